"""What striping over several directories costs, and what it buys.

1. The same disk: one Offloader on one directory against one striped over
   two directories of the same file system (what striping costs when the
   directories share a drive). 64 MiB tensors written then read back (page
   cache dropped), each Offloader keeping its tensors across rounds, after
   two untimed rounds, in an order reversed every other round, medians, as a
   ratio to the single directory. After each read fio reads that
   Offloader's own files (the striped one's in turn, 4 MiB each, as it
   stripes them): a file's place on the disk moves its read rate by a few
   percent (benchmarks/file_placement.py) and each Offloader keeps its
   files, so the read is also given as each round's read over that fio
   read, over the one directory's the same way.
2. Separate drives, modelled (root): two ext4 images on loop devices, each
   capped at ``--cap-mbps`` for reads and writes by a blkio cgroup (the
   kernel's own throttle, per device). A subprocess in that cgroup runs one
   directory against both. With n capped devices the striped Offloader can
   reach n times one; this shows whether it does. Real scaling needs real
   drives: the cap stands for each drive's bandwidth, nothing else is modelled.

Each part also saves and loads the same bytes as a sharded checkpoint
(``offload.save(..., stripe=...)``, durable; ``offload.load`` with the page
cache dropped), one directory (one shard) against two (a shard each), and
through torch.distributed.checkpoint (``offload.dcp.Writer(..., stripe=...)``
and ``Reader``, one process), one data file against one per directory.

    python benchmarks/striping.py DIR [--total-mib 1024] [--rounds 5] [--cap-mbps 300] [--capped-mib 512]
"""
import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import offload
from offload import Offloader
from offload._atomic_file import wait_for_frees
from offload.benchmark import (drop_page_cache, fio_read_open_files, hugepage_buffers, make_tensors, median_ratio,
                               whole_tensors)

MIB = 1 << 20
TENSOR = 64 * MIB


def backing_fds(off) -> list:
    """The descriptors of an Offloader's backing files, one per directory."""
    return [f.fd for f in getattr(off._file, "files", [off._file])]


def rounds(contenders, total, count, same_files=False) -> dict:
    """{name: {"write": [GB/s...], "read": [...]}} over ``count`` rounds,
    the order reversed every other round, after two untimed rounds (a
    process's first cycles fault in new memory). With ``same_files``, each
    read is followed by fio reading that Offloader's own files ("fio
    read"): where a file lies on a disk moves its read rate, and each
    Offloader keeps its files across the rounds."""
    out = {name: {"write": [], "read": []} for name in contenders}
    mem = hugepage_buffers(32 * 4 * MIB)[0] if same_files else None
    for round_index in range(-2, count):
        names = list(contenders) if round_index % 2 == 0 else list(contenders)[::-1]
        for name in names:
            off, tensors = contenders[name]
            drop_page_cache()
            start = time.perf_counter()
            off.sync_writev(tensors)
            write = total / (time.perf_counter() - start) / 1e9
            drop_page_cache()
            start = time.perf_counter()
            off.sync_readv(tensors)
            read = total / (time.perf_counter() - start) / 1e9
            if round_index < 0:
                continue
            out[name]["write"].append(write)
            out[name]["read"].append(read)
            if same_files:
                drop_page_cache()
                gbps = fio_read_open_files(backing_fds(off), 4 * MIB, total, extra=(mem,) if mem else ())
                if gbps is not None:
                    out[name].setdefault("fio read", []).append(gbps)
    return out


