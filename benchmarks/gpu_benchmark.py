"""GPU <-> NVMe through the staging pipeline, beside fio and a naive baseline.

    python benchmarks/gpu_benchmark.py DIR [--repeats 3] [--total-mib 2048]
    python benchmarks/gpu_benchmark.py DIR --device late-copy   # the pipeline on the CPU

Measures, interleaved and as medians (min-max):
- offload write (GPU -> pinned staging -> NVMe) and read (NVMe -> staging -> GPU)
  of 64 MiB tensors, each figure also as a ratio to fio on the same directory;
- fio with huge-page buffers where root can have them (the disk's real limit;
  fio's default 4 KiB-page buffers split large O_DIRECT requests on some disks),
  on its own file and, after each offload read, on the file offload read (a
  file's place on a disk moves its read rate): the read also over that;
- raw D2H/H2D copies to and from pinned host memory (the PCIe limit);
- the naive way: t.cpu() + torch.save with fsync, torch.load + .cuda();
- overlap: matmuls on the default stream alone, then again beside the write
  and beside the read, each part sized to last as long as its transfer:
  (compute alone + transfers alone) / both together, 2.0 is perfect overlap.
Without CUDA (and without --device late-copy) it says so and exits 0.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from offload import Offloader
from offload.benchmark import (drop_page_cache, fio_read_open_files, fio_run, hugepage_buffers, median_ratio,
                               whole_tensors)

MIB = 1 << 20


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--device", choices=["cuda", "late-copy"], default="cuda")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    total = whole_tensors(parser, args.total_mib, 64 * MIB)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure (use --device late-copy to exercise the pipeline)")
        return 0
    test_device = None
    if args.device == "late-copy":
        from offload.devices import LateCopyDevice
        test_device = LateCopyDevice(max_delay=0.0)
    where = "cuda" if args.device == "cuda" else "cpu"
    tensors = [torch.randn(16 * MIB, device=where) for _ in range(total // (64 * MIB))]
    expected = [t.clone() for t in tensors[:2]]
    rates = {k: [] for k in ("offload write", "offload read", "naive write", "naive read",
                             "pinned D2H write", "pinned H2D read", "fio write", "fio read",
                             "fio read, offload's file", "overlap")}
    pinned = None
    if where == "cuda":  # raw copies to and from pinned host memory: the PCIe limit
        pinned = [torch.empty(16 * MIB, pin_memory=True) for _ in tensors]
    a = torch.randn(2048, 2048, device=where)

    def compute(n):
        for _ in range(n):
            torch.mm(a, a)

    compute(3)
    per_matmul = timed(lambda: compute(20), where) / 20

    path = os.path.join(args.directory, "gpu-bench-naive.pt")
    fio_mem, fio_buffers = hugepage_buffers(4 * MIB * 32)
    fio_extra = (fio_mem,) if fio_mem else ()
    with Offloader(args.directory, device=test_device) as off:
        for _ in range(args.repeats):
            rates["offload write"].append(total / timed(lambda: off.sync_writev(tensors), where) / 1e9)
            drop_page_cache()
            rates["offload read"].append(total / timed(lambda: off.sync_readv(tensors), where) / 1e9)
            assert all(torch.equal(x, y) for x, y in zip(tensors[:2], expected))
            # fio reading the file offload just read (it keeps it all the rounds): a
            # file's place on a disk moves its read rate (benchmarks/file_placement.py).
            drop_page_cache()
            gbps = fio_read_open_files([off._fd], 4 * MIB, total, extra=fio_extra)
            if gbps is not None:
                rates["fio read, offload's file"].append(gbps)

            def naive_write():
                with open(path, "wb") as f:
                    torch.save([t.cpu() for t in tensors], f)
                    f.flush()
                    os.fsync(f.fileno())

            rates["naive write"].append(total / timed(naive_write, where) / 1e9)
            drop_page_cache()
            rates["naive read"].append(
                total / timed(lambda: [t.to(where) for t in torch.load(path, weights_only=True)], where) / 1e9)
            if pinned is not None:
                rates["pinned D2H write"].append(total / timed(
                    lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors)], where) / 1e9)
                rates["pinned H2D read"].append(total / timed(
                    lambda: [t.copy_(p, non_blocking=True) for p, t in zip(pinned, tensors)], where) / 1e9)
            for rw in ("write", "read"):
                if rw == "read":
                    drop_page_cache()
                gbps = fio_run(args.directory, rw, 4 * MIB, total, extra=fio_extra)
                if gbps is not None:
                    rates[f"fio {rw}"].append(gbps)
            # Compute sized to last as long as each transfer: with much less, the
            # ratio says nothing (a perfect overlap would hide only a sliver).
            write_s = timed(lambda: off.sync_writev(tensors), where)
            read_s = timed(lambda: off.sync_readv(tensors), where)
            beside_write = max(1, round(write_s / per_matmul))
            beside_read = max(1, round(read_s / per_matmul))
            alone = timed(lambda: compute(beside_write + beside_read), where)

            def both():
                h = off.async_writev(tensors)
                compute(beside_write)
                h.wait()
                h = off.async_readv(tensors)
                compute(beside_read)
                h.wait()
            together = timed(both, where)
            rates["overlap"].append((alone + write_s + read_s) / together)  # 2.0 = perfect overlap
    for name in ("gpu-bench-naive.pt", "bench-fio.bin"):
        try:
            os.unlink(os.path.join(args.directory, name))
        except FileNotFoundError:
            pass
    fio = {rw: statistics.median(rates[f"fio {rw}"]) if rates[f"fio {rw}"] else None for rw in ("write", "read")}
    print(f"{len(tensors)} x 64 MiB on {args.device}, {args.repeats} interleaved runs, median (min-max), "
          f"then the first run (a fresh process's first cycle); fio buffers: {fio_buffers}")
    for name, values in rates.items():
        if not values:
            continue
        rw = name.split()[-1]
        has_reference = rw in fio and fio[rw] and name not in ("overlap", "fio read, offload's file")
        ratio = f"  x fio {statistics.median(values) / fio[rw]:.2f}" if has_reference else ""
        unit = "" if name == "overlap" else " GB/s"
        # The first run beside fio's first run: the same round, as every ratio here.
        first = f"  first {values[0]:.2f}" + (f" x fio {values[0] / rates[f'fio {rw}'][0]:.2f}" if ratio else "")
        print(f"  {name:16} {statistics.median(values):6.2f}{unit} ({min(values):.2f}-{max(values):.2f}){ratio}{first}")
    same_file = rates["fio read, offload's file"]
    if same_file:  # each round's read over fio's read of the very file it read
        print(f"  offload read over fio on its file, median of the rounds: "
              f"{median_ratio(rates['offload read'], same_file):.2f}")
    print("  overlap = (compute alone + transfers alone) / both together: 2.0 is perfect overlap")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "bytes": total, "fio_buffers": fio_buffers,
                       "runs": {k: v for k, v in rates.items() if v}},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
