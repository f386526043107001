"""How much of a transfer is left for the wait when the caller is away.

    python benchmarks/between_calls.py DIR [--total-mib 1024] [--idle 3] [--repeats 2] [--json F]

Issues 64 MiB CPU tensors with async_writev (then async_readv), makes no call
into the Offloader for --idle seconds (as a training step computing would),
then times the wait. Beside it, the same transfer alone (sync_writev /
sync_readv). Run for the CPU path and for the GPU pipeline on the late-copy
test device. A wait near 0 means the transfer moved while the caller was away;
a wait near the transfer alone means it stopped at the engine's in-flight
window (or the staging ring) until the next call.
"""
import argparse
import json
import statistics
import sys
import time

import torch

from offload import Offloader
from offload.benchmark import whole_tensors
from offload.devices import LateCopyDevice

MIB = 1 << 20


def measure(directory, device, total_mib, idle, repeats):
    tensors = [torch.randn(16 * MIB) for _ in range(total_mib // 64)]
    expected = tensors[0].clone()
    rows = {k: [] for k in ("write alone", "write wait", "read alone", "read wait")}
    with Offloader(directory, device=device) as off:
        off.sync_writev(tensors)
        off.sync_readv(tensors)
        for _ in range(repeats):
            start = time.perf_counter()
            off.sync_writev(tensors)
            rows["write alone"].append(time.perf_counter() - start)
            start = time.perf_counter()
            off.sync_readv(tensors)
            rows["read alone"].append(time.perf_counter() - start)
            for kind, issue in (("write", off.async_writev), ("read", off.async_readv)):
                handle = issue(tensors)
                time.sleep(idle)
                start = time.perf_counter()
                handle.wait()
                rows[f"{kind} wait"].append(time.perf_counter() - start)
        assert torch.equal(tensors[0], expected)
    return {k: statistics.median(v) for k, v in rows.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the figures (seconds, medians) here")
    args = parser.parse_args(argv)
    whole_tensors(parser, args.total_mib, 64 * MIB)
    report = {}
    for name, device in (("cpu", None), ("late-copy device", LateCopyDevice(max_delay=0.0))):
        r = report[name] = measure(args.directory, device, args.total_mib, args.idle, args.repeats)
        print(f"{name:16}  write: {r['write wait']:.3f} s left after {args.idle:g} s away "
              f"(alone {r['write alone']:.3f} s)   read: {r['read wait']:.3f} s left "
              f"(alone {r['read alone']:.3f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"idle_s": args.idle, "bytes": args.total_mib * MIB, "paths": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
