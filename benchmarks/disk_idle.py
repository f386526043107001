"""Where the disk waits while a fresh process writes and reads its first
tensors, and in the cycle after.

Makes ``--total-mib`` of new CPU tensors of ``--tensor-mib`` each, then twice
writes them all (``async_write`` each, then ``synchronize``), drops the page
cache and reads them back (``async_read`` each, ``synchronize``), checking
the bytes. The block layer's request events (tracefs, root) give, for each
phase, the time the disk had no request in flight (its share, the number of
gaps, the largest) and the completion bursts. The first cycle is what a new
user's script meets; the second is the same process with its memory warm.
The script is the fresh process: run it once per measurement.

    python benchmarks/disk_idle.py DIR [--total-mib 1024] [--tensor-mib 64] [--json FILE]
"""
import argparse
import json
import os
import sys
import time

import torch

from offload import Offloader
from offload.benchmark import (MIB, block_trace, disk_activity, drop_page_cache, make_tensors,
                              whole_tensors)


def phase(name, total, fn, cycle):
    """Runs ``fn``, one phase moving ``total`` bytes: its time and rate, and
    when it ran (on time.monotonic, the trace's clock)."""
    started = time.monotonic()
    fn()
    ended = time.monotonic()
    return {"phase": name, "cycle": cycle, "seconds": ended - started, "gbps": total / (ended - started) / 1e9,
            "start": started, "end": ended}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.dir)
    size = args.tensor_mib * MIB
    total = whole_tensors(parser, args.total_mib, size)
    tensors = make_tensors(total // size, size)
    expected = [t.clone() for t in tensors]
    rows, events = [], []
    with block_trace(directory, events) as tracing, Offloader(directory) as off:
        for cycle in (1, 2):
            drop_page_cache()
            rows.append(phase("write", total, lambda: ([off.async_write(t) for t in tensors], off.synchronize()),
                              cycle))
            drop_page_cache()
            rows.append(phase("read", total, lambda: ([off.async_read(t) for t in tensors], off.synchronize()),
                              cycle))
            if not all(torch.equal(a, b) for a, b in zip(tensors, expected)):
                raise AssertionError("offload returned different bytes")
    for row in rows:
        start, end = row.pop("start"), row.pop("end")
        if tracing:
            row.update(disk_activity(events, start, end)[1])
    print(f"{len(tensors)} tensors of {args.tensor_mib} MiB, {args.total_mib} MiB in all; "
          f"page cache dropped before each phase: {os.geteuid() == 0}")
    for row in rows:
        line = f"cycle {row['cycle']} {row['phase']:5s}: {row['gbps']:.2f} GB/s"
        if "idle_seconds" in row:
            idle_share = 100 * row['idle_seconds'] / row['seconds']
            line += (f"; disk idle {1e3 * row['idle_seconds']:.0f} ms ({idle_share:.0f}%)"
                     f" in {row['idle_gaps']} gaps, the largest {1e3 * row['largest_gap_seconds']:.1f} ms; "
                     f"{row['bursts']} completion bursts of {row['requests_per_burst']:.1f} requests, "
                     f"{row['bursts_emptying']} leaving the disk empty")
        print(line)
    if not tracing:
        print("disk idle: not traced (needs root: tracefs, mounted for the run where it is not)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensor_bytes": size, "total_bytes": total, "traced": tracing, "phases": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
