"""Transfers keep moving while the caller is away (offload/_progress_thread.py).

Every test here leaves the Offloader alone after the call (no wait, no poll,
no other call) and watches the handle's own count, which only a reap can
change: before the progress thread, such a transfer stopped at the engine's
in-flight window, or at the device pipeline's staging ring, until the next
call."""
import asyncio
import gc
import sys
import textwrap
import threading
import time

import pytest
import torch

from conftest import ENGINE_CONFIGS, direct_refusal, engine_config_id, random_tensor, run_python, same_bits, uring_refusal
from offload import Offloader
from offload.devices import LateCopyDevice

# Small chunks and a short queue: 48 chunks of 64 KiB per MiB of tensors, at
# most 2 in flight, so nearly all of every call waits behind the window.
SMALL_WINDOW = {"n_entries": 2, "chunk_bytes": 64 << 10}


def finished_while_away(handle, timeout=20.0) -> bool:
    """Whether ``handle`` finishes with nobody calling into the Offloader
    (reads its count only: that reaps nothing)."""
    deadline = time.monotonic() + timeout
    while handle._remaining and time.monotonic() < deadline:
        time.sleep(0.005)
    return handle._remaining == 0


def progress_threads():
    return [t for t in threading.enumerate() if t.name.startswith("offload-progress")]


# O_DIRECT files: on a page-cache file these calls leave nothing queued behind
# the window (the engine has handed every chunk over when the call returns).
@pytest.mark.parametrize("config", [c for c in ENGINE_CONFIGS if c[1]], ids=engine_config_id)
def test_a_call_beyond_the_in_flight_window_finishes_while_the_caller_is_away(config, tmp_path):
    backend, direct, stripes = config
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    if direct_refusal(str(tmp_path)):
        pytest.skip(direct_refusal(str(tmp_path)))
    directories = [tmp_path / f"stripe{i}" for i in range(stripes)]
    for d in directories:
        d.mkdir()
    off = Offloader(directories if stripes > 1 else tmp_path, backend=backend, direct=direct, **SMALL_WINDOW)
    with off:
        tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(12)]
        expected = [t.clone() for t in tensors]
        ran = []
        handle = off.async_writev(tensors, callback=lambda: ran.append(threading.get_ident()))
        assert off._engine.backlog > 0  # the premise: most of the call waits behind the window
        assert finished_while_away(handle)
        assert ran == []  # callbacks wait for the caller's thread
        off.synchronize()
        assert ran == [threading.get_ident()]
        handle = off.async_readv(tensors, callback=lambda: ran.append(threading.get_ident()))
        assert finished_while_away(handle)
        assert len(ran) == 1
        handle.wait()
        assert ran == [threading.get_ident()] * 2
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))


def test_a_device_transfer_larger_than_the_staging_ring_finishes_while_the_caller_is_away(tmp_path):
    # 8 MiB tensors through 2 slots of 256 KiB: each slot is refilled 16 times
    # per tensor, and only a reap can refill it.
    with Offloader(tmp_path, device=LateCopyDevice(max_delay=0.001), staging_buffers=2,
                   staging_buffer_bytes=256 << 10) as off:
        tensors = [random_tensor((2 << 20,), torch.float32) for _ in range(3)]
        expected = [t.clone() for t in tensors]
        handle = off.async_writev(tensors)
        assert finished_while_away(handle)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        handle = off.async_readv(tensors)
        assert finished_while_away(handle)
        off.synchronize()
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))


def test_the_progress_thread_sleeps_once_nothing_would_stall(tmp_path):
    with Offloader(tmp_path, **SMALL_WINDOW) as off:
        tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(4)]
        assert finished_while_away(off.async_writev(tensors))
        off.synchronize()
        rounds = off._progress.rounds
        assert rounds > 0
        time.sleep(0.3)
        assert off._progress.rounds == rounds  # parked: no reaps of nothing
        # A small call within the window never needs it.
        t = random_tensor((4096,), torch.uint8)
        off.sync_write(t)
        off.sync_read(t)
        assert off._progress.rounds == rounds


