"""What a staged write can reach here: fio's write beside a copy of the same bytes.

A new torch tensor's memory (64 bytes past a page, on 4 KiB pages) misses
O_DIRECT's alignment on most disks, so an Offloader copies it into a pool
block and writes the block (README, Engines). Where the disk's transfers and
that copy share one memory system (a VM's virtio disk is the host reading
guest memory), the copy slows the disk: the limit for such a write is not fio
alone but fio with the same copy running beside it.

Each round, fio alone first (the others' pace and reference), then the rest
in an order rotated and reversed from round to round:

- ``fio``: fio writing ``--total-mib`` with huge-page buffers (the bench's
  limit: O_DIRECT, io_uring, 4 MiB requests, iodepth 32), overwriting its file;
- ``fio beside a copy``: the same job while a thread of this process copies new
  torch tensors (4 KiB pages) into huge-page blocks 4 MiB at a time, paced at
  the rate fio reached alone in the round (the rate at which an Offloader
  copies while the disk keeps up); the copier runs from before fio starts
  until it ends;
- ``new tensors``: an Offloader writing the same number of bytes as new
  tensors (cloned untimed before each write, as the bench's "new tensors");
- ``rewrites``: the same Offloader writing the tensors its last read gave
  back (pool blocks: written as they are, nothing copied).

Printed: medians of each round's ratio to fio alone, the rate the copier
kept beside fio, and whether the rewritten tensors read back bit for bit.
``fio beside a copy`` over fio is what the copy's memory traffic costs the
disk; where the copier also falls behind fio's rate (it copied fewer bytes
than fio wrote meanwhile), a staged write, which must do both to every
byte, cannot reach even that.

    python benchmarks/staged_write_floor.py DIR [--total-mib 1024] [--tensor-mib 64] [--repeats 5] [--json FILE]
"""
import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time

import torch

from offload import Offloader
from offload.benchmark import (MIB, drop_page_cache, fio_job, hugepage_buffers, make_tensors, measure,
                               release_hugepage_buffers)

BLOCK = 4 * MIB
RING = 32  # 128 MiB of blocks, as much as an Offloader keeps staged in flight


def huge_page_blocks(count: int, size: int):
    """``count`` tensors of ``size`` bytes on transparent huge pages, faulted in."""
    area = mmap.mmap(-1, count * size + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-(torch.frombuffer(area, dtype=torch.uint8).data_ptr()) % (2 << 20))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(area, dtype=torch.uint8)[start:start + count * size]
    whole.fill_(0)
    return area, [whole[i * size:(i + 1) * size] for i in range(count)]


class PacedCopier(threading.Thread):
    """Copies ``sources`` 4 MiB at a time into a ring of huge-page blocks at
    ``gbps`` (or as fast as it can, when that is slower) until stopped
    (torch's copy releases the GIL)."""

    def __init__(self, sources, ring, gbps):
        super().__init__(daemon=True)
        self.slices = [s[i:i + BLOCK] for s in sources for i in range(0, s.numel(), BLOCK)]
        self.ring, self.gbps = ring, gbps
        self.stop = threading.Event()
        self.copied = 0

    def run(self):
        start = time.perf_counter()
        i = 0
        while not self.stop.is_set():
            ahead = start + self.copied / (self.gbps * 1e9) - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            piece = self.slices[i % len(self.slices)]
            self.ring[i % len(self.ring)][:piece.numel()].copy_(piece)
            self.copied += piece.numel()
            i += 1


def fio_write(directory, total, mem):
    job = fio_job(directory, "write", BLOCK, total, filename="staged-floor-fio.bin", extra=(mem,))
    return job["bw_bytes"] / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    total, size = args.total_mib * MIB, args.tensor_mib * MIB
    mem, note = hugepage_buffers(BLOCK * 32)
    if mem is None:
        sys.exit(f"needs fio on huge-page buffers ({note})")
    template = make_tensors(total // size, size)
    area, ring = huge_page_blocks(RING, BLOCK)
    off = Offloader(args.directory)
    fio_write(args.directory, total, mem)                 # fio's file made, untimed
    rewritten = [t.clone() for t in template]
    for _ in range(2):                                    # untimed: the extents made, the tensors on pool blocks
        off.async_writev(rewritten)
        off.synchronize()
        off.sync_readv(rewritten)
    runs = {"fio": [], "fio beside a copy": [], "new tensors": [], "rewrites": []}
    copied_gbps = []

    def beside_copy(gbps):
        sources = [t.clone() for t in template]
        copier = PacedCopier(sources, ring, gbps)
        copier.start()
        started = time.perf_counter()
        time.sleep(0.05)
        result = fio_write(args.directory, total, mem)
        copier.stop.set()
        copier.join()
        copied_gbps.append(copier.copied / (time.perf_counter() - started) / 1e9)
        return result

    def new_tensors():
        tensors = [t.clone() for t in template]
        seconds = measure(lambda: (off.async_writev(tensors), off.synchronize()))
        del tensors
        return total / seconds / 1e9

    def rewrites():
        seconds = measure(lambda: (off.async_writev(rewritten), off.synchronize()))
        off.sync_readv(rewritten)
        return total / seconds / 1e9

    others = ["fio beside a copy", "new tensors", "rewrites"]
    for r in range(args.repeats):
        alone = fio_write(args.directory, total, mem)
        runs["fio"].append(alone)
        order = others[r % len(others):] + others[:r % len(others)]
        for name in (order if r % 2 == 0 else order[::-1]):
            drop_page_cache()
            runs[name].append(beside_copy(alone) if name == "fio beside a copy" else
                              new_tensors() if name == "new tensors" else rewrites())
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f} GB/s" for n, v in runs.items()), flush=True)
    intact = all(torch.equal(a, b) for a, b in zip(rewritten, template))  # after the rounds' last read
    off.close()
    os.unlink(os.path.join(args.directory, "staged-floor-fio.bin"))
    release_hugepage_buffers()
    del area

    ratio = {name: statistics.median(a / b for a, b in zip(runs[name], runs["fio"])) for name in others}
    report = {"runs": runs, "x_fio": ratio, "copier_gbps": copied_gbps, "data_intact": intact,
              "new_over_floor": statistics.median(n / f for n, f in zip(runs["new tensors"],
                                                                        runs["fio beside a copy"]))}
    print(f"\n{args.total_mib} MiB as {args.tensor_mib} MiB tensors, {args.repeats} rounds, medians x fio alone "
          f"(huge-page buffers; fio {min(runs['fio']):.2f}-{max(runs['fio']):.2f} GB/s):")
    for name in others:
        print(f"  {name:18s} {ratio[name]:.2f}")
    print(f"  new tensors over fio beside a copy: {report['new_over_floor']:.2f}")
    print(f"  the copier kept {statistics.median(copied_gbps):.2f} GB/s (median) beside fio; "
          f"rewritten tensors read back intact: {intact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
