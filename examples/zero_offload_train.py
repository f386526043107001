"""Train a small transformer with its AdamW state on NVMe (ZeRO-Infinity style).

Trains the same model (synthetic data) twice from the same seed: with plain
AdamW, then with ``OffloadedOptimizer`` keeping exp_avg/exp_avg_sq in an
Offloader between steps. Prints the step time of both, the optimizer-state
memory resident at the peak, the share of the optimizer's I/O hidden behind
the updates, the step against its floor (max of the update's compute and the
same state's I/O alone, both measured in the same round as the step), and
whether the two runs ended bit-identical.

    python examples/zero_offload_train.py [DIR] [--layers 8] [--d-model 512] [--steps 8] [--json FILE]

The first step of the process (AdamW makes its state; the offloaded run
writes it out, in memory the process never touched) is shown on its own and
left out of the medians. The offloaded model trains first in every round,
so its first forward and backward also carry the process's one-time costs:
the optimizer steps are the like-for-like pair there.

``--write-behind``: ``step()`` returns before its last writes land; they
finish while the next forward and backward run. ``--read-ahead``: the reads
of the next step's first pieces start as ``step()`` ends. Each round trains
the offloaded model first and the plain one after it, so that I/O runs
beside a forward and backward pass; what is left of it when that pass ends
is charged to the offloaded step.

Both runs use torch's fused CPU AdamW kernel where this torch has one (2.4
and later): one vectorized pass over each tensor, the kind of update
DeepSpeed's ZeRO-Offload runs on the CPU (its CPU Adam). ``--no-fused`` runs
torch's default per-tensor loop of elementwise operations instead.

Large parameters move in chunks (``chunk_size``); by default the chunk is the
mean parameter size, so at most prefetch + write_depth chunks of state are in
memory: (prefetch + write_depth) / N of the optimizer state for N parameter
tensors (``--prefetch``, ``--write-depth``: 2 and 2 by default).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from offload import Offloader
from offload.optim import OffloadedOptimizer


class TinyLM(nn.Module):
    def __init__(self, vocab, d_model, layers, heads=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def train_step(model, opt, step, batch, seq, vocab):
    """One step on synthetic batch ``step``; returns (step seconds, optimizer.step seconds)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    started = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before_step = time.perf_counter()
    opt.step()
    done = time.perf_counter()
    return done - started, done - before_step


def add_workload_arguments(parser) -> None:
    """The model, training and OffloadedOptimizer options (also benchmarks/zero_ranks.py's)."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="per optimizer, interleaved; the first is warm-up")
    parser.add_argument("--prefetch", type=int, default=2,
                        help="reads run ahead of the update over pieces weighing this many of the largest")
    parser.add_argument("--write-depth", type=int, default=2,
                        help="writes run behind the update over pieces weighing this many of the largest, "
                             "the updated one included")
    parser.add_argument("--write-behind", action="store_true",
                        help="let each step's last writes finish during the next forward pass")
    parser.add_argument("--read-ahead", action="store_true",
                        help="start reading the next step's first pieces as a step ends")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="elements per chunk (default: the mean parameter size; 0: whole parameters)")
    parser.add_argument("--no-fused", dest="fused", action="store_false",
                        help="torch's default AdamW loop instead of its fused CPU kernel")
    parser.add_argument("--json", help="write the figures here")


def adamw_options(args) -> dict:
    """AdamW's keyword arguments for both runs: the fused CPU kernel if asked
    for and this torch has it (2.4 and later), else torch's default."""
    if args.fused:
        try:
            torch.optim.AdamW([nn.Parameter(torch.zeros(1))], fused=True)
            return {"lr": 1e-3, "fused": True}
        except (RuntimeError, ValueError):
            args.fused = False  # reported as not fused
    return {"lr": 1e-3}


def build(args):
    """The model, the same weights every call."""
    torch.manual_seed(0)
    return TinyLM(args.vocab, args.d_model, args.layers)


def chunk_size(args, params) -> int:
    return args.chunk_size if args.chunk_size is not None else \
        sum(p.numel() for p in params) // len(params) // 1024 * 1024


