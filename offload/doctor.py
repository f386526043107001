"""python -m offload doctor DIR: what works on this machine, and why not.

Every answer comes from trying the real thing (an io_uring ring, an O_DIRECT
write and read in DIR, registered buffers, a pinned allocation), not from
version numbers.
"""
import argparse
import contextlib
import errno
import json
import os
import resource
import sys
import warnings


def diagnose(directory) -> dict:
    directory = os.fspath(directory)
    report = {"directory": os.path.abspath(directory)}
    report["huge_pages"] = _huge_pages()
    with _without_invalid_huge_page_setting(report["huge_pages"]):
        report["io_uring"] = _io_uring()
        report["o_direct"] = _o_direct(directory)
        report["memlock"] = _memlock()
        report["registered_buffers"] = _registered_buffers(directory, report["io_uring"]["available"])
    report["free_space"] = _free_space(directory)
    report["file_system"] = _file_system(directory)
    report["request_splitting"] = _request_splitting(directory)
    report["tensor_writes"] = _tensor_writes(report["o_direct"])
    report["memory_given_back"] = free_page_reporting()
    report["buffer_pages"] = _buffer_pages(report["memory_given_back"]["reporting"])
    report["cuda"] = _cuda()
    report["auto_engine"] = _auto_engine()
    return report


@contextlib.contextmanager
def _without_invalid_huge_page_setting(huge_pages):
    """An invalid OFFLOAD_HUGE_PAGES makes the buffer pool refuse to start;
    the doctor reports it (above) and probes the rest without it."""
    invalid = huge_pages["setting"].endswith(")") and "(invalid:" in huge_pages["setting"]
    saved = os.environ.pop("OFFLOAD_HUGE_PAGES", None) if invalid else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["OFFLOAD_HUGE_PAGES"] = saved


def _io_uring() -> dict:
    from . import _core
    from ._engines import _io_uring_disabled_sysctl, explain_uring_error
    result = {"built_with_liburing": bool(_core.HAVE_URING), "liburing_linked": _core.URING_LINK or "no",
              "kernel.io_uring_disabled": _io_uring_disabled_sysctl()}
    try:
        _core.make_uring_engine(8, 1 << 20, 8).close()
        result.update(available=True, reason="io_uring_setup succeeded")
    except OSError as error:
        result.update(available=False, errno=errno.errorcode.get(error.errno, error.errno),
                      reason=explain_uring_error(error))
    return result


def _o_direct(directory) -> dict:
    from . import _core
    from ._direct_io import probe_direct, transfer_alignment
    from ._pool import buffer_pool
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as error:
        return {"accepted": False, "reason": f"open with O_DIRECT failed: {error.strerror} "
                                             f"({errno.errorcode.get(error.errno, error.errno)})"}
    try:
        memory, offset = _core.dio_alignment(fd)
        try:
            probe_direct(fd, buffer_pool().acquire(1 << 20))  # as the Offloader proves its file
        except OSError as error:
            return {"accepted": False, "reason": f"an aligned O_DIRECT write/read failed: {error.strerror}",
                    "alignment": {"memory": memory, "offset": offset}}
        as_is = dict(zip(("memory", "length"), transfer_alignment(fd, True)))  # what the Offloader applies
        return {"accepted": True, "alignment": {"memory": memory, "offset": offset}, "transfer_alignment": as_is}
    finally:
        os.close(fd)


def _tensor_writes(o_direct, nbytes: int = 64 << 20, address: int = None) -> dict:
    """Whether a write of torch's own CPU tensors goes from their memory or
    is copied into staging blocks first: a new tensor's address and length
    (or the ``address`` given) against what O_DIRECT wants on this file, as
    the Offloader decides. In a fresh process (the doctor's) the probe is
    large enough that glibc maps it on its own (above its largest mmap
    threshold), so its place in a page is what large tensors get; in a
    process whose heap has a free region that large, it may land there."""
    import torch
    if not o_direct["accepted"]:
        return {"staged": False, "reason": "no O_DIRECT here: writes go through the page cache, from the "
                                           "tensor's memory"}
    memory, length = o_direct["transfer_alignment"]["memory"], o_direct["transfer_alignment"]["length"]
    if address is None:
        address = torch.empty(nbytes, dtype=torch.uint8).data_ptr()
    staged = address % memory != 0 or nbytes % length != 0
    if not staged:
        return {"staged": False, "address_mod_page": address % 4096, "memory_alignment": memory,
                "reason": f"torch's tensors meet the {memory}-byte memory alignment: written from their "
                          "own memory, no copy"}
    hint = ("" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else
            "; THP_MEM_ALLOC_ENABLE=1 (environment) makes torch put tensors of 2 MiB or more on "
            "page boundaries, written as they are")
    return {"staged": True, "address_mod_page": address % 4096, "memory_alignment": memory,
            "reason": f"torch's tensors start {address % 4096} bytes past a page, off the file's {memory}-byte "
                      "memory alignment: each write copies them into staging blocks first, which costs memory "
                      f"bandwidth beside the disk's{hint}"}