def test_waits_and_the_progress_thread_take_turns_without_losing_a_byte(tmp_path):
    # Waits that start at random points of a transfer the thread is moving:
    # every completion is taken exactly once, by one of them.
    generator = torch.Generator().manual_seed(3)
    with Offloader(tmp_path, **SMALL_WINDOW) as off:
        tensors = [random_tensor((256 << 10,), torch.uint8, generator) for _ in range(8)]
        expected = [t.clone() for t in tensors]
        for i in range(20):
            handle = off.async_writev(tensors)
            time.sleep(0.001 * (i % 5))
            handle.wait()
            handle = off.async_readv(tensors)
            time.sleep(0.001 * (i % 3))
            off.synchronize()
            assert handle.done()
            assert all(same_bits(t, e) for t, e in zip(tensors, expected))


def test_the_progress_thread_ends_with_close_and_with_a_dropped_offloader(tmp_path):
    before = set(progress_threads())
    (tmp_path / "a").mkdir()
    off = Offloader(tmp_path / "a", **SMALL_WINDOW)
    tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(4)]
    assert finished_while_away(off.async_writev(tensors))
    assert len(set(progress_threads()) - before) == 1
    off.close()
    assert set(progress_threads()) - before == set()

    (tmp_path / "b").mkdir()
    off = Offloader(tmp_path / "b", **SMALL_WINDOW)
    tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(4)]
    assert finished_while_away(off.async_writev(tensors))
    off.synchronize()
    del off
    gc.collect()
    deadline = time.monotonic() + 5
    while set(progress_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(progress_threads()) - before == set()


FORK_WHILE_MOVING = textwrap.dedent("""
    import os, sys, threading, time, torch
    from offload import Offloader, OffloaderForkedError, buffer_pool
    tensors = [torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(64)]
    with Offloader(sys.argv[1], n_entries=2, chunk_bytes=64 << 10) as off:
        writing = True
        handle = off.async_writev(tensors)     # the progress thread reaps it, lock taken and given
        forks = 0                              # those made while I/O was in flight
        for _ in range(100):
            if forks == 10:
                break
            if not handle._remaining:          # done (a fast disk): the next round, read or write
                writing = not writing
                handle = (off.async_writev if writing else off.async_readv)(tensors)
            if forks % 2 == 0:                 # another thread holds the lock as fork() starts,
                taken = threading.Event()      # as the progress thread does while it reaps
                def hold():
                    with off._lock:
                        taken.set()
                        time.sleep(0.02)
                threading.Thread(target=hold).start()
                taken.wait()
            in_flight = bool(handle._remaining)
            pid = os.fork()
            if pid == 0:                       # refused at once, and the pool works: no lock left taken
                for call in (off.synchronize, lambda: off.async_write(torch.ones(8))):
                    try:
                        call()
                        os._exit(3)
                    except OffloaderForkedError:
                        pass
                off.close()                    # abandoned: returns, touching nothing
                buffer_pool().warm([1 << 20]); buffer_pool().trim()
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert status == 0, status
            forks += in_flight
        off.synchronize()
        if writing:
            off.sync_readv(tensors)
        print(forks, all(bool((t == i).all()) for i, t in enumerate(tensors)))
""")


def test_a_fork_while_the_progress_thread_reaps_leaves_the_child_no_lock_taken(tmp_path):
    result = run_python([sys.executable, "-c", FORK_WHILE_MOVING, str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    forks, intact = result.stdout.split()
    assert int(forks) == 10 and intact == "True", result.stdout


def test_a_call_made_by_a_callback_inside_a_wait_still_moves_after_the_wait(tmp_path):
    # The callback runs inside wait(), while the thread is parked for the
    # waiter; what it issues must still move once the wait has returned.
    with Offloader(tmp_path, **SMALL_WINDOW) as off:
        first = random_tensor((4096,), torch.uint8)
        tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(6)]
        expected = [t.clone() for t in tensors]
        issued = []
        off.async_write(first, callback=lambda: issued.append(off.async_writev(tensors))).wait()
        assert len(issued) == 1
        assert finished_while_away(issued[0])
        off.sync_readv(tensors)
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))


