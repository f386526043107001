"""The process-wide buffer pool: page-aligned memory that reads land in and
writes stage through, shared by every Offloader, checkpoint and optimizer."""
import atexit
import collections
import contextlib
import os
import threading

from . import _core, _releaser, _signals

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
    ``trim()`` frees both. A write that frees a tensor's own memory has the
    block its read will land in faulted in on a helper thread meanwhile,
    and lazily freed, unless the caches hold one already (within the
    smaller of the two limits; ``set_lazy_limit(0)`` turns it off): see
    ``provision``. A read given a new block anyway has it faulted in on
    the same thread, ahead of the engine: see ``fault_in``. Buffers a
    checkpoint load faulted in on 4 KiB pages go back onto huge pages once
    idle and the pool is quiet: see ``collapse_when_idle``. One pool serves
    every Offloader, since buffers move between them with the tensors.

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


class _Provisioner:
    """Faults in, on a thread of its own, the new blocks reads were just
    given (see ``fault_in``), then the blocks the reads of written tensors
    will land in (see ``provision``), as the writes free memory:
    memory faulted in then is likely what the write just freed, still
    backed where a VM hands freed memory back to its host seconds later. A
    read that comes first takes its own blocks at issue, which meets the
    expectation: no block is faulted in twice, but for the one in hand.
    ``QUIET`` (seconds the writes must pause first) is 0: provisioning in
    2 MiB steps leaves the writes beside it at their rate (BENCHMARKS.md).
    While blocks faulted in on 4 KiB pages are alive, it also looks at the
    pool every ``COLLAPSE_POLL`` seconds and collapses the idle ones back
    onto huge pages, one at a time, for as long as the pool stays quiet
    (see ``collapse_when_idle``); that never delays ``wait``.
    One per process; a forked child starts its own, and a fork waits for
    the block in hand (whose C++ lock the child would otherwise inherit
    taken)."""

    QUIET = 0.0
    # Between looks at the pool while blocks faulted in on 4 KiB pages are
    # alive: it collapses idle ones once the pool has been left alone that long.
    COLLAPSE_POLL = 0.5

    def __init__(self, pool):
        self._pool = pool
        self._requests = 0     # request() calls so far
        self._done = 0         # requests whose blocks are provisioned (or refused)
        self._busy = False
        self._collapsing = False  # in _collapse_while_quiet (not waited for by wait())
        self._to_fault = collections.deque()  # new blocks that reads were given, in issue order
        self.faulted_in = 0    # bytes of those blocks faulted in here
        self.in_pool = threading.Lock()  # held while the pool works on a block
        self._stopping = False
        self._ready = threading.Condition()
        self._thread = None
        self._activity = -1    # the pool's acquires and releases when it last looked

    def request(self, counts) -> None:
        for nbytes, count in counts.items():
            self._pool.expect(nbytes, count)
        with self._ready:
            if self._stopping:
                return
            self._requests += 1
            if self._thread is None:
                self._start()
            elif self._requests == self._done + 1:
                # The first since the thread last finished: wake it from its
                # idle wait. Later ones need no wake-up (a write's every
                # completion would cost a thread switch): the thread checks
                # for them when its pass over the pool ends (and when a
                # quiet period, if set, times out).
                self._ready.notify_all()

    def fault_in(self, buffers) -> None:
        with self._ready:
            if self._stopping:
                return
            self._to_fault.extend(buffers)
            if self._thread is None:
                self._start()
            elif not self._busy:
                self._ready.notify_all()

    def watch_small_pages(self) -> None:
        """Blocks were marked as faulted in on 4 KiB pages: from now on the
        thread looks at the pool every ``COLLAPSE_POLL`` seconds while any
        is alive, and collapses the idle ones while the pool is quiet."""
        with self._ready:
            if self._stopping:
                return
            if self._thread is None:
                self._start()
            elif not self._busy:
                self._ready.notify_all()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="offload-provision")
        self._thread.start()

    def wait(self) -> None:
        """Returns once the blocks expected and given to reads so far are
        faulted in (or refused)."""
        with self._ready:
            seen = self._requests
            self._ready.wait_for(lambda: (self._done >= seen and not self._to_fault and not self._busy)
                                 or self._stopping)

    def stop(self) -> None:
        """Provisions nothing more, and waits for the block in hand (at exit)."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
            self._ready.wait_for(lambda: not self._busy and not self._collapsing)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._ready.wait_for(
                        lambda: self._requests != self._done or self._to_fault or self._stopping,
                        self.COLLAPSE_POLL if self._pool.small_page_bytes else None):
                    self._collapsing = True
                    self._ready.release()
                    try:
                        self._collapse_while_quiet()
                    finally:
                        self._ready.acquire()
                        self._collapsing = False
                        self._ready.notify_all()
                seen = None
                while seen != self._requests and not self._stopping:  # until writes pause
                    seen = self._requests
                    self._ready.wait(self.QUIET)
                if self._stopping:
                    return
                self._busy = True
            try:
                while not self._stopping:
                    self._fault_in_queued()  # reads in flight come first
                    with self.in_pool:
                        if self._pool.provision() == 0:
                            break
                self._fault_in_queued()
            except OSError:
                pass  # out of memory: reads fault their blocks in themselves, as without
            with self._ready:
                self._busy = False
                self._done = seen
                self._ready.notify_all()

    def _collapse_while_quiet(self) -> None:
        """Collapses idle blocks faulted in on 4 KiB pages back onto huge
        pages, one at a time, while no acquire or release happened since the
        last look (each costs about what faulting new huge pages costs: on
        this VM 0.5-2.5 s/GiB of this thread; BENCHMARKS.md)."""
        while not self._stopping and not self._to_fault and self._requests == self._done:
            activity, self._activity = self._activity, self._pool.activity
            if activity != self._activity or not self._pool.small_page_idle_bytes:
                return
            with self.in_pool:
                if self._pool.collapse_one() <= 0:
                    return

    def _fault_in_queued(self) -> None:
        while True:
            with self._ready:
                if not self._to_fault or self._stopping:
                    return
                buffer = self._to_fault.popleft()
            # Faulting in pages already there changes nothing, so a block the
            # kernel is reading into (faulted in by the read's submission)
            # keeps its bytes. The reference held here keeps it mapped.
            _core.prefault(buffer.address, buffer.capacity, False)
            self.faulted_in += buffer.capacity
            del buffer


_provisioner = None


def collapse_when_idle(buffer) -> None:
    """``buffer`` (a pool block of 2 MiB or more) was faulted in on 4 KiB
    pages: fast to fault in on a VM, but a disk with few segments a request
    splits O_DIRECT requests into such memory. Once it is idle in the pool
    and the pool has been left alone for ``COLLAPSE_POLL`` seconds, a helper
    thread puts it back on huge pages (``MADV_COLLAPSE``, Linux 6.1+), so
    the reads that reuse it (the next load of the same checkpoint) run at
    the disk's rate (BENCHMARKS.md, Checkpoints). ``OFFLOAD_COLLAPSE=0``
    turns it off (the buffers then stay on 4 KiB pages)."""
    if os.environ.get("OFFLOAD_COLLAPSE", "1").strip() == "0":
        return
    pool = buffer_pool()
    pool.mark_small_pages(buffer.address)
    if pool.small_page_bytes:
        _the_provisioner().watch_small_pages()


def collapse_now() -> int:
    """Collapses every idle block ``collapse_when_idle`` marked, now, on the
    calling thread, and returns the bytes collapsed: for benchmarks that
    must not let the helper thread's collapses run beside what they time."""
    pool, total = buffer_pool(), 0
    held = _provisioner.in_pool if _provisioner is not None else contextlib.nullcontext()
    while True:
        with held:  # as the helper does: a fork waits for the block in hand
            done = pool.collapse_one()
        if done <= 0:
            return total
        total += done