def _capability(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False


def _memlock() -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    as_text = lambda v: "unlimited" if v == resource.RLIM_INFINITY else v  # noqa: E731
    return {"soft": as_text(soft), "hard": as_text(hard), "cap_ipc_lock": _capability(14)}


def _registered_buffers(directory, uring) -> dict:
    if not uring:
        return {"work": False, "reason": "no io_uring"}
    import torch
    from .offloader import Offloader
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with Offloader(directory, backend="uring") as off:
                t = torch.ones(1 << 20)
                off.sync_write(t)
                off.sync_read(t)
                registered, error = off.registered_buffers, off._engine.fixed_buffers[1]
        except OSError as e:
            return {"work": False, "reason": str(e)}
    if error:
        return {"work": False, "reason": f"io_uring refused fixed buffers: "
                                         f"{errno.errorcode.get(-error, error)} (RLIMIT_MEMLOCK too low?)"}
    return {"work": registered > 0, "reason": f"{registered} buffer(s) registered by a test write/read"}


def _free_space(directory) -> dict:
    st = os.statvfs(directory)
    return {"free_bytes": st.f_bavail * st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize}


def _file_system(directory) -> str:
    path, best, kind = os.path.realpath(directory), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")) \
                        and len(fields[1]) > len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def _request_splitting(directory) -> dict:
    """Whether the block device under ``directory`` splits large O_DIRECT
    requests whose memory is in 4 KiB pages: it takes at most max_segments
    segments a request, and memory from malloc (torch's CPU tensors, fio's
    default buffers) is rarely contiguous beyond a page. offload's buffer
    pool uses huge pages, so its requests are not split; a user's own
    O_DIRECT code on plain memory (and fio's default) will be."""
    st = os.stat(directory)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    queue = os.path.join(base, "queue")
    if not os.path.isdir(queue):
        queue = os.path.join(base, "..", "queue")  # a partition: its disk's queue
    values = {name: value for name in ("max_segments", "max_sectors_kb", "dma_alignment")
              if (value := _read_int(queue, name)) is not None}
    if "max_segments" not in values or "max_sectors_kb" not in values:
        return {"known": False, "reason": f"no block queue limits under {base} (not a block device?)"}
    small_page_limit = values["max_segments"] * 4096
    splits = small_page_limit < values["max_sectors_kb"] * 1024
    reason = (f"requests over {small_page_limit >> 10} KiB from 4 KiB-page memory are split "
              f"(max_segments {values['max_segments']}, max request {values['max_sectors_kb']} KiB): plain "
              "malloc'd buffers (fio's default) get a fraction of the disk; offload's huge-page pool does not"
              if splits else f"4 KiB-page memory fills a whole request (max_segments {values['max_segments']})")
    return {"known": True, "splits_small_page_requests": splits, "reason": reason, **values}


_VIRTIO_BALLOON = 5            # virtio device id of the memory balloon
_BALLOON_F_REPORTING = 5       # its feature bit: free page reporting


def free_page_reporting(devices="/sys/bus/virtio/devices",
                        parameters="/sys/module/page_reporting/parameters") -> dict:
    """Whether this machine is a VM whose balloon hands freed memory back to
    its host (virtio-balloon free page reporting). Memory freed for a few
    seconds is then no longer backed, and touching it again waits on the
    host: a fresh process's first reads into new buffers pay that
    (BENCHMARKS.md, where a fresh process's time goes). Where the kernel's
    page_reporting has a ``min_free_ms`` (how long memory stays free before
    it is handed back; not every kernel has one), its value is reported."""
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return {"reporting": False, "reason": "no virtio devices here: not a virtio VM"}
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                device = int(f.read(), 16)
            with open(os.path.join(devices, name, "features")) as f:
                features = f.read().strip()  # one character a feature bit, bit 0 first
        except (OSError, ValueError):
            continue
        if device != _VIRTIO_BALLOON:
            continue
        if features[_BALLOON_F_REPORTING:_BALLOON_F_REPORTING + 1] == "1":
            found = {"reporting": True, "device": name,
                     "reason": f"this VM hands freed memory back to its host (virtio-balloon free page reporting, "
                               f"{name}): freed memory is backed again only when touched, at the host's pace, so a "
                               "fresh process's first reads into new buffers are slow; reserve huge pages and set "
                               "OFFLOAD_HUGE_PAGES, call Offloader.warm() ahead of them, or give the pool smaller "
                               "huge pages (below). For tensors of 2 MiB or more, THP_MEM_ALLOC_ENABLE=1 in the "
                               "environment has torch put them on huge pages: written as they are, they free whole "
                               "huge pages still backed, which the reads that bring them back get (a fresh process "
                               "on the machine BENCHMARKS.md measured, started idle, went from 0.44 / 0.08 of the "
                               "disk's rate, first write / read of 64 MiB tensors, to 0.80-0.82 / 0.73-0.83)"}
            found.update({name: value for name in ("min_free_ms", "max_waiting_mib")
                          if (value := _read_int(parameters, name)) is not None})
            if "min_free_ms" not in found:
                return found
            found["reason"] += (f". This kernel hands a block back once it has been free for min_free_ms = "
                                f"{found['min_free_ms']} ms; a longer wait (as root: echo 60000 > "
                                f"{parameters}/min_free_ms) keeps memory that a process freed within it backed "
                                "for the next")
            if "max_waiting_mib" not in found:
                return found
            found["reason"] += (f", up to max_waiting_mib = {found['max_waiting_mib']} MiB waiting (raise it past "
                                f"what a process frees: echo 65536 > {parameters}/max_waiting_mib). With both "
                                "raised, a fresh process's first writes and reads went from 0.44-0.54 and "
                                "0.07-0.08 of the disk's rate (started idle) to 0.90-1.02 on the machine "
                                "BENCHMARKS.md measured; min_free_ms alone left its 64 MiB reads at 0.25-0.32")
            return found
        return {"reporting": False, "device": name,
                "reason": f"a virtio balloon ({name}) without free page reporting: freed memory stays backed"}
    return {"reporting": False, "reason": "no virtio balloon: freed memory stays with this machine"}


def _read_int(directory, name):
    """The integer in a sysfs file (a queue limit, a module parameter), or
    None where there is none."""
    try:
        with open(os.path.join(directory, name)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _buffer_pages(memory_given_back: bool, thp="/sys/kernel/mm/transparent_hugepage") -> dict:
    """The page size the pool's new buffers fault in on: the largest
    transparent huge page size enabled for memory advised MADV_HUGEPAGE
    (``hugepages-<size>kB/enabled``: always, madvise, or inherit from the
    top-level setting), else 4 KiB. Where the machine hands freed memory
    back to a host, 2 MiB pages come from memory the host took back (the
    kernel reports only free blocks of 2 MiB and more), while smaller ones
    are mostly carved from memory still backed: on the development VM a
    fresh process read into new 256 KiB pages about 3x faster than into new
    2 MiB ones, and about as fast afterwards (BENCHMARKS.md)."""
    from ._pool import advised_page_sizes
    sizes = advised_page_sizes(thp)
    page_kib = max(sizes, default=4)
    advice = ""
    if memory_given_back and page_kib >= 2048:
        advice = "; on a VM that hands freed memory back, a fresh process's first reads fault in 2 MiB pages at " \
                 "the host's pace"
        if os.path.exists(os.path.join(thp, "hugepages-256kB", "enabled")):
            advice += (f": with 2 MiB off and 256 KiB on (echo never > {thp}/hugepages-2048kB/enabled; echo "
                       f"madvise > {thp}/hugepages-256kB/enabled) they ran about 3x faster on the development VM, "
                       "later reads about as fast; this changes every program's huge pages")
        else:
            advice += "; smaller huge pages, which fault in faster there, need Linux 6.8 or later"

    return {"page_kib": page_kib, "sizes_kib": sizes, "slow_first_touch": bool(advice),
            "reason": f"new buffers fault in on {page_kib} KiB pages" + advice}


def _huge_pages() -> dict:
    """The system's reserved huge pages and whether this process's pool may
    take them (OFFLOAD_HUGE_PAGES): with them, a fresh process's first reads
    land in memory that faults in fast."""
    from ._pool import huge_page_limit
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.startswith("HugePages_") or name == "Hugepagesize":
                    fields[name] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    setting = os.environ.get("OFFLOAD_HUGE_PAGES", "")
    try:
        limit = huge_page_limit(setting)
    except ValueError as error:
        limit, setting = 0, f"{setting} (invalid: {error})"
    free = fields.get("HugePages_Free", 0) - fields.get("HugePages_Rsvd", 0)
    if limit == 0:
        reason = (f"{free} reserved huge pages are free; the pool leaves them alone: set OFFLOAD_HUGE_PAGES "
                  "(a size, or all) to have first reads land in them" if free else
                  "none reserved (vm.nr_hugepages): a fresh process's first reads fault in new memory; "
                  "reserve some and set OFFLOAD_HUGE_PAGES, or call Offloader.warm()")
    else:
        reason = (f"the pool may take {'all' if limit >= 1 << 60 else f'{limit >> 20} MiB'} of them; "
                  f"{free} free now" + ("" if free else ": none left, so new blocks use ordinary memory"))
    return {"reserved": fields.get("HugePages_Total", 0), "free": free,
            "page_kib": fields.get("Hugepagesize", 0), "setting": setting, "pool_limit": limit, "reason": reason}


def _cuda() -> dict:
    import torch
    if not torch.cuda.is_available():
        return {"available": False, "reason": f"torch {torch.__version__} sees no CUDA device"
                                              f"{' (CPU-only build)' if torch.version.cuda is None else ''}"}
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        pinned = True
    except RuntimeError:
        pinned = False
    return {"available": True, "devices": devices, "pinned_memory": pinned}


def _auto_engine() -> str:
    from ._engines import open_engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = open_engine("auto", 8, 1 << 20, 2)
    name = engine.name
    engine.close()
    return name


def _print(report) -> None:
    def line(ok, what, detail):
        print(f"  [{'ok' if ok else '--'}] {what}: {detail}")

    print(f"offload doctor: {report['directory']} ({report['file_system']})")
    u = report["io_uring"]
    build = (f"built with liburing, linked {u['liburing_linked']}" if u["built_with_liburing"]
             else "built WITHOUT liburing: install liburing-dev and reinstall offload")
    line(u["available"], "io_uring", f"{u['reason']} (kernel.io_uring_disabled={u['kernel.io_uring_disabled']}; "
                                      f"{build})")
    d = report["o_direct"]
    line(d["accepted"], "O_DIRECT", ("accepted" if d["accepted"] else d["reason"]) +
         (f"; DIO alignment memory {d['alignment']['memory']}, offset {d['alignment']['offset']}"
          if "alignment" in d else ""))
    q = report["request_splitting"]
    line(not q.get("splits_small_page_requests", False), "request size", q["reason"])
    w = report["tensor_writes"]
    line(not w["staged"], "tensor writes", w["reason"])
    m = report["memlock"]
    line(True, "RLIMIT_MEMLOCK", f"soft {m['soft']}, hard {m['hard']}, CAP_IPC_LOCK {m['cap_ipc_lock']}")
    r = report["registered_buffers"]
    line(r["work"], "registered buffers", r["reason"])
    f = report["free_space"]
    line(f["free_bytes"] > 0, "free space", f"{f['free_bytes'] / 2**30:.1f} GiB of {f['total_bytes'] / 2**30:.1f} GiB")
    h = report["huge_pages"]
    line(h["pool_limit"] > 0 and h["free"] > 0, "reserved huge pages", h["reason"])
    g = report["memory_given_back"]
    line(not g["reporting"], "freed memory", g["reason"])
    b = report["buffer_pages"]
    line(not b["slow_first_touch"], "buffer pages", b["reason"])
    c = report["cuda"]
    line(c["available"], "CUDA", c.get("reason") or f"{', '.join(c['devices'])}; pinned memory "
         f"{'works' if c['pinned_memory'] else 'fails'}")
    print(f"  auto engine: {report['auto_engine']}")


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload doctor", description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"not a directory: {args.dir}", file=sys.stderr)
        return 2
    report = diagnose(args.dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0