def fail_once_on_the_progress_thread(off, before):
    """Makes ``off``'s next tend on a progress thread (one not in ``before``)
    raise; returns the list that will hold the error raised."""
    tend, raised = off._tend, []

    def tend_that_fails_once_on_the_thread():
        if threading.current_thread() in set(progress_threads()) - before and not raised:
            raised.append(RuntimeError("a bug in a completion's bookkeeping"))
            raise raised[0]
        tend()

    off._tend = tend_that_fails_once_on_the_thread
    return raised


def test_an_error_on_the_progress_thread_is_raised_by_the_callers_next_call_and_loses_nothing(tmp_path):
    before = set(progress_threads())
    with Offloader(tmp_path, **SMALL_WINDOW) as off:
        tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(12)]
        expected = [t.clone() for t in tensors]
        raised = fail_once_on_the_progress_thread(off, before)
        handle = off.async_writev(tensors)
        deadline = time.monotonic() + 20
        while set(progress_threads()) - before and time.monotonic() < deadline:
            time.sleep(0.005)
        assert raised and set(progress_threads()) - before == set()  # it met the error and ended
        with pytest.raises(RuntimeError, match="bookkeeping") as caught:
            off.synchronize()
        assert caught.value is raised[0]
        assert any("progress thread" in note for note in getattr(caught.value, "__notes__", []))
        handle.wait()  # the caller moves the rest itself
        off.synchronize()
        off.sync_readv(tensors)
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))


@pytest.mark.asyncio
async def test_an_error_on_the_progress_thread_is_raised_by_the_await_waiting_meanwhile(tmp_path):
    """The event loop reaps for the await; the thread's error is raised by
    the await as it returns, not handed to asyncio's exception handler."""
    loop_errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
    before = set(progress_threads())
    with Offloader(tmp_path, **SMALL_WINDOW) as off:
        tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(12)]
        expected = [t.clone() for t in tensors]
        raised = fail_once_on_the_progress_thread(off, before)
        off.inject_faults(delay_rate=1.0, delay_ms=2)  # ~0.2 s of chunks: the thread gets its rounds
        handle = off.async_writev(tensors)
        with pytest.raises(RuntimeError, match="bookkeeping") as caught:
            await handle
        assert caught.value is raised[0] and loop_errors == []
        assert handle.done() and handle.exception() is None  # the write itself went on to its end
        off.inject_faults()
        await off.read(tensors)
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))


def test_a_completion_handler_that_raises_costs_no_other_completion_of_its_reap(tmp_path):
    with Offloader(tmp_path) as off:
        loop = off._completions
        for _ in range(20):
            tensors = [random_tensor((1 << 20,), torch.uint8) for _ in range(2)]
            expected = [t.clone() for t in tensors]
            handles = [off.async_write(t) for t in tensors]
            time.sleep(0.5)  # nobody reaps meanwhile (within the window: no progress thread)
            if len(loop.pending) == 2:  # both completions will come in one reap
                break
            # The first write ended before the second call began, which reaped it
            # (seen with both cores busy): again, with new tensors.
            off.synchronize()
        else:
            pytest.fail("in 20 tries, the first write always ended before the second was issued")
        tag = min(loop.pending)
        handler, entry = loop.pending[tag]

        def handler_that_raises(entry, result):
            handler(entry, result)
            raise RuntimeError("a handler failed")

        loop.pending[tag] = (handler_that_raises, entry)
        try:
            with pytest.raises(RuntimeError, match="a handler failed"):
                loop.poll()
            assert not loop.pending, "a completion taken from the engine was dropped"
        finally:
            loop.pending.clear()  # (empty when it passes) a dropped one would hang close()
        for h in handles:
            h.wait(timeout=5)
        off.sync_readv(tensors)
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))
