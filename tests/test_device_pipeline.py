"""The GPU pipeline, proven on the CPU: LateCopyDevice runs every device copy
late, on another thread, after a random delay. Chunks, staging-buffer reuse,
ordering and error paths are exercised under stress; three ordering bugs,
planted one at a time, must each corrupt data (or crash) and so be caught."""
import errno
import sys
import textwrap
import time

import pytest
import torch

from offload import Offloader
from offload.device_pipeline import StagingRing
from offload.devices import LateCopyDevice
from conftest import run_python
from conftest import (AUTOGRAD_ROUND_TRIPS, assert_no_change_to_autograd,
                      assert_the_base_goes_and_returns_with_its_view, random_tensor, same_bits)

TINY = dict(staging_buffers=2, staging_buffer_bytes=16 << 10)  # 16 KiB slots: many chunks


def test_round_trip_through_the_pipeline(tmp_path):
    device = LateCopyDevice(seed=1)
    t = torch.randn(1 << 20)
    expected = t.clone()
    with Offloader(tmp_path, device=device, **TINY) as off:
        off.sync_write(t)
        assert t.untyped_storage().nbytes() == 0        # device memory released when done
        off.sync_read(t)
        assert torch.equal(t, expected)
    assert device.copies >= 2 * (4 << 20) // (16 << 10)  # it really went chunk by chunk


@pytest.mark.parametrize("round_trip", AUTOGRAD_ROUND_TRIPS, ids=str)
def test_a_round_trip_through_the_pipeline_is_no_change_to_autograd(tmp_path, round_trip):
    """As on the CPU path (test_conformance): device tensors saved for
    backward and read back before it keep their version counters and their
    gradient accumulator."""
    with Offloader(tmp_path, device=LateCopyDevice(seed=7), **TINY) as off:
        assert_no_change_to_autograd(off, round_trip, 1 << 16)


@pytest.mark.parametrize("round_trip", AUTOGRAD_ROUND_TRIPS, ids=str)
def test_a_view_through_the_pipeline_takes_its_base_along(tmp_path, round_trip):
    """As on the CPU path (test_conformance): the device memory a view
    releases and gets back is its base's too."""
    with Offloader(tmp_path, device=LateCopyDevice(seed=9), **TINY) as off:
        assert_the_base_goes_and_returns_with_its_view(off, round_trip, 1 << 16)


def test_stress_thousands_of_chunks_tiny_pool_random_delays(tmp_path):
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.complex64, torch.bool, torch.float8_e4m3fn]
    tensors = [random_tensor((int(torch.randint(1, 150_000, (1,), generator=gen)),), dtypes[i % 6], gen)
               for i in range(60)]
    expected = [t.clone() for t in tensors]
    device = LateCopyDevice(seed=2, max_delay=0.0005)
    with Offloader(tmp_path, device=device, **TINY) as off:
        for round_ in range(3):
            done = []
            for i, t in enumerate(tensors):
                off.async_write(t, callback=lambda i=i: done.append(i))
            off.synchronize()
            assert sorted(done) == list(range(60))
            off.async_readv(tensors)
            off.synchronize()
            for t, e in zip(tensors, expected):
                assert same_bits(t, e)                    # usable right away: ordered before us
            for t, e in zip(tensors, expected):
                if t.dtype == torch.float32:
                    t.add_(1)
                    e.add_(1)
    assert device.copies > 2000  # thousands of chunks went through two slots


def test_ordering_on_one_tensor_and_mixed_with_asyncio(tmp_path):
    import asyncio
    device = LateCopyDevice(seed=3)
    t = torch.randn(200_000)
    expected = t.clone()
    with Offloader(tmp_path, device=device, **TINY) as off:
        for _ in range(3):
            off.async_write(t)
            off.async_read(t)       # queued behind the write: must see its data
        off.synchronize()
        assert torch.equal(t, expected)

        async def step():
            await off.write(t)
            await off.read(t)
            t.mul_(2)
            await off.write(t)
            await off.read(t)

        asyncio.run(step())
    assert torch.equal(t, expected * 2)


