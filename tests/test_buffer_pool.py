import gc

import torch

from offload import _core

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


def test_block_goes_back_when_the_tensor_using_it_dies():
    pool = _core.BufferPool(64 * MIB)
    t = torch.frombuffer(pool.acquire(MIB), dtype=torch.uint8)
    t.fill_(7)
    assert pool.live_bytes == MIB
    del t
    gc.collect()
    assert pool.live_bytes == 0 and pool.idle_bytes == MIB
