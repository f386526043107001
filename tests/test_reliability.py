"""Hardening: random faults, cancellation, shutdown, load, bad input, security.
The counts here are the ones RELIABILITY.md reports."""
import asyncio
import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import offload._backing_file as backing_file
from offload import Offloader
from conftest import uring_refusal

FAULT_OPS = 3000
LOAD_OPS = 20000
OPEN_CLOSE_CYCLES = 1000
HARD_ERRNOS = {errno.EIO, errno.ENOSPC}


@pytest.fixture(params=["uring", "threads"])
def backend(request):
    if request.param == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    return request.param


def random_bytes(rng, n):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng)


# ------------------------------------------------------------------ random faults
def test_random_faults_every_operation_completes_exactly_once(tmp_path, backend):
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    tensors = [random_bytes(gen, rng.choice([1, 4095, 70_000, 1 << 20, (3 << 20) + 5])) for _ in range(40)]
    expected = [t.clone() for t in tensors]
    calls = {}      # op number -> callback count
    ops = []        # (op number, kind, index, handle)
    with Offloader(tmp_path, backend=backend) as off:
        off.inject_faults(error_rate=0.05, errnos=[errno.EIO, errno.ENOSPC, errno.EAGAIN, errno.EINTR],
                          short_rate=0.1, delay_rate=0.02, delay_ms=30, seed=7)
        for batch_start in range(0, FAULT_OPS, 20):
            # 20 operations on 20 different tensors, then a synchronize.
            for number, i in zip(range(batch_start, batch_start + 20), rng.sample(range(len(tensors)), 20)):
                calls[number] = 0

                def on_done(number=number):
                    calls[number] += 1

                t = tensors[i]
                if is_offloaded(t):
                    ops.append((number, "read", i, off.async_read(t, callback=on_done)))
                else:
                    ops.append((number, "write", i, off.async_write(t, callback=on_done)))
            try:
                off.synchronize()
            except OSError as error:
                assert error.errno in HARD_ERRNOS
        injected = off.faults_injected
        off.inject_faults()
        for number, kind, i, handle in ops:
            assert handle.done()
            error = handle.exception()
            if error is None:
                assert calls[number] == 1            # exactly once, on success
            else:
                assert calls[number] == 0            # never on failure
                assert isinstance(error, OSError) and error.errno in HARD_ERRNOS
                assert error.filename == off.path
        for t in tensors:                            # nothing lost: every byte comes back
            if is_offloaded(t):
                off.sync_read(t)
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    failures = sum(1 for *_, h in ops if h.exception() is not None)
    print(f"\n[{backend}] {len(ops)} operations, {injected} faults injected, {failures} failed "
          f"with EIO/ENOSPC, {len(ops) - failures} succeeded; callbacks exactly once; all bytes back")
    assert injected > 100 and 0 < failures < len(ops)


def is_offloaded(t):
    """With nothing in flight on ``t``: the store holds it and its memory is
    released (a write that failed left it in memory; a read that failed left
    it offloaded)."""
    return t.untyped_storage().nbytes() == 0


def test_faults_under_asyncio_every_future_resolves(tmp_path, backend):
    gen = torch.Generator().manual_seed(2)
    tensors = [random_bytes(gen, 50_000 + i) for i in range(64)]
    expected = [t.clone() for t in tensors]

    async def main(off):
        outcomes = []
        for _ in range(10):
            results = await asyncio.gather(*(off.write(t) for t in tensors), return_exceptions=True)
            outcomes += results
            written = [t for t, r in zip(tensors, results) if r is None]
            results = await asyncio.gather(*(off.read(t) for t in written), return_exceptions=True)
            outcomes += results
            for t in written:  # a failed read leaves the data on disk: retry until it succeeds
                while t.untyped_storage().nbytes() == 0:
                    try:
                        await off.read(t)
                    except OSError as error:
                        assert error.errno in HARD_ERRNOS
        return outcomes

    with Offloader(tmp_path, backend=backend) as off:
        off.inject_faults(error_rate=0.1, errnos=[errno.EIO, errno.EAGAIN], delay_rate=0.05, delay_ms=20, seed=3)
        outcomes = asyncio.run(asyncio.wait_for(main(off), timeout=120))
        off.inject_faults()
    errors = [o for o in outcomes if o is not None]
    print(f"\n[{backend}] {len(outcomes)} awaited operations, {len(errors)} raised EIO, all resolved")
    assert all(isinstance(e, OSError) and e.errno in HARD_ERRNOS for e in errors)
    assert 0 < len(errors) < len(outcomes)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


