"""The process-wide buffer pool: page-aligned memory that reads land in and
writes stage through, shared by every Offloader, checkpoint and optimizer."""
import os
import threading

from . import _core, _signals

_signals.bookkeeping_module(__file__)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


_pool = None
_pool_lock = threading.Lock()


def buffer_pool():
    """The process-wide pool of page-aligned buffers that reads land in and
    writes stage through. Released buffers (from tensors that died or were
    written) are kept up to an idle limit, default min(2 GiB, RAM / 8), so
    reads land in memory that is already faulted in (first-touch memory is
    several times slower to read into: BENCHMARKS.md).
    Buffers beyond it are lazily freed (MADV_FREE) up to a second limit,
    default RAM / 4: the kernel reclaims their pages when it needs memory
    (``LazyFree`` in /proc/PID/smaps_rollup; ``ps`` still counts them in RSS
    until it does), and until then reusing them costs no page faults. Change
    the limits with ``set_idle_limit(nbytes)`` and ``set_lazy_limit(nbytes)``;
    ``trim()`` frees both. One pool serves every Offloader, since buffers
    move between them with the tensors.

    Where the system has huge pages reserved (``/proc/sys/vm/nr_hugepages``)
    and ``OFFLOAD_HUGE_PAGES`` says how much of them the pool may take
    (``4G``, ``512M``, a byte count, or ``all``), new buffers come from them
    first: memory the kernel has set aside, so even a fresh process's first
    reads land in memory that faults in fast (where a VM hands freed memory
    back to its host, never-touched memory is what costs most). Off by default: reserved pages usually belong to someone
    (a database, DPDK, fio); ``set_huge_page_limit(nbytes)`` is the same
    switch in code. A child forked while the pool holds them shares them
    copy-on-write: a child that writes to one needs a free reserved page of
    its own, or gets SIGBUS."""
    global _pool
    with _pool_lock:
        if _pool is None:
            huge_pages = huge_page_limit(os.environ.get("OFFLOAD_HUGE_PAGES", ""))
            ram = _ram_bytes()
            pool = _core.BufferPool(min(2 << 30, ram // 8), ram // 4)
            pool.set_huge_page_limit(huge_pages)
            _pool = pool
        return _pool


def huge_page_limit(setting: str) -> int:
    """Bytes of reserved huge pages an ``OFFLOAD_HUGE_PAGES`` setting allows:
    ``""`` or ``"0"`` none, ``"all"`` no limit, else a byte count with an
    optional K, M, G or T suffix (powers of 1024). Anything else raises
    ValueError, naming the variable."""
    text = setting.strip().upper()
    if text in ("", "0"):
        return 0
    if text == "ALL":
        return 1 << 62
    scale = 1
    if text[-1:] in ("K", "M", "G", "T"):
        scale = 1 << (10 * ("KMGT".index(text[-1]) + 1))
        text = text[:-1]
    try:
        value = int(float(text) * scale)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"OFFLOAD_HUGE_PAGES={setting!r}: expected a size such as 4G, 512M or 1073741824, or all")
    return value
