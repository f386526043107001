"""What a fresh process's I/O costs in memory: writes stage through no more
fresh memory than is in flight, a write that frees a tensor's memory has the
block its read will land in faulted in beforehand (within the lazy limit,
never for memory the pool already recycles, nor for a read that took its
block already or a tensor that died), a read given new blocks has
them faulted in on the helper thread too, and blocks the pool lazily freed
hold the data read into them for good, even once the kernel goes
reclaiming."""
import json
import os
import sys
import textwrap

import pytest

from offload import _core
from conftest import run_python

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
    result = run_python([sys.executable, "-c", STAGING_WINDOW, str(tmp_path), backend],
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
        pool.trim()                        # the other cached blocks gone: what is still lazily freed?
        with open("/proc/self/smaps_rollup") as f:
            lazy_mib = next(int(line.split()[1]) >> 10 for line in f if line.startswith("LazyFree:"))
    # Closed: the ring let go of its registrations (which pinned the pages).
    # Reclaim the tensors' pages now, as memory pressure would: clean lazily
    # freed pages are dropped (and read back as zeros), dirty ones kept.
    for t in tensors:
        if libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), MADV_PAGEOUT) != 0:
            print("no-pageout", ctypes.get_errno()); sys.exit(0)
    print(lazy_hits, lazy_mib, all(torch.equal(a, b) for a, b in zip(tensors, expected)))
""")


@pytest.mark.skipif(not _core.HAVE_URING, reason="needs io_uring")
def test_data_read_into_a_lazily_freed_block_survives_reclaim(tmp_path):
    result = run_python([sys.executable, "-c", RECLAIM, str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("no-pageout"):
        pytest.skip(f"MADV_PAGEOUT unavailable: {result.stdout.strip()}")
    lazy_hits, lazy_mib, intact = result.stdout.split()
    assert int(lazy_hits) >= 4
    # None of the data's pages is left clean and lazily freed, for the kernel
    # to discard: MADV_PAGEOUT did not reclaim such pages on Linux 6.18 (the
    # test passed without the pool's write to each reused page), LazyFree
    # shows them (32 MiB without that write).
    assert int(lazy_mib) < 2, result.stdout
    assert intact == "True"


WARM = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    from offload import buffer_pool
    MIB = 1 << 20
    pool = buffer_pool()
    pool.set_lazy_limit(0)   # no provisioning (and no lazily freed blocks): warm() alone
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
    result = run_python([sys.executable, "-c", WARM, str(tmp_path), "warm" if warm else "cold"],
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
    from offload import Offloader, buffer_pool
    MIB = 1 << 20
    buffer_pool().set_lazy_limit(0)  # no provisioning: the reads take fresh blocks
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
    result = run_python([sys.executable, "-c", REGISTRATION, str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, later, ok = result.stdout.split()
    assert ok == "True"
    assert int(first) == 0 and int(later) == 4, (first, later)


PROVISION = textwrap.dedent("""
    import json, sys, torch
    from offload import Offloader, buffer_pool
    from offload._pool import wait_provisioned
    MIB = 1 << 20
    pool = buffer_pool()
    if sys.argv[3] != "default":
        pool.set_lazy_limit(int(sys.argv[3]) * MIB)
    size, count = int(sys.argv[4]), int(sys.argv[5])
    tensors = [torch.full((size,), i % 256, dtype=torch.uint8) for i in range(count)]  # torch's memory
    out = {}
    with Offloader(sys.argv[1], backend=sys.argv[2]) as off:
        off.sync_writev(tensors)
        wait_provisioned()
        out["provisioned"] = pool.provisioned_bytes // MIB
        out["lazy"] = pool.lazy_bytes // MIB
        out["idle_kib"] = pool.idle_bytes // 1024
        fresh, hits = pool.fresh_bytes, pool.hits + pool.lazy_hits
        off.sync_readv(tensors)
        out["read_fresh"] = (pool.fresh_bytes - fresh) // MIB
        out["read_cached"] = pool.hits + pool.lazy_hits - hits
        out["ok"] = all(bool((t == i % 256).all()) for i, t in enumerate(tensors))
        # Again, from the blocks the reads made the tensors' memory: the pool
        # recycles those itself, so nothing more is provisioned.
        before = pool.provisioned_bytes
        off.sync_writev(tensors)
        wait_provisioned()
        out["again"] = (pool.provisioned_bytes - before) // MIB
    print(json.dumps(out))
