import ctypes
import gc
import sys
import textwrap

import pytest
import torch

from offload import _core
from conftest import run_python

MIB = 1 << 20


def test_blocks_are_page_aligned_and_rounded():
    pool = _core.BufferPool(64 * MIB)
    for size in (1, 4095, 4096, 4097, 3 * MIB + 5):
        b = pool.acquire(size)
        assert b.address % 4096 == 0
        assert b.capacity == _core.BufferPool.capacity_for(size) >= size
        assert b.capacity % 4096 == 0


def test_released_blocks_are_reused_for_the_same_size():
    pool = _core.BufferPool(64 * MIB)
    b = pool.acquire(MIB)
    address = b.address
    del b
    assert pool.idle_bytes == MIB and pool.live_bytes == 0
    again = pool.acquire(MIB)
    assert again.address == address and pool.hits == 1


def test_idle_limit_bounds_the_cache():
    pool = _core.BufferPool(3 * MIB)
    blocks = [pool.acquire(MIB) for _ in range(5)]
    assert pool.live_bytes == 5 * MIB
    del blocks
    assert pool.idle_bytes == 3 * MIB and pool.live_bytes == 0
    pool.set_idle_limit(MIB)
    assert pool.idle_bytes == MIB
    pool.trim()
    assert pool.idle_bytes == 0


def test_a_block_larger_than_the_idle_limit_leaves_the_cache_as_it_was():
    """It cannot be kept, so it goes (lazily freed) without evicting the
    smaller blocks the cache holds for the next reads."""
    pool = _core.BufferPool(4 * MIB, 64 * MIB)
    small = [pool.acquire(MIB) for _ in range(3)]
    addresses = {b.address for b in small}
    big = pool.acquire(8 * MIB)
    del small
    del big
    assert pool.idle_bytes == 3 * MIB and pool.lazy_bytes == 8 * MIB
    again = [pool.acquire(MIB) for _ in range(3)]
    assert {b.address for b in again} == addresses and pool.hits == 3


def mapped(address: int) -> bool:
    """Whether the page at ``address`` is mapped (mincore fails with ENOMEM where it is not)."""
    vector = (ctypes.c_ubyte * 1)()
    return ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(address), ctypes.c_size_t(4096), vector) == 0


def test_a_slab_whose_small_blocks_are_all_freed_is_unmapped():
    """Small blocks are carved from 2 MiB slabs; once every block of a slab
    is freed (nothing cached: idle and lazy limits 0), the slab goes back."""
    pool = _core.BufferPool(0)
    blocks = [pool.acquire(64 << 10) for _ in range(4)]
    slab = blocks[0].address & ~((2 << 20) - 1)
    assert all(b.address & ~((2 << 20) - 1) == slab for b in blocks) and mapped(slab)
    del blocks[:3]
    assert mapped(slab)                       # one block still lives in it
    del blocks
    assert not mapped(slab)


def test_block_goes_back_when_the_tensor_using_it_dies():
    pool = _core.BufferPool(64 * MIB)
    t = torch.frombuffer(pool.acquire(MIB), dtype=torch.uint8)
    t.fill_(7)
    assert pool.live_bytes == MIB
    del t
    gc.collect()
    assert pool.live_bytes == 0 and pool.idle_bytes == MIB


def test_eviction_takes_the_least_recently_released_block_of_any_size():
    pool = _core.BufferPool(8 * MIB)
    big = pool.acquire(4 * MIB)
    small = [pool.acquire(64 << 10) for _ in range(64)]       # 4 MiB of small blocks
    del big                                                   # released first: the oldest
    del small                                                 # the cache is full now (8 MiB)
    assert pool.idle_bytes == 8 * MIB
    newer = pool.acquire(MIB)
    del newer                                                 # over the limit: the big block goes
    assert pool.idle_bytes == 5 * MIB
    hits = pool.hits
    again = pool.acquire(4 * MIB)
    assert pool.hits == hits                                  # not served from the cache: evicted
    kept = [pool.acquire(64 << 10) for _ in range(64)]        # all 64 small ones still cached
    assert pool.hits == hits + 64
    del kept, again


