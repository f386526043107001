"""Activation offloading: the one-line change, and what it costs.

A transformer training step (forward + backward, synthetic data) whose saved
activations are several times its parameters, run interleaved, round after
round, in the same process:

- plain: nothing offloaded;
- save_on_cpu: torch.autograd.graph.save_on_cpu (synchronous copies, CPU);
- offload to disk: ``with offload.nn.offload_activations(Offloader(dir)):``;
- the disk alone: the same bytes written then read back by fio (O_DIRECT,
  4 MiB requests, io_uring; huge-page buffers when root can reserve them),
  the floor a step that moves them cannot beat;
- with ``--pinned``, also the pinned tier (``Offloader(None)``) on the test
  device that stands for a GPU here (its copies are CPU memcpys on a thread;
  its copies held are the test device's, not counted), and the same with the
  test device's copies skipped, to separate the pipeline's cost from the
  memcpys a GPU would do by DMA (timing only: its bytes are wrong).

Prints each contender's median step time over the rounds and its first,
the peak memory the saved tensors held, and whether the gradients are
bit-identical to the plain step's.

    python examples/offload_activations.py [DIR] [--layers 4] [--batch 8] [--seq 512] [--rounds 5]
        [--pinned] [--json FILE]
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402
from offload import Offloader  # noqa: E402
from offload.benchmark import drop_page_cache, fio_limit  # noqa: E402


def build(layers, d_model, heads, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class SavedBytes:
    """Counts what autograd saves (the plain step's saved-tensor memory)."""

    def __init__(self, min_bytes):
        self.total, self.largest, self.min_bytes = 0, 0, min_bytes

    def pack(self, t):
        self.total += t.nbytes
        if t.nbytes >= self.min_bytes:
            self.largest = max(self.largest, t.nbytes)
        return t


def step(model, x, context, pool_peak):
    """One forward + backward; returns (seconds, gradients)."""
    model.zero_grad(set_to_none=True)
    hooks = [m.register_forward_hook(pool_peak.sample) for m in model.modules()]
    hooks += [m.register_full_backward_hook(pool_peak.sample) for m in model.layers]
    start = time.perf_counter()
    with context:
        loss = model(x).square().mean()
    loss.backward()
    seconds = time.perf_counter() - start
    for h in hooks:
        h.remove()
    return seconds, [p.grad.clone() for p in model.parameters()]


class PoolPeak:
    """The most pool memory (what offload's saved-tensor copies live in)
    held above a baseline, sampled at every module boundary."""

    def __init__(self):
        self.pool, self.base, self.peak = offload.buffer_pool(), 0, 0

    def reset(self):
        self.base, self.peak = self.pool.live_bytes, 0

    def sample(self, *_):
        self.peak = max(self.peak, self.pool.live_bytes - self.base)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-bytes", type=int, default=1 << 20)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--pinned", action="store_true", help="also the pinned tier, on the test device")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    model = build(args.layers, args.d_model, args.heads)
    x = torch.randn(args.batch, args.seq, args.d_model)
    params = sum(p.nbytes for p in model.parameters())
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the input needs no grad
    counter = SavedBytes(args.min_bytes)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        model(x).square().mean().backward()
    saved = counter.total
    directory = tempfile.mkdtemp(prefix="activations-", dir=args.directory)
    disk = Offloader(directory)
    pinned = copyless = None
    if args.pinned:
        from offload.devices import LateCopyDevice

        class CopylessDevice(LateCopyDevice):
            """The test device with its copies skipped: the pipeline's own
            cost without the memcpys. For timing only (wrong bytes)."""

            def copy(self, dst, src, after):
                return self.caller_event()

        pinned = Offloader(None, device=LateCopyDevice(seed=1, max_delay=0.0))
        copyless = Offloader(None, device=CopylessDevice(seed=1, max_delay=0.0))
    peak = PoolPeak()
    contenders = {
        "plain": lambda: contextlib.nullcontext(),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
        "offload to disk": lambda: offload.nn.offload_activations(disk, min_bytes=args.min_bytes,
                                                                  prefetch=args.prefetch),
    }
    if pinned is not None:
        contenders["offload pinned (test device)"] = lambda: offload.nn.offload_activations(
            pinned, min_bytes=args.min_bytes, prefetch=args.prefetch)
        contenders["offload pinned, copies skipped"] = lambda: offload.nn.offload_activations(
            copyless, min_bytes=args.min_bytes, prefetch=args.prefetch)
    times = {name: [] for name in contenders}
    peaks = {name: 0 for name in contenders}
    identical = {name: True for name in contenders}
    reference, moved = None, 0
    fio_rates, fio_notes = [], set()
    for round_ in range(args.rounds):
        for name, make in contenders.items():
            drop_page_cache()
            peak.reset()
            context = make()
            seconds, grads = step(model, x, context, peak)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak.peak)
            if reference is None:
                reference = grads
            if name != "offload pinned, copies skipped":  # timing only: its bytes are wrong
                identical[name] &= all(torch.equal(a, b) for a, b in zip(reference, grads))
            if name == "offload to disk":
                moved = context.written_bytes
        limit = fio_limit(directory, max(moved, 64 << 20))
        if limit is not None:
            fio_rates.append(limit["seconds_per_byte"])
            fio_notes.add(limit["buffers"])
    disk.close()
    shutil.rmtree(directory, ignore_errors=True)
    if pinned is not None:
        pinned.close()
        copyless.close()

    plain = statistics.median(times["plain"])
    floor_s = moved * statistics.median(fio_rates) if fio_rates else None
    report = {"parameters_bytes": params, "saved_bytes": saved, "offloaded_bytes_per_step": moved,
              "largest_saved_bytes": counter.largest, "prefetch": args.prefetch,
              "rounds": args.rounds, "fio_buffers": sorted(fio_notes), "disk_floor_s": floor_s,
              "contenders": {}}
    print(f"model: {args.layers} layers, d_model {args.d_model}, batch {args.batch} x seq {args.seq}; "
          f"parameters {params / 2**20:.0f} MiB, saved activations {saved / 2**20:.0f} MiB "
          f"({saved / params:.1f}x), of which offloaded {moved / 2**20:.0f} MiB (min_bytes {args.min_bytes}); "
          f"the largest saved tensor {counter.largest / 2**20:.0f} MiB, prefetch {args.prefetch}")
    if floor_s is not None:
        print(f"the disk alone (fio, {', '.join(sorted(fio_notes))} buffers): writing and reading those bytes "
              f"takes {floor_s:.3f} s")
    print(f"step = forward + backward, median of {args.rounds} rounds (first round in brackets):")
    for name in contenders:
        median = statistics.median(times[name])
        row = {"median_s": median, "first_s": times[name][0], "runs": times[name], "ratio_to_plain": median / plain,
               "peak_saved_copies_bytes": peaks[name], "gradients_bit_identical": identical[name]}
        line = f"  {name:30s} {median:.3f} s [{times[name][0]:.3f}]  {median / plain:.2f}x plain"
        if floor_s is not None and name == "offload to disk":
            row["ratio_to_floor"] = median / max(plain, floor_s)
            line += f", {row['ratio_to_floor']:.2f}x max(plain, disk alone)"
        if name == "offload to disk":
            line += (f"; copies held at peak {peaks[name] / 2**20:.0f} MiB "
                     f"(= {peaks[name] / counter.largest:.1f} x the largest saved tensor)")
        if name == "offload pinned, copies skipped":
            row["gradients_bit_identical"] = None
            line += "; timing only (the device's copies are skipped)"
        else:
            line += "; gradients " + ("bit-identical" if identical[name] else "DIFFER")
        print(line)
        report["contenders"][name] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
