"""Do io_uring fixed (registered) buffers pay on the CPU path? Reads and writes
of one 256 MiB page-aligned region through the uring engine, registered and not,
interleaved, at two request sizes. The ratio tells whether to register.

    python benchmarks/registered_buffers.py DIR [--repeats 5]
"""
import argparse
import os
import statistics
import time

from offload import _core
from offload._engines import pairs

MIB = 1 << 20
REGION = 256 * MIB


def transfer(engine, kind, fd, buffer, request_bytes, fixed):
    region = (buffer.address, REGION) if fixed else (0, 0)
    batch = _core.Requests()
    add = batch.write if kind == _core.KIND_WRITE else batch.read
    for i, off in enumerate(range(0, REGION, request_bytes)):
        add(i, fd, buffer.address + off, request_bytes, off, region=region[0], region_length=region[1])
    start = time.perf_counter()
    engine.submit(batch)
    while engine.pending:
        engine.wait(1000)
        for tag, result in pairs(engine.reap()):
            assert result == request_bytes, (tag, result)
    return REGION / (time.perf_counter() - start) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    fd = os.open(args.directory, os.O_TMPFILE | os.O_RDWR | os.O_DIRECT, 0o600)
    buffer = _core.BufferPool(0).acquire(REGION)
    memoryview(buffer)[:] = os.urandom(MIB) * (REGION // MIB)
    print(f"RLIMIT_MEMLOCK: {open('/proc/self/limits').read().split('Max locked memory')[1].split()[0:2]}")
    for request in (4 * MIB, 64 * 1024):
        plain = _core.make_uring_engine(128, request, 128, 128 * MIB)
        fixed = _core.make_uring_engine(128, request, 128, 128 * MIB)
        transfer(plain, _core.KIND_WRITE, fd, buffer, request, False)  # lay the file out
        transfer(fixed, _core.KIND_WRITE, fd, buffer, request, True)   # registers the region
        registered, error = fixed.fixed_buffers
        if not registered:
            print(f"registration refused (errno {-error}); nothing to compare")
            return 1
        rates = {(name, kind): [] for name in ("plain", "fixed") for kind in ("write", "read")}
        for _ in range(args.repeats):
            for name, engine in (("plain", plain), ("fixed", fixed)):
                is_fixed = name == "fixed"
                rates[(name, "write")].append(transfer(engine, _core.KIND_WRITE, fd, buffer, request, is_fixed))
                rates[(name, "read")].append(transfer(engine, _core.KIND_READ, fd, buffer, request, is_fixed))
        for kind in ("write", "read"):
            p, f = (statistics.median(rates[(n, kind)]) for n in ("plain", "fixed"))
            print(f"{request // 1024:>5} KiB {kind:5}: plain {p:5.2f} GB/s, fixed {f:5.2f} GB/s, "
                  f"fixed/plain {f / p:.3f}")
        plain.close()
        fixed.close()
    os.close(fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
