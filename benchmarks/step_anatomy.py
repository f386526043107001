"""Where an offloaded optimizer step's time goes, and how busy it keeps the disk.

Steps examples/zero_offload_train.py's model (same sizes and chunks) with
OffloadedOptimizer over random gradients (no forward or backward pass: the
step alone), and splits each step's wall time into the updates (the wrapped
optimizer's kernels, with the backups and bookkeeping around them), the waits
for reads and the waits for writes. Beside each step it moves the same state
with nothing to hide behind (read whole, then written whole: the example's
"I/O alone"). For both it reads the disk's own counters
(/sys/dev/block/M:m/stat): how many milliseconds the disk had I/O in flight
(busy), and the mean number of requests in flight while busy (depth).

A step whose updates and waits add up to its time, with the disk busy for
most of it, is I/O-bound: cutting compute would not shorten it; only moving
the state faster at the step's depth would.

Where the disk sits idle within a step, and what the calling thread was doing
meanwhile (updating, waiting on a read, on a write, or in between), comes from
the block layer's own request events (tracefs ``block_rq_issue`` and
``block_rq_complete`` on the device, in a tracing instance of this script's
own, on the monotonic clock the stages are timed on). That needs root and
tracefs; elsewhere the script says so and reports the rest.

    python benchmarks/step_anatomy.py DIR [--steps 6] [--prefetch 2] [--write-depth 2]
                                          [--no-atomic] [--no-fused] [--json FILE]

The waits are timed by wrapping the step's internal wait and update calls
(offload.optim._Step): instrumentation for this script alone.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import offload.optim as optim  # noqa: E402
from offload import Offloader  # noqa: E402
from offload.benchmark import block_trace, disk_activity  # noqa: E402
from zero_offload_train import adamw_options, build, chunk_size, unit_sizes  # noqa: E402


def disk_counters(directory):
    """(busy ms, ms x requests in flight) of the block device holding
    ``directory``, or None where the kernel does not say."""
    dev = os.stat(directory).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            fields = f.read().split()
        return int(fields[9]), int(fields[10])
    except (OSError, IndexError, ValueError):
        return None


def idle_by_stage(gaps, stages):
    """Seconds of ``gaps`` overlapping each stage ("updates", "read_wait",
    "write_wait"; the rest: "other")."""
    totals = {"updates": 0.0, "read_wait": 0.0, "write_wait": 0.0}
    for a, b in gaps:
        for name, s, e in stages:
            if s < b and e > a:
                totals[name] += min(b, e) - max(a, s)
    totals["other"] = sum(b - a for a, b in gaps) - sum(totals.values())
    return totals


@contextlib.contextmanager
def timed_stages(stages):
    """Appends each update, read wait and write wait of the steps run inside
    as (name: "updates", "read_wait" or "write_wait", start, end) on
    time.monotonic to ``stages``."""
    wait, apply = optim._Step._wait, optim._Step._apply

    def timed_wait(self, w, attribute, what):
        started = time.monotonic()
        try:
            return wait(self, w, attribute, what)
        finally:
            stages.append(("read_wait" if attribute == "read" else "write_wait", started, time.monotonic()))

    def timed_apply(self, w):
        started = time.monotonic()
        try:
            return apply(self, w)
        finally:
            stages.append(("updates", started, time.monotonic()))

    optim._Step._wait, optim._Step._apply = timed_wait, timed_apply
    try:
        yield
    finally:
        optim._Step._wait, optim._Step._apply = wait, apply


def measured(fn, directory, interval=None):
    """Runs fn; its seconds, and the disk's busy ms and mean depth meanwhile.
    ``interval`` (a list) gets fn's (start, end) on time.monotonic."""
    before = disk_counters(directory)
    started = time.monotonic()
    fn()
    ended = time.monotonic()
    after = disk_counters(directory)
    if interval is not None:
        interval[:] = [started, ended]
    row = {"seconds": ended - started}
    if before is not None and after is not None:
        busy, queued = after[0] - before[0], after[1] - before[1]
        row.update(busy_ms=busy, depth=queued / busy if busy else 0.0)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6, help="measured steps (after one warm-up step)")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--write-depth", type=int, default=2)
    parser.add_argument("--no-atomic", dest="atomic", action="store_false")
    parser.add_argument("--no-fused", dest="fused", action="store_false",
                        help="torch's per-tensor AdamW loop instead of its fused CPU kernel (the example's default)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.dir)

    model = build(args)
    params = list(model.parameters())
    chunk = chunk_size(argparse.Namespace(chunk_size=None), params)
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    with Offloader(directory) as off:
        opt = optim.OffloadedOptimizer(torch.optim.AdamW(params, **adamw_options(args)), off, args.prefetch,
                                       atomic=args.atomic, chunk_size=chunk, write_depth=args.write_depth)
        state = [torch.zeros(n) for n in unit_sizes(params, chunk) for _ in ("exp_avg", "exp_avg_sq")]
        off.sync_writev(state)
        opt.step()  # warm-up: the state is created and first written here
        steps, alone, traced, block_events = [], [], [], []
        with block_trace(directory, block_events) as tracing:
            for _ in range(args.steps):
                stages, interval = [], []
                with timed_stages(stages):
                    row = measured(opt.step, directory, interval)
                for key in ("updates", "read_wait", "write_wait"):
                    row[key] = sum(e - s for name, s, e in stages if name == key)
                steps.append(row)
                traced.append((interval, stages))
                alone.append(measured(lambda: (off.sync_readv(state), off.sync_writev(state)), directory))
        if tracing:
            for row, ((start, end), stages) in zip(steps, traced):
                gaps, seen = disk_activity(block_events, start, end)
                row.update(bursts=seen["bursts"], requests_per_burst=seen["requests_per_burst"],
                           bursts_emptying=seen["bursts_emptying"] / seen["bursts"] if seen["bursts"] else 0,
                           idle_ms=1e3 * seen["idle_seconds"], idle_gaps=seen["idle_gaps"],
                           **{f"idle_ms_{name}": 1e3 * s for name, s in idle_by_stage(gaps, stages).items()})

    def median(rows, key):
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    figures = {"pieces": len(opt._work()), "prefetch": args.prefetch, "write_depth": args.write_depth,
               "atomic": args.atomic, "fused": args.fused,
               "state_bytes": sum(t.numel() * t.element_size() for t in state),
               "steps": steps, "io_alone": alone,
               "median": {"step": {k: median(steps, k) for k in steps[0]},
                          "io_alone": {k: median(alone, k) for k in alone[0]}}}
    s, a = figures["median"]["step"], figures["median"]["io_alone"]
    print(f"{figures['pieces']} pieces, {figures['state_bytes'] / 2**20:.0f} MiB of state read and written, "
          f"prefetch {args.prefetch}, write_depth {args.write_depth}, atomic {args.atomic}, "
          f"AdamW {'fused' if args.fused else 'not fused'}; "
          f"medians of {args.steps} steps")
    print(f"step():   {s['seconds']:.3f} s = updates {s['updates']:.3f} + waiting on reads {s['read_wait']:.3f}"
          f" + on writes {s['write_wait']:.3f} (+ {s['seconds'] - s['updates'] - s['read_wait'] - s['write_wait']:.3f}"
          " other)")
    print(f"I/O alone: {a['seconds']:.3f} s")
    if s.get("busy_ms") is not None and a.get("busy_ms") is not None:
        print(f"disk busy: {s['busy_ms']:.0f} ms of the step ({s['busy_ms'] / 10 / s['seconds']:.0f}%), "
              f"{s['depth']:.1f} requests in flight on average; {a['busy_ms']:.0f} ms of the I/O alone "
              f"({a['busy_ms'] / 10 / a['seconds']:.0f}%), {a['depth']:.1f} in flight")
    else:
        print("disk busy: no block-device counters for this directory")
    if s.get("idle_ms") is not None:
        print(f"disk idle in the step (block-layer trace): {s['idle_ms']:.1f} ms in {s['idle_gaps']:.0f} gaps, "
              f"while the thread was updating {s['idle_ms_updates']:.1f}, waiting on writes "
              f"{s['idle_ms_write_wait']:.1f}, on reads {s['idle_ms_read_wait']:.1f}, "
              f"elsewhere {s['idle_ms_other']:.1f}")
        print(f"completions: {s['bursts']:.0f} bursts in the step (each less than 0.1 ms after the one before), "
              f"{s['requests_per_burst']:.1f} requests each; {100 * s['bursts_emptying']:.0f}% of them left "
              "the disk with nothing in flight")
    else:
        print("disk idle in the step: not traced (needs root: tracefs, mounted for the run where it is not)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