def unit_sizes(params, chunk) -> list:
    """Element counts of ``params`` cut as OffloadedOptimizer cuts them
    (chunks of ``chunk`` elements; 0: whole parameters): one AdamW state
    tensor each of exp_avg and exp_avg_sq per unit."""
    return [min(chunk, p.numel() - start) if chunk else p.numel()
            for p in params for start in range(0, p.numel(), chunk or p.numel())]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--no-atomic", dest="atomic", action="store_false",
                        help="no pre-step parameter copies (a failed step stays partly applied)")
    add_workload_arguments(parser)
    args = parser.parse_args(argv)

    plain_model, offl_model = build(args), build(args)
    params = list(plain_model.parameters())
    n_params = sum(p.numel() for p in params)
    state_bytes = 2 * 4 * n_params  # exp_avg + exp_avg_sq, fp32
    options = adamw_options(args)
    print(f"model: {n_params / 1e6:.1f}M parameters in {len(params)} tensors; AdamW state "
          f"{state_bytes / 2**20:.0f} MiB; {torch.get_num_threads()} threads; AdamW "
          f"{'fused' if args.fused else 'not fused'}")

    plain_opt = torch.optim.AdamW(plain_model.parameters(), **options)
    with Offloader(args.dir) as off:
        opt = OffloadedOptimizer(torch.optim.AdamW(offl_model.parameters(), **options), off, args.prefetch,
                                 names=offl_model.named_parameters(), atomic=args.atomic,
                                 chunk_size=chunk_size(args, params),
                                 write_behind=args.write_behind, read_ahead=args.read_ahead,
                                 write_depth=args.write_depth)
        chunk = opt.chunk_size  # as the optimizer cuts (rounded up to a multiple of 64 elements)
        units = unit_sizes(params, chunk)
        largest = max(2 * 4 * n for n in units)
        # The same I/O with nothing to hide behind: tensors of the same sizes,
        # read and written back once after every step.
        state = [torch.zeros(n) for n in units for _ in ("exp_avg", "exp_avg_sq")]
        off.sync_writev(state)
        # Interleaved, step by step (the machine's noise hits all three alike).
        plain_times, plain_opt_times, offl_times, stats, alone = [], [], [], [], []
        offl_opt_times, waits = [], []
        for step in range(args.steps):
            total, _ = train_step(offl_model, opt, step, args.batch, args.seq, args.vocab)
            stats.append(opt.stats)
            in_plain, in_step = train_step(plain_model, plain_opt, step, args.batch, args.seq, args.vocab)
            plain_times.append(in_plain)
            plain_opt_times.append(in_step)
            started = time.perf_counter()
            opt.synchronize()  # I/O the step left running: what is still due is charged to it
            off.synchronize()
            due = time.perf_counter() - started
            offl_times.append(total + due)
            offl_opt_times.append(opt.stats.seconds + due)
            waits.append(opt.stats.io_wait_seconds + due)
            started = time.perf_counter()
            off.sync_readv(state)
            off.sync_writev(state)
            alone.append(time.perf_counter() - started)
        io_alone = statistics.median(alone[1:])
        # Each step against its own floor: max(the update's compute, the I/O alone) of the same round.
        over_floor = statistics.median(s / max(a, p) for s, a, p in
                                       zip(offl_opt_times[1:], alone[1:], plain_opt_times[1:]))
        backend, direct = off.backend, off.direct

    exact = all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), offl_model.parameters()))
    plain_step, offl_step = statistics.median(plain_times[1:]), statistics.median(offl_times[1:])
    measured = stats[1:]
    wait = statistics.median(waits[1:])
    opt_time = statistics.median(offl_opt_times[1:])
    plain_opt_time = statistics.median(plain_opt_times[1:])
    peak = max(s.peak_state_bytes for s in measured)
    hidden = max(0.0, 1 - wait / io_alone)
    window = args.prefetch + args.write_depth  # pieces whose state may be in memory at once
    figures = {
        "parameters": n_params, "tensors": len(params), "state_bytes": state_bytes,
        "chunk_size": chunk, "fused": args.fused,
        "engine": backend, "direct": direct, "prefetch": args.prefetch, "write_depth": args.write_depth,
        "write_behind": args.write_behind,
        "read_ahead": args.read_ahead, "pieces_read_ahead": statistics.median(s.pieces_read_ahead for s in measured),
        "writes_left_in_flight": statistics.median(s.writes_left_in_flight for s in measured),
        "step_seconds_plain": plain_step, "step_seconds_offloaded": offl_step,
        "step_time_ratio": offl_step / plain_step,
        "first_step_seconds_plain": plain_times[0], "first_step_seconds_offloaded": offl_times[0],
        "first_optimizer_step_seconds": offl_opt_times[0], "first_optimizer_step_seconds_plain": plain_opt_times[0],
        "optimizer_step_seconds": opt_time, "optimizer_step_seconds_plain": plain_opt_time,
        "io_wait_seconds": wait, "io_alone_seconds": io_alone, "step_over_floor": over_floor,
        "io_hidden_share": hidden, "peak_state_bytes": peak,
        "peak_state_fraction": peak / state_bytes,
        "bound_window_largest_unit": window * largest / state_bytes,
        "bound_window_over_n": window / len(params),
        "bit_identical": exact,
    }
    print(f"step time (median of {len(measured)}): plain AdamW {plain_step:.3f} s, offloaded "
          f"{offl_step:.3f} s = {offl_step / plain_step:.3f}x  [{backend}, O_DIRECT {direct}]")
    print(f"optimizer step: plain {plain_opt_time:.3f} s, offloaded {opt_time:.3f} s, of which waiting on "
          f"I/O {wait:.3f} s; the same I/O alone {io_alone:.3f} s: {100 * hidden:.0f}% of the I/O hidden "
          "behind the updates")
    print(f"step over its floor, max(update, I/O alone) of the same round: {over_floor:.2f}x (median)")
    print(f"first step of this process (not in the medians; AdamW makes its state, which the offloaded run "
          f"then writes; the offloaded model trains first, so its first forward and backward also carry the "
          f"process's one-time costs): plain {plain_times[0]:.3f} s, offloaded {offl_times[0]:.3f} s = "
          f"{offl_times[0] / plain_times[0]:.3f}x; optimizer step {plain_opt_times[0]:.3f} s and "
          f"{offl_opt_times[0]:.3f} s")
    if args.write_behind or args.read_ahead:
        print(f"write-behind: {figures['writes_left_in_flight']:g} pieces' writes still running when step() "
              f"returned; read-ahead: {figures['pieces_read_ahead']:g} pieces read before step() began "
              "(medians); what was still due after the next pass charged to the step")
    print(f"optimizer state in memory at the peak: {peak / 2**20:.1f} MiB = "
          f"{100 * peak / state_bytes:.1f}% of plain AdamW's {state_bytes / 2**20:.0f} MiB "
          f"(bound: prefetch + write_depth = {window} x the largest chunk's state = "
          f"{100 * figures['bound_window_largest_unit']:.1f}%, chunks of at most {chunk or 'whole'} "
          f"elements; (prefetch + write_depth)/N = {100 * figures['bound_window_over_n']:.1f}% "
          f"for N = {len(params)} tensors)")
    print(f"parameters after {args.steps} steps bit-identical to plain AdamW: {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
