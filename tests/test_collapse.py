"""Buffers faulted in on 4 KiB pages (a checkpoint load's new segment
buffers) go back onto huge pages once idle: the pool collapses them
(MADV_COLLAPSE) on its helper thread while nothing else uses it, and the next
load reads into them whole."""
import os
import sys
import textwrap

import pytest
import torch

from offload import _core, _pool
from conftest import run_python

MIB = 1 << 20


def _anon_huge_kib(address, length):
    """AnonHugePages (KiB) of the mappings overlapping [address, address + length)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo < address + length and hi > address
            elif inside and first == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def _can_collapse():
    if 2048 not in _pool.advised_page_sizes():
        return "2 MiB transparent huge pages are not enabled for advised memory"
    probe = _core.BufferPool(64 * MIB, 0)
    block = probe.acquire(4 * MIB)
    _core.prefault(block.address, block.capacity, True)
    probe.mark_small_pages(block.address)
    del block
    rc = probe.collapse_one()
    return None if rc > 0 else f"MADV_COLLAPSE refused here ({rc})"


WHY_NOT = _can_collapse()
needs_collapse = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@needs_collapse
def test_an_idle_block_faulted_on_small_pages_is_collapsed_and_keeps_its_bytes():
    pool = _core.BufferPool(256 * MIB, 0)
    block = pool.acquire(16 * MIB)
    address, capacity = block.address, block.capacity
    _core.prefault(address, capacity, True)
    data = torch.frombuffer(block, dtype=torch.uint8)
    data.copy_(torch.randint(0, 256, (capacity,), dtype=torch.uint8))
    expected = data.clone()
    pool.mark_small_pages(address)
    assert pool.small_page_bytes == capacity and pool.small_page_idle_bytes == 0
    assert pool.collapse_one() == 0            # live: never touched
    assert _anon_huge_kib(address, capacity) == 0
    del data, block
    assert pool.small_page_idle_bytes == capacity
    assert pool.collapse_one() == capacity
    assert _anon_huge_kib(address, capacity) == capacity >> 10
    assert pool.collapsed_bytes == capacity and pool.small_page_bytes == 0 and pool.idle_bytes == capacity
    assert pool.collapse_one() == 0            # nothing more marked
    again = pool.acquire(16 * MIB)             # the same block, from the idle cache, bytes as they were
    assert again.address == address and not again.fresh
    assert torch.equal(torch.frombuffer(again, dtype=torch.uint8), expected)


@needs_collapse
def test_only_marked_blocks_of_a_huge_page_or_more_are_collapsed():
    pool = _core.BufferPool(256 * MIB, 0)
    small, plain = pool.acquire(1 * MIB), pool.acquire(8 * MIB)
    _core.prefault(plain.address, plain.capacity, True)   # small pages, but never marked
    pool.mark_small_pages(small.address)                  # under 2 MiB: shares a slab, not marked
    pool.mark_small_pages(12345)                          # not a block of this pool
    assert pool.small_page_bytes == 0
    del small, plain
    assert pool.collapse_one() == 0 and pool.collapsed_bytes == 0


@needs_collapse
def test_a_marked_block_that_leaves_the_caches_is_forgotten():
    pool = _core.BufferPool(8 * MIB, 0)
    block = pool.acquire(16 * MIB)                        # beyond the idle limit: unmapped on release
    pool.mark_small_pages(block.address)
    assert pool.small_page_bytes == 16 * MIB
    del block
    assert pool.small_page_bytes == 0 and pool.collapse_one() == 0


HELPER = textwrap.dedent("""
    import sys, time, threading
    import torch, offload
    from offload import _pool
    path, mode = sys.argv[1], sys.argv[2]
    _pool._Provisioner.COLLAPSE_POLL = 0.25
    pool = offload.buffer_pool()
    loaded = offload.load(path)
    expected = {k: v.clone() for k, v in loaded.items()}
    marked = pool.small_page_bytes
    assert marked >= 24 << 20, marked                   # the new segment buffers
    if mode == "busy":
        # The pool in use all along: nothing is collapsed beside it.
        del loaded
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pool.acquire(1 << 20)                       # an acquire and a release
            time.sleep(0.005)
        assert pool.collapsed_bytes == 0, pool.collapsed_bytes
        assert pool.small_page_idle_bytes == marked
    else:
        del loaded
    deadline = time.monotonic() + 20
    while pool.small_page_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.small_page_bytes == 0 and pool.collapsed_bytes >= marked, (pool.small_page_bytes, marked)
    hits = pool.hits
    again = offload.load(path)                          # into the collapsed buffers
    assert pool.hits > hits
    assert set(again) == set(expected)
    assert all(torch.equal(again[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in expected)
    print("ok", marked)
""")


MARKED = textwrap.dedent("""
    import sys, torch, offload
    loaded = offload.load(sys.argv[1])
    print(offload.buffer_pool().small_page_bytes)
""")


@needs_collapse
@pytest.mark.parametrize("setting", ["0", "1"])
def test_offload_collapse_0_leaves_the_buffers_as_they_are(tmp_path, setting):
    import offload
    path = tmp_path / "model.safetensors"
    offload.save({"a": torch.ones(4 * MIB)}, path)
    result = run_python([sys.executable, "-c", MARKED, str(path)], capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, OFFLOAD_HUGE_PAGES="", OFFLOAD_COLLAPSE=setting))
    assert result.returncode == 0, result.stderr
    marked = int(result.stdout)
    assert marked == 0 if setting == "0" else marked >= 16 * MIB, (setting, marked, result.stderr[-2000:])


@needs_collapse
@pytest.mark.parametrize("mode", ["quiet", "busy"])
def test_a_load_collapses_its_new_buffers_once_the_pool_is_quiet_and_the_next_load_reads_into_them(tmp_path, mode):
    import offload
    generator = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(3 * MIB, generator=generator),          # 12 MiB
             "b": torch.randn(2 * MIB, generator=generator).bfloat16(),
             "c": torch.randint(0, 1 << 30, (3 * MIB,), generator=generator, dtype=torch.int32)}
    path = tmp_path / "model.safetensors"
    offload.save(state, path)
    result = run_python([sys.executable, "-c", HELPER, str(path), mode], capture_output=True, text=True,
                        timeout=120, env=dict(os.environ, OFFLOAD_HUGE_PAGES=""))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


COLLAPSE_NOW = textwrap.dedent("""
    from offload import _core, _pool
    pool = _pool.buffer_pool()
    block = pool.acquire(6 << 20)
    _core.prefault(block.address, block.capacity, True)
    pool.mark_small_pages(block.address)    # not through collapse_when_idle: no helper is woken
    capacity = block.capacity
    del block
    assert _pool._provisioner is None
    assert _pool.collapse_now() == capacity and pool.collapsed_bytes == capacity
    assert _pool.collapse_now() == 0
    print("ok")
""")


@needs_collapse
def test_collapse_now_collapses_on_the_calling_thread():
    result = run_python([sys.executable, "-c", COLLAPSE_NOW], capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, OFFLOAD_HUGE_PAGES=""))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


FORK_WHILE_COLLAPSING = textwrap.dedent("""
    import os, sys, time, torch, offload
    from offload import _pool
    _pool._Provisioner.COLLAPSE_POLL = 0.05
    pool = offload.buffer_pool()
    loaded = offload.load(sys.argv[1])
    marked = pool.small_page_bytes
    del loaded                                 # idle: the helper starts collapsing soon
    forks = 0
    while pool.small_page_bytes and forks < 200:
        pid = os.fork()
        if pid == 0:                           # the child's pool: no lock left taken, no block lost
            idle = pool.idle_bytes
            _pool.collapse_now()
            block = pool.acquire(1 << 20); del block
            os._exit(0 if pool.idle_bytes >= idle else 3)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        forks += 1
    deadline = time.monotonic() + 20
    while pool.small_page_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    print(forks, marked, pool.collapsed_bytes, pool.small_page_bytes)
""")


@needs_collapse
def test_a_fork_while_the_helper_collapses_leaves_the_child_a_working_pool(tmp_path):
    import offload
    path = tmp_path / "model.safetensors"
    offload.save({f"t{i}": torch.full((2 * MIB,), i, dtype=torch.int32) for i in range(24)}, path)  # 192 MiB
    result = run_python([sys.executable, "-c", FORK_WHILE_COLLAPSING, str(path)], capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, OFFLOAD_HUGE_PAGES=""))
    assert result.returncode == 0, result.stderr
    forks, marked, collapsed, left = (int(x) for x in result.stdout.split())
    # Every block collapsed, or (refused with EAGAIN three times while forks
    # copied its page tables) left as it was; none lost, none still pending.
    assert forks > 0 and marked >= 128 * MIB and collapsed > 0 and left == 0
