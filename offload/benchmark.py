"""The benchmark: offload's engines beside fio, a Python thread pool and
torch.save/torch.load, on the same directory, interleaved, medians of N.

    python -m offload bench DIR [--repeats 3] [--total-mib 2048] [--json out.json]

Each engine runs twice: rewriting the tensors its last read gave back (pool
blocks, written as they are) and writing new tensors every round (torch's own
memory, copied out; "new tensors"). Every figure is GB/s (1e9 bytes/s) and its
ratio to fio's median for the same layout and direction, measured in the same
run. fio runs with huge-page buffers where root can mount hugetlbfs: with
4 KiB-page buffers a disk that takes few segments a request (virtio: 254)
splits every large O_DIRECT request, and fio then reads at a fraction of what
the disk does. The default-buffer fio figure is reported beside it. Writes are
durable when timed (O_DIRECT, or followed by fsync for the buffered
alternatives); the page cache is dropped before reads when the process may
(root).

The steady state: each contender first runs ``--warmup`` untimed rounds
(default 2; a process's first cycles fault in and register new memory,
which the fresh-process rows time on their own) and fio writes its file
once untimed (its first write allocates it), then the timed rounds.
After each timed read, fio reads the file that offload contender wrote, the
same job on the same bytes: where a file lies on the disk moves its read
rate, so "x fio on its file" (the median of each round's ratio) is the read
figure without that file's luck. Writes are not compared that way (fio would
overwrite the contender's data; overwrites did not vary between files).
"""
import argparse
import atexit
import contextlib
import concurrent.futures
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

from .doctor import free_page_reporting
from .offloader import Offloader

KIB, MIB = 1 << 10, 1 << 20
LAYOUTS = {"64MiB": 64 * MIB, "1MiB": MIB, "64KiB": 64 * KIB}
FIO_BLOCK = {"64MiB": 4 * MIB}  # the disk splits anything larger; others use the tensor size


class Progress:
    """One status line on a terminal (redrawn), plain lines otherwise."""

    def __init__(self, total):
        self.total, self.done, self.tty = total, 0, sys.stderr.isatty()

    def step(self, label):
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write("\n")


def whole_tensors(parser, total_mib: int, tensor_bytes: int) -> int:
    """``total_mib`` in bytes, or ``parser.error`` unless it is a whole,
    nonzero number of tensors of ``tensor_bytes``: a benchmark makes
    ``total // tensor_bytes`` tensors, and its rates divide the bytes moved."""
    total = total_mib * MIB
    if total < tensor_bytes or total % tensor_bytes:
        parser.error(f"--total-mib {total_mib} is not a whole number of {tensor_bytes / MIB:g} MiB tensors")
    return total


def drop_page_cache():
    if os.geteuid() != 0:
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------ block-layer trace
TRACING = "/sys/kernel/tracing"
_BLOCK_EVENT = re.compile(r"\s([\d.]+): block_rq_(issue|complete): (\d+),(\d+) \S+ (?:\d+ )?\(\) (\d+) \+ (\d+)")


def whole_disk(directory):
    """(major, minor) of the disk holding ``directory`` (a partition's disk)."""
    dev = os.stat(directory).st_dev
    node = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if os.path.exists(os.path.join(node, "partition")):
        with open(os.path.join(os.path.dirname(node), "dev")) as f:
            return tuple(int(x) for x in f.read().split(":"))
    return os.major(dev), os.minor(dev)


def _temporary_mount(fstype: str, prefix: str):
    """Mounts a ``fstype`` file system on a new temporary directory (root):
    (its path, "") or ("", why not), the directory removed again."""
    mount = tempfile.mkdtemp(prefix=prefix)
    result = subprocess.run(["mount", "-t", fstype, "none", mount], capture_output=True, text=True)
    if result.returncode != 0:
        os.rmdir(mount)
        return "", result.stderr.strip()
    return mount, ""


def _unmount(mount: str) -> None:
    """Undoes _temporary_mount (quietly: at exit, nothing is left to tell).
    A mount still in use (a fio that the same SIGTERM is ending) is
    detached lazily, and goes once its last user does."""
    if subprocess.run(["umount", mount], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", mount], capture_output=True)
    with contextlib.suppress(OSError):
        os.rmdir(mount)


_undo_on_sigterm = []


def _undo_at_exit(undo) -> None:
    """Runs ``undo`` at exit, and when SIGTERM ends the process (timeout(1),
    a job scheduler), whose default action skips atexit and would leave the
    machine's mounts and huge-page reserve behind: SIGTERM, where it still
    has its default action, then runs every such ``undo`` and ends the
    process by SIGTERM as before. ``_forget_undo`` drops ``undo`` again."""
    atexit.register(undo)
    _undo_on_sigterm.append(undo)
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _undo_then_die)


def _forget_undo(undo) -> None:
    atexit.unregister(undo)
    with contextlib.suppress(ValueError):
        _undo_on_sigterm.remove(undo)


def _undo_then_die(signum, frame) -> None:
    while _undo_on_sigterm:
        with contextlib.suppress(Exception):
            _undo_on_sigterm.pop()()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def tracing_dir():
    """Where tracefs is: TRACING when mounted there, else (as root) a mount
    of this process's own on a temporary directory, unmounted at exit (many
    systems leave tracefs unmounted); None when neither."""
    global _tracefs
    if os.path.isdir(os.path.join(TRACING, "instances")):
        return TRACING
    if _tracefs is None:
        _tracefs = ""
        if os.geteuid() == 0:
            mount, _ = _temporary_mount("tracefs", "offload-tracefs-")
            if mount:
                _tracefs = mount
                _undo_at_exit(functools.partial(_unmount, mount))
    return _tracefs or None


