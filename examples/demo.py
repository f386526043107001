"""Offload 1 GiB of real tensors through the real engine and back, save and load
them as a checkpoint, and say how fast.

    python examples/demo.py [DIR] [--tensors 16] [--json FILE]      (make demo)

--tensors: how many 64 MiB tensors (16: 1 GiB).
"""
import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import offload
from offload import Offloader

GIB = 1 << 30


def memcpy_gbps(nbytes=256 << 20, repeats=5):
    """Plain memcpy into touched memory, the reference for memory speed."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1), dst.fill_(0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main(directory, json_path=None, count=16):
    tensors = [torch.randn(16 << 20) for _ in range(count)]         # count x 64 MiB
    expected = [t.clone() for t in tensors]
    total = sum(t.numel() * t.element_size() for t in tensors)
    with Offloader(directory) as off:
        print(f"offload: {off.backend} engine, O_DIRECT {'on' if off.direct else 'off'}, "
              f"backing file in {directory}")
        print(f"moving {len(tensors)} tensors of 64 MiB ({total / GIB:.1f} GiB) to disk and back\n")
        write_rates, read_rates = [], []
        for round_ in range(3):
            start = time.perf_counter()
            written = []
            for i, t in enumerate(tensors):
                off.async_write(t, callback=lambda i=i: written.append(i))   # fire and forget
            off.synchronize()
            w = time.perf_counter() - start
            assert sorted(written) == list(range(len(tensors)))
            assert all(t.untyped_storage().nbytes() == 0 for t in tensors)   # memory released
            start = time.perf_counter()
            off.sync_readv(tensors)
            r = time.perf_counter() - start
            write_rates.append(total / w / 1e9)
            read_rates.append(total / r / 1e9)
            print(f"  round {round_ + 1}: write {write_rates[-1]:5.2f} GB/s   read {read_rates[-1]:5.2f} GB/s")
        identical = all(torch.equal(a, b) for a, b in zip(tensors, expected))
        if read_rates[0] < 0.5 * min(read_rates[1:]) or write_rates[0] < 0.5 * min(write_rates[1:]):
            print("  (round 1 staged its writes through, and read into, memory this process had never\n"
                  "   touched; later rounds reuse it from the buffer pool. `python -m offload doctor` says\n"
                  "   what new memory costs here, and Offloader.warm() pays for it before the I/O.)")

        async def training_step():
            """await inside an event loop: read, compute, write back."""
            w = tensors[0]
            off.sync_write(w)
            await off.read(w)
            w.mul_(2)
            await off.write(w)
            await off.read(w)
            return torch.equal(w, expected[0] * 2)

        awaited = asyncio.run(training_step())
    print(f"\nmedian of 3: write {statistics.median(write_rates):.2f} GB/s, "
          f"read {statistics.median(read_rates):.2f} GB/s "
          f"(memcpy on this machine: {memcpy_gbps():.1f} GB/s; for the disk's limit run `make bench`)")
    print(f"bit-identical after 3 round trips: {'yes' if identical else 'NO'}; "
          f"asyncio read/compute/write: {'ok' if awaited else 'WRONG'}")

    # The same tensors as a checkpoint: an atomic, fsynced safetensors file, and back.
    state = {f"layer{i}.weight": t for i, t in enumerate(tensors)}
    path = os.path.join(directory, "offload-demo.safetensors")
    start = time.perf_counter()
    offload.save(state, path, {"demo": "yes"})
    saved = time.perf_counter() - start
    start = time.perf_counter()
    loaded = offload.load(path)
    load_time = time.perf_counter() - start
    restored = all(torch.equal(loaded[name], t) for name, t in state.items())
    os.unlink(path)
    print(f"checkpoint: offload.save {total / saved / 1e9:.2f} GB/s (durable), offload.load "
          f"{total / load_time / 1e9:.2f} GB/s; bit-identical: {'yes' if restored else 'NO'}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"bytes": total, "write_gbps": write_rates, "read_gbps": read_rates,
                       "bit_identical": identical, "asyncio_round_trip_exact": awaited,
                       "checkpoint_save_gbps": total / saved / 1e9, "checkpoint_load_gbps": total / load_time / 1e9,
                       "checkpoint_bit_identical": restored}, f, indent=2)
    return 0 if identical and awaited and restored else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--tensors", type=int, default=16, help="how many 64 MiB tensors")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    sys.exit(main(args.dir, args.json, args.tensors))
