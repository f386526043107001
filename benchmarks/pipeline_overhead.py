"""Does the GPU staging pipeline serialize anything? The same tensors through
the plain CPU path (which writes in place, copying nothing), the CPU path made
to copy each byte once (as the pipeline must), the device pipeline on the
late-copy test device with zero copy delay (its "device" copies are CPU
memcpys on a worker thread), and the same pipeline with its copies skipped
(what the pipeline's structure costs without the test device's memcpys, which
share this machine's cores with the disk; a GPU's copies are DMA),
interleaved, medians.

    python benchmarks/pipeline_overhead.py DIR [--repeats 5] [--total-mib 1024]
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


class _CopylessDevice(LateCopyDevice):
    """The test device with every copy skipped (done at once): staging slots
    go to the disk with whatever they hold. For timing only."""

    def copy(self, dst, src, after):
        return self.caller_event()  # an event that has already happened


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--staging", default="16x16", help="staging buffers x MiB each (default 16x16)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    total = whole_tensors(parser, args.total_mib, 64 * MIB)
    slots, slot_mib = (int(v) for v in args.staging.split("x"))
    count = total // (64 * MIB)
    contenders = {
        "cpu path": (Offloader(args.directory), [torch.randn(16 * MIB) for _ in range(count)]),
        # The same path made to copy every byte once, as the pipeline must: the
        # tensors are replaced by fresh clones (untimed) so each write is staged.
        "cpu path, staged": (Offloader(args.directory), [torch.randn(16 * MIB) for _ in range(count)]),
        "device pipeline": (Offloader(args.directory, device=LateCopyDevice(max_delay=0.0),
                                      staging_buffers=slots, staging_buffer_bytes=slot_mib * MIB),
                            [torch.randn(16 * MIB) for _ in range(count)]),
        "pipeline, copies skipped": (Offloader(args.directory, device=_CopylessDevice(),
                                               staging_buffers=slots, staging_buffer_bytes=slot_mib * MIB),
                                     [torch.randn(16 * MIB) for _ in range(count)]),
    }
    rates = {(name, rw): [] for name in contenders for rw in ("write", "read")}
    for round_ in range(args.repeats + 1):
        for name, (off, tensors) in contenders.items():
            if name == "cpu path, staged":
                tensors[:] = [t.clone() for t in tensors]
                off.synchronize()
            start = time.perf_counter()
            off.sync_writev(tensors)
            middle = time.perf_counter()
            off.sync_readv(tensors)
            end = time.perf_counter()
            if round_:  # the first round allocates fresh memory: warm-up
                rates[(name, "write")].append(total / (middle - start) / 1e9)
                rates[(name, "read")].append(total / (end - middle) / 1e9)
    for off, _ in contenders.values():
        off.close()
    print(f"{count} x 64 MiB, {args.repeats} interleaved rounds after one warm-up, median (min-max) GB/s")
    for rw in ("write", "read"):
        dev = statistics.median(rates[("device pipeline", rw)])
        cells = []
        for name in contenders:
            values = rates[(name, rw)]
            cells.append(f"{name} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"  {rw:5}: " + ", ".join(cells))
        cpu = statistics.median(rates[("cpu path", rw)])
        print(f"         pipeline / cpu path {dev / cpu:.2f}, "
              f"pipeline / cpu path staged {dev / statistics.median(rates[('cpu path, staged', rw)]):.2f}, "
              f"pipeline with copies skipped / cpu path "
              f"{statistics.median(rates[('pipeline, copies skipped', rw)]) / cpu:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({rw: {name: rates[(name, rw)] for name in contenders} for rw in ("write", "read")},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
