"""How fast can an optimizer step that streams its state be on this disk?

OffloadedOptimizer.step() reads each piece's state shortly before its update
and writes it back right after, with at most prefetch + 2 pieces in memory, so
reads and writes share the disk at a shallow depth. This measures that I/O
pattern with no update at all: pieces of ``--piece`` float32 elements (two
state tensors each, as AdamW's exp_avg and exp_avg_sq), ``--pieces`` of them,
reads issued ``ahead`` pieces before use and writes waited ``behind`` pieces
later, for several depths, interleaved, medians. The step's I/O cannot finish
faster than the figure at its own depth (ahead = prefetch, behind = 2).

    python benchmarks/state_io_floor.py DIR [--piece 225280] [--pieces 121] [--repeats 5]

The defaults mirror examples/zero_offload_train.py's optimizer: its 27.3M
parameters move as 121 pieces (chunks of up to 275,456 elements and bundles of
small parameters), 208 MiB of AdamW state, here as 121 equal pieces.
"""
import argparse
import json
import statistics
import sys
import time

import torch

from offload import Offloader


def stream(off, pieces, ahead, behind) -> float:
    """Seconds to read and write back every piece, ``ahead``/``behind`` deep."""
    reads, writes = {}, {}
    started = time.perf_counter()
    for j in range(min(ahead, len(pieces))):
        reads[j] = off.async_readv(pieces[j])
    for i, piece in enumerate(pieces):
        if i >= behind:
            writes[i - behind].wait()
        if i + ahead < len(pieces):
            reads[i + ahead] = off.async_readv(pieces[i + ahead])
        if i not in reads:
            reads[i] = off.async_readv(piece)
        reads[i].wait()
        writes[i] = off.async_writev(piece)
    for handle in writes.values():
        handle.wait()
    return time.perf_counter() - started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--piece", type=int, default=225280, help="float32 elements per state tensor")
    parser.add_argument("--pieces", type=int, default=121)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--depths", default="2:2,4:4,8:8,16:16", help="ahead:behind pairs")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    depths = [tuple(int(v) for v in pair.split(":")) for pair in args.depths.split(",")]
    nbytes = 2 * 2 * args.piece * 4 * args.pieces  # two tensors a piece, read and written
    rates = {depth: [] for depth in depths}
    with Offloader(args.directory) as off:
        pieces = [[torch.randn(args.piece), torch.randn(args.piece)] for _ in range(args.pieces)]
        expected = [t.clone() for t in pieces[0] + pieces[-1]]
        off.sync_writev([t for piece in pieces for t in piece])
        stream(off, pieces, 2, 2)  # warm-up: the file's extents and the pool's buffers
        for _ in range(args.repeats):
            for depth in depths:
                rates[depth].append(nbytes / stream(off, pieces, *depth) / 1e9)
        backend, direct = off.backend, off.direct
        off.sync_readv(pieces[0] + pieces[-1])
        intact = all(torch.equal(a, b) for a, b in zip(pieces[0] + pieces[-1], expected))
    print(f"{args.pieces} pieces x 2 x {args.piece} float32 ({nbytes / 2 / 2**20:.0f} MiB read and written), "
          f"{backend}, O_DIRECT {direct}; read + write GB/s, median (min-max) of {args.repeats} interleaved")
    for (ahead, behind), values in rates.items():
        print(f"  {ahead:3} ahead, {behind:3} behind: {statistics.median(values):.2f} "
              f"({min(values):.2f}-{max(values):.2f}) GB/s = "
              f"{nbytes / statistics.median(values) / 1e9:.3f} s per step")
    print(f"data intact after {1 + args.repeats * len(depths)} round trips: {intact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": backend, "direct": direct, "bytes_per_step": nbytes, "data_intact": intact,
                       "round_trips": 1 + args.repeats * len(depths),
                       "depths": [{"ahead": a, "behind": b, "gbps": values} for (a, b), values in rates.items()]},
                      f, indent=2)
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