def compare(directory_sets, total, count, same_files=False) -> dict:
    """One Offloader per set of directories, the same tensors' bytes in each."""
    contenders, expected = {}, make_tensors(total // TENSOR, TENSOR)
    try:
        for name, directories in directory_sets.items():
            contenders[name] = (Offloader(directories), [t.clone() for t in expected])
        results = rounds(contenders, total, count, same_files)
        for name, (off, tensors) in contenders.items():
            if not all(torch.equal(a, b) for a, b in zip(tensors, expected)):
                raise AssertionError(f"{name} returned different bytes")
    finally:
        for off, _ in contenders.values():
            off.close()
    return results


def sharded_safetensors(state, first, stripe):
    """offload.save of a sharded checkpoint (the index in ``first``); returns how to load it."""
    index = os.path.join(first, "model.safetensors.index.json")
    offload.save(state, index, stripe=stripe, progress=False)
    return lambda: offload.load(index, progress=False)


def dcp_rounds(sets, total, count):
    """The DCP rounds, or {"skipped": why} where offload.dcp needs a newer torch."""
    try:
        importlib.import_module("offload.dcp")
    except ImportError as error:
        return {"skipped": str(error)}
    return checkpoint_rounds(sets, total, count, distributed_checkpoint)


def distributed_checkpoint(state, first, stripe):
    """torch.distributed.checkpoint through offload.dcp (one process); returns how to load it."""
    import torch.distributed.checkpoint as dcp
    import offload.dcp
    dcp.save(state, storage_writer=offload.dcp.Writer(first, stripe=stripe))

    def load():
        out = {k: torch.empty_like(t) for k, t in state.items()}
        dcp.load(out, storage_reader=offload.dcp.Reader(first))
        return out
    return load


def checkpoint_rounds(directory_sets, total, count, save=sharded_safetensors) -> dict:
    """``save`` (durable) then its load (page cache dropped) of one state
    dict, per set of directories (the checkpoint in the first, ``stripe=``
    the rest): {name: {"write": [...], "read": [...]}} over ``count`` rounds,
    interleaved, the order reversed every other round."""
    state = {f"layer{i}": t for i, t in enumerate(make_tensors(total // TENSOR, TENSOR))}
    out = {name: {"write": [], "read": []} for name in directory_sets}
    names, made = list(directory_sets), set()
    for round_index in range(count):
        for name in (names if round_index % 2 == 0 else names[::-1]):
            first, *stripe = [os.path.join(d, f"{save.__name__}-" + name.split(",")[0].replace(" ", "-"))
                              for d in directory_sets[name]]
            for d in [first] + stripe:
                os.makedirs(d, exist_ok=True)
                made.add(d)
            drop_page_cache()
            start = time.perf_counter()
            load = save(state, first, stripe)
            out[name]["write"].append(total / (time.perf_counter() - start) / 1e9)
            wait_for_frees()  # the files it replaced, freed after it returned: not in the load's time
            drop_page_cache()
            start = time.perf_counter()
            loaded = load()
            out[name]["read"].append(total / (time.perf_counter() - start) / 1e9)
            if not all(torch.equal(loaded[k], t) for k, t in state.items()):
                raise AssertionError(f"{name}: the checkpoint loaded different bytes")
            del loaded
    for d in made:
        shutil.rmtree(d)
    return out


def summary(results, reference) -> dict:
    if "skipped" in results:
        return results
    table = {}
    for name, runs in results.items():
        table[name] = {}
        for rw in ("write", "read"):
            values = runs[rw]
            median = statistics.median(values)
            table[name][rw] = {"median": median, "runs": values,
                               "ratio": median / statistics.median(results[reference][rw])}
        fio, ref = runs.get("fio read"), results[reference]
        if fio and ref.get("fio read"):
            # Each round's read over fio's on the same files, then over the reference's
            # the same way: the ratio without the luck of where either's files lie.
            table[name]["read"]["fio_runs"] = fio
            table[name]["read"]["ratio_on_its_files"] = median_ratio(
                [ours / theirs for ours, theirs in zip(runs["read"], fio)],
                [ours / theirs for ours, theirs in zip(ref["read"], ref["fio read"])])
    return table


def print_table(title, table):
    print(f"\n{title}")
    if "skipped" in table:
        print(f"  skipped: {table['skipped']}")
        return
    same_files = any("ratio_on_its_files" in row["read"] for row in table.values())
    print(f"  {'':34} {'write GB/s':>11} {'ratio':>6}   {'read GB/s':>10} {'ratio':>6}"
          + ("   ratio, each over fio on its files" if same_files else ""))
    for name, row in table.items():
        print(f"  {name:34} {row['write']['median']:11.2f} {row['write']['ratio']:6.2f}   "
              f"{row['read']['median']:10.2f} {row['read']['ratio']:6.2f}"
              + (f"   {row['read']['ratio_on_its_files']:6.2f}" if "ratio_on_its_files" in row["read"] else ""))


def same_disk(directory, total, count) -> dict:
    a, b = (tempfile.mkdtemp(prefix="stripe-", dir=directory) for _ in range(2))
    try:
        sets = {"one directory": [a], "two directories, same disk": [a, b]}
        results = compare(sets, total, count, same_files=True)
        saved = checkpoint_rounds(sets, total, count)
        dcp_saved = dcp_rounds(sets, total, count)
    finally:
        shutil.rmtree(a), shutil.rmtree(b)
    return [summary(r, "one directory") for r in (results, saved, dcp_saved)]


def capped_worker(directories, total, count, cgroup) -> None:
    """Runs inside the throttling cgroup: prints the results as JSON."""
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    sets = {"one capped device": directories[:1], "two capped devices, striped": directories}
    print(json.dumps([compare(sets, total, count), checkpoint_rounds(sets, total, count),
                      dcp_rounds(sets, total, count)]))


def capped(directory, total, count, cap_bytes):
    """Two loop-mounted ext4 images, each throttled to ``cap_bytes``/s: the
    summaries of the Offloaders, the sharded checkpoints and DCP (or
    {"skipped": why})."""
    if os.geteuid() != 0:
        return {"skipped": "needs root (loop mounts, a blkio cgroup)"}
    cgroup_root = "/sys/fs/cgroup/blkio"
    if not os.path.isdir(cgroup_root):
        cgroup_root = "/sys/fs/cgroup"   # cgroup v2: io.max instead
    work = tempfile.mkdtemp(prefix="stripe-capped-", dir=directory)
    cgroup = os.path.join(cgroup_root, f"offload-striping-{os.getpid()}")
    mounts, devices = [], []
    try:
        for i in range(2):
            image, mount = os.path.join(work, f"drive{i}.img"), os.path.join(work, f"drive{i}")
            os.mkdir(mount)
            with open(image, "wb") as f:
                # all of one contender and half of the other, for the Offloaders, then
                # for the checkpoints (each saved beside the old one it replaces)
                f.truncate(2 * (2 * total) + 512 * MIB)
            subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True)
            subprocess.run(["mount", "-o", "loop", image, mount], check=True)
            mounts.append(mount)
            st = os.stat(subprocess.run(["findmnt", "-n", "-o", "SOURCE", mount], capture_output=True,
                                        text=True, check=True).stdout.strip())
            devices.append(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
        os.mkdir(cgroup)
        for device in devices:
            if cgroup_root.endswith("blkio"):
                for knob in ("read_bps_device", "write_bps_device"):
                    with open(os.path.join(cgroup, f"blkio.throttle.{knob}"), "w") as f:
                        f.write(f"{device} {cap_bytes}")
            else:
                with open(os.path.join(cgroup, "io.max"), "w") as f:
                    f.write(f"{device} rbps={cap_bytes} wbps={cap_bytes}")
        worker = subprocess.run([sys.executable, __file__, "--capped-worker", json.dumps(mounts), str(total),
                                 str(count), cgroup], capture_output=True, text=True)
        if worker.returncode != 0:
            raise RuntimeError(f"the capped-device worker failed:\n{worker.stderr}")
        return [summary(r, "one capped device") for r in json.loads(worker.stdout.strip().splitlines()[-1])]
    finally:
        for mount in mounts:
            subprocess.run(["umount", mount], capture_output=True)
        if os.path.isdir(cgroup):
            os.rmdir(cgroup)
        shutil.rmtree(work, ignore_errors=True)


SHARDED = "the same bytes as a sharded checkpoint: offload.save (durable) and offload.load"
DCP = "the same bytes through torch.distributed.checkpoint: offload.dcp.Writer (durable) and Reader"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--capped-worker":
        capped_worker(json.loads(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per round, same disk (MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cap-mbps", type=int, default=300, help="each capped device's limit (MB/s)")
    parser.add_argument("--capped-mib", type=int, default=512, help="bytes per round, capped devices (MiB)")
    parser.add_argument("--no-capped", action="store_true", help="skip the capped-device model")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    total = whole_tensors(parser, args.total_mib, TENSOR)
    capped_total = whole_tensors(parser, args.capped_mib, TENSOR)
    report = {}
    report["same_disk"], report["same_disk_checkpoints"], report["same_disk_dcp"] = same_disk(
        args.directory, total, args.rounds)
    print_table(f"{args.total_mib} MiB of 64 MiB tensors, medians of {args.rounds} rounds, ratio to one directory",
                report["same_disk"])
    print_table(SHARDED, report["same_disk_checkpoints"])
    print_table(DCP, report["same_disk_dcp"])
    if not args.no_capped:
        capped_report = capped(args.directory, capped_total, args.rounds, args.cap_mbps * 1000 * 1000)
        report["cap_mbps"] = args.cap_mbps
        if "skipped" in capped_report:
            report["capped"] = capped_report
            print(f"\ncapped devices: skipped, {capped_report['skipped']}")
        else:
            report["capped"], report["capped_checkpoints"], report["capped_dcp"] = capped_report
            print_table(f"{args.capped_mib} MiB, two loop devices each capped at {args.cap_mbps} MB/s (blkio "
                        f"throttle), medians of {args.rounds} rounds, ratio to one device", report["capped"])
            print_table(SHARDED, report["capped_checkpoints"])
            print_table(DCP, report["capped_dcp"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
