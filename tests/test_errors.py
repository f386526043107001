"""Clear errors, and nothing lost, when the machine or the caller says no."""
import asyncio
import errno
import os
import subprocess
import time
import warnings

import pytest
import torch

from offload import Offloader, OffloaderClosedError
from offload._completion_loop import CompletionLoop
from conftest import backing_fds


@pytest.fixture(params=["uring", "threads"])
def off(request, tmp_path):
    from conftest import uring_refusal
    if request.param == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    o = Offloader(tmp_path, backend=request.param)
    yield o
    o.inject_faults()
    o.close()


def test_reading_a_tensor_never_written(off):
    with pytest.raises(RuntimeError, match="never written"):
        off.sync_read(torch.zeros(3))


def test_writing_twice_without_reading(off):
    t = torch.randn(10)
    off.async_write(t)
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.async_write(t)
    off.synchronize()


def test_a_tensor_changed_since_it_was_written(off):
    t = torch.randn(4, 4)
    off.sync_write(t)
    t.data = torch.empty(0, dtype=torch.int32)  # the caller swapped its storage and dtype
    with pytest.raises(ValueError, match="changed since it was written"):
        off.sync_read(t)


def test_discarding_a_tensor_changed_since_it_was_read(off):
    t = torch.randn(4, 4)
    off.sync_write(t)
    off.sync_read(t)
    t.data = torch.zeros(8, dtype=torch.int32)  # the caller swapped its storage, shape and dtype
    with pytest.raises(ValueError, match="changed since it was written"):
        off.discard(t)
    assert torch.equal(t, torch.zeros(8, dtype=torch.int32))  # left as it is


def test_wrong_types_and_devices(off):
    with pytest.raises(TypeError, match="torch.Tensor"):
        off.async_write([1, 2, 3])
    with pytest.raises(ValueError, match="meta"):
        off.async_write(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="dense"):
        off.async_write(torch.eye(3).to_sparse())
    with warnings.catch_warnings():  # torch deprecates quantized dtypes
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8)
    with pytest.raises(ValueError, match=r"quantized tensors \(torch.qint8\)"):
        off.async_write(quantized)
    with pytest.raises(TypeError, match="callable"):
        off.async_write(torch.randn(3), callback=42)


