"""How fast can an optimizer step that streams its state be on this disk?

OffloadedOptimizer.step() reads each piece's state shortly before its update
and writes it back right after, with at most prefetch + 2 pieces in memory, so
reads and writes share the disk at a shallow depth. This measures that I/O
pattern with no update at all: pieces of ``--piece`` float32 elements (two
state tensors each, as AdamW's exp_avg and exp_avg_sq), ``--pieces`` of them,
reads issued ``ahead`` pieces before use and writes waited ``behind`` pieces
later, for several depths, interleaved, medians. The step's I/O cannot finish
faster than the figure at its own depth (ahead = prefetch, behind = 2).

``--update`` adds the update: each piece is also a parameter with a gradient
and its own torch.optim.AdamW, stepped between the piece's read and its write
(no backups, no bookkeeping: the least an optimizer streaming its state can
do). Each round then also times the updates alone (state in memory), the
state read and written whole (what examples/zero_offload_train.py calls the
I/O alone), and two OffloadedOptimizers (atomic, and atomic=False) stepping
the same number of pieces of the same size, and reports each pass against
max(update alone, I/O) of its round: how much this machine can hide, and
what OffloadedOptimizer adds (its prefetch is the depth's ``ahead``; its
writes are waited 2 pieces behind).

    python benchmarks/state_io_floor.py DIR [--piece 225280] [--pieces 121] [--repeats 5] [--update]

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
from offload.optim import OffloadedOptimizer


def stream(off, pieces, ahead, behind, updates=None) -> float:
    """Seconds to read and write back every piece, ``ahead``/``behind`` deep,
    stepping ``updates[i]`` (an optimizer) between piece i's read and write."""
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
        if updates is not None:
            updates[i].step()
        writes[i] = off.async_writev(piece)
    for handle in writes.values():
        handle.wait()
    return time.perf_counter() - started


def adamw_pieces(pieces, seed=0):
    """One parameter (with a gradient) and one AdamW per piece, whose state
    tensors are the piece's two tensors."""
    g = torch.Generator().manual_seed(seed)
    updates = []
    for piece in pieces:
        param = torch.randn(piece[0].numel(), generator=g)
        param.grad = torch.randn(piece[0].numel(), generator=g)
        opt = torch.optim.AdamW([param], lr=1e-3)
        opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": piece[0], "exp_avg_sq": piece[1]}
        updates.append(opt)
    return updates