""")


def run_provision(tmp_path, backend, lazy_limit_mib="default", size=6 * (1 << 20) + 1000, count=8):
    result = run_python([sys.executable, "-c", PROVISION, str(tmp_path), backend, str(lazy_limit_mib), str(size),
                         str(count)],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_large_write_provisions_its_read_block_once_its_memory_is_freed(tmp_path):
    """Tensors over 32 MiB are freed on the releaser's thread, which then
    asks for their read blocks: the reads still take no new memory."""
    out = run_provision(tmp_path, "auto", size=40 * (1 << 20) + 1000, count=3)
    assert out["ok"] is True
    assert out["provisioned"] == (3 * (40 * 1024 + 4)) // 1024
    assert out["read_fresh"] == 0 and out["read_cached"] == 3, out


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_write_provisions_the_blocks_its_reads_land_in(tmp_path, backend):
    """Each tensor's write frees its memory; the block its read needs
    (6 MiB + 1000 bytes, rounded to 6 MiB + 4 KiB) is faulted in then, lazily
    freed, and the read lands in it: none of the reads takes new memory."""
    if backend == "uring" and not _core.HAVE_URING:
        pytest.skip("needs io_uring")
    out = run_provision(tmp_path, backend)
    assert out["ok"] is True
    assert out["provisioned"] == (8 * (6 * 1024 + 4)) // 1024   # 8 blocks of 6 MiB + 4 KiB, in MiB
    assert out["lazy"] >= 48
    assert out["read_fresh"] == 0 and out["read_cached"] == 8, out
    assert out["again"] == 0


def test_blocks_under_a_huge_page_are_provisioned_into_the_idle_cache(tmp_path):
    """192 tensors of 1 MiB + 1000 bytes (blocks of 1 MiB + 4 KiB, carved
    from 2 MiB slabs), more than the write keeps in flight: the blocks it
    staged through serve some of the reads, the rest are provisioned, and
    kept idle (lazily freeing one would split its huge page)."""
    out = run_provision(tmp_path, "threads", size=(1 << 20) + 1000, count=192)
    assert out["ok"] is True
    assert out["provisioned"] >= 192 - 128 and out["lazy"] == 0, out
    assert out["read_fresh"] == 0 and out["read_cached"] == 192, out
    assert out["again"] == 0


def test_provisioning_stays_within_the_lazy_limit(tmp_path):
    out = run_provision(tmp_path, "threads", 20)   # room for three of the eight blocks
    assert out["ok"] is True
    assert out["provisioned"] == (3 * (6 * 1024 + 4)) // 1024 and out["lazy"] <= 20, out
    assert out["read_fresh"] >= 5 * 6   # the other five reads take new memory, as without
    off = run_provision(tmp_path, "threads", 0)    # a lazy limit of 0 turns it off
    assert off["provisioned"] == 0 and off["read_fresh"] >= 48 and off["ok"] is True


IMMEDIATE_READ = textwrap.dedent("""
    import sys, torch
    from offload import Offloader, buffer_pool
    from offload import _pool
    MIB = 1 << 20
    _pool._Provisioner.QUIET = float(sys.argv[2])
    pool = buffer_pool()
    tensors = [torch.full((6 * MIB + 1000,), i, dtype=torch.uint8) for i in range(8)]
    with Offloader(sys.argv[1], backend="threads") as off:
        off.sync_writev(tensors)
        fresh = pool.fresh_bytes
        off.sync_readv(tensors)          # takes its blocks at issue: the expected reads are met
        read_fresh = pool.fresh_bytes - fresh
        _pool.wait_provisioned()
        ok = all(bool((t == i).all()) for i, t in enumerate(tensors))
    print(pool.provisioned_bytes, read_fresh, ok)
