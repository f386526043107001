"""The optimizer example's model on several ranks with torch's ZeroRedundancyOptimizer.

Each rank (gloo, CPU, its own process) trains two DDP copies of the model in
``examples/zero_offload_train.py`` from one seed, interleaved step by step:
ZeRO sharding plain AdamW, and ZeRO sharding AdamW in an OffloadedOptimizer
on the rank's own directory. After every step each rank also reads and
writes back its shard's state alone, all ranks at once (they share the
disk), so each step has its floor, max(the plain ZeRO step, that I/O), from
its own round. Rank 0 prints each rank's medians and checks that both copies
ended bit-identical on every rank.

    python benchmarks/zero_ranks.py DIR [--ranks 2] [--steps 8] [--write-behind] [--read-ahead] [--json FILE]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from zero_offload_train import (add_workload_arguments, adamw_options, build, chunk_size,  # noqa: E402
                                train_step, unit_sizes)

from offload import Offloader  # noqa: E402
from offload.optim import offloaded  # noqa: E402


def rank_main(rank, world, port, args):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")

    plain_model, offl_model = build(args), build(args)
    chunk = chunk_size(args, list(plain_model.parameters()))
    plain, offl = DistributedDataParallel(plain_model), DistributedDataParallel(offl_model)
    directory = os.path.join(args.dir, f"rank{rank}")
    os.makedirs(directory, exist_ok=True)
    with Offloader(directory) as off:
        options = adamw_options(args)
        plain_opt = ZeroRedundancyOptimizer(plain.parameters(), optimizer_class=torch.optim.AdamW, **options)
        opt = ZeroRedundancyOptimizer(offl.parameters(), optimizer_class=offloaded(
            torch.optim.AdamW, off, args.prefetch, chunk_size=chunk, write_behind=args.write_behind,
            read_ahead=args.read_ahead, write_depth=args.write_depth), **options)
        local = opt.optim  # this rank's OffloadedOptimizer
        shard = [p for group in local.param_groups for p in group["params"]]
        state = [torch.zeros(n) for n in unit_sizes(shard, local.chunk_size) for _ in ("exp_avg", "exp_avg_sq")]
        off.sync_writev(state)
        rounds = []
        for step in range(args.steps):
            batch = step * world + rank  # each rank its own data, as DDP trains
            total, _ = train_step(offl, opt, batch, args.batch, args.seq, args.vocab)
            stats = local.stats
            plain_total, plain_step = train_step(plain, plain_opt, batch, args.batch, args.seq, args.vocab)
            started = time.perf_counter()
            local.synchronize()  # I/O a step left running: what is still due is charged to it
            off.synchronize()
            due = time.perf_counter() - started
            dist.barrier()
            started = time.perf_counter()
            off.sync_readv(state)
            off.sync_writev(state)
            alone = time.perf_counter() - started
            dist.barrier()
            rounds.append({"step": total + due, "plain": plain_total, "opt_step": stats.seconds + due,
                           "plain_opt_step": plain_step, "io_wait": stats.io_wait_seconds + due,
                           "io_alone": alone})
        exact = all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), offl_model.parameters()))
        measured = rounds[1:]

        def median(key):
            return statistics.median(r[key] for r in measured)

        figures = {
            "rank": rank, "threads": torch.get_num_threads(), "shard_parameters": sum(p.numel() for p in shard),
            "shard_state_bytes": sum(4 * t.numel() for t in state), "pieces": len(local._work()),
            "step_seconds_plain": median("plain"), "step_seconds_offloaded": median("step"),
            "step_time_ratio": statistics.median(r["step"] / r["plain"] for r in measured),
            "optimizer_step_seconds": median("opt_step"), "optimizer_step_seconds_plain": median("plain_opt_step"),
            "io_wait_seconds": median("io_wait"), "io_alone_seconds": median("io_alone"),
            "step_over_floor": statistics.median(r["opt_step"] / max(r["io_alone"], r["plain_opt_step"])
                                                 for r in measured),
            "bit_identical": exact,
        }
    with open(rank_file(args.dir, rank), "w") as f:  # not all_gather_object: see main()
        json.dump(figures, f)
    dist.barrier()
    dist.destroy_process_group()


def rank_file(directory, rank) -> str:
    return os.path.join(directory, f"zero-ranks-{rank}.json")


def report(ranks, args):
    print(f"{len(ranks)} ranks, ZeroRedundancyOptimizer over gloo, torch threads per rank: {ranks[0]['threads']}; "
          f"AdamW {'fused' if args.fused else 'not fused'}; write-behind {args.write_behind}, "
          f"read-ahead {args.read_ahead}; medians of {args.steps - 1} steps")
    for r in ranks:
        print(f"rank {r['rank']}: shard {r['shard_parameters'] / 1e6:.1f}M parameters, "
              f"{r['shard_state_bytes'] / 2**20:.0f} MiB of state in {r['pieces']} pieces; step plain "
              f"{r['step_seconds_plain']:.3f} s, offloaded {r['step_seconds_offloaded']:.3f} s = "
              f"{r['step_time_ratio']:.3f}x; optimizer step plain {r['optimizer_step_seconds_plain']:.3f} s, "
              f"offloaded {r['optimizer_step_seconds']:.3f} s (waiting on I/O {r['io_wait_seconds']:.3f} s), "
              f"the shard's I/O alone {r['io_alone_seconds']:.3f} s: {r['step_over_floor']:.2f}x its floor; "
              f"bit-identical {r['bit_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": ranks, "fused": args.fused, "write_behind": args.write_behind,
                       "read_ahead": args.read_ahead}, f, indent=2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--ranks", type=int, default=2)
    add_workload_arguments(parser)
    args = parser.parse_args(argv)
    adamw_options(args)  # settles args.fused (this torch may have no fused CPU kernel) for the ranks and the report
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each rank writes its figures to a file and this process reads them:
    # torch 2.1's gloo could deadlock destroying a process group whose worker
    # thread still held the Python tensors of an all_gather_object (seen here).
    mp.spawn(rank_main, args=(args.ranks, port, args), nprocs=args.ranks)
    ranks = []
    for rank in range(args.ranks):
        with open(rank_file(args.dir, rank)) as f:
            ranks.append(json.load(f))
        os.unlink(rank_file(args.dir, rank))
    report(ranks, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