def test_a_completion_delayed_for_long_still_arrives(tmp_path, backend):
    t = torch.randn(1 << 20)
    expected = t.clone()
    with Offloader(tmp_path, backend=backend) as off:
        off.inject_faults(delay_rate=1.0, delay_ms=1500)
        started = time.monotonic()

        async def main():
            await off.write(t)   # only the delay timer can wake the loop here
            await off.read(t)

        asyncio.run(main())
        assert time.monotonic() - started >= 3.0  # both held back, neither lost
        off.inject_faults()
    assert torch.equal(t, expected)


# ------------------------------------------------------------------ cancellation
@pytest.mark.parametrize("kind", ["read", "write"])
def test_cancelled_await_never_frees_memory_in_use(tmp_path, backend, kind):
    t = torch.randn(4 << 20)
    expected = t.clone()
    with Offloader(tmp_path, backend=backend) as off:
        if kind == "read":
            off.sync_write(t)
        off.inject_faults(delay_rate=1.0, delay_ms=300)  # keep it in flight while we cancel

        async def main():
            task = asyncio.ensure_future(off.read(t) if kind == "read" else off.write(t))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        # Documented state: the operation ran to the end anyway.
        off.synchronize()
        if kind == "read":
            assert torch.equal(t, expected)
        else:
            assert t.untyped_storage().nbytes() == 0
            off.inject_faults()
            off.sync_read(t)
            assert torch.equal(t, expected)
        off.inject_faults()
        off.sync_write(t)  # still usable
        off.sync_read(t)
    assert torch.equal(t, expected)


# ------------------------------------------------------------------ shutdown
EXIT_IN_FLIGHT = textwrap.dedent("""
    import sys, torch
    import offload._backing_file as bf
    bf.try_tmpfile = False
    from offload import Offloader
    off = Offloader(sys.argv[1])
    # Long enough that all 8 are still in flight at the print on a busy machine
    # too (at 200 ms, 2 runs of many saw one finish before it).
    off.inject_faults(delay_rate=1.0, delay_ms=1000)
    keep = [torch.randn(1 << 20) for _ in range(8)]
    handles = [off.async_write(t) for t in keep]
    print(sum(not h.done() for h in handles), flush=True)
    # the interpreter exits here, with the writes in flight and no close()
""")


