"""offload's torch-free I/O core (csrc/, bound in bindings.cpp).

Addresses are plain ints. Every request carries a caller-chosen ``tag`` that
comes back, once, with its result: the full length on success (0 for fsync),
or -errno. Errors of a call itself raise OSError with the errno. Calls that
wait release the GIL.
"""
from collections.abc import Sequence
from typing import Optional

HAVE_URING: bool
URING_LINK: str  # "static" (liburing inside this module), "shared", or "" without io_uring
KIND_READ: int
KIND_WRITE: int
KIND_FSYNC: int

class Requests:
    """The requests of one vector call, each converted and checked when it is
    added; ``Engine.submit`` hands them all to the engine at once."""
    def __init__(self) -> None: ...
    def read(self, tag: int, fd: int, addr: int, length: int, offset: int, region: int = 0,
             region_length: int = 0) -> int:
        """Adds a read, as ``Engine.submit_read``; returns how many requests it holds."""
    def write(self, tag: int, fd: int, addr: int, length: int, offset: int, copy_from: int = 0,
              copy_length: int = 0, region: int = 0, region_length: int = 0) -> int:
        """Adds a write, as ``Engine.submit_write``; returns how many requests it holds."""
    def __len__(self) -> int: ...
    def tags(self) -> list[int]:
        """The tags of the requests, in order."""