""")

BLOCK = 6 * (1 << 20) + 4096   # 6 MiB + 1000 bytes, rounded up to whole pages


def run_immediate_read(tmp_path, quiet):
    result = run_python([sys.executable, "-c", IMMEDIATE_READ, str(tmp_path), str(quiet)],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    provisioned, read_fresh, ok = result.stdout.split()
    assert ok == "True"
    return int(provisioned), int(read_fresh)


def test_a_read_right_after_the_write_leaves_nothing_to_provision(tmp_path):
    """With provisioning held back until writes pause, a read issued before
    then faults its own blocks in, which meets the expectations: nothing is
    provisioned afterwards."""
    provisioned, read_fresh = run_immediate_read(tmp_path, 2.0)
    assert provisioned == 0 and read_fresh == 8 * BLOCK


def test_a_read_racing_provisioning_faults_no_block_twice(tmp_path):
    """By default provisioning runs beside the writes, and a read issued at
    once races it: each block the reads need is faulted in by one of the
    two, never both, but for the one block the helper thread had in hand."""
    provisioned, read_fresh = run_immediate_read(tmp_path, 0.0)
    assert provisioned % BLOCK == 0 and read_fresh % BLOCK == 0
    assert 8 * BLOCK <= provisioned + read_fresh <= 9 * BLOCK, (provisioned, read_fresh)


LATE_FREE = textwrap.dedent("""
    import gc, sys, torch
    from offload import Offloader, buffer_pool
    from offload import _pool, _releaser
    MIB = 1 << 20
    pool = buffer_pool()
    mode, size = sys.argv[2], (40 * MIB if sys.argv[2] != "queued" else 6 * MIB) + 1000
    tensors = [torch.full((size,), i, dtype=torch.uint8) for i in range(3)]   # torch's memory
    with Offloader(sys.argv[1], backend="threads") as off:
        if mode == "queued":            # under 32 MiB: freed at once, provisioned after the reap
            for t in tensors:
                off.async_write(t)
                off.async_read(t)       # starts as soon as the write lands, before that reap ends
            off.synchronize()
        else:                           # over 32 MiB: freed on the releaser's thread, then provisioned
            with _releaser._releaser.in_hand:   # which frees nothing, and asks for nothing, until this ends
                off.sync_writev(tensors)
                if mode == "read first":
                    off.sync_readv(tensors)     # the reads take their blocks before the frees ask for them
                elif mode == "died":
                    del tensors
                    gc.collect()
                    off.synchronize()           # the Offloader learns of the deaths
        _pool.wait_provisioned()
        provisioned = pool.provisioned_bytes
        ok = True
        if mode == "in order":
            hits = pool.hits + pool.lazy_hits
            off.sync_readv(tensors)
            ok = pool.hits + pool.lazy_hits - hits == 3
        if mode != "died":
            ok = ok and all(bool((t == i).all()) for i, t in enumerate(tensors))
    print(provisioned, ok)
