"""How much where a file lies on the disk moves fio's rate on it.

    python benchmarks/file_placement.py DIR [--files 4] [--rounds 8] [--mib 1024] [--rw read] [--json out.json]

Makes ``--files`` files of the same size in DIR (allocated, then written
whole by fio), then, round after round, has fio do the same job on each
(O_DIRECT, io_uring, 4 MiB requests, 32 in flight, huge-page buffers where
root can have them; page cache dropped before reads), in an order rotated
and reversed from round to round. Prints each file's median GB/s, the
median of its per-round ratios to the first file's, and where its first
extent lies (``filefrag``). A file that is faster or slower in every round
carries that into any ratio to it: why ``python -m offload bench`` reads
each contender's own file with fio as well.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload.benchmark import drop_page_cache, fio_job, hugepage_buffers, median_ratio  # noqa: E402

MIB = 1 << 20


def first_extent(path):
    """filefrag's line for the file's first extent (logical, physical, length), or why not."""
    try:
        lines = subprocess.run(["filefrag", "-v", path], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        return f"(filefrag: {error})"
    rows = [line for line in lines.splitlines() if line.strip().startswith("0:")]
    extents = sum(1 for line in lines.splitlines() if line.strip()[:1].isdigit() and ":" in line)
    return f"{rows[0].strip() if rows else '?'} ({extents} extents)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rw", choices=("read", "write"), default="read")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.files < 2 or args.rounds < 1 or args.mib < 4:
        parser.error("--files must be >= 2, --rounds >= 1, --mib >= 4")
    size = args.mib // 4 * 4 * MIB
    mem, buffers = hugepage_buffers(32 * 4 * MIB)
    extra = (mem,) if mem else ()
    names = [f"placement-{i}.bin" for i in range(args.files)]
    paths = [os.path.join(args.directory, name) for name in names]
    runs = {name: [] for name in names}
    try:
        for name, path in zip(names, paths):
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            if fio_job(args.directory, "write", 4 * MIB, size, filename=name, extra=extra) is None:
                parser.error("fio is not installed")
        for round_ in range(args.rounds):
            shift = round_ // 2 % len(names)
            order = names[shift:] + names[:shift]
            for name in order[::-1] if round_ % 2 else order:
                if args.rw == "read":
                    drop_page_cache()
                runs[name].append(fio_job(args.directory, args.rw, 4 * MIB, size, filename=name,
                                          extra=extra)["bw_bytes"] / 1e9)
        report = {"rw": args.rw, "bytes": size, "rounds": args.rounds, "fio_buffers": buffers, "files": {}}
        reference = runs[names[0]]
        print(f"fio {args.rw}, {size // MIB} MiB a file, {args.rounds} rounds, {buffers} buffers")
        for name, path in zip(names, paths):
            ratio = median_ratio(runs[name], reference)
            report["files"][name] = {"runs": runs[name], "median_gbps": statistics.median(runs[name]),
                                     "ratio_to_first": ratio, "first_extent": first_extent(path)}
            print(f"  {name}  {statistics.median(runs[name]):5.2f} GB/s  x first file {ratio:5.3f}   "
                  f"{report['files'][name]['first_extent']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