def test_disk_errors_mid_transfer(tmp_path):
    device = LateCopyDevice(seed=4)
    t = torch.randn(100_000)
    expected = t.clone()
    with Offloader(tmp_path, device=device, **TINY) as off:
        off.inject_faults(error_rate=0.3, errnos=[errno.EIO], seed=9)
        with pytest.raises(OSError) as info:
            off.sync_write(t)
        assert info.value.errno == errno.EIO
        assert torch.equal(t, expected)                  # a failed write keeps the data
        off.inject_faults()
        off.sync_write(t)
        off.inject_faults(error_rate=0.3, errnos=[errno.EIO], seed=9)
        with pytest.raises(OSError):
            off.sync_read(t)
        assert t.untyped_storage().nbytes() == 0         # still offloaded, still on disk
        off.inject_faults()
        off.sync_read(t)
        assert torch.equal(t, expected)


@pytest.mark.parametrize("woken", [True, False], ids=["woken", "control-not-woken"])
def test_a_copy_that_lands_while_the_disk_is_busy_goes_to_the_disk_at_once(tmp_path, woken):
    """Under asyncio nothing polls: the landed copy itself must wake the
    Offloader, or its chunk waits for the disk's next completion. The control
    turns the wake-up off, to show that the timing tells the two apart. Both
    run without the progress thread, whose 50 ms slices would find the copy
    anyway (that thread waits on the same wake-up)."""
    import asyncio
    device = LateCopyDevice(delay=0.15)  # each copy lands 150 ms after the one before
    if not woken:
        device.notify_when_done = lambda event, wake: None
    t = torch.randn(2 * (256 << 10) // 4)  # two chunks of 256 KiB
    expected = t.clone()

    async def write():
        started = time.monotonic()
        await off.write(t)
        return time.monotonic() - started

    with Offloader(tmp_path, device=device, staging_buffers=2, staging_buffer_bytes=256 << 10) as off:
        with off._lock:
            off._progress.stop()
        off.inject_faults(delay_rate=1.0, delay_ms=800)  # every disk I/O completes 800 ms late
        elapsed = asyncio.run(write())
        off.inject_faults()
        off.sync_read(t)
    assert torch.equal(t, expected)
    # Chunk 0 is on the disk from 0.15 s to 0.95 s; chunk 1's copy lands at 0.3 s.
    # Woken, chunk 1 is written from 0.3 s: done at 1.1 s. Not woken, from 0.95 s: 1.75 s.
    assert (elapsed < 1.45) if woken else (elapsed > 1.45), elapsed


def test_staging_pool_is_bounded(tmp_path):
    """The staging memory the device page-locks is the ring's, pinned once:
    20 writes and reads through 2 slots pin nothing more, and close() unpins it."""
    class CountingDevice(LateCopyDevice):
        def __init__(self):
            super().__init__(seed=6)
            self.pinned = {}

        def pin(self, address, nbytes):
            self.pinned[address] = nbytes

        def unpin(self, address):
            del self.pinned[address]

    device = CountingDevice()
    with Offloader(tmp_path, device=device, **TINY) as off:
        tensors = [torch.randn(50_000) for _ in range(20)]
        expected = [t.clone() for t in tensors]
        off.async_writev(tensors)
        assert len(device.pinned) == TINY["staging_buffers"]
        assert set(device.pinned.values()) == {TINY["staging_buffer_bytes"]}
        off.synchronize()
        off.sync_readv(tensors)
        assert len(device.pinned) == TINY["staging_buffers"]
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    assert device.pinned == {}


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "resizable"),
                    reason="torch without UntypedStorage.resizable(): the test device's storages are probed "
                           "by a same-size resize, which moves them (_tensors.must_be_resizable)")
def test_device_memory_is_recycled_like_a_caching_allocator(tmp_path):
    # A GPU's caching allocator hands freed memory out again, so a late copy
    # into memory released too early would land in another tensor; the test
    # device must recycle the same way, or such bugs would go unseen.
    device = LateCopyDevice(seed=7)
    with Offloader(tmp_path, device=device, **TINY) as off:
        a, b = torch.randn(100_000), torch.randn(100_000)
        expected_a, b_address = a.clone(), b.data_ptr()
        off.sync_write(a)
        off.sync_write(b)
        off.sync_read(a)                               # gets the memory b just gave back
        assert a.data_ptr() == b_address
        assert torch.equal(a, expected_a)
    x = torch.randn(1000)
    alias = torch.empty(0).set_(x.untyped_storage())  # memory someone still uses: never recycled
    device.release(x)
    y = torch.empty(1000)
    device.release(y)
    device.allocate(y, 4000)
    device.allocate(x, 4000)
    assert alias.data_ptr() not in (x.data_ptr(), y.data_ptr())