_tracefs = None


@contextlib.contextmanager
def block_trace(directory, events):
    """Appends (monotonic seconds, "issue" or "complete", first sector) for
    each data request of the disk holding ``directory`` to ``events`` (cache
    flushes, which carry no sectors, are left out: their completion is not
    traced as such), from a tracefs instance made for the purpose (removed
    after; tracefs mounted first where it is not: ``tracing_dir``). Yields
    whether it could trace."""
    tracing = tracing_dir()
    instance = os.path.join(tracing or TRACING, "instances", f"offload_benchmark_{os.getpid()}")
    try:
        os.mkdir(instance)
    except OSError:
        yield False
        return
    try:
        def put(name, value):
            with open(os.path.join(instance, name), "w") as f:
                f.write(value)
        put("trace_clock", "mono")  # time.monotonic's clock
        put("buffer_size_kb", "16384")
        for event in ("block_rq_issue", "block_rq_complete"):
            put(f"events/block/{event}/enable", "1")
        put("tracing_on", "1")
        yield True
        put("tracing_on", "0")
        disk = whole_disk(directory)
        with open(os.path.join(instance, "trace")) as f:
            for line in f:
                m = _BLOCK_EVENT.search(line)
                if m and (int(m[3]), int(m[4])) == disk and int(m[6]) > 0:
                    events.append((float(m[1]), m[2], int(m[5])))
    finally:
        for event in ("block_rq_issue", "block_rq_complete"):
            with contextlib.suppress(OSError), open(os.path.join(instance, f"events/block/{event}/enable"), "w") as f:
                f.write("0")
        with contextlib.suppress(OSError):
            os.rmdir(instance)


def idle_gaps(events, start, end):
    """The intervals within [start, end] when the disk had no request in
    flight (a request is its first sector, from its issue to its completion;
    a completion of one issued before the trace began changes nothing)."""
    in_flight, idle_since, gaps = set(), start, []
    for t, kind, sector in sorted(events):
        if t > end:
            break
        if kind == "issue":
            if not in_flight and t > max(idle_since, start):
                gaps.append((max(idle_since, start), t))
            in_flight.add(sector)
        elif sector in in_flight:
            in_flight.discard(sector)
            if not in_flight:
                idle_since = t
    if not in_flight and end > max(idle_since, start):
        gaps.append((max(idle_since, start), end))
    return gaps


def completion_bursts(events, start, end, within=1e-4):
    """The completions within [start, end] in bursts (each less than
    ``within`` seconds after the one before): per burst, (how many requests,
    how many were left in flight after it)."""
    in_flight, bursts, last = set(), [], None
    for t, kind, sector in sorted(events):
        if t > end:
            break
        if kind == "issue":
            in_flight.add(sector)
            continue
        in_flight.discard(sector)
        if t < start:
            continue
        if last is not None and t - last < within:
            bursts[-1][0] += 1
        else:
            bursts.append([1, 0])
        bursts[-1][1] = len(in_flight)
        last = t
    return [tuple(b) for b in bursts]


def disk_activity(events, start, end):
    """What a block trace saw of [start, end]: its idle gaps, and a summary
    (seconds idle, gaps, the largest, completion bursts, requests a burst,
    bursts that left the disk with nothing in flight)."""
    gaps, bursts = idle_gaps(events, start, end), completion_bursts(events, start, end)
    return gaps, {"idle_seconds": sum(b - a for a, b in gaps), "idle_gaps": len(gaps),
                  "largest_gap_seconds": max((b - a for a, b in gaps), default=0.0), "bursts": len(bursts),
                  "requests_per_burst": statistics.mean(n for n, _ in bursts) if bursts else 0.0,
                  "bursts_emptying": sum(left == 0 for _, left in bursts)}


def make_tensors(count, size):
    """count tensors of size bytes holding random data (one random block, repeated)."""
    block = torch.randint(0, 256, (min(size, 64 * MIB),), dtype=torch.uint8)
    tensors = []
    for _ in range(count):
        t = torch.empty(size, dtype=torch.uint8)
        for start in range(0, size, block.numel()):
            n = min(block.numel(), size - start)
            t[start:start + n].copy_(block[:n])
        tensors.append(t)
    return tensors


# --------------------------------------------------------------------- contenders
class OffloadContender:
    def __init__(self, directory, backend, tensors):
        self.name = f"offload-{backend}"
        self.off = Offloader(directory, backend=backend)
        self.tensors = tensors

    def write(self):
        self.off.async_writev(self.tensors)
        self.off.synchronize()

    def read(self):
        self.off.sync_readv(self.tensors)

    def close(self):
        self.off.close()


class NewTensorsContender(OffloadContender):
    """Writes new tensors every round, as a training step writes its new
    activations or state: each round's are cloned, untimed, just before the
    write, so it copies out of torch's own memory (staged where the file's
    O_DIRECT alignment refuses that memory), not out of the pool blocks the
    last read left."""

    def __init__(self, directory, backend, template):
        super().__init__(directory, backend, [])
        self.name = f"offload-{backend}, new tensors"
        self.template = template

    def prepare(self):
        self.tensors = [t.clone() for t in self.template]