def test_releasing_into_a_full_cache_of_many_blocks_stays_cheap():
    """Eviction looks at the oldest block of each size class, not at every
    idle block: 40,000 releases into a full cache of 40,000 small blocks
    (scanning every idle block per eviction, as the pool first did, took 2.3 s here)."""
    import time
    pool = _core.BufferPool(40000 * 4096)
    blocks = [pool.acquire(4096) for _ in range(80000)]
    start = time.perf_counter()
    del blocks
    elapsed = time.perf_counter() - start
    assert pool.idle_bytes == 40000 * 4096
    assert elapsed < 1.0, f"{elapsed:.2f} s for 80,000 releases"


def _lazy_free_kib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("LazyFree:"):
                return int(line.split()[1])
    raise AssertionError("no LazyFree line in /proc/self/smaps_rollup")


def test_blocks_beyond_the_idle_limit_are_lazily_freed_then_reused():
    pool = _core.BufferPool(4 * MIB, 64 * MIB)
    blocks = [pool.acquire(4 * MIB) for _ in range(4)]
    for b in blocks:
        torch.frombuffer(b, dtype=torch.uint8).fill_(7)  # faulted in
    addresses = {b.address for b in blocks}
    before = _lazy_free_kib()
    del b, blocks
    assert pool.idle_bytes == 4 * MIB and pool.lazy_bytes == 12 * MIB
    # The kernel sees them as reclaimable: given back, as far as memory pressure goes.
    assert _lazy_free_kib() - before >= 12 * 1024
    again = [pool.acquire(4 * MIB) for _ in range(4)]
    assert {b.address for b in again} == addresses
    assert pool.hits == 1 and pool.lazy_hits == 3 and pool.lazy_bytes == 0
    assert _lazy_free_kib() - before < 4 * 1024  # reuse cancelled the lazy free
    assert pool.fresh_bytes == 16 * MIB           # only the first four were new


def test_lazy_limit_bounds_what_is_kept_and_trim_frees_everything():
    pool = _core.BufferPool(0, 2 * MIB)
    blocks = [pool.acquire(MIB) for _ in range(4)]
    del blocks
    assert pool.idle_bytes == 0 and pool.lazy_bytes == 2 * MIB
    pool.set_lazy_limit(MIB)
    assert pool.lazy_bytes == MIB
    pool.trim()
    assert pool.lazy_bytes == 0 and pool.idle_bytes == 0


def test_a_block_is_fresh_only_on_its_first_use():
    pool = _core.BufferPool(64 * MIB, 64 * MIB)
    big, small = pool.acquire(3 * MIB), pool.acquire(64 << 10)
    assert big.fresh and small.fresh
    addresses = big.address, small.address
    del big, small
    again = pool.acquire(3 * MIB), pool.acquire(64 << 10)
    assert (again[0].address, again[1].address) == addresses
    assert not again[0].fresh and not again[1].fresh     # cached: touched already
    del again
    pool.set_idle_limit(0)                                # both go to the lazy tier
    lazy = pool.acquire(3 * MIB)
    assert pool.lazy_hits == 1 and not lazy.fresh          # write-touched when handed out


FORK_WHILE_A_POOL_IS_LOCKED = textwrap.dedent("""
    import os, sys, threading, time
    import torch
    from offload import Offloader, _core, buffer_pool

    directory, which = sys.argv[1], sys.argv[2]
    pool = buffer_pool() if which == "process" else _core.BufferPool(1 << 30)
    holder = threading.Thread(target=pool._hold_lock, args=(400,))
    holder.start()
    time.sleep(0.1)                          # the holder is inside the pool's lock
    pid = os.fork()
    if pid == 0:                             # the child's first use of the pools
        pool.acquire(4096)
        with Offloader(directory) as off:
            t = torch.arange(1 << 16, dtype=torch.float32)
            off.sync_write(t)
            off.sync_read(t)
            os._exit(0 if torch.equal(t, torch.arange(1 << 16, dtype=torch.float32)) else 3)
    deadline = time.monotonic() + 15
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("the child hung")
            sys.exit(1)
        time.sleep(0.01)
    holder.join()
    print("child exit status", status)
    sys.exit(0 if status == 0 else 2)
""")


@pytest.mark.parametrize("which", ["process", "another"])
def test_a_fork_while_another_thread_is_inside_a_pool_leaves_the_child_a_working_pool(tmp_path, which):
    # fork() copies memory, not threads: a pool lock held at that moment by
    # another thread would stay taken in the child, whose first acquire (or
    # first Offloader) then hangs. fork() waits the holder out instead.
    result = run_python([sys.executable, "-c", FORK_WHILE_A_POOL_IS_LOCKED, str(tmp_path), which],
                        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