class Buffer:
    """A page-aligned pool block, writable through the buffer protocol;
    returned to its pool when the last reference goes."""
    @property
    def address(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def fresh(self) -> bool:
        """Never used before: its pages fault in on first touch."""

class BufferPool:
    """Page-aligned blocks on 2 MiB pages, recycled by size: up to
    ``idle_limit`` bytes kept as they are, beyond it up to ``lazy_limit``
    lazily freed (MADV_FREE), beyond that unmapped. Thread-safe."""
    def __init__(self, idle_limit: int, lazy_limit: int = 0) -> None: ...
    @staticmethod
    def capacity_for(size: int) -> int: ...
    def acquire(self, size: int) -> Buffer: ...
    def live_capacity(self, address: int) -> int: ...
    def trim(self) -> None: ...
    def _hold_lock(self, milliseconds: int) -> None:
        """For tests: holds the pool's lock that long (without the GIL)."""
    def set_idle_limit(self, nbytes: int) -> None: ...
    def set_lazy_limit(self, nbytes: int) -> None: ...
    def set_huge_page_limit(self, nbytes: int) -> None:
        """New blocks come from reserved huge pages (MAP_HUGETLB) while fewer
        than ``nbytes`` of them are mapped; 0 (the default): never."""
    def warm(self, sizes: Sequence[int]) -> int:
        """One block of each size made ready (new ones faulted in now, without
        the GIL), then cached as if released. Returns the bytes faulted in."""
    def expect(self, size: int, count: int = 1) -> None:
        """``count`` reads of ``size`` bytes are expected: provision() readies a block for each."""
    def provision(self) -> int:
        """Faults in (without the GIL) and lazily frees new blocks for the
        expected reads the caches cannot serve, within the lazy and idle
        limits; nothing with a huge-page limit. Returns the bytes faulted in."""
    def mark_small_pages(self, address: int) -> None:
        """The live block at ``address`` (2 MiB or more) was faulted in on
        4 KiB pages: once idle, collapse_one() may put it back on huge pages."""
    def collapse_one(self) -> int:
        """Puts one idle marked block back on huge pages (MADV_COLLAPSE,
        without the GIL). Returns its bytes, 0 when none waits, or -errno."""
    @property
    def small_page_bytes(self) -> int: ...
    @property
    def small_page_idle_bytes(self) -> int: ...
    @property
    def collapsed_bytes(self) -> int: ...
    @property
    def activity(self) -> int: ...
    @property
    def provisioned_bytes(self) -> int: ...
    @property
    def idle_bytes(self) -> int: ...
    @property
    def lazy_bytes(self) -> int: ...
    @property
    def live_bytes(self) -> int: ...
    @property
    def hits(self) -> int: ...
    @property
    def lazy_hits(self) -> int: ...
    @property
    def fresh_bytes(self) -> int: ...
    @property
    def huge_page_bytes(self) -> int: ...

class Engine:
    """Runs requests asynchronously, split into chunks; every request
    completes exactly once, through reap() or a submit_*_now result."""
    @property
    def name(self) -> str: ...
    @property
    def event_fd(self) -> int: ...
    @property
    def pending(self) -> int: ...
    @property
    def backlog(self) -> int: ...
    @property
    def staged_bytes(self) -> int: ...
    @property
    def merged_writes(self) -> int:
        """Write chunks that went to the device inside the staging block of
        the chunk queued before them (side by side in the same file), so far."""
    @property
    def merged_vectored(self) -> int:
        """Read or write chunks (not staged) that went to the device inside
        the vectored I/O of the chunk queued before them, so far."""
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def max_in_flight_bytes(self) -> int: ...
    @property
    def inline_bytes(self) -> int:
        """Largest transfer on a page-cache file that may run within the call."""
    @property
    def fixed_buffers(self) -> tuple[int, int]: ...
    @property
    def faults_injected(self) -> int: ...
    def submit_read(self, tag: int, fd: int, addr: int, length: int, offset: int, region: int = 0,
                    region_length: int = 0) -> None:
        """region, region_length: the pool Buffer addr lies in (address,
        capacity); io_uring registers its mapping as a fixed buffer."""
    def submit_write(self, tag: int, fd: int, addr: int, length: int, offset: int, copy_from: int = 0,
                     copy_length: int = 0, region: int = 0, region_length: int = 0) -> None:
        """With copy_from (addr 0): the engine stages the bytes chunk by chunk
        through its staging pool; copy_from must stay valid until reaped."""
    def submit_read_now(self, tag: int, fd: int, addr: int, length: int, offset: int) -> Optional[int]: ...
    def submit_write_now(self, tag: int, fd: int, addr: int, length: int, offset: int) -> Optional[int]: ...
    def add_stripes(self, fds: Sequence[int], unit: int) -> int:
        """Makes the files one striped file (RAID-0, ``unit`` bytes per file in
        turn); returns the (negative) fd requests name it by."""
    def failed_fd(self, tag: int) -> int:
        """The file a failed request on a striped file failed on; else -1."""
    def submit_fsync(self, tag: int, fd: int) -> None: ...
    def submit(self, requests: Requests) -> None:
        """Submits every request at once and empties ``requests``; on an error
        nothing was submitted and they stay in it."""
    def set_staging_pool(self, pool: BufferPool, register_blocks: bool = True) -> None: ...
    def reap(self) -> list[int]:
        """Completions since the last call, flat: [tag, result, tag, result, ...]."""
    def wait(self, timeout_ms: int) -> bool: ...
    def wake(self) -> None: ...
    def set_faults(self, error_rate: float = 0.0, errnos: Sequence[int] = (), short_rate: float = 0.0,
                   delay_rate: float = 0.0, delay_ms: int = 0, seed: int = 1) -> None: ...
    def close(self) -> None:
        """Waits for the I/O in flight, then frees the engine. A signal handler
        that raises ends the wait: what is in flight is cancelled, and what is
        still in flight a second later keeps the engine alive for good; the
        exception propagates. The caller then keeps its requests' memory."""

def make_uring_engine(entries: int, chunk_bytes: int, max_in_flight: int, max_in_flight_bytes: int = ...,
                      inline_bytes: int = ...) -> Engine: ...
def make_thread_engine(threads: int, chunk_bytes: int, max_in_flight: int, max_in_flight_bytes: int = ...,
                       inline_bytes: int = ...) -> Engine: ...
def prefault(address: int, length: int, small_pages: bool) -> None: ...
def discard_pages(address: int, length: int) -> int: ...
def copy_memory(destination: int, source: int, length: int) -> None: ...
def abandoned_engines() -> int: ...
def dio_alignment(fd: int) -> tuple[int, int]: ...