class ThreadPoolContender:
    """What a user writes without a library: os.pwritev/os.preadv in a thread pool."""

    name = "python-threads"

    def __init__(self, directory, tensors, workers=8):
        self.tensors = tensors
        self.path = os.path.join(directory, "bench-threadpool.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.offsets, offset = [], 0
        for t in tensors:
            self.offsets.append(offset)
            offset += t.numel()
        self.pool = concurrent.futures.ThreadPoolExecutor(workers)
        self.loaded = None

    def write(self):
        list(self.pool.map(lambda i: os.pwritev(self.fd, [self.tensors[i].numpy()], self.offsets[i]),
                           range(len(self.tensors))))
        os.fsync(self.fd)

    def read(self):
        def load(i):
            t = torch.empty(self.tensors[i].numel(), dtype=torch.uint8)
            os.preadv(self.fd, [t.numpy()], self.offsets[i])
            return t
        self.loaded = list(self.pool.map(load, range(len(self.tensors))))

    def close(self):
        self.pool.shutdown()
        os.close(self.fd)
        os.unlink(self.path)


class TorchSaveContender:
    name = "torch.save/load"

    def __init__(self, directory, tensors):
        self.tensors = tensors
        self.path = os.path.join(directory, "bench-torch-save.pt")
        self.loaded = None

    def write(self):
        with open(self.path, "wb") as f:
            torch.save(self.tensors, f)
            f.flush()
            os.fsync(f.fileno())

    def read(self):
        self.loaded = torch.load(self.path, weights_only=True)

    def close(self):
        os.unlink(self.path)


def fio_job(directory, rw, block, size, *, direct=True, filename="bench-fio.bin", iodepth=32, extra=()):
    """fio's json figures for one io_uring job ("bw_bytes", "iops"...), or None without fio."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=offload-bench", f"--directory={directory}", f"--rw={rw}", f"--bs={block}",
           f"--size={size}", f"--direct={int(direct)}", "--ioengine=io_uring", f"--iodepth={iodepth}",
           "--numjobs=1", "--output-format=json", f"--filename={filename}", *extra]
    return _fio_figures(cmd, rw)


def _fio_figures(cmd, rw, pass_fds=()):
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, pass_fds=pass_fds).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]["write" if rw == "write" else "read"]


def fio_read_open_files(fds, block, size, iodepth=32, extra=()):
    """GB/s of fio reading ``size`` bytes of the open files ``fds`` (split
    evenly, ``block`` from each in turn, as a striped Offloader reads them)
    with the layout's job (O_DIRECT, io_uring), or None without fio: the
    limit for reading the very files a contender wrote. Where a file lies on
    the disk moves its read rate (by up to 7% between files on the
    development VM, round after round: BENCHMARKS.md), so a ratio to fio's
    own file carries that file's luck; this one does not."""
    if shutil.which("fio") is None:
        return None
    files = ":".join(f"/proc/self/fd/{fd}" for fd in fds)
    cmd = ["fio", "--name=offload-bench-same-file", f"--filename={files}", "--file_service_type=roundrobin",
           "--rw=read", f"--bs={block}", f"--size={size}", "--direct=1", "--ioengine=io_uring",
           f"--iodepth={iodepth}", "--numjobs=1", "--output-format=json", *extra]
    return _fio_figures(cmd, "read", pass_fds=tuple(fds))["bw_bytes"] / 1e9


def fio_run(directory, rw, block, total, iodepth=32, extra=()):
    """GB/s of one fio job (O_DIRECT, io_uring) or None without fio."""
    job = fio_job(directory, rw, block, total, iodepth=iodepth, extra=extra)
    return None if job is None else job["bw_bytes"] / 1e9


def hugepage_buffers(nbytes: int):
    """fio's ``--mem=mmaphuge:`` argument for huge-page I/O buffers of
    ``nbytes``, and a note saying what was used. On a virtio disk, fio's
    default 4 KiB-page buffers split every large O_DIRECT request and read at
    a fraction of the disk's rate; huge pages show its real limit. Needs root
    to reserve the pages and mount hugetlbfs (once per process, under the
    temporary directory); otherwise (None, why)."""
    global _hugetlbfs
    if _hugetlbfs is None:
        _hugetlbfs = ("", "default (4 KiB pages): not root") if os.geteuid() != 0 else _mount_hugetlbfs()
    mount, note = _hugetlbfs
    if not mount:
        return None, note
    pages = -(-nbytes // (2 << 20)) + 8
    try:
        with open("/proc/sys/vm/nr_hugepages") as f:
            reserved = int(f.read())
        if reserved < pages:
            with open("/proc/sys/vm/nr_hugepages", "w") as f:
                f.write(str(pages))
            with open("/proc/sys/vm/nr_hugepages") as f:
                if int(f.read()) < pages:
                    return None, "default (4 KiB pages): the kernel would not reserve enough huge pages"
    except OSError as error:
        return None, f"default (4 KiB pages): {error}"
    return f"--mem=mmaphuge:{mount}/fio-buffers", "huge-page"


_hugetlbfs = None


def _mount_hugetlbfs():
    """Mounts hugetlbfs on a temporary directory; at exit unmounts it and
    gives back the huge pages reserved since (at SIGTERM too)."""
    mount, error = _temporary_mount("hugetlbfs", "offload-hugetlbfs-")
    if not mount:
        return "", f"default (4 KiB pages): mounting hugetlbfs failed: {error}"
    with open("/proc/sys/vm/nr_hugepages") as f:
        reserved_before = f.read().strip()

    def undo():
        global _hugetlbfs, _hugetlbfs_undo
        _hugetlbfs = _hugetlbfs_undo = None
        _forget_undo(undo)
        _unmount(mount)
        with contextlib.suppress(OSError), open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(reserved_before)
    global _hugetlbfs_undo
    _hugetlbfs_undo = undo
    _undo_at_exit(undo)
    return mount, "huge-page"


_hugetlbfs_undo = None


def release_hugepage_buffers() -> None:
    """Unmounts the hugetlbfs and gives back the huge pages now, as exit
    would: for processes that leave through os._exit, which skips atexit."""
    if _hugetlbfs_undo is not None:
        _hugetlbfs_undo()


def fio_limit(directory, total: int, block: int = 4 << 20, iodepth: int = 32):
    """The disk's limit for writing ``total`` bytes then reading them back
    (O_DIRECT, io_uring, page cache dropped before the read), from fio with
    huge-page buffers where it can have them: {"seconds_per_byte",
    "write_gbps", "read_gbps", "buffers"}, or None without fio."""
    mem, note = hugepage_buffers(block * iodepth)
    extra = (mem,) if mem else ()
    total = max(block, total // block * block)
    write = fio_job(directory, "write", block, total, iodepth=iodepth, filename="bench-fio-limit.bin", extra=extra)
    if write is None:
        return None
    drop_page_cache()
    read = fio_job(directory, "read", block, total, iodepth=iodepth, filename="bench-fio-limit.bin", extra=extra)
    os.unlink(os.path.join(directory, "bench-fio-limit.bin"))
    write_gbps, read_gbps = write["bw_bytes"] / 1e9, read["bw_bytes"] / 1e9
    return {"seconds_per_byte": 1 / (write_gbps * 1e9) + 1 / (read_gbps * 1e9), "write_gbps": write_gbps,
            "read_gbps": read_gbps, "buffers": note}


# ------------------------------------------------------------------------- harness
def measure(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summarize(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def median_ratio(ours, theirs) -> float:
    """The median of each round's ratio ``ours[i] / theirs[i]``: this disk's
    speed drifts from round to round, so each round is set against its own
    reference before the rounds are summed up."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def bench_layout(directory, layout, size, total, repeats, backends, progress, alternatives=True, warmup=2):
    count = total // size
    tensors = make_tensors(count, size)
    expected = [t.clone() for t in tensors[:8]] + [tensors[-1].clone()]
    # Each Offloader gets its own copy, as in a training loop; the others share one.
    contenders = [OffloadContender(directory, b, [t.clone() for t in tensors]) for b in backends]
    contenders += [NewTensorsContender(directory, b, tensors) for b in backends]
    if alternatives:
        contenders += [ThreadPoolContender(directory, tensors), TorchSaveContender(directory, tensors)]
    results = {c.name: {"write": [], "read": []} for c in contenders}
    block = FIO_BLOCK.get(layout, size)
    # The device limit is fio with huge-page buffers where they can be had:
    # with 4 KiB-page buffers a virtio disk splits large O_DIRECT requests.
    # The default-buffer figure is kept beside it (what plain malloc'd memory gets).
    mem, fio_buffers = hugepage_buffers(block * 32)
    fio_jobs = {"fio": (mem,) if mem else ()}
    if mem:
        fio_jobs[DEFAULT_BUFFERS_FIO] = ()
    for name in fio_jobs:
        results[name] = {"write": [], "read": []}
    same_file = {c.name: [] for c in contenders if isinstance(c, OffloadContender)}  # (its read, fio's) a round

    def run_contender(c, into=results, timed=True):
        if hasattr(c, "prepare"):
            c.prepare()
        into[c.name]["write"].append(total / measure(c.write) / 1e9)
        progress.step(f"{layout}: {c.name} write")
        drop_page_cache()
        into[c.name]["read"].append(total / measure(c.read) / 1e9)
        progress.step(f"{layout}: {c.name} read")
        if isinstance(c, OffloadContender):
            ok = all(torch.equal(a, b) for a, b in zip(c.tensors[:8] + c.tensors[-1:], expected))
            if not ok:
                raise AssertionError(f"{c.name} returned different bytes")
            # fio reading the file this contender just read (its tensors are
            # back in memory; fio only reads), the limit without placement luck.
            if timed and "fio" in fio_jobs and c.off.file_bytes == total:
                drop_page_cache()
                gbps = fio_read_open_files([c.off._fd], block, total, extra=fio_jobs["fio"])
                if gbps is not None:
                    same_file[c.name].append((into[c.name]["read"][-1], gbps))

    def run_fio(name):
        for rw in ("write", "read"):
            if rw == "read":
                drop_page_cache()
            gbps = fio_run(directory, rw, block, total, extra=fio_jobs[name])
            if gbps is not None:
                results[name][rw].append(gbps)
        progress.step(f"{layout}: {name}")

    # Every contender and fio once a round, in an order rotated and reversed
    # from round to round: a figure moved with whoever ran just before it
    # (BENCHMARKS.md, checkpoints), so none always follows the same one.
    steps = [lambda c=c: run_contender(c) for c in contenders]
    steps += [lambda name=name: run_fio(name) for name in fio_jobs]
    # Untimed first: a process's first cycles fault in new memory and register
    # it (the fresh-process rows report those); the rounds below are the steady state.
    warmup_runs = {c.name: {"write": [], "read": []} for c in contenders}
    try:
        for _ in range(warmup):
            for c in contenders:
                run_contender(c, warmup_runs, timed=False)
        if warmup:  # fio's file made untimed too: every timed write then overwrites, as the contenders' do
            for name in fio_jobs:
                gbps = fio_run(directory, "write", block, total, extra=fio_jobs[name])
                if gbps is not None:
                    warmup_runs[name] = {"write": [gbps], "read": []}
        for round_ in range(repeats):
            for step in interleaved(steps, round_):
                step()
    finally:
        for c in contenders:
            c.close()
        try:
            os.unlink(os.path.join(directory, "bench-fio.bin"))
        except FileNotFoundError:
            pass
    table = {}
    for name, runs in results.items():
        if not runs["write"]:
            continue
        table[name] = {rw: summarize(v) for rw, v in runs.items()}
    if "fio" in table:
        for name, row in table.items():
            for rw in ("write", "read"):
                row[rw]["ratio_to_fio"] = row[rw]["median"] / table["fio"][rw]["median"]
    for name, pairs in same_file.items():
        if pairs and name in table:
            ours, fio = zip(*pairs)
            table[name]["read"]["ratio_to_fio_same_file"] = median_ratio(ours, fio)
            table[name]["read"]["fio_same_file"] = summarize(list(fio))
    return {"tensor_bytes": size, "count": count, "fio_block": block, "fio_buffers": fio_buffers,
            "results": table, "warmup_runs": warmup_runs}


DEFAULT_BUFFERS_FIO = "fio, 4 KiB-page buffers"


def fresh_process_cycles(directory, size, total, cycles=1, warm=False, pause=0.0):
    """Runs in a fresh process: makes ``total`` bytes of ``size``-byte
    tensors, optionally ``Offloader.warm()``s them (untimed), then ``cycles``
    times writes them all (async_writev + synchronize) and reads them back with
    the page cache dropped in between, ``pause`` seconds after the write (a
    script computing meanwhile). [(write GB/s, read GB/s)] per cycle."""
    tensors = make_tensors(total // size, size)
    expected = [t.clone() for t in tensors[:4]] + [tensors[-1].clone()]
    out = []
    with Offloader(directory) as off:
        if warm:
            off.warm(tensors)
        for _ in range(cycles):
            drop_page_cache()
            write = measure(lambda: (off.async_writev(tensors), off.synchronize()))
            drop_page_cache()
            time.sleep(pause)
            read = measure(lambda: off.sync_readv(tensors))
            if not all(torch.equal(a, b) for a, b in zip(tensors[:4] + tensors[-1:], expected)):
                raise AssertionError("offload returned different bytes")
            out.append((total / write / 1e9, total / read / 1e9))
    return out


def deepspeed_fresh_process_cycles(directory, size, total, cycles=1, pause=0.0):
    """DeepSpeed's aio (``deepspeed.ops.op_builder.AsyncIOBuilder``) as a
    user's script runs it in a fresh process: one file per tensor,
    ``aio_handle(block_size=1 MiB, queue_depth=32, overlap_events=True)``,
    writing the tensors from plain torch memory and reading them back into
    torch tensors never touched before (``torch.empty``), with the page cache
    dropped in between and ``pause`` seconds before the read. [(write GB/s,
    read GB/s)] per cycle."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    handle = AsyncIOBuilder().load(verbose=False).aio_handle(MIB, 32, False, True, 1)
    tensors = make_tensors(total // size, size)
    files = [os.path.join(directory, f"bench-deepspeed-{i}.bin") for i in range(len(tensors))]
    out = []
    try:
        for _ in range(cycles):
            targets = [torch.empty_like(t) for t in tensors]
            drop_page_cache()

            def write():
                for t, f in zip(tensors, files):
                    handle.async_pwrite(t, f)
                handle.wait()

            def read():
                for t, f in zip(targets, files):
                    handle.async_pread(t, f)
                handle.wait()
            seconds_write = measure(write)
            drop_page_cache()
            time.sleep(pause)
            seconds_read = measure(read)
            if not all(torch.equal(a, b) for a, b in zip(tensors[:4] + tensors[-1:], targets[:4] + targets[-1:])):
                raise AssertionError("DeepSpeed aio returned different bytes")
            out.append((total / seconds_write / 1e9, total / seconds_read / 1e9))
    finally:
        for f in files:
            if os.path.exists(f):
                os.unlink(f)
    return out


def deepspeed_refusal():
    """Why DeepSpeed's aio cannot be a contender here, or None if it can."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as error:  # noqa: BLE001 (not installed, or broken: either way, skipped)
        return f"DeepSpeed not installed ({type(error).__name__}): pip install deepspeed"
    if not AsyncIOBuilder().is_compatible(False):
        return "DeepSpeed's async_io op cannot build here: apt-get install libaio-dev"
    return None


@contextlib.contextmanager
def reserved_huge_pages(nbytes: int):
    """Reserves 2 MiB huge pages for ``nbytes`` more (vm.nr_hugepages) for
    the duration, for fresh processes run with OFFLOAD_HUGE_PAGES; yields
    None, or why it could not (not root, the kernel refused). The reserve in
    place before is restored afterwards. The first process to touch newly
    reserved pages pays for them (on a VM, the host backs them then); later
    ones find them ready. A SIGTERM restores it too."""
    if os.geteuid() != 0:
        yield "not root: cannot reserve huge pages"
        return
    path = "/proc/sys/vm/nr_hugepages"
    wanted = -(-nbytes // (2 << 20))
    try:
        with open(path) as f:
            before = int(f.read())
        with open(path, "w") as f:
            f.write(str(before + wanted))
        with open(path) as f:
            got = int(f.read()) - before
    except OSError as error:
        yield f"cannot reserve huge pages: {error}"
        return
    def restore():
        _forget_undo(restore)
        with open(path, "w") as f:
            f.write(str(before))
    _undo_at_exit(restore)  # a SIGTERM runs no finally
    try:
        yield None if got >= wanted else f"the kernel reserved {got} huge pages of {wanted}"
    finally:
        restore()


def _in_fresh_process(directory, size, total, cycles, warm, contender="offload", env=None, pause=0.0):
    if contender == "deepspeed":
        code = ("import json, sys; from offload.benchmark import deepspeed_fresh_process_cycles as f; "
                "print(json.dumps(f(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "
                "float(sys.argv[6]))))")
    else:
        code = ("import json, sys; from offload.benchmark import fresh_process_cycles as f; "
                "print(json.dumps(f(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "
                "sys.argv[5] == '1', float(sys.argv[6]))))")
    done = subprocess.run([sys.executable, "-c", code, directory, str(size), str(total), str(cycles),
                           str(int(warm)), str(pause)], capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    if done.returncode != 0:  # its own error, not only "exit status 1"
        raise RuntimeError(f"the fresh {contender} process failed (exit status {done.returncode}):\n"
                           + done.stderr.strip())
    return json.loads(done.stdout.strip().splitlines()[-1])


def interleaved(names, round_) -> list:
    """The order fresh processes run in, round ``round_``: rotated, and
    reversed every other round. A process's figure depends on who ran just
    before it (memory the last one freed may still be backed), so none
    always follows the same one."""
    shift = round_ // 2 % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if round_ % 2 else order


# Seconds between fresh processes, so that each starts on an idle machine,
# as a user's script does. A VM that hands freed memory back to its host
# reports it ~2 s after a free, and the host takes it some seconds later
# still: on the development VM a process started 5 s after the last wrote
# its first GiB at 2.3 GB/s, one started 15 s or 40 s after at 0.5-0.8
# (BENCHMARKS.md, "A fresh process after the machine idled").
SETTLE = 20.0


def bench_first_cycle(directory, layout, size, total, repeats, progress, cycles=1, warm=False,
                      deepspeed=False, huge_pages=False, pause=0.0, settle=SETTLE):
    """What a user's script sees: each round a fresh process writes then
    reads ``total`` bytes (its first cycle, and later ones when ``cycles`` >
    1), interleaved with fio on huge-page buffers writing a new file and
    reading it back (the limit for the same work). With ``warm``, another
    fresh process per round calls ``Offloader.warm()`` first (untimed); with
    ``huge_pages``, another runs with OFFLOAD_HUGE_PAGES=all on huge pages
    reserved for the rounds; with ``deepspeed``, another runs DeepSpeed's aio
    on the same sizes. Each process starts ``settle`` seconds after the one
    before, when what that one freed has been handed back (on a VM that
    does so: see ``SETTLE``; the contenders' order is rotated and reversed
    from round to round too)."""
    runs = {"offload": [[] for _ in range(cycles)], "fio": []}
    if warm:
        runs["offload, warmed"] = [[] for _ in range(cycles)]
    if huge_pages:
        runs[RESERVED] = [[] for _ in range(cycles)]
    if deepspeed:
        runs["DeepSpeed aio, into new memory"] = [[] for _ in range(cycles)]
    block = FIO_BLOCK.get(layout, size)
    # fio's hugetlbfs first: it records the reserve to give back at exit,
    # which must be the one before this function's own.
    mem, note = hugepage_buffers(block * 32)
    # Room for the tensors read back, the blocks writes stage through, slabs.
    with reserved_huge_pages(total + 192 * MIB) if huge_pages else contextlib.nullcontext() as refusal:
        if huge_pages and refusal:
            runs.pop(RESERVED)
        names = [key for key in runs if key != "fio"]
        for round_ in range(repeats):
            for name in interleaved(names, round_):
                contender = "deepspeed" if name.startswith("DeepSpeed") else "offload"
                time.sleep(settle)  # the last process's memory handed back, whoever ran before
                env = {"OFFLOAD_HUGE_PAGES": "all"} if name == RESERVED else None
                for i, cycle in enumerate(_in_fresh_process(directory, size, total, cycles, name == "offload, warmed",
                                                            contender, env, pause)):
                    runs[name][i].append(cycle)
                progress.step(f"{layout}: fresh process")
            limit = fio_limit(directory, total, block)
            if limit is not None:
                runs["fio"].append((limit["write_gbps"], limit["read_gbps"]))
            progress.step(f"{layout}: fio")
    rows = {}
    for name in [key for key in runs if key != "fio"]:
        for i, cycle_runs in enumerate(runs[name]):
            rows[f"{name}, cycle {i + 1}"] = {rw: summarize([r[k] for r in cycle_runs])
                                              for k, rw in enumerate(("write", "read"))}
    if runs["fio"]:
        rows["fio"] = {rw: summarize([r[k] for r in runs["fio"]]) for k, rw in enumerate(("write", "read"))}
        for row in rows.values():
            for rw in ("write", "read"):
                row[rw]["ratio_to_fio"] = row[rw]["median"] / rows["fio"][rw]["median"]
    return {"tensor_bytes": size, "count": total // size, "fio_block": block, "fio_buffers": note,
            "fresh_process": True, "settle_seconds": settle, "results": rows,
            **({"huge_pages": refusal} if huge_pages and refusal else {})}


RESERVED = "offload, OFFLOAD_HUGE_PAGES"


def bench_overhead(directory, pairs=20000, repeats=3, tensor_bytes=4 * KIB):
    """async_write+async_read pairs per second of small tensors through Python,
    O_DIRECT off (page cache), each engine, interleaved with two floors
    measured on the same directory: fio's own buffered io_uring write and read
    of the same blocks (a pair costs one of each: 1 / (1/write + 1/read) IOPS),
    and the cheapest I/O Python can do per pair (os.pwrite + os.preadv of one
    buffer, no torch, nothing asynchronous). The engines' rows write the
    same tensors every round (the steady state of a working set); their
    "new tensors" rows write tensors made for the round (made untimed; the
    last round's die, and are forgotten, inside the timed loop), as
    activations are."""
    backends = ("uring", "threads")
    rates = {name: [] for name in (*backends, *(f"{b}, new tensors" for b in backends), "fio",
                                   "python os.pwrite+os.preadv")}
    offloaders = {backend: Offloader(directory, backend=backend, direct=False) for backend in backends}
    tensors = {backend: [torch.zeros(tensor_bytes, dtype=torch.uint8) for _ in range(pairs)]
               for backend in offloaders}
    new = dict.fromkeys(offloaders, ())

    def pairs_per_second(off, batch):
        start = time.perf_counter()
        for t in batch:
            off.async_write(t)
            off.async_read(t)
        off.synchronize()
        return pairs / (time.perf_counter() - start)

    try:
        for round_ in range(repeats + 1):  # the first round warms the pool and the files
            for backend, off in offloaders.items():
                steady = pairs_per_second(off, tensors[backend])
                new[backend] = ()  # the last round's die here
                new[backend] = [torch.zeros(tensor_bytes, dtype=torch.uint8) for _ in range(pairs)]
                fresh = pairs_per_second(off, new[backend])
                if round_:
                    rates[backend].append(steady)
                    rates[f"{backend}, new tensors"].append(fresh)
            if round_:
                floor = fio_pair_rate(directory, tensor_bytes, pairs)
                if floor is not None:
                    rates["fio"].append(floor)
                rates["python os.pwrite+os.preadv"].append(python_pair_rate(directory, tensor_bytes, pairs))
    finally:
        for off in offloaders.values():
            off.close()
    out = {name: summarize(values) for name, values in rates.items() if values}
    if "fio" in out:
        for row in out.values():
            row["ratio_to_fio"] = row["median"] / out["fio"]["median"]
    return out


def fio_pair_rate(directory, block, count):
    """fio's write+read pairs/s of ``count`` ``block``-byte blocks through the
    page cache (io_uring, iodepth 32, no O_DIRECT), or None without fio."""
    iops = {}
    for rw in ("write", "read"):  # the read finds the written blocks in the page cache
        job = fio_job(directory, rw, block, block * count, direct=False, filename="bench-fio-pairs.bin",
                      extra=("--overwrite=1",))
        if job is None:
            return None
        iops[rw] = job["iops"]
    os.unlink(os.path.join(directory, "bench-fio-pairs.bin"))
    return 1 / (1 / iops["write"] + 1 / iops["read"])


def python_pair_rate(directory, block, count):
    """Pairs/s of the cheapest write+read Python can make: os.pwrite then
    os.preadv of one preallocated buffer, ``count`` blocks of a page-cache
    file. The blocks exist already (written once, untimed), as the Offloader's
    do in its measured rounds and fio's with --overwrite=1: rewriting a cached
    block and appending one cost the kernel different amounts."""
    path = os.path.join(directory, "bench-python-pairs.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        buffer = memoryview(bytearray(block))
        pwrite, preadv = os.pwrite, os.preadv
        for offset in range(0, block * count, block):
            pwrite(fd, buffer, offset)
        start = time.perf_counter()
        for offset in range(0, block * count, block):
            pwrite(fd, buffer, offset)
            preadv(fd, [buffer], offset)
        return count / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)


def _started_after(data) -> str:
    settle = data.get("settle_seconds")
    return "" if settle is None else f" started {settle:g} s after the last"


def format_table(report):
    lines = []
    sections = [(name, data, "") for name, data in report["layouts"].items()]
    sections += [(name, data, f", each round a fresh process{_started_after(data)}: its first cycle"
                  if not any("cycle 2" in row for row in data["results"])
                  else f", each round a fresh process{_started_after(data)}, its cycles in order")
                 for name, data in report.get("first_cycle", {}).items()]
    for layout, data, what in sections:
        lines.append(f"\n{data['count']} x {layout} (fio block {data['fio_block'] // KIB} KiB, iodepth 32, "
                     f"{data.get('fio_buffers', 'default')} buffers{what})")
        if data.get("huge_pages"):
            lines.append(f"  (no OFFLOAD_HUGE_PAGES row: {data['huge_pages']})")
        width = max(18, *(len(name) for name in data["results"]))
        same_file = any("ratio_to_fio_same_file" in row["read"] for row in data["results"].values())
        lines.append(f"  {'':{width}} {'write GB/s (min-max)':>26} {'x fio':>6}   {'read GB/s (min-max)':>26} "
                     f"{'x fio':>6}" + ("   x fio on its file" if same_file else ""))
        for name, row in data["results"].items():
            cells = []
            for rw in ("write", "read"):
                s = row[rw]
                cells.append(f"{s['median']:7.2f} ({s['min']:.2f}-{s['max']:.2f})".rjust(26)
                             + f" {s.get('ratio_to_fio', float('nan')):6.2f}")
            if "ratio_to_fio_same_file" in row["read"]:
                cells[1] += f"   {row['read']['ratio_to_fio_same_file']:6.2f}"
            lines.append(f"  {name:{width}} {cells[0]}   {cells[1]}")
        if same_file:
            lines.append("  (x fio on its file: each round's read over fio reading the file that contender "
                         "wrote, right after it; a file's place on the disk moves its read rate)")
    given_back = report.get("memory_given_back", {})
    if given_back.get("reporting"):
        waits = ", ".join(f"{key} {given_back[key]}" for key in ("min_free_ms", "max_waiting_mib")
                          if key in given_back)
        lines.append("\nFresh processes: this machine hands freed memory back to its host (virtio-balloon free "
                     f"page reporting{'; ' + waits if waits else ''}), so a fresh process's new memory is backed "
                     "again at the host's pace, not the disk's; `python -m offload doctor DIR` says what helps.")
    if "overhead" in report:
        lines.append("\nasync_write+async_read pairs/s, 4 KiB tensors, page cache (median, min-max, x fio):")
        for name, s in report["overhead"].items():
            label = f"offload-{name}" if name.startswith(("uring", "threads")) else name
            lines.append(f"  {label:28} {s['median']:10.0f} ({s['min']:.0f}-{s['max']:.0f})"
                         f" {s.get('ratio_to_fio', float('nan')):6.2f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m offload bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=2048, help="bytes per layout (MiB)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ",".join(LAYOUTS))
    parser.add_argument("--backends", default="uring,threads")
    parser.add_argument("--no-alternatives", action="store_true", help="skip the thread pool and torch.save")
    parser.add_argument("--no-overhead", action="store_true", help="skip the per-operation overhead test")
    parser.add_argument("--no-first-cycle", action="store_true",
                        help="skip the fresh-process rounds (a script's first write and read)")
    parser.add_argument("--fresh-cycles", type=int, default=1,
                        help="write+read cycles each fresh process runs (later ones: a working set it reuses)")
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds each fresh process waits between a cycle's write and its read (a script "
                             "computing meanwhile)")
    parser.add_argument("--settle", type=float, default=SETTLE,
                        help="seconds between fresh processes (default %(default)s): a VM that hands freed memory "
                             "back to its host takes it seconds after a free, and a process started sooner finds "
                             "what its predecessor freed still backed, faster to fault in than what a script "
                             "started on an idle machine meets")
    parser.add_argument("--warm", action="store_true",
                        help="also run each fresh process after Offloader.warm() (untimed)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="also run each fresh process with OFFLOAD_HUGE_PAGES=all, on huge pages reserved "
                             "for the rounds (root)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed rounds of each contender before the steady state's timed ones (a process's "
                             "first cycles fault in and register new memory: the fresh-process rows time those)")
    parser.add_argument("--no-steady-state", action="store_true",
                        help="skip the in-process rounds and the alternatives (only the fresh-process rounds)")
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="skip DeepSpeed's aio in the fresh-process rounds (run when it is installed)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        parser.error(f"not a directory: {args.directory}")
    layouts = [name for name in args.layouts.split(",") if name]
    backends = [b for b in args.backends.split(",") if b]
    total = whole_tensors(parser, args.total_mib, max((LAYOUTS[name] for name in layouts), default=MIB))
    contender_steps = 2 * (2 * len(backends) + (0 if args.no_alternatives else 2))
    steps_per_round = contender_steps + 2
    first_cycle = [] if args.no_first_cycle else [name for name in layouts if name != "64KiB"]
    steady = [] if args.no_steady_state else layouts
    deepspeed_note = "skipped (--no-deepspeed)" if args.no_deepspeed else deepspeed_refusal() if first_cycle else None
    deepspeed = first_cycle and deepspeed_note is None
    per_layout = 2 + int(args.warm) + int(args.huge_pages) + int(bool(deepspeed))
    progress = Progress((len(steady) * steps_per_round + per_layout * len(first_cycle)) * args.repeats
                        + len(steady) * contender_steps * args.warmup)
    report = {"command": " ".join(["python -m offload bench"] + (argv if argv is not None else sys.argv[1:])),
              "directory": os.path.abspath(args.directory), "total_bytes": total, "repeats": args.repeats,
              "warmup": args.warmup,
              "page_cache_dropped": os.geteuid() == 0, "torch": torch.__version__, "layouts": {}}
    for name in steady:
        report["layouts"][name] = bench_layout(args.directory, name, LAYOUTS[name], total, args.repeats,
                                               backends, progress, not args.no_alternatives, args.warmup)
    if first_cycle:
        report["first_cycle"] = {name: bench_first_cycle(args.directory, name, LAYOUTS[name], total,
                                                         args.repeats, progress, args.fresh_cycles, args.warm,
                                                         deepspeed, args.huge_pages, args.pause, args.settle)
                                 for name in first_cycle}
        report["deepspeed"] = deepspeed_note or "DeepSpeed aio ran in the fresh-process rounds"
        report["memory_given_back"] = free_page_reporting()
    progress.close()
    if not args.no_overhead:
        report["overhead"] = bench_overhead(args.directory, repeats=args.repeats)
    print(format_table(report))
    if report.get("deepspeed"):
        print(f"\nDeepSpeed: {report['deepspeed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