""")


@pytest.mark.parametrize("mode", ["in order", "read first", "died", "queued"])
def test_a_block_is_provisioned_only_for_a_read_still_to_come(tmp_path, mode):
    """A written tensor's freed memory asks for a block for its read, unless
    that read took its block already or the tensor died: such a block would
    be faulted in for no one, beside whatever runs next. "in order": the
    frees come before the reads, which land in the three blocks provisioned.
    "read first": the releaser's thread frees the memory only after the
    reads took their blocks. "died": the tensors die before their memory is
    freed. "queued": each read waits behind its write and starts when the
    write lands, before the reap that freed the memory asks for blocks."""
    result = run_python([sys.executable, "-c", LATE_FREE, str(tmp_path), mode],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    provisioned, ok = result.stdout.split()
    assert ok == "True"
    block = 40 * (1 << 20) + 4096
    assert int(provisioned) == (3 * block if mode == "in order" else 0), provisioned


FORK_WHILE_PROVISIONING = textwrap.dedent("""
    import os, sys, torch
    from offload import Offloader, buffer_pool
    from offload import _pool
    MIB = 1 << 20
    _pool._Provisioner.QUIET = 0.0
    tensors = [torch.full((8 * MIB,), i, dtype=torch.uint8) for i in range(32)]
    with Offloader(sys.argv[1], backend="threads") as off:
        off.sync_writev(tensors)              # 32 blocks to provision: forks land among them
        for _ in range(20):
            pid = os.fork()
            if pid == 0:                       # the pool works in the child: no lock left taken
                buffer_pool().warm([MIB]); buffer_pool().trim()
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert status == 0, status
        _pool.wait_provisioned()
        off.sync_readv(tensors)
        ok = all(bool((t == i).all()) for i, t in enumerate(tensors))
    print(buffer_pool().provisioned_bytes // MIB, ok)
""")


def test_a_fork_while_blocks_are_provisioned_leaves_the_child_a_working_pool(tmp_path):
    result = run_python([sys.executable, "-c", FORK_WHILE_PROVISIONING, str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    provisioned, ok = result.stdout.split()
    assert ok == "True" and int(provisioned) > 0


READS_INTO_NEW_BLOCKS = textwrap.dedent("""
    import sys, torch
    from offload import Offloader, buffer_pool
    from offload import _pool
    MIB = 1 << 20
    pool = buffer_pool()
    pool.set_lazy_limit(0)                 # nothing provisioned: every read gets new blocks
    pool.set_idle_limit(0)
    gen = torch.Generator().manual_seed(5)
    expected = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
                for n in [48 * MIB, 16 * MIB + 4096, 3 * MIB, 8 * MIB + 1000] * 4]
    fresh, intact = 0, True
    with Offloader(sys.argv[1], backend=sys.argv[2]) as off:
        for _ in range(3):
            tensors = [t.clone() for t in expected]
            off.sync_writev(tensors)
            pool.trim()
            before = pool.fresh_bytes
            off.sync_readv(tensors)        # 300 MiB: more than the engine keeps in flight
            fresh += pool.fresh_bytes - before
            intact = intact and all(torch.equal(a, b) for a, b in zip(tensors, expected))
            del tensors
        _pool.wait_provisioned()
    print(fresh // MIB, _pool.faulted_in_for_reads() // MIB, intact)
""")


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_new_blocks_that_reads_are_given_are_faulted_in_on_the_helper_and_keep_their_bytes(tmp_path, backend):
    """A read given new blocks hands them to the helper thread, which faults
    them in while the engine works through the reads before them; faulting in
    pages a read's submission already faulted in (and the kernel may be
    reading into) must leave its bytes as they land."""
    result = run_python([sys.executable, "-c", READS_INTO_NEW_BLOCKS, str(tmp_path), backend],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    fresh_mib, faulted_mib, intact = result.stdout.split()
    assert intact == "True"
    assert int(fresh_mib) >= 3 * 300 and int(faulted_mib) == int(fresh_mib), (fresh_mib, faulted_mib)


UNDER_PRESSURE = textwrap.dedent("""
    import os, sys
    directory, cgroup, version, backend = sys.argv[1:5]
    import torch
    from offload import Offloader, buffer_pool
    # Joined after the imports: the page cache they read stays charged where it
    # was (another process dropping caches would otherwise leave this cgroup
    # file pages that reclaim takes before the lazily freed ones); everything
    # the pool maps from here on is charged to this cgroup.
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    MIB = 1 << 20
    LIMIT = os.path.join(cgroup, "memory.max" if version == "2" else "memory.limit_in_bytes")
    USAGE = os.path.join(cgroup, "memory.current" if version == "2" else "memory.usage_in_bytes")
    STAT = os.path.join(cgroup, "memory.stat")

    def lazy_free():
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("LazyFree:"))

    pool = buffer_pool()
    pool.set_idle_limit(0)                 # every block released is lazily freed
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randint(0, 256, (8 * MIB,), dtype=torch.uint8, generator=gen) for _ in range(8)]
    expected = [t.clone() for t in tensors]
    with Offloader(directory, backend=backend) as off:
        off.sync_writev(tensors)
        off.sync_readv(tensors)            # into pool blocks
        off.sync_writev(tensors)           # which the writes release: lazily freed (io_uring: still registered)
        lazy_before = lazy_free()
        # The cgroup's limit 32 MiB above what it uses, then that much more
        # touched, and its page cache, and 32 MiB: the kernel must reclaim,
        # and without swap it can take only page cache (first, if any) and
        # lazily freed pages, so at least 32 MiB of the latter.
        with open(USAGE) as f:
            usage = int(f.read())
        with open(STAT) as f:
            cache_key = "file" if version == "2" else "cache"
            cached = next(int(value) for key, value in map(str.split, f) if key == cache_key)
        with open(LIMIT, "w") as f:
            f.write(str(usage + 32 * MIB))
        try:
            hog = torch.ones(64 * MIB + cached, dtype=torch.uint8)
            del hog
            lazy_after = lazy_free()
            hits = pool.lazy_hits
            off.sync_readv(tensors)        # into those blocks again, whatever reclaim left of them
                                           # (io_uring: as fixed buffers, which the kernel does not mark dirty)
            reused = pool.lazy_hits - hits
        finally:
            with open(LIMIT, "w") as f:
                f.write("max" if version == "2" else "-1")
        pool.trim()                        # the other cached blocks gone: what is still lazily freed?
        lazy_holding_data = lazy_free()
        intact = all(torch.equal(a, b) for a, b in zip(tensors, expected))
    print(lazy_before // MIB, lazy_after // MIB, reused, lazy_holding_data // MIB, intact)
""")


def _memory_cgroup():
    """A new memory cgroup under this process's own, and its version; None
    where there is none to make (no root, no memory controller)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    candidates = [(os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")), "1")
                  for _, controllers, path in lines if "memory" in controllers.split(",")]
    candidates += [(os.path.join("/sys/fs/cgroup", path.lstrip("/")), "2")
                   for hierarchy, controllers, path in lines if hierarchy == "0" and controllers == ""]
    for parent, version in candidates:
        if version == "2":
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
        child = os.path.join(parent, f"offload-test-{os.getpid()}")
        try:
            os.mkdir(child)
        except OSError:
            continue
        return child, version
    return None


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_data_read_into_lazily_freed_blocks_survives_a_memory_cgroup_squeezing_them(tmp_path, backend):
    """Real memory pressure, not a simulation of it: a cgroup's limit set
    just above what the process uses, then more memory touched. The lazily
    freed blocks' pages are reclaimed (LazyFree falls), and the reads that
    reuse the blocks, under that limit, cancel the lazy free before the data
    lands: none of their pages is left for the kernel to discard (LazyFree
    counts only clean pages), and every byte read is as written. Through
    io_uring the blocks are read into as registered buffers, which the
    kernel does not mark dirty: without the pool's write to each page on
    reuse, all 64 MiB stayed lazily freed (checked by taking it out). The
    thread pool's O_DIRECT reads dirty the pages themselves."""
    if backend == "uring" and not _core.HAVE_URING:
        pytest.skip("needs io_uring")
    made = _memory_cgroup()
    if made is None:
        pytest.skip("no memory cgroup to make here (needs root and a memory controller)")
    cgroup, version = made
    try:
        result = run_python([sys.executable, "-c", UNDER_PRESSURE, str(tmp_path), cgroup, version, backend],
                            capture_output=True, text=True, timeout=120)
    finally:
        os.rmdir(cgroup)
    assert result.returncode == 0, result.stderr
    lazy_before, lazy_after, reused, lazy_holding_data, intact = result.stdout.split()
    assert int(lazy_before) >= 64, result.stdout           # the eight 8 MiB blocks, lazily freed
    assert int(lazy_after) <= int(lazy_before) - 8, result.stdout    # the squeeze reclaimed some
    assert int(reused) == 8                                 # every read took one of those blocks
    assert int(lazy_holding_data) < 2, result.stdout        # and cancelled its lazy free
    assert intact == "True"