class _WrapperTensor(torch.Tensor):
    """A wrapper subclass (as FakeTensor, DTensor): its storage is not memory."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.elem if isinstance(x, _WrapperTensor) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _PlainSubclass(torch.Tensor):
    """A subclass that only adds Python methods: plain memory underneath."""


def test_tensors_with_no_memory_of_their_own_are_refused_and_subclasses_of_plain_memory_are_not(off):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(100)
    refused = [(_WrapperTensor(torch.randn(100)), "_WrapperTensor"), (fake, "FakeTensor")]
    if hasattr(torch, "jagged"):  # torch 2.2 and later
        refused.append((torch.nested.nested_tensor([torch.randn(3), torch.randn(5)], layout=torch.jagged), "dense"))
    for t, what in refused:
        with pytest.raises(ValueError, match=what):
            off.async_write(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the PyTorch API of nested tensors is in prototype stage"
        strided_nested = torch.nested.as_nested_tensor([torch.randn(3), torch.randn(5)])
    with pytest.raises(ValueError, match="nested tensors cannot be offloaded"):
        off.async_write(strided_nested)
    plain = torch.randn(100).as_subclass(_PlainSubclass)
    expected = plain.clone()
    off.sync_write(plain)
    off.sync_read(plain)
    assert type(plain) is _PlainSubclass and torch.equal(plain, expected)


def test_closed_offloader(tmp_path):
    o = Offloader(tmp_path)
    o.close()
    o.close()  # idempotent
    with pytest.raises(OffloaderClosedError, match="closed"):
        o.async_write(torch.randn(3))


def test_directory_errors_are_the_right_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        Offloader(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        Offloader(tmp_path / "file")
    with pytest.raises(ValueError, match="backend"):
        Offloader(tmp_path, backend="gpu")


def test_failed_write_keeps_the_data_and_reports_the_errno(off):
    t = torch.randn(3 << 20)
    expected = t.clone()
    off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    handle = off.async_write(t)
    with pytest.raises(OSError) as info:
        handle.wait()
    assert info.value.errno == errno.EIO and info.value.filename == off.path
    assert torch.equal(t, expected)           # nothing lost
    off.inject_faults()
    off.sync_write(t)                          # and the tensor can be written again
    off.sync_read(t)
    assert torch.equal(t, expected)


def test_failed_read_keeps_the_data_on_disk(off):
    t = torch.randn(1 << 20)
    expected = t.clone()
    off.sync_write(t)
    off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError) as info:
        off.sync_read(t)
    assert info.value.errno == errno.EIO
    assert t.untyped_storage().nbytes() == 0
    off.inject_faults()
    off.sync_read(t)                           # retry succeeds
    assert torch.equal(t, expected)


def test_unreported_errors_surface_from_synchronize(off):
    tensors = [torch.randn(1000) for _ in range(4)]
    off.inject_faults(error_rate=1.0, errnos=[errno.ENOSPC])
    called = []
    for t in tensors:
        off.async_write(t, callback=lambda: called.append(1))
    with pytest.raises(OSError) as info:
        off.synchronize()
    assert info.value.errno == errno.ENOSPC
    assert called == []                        # callbacks run only on success
    off.synchronize()                          # reported once, not again


def test_callback_exceptions_surface_from_the_call_that_ran_them(off):
    t = torch.randn(100)

    def boom():
        raise KeyError("from the callback")

    off.async_write(t, callback=boom)
    with pytest.raises(KeyError, match="from the callback"):
        off.synchronize()
    off.sync_read(t)  # the Offloader still works


def three_writes_finishing_together(off, error):
    """Three writes whose callbacks become due at once, before any runs;
    whichever runs first raises ``error``. Returns what ran, in order."""
    ran = []

    def callback(i):
        ran.append(i)
        if len(ran) == 1:
            raise error

    off.inject_faults(delay_rate=1.0, delay_ms=200)  # none finishes while the others are issued
    for i in range(3):
        off.async_write(torch.randn(1 << 12), callback=lambda i=i: callback(i))
    off.inject_faults()
    time.sleep(0.5)  # all three finish before anyone reaps or runs a callback
    return ran


def test_a_callback_that_raises_leaves_the_others_to_run_once(off):
    """The wait raises the first callback's error after running the other
    two, and no callback runs again."""
    ran = three_writes_finishing_together(off, KeyError("from a callback"))
    with pytest.raises(KeyError, match="from a callback"):
        off.synchronize()
    off.synchronize()
    assert sorted(ran) == [0, 1, 2]


def test_an_interrupt_in_a_callback_leaves_the_others_due(off):
    """A KeyboardInterrupt from a callback stops the wait at once, and the
    callbacks after it stay due: the next call runs each of them once."""
    ran = three_writes_finishing_together(off, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        off.synchronize()
    assert len(ran) == 1                       # stopped at the interrupt
    off.synchronize()
    assert sorted(ran) == [0, 1, 2]            # the other two ran, once each


def test_a_completion_handler_that_raises_lets_the_rest_of_its_reap_finish():
    """The engine hands a reap's completions over once: when one handler
    raises, the others of that reap still run, then the error is raised."""
    class Engine:
        completions = []

        def reap(self):
            done, self.completions = self.completions, []
            return done

    engine = Engine()
    loop = CompletionLoop(engine, lambda: RuntimeError("closed"))
    handled = []

    def handler(entry, result):
        handled.append((entry, result))
        if entry == "a":
            raise KeyError("from a handler")

    tags = [loop.new_tag(handler, entry) for entry in "abc"]
    engine.completions = [tags[0], 1, tags[1], 2, tags[2], 3]
    with pytest.raises(KeyError, match="from a handler"):
        with loop.lock:
            loop.reap()
    assert handled == [("a", 1), ("b", 2), ("c", 3)] and not loop.pending


def test_close_runs_every_callback_when_one_raises(tmp_path):
    """close() waits for all it admitted and runs every callback, then
    raises the first error one of them raised: here the first write's
    callback raises while the second write is still held back."""
    off = Offloader(tmp_path)
    ran = []

    def held_back(handle, count):  # until the engine has handed its completion over, and it is held
        deadline = time.monotonic() + 10
        while off.faults_injected < count:
            assert not handle.done() and time.monotonic() < deadline
            time.sleep(0.001)

    def boom():
        ran.append("first")
        raise KeyError("from the first callback")
    off.inject_faults(delay_rate=1.0, delay_ms=500)
    first = off.async_write(torch.randn(1 << 12), callback=boom)
    held_back(first, 1)
    off.inject_faults(delay_rate=1.0, delay_ms=1500)
    second = off.async_write(torch.randn(1 << 12), callback=lambda: ran.append("second"))
    held_back(second, 2)
    with pytest.raises(KeyError, match="from the first callback"):
        off.close()
    assert ran == ["first", "second"] and off.closed


@pytest.mark.asyncio
async def test_a_callback_exception_met_by_the_event_loop_surfaces_from_the_await(off):
    """A callback that raises while the event loop reaps for an await (no
    call of the caller's running) is not handed to asyncio's exception
    handler: the await raises it as it returns, as a wait would."""
    loop_errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
    t = torch.randn(1 << 18)
    expected = t.clone()

    def boom():
        raise KeyError("from the callback")

    off.inject_faults(delay_rate=1.0, delay_ms=100)  # it completes while the await waits
    handle = off.async_write(t, callback=boom)
    with pytest.raises(KeyError, match="from the callback"):
        await handle
    assert loop_errors == []
    assert handle.done() and handle.exception() is None  # the write itself succeeded
    off.inject_faults()
    await off.read(t)  # raised once, not again; nothing lost
    assert torch.equal(t, expected)


@pytest.mark.asyncio
async def test_await_raises_the_oserror(off):
    t = torch.randn(1000)
    off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError) as info:
        await off.write(t)
    assert info.value.errno == errno.EIO
    assert t.untyped_storage().nbytes() == 4000


def test_wait_timeout(off):
    t = torch.randn(1000)
    expected = t.clone()
    off.inject_faults(delay_rate=1.0, delay_ms=500)   # (decided as the completion is reaped)
    h = off.async_write(t)
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.05)
    assert not h.done()                                # the write goes on
    off.inject_faults()
    h.wait(timeout=30)
    assert h.done()
    off.sync_read(t)
    assert torch.equal(t, expected)


def test_failures_no_handle_reported_are_raised_once_with_a_count_of_the_others(off):
    off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    for _ in range(3):
        off.async_write(torch.randn(1000))             # nobody asks these handles
    with pytest.raises(OSError) as raised:
        off.synchronize()
    off.inject_faults()
    assert raised.value.errno == errno.EIO
    assert "2 more operation(s) failed too" in getattr(raised.value, "__notes__", [])
    off.synchronize()                                  # reported once


# ---------------------------------------------------------------- real file systems
@pytest.mark.parametrize("backend", ["uring", "threads"])
@pytest.mark.parametrize("elements, direct", [(1 << 20, None), (4096, False)], ids=["4MiB-direct", "16KiB-inline"])
def test_real_enospc_loses_nothing(tiny_fs, backend, elements, direct):
    """The 16 MiB disk fills up. 16 KiB tensors on the page cache meet it in
    the calling thread (small buffered writes run inline): the error and the
    data must be the same as through the backend."""
    from conftest import uring_refusal
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    kept, failed = [], None
    with Offloader(tiny_fs, backend=backend, direct=direct) as o:
        for i in range((64 << 20) // (4 * elements)):  # 64 MiB worth
            t = torch.full((elements,), float(i))
            try:
                o.sync_write(t)
            except OSError as error:
                assert error.errno == errno.ENOSPC
                failed = t
                break
            kept.append(t)
        assert failed is not None, "the small file system never filled up"
        assert torch.equal(failed, torch.full((elements,), float(len(kept))))  # data intact
        o.sync_readv(kept)
        for i, t in enumerate(kept):
            assert torch.equal(t, torch.full((elements,), float(i)))


def test_a_file_that_cannot_grow_a_whole_step_grows_by_what_is_needed(tiny_fs):
    """The backing file grows in generous steps (double its size here); on a
    disk without room for the step it takes just what the write needs."""
    with Offloader(tiny_fs) as o:
        first, second = torch.full((2 << 20,), 1.0), torch.full((1 << 18,), 2.0)   # 8 MiB, then 1 MiB
        o.sync_write(first)
        o.sync_write(second)                       # a 16 MiB step cannot fit in a 16 MiB file system
        o.sync_readv([first, second])
        assert torch.equal(first, torch.full((2 << 20,), 1.0)) and torch.equal(second, torch.full((1 << 18,), 2.0))


def test_read_only_file_system(tiny_fs):
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    with pytest.raises(OSError) as info:
        Offloader(tiny_fs)
    assert info.value.errno == errno.EROFS


def test_backing_file_is_private_and_removed(tmp_path):
    with Offloader(tmp_path) as o:
        o.sync_write(torch.randn(1000))
        assert os.listdir(tmp_path) == []  # O_TMPFILE: no name, nothing for others to open
        (fd,) = backing_fds(tmp_path)
        assert os.stat(fd).st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_close_warns_once_when_no_request_finishes_for_a_while(tmp_path, monkeypatch, backend):
    """A hung device (or a lost completion) would hold close() for ever: once
    no request has finished for QUIET_WAIT_WARNING_S, one warning names the
    Offloader and what is left, and close() waits on until the write is done.
    A drain longer than that whose requests keep finishing, each gap shorter,
    does not warn: the clock is the quiet time, not the drain's."""
    from conftest import uring_refusal
    from offload import _completion_loop
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    monkeypatch.setattr(_completion_loop, "QUIET_WAIT_WARNING_S", 0.5)
    # Every write (one whole 4 MiB chunk: none merged) completes 0.9 s late.
    # One write: 0.9 s of quiet. Five, 0.25 s apart, close() after the last:
    # the drain lasts ~0.9 s, its requests finishing 0.25 s apart.
    for writes, warned in ((1, 1), (5, 0)):
        off = Offloader(tmp_path, backend=backend)
        off.inject_faults(delay_rate=1.0, delay_ms=900)
        handles = []
        for i in range(writes):
            if i:
                time.sleep(0.25)
            handles.append(off.async_write(torch.randn(1 << 20)))
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            off.close()
        assert time.monotonic() - started > 0.6   # waited on, past the threshold either way
        quiet = [w for w in caught if "none finishing" in str(w.message)]
        assert len(quiet) == warned, [str(w.message) for w in caught]
        if warned:
            message = str(quiet[0].message)
            assert quiet[0].category is RuntimeWarning and repr(off.path) in message
            assert "1 request(s) in flight" in message and quiet[0].filename == __file__  # the caller's line
        assert all(h.done() and h.exception() is None for h in handles)


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_synchronize_and_wait_warn_once_when_no_request_finishes_for_a_while(tmp_path, monkeypatch, backend):
    """synchronize() and a handle's wait() would hang as silently as close()
    on a hung device: each warns once, naming the call and the Offloader, at
    the caller's line, and waits on. A chain of callbacks, each issuing the
    next write, keeps one request in flight for longer than the threshold
    but finishes one every 0.25 s: no warning (progress is requests
    finishing, not the count in flight changing)."""
    from conftest import uring_refusal
    from offload import _completion_loop
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    monkeypatch.setattr(_completion_loop, "QUIET_WAIT_WARNING_S", 0.5)
    with Offloader(tmp_path, backend=backend) as off:
        off.inject_faults(delay_rate=1.0, delay_ms=900)
        for call, wait in (("synchronize()", lambda h: off.synchronize()),
                           ("waiting on an operation", lambda h: h.wait()),
                           ("sync_write_events()", lambda h: off.sync_write_events())):
            t = torch.randn(1 << 20)
            h = off.async_write(t)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wait(h)
            quiet = [w for w in caught if "none finishing" in str(w.message)]
            assert len(quiet) == 1, (call, [str(w.message) for w in caught])
            message = str(quiet[0].message)
            assert message.startswith(f"offload: {call}") and repr(off.path) in message, message
            assert "1 request(s) in flight" in message and quiet[0].filename == __file__
            assert h.done() and h.exception() is None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the read is held as long, and warns too
                off.sync_read(t)

        off.inject_faults(delay_rate=1.0, delay_ms=250)
        tensors = [torch.randn(1 << 20) for _ in range(5)]
        written = []

        def write_next():
            written.append(True)
            if len(written) < len(tensors):
                off.async_write(tensors[len(written)], callback=write_next)

        off.async_write(tensors[0], callback=write_next)
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            off.synchronize()
        assert time.monotonic() - started > 0.9  # one in flight throughout, past the threshold
        assert len(written) == len(tensors)
        assert not [w for w in caught if "none finishing" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_an_await_warns_once_when_no_request_finishes_for_a_while(tmp_path, monkeypatch, backend):
    """An asyncio training loop awaiting a hung device would hang silently:
    while awaits wait on an event loop and no request finishes for the
    threshold, one warning names the Offloader (from the loop's callback;
    the await waits on). Five writes issued 0.2 s apart and awaited
    together, each finishing 0.25 s after it started, keep an await
    waiting for ~1.1 s, twice the threshold, but finish steadily: no
    warning."""
    from conftest import uring_refusal
    from offload import _completion_loop
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    monkeypatch.setattr(_completion_loop, "QUIET_WAIT_WARNING_S", 0.5)
    with Offloader(tmp_path, backend=backend) as off:
        off.inject_faults(delay_rate=1.0, delay_ms=900)
        t = torch.randn(1 << 20)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(off.write(t))
        quiet = [w for w in caught if "none finishing" in str(w.message)]
        assert len(quiet) == 1, [str(w.message) for w in caught]
        message = str(quiet[0].message)
        assert message.startswith("offload: awaiting an operation of the Offloader on") and repr(off.path) in message
        assert "1 request(s) in flight" in message
        assert t.untyped_storage().nbytes() == 0   # written, released
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the read is held as long, and warns too
            off.sync_read(t)

        off.inject_faults(delay_rate=1.0, delay_ms=250)
        tensors = [torch.randn(1 << 20) for _ in range(5)]

        async def staggered():
            started, awaited = time.monotonic(), []
            for t in tensors:
                awaited.append(asyncio.ensure_future(_awaited(off.write(t))))
                await asyncio.sleep(0.2)
            await asyncio.gather(*awaited)
            return time.monotonic() - started

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            took = asyncio.run(staggered())
        assert took > 1.0
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert not [w for w in caught if "none finishing" in str(w.message)], [str(w.message) for w in caught]


async def _awaited(handle):
    await handle
