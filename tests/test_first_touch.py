"""What a fresh process's I/O costs in memory: writes stage through no more
fresh memory than is in flight, and blocks the pool lazily freed hold the data
read into them for good, even once the kernel goes reclaiming."""
import subprocess
import sys
import textwrap

import pytest

from offload import _core

STAGING_WINDOW = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    from offload import buffer_pool
    MIB = 1 << 20
    pool = buffer_pool()
    tensors = [torch.full((16 * MIB,), i, dtype=torch.uint8) for i in range(16)]   # 256 MiB
    with Offloader(sys.argv[1], backend=sys.argv[2]) as off:
        off.sync_writev(tensors)
        written_fresh = pool.fresh_bytes
        off.sync_readv(tensors)
        ok = all(bool((t == i).all()) for i, t in enumerate(tensors))
    print(written_fresh // MIB, ok)
""")


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_write_touches_no_more_fresh_memory_than_is_in_flight(tmp_path, backend):
    result = subprocess.run([sys.executable, "-c", STAGING_WINDOW, str(tmp_path), backend],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    fresh_mib, ok = result.stdout.split()
    assert ok == "True"
    # The engine keeps at most 128 MiB in flight; each chunk is staged as it
    # starts and its block recycled once reaped. (It was 256: a block per tensor.)
    assert int(fresh_mib) <= 128 + 4, fresh_mib


RECLAIM = textwrap.dedent("""
    import ctypes, sys, torch
    from offload import Offloader
    from offload import buffer_pool
    MIB = 1 << 20
    MADV_PAGEOUT = 21
    libc = ctypes.CDLL(None, use_errno=True)
    pool = buffer_pool()
    pool.set_idle_limit(0)                 # every released block goes to the lazy tier
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randint(0, 256, (8 * MIB,), dtype=torch.uint8, generator=gen) for _ in range(4)]
    expected = [t.clone() for t in tensors]
    with Offloader(sys.argv[1], backend="uring") as off:
        for _ in range(2):                 # the second read lands in lazily freed blocks
            off.sync_writev(tensors)
            off.sync_readv(tensors)
        lazy_hits = pool.lazy_hits
    # Closed: the ring let go of its registrations (which pinned the pages).
    # Reclaim the tensors' pages now, as memory pressure would: clean lazily
    # freed pages are dropped (and read back as zeros), dirty ones kept.
    for t in tensors:
        if libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), MADV_PAGEOUT) != 0:
            print("no-pageout", ctypes.get_errno()); sys.exit(0)
    print(lazy_hits, all(torch.equal(a, b) for a, b in zip(tensors, expected)))
""")


@pytest.mark.skipif(not _core.HAVE_URING, reason="needs io_uring")
def test_data_read_into_a_lazily_freed_block_survives_reclaim(tmp_path):
    result = subprocess.run([sys.executable, "-c", RECLAIM, str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("no-pageout"):
        pytest.skip(f"MADV_PAGEOUT unavailable: {result.stdout.strip()}")
    lazy_hits, intact = result.stdout.split()
    assert int(lazy_hits) >= 4
    assert intact == "True"


WARM = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    from offload import buffer_pool
    MIB = 1 << 20
    pool = buffer_pool()
    tensors = [torch.full((6 * MIB,), i, dtype=torch.uint8) for i in range(8)]
    with Offloader(sys.argv[1]) as off:
        if sys.argv[2] == "warm":
            # new memory, faulted in now: the reads' 8 x 6 MiB, and 12 x 4 MiB the
            # write stages its 4 MiB chunks through (48 MiB of them, under the 128 in flight)
            assert off.warm(tensors) == 96 * MIB
        off.sync_writev(tensors)
        hits, fresh = pool.hits, pool.fresh_bytes
        off.sync_readv(tensors)
        ok = all(bool((t == i).all()) for i, t in enumerate(tensors))
        print(pool.hits - hits, (pool.fresh_bytes - fresh) // MIB, ok)
""")


@pytest.mark.parametrize("warm", [True, False])
def test_warm_makes_the_first_reads_land_in_memory_already_faulted_in(tmp_path, warm):
    result = subprocess.run([sys.executable, "-c", WARM, str(tmp_path), "warm" if warm else "cold"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    hits, fresh_mib, ok = result.stdout.split()
    assert ok == "True"
    if warm:   # every read found a warmed buffer: no new memory faulted inside the reads
        assert int(hits) == 8 and int(fresh_mib) == 0
    else:      # the same reads without warm() take new memory
        assert int(hits) == 0 and int(fresh_mib) == 48


REGISTRATION = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    MIB = 1 << 20
    tensors = [torch.full((6 * MIB,), i, dtype=torch.uint8) for i in range(4)]
    with Offloader(sys.argv[1], backend="uring") as off:
        off.sync_writev(tensors)
        before = off.registered_buffers          # the write's staging blocks
        off.sync_readv(tensors)                  # into 4 fresh blocks
        first = off.registered_buffers - before
        off.sync_writev(tensors)                 # from those blocks, touched now
        off.sync_readv(tensors)
        later = off.registered_buffers - before
        ok = all(bool((t == i).all()) for i, t in enumerate(tensors))
    print(first, later, ok)
""")


@pytest.mark.skipif(not _core.HAVE_URING, reason="needs io_uring")
def test_reads_register_a_block_once_it_has_been_touched_not_on_its_first_use(tmp_path):
    # Registering pins a whole block at once in the submitting thread: a
    # fresh block is left to fault in under its first read, and registered
    # when the pool hands it out again.
    result = subprocess.run([sys.executable, "-c", REGISTRATION, str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, later, ok = result.stdout.split()
    assert ok == "True"
    assert int(first) == 0 and int(later) == 4, (first, later)
