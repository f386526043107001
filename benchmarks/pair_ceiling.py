"""The least Python a 4 KiB async_write+async_read pair can cost on offload's
own engine and buffer pool: the engine calls and the two storage swaps a
pair needs (release the tensor's memory on write, attach a pool buffer on
read), and nothing else - no records, handles, checks or callbacks. It is a
ceiling for any Offloader whose per-tensor work is in Python: issue 3's pair
rate cannot pass it without moving that work into C++.

    python benchmarks/pair_ceiling.py DIR [--pairs 20000] [--repeats 3]

Page-cache file (no O_DIRECT), as the harness's pair rate. The bytes read
back are checked.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from offload import _core  # noqa: E402
from offload._engines import pairs  # noqa: E402
from offload._tensors import TensorLayout, attach_buffer, detach_storage  # noqa: E402
from offload import buffer_pool  # noqa: E402

BLOCK = 4096


def one_round(engine, fd, tensors, layout, pool) -> float:
    """Pairs/s: write each tensor (its memory released), read it back once written.
    Even tags are writes, odd tags the read of the same tensor."""
    keep = {}

    def complete(reaped):
        for tag, result in pairs(reaped):
            if result < 0:
                raise OSError(-result, os.strerror(-result))
            if tag & 1:
                attach_buffer(tensors[tag // 2], keep.pop(tag), layout)
            else:
                del keep[tag]
                engine.submit_read(tag + 1, fd, keep[tag + 1].address, BLOCK, (tag // 2) * BLOCK)

    started = time.perf_counter()
    for i, t in enumerate(tensors):
        storage = t.untyped_storage()
        keep[2 * i] = storage
        engine.submit_write(2 * i, fd, storage.data_ptr(), BLOCK, i * BLOCK)
        detach_storage(t, layout)
        keep[2 * i + 1] = pool.acquire(BLOCK)
        complete(engine.reap())
    while keep:
        engine.wait(10)
        complete(engine.reap())
    return len(tensors) / (time.perf_counter() - started)


def file_holds(engine, fd, count, pool) -> bool:
    """Reads every block back into buffers filled with 0xFF first (a read that
    did nothing cannot pass) and checks block i holds i % 251."""
    buffers = [pool.acquire(BLOCK) for _ in range(count)]
    for i, buffer in enumerate(buffers):
        torch.frombuffer(buffer, dtype=torch.uint8, count=BLOCK).fill_(255)
        engine.submit_read(i, fd, buffer.address, BLOCK, i * BLOCK)
    landed = 0
    while landed < count:
        engine.wait(10)
        for _, result in pairs(engine.reap()):
            if result != BLOCK:
                return False
            landed += 1
    return all(bool((torch.frombuffer(b, dtype=torch.uint8, count=BLOCK) == i % 251).all())
               for i, b in enumerate(buffers))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    pool = buffer_pool()
    engines = {"threads": lambda: _core.make_thread_engine(8, 4 << 20, 128)}
    if _core.HAVE_URING:
        engines["uring"] = lambda: _core.make_uring_engine(128, 4 << 20, 128)
    path = os.path.join(args.directory, "pair-ceiling.bin")
    report = {}
    for name, make in engines.items():
        engine = make()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            tensors = [torch.full((BLOCK,), i % 251, dtype=torch.uint8) for i in range(args.pairs)]
            layout = TensorLayout(tensors[0])
            for t in tensors:  # pool-backed, as tensors are after a read: written in place
                buffer = pool.acquire(BLOCK)
                value = int(t[0])
                attach_buffer(t, buffer, layout)
                t.fill_(value)
            rates = [one_round(engine, fd, tensors, layout, pool) for _ in range(args.repeats + 1)][1:]
            intact = file_holds(engine, fd, args.pairs, pool) and all(
                t.untyped_storage().nbytes() == BLOCK and bool((t == i % 251).all()) for i, t in enumerate(tensors))
        finally:
            engine.close()
            os.close(fd)
            os.unlink(path)
        print(f"{name:8} {statistics.median(rates):10.0f} pairs/s median ({min(rates):.0f}-{max(rates):.0f}) "
              f"of {args.repeats} rounds after a warm-up; data intact: {intact}")
        report[name] = {"pairs_per_second": rates, "data_intact": intact}
        if not intact:
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(row["data_intact"] for row in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