def offloaded_params(args):
    """``--pieces`` parameters of ``--piece`` elements with gradients, the same each call."""
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(args.piece, generator=g) for _ in range(args.pieces)]
    for p in params:
        p.grad = torch.randn(args.piece, generator=g)
    return params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--piece", type=int, default=225280, help="float32 elements per state tensor")
    parser.add_argument("--pieces", type=int, default=121)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--depths", default="2:2,4:4,8:8,16:16", help="ahead:behind pairs")
    parser.add_argument("--update", action="store_true", help="step an AdamW per piece between read and write")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    depths = [tuple(int(v) for v in pair.split(":")) for pair in args.depths.split(",")]
    nbytes = 2 * 2 * args.piece * 4 * args.pieces  # two tensors a piece, read and written
    rates = {depth: [] for depth in depths}
    together = {depth: [] for depth in depths}  # (pipelined s, update alone s, I/O alone s) per round
    with Offloader(args.directory) as off:
        pieces = [[torch.randn(args.piece), torch.randn(args.piece).abs()] for _ in range(args.pieces)]
        expected = [t.clone() for t in pieces[0] + pieces[-1]]
        updates = adamw_pieces(pieces) if args.update else None
        if updates is not None:  # the same update through OffloadedOptimizer, one piece per parameter
            offloaded = [OffloadedOptimizer(torch.optim.AdamW(offloaded_params(args), lr=1e-3), off,
                                            chunk_size=args.piece, atomic=atomic) for atomic in (True, False)]
            for opt in offloaded:
                opt.step()  # its state is made by the first step
        off.sync_writev([t for piece in pieces for t in piece])
        stream(off, pieces, 2, 2)  # warm-up: the file's extents and the pool's buffers
        steps = 0
        for _ in range(args.repeats):
            for depth in depths:
                io_alone = stream(off, pieces, *depth)
                rates[depth].append(nbytes / io_alone / 1e9)
                if updates is None:
                    continue
                state = [t for piece in pieces for t in piece]
                started = time.perf_counter()
                off.sync_readv(state)
                read = time.perf_counter() - started
                started = time.perf_counter()
                for opt in updates:
                    opt.step()
                update_alone = time.perf_counter() - started
                started = time.perf_counter()
                off.sync_writev(state)
                bulk = read + time.perf_counter() - started
                pipelined = stream(off, pieces, *depth, updates)
                steps_taken = []
                for opt in offloaded:
                    opt.prefetch = depth[0]
                    started = time.perf_counter()
                    opt.step()
                    steps_taken.append(time.perf_counter() - started)
                together[depth].append((pipelined, update_alone, io_alone, bulk, *steps_taken))
                steps += 2
        backend, direct = off.backend, off.direct
        off.sync_readv(pieces[0] + pieces[-1])
        got, params_equal = pieces[0] + pieces[-1], True
        if updates is not None:  # the same steps in memory, from the same start, must give the same bits
            replay = adamw_pieces([[torch.empty(args.piece), torch.empty(args.piece)] for _ in pieces])
            chosen = (replay[0], replay[-1])
            for opt, (avg, sq) in zip(chosen, (expected[:2], expected[2:])):
                opt.state[opt.param_groups[0]["params"][0]] = {"step": torch.tensor(0.0), "exp_avg": avg.clone(),
                                                               "exp_avg_sq": sq.clone()}
            for _ in range(steps):
                for opt in chosen:
                    opt.step()
            expected = [t for opt in chosen for t in list(opt.state.values())[0].values() if t.dim()]
            params_equal = all(torch.equal(mine.param_groups[0]["params"][0], theirs.param_groups[0]["params"][0])
                               for mine, theirs in zip((updates[0], updates[-1]), chosen))
            in_memory = offloaded_params(args)
            plain = torch.optim.AdamW(in_memory, lr=1e-3)
            for _ in range(1 + steps // 2):
                plain.step()
            params_equal &= all(torch.equal(a, b) for opt in offloaded
                                for a, b in zip(opt.param_groups[0]["params"], in_memory))
        intact = params_equal and all(torch.equal(a, b) for a, b in zip(got, expected))
    print(f"{args.pieces} pieces x 2 x {args.piece} float32 ({nbytes / 2 / 2**20:.0f} MiB read and written), "
          f"{backend}, O_DIRECT {direct}; read + write GB/s, median (min-max) of {args.repeats} interleaved")
    for (ahead, behind), values in rates.items():
        print(f"  {ahead:3} ahead, {behind:3} behind: {statistics.median(values):.2f} "
              f"({min(values):.2f}-{max(values):.2f}) GB/s = "
              f"{nbytes / statistics.median(values) / 1e9:.3f} s per step")
        rounds = together[(ahead, behind)]
        if rounds:
            def ratios(i, floor):
                values = [r[i] / max(r[1], r[floor]) for r in rounds]
                return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"
            print(f"      update alone {statistics.median(r[1] for r in rounds):.3f} s, the state read and "
                  f"written whole {statistics.median(r[3] for r in rounds):.3f} s")
            print(f"      pipelined with the update: {statistics.median(r[0] for r in rounds):.3f} s = "
                  f"{ratios(0, 2)} max(update, this I/O alone), {ratios(0, 3)} max(update, whole)")
            for i, kind in ((4, "atomic"), (5, "atomic=False")):
                print(f"      OffloadedOptimizer.step(), prefetch {ahead}, {kind}: "
                      f"{statistics.median(r[i] for r in rounds):.3f} s = {ratios(i, 2)} max(update, this I/O "
                      f"alone), {ratios(i, 3)} max(update, whole)")
    round_trips = 1 + args.repeats * len(depths) * (5 if updates is not None else 1)
    what = "state after the same AdamW steps in memory" if updates is not None else "data"
    print(f"{what} bit-identical after {round_trips} round trips: {intact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": backend, "direct": direct, "bytes_per_step": nbytes, "data_intact": intact,
                       "round_trips": round_trips, "update": args.update,
                       "depths": [{"ahead": a, "behind": b, "gbps": values,
                                   "with_update": [dict(zip(("pipelined_s", "update_alone_s", "io_alone_s",
                                                             "whole_io_s", "offloaded_step_s",
                                                             "offloaded_step_not_atomic_s"), r))
                                                   for r in together[(a, b)]]}
                                  for (a, b), values in rates.items()]},
                      f, indent=2)
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