PLANTED = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    from offload.devices import LateCopyDevice
    bug = sys.argv[2]
    device = LateCopyDevice(seed=11, max_delay=0.001, skip=bug, lazy=True)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(40_000, generator=gen) for _ in range(12)]
    expected = [t.clone() for t in tensors]
    ok = True
    with Offloader(sys.argv[1], device=device, staging_buffers=2, staging_buffer_bytes=16 << 10) as off:
        for _ in range(2):
            off.sync_writev(tensors)
            off.sync_readv(tensors)
            ok = ok and all(torch.equal(a, b) for a, b in zip(tensors, expected))
            off.synchronize()
            if not ok:
                break
    print("intact" if ok else "corrupted", flush=True)
""")


@pytest.mark.parametrize("bug", ["", "wait_before_reuse", "wait_before_write", "order_before_caller"])
def test_each_planted_ordering_bug_is_caught(tmp_path, bug):
    result = run_python([sys.executable, "-c", PLANTED, str(tmp_path), bug],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # A lazy device runs a copy only once something waits for it, so each bug
    # corrupts deterministically; without a bug the data is intact.
    assert result.stdout.strip() == ("intact" if bug == "" else "corrupted")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_and_stream_ordering(tmp_path):
    w = torch.randn(4096, 4096, device="cuda")
    expected = w.clone()
    with Offloader(tmp_path) as off:
        h = off.async_write(w)
        x = torch.randn(4096, 4096, device="cuda")
        y = x @ x                                     # compute keeps running meanwhile
        h.wait()
        assert w.untyped_storage().nbytes() == 0
        off.sync_read(w)
        assert torch.equal(w, expected)
        assert torch.isfinite(y).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_and_cpu_tensors_in_one_offloader(tmp_path):
    g, c = torch.randn(1 << 22, device="cuda"), torch.randn(1 << 22)
    eg, ec = g.clone(), c.clone()
    with Offloader(tmp_path) as off:
        off.sync_writev([g, c])
        off.sync_readv([g, c])
    assert torch.equal(g, eg) and torch.equal(c, ec)


def test_cuda_copy_watcher_wakes_after_each_event_in_order_and_stops_on_close():
    """The watcher loop of CudaDevice, driven with stand-in events on the CPU:
    each wake-up comes after its event's synchronize(), a failing event still
    wakes (the pipeline's own synchronize reports the error), None stops it."""
    import queue
    import threading
    from offload.devices import CudaDevice

    calls = []

    class Event:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def synchronize(self):
            calls.append(("sync", self.name))
            if self.error:
                raise self.error

    watched = queue.SimpleQueue()
    for event in (Event("a"), Event("b", RuntimeError("CUDA error: an illegal memory access")), Event("c")):
        watched.put((event, lambda name=event.name: calls.append(("wake", name))))
    watched.put(None)
    watcher = threading.Thread(target=CudaDevice._watch, args=(watched,))
    watcher.start()
    watcher.join(10)
    assert not watcher.is_alive()
    assert calls == [("sync", "a"), ("wake", "a"), ("sync", "b"), ("wake", "b"), ("sync", "c"), ("wake", "c")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_watcher_wakes_once_the_copy_has_landed():
    import threading
    from offload.devices import CudaDevice
    device = CudaDevice(torch.cuda.current_device())
    src = torch.randn(1 << 24, device="cuda")
    dst = torch.empty(1 << 24).pin_memory()
    event = device.copy(dst, src, device.caller_event())
    woke = threading.Event()
    device.notify_when_done(event, woke.set)
    assert woke.wait(10) and event.query()
    assert torch.equal(dst, src.cpu())
    device.close()


def test_unsupported_devices_get_a_clear_error(tmp_path):
    with Offloader(tmp_path) as off:
        with pytest.raises(ValueError, match="meta"):
            off.async_write(torch.empty(4, device="meta"))


def test_a_staging_ring_hands_out_slots_given_back_before_unused_ones():
    """A slot never used may still need its pages faulted in: it goes out
    only when no slot given back is free, and those go oldest first."""
    ring = StagingRing(None, 4, 1 << 20)
    try:
        assert [ring.take(), ring.take()] == [0, 1]
        ring.give(1)
        ring.give(0)
        assert [ring.take(), ring.take(), ring.take(), ring.take()] == [1, 0, 2, 3]
        assert not ring.has_free()
        ring.give(3)
        assert ring.has_free() and ring.take() == 3
    finally:
        ring.close()
