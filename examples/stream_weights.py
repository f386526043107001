"""Weight streaming: run a model whose weights live on disk, and what it costs.

A stack of MLP blocks (default: 24 blocks, 1.5 GB of fp32 weights) at a batch
small enough that each block's compute is below its I/O. Inference, round
after round in one process, interleaved, the page cache dropped before each:

- in memory: the model with its weights in RAM (the compute floor);
- offload: ``offload.nn.offload_parameters(model, Offloader(dir), prefetch)``,
  weights read ahead of the blocks (O_DIRECT: the page cache plays no part);
- accelerate: ``accelerate.disk_offload`` of the same model, when installed
  (weights read through numpy memmaps when each module runs);
- the disk alone: fio reading the same bytes (O_DIRECT, 4 MiB requests,
  io_uring, huge-page buffers when root can reserve them): the I/O floor.

Then ``--train-steps`` training steps (forward, backward, AdamW), each variant
in a fresh process so that its peak RSS is its own: the model in memory, and
the model built on the meta device, filled from a checkpoint a block at a
time and streamed (weights through ``handle.step``, optimizer state through
``OffloadedOptimizer``), so it never holds the whole model. Losses compared
bit for bit.

Prints medians over the rounds with the first round in brackets (the first
pass of a process: memory faulted in, block order not yet recorded), the
peak of streamed weights resident, and whether outputs are bit-identical.

    python examples/stream_weights.py [DIR] [--layers 24] [--d-model 1536] [--hidden 5120]
        [--tokens 16] [--rounds 5] [--prefetch 2] [--train-steps 3] [--json FILE]
"""
import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402
from offload import Offloader  # noqa: E402
from offload.benchmark import drop_page_cache, fio_job, hugepage_buffers  # noqa: E402
from offload.optim import OffloadedOptimizer  # noqa: E402


class Block(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def build(layers, d_model, hidden, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(d_model, hidden) for _ in range(layers)])


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def fio_gbps(directory, nbytes):
    """fio writing ``nbytes`` with O_DIRECT, then reading them after a cache
    drop: (write GB/s, read GB/s, buffers), or Nones without fio."""
    mem, note = hugepage_buffers((4 << 20) * 32)
    extra = (mem,) if mem else ()
    total = max(4 << 20, nbytes // (4 << 20) * (4 << 20))
    write = fio_job(directory, "write", 4 << 20, total, filename="weights-fio.bin", extra=extra)
    if write is None:
        return None, None, None
    drop_page_cache()
    read = fio_job(directory, "read", 4 << 20, total, filename="weights-fio.bin", extra=extra)
    os.unlink(os.path.join(directory, "weights-fio.bin"))
    return write["bw_bytes"] / 1e9, read["bw_bytes"] / 1e9, note


def storage_io():
    """(bytes read, bytes written) at the storage layer by this process so
    far, all its threads (io_uring's workers too): /proc/self/io."""
    fields = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = int(value)
    return fields["read_bytes"], fields["write_bytes"]


def train_worker(args, mode, checkpoint, directory, out):
    """Trains in this process (``mode``: "in memory", or "offload": built on
    the meta device, weights filled from ``checkpoint`` a block at a time and
    streamed, optimizer state in an OffloadedOptimizer); writes step times,
    losses (exact float values) and the process's peak RSS to ``out``."""
    import resource
    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.d_model)
    if mode == "offload":
        with torch.device("meta"):
            model = build(args.layers, args.d_model, args.hidden)
        off = Offloader(tempfile.mkdtemp(prefix="train-", dir=directory))
        handle = offload.nn.offload_parameters(model, off, prefetch=args.prefetch, checkpoint=checkpoint)
        optimizer = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), off)
        step = handle.step
    else:
        model = build(args.layers, args.d_model, args.hidden)
        model.load_state_dict(offload.load(checkpoint))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = lambda o: o.step()  # noqa: E731
    sampler = _UnreclaimablePeak()
    times, losses, moved = [], [], []
    for i in range(args.train_steps):
        target = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(i))
        before = storage_io()
        start = time.perf_counter()
        loss = (model(x) - target).square().mean()
        loss.backward()
        step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        moved.append([after - was for after, was in zip(storage_io(), before)])
        losses.append(loss.item())
    result = {"times": times, "losses": losses, "storage_bytes": moved,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "peak_unreclaimable": sampler.stop(),
              "peak_streamed": handle.peak_streamed_bytes if mode == "offload" else None}
    with open(out, "w") as f:
        json.dump(result, f)


