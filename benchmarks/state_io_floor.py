"""How fast can an optimizer step that streams its state be on this disk?

OffloadedOptimizer.step() reads each piece's state shortly before its update
and writes it back right after, with at most prefetch + write_depth pieces in memory, so
reads and writes share the disk at a shallow depth. This measures that I/O
pattern with no update at all: pieces of ``--piece`` float32 elements (two
state tensors each, as AdamW's exp_avg and exp_avg_sq), ``--pieces`` of them,
reads issued ``ahead`` pieces before use and writes waited ``behind`` pieces
later, for several depths, interleaved, medians. The step's I/O cannot finish
faster than the figure at its own depth (ahead = prefetch, behind = write_depth).

``--update`` adds the update: each piece is also a parameter with a gradient
and its own torch.optim.AdamW, stepped between the piece's read and its write
(no backups, no bookkeeping: the least an optimizer streaming its state can
do). Each round then also times the updates alone (state in memory), the
state read and written whole (what examples/zero_offload_train.py calls the
I/O alone), and two OffloadedOptimizers (atomic, and atomic=False) stepping
the same number of pieces of the same size, and reports each pass against
max(update alone, I/O) of its round: how much this machine can hide, and
what OffloadedOptimizer adds (its prefetch is the depth's ``ahead``, its
write_depth the depth's ``behind``).

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


def adamw_on(param, grad, exp_avg, exp_avg_sq):
    """An AdamW over ``param`` whose state is these two tensors (updated in place)."""
    param.grad = grad
    opt = torch.optim.AdamW([param], lr=1e-3)
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return opt


def params_with_grads(count, size, seed):
    """``count`` parameters of ``size`` elements with gradients, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(count):
        param = torch.randn(size, generator=g)
        param.grad = torch.randn(size, generator=g)
        params.append(param)
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
    together = {depth: [] for depth in depths}  # per round: the seconds of each pass (--update)
    with Offloader(args.directory) as off:
        pieces = [[torch.randn(args.piece), torch.randn(args.piece).abs()] for _ in range(args.pieces)]
        expected = [t.clone() for t in pieces[0] + pieces[-1]]
        updates = None
        if args.update:
            params = params_with_grads(args.pieces, args.piece, seed=0)
            starts = [(p.clone(), p.grad.clone()) for p in (params[0], params[-1])]
            updates = [adamw_on(p, p.grad, *piece) for p, piece in zip(params, pieces)]
            # The same update through OffloadedOptimizer, one piece per parameter.
            offloaded = [OffloadedOptimizer(torch.optim.AdamW(params_with_grads(args.pieces, args.piece, seed=1),
                                                              lr=1e-3),
                                            off, chunk_size=args.piece, atomic=atomic) for atomic in (True, False)]
            for opt in offloaded:
                opt.step()  # its state is made by the first step
        off.sync_writev([t for piece in pieces for t in piece])
        stream(off, pieces, 2, 2)  # warm-up: the file's extents and the pool's buffers
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
                passes = {"io_alone_s": io_alone, "update_alone_s": update_alone,
                          "whole_io_s": read + time.perf_counter() - started,
                          "pipelined_s": stream(off, pieces, *depth, updates)}
                for opt, name in zip(offloaded, ("offloaded_step_s", "offloaded_step_not_atomic_s")):
                    opt.prefetch, opt.write_depth = depth
                    started = time.perf_counter()
                    opt.step()
                    passes[name] = time.perf_counter() - started
                together[depth].append(passes)
        backend, direct = off.backend, off.direct
        off.sync_readv(pieces[0] + pieces[-1])
        got, params_equal = pieces[0] + pieces[-1], True
        if updates is not None:  # the same steps in memory, from the same start, must give the same bits
            rounds = args.repeats * len(depths)
            replay = [adamw_on(p, g, *expected[2 * i:2 * i + 2]) for i, (p, g) in enumerate(starts)]
            for _ in range(2 * rounds):  # each round steps them alone, then pipelined
                for opt in replay:
                    opt.step()
            params_equal = all(torch.equal(mine.param_groups[0]["params"][0], theirs.param_groups[0]["params"][0])
                               for mine, theirs in zip((updates[0], updates[-1]), replay))
            in_memory = params_with_grads(args.pieces, args.piece, seed=1)
            plain = torch.optim.AdamW(in_memory, lr=1e-3)
            for _ in range(1 + rounds):  # the first step, then one a round
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
            def median(name):
                return statistics.median(r[name] for r in rounds)

            def ratios(name, floor):
                values = [r[name] / max(r["update_alone_s"], r[floor]) for r in rounds]
                return (f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}) "
                        f"max(update, {'this I/O alone' if floor == 'io_alone_s' else 'whole'})")

            def against_floors(name):
                return f"{median(name):.3f} s = {ratios(name, 'io_alone_s')}, {ratios(name, 'whole_io_s')}"
            print(f"      update alone {median('update_alone_s'):.3f} s, the state read and "
                  f"written whole {median('whole_io_s'):.3f} s")
            print(f"      pipelined with the update: {against_floors('pipelined_s')}")
            for name, kind in (("offloaded_step_s", "atomic"), ("offloaded_step_not_atomic_s", "atomic=False")):
                print(f"      OffloadedOptimizer.step(), prefetch {ahead}, write_depth {behind}, {kind}: "
                      f"{against_floors(name)}")
    round_trips = 1 + args.repeats * len(depths) * (5 if updates is not None else 1)
    what = "state after the same AdamW steps in memory" if updates is not None else "data"
    print(f"{what} bit-identical after {round_trips} round trips: {intact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": backend, "direct": direct, "bytes_per_step": nbytes, "data_intact": intact,
                       "round_trips": round_trips, "update": args.update,
                       "depths": [{"ahead": a, "behind": b, "gbps": values,
                                   "with_update": together[(a, b)]}
                                  for (a, b), values in rates.items()]},
                      f, indent=2)
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