def provision(counts) -> None:
    """Writes just freed tensors' own memory, ``counts[nbytes]`` tensors of
    each size, and the reads that bring them back will want pool blocks of
    those sizes. Unless the pool's caches hold them (or reads take them
    first), a helper thread faults them in at once, beside the writes, and
    caches them: lazily freed (the kernel may take them back under memory
    pressure; until then the reads land in them without page faults), or
    idle if under 2 MiB.
    Where a VM hands freed memory back to its host seconds after it is freed,
    never-touched memory is what a read faults in slowest; memory faulted in
    soon after the write is likely what the write freed, still backed
    (BENCHMARKS.md). Within the smaller of the pool's lazy and idle limits
    (``set_lazy_limit(0)`` turns it off); off with reserved huge pages
    (which fault in fast anyway)."""
    _the_provisioner().request(counts)


def fault_in(buffers) -> None:
    """Reads were just given these new blocks (never touched: each page
    faults in on first touch). A helper thread faults them in, in order, so
    that those the engine submits later (beyond its window) find their pages
    there, and the first ones are faulted in by two threads, the helper and
    the submission, instead of one. Left to the submission alone, on a VM
    that hands freed memory back to its host, faulting new memory in one
    request after another left the disk idle (BENCHMARKS.md)."""
    _the_provisioner().fault_in(buffers)