class _UnreclaimablePeak:
    """Samples, every 10 ms on a thread, the memory of this process that the
    kernel cannot reclaim: Rss minus LazyFree (pool blocks freed lazily,
    MADV_FREE, still count in RSS until the kernel takes them)."""

    def __init__(self):
        import threading
        self.peak, self.done = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(0.01):
            fields = {}
            with open("/proc/self/smaps_rollup") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 2 and parts[0] in ("Rss:", "LazyFree:"):
                        fields[parts[0]] = int(parts[1]) * 1024
            self.peak = max(self.peak, fields.get("Rss:", 0) - fields.get("LazyFree:", 0))

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def _train_in_fresh_process(args, mode, checkpoint, directory):
    import subprocess
    out = os.path.join(directory, f"train-{mode.replace(' ', '-')}.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), directory, "--layers", str(args.layers),
                    "--d-model", str(args.d_model), "--hidden", str(args.hidden), "--tokens", str(args.tokens),
                    "--prefetch", str(args.prefetch), "--train-steps", str(args.train_steps),
                    "--train-worker", mode, checkpoint, out], check=True)
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1536)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--train-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train_worker:
        mode, checkpoint, out = args.train_worker
        train_worker(args, mode, checkpoint, args.directory, out)
        return 0

    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.d_model)
    reference = build(args.layers, args.d_model, args.hidden)
    weights = sum(p.nbytes for p in reference.parameters())
    block_bytes = weights // args.layers
    directory = tempfile.mkdtemp(prefix="stream-weights-", dir=args.directory)
    off = Offloader(directory)
    streamed = copy.deepcopy(reference)
    handle = offload.nn.offload_parameters(streamed, off, prefetch=args.prefetch)
    contenders = {"in memory": reference, "offload": streamed}
    try:
        import accelerate
        if args.no_accelerate:
            raise ImportError
        accelerated = copy.deepcopy(reference)
        accelerate.disk_offload(accelerated, os.path.join(directory, "accelerate"), execution_device="cpu")
        contenders["accelerate disk_offload"] = accelerated
        accelerate_note = f"accelerate {accelerate.__version__}"
    except ImportError:
        accelerate_note = "accelerate not installed (pip install accelerate): skipped"

    times = {name: [] for name in contenders}
    identical = {name: True for name in contenders}
    fio_rates, fio_write_rates, fio_notes = [], [], set()
    with torch.no_grad():
        expected = reference(x)
        for _ in range(args.rounds):
            for name, model in contenders.items():
                drop_page_cache()
                seconds, out = timed(lambda: model(x))
                times[name].append(seconds)
                identical[name] &= torch.equal(out, expected)
            write_rate, rate, note = fio_gbps(directory, weights)
            if rate is not None:
                fio_rates.append(rate)
                fio_write_rates.append(write_rate)
                fio_notes.add(note)
    peak = handle.peak_streamed_bytes

    handle.remove()
    train = None
    if args.train_steps:  # each variant in a fresh process of its own: its peak memory is its own
        checkpoint = os.path.join(directory, "model.safetensors")
        offload.save(reference.state_dict(), checkpoint)
        runs = {mode: _train_in_fresh_process(args, mode, checkpoint, directory) for mode in ("in memory", "offload")}
        train = {mode: run["times"] for mode, run in runs.items()}
        train["peak_rss_bytes"] = {mode: run["peak_rss"] for mode, run in runs.items()}
        train["peak_unreclaimable_bytes"] = {mode: run["peak_unreclaimable"] for mode, run in runs.items()}
        train["losses_identical"] = runs["in memory"]["losses"] == runs["offload"]["losses"]
        train["peak_streamed_weights_bytes"] = runs["offload"]["peak_streamed"]
        # The streamed step's floor: its own storage I/O (/proc/self/io, median
        # step) at the disk's rates measured by fio in this run, one direction
        # after the other (one disk), or the step in memory, whichever is more.
        read_bytes = statistics.median(r for r, _ in runs["offload"]["storage_bytes"])
        write_bytes = statistics.median(w for _, w in runs["offload"]["storage_bytes"])
        train["step_read_bytes"], train["step_write_bytes"] = read_bytes, write_bytes
        if fio_rates:
            train["io_floor_s"] = (read_bytes / (statistics.median(fio_rates) * 1e9)
                                   + write_bytes / (statistics.median(fio_write_rates) * 1e9))
    off.close()
    shutil.rmtree(directory, ignore_errors=True)

    compute = statistics.median(times["in memory"])
    read_floor = weights / (statistics.median(fio_rates) * 1e9) if fio_rates else None
    floor = max(compute, read_floor) if read_floor is not None else compute
    report = {"weights_bytes": weights, "blocks": args.layers, "block_bytes": block_bytes,
              "tokens": args.tokens, "prefetch": args.prefetch, "rounds": args.rounds,
              "fio_read_gbps": statistics.median(fio_rates) if fio_rates else None,
              "fio_write_gbps": statistics.median(fio_write_rates) if fio_rates else None,
              "fio_buffers": sorted(fio_notes), "read_floor_s": read_floor, "compute_s": compute,
              "peak_streamed_weights_bytes": peak, "peak_bound_bytes": (args.prefetch + 2) * block_bytes,
              "accelerate": accelerate_note, "contenders": {}, "training": train}
    print(f"model: {args.layers} blocks of {block_bytes / 1e6:.0f} MB, {weights / 1e9:.2f} GB of fp32 weights; "
          f"{args.tokens} tokens per forward; prefetch {args.prefetch}")
    if read_floor is not None:
        print(f"the disk alone (fio, {', '.join(sorted(fio_notes))} buffers): "
              f"{report['fio_read_gbps']:.2f} GB/s, reading the weights takes {read_floor:.3f} s")
    print(f"forward, median of {args.rounds} rounds (first in brackets), cache dropped before each:")
    for name in contenders:
        median = statistics.median(times[name])
        row = {"median_s": median, "first_s": times[name][0], "runs": times[name],
               "ratio_to_floor": median / floor, "outputs_bit_identical": identical[name]}
        report["contenders"][name] = row
        line = f"  {name:24s} {median:7.3f} s [{times[name][0]:.3f}]  {median / floor:.2f}x max(compute, disk)"
        if name != "in memory":
            line += f", {median / statistics.median(times['offload']):.1f}x offload" if name != "offload" else ""
            line += "; outputs " + ("bit-identical" if identical[name] else "DIFFER")
        print(line)
    print(f"  ({accelerate_note})")
    print(f"peak streamed weights resident: {peak / 1e6:.0f} MB = {peak / block_bytes:.1f} blocks "
          f"(bound: prefetch + 2 = {args.prefetch + 2})")
    if train is not None:
        m, o = statistics.median(train["in memory"]), statistics.median(train["offload"])
        rss, hard = train["peak_rss_bytes"], train["peak_unreclaimable_bytes"]
        print(f"training step (forward, backward, AdamW), each in a fresh process, median of {args.train_steps}: "
              f"in memory {m:.3f} s, streamed {o:.3f} s ({o / m:.2f}x); peak memory the kernel cannot reclaim "
              f"(Rss - LazyFree, sampled every 10 ms during the steps): in memory {hard['in memory'] / 1e9:.2f} GB, "
              f"streamed {hard['offload'] / 1e9:.2f} GB (peak RSS {rss['in memory'] / 1e9:.2f} and "
              f"{rss['offload'] / 1e9:.2f} GB; the streamed model is built on the meta device, "
              f"filled from a checkpoint; streamed weights resident at peak "
              f"{train['peak_streamed_weights_bytes'] / 1e6:.0f} MB of {weights / 1e6:.0f} MB); losses "
              + ("bit-identical" if train["losses_identical"] else "DIFFER"))
        io_line = (f"the streamed step's own storage I/O (median step): {train['step_read_bytes'] / 1e9:.2f} GB read, "
                   f"{train['step_write_bytes'] / 1e9:.2f} GB written")
        if "io_floor_s" in train:
            floor_s = max(m, train["io_floor_s"])
            train["ratio_to_floor"] = o / floor_s
            train["ratio_to_io_floor"] = o / train["io_floor_s"]
            io_line += (f" = {train['io_floor_s']:.3f} s at fio's rates; streamed step = "
                        f"{o / train['io_floor_s']:.2f}x that I/O, {o / floor_s:.2f}x max(step in memory, that I/O)")
        print(io_line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(identical.values()) and (train is None or train["losses_identical"]) else 1


if __name__ == "__main__":
    sys.exit(main())