def test_interpreter_exit_with_operations_in_flight(tmp_path):
    result = subprocess.run([sys.executable, "-c", EXIT_IN_FLIGHT, str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == 8
    assert os.listdir(tmp_path) == []  # the named backing file was removed


KILLED = textwrap.dedent("""
    import sys, time, torch
    import offload._backing_file as bf
    bf.try_tmpfile = False
    from offload import Offloader
    off = Offloader(sys.argv[1])
    off.sync_write(torch.randn(1 << 16))
    print("ready", flush=True)
    time.sleep(60)
""")


def test_sigkill_leaves_a_file_the_next_offloader_cleans_up(tmp_path, monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    monkeypatch.setattr(backing_file, "try_tmpfile", False)
    with Offloader(tmp_path):                       # the child is alive: its file is left alone
        assert len(os.listdir(tmp_path)) == 2
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert len(os.listdir(tmp_path)) == 1          # the dead child's file
    with Offloader(tmp_path) as off:                # the next Offloader does not trip over it...
        t = torch.randn(100)
        off.sync_write(t)
        off.sync_read(t)
        assert os.listdir(tmp_path) == [os.path.basename(off.path)]  # ...and removed it
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ load
@pytest.mark.slow
def test_20000_mixed_operations_of_random_sizes(tmp_path):
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    # 1 B .. 16 MiB, log-uniform, and one of 64 MiB (16 chunks): ~1 MB an
    # operation on average (up to 64 MiB each, ~3.7 MB: a minute of disk
    # time on a slow VM, for no path this does not reach).
    sizes = [1, 64 << 20] + [max(1, int(2 ** rng.uniform(0, 24))) for _ in range(46)]
    tensors = [random_bytes(gen, n) for n in sizes]
    expected = [t.clone() for t in tensors]
    callbacks = 0

    async def main(off):
        pending = []        # (index, handle)
        busy = set()
        for _ in range(LOAD_OPS):
            i = rng.randrange(len(tensors))
            if i in busy or len(pending) >= 32:      # bounded in-flight depth
                index, handle = pending.pop(0)
                await handle
                busy.discard(index)
                if i in busy:
                    continue
            t = tensors[i]
            method = off.read if t.untyped_storage().nbytes() == 0 and t.numel() else off.write
            mode = rng.choice(["await", "callback", "handle"])
            if mode == "await":
                await method(t)
            else:
                def count():
                    nonlocal callbacks
                    callbacks += 1
                pending.append((i, method(t, callback=count if mode == "callback" else None)))
                busy.add(i)
        for _, handle in pending:
            await handle

    with Offloader(tmp_path) as off:
        started = time.monotonic()
        asyncio.run(main(off))
        off.synchronize()
        for t in tensors:
            if t.untyped_storage().nbytes() == 0 and t.numel():
                off.sync_read(t)
        elapsed = time.monotonic() - started
    moved = sum(sizes)
    print(f"\n{LOAD_OPS} operations on {len(tensors)} tensors of 1 B to {max(sizes) >> 20} MiB "
          f"({callbacks} callbacks) in {elapsed:.1f} s; all bytes back")
    assert callbacks > LOAD_OPS // 5
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    assert elapsed < 300 and moved > 64 << 20


def _rss_kib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


@pytest.mark.slow
def test_memory_and_descriptors_stay_flat_over_open_close_cycles(tmp_path):
    def cycle():
        with Offloader(tmp_path) as off:
            t = torch.randn(10_000)
            off.sync_write(t)
            off.sync_read(t)

    for _ in range(100):
        cycle()
    fds, rss = len(os.listdir("/proc/self/fd")), _rss_kib()
    for _ in range(OPEN_CLOSE_CYCLES):
        cycle()
    print(f"\n{OPEN_CLOSE_CYCLES} open/close cycles: fds {fds} -> {len(os.listdir('/proc/self/fd'))}, "
          f"RSS {rss} -> {_rss_kib()} KiB")
    assert len(os.listdir("/proc/self/fd")) == fds
    assert _rss_kib() - rss < 16 * 1024, (rss, _rss_kib())


# ------------------------------------------------------------------ bad input
def test_freed_and_resized_tensors_are_refused(tmp_path):
    with Offloader(tmp_path) as off:
        freed = torch.randn(100)
        freed.untyped_storage().resize_(0)
        with pytest.raises(ValueError, match="no data"):
            off.sync_write(freed)
        grown = torch.randn(100)
        grown.untyped_storage().resize_(800)
        with pytest.raises(ValueError, match="view"):
            off.sync_write(grown)


@pytest.mark.parametrize("mib", [4, 160])  # one chunk; more than the 128 MiB the engine has in flight
def test_a_write_is_a_snapshot_taken_at_the_call(tmp_path, backend, mib):
    import numpy as np
    array = np.arange(mib << 18, dtype=np.float32)
    t = torch.from_numpy(array)          # memory the caller can still change behind our back
    expected = t.clone()
    with Offloader(tmp_path, backend=backend) as off:
        off.inject_faults(delay_rate=1.0, delay_ms=100)
        handle = off.async_write(t)
        array[:] = -1                    # mutate while the write is in flight
        handle.wait()
        off.inject_faults()
        off.sync_read(t)
    assert torch.equal(t, expected)      # the bytes of the moment of the call, not half-new


def test_file_system_without_o_direct_falls_back_with_a_warning(ramfs, backend):
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        off = Offloader(ramfs, backend=backend)
    with off:
        assert off.direct is False
        t = torch.randn(1000)
        expected = t.clone()
        off.sync_write(t)
        off.sync_read(t)
        assert torch.equal(t, expected)
    with pytest.raises(OSError) as info:
        Offloader(ramfs, backend=backend, direct=True)
    assert info.value.errno == errno.EINVAL
    assert os.listdir(ramfs) == []  # no file left by the refused O_DIRECT opens either


# ------------------------------------------------------------------ security
def test_named_backing_file_is_private_and_never_follows_symlinks(tmp_path, monkeypatch):
    monkeypatch.setattr(backing_file, "try_tmpfile", False)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / ".offload-1-deadbeef.swap").symlink_to(victim)   # a planted link
    with Offloader(tmp_path) as off:
        assert os.path.dirname(off.path) == str(tmp_path)
        assert os.stat(off.path).st_mode & 0o777 == 0o600
        assert os.path.basename(off.path).startswith(".offload-")
    assert victim.read_bytes() == b"keep me"
    assert os.path.islink(tmp_path / ".offload-1-deadbeef.swap")
