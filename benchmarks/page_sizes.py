"""Which transparent huge page size a fresh process's first reads want.

    python benchmarks/page_sizes.py DIR [--sizes 2048,256,4] [--rounds 3] [--mib 1024]

For each page size, round after round: enables only that THP size for
memory advised MADV_HUGEPAGE (4: none, base pages), waits for the memory the
last process freed to be handed back (a VM with free page reporting does so
~2 s after a free), then a fresh process maps new memory, advises it as the
buffer pool advises its blocks, and reads a file into it with O_DIRECT
(4 MiB requests, 32 in flight), page cache dropped: the first read faults
the memory in, the second lands in it again. Root only: it changes
/sys/kernel/mm/transparent_hugepage/hugepages-*kB/enabled, and puts every
setting back as it found it.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

THP = "/sys/kernel/mm/transparent_hugepage"

READER = r"""
import mmap, os, sys, time
from concurrent.futures import ThreadPoolExecutor
path, size, advise = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
CHUNK = 4 << 20
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf.madvise(mmap.MADV_HUGEPAGE if advise else mmap.MADV_NOHUGEPAGE)
view = memoryview(buf)

def read_all():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            done = sum(pool.map(lambda at: os.preadv(fd, [view[at:at + CHUNK]], at), range(0, size, CHUNK)))
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    assert done == size, done
    return size / seconds / 1e9

print(read_all(), read_all())
"""


def _settings():
    found = {}
    for path in glob.glob(f"{THP}/hugepages-*kB/enabled"):
        with open(path) as f:
            found[path] = f.read().split("[")[1].split("]")[0]
    return found


def _enable_only(kib, saved):
    for path in saved:
        with open(path, "w") as f:
            f.write("madvise" if path.endswith(f"/hugepages-{kib}kB/enabled") else "never")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--sizes", default="2048,256,4", help="KiB, comma-separated; 4: base pages")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=1024, help="the file read, in MiB (a multiple of 4)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds before each fresh process")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    saved = _settings()
    if os.geteuid() != 0 or not saved:
        print("needs root and a kernel with multi-size THP (hugepages-*kB under " + THP + ")", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    missing = [s for s in sizes if s != 4 and f"{THP}/hugepages-{s}kB/enabled" not in saved]
    if missing:
        print(f"this kernel has no THP size {missing} KiB", file=sys.stderr)
        return 2
    nbytes = args.mib << 20
    path = os.path.join(args.directory, "page-sizes.bin")
    with open(path, "wb") as f:
        block = os.urandom(4 << 20)
        for _ in range(nbytes // len(block)):
            f.write(block)
    runs = {s: [] for s in sizes}
    try:
        for _ in range(args.rounds):
            for kib in sizes:
                _enable_only(kib, saved)
                time.sleep(args.settle)
                out = subprocess.run([sys.executable, "-c", READER, path, str(nbytes), str(int(kib != 4))],
                                     capture_output=True, text=True, check=True).stdout
                runs[kib].append([float(x) for x in out.split()])
    finally:
        for setting_path, setting in saved.items():
            with open(setting_path, "w") as f:
                f.write(setting)
        os.unlink(path)
    report = {}
    print(f"{args.mib} MiB read with O_DIRECT into new memory, a fresh process each, medians of {args.rounds}:")
    for kib, values in runs.items():
        first, again = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        report[kib] = {"first_gbps": first, "again_gbps": again, "runs": values}
        name = "base pages (4 KiB)" if kib == 4 else f"{kib} KiB pages"
        print(f"  {name:<20} first read {first:5.2f} GB/s   read again {again:5.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