def _the_provisioner() -> _Provisioner:
    global _provisioner
    if _provisioner is None:
        pool = buffer_pool()
        with _pool_lock:
            if _provisioner is None:
                _provisioner = _Provisioner(pool)
    return _provisioner


def wait_provisioned() -> None:
    """Returns once the blocks ``provision`` was asked for, and those given
    to ``fault_in``, are ready (after the written tensors handed to the
    releaser are freed: it asks for their blocks then)."""
    _releaser.wait_released()
    if _provisioner is not None:
        _provisioner.wait()


def faulted_in_for_reads() -> int:
    """Bytes of new read blocks the helper thread faulted in (``fault_in``)."""
    return 0 if _provisioner is None else _provisioner.faulted_in


def _stop_provisioner() -> None:
    if _provisioner is not None:
        _provisioner.stop()


_held_across_fork = None


def _hold_provisioner() -> None:
    global _held_across_fork
    _held_across_fork = _provisioner
    if _held_across_fork is not None:
        _held_across_fork.in_pool.acquire()


def _release_provisioner() -> None:
    if _held_across_fork is not None:
        _held_across_fork.in_pool.release()


def _forget_provisioner_in_child() -> None:
    global _provisioner, _held_across_fork
    _provisioner = _held_across_fork = None  # its thread is the parent's


atexit.register(_stop_provisioner)  # before the pool can be freed under its thread
os.register_at_fork(before=_hold_provisioner, after_in_parent=_release_provisioner,
                    after_in_child=_forget_provisioner_in_child)


def advised_page_sizes(thp="/sys/kernel/mm/transparent_hugepage") -> list:
    """The transparent huge page sizes, in KiB, enabled for memory advised
    MADV_HUGEPAGE (as the pool's blocks are): a size's ``enabled`` is always
    or madvise, or inherits one from the top-level switch. A page faults in
    on the largest that fits and that the kernel can allocate; [] means
    base pages."""
    def chosen(path):
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            return None
        return text[text.index("[") + 1:text.index("]")] if "[" in text else None

    top = chosen(os.path.join(thp, "enabled"))
    sizes = []
    try:
        names = os.listdir(thp)
    except OSError:
        names = []
    for name in names:
        if name.startswith("hugepages-") and name.endswith("kB"):
            setting = chosen(os.path.join(thp, name, "enabled"))
            if setting in ("always", "madvise") or (setting == "inherit" and top in ("always", "madvise")):
                sizes.append(int(name[len("hugepages-"):-2]))
    if not sizes and top in ("always", "madvise") and chosen(os.path.join(thp, "hugepages-2048kB", "enabled")) is None:
        sizes.append(2048)  # a kernel without multi-size THP: the one size, by the top-level switch
    return sorted(sizes)


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
