"""Offloader behaviour beyond the conformance suite: threads, the GIL, and
how small tensors of a page-cache file move."""
import collections
import errno
import gc
import os
import sys
import textwrap
import threading
import time

import pytest
import torch

from offload import Offloader, _core, _tensors
from conftest import run_python
from conftest import (AUTOGRAD_ROUND_TRIPS, ENGINES, OtherThreadTicks, assert_no_change_to_autograd, backing_fds,
                      random_tensor, same_bits, uring_refusal)


def test_gil_is_released_during_a_large_sync_write(tmp_path):
    t = torch.randn(128 << 20)  # 512 MiB
    with Offloader(tmp_path) as off:
        with OtherThreadTicks() as other:
            started = time.perf_counter()
            off.sync_write(t)
            elapsed = time.perf_counter() - started
    # The other thread kept running for the whole write, not just between calls.
    assert elapsed > 0.05 and other.during > 1000, (elapsed, other.during)


@pytest.mark.parametrize("backend", ["uring", "threads"])
@pytest.mark.parametrize("direct", [None, False], ids=["default", "page-cache"])
def test_several_python_threads_share_one_offloader(tmp_path, backend, direct):
    """Vector and single calls from four threads; on a page-cache file the
    small tensors among them move in place, within the call."""
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    errors = []

    with Offloader(tmp_path, backend=backend, direct=direct) as off:
        def worker(seed):
            try:
                g = torch.Generator().manual_seed(seed)
                tensors = [torch.randn(int(torch.randint(1, 100_000, (1,), generator=g)), generator=g)
                           for _ in range(10)]
                expected = [t.clone() for t in tensors]
                for round_ in range(20):
                    if round_ % 2:
                        off.sync_writev(tensors)
                        off.sync_readv(tensors)
                    else:
                        for handle in [off.async_write(t) for t in tensors]:
                            handle.wait()
                        for handle in [off.async_read(t) for t in tensors]:
                            handle.wait()
                assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert errors == []


def test_several_offloaders_in_one_process(tmp_path):
    offloaders = [Offloader(tmp_path) for _ in range(4)]
    tensors = [torch.randn(10_000) for _ in offloaders]
    expected = [t.clone() for t in tensors]
    for off, t in zip(offloaders, tensors):
        off.async_write(t)
    for off, t in zip(offloaders, tensors):
        off.sync_read(t)
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


def test_close_with_operations_in_flight_drains(tmp_path):
    off = Offloader(tmp_path)
    tensors = [torch.randn(1 << 20) for _ in range(16)]
    done = []
    for t in tensors:
        off.async_write(t, callback=lambda: done.append(1))
    off.close()
    assert len(done) == 16 and off.closed


def test_vector_calls_leave_the_garbage_collector_as_they_found_it(tmp_path):
    # Vector calls pause the cyclic collector while planning and completing
    # many tensors (a quarter of a 32768 x 64 KiB write went to collections).
    import gc
    tensors = [torch.randn(256) for _ in range(200)]
    expected = [t.clone() for t in tensors]
    with Offloader(tmp_path) as off:
        assert gc.isenabled()
        off.sync_writev(tensors)
        off.sync_readv(tensors)
        assert gc.isenabled() and all(torch.equal(a, b) for a, b in zip(tensors, expected))
        with pytest.raises(ValueError, match="twice"):
            off.async_writev(tensors + tensors[:1])   # raises inside the pause
        assert gc.isenabled()
        gc.disable()
        try:
            off.sync_writev(tensors)
            off.sync_readv(tensors)
            assert not gc.isenabled()                 # the caller's choice stands
        finally:
            gc.enable()


def test_torch_without_its_below_autograd_guard_gets_one_built_by_hand(tmp_path, monkeypatch):
    """torch 2.1 has no _AutoDispatchBelowADInplaceOrView. The guard built in
    its place keeps a round trip no change to autograd (version counters,
    gradient accumulators) and admits tensors made in inference mode; with
    set_ under no_grad alone, both failed there."""
    monkeypatch.delattr(torch._C, "_AutoDispatchBelowADInplaceOrView", raising=False)
    guard = _tensors._below_autograd_guard()
    assert guard is not None
    monkeypatch.setattr(_tensors, "_below_autograd", guard)
    with Offloader(tmp_path) as off:
        for round_trip in AUTOGRAD_ROUND_TRIPS:
            assert_no_change_to_autograd(off, round_trip, 1 << 18)
        with torch.inference_mode():
            t = torch.randn(1 << 18)
        expected = t.clone()
        off.sync_write(t)
        off.sync_read(t)
        assert same_bits(t, expected)


@pytest.mark.parametrize("direct", [False, None], ids=["page-cache", "o-direct"])
def test_a_tensor_seen_keeps_one_object_of_offload_for_the_cyclic_gc(tmp_path, direct):
    """What an Offloader keeps for each tensor it has seen, for the tensor's
    life, is its record (which is also its weak reference); tensors of one
    dtype, shape and strides share a layout. Every object the cyclic GC
    tracks slows every full collection of the program, and first writes
    that leave more set them off more often (BENCHMARKS.md, "The 4 KiB pair
    rate": new tensors and the GC). Small tensors of a page-cache file
    (moved in place) and larger ones (the general path) alike; torch's own
    objects (the storages the tensors already had) are made before
    counting."""
    def offloads(kind):
        module = kind.__module__  # (a descriptor, not a name, for some metaclasses)
        return isinstance(module, str) and module.startswith("offload")

    def tracked():
        return collections.Counter(type(o).__qualname__ for o in gc.get_objects()
                                   if type(o) is torch.Size or offloads(type(o)))

    tensors = [torch.full((1024,), float(i)) for i in range(300)] + [torch.full((1 << 18,), float(i))
                                                                     for i in range(4)]   # 4 KiB, 1 MiB
    expected = [t.clone() for t in tensors]
    for t in tensors:
        t.untyped_storage()
    with Offloader(tmp_path, direct=direct) as off:
        warm_up = [torch.zeros(1024), torch.zeros(1 << 18)]  # the Offloader's own first objects (pool, threads...)
        off.sync_writev(warm_up)
        off.sync_readv(warm_up)
        gc.collect()
        before = tracked()
        for t in tensors:
            off.async_write(t)
            off.async_read(t)
        off.synchronize()
        gc.collect()
        grown = {name: count - before[name] for name, count in tracked().items() if count > before[name]}
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))
    assert grown.pop("Record") == len(tensors), grown
    assert sum(grown.values()) <= 4, grown  # nothing else a tensor (the warm-up made both shapes' layouts)


def test_tensors_of_one_dtype_shape_and_strides_share_a_layout_and_the_table_stays_bounded():
    a = torch.zeros(3, 4)
    layout = _tensors.layout_of(a)
    assert _tensors.layout_of(torch.ones(3, 4)) is layout and layout.matches(a)
    for other in (a.t(), a.t().contiguous(), a.double(), torch.zeros(4, 3)[:3], torch.zeros(12)):
        assert _tensors.layout_of(other) is not layout and not layout.matches(other)
        assert _tensors.layout_of(other).matches(other)
    for n in range(1, _tensors._LAYOUTS_KEPT + 10):
        _tensors.layout_of(torch.empty(n, device="meta"))
    assert len(_tensors._layouts) <= _tensors._LAYOUTS_KEPT
    assert layout.matches(a) and layout.nbytes == 48  # a layout let go of by the table is still whole


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "resizable"),
                    reason="torch without UntypedStorage.resizable(): the in-place path is off (_tensors.resizable)")
@pytest.mark.parametrize("backend", ENGINES)
def test_small_tensors_of_a_page_cache_file_move_in_their_own_storage(tmp_path, backend):
    """Up to 64 KiB on a file without O_DIRECT, a write frees the tensor's own
    storage in place (resized to 0) and a read resizes it back: the storage
    object stays. Transfers the engine does not finish within the call (held
    back, or a read the page cache cannot serve) complete right: such a write
    gives the tensor an empty storage until it finishes, then its own back,
    emptied. Failures leave the data where it was."""
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    off = Offloader(tmp_path, backend=backend, direct=False)
    try:
        t = random_tensor((16, 1024), torch.float32)  # 64 KiB: the largest moved in place
        expected, storage = t.clone(), t.untyped_storage()

        def same_storage():
            return t.untyped_storage()._cdata == storage._cdata

        off.sync_write(t)
        assert same_storage() and storage.nbytes() == 0
        off.sync_read(t)
        assert same_storage() and same_bits(t, expected)

        off.inject_faults(delay_rate=1.0, delay_ms=300)  # finished late: reaped as usual
        write = off.async_write(t)
        assert not write.done() and t.untyped_storage().nbytes() == 0
        write.wait()
        assert same_storage() and storage.nbytes() == 0
        read = off.async_read(t)
        assert not read.done()
        read.wait()
        assert same_storage() and same_bits(t, expected)

        off.inject_faults(error_rate=1.0, errnos=[errno.ENOSPC])
        with pytest.raises(OSError) as info:
            off.sync_write(t)
        assert info.value.errno == errno.ENOSPC and same_storage() and same_bits(t, expected)
        off.inject_faults()
        off.sync_write(t)
        off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
        with pytest.raises(OSError):
            off.sync_read(t)
        assert same_storage() and storage.nbytes() == 0  # still offloaded; the file holds it
        off.inject_faults()

        (fd,) = backing_fds(tmp_path)  # out of the page cache: the backend reads it from the disk
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        off.sync_read(t)
        assert same_storage() and same_bits(t, expected)

        big = random_tensor((64 * 1024 + 1,), torch.uint8)  # one byte more: read into a pool buffer
        big_expected, big_storage = big.clone(), big.untyped_storage()
        off.sync_write(big)
        off.sync_read(big)
        assert big.untyped_storage()._cdata != big_storage._cdata and same_bits(big, big_expected)
    finally:
        off.close()


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "resizable"),
                    reason="torch without UntypedStorage.resizable(): the in-place path is off (_tensors.resizable)")
@pytest.mark.parametrize("backend", ENGINES)
def test_a_small_tensors_first_write_to_a_page_cache_file_finishes_within_the_call(tmp_path, backend):
    """New tensors (activations, a step's small state) take the in-place
    path from their first write: on return the bytes are in the file and the
    tensor's own storage is emptied, with no completion left to reap. What no
    write accepts is refused there as on any other path; what that path does
    not take (over 64 KiB) still goes through a pool buffer."""
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    g = torch.Generator().manual_seed(5)
    with Offloader(tmp_path, backend=backend, direct=False) as off:
        tensors = [random_tensor((int(n),), dtype, g)
                   for n, dtype in [(1, torch.uint8), (3, torch.float16), (1000, torch.float32), (16384, torch.float32),
                                    (65536, torch.uint8), (4097, torch.bfloat16)]]
        tensors.append(random_tensor((64, 100), torch.float32, g).t())  # dense, not contiguous
        tensors.append(random_tensor((100,), torch.float32, g).requires_grad_())
        expected = [t.detach().clone() for t in tensors]
        for t in tensors:
            storage = t.untyped_storage()
            off.async_write(t)
            assert t.untyped_storage()._cdata == storage._cdata and storage.nbytes() == 0, t.shape
            assert "0 in flight" in repr(off)
        for t in tensors:
            storage = t.untyped_storage()
            off.async_read(t)
            assert t.untyped_storage()._cdata == storage._cdata and storage.nbytes() == t.nbytes
        off.synchronize()
        assert all(same_bits(t.detach(), e) for t, e in zip(tensors, expected))

        base = torch.arange(1000, dtype=torch.float32)
        with pytest.raises(ValueError, match="view"):
            off.async_write(base[:10])
        with pytest.raises(TypeError):
            off.async_write(base.numpy())
        with pytest.raises(RuntimeError, match="never written"):
            off.async_read(base[:10])
        off.sync_write(base)
        off.sync_read(base)
        assert torch.equal(base, torch.arange(1000, dtype=torch.float32))

        big = random_tensor((64 * 1024 + 1,), torch.uint8, g)
        big_expected, big_storage = big.clone(), big.untyped_storage()
        off.async_write(big)
        assert big.untyped_storage()._cdata != big_storage._cdata  # detached: the write holds it
        off.sync_read(big)
        assert same_bits(big, big_expected)


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "resizable"),
                    reason="torch without UntypedStorage.resizable(): the in-place path is off (_tensors.resizable)")
@pytest.mark.parametrize("backend", ENGINES)
def test_vector_calls_move_small_tensors_of_a_page_cache_file_in_their_own_storage(tmp_path, backend):
    """async_writev writes each tensor of at most 64 KiB from its own
    storage, first writes included, and frees it in place; async_readv reads
    those of at most 16 KiB back into their own storage, and larger ones
    into pool buffers, in one batch (where it measured faster). The rest of
    the same call (here a tensor over 64 KiB) takes the general path: one
    handle, one callback, every byte back. Transfers held back in the engine
    complete through it, as for single calls."""
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    g = torch.Generator().manual_seed(6)
    with Offloader(tmp_path, backend=backend, direct=False) as off:
        small = [random_tensor((int(n),), torch.float32, g) for n in torch.randint(1, 4097, (100,), generator=g)]
        medium = [random_tensor((int(n),), torch.float32, g) for n in torch.randint(4097, 16385, (100,), generator=g)]
        big = random_tensor((40000,), torch.float32, g)  # 160 KiB: through a pool buffer
        tensors = small + medium + [big]
        expected = [t.clone() for t in tensors]
        storages = [t.untyped_storage() for t in small + medium]
        calls = []
        for delayed in (False, True):
            if delayed:
                off.inject_faults(delay_rate=1.0, delay_ms=50)
            write = off.async_writev(tensors, callback=lambda: calls.append("write"))
            if not delayed:  # moved within the call: the tensors' own storages, emptied on return
                assert all(t.untyped_storage()._cdata == s._cdata and s.nbytes() == 0
                           for t, s in zip(small + medium, storages))
            write.wait()
            read = off.async_readv(tensors, callback=lambda: calls.append("read"))
            read.wait()
            assert all(t.untyped_storage()._cdata == s._cdata for t, s in zip(small, storages))
            assert not any(t.untyped_storage()._cdata == s._cdata for t, s in zip(medium, storages[len(small):]))
            assert all(same_bits(t, e) for t, e in zip(tensors, expected))
            off.inject_faults()
        assert calls == ["write", "read"] * 2


def test_a_long_callback_chain_of_small_tensors_runs_without_recursing(tmp_path):
    """Each link's transfer finishes within the call that starts it; its
    callback still runs from a later call (synchronize's loop), not inside:
    4,000 links would otherwise pass Python's recursion limit."""
    with Offloader(tmp_path, direct=False) as off:
        t = torch.randn(100)
        expected, links = t.clone(), []

        def read_then_write_again():
            links.append(1)
            if len(links) < 2000:
                off.async_write(t, callback=lambda: off.async_read(t, callback=read_then_write_again))

        off.sync_write(t)
        off.async_read(t, callback=read_then_write_again)
        off.synchronize()
        assert len(links) == 2000 and torch.equal(t, expected)


@pytest.mark.parametrize("failing", [False, True], ids=["succeeded", "failed"])
def test_a_finished_handle_lets_go_of_its_callback(tmp_path, failing):
    """A callback that refers to the object holding its handle (a pipeline
    keeping its handles, a lambda over ``self``) is a reference cycle while
    the handle holds it: with the cyclic GC off (as during vector calls, or
    rarely run in a long training process), that object and every tensor it
    holds would outlive it, file space included."""
    import gc
    import weakref

    class Holder:
        def landed(self):
            pass

    with Offloader(tmp_path) as off:
        t = torch.randn(1000)
        off.sync_write(t)
        if failing:
            off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
        gc.disable()
        try:
            holder = Holder()
            holder.handle = off.async_read(t, callback=holder.landed)
            gone = weakref.ref(holder)
            if failing:
                with pytest.raises(OSError):
                    holder.handle.wait()
            else:
                holder.handle.wait()
            del holder
            assert gone() is None
        finally:
            gc.enable()


@pytest.mark.parametrize("backend", ENGINES)
def test_a_vector_write_grows_the_file_once_before_its_transfers_start(tmp_path, backend, monkeypatch):
    # ext4's fallocate waits for every O_DIRECT transfer in flight on the file:
    # growing it step by step while the first chunks run stalled the disk.
    tensors = [random_tensor((n,), torch.uint8) for n in [1 << 20] * 300 + [5000, 3 << 20]]
    expected = [t.clone() for t in tensors]
    grown = []
    real = os.posix_fallocate
    with Offloader(tmp_path, backend=backend) as off:
        def fallocate(fd, offset, length):
            grown.append((off.file_bytes, length))   # 0: before the call claimed an extent
            real(fd, offset, length)
        monkeypatch.setattr(os, "posix_fallocate", fallocate)
        off.sync_writev(tensors)
        assert len(grown) == 1 and grown[0][0] == 0, grown      # once, before any transfer
        assert grown[0][1] >= 300 * (1 << 20) + (3 << 20)
        off.sync_readv(tensors)
        assert all(same_bits(a, b) for a, b in zip(tensors, expected))
        off.sync_writev(tensors)                                 # the extents exist: no growth
        assert len(grown) == 1


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_memory_torch_does_not_own_is_written_as_it_was_at_the_call(tmp_path, backend, direct):
    """Its owner (numpy here) may change it once the call returned: the write
    takes a snapshot. The I/O before it is held back, so the engine reaches
    this tensor's bytes only after the owner changed them."""
    np = pytest.importorskip("numpy")
    with Offloader(tmp_path, n_entries=1, backend=backend, direct=direct) as off:   # one I/O at a time
        off.inject_faults(delay_rate=1.0, delay_ms=300)            # (each completion, as it is met)
        off.async_write(torch.randn(1 << 20))                      # holds the only slot
        owned = np.arange(1 << 18, dtype=np.float32)
        t = torch.from_numpy(owned)
        expected = t.clone()
        off.async_write(t)
        owned[:] = -1                                              # while the write waits
        off.synchronize()
        off.inject_faults()
        off.sync_read(t)
        assert torch.equal(t, expected)


@pytest.mark.parametrize("backend", ENGINES)
def test_torch_memory_is_written_as_it_is_where_the_file_admits_it(tmp_path, backend):
    """A write goes from the tensor's own memory when the file's alignment
    admits its address and length (a page-cache file admits any), and
    through staging blocks otherwise; the bits come back the same."""
    sizes = ((1 << 20) + 3, 4 << 20, 1 << 20)
    with Offloader(tmp_path, backend=backend, direct=False) as off:
        tensors = [random_tensor((n,), torch.uint8) for n in sizes]
        expected = [t.clone() for t in tensors]
        off.sync_writev(tensors)
        assert off.staged_bytes == 0
        off.sync_readv(tensors)
        assert all(same_bits(a, b) for a, b in zip(tensors, expected))
    with Offloader(tmp_path, backend=backend, direct=True) as off:
        memory, _ = _core.dio_alignment(backing_fds(tmp_path)[0])
        t = random_tensor((4 << 20,), torch.uint8)
        misaligned = t.data_ptr() % max(memory, 1) != 0
        expected = t.clone()
        off.sync_write(t)
        first = off.staged_bytes
        if hasattr(torch.UntypedStorage, "resizable"):
            assert first == (4 << 20 if misaligned else 0)
        else:  # torch 2.2 and older: the write copies the bytes first, and the copy's address decides
            assert first in (0, 4 << 20)
        off.sync_read(t)  # into a pool block: page-aligned, so the next write takes it as it is
        off.sync_write(t)
        assert off.staged_bytes == first
        off.sync_read(t)
        assert same_bits(t, expected)


ALIGNED_TORCH_MEMORY = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    from conftest import random_tensor, same_bits
    with Offloader(sys.argv[1], backend=sys.argv[2], direct=True) as off:
        whole = random_tensor((4 << 20,), torch.uint8)     # page-aligned (THP_MEM_ALLOC_ENABLE)
        ragged = random_tensor(((4 << 20) + 100,), torch.uint8)  # its length is not
        expected = [whole.clone(), ragged.clone()]
        aligned = whole.data_ptr() % 4096 == 0
        off.sync_write(whole)
        in_place = off.staged_bytes == 0
        off.sync_write(ragged)
        staged = off.staged_bytes
        off.sync_readv([whole, ragged])
        print(aligned, in_place, staged, all(same_bits(a, b) for a, b in zip([whole, ragged], expected)))
""")


def test_page_aligned_torch_memory_goes_to_o_direct_without_a_copy(tmp_path, backend="auto"):
    """torch allocates page-aligned memory for large tensors with
    THP_MEM_ALLOC_ENABLE=1: O_DIRECT takes it as it is, and only a length
    off the alignment goes through staging."""
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    result = run_python([sys.executable, "-c", ALIGNED_TORCH_MEMORY, str(tmp_path), backend], env=env,
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    aligned, in_place, staged, same = result.stdout.split()
    if aligned != "True":
        pytest.skip(f"torch {torch.__version__} ignores THP_MEM_ALLOC_ENABLE")
    assert in_place == "True" and int(staged) == (4 << 20) + 100 and same == "True"


class _WatchedEngine:
    """An engine seen through: records which thread submitted each batch
    and how many requests it held, in the order they reached it (those off
    the main thread after a delay), and refuses the ``refuse``-th with ENOMEM
    (nothing of a refused batch starts, as the real engine's refusal)."""

    def __init__(self, engine, refuse=None):
        self._engine, self._refuse, self.batches = engine, refuse, []

    def submit(self, batch):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)  # a slow submission: a batch behind it must wait for it
        self.batches.append((threading.current_thread(), len(batch.tags())))
        if len(self.batches) == self._refuse:
            raise OSError(errno.ENOMEM, "refused for the test")
        self._engine.submit(batch)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("refuse", [None, 2], ids=["all-taken", "second-refused"])
def test_a_long_vector_calls_batches_are_submitted_beside_its_planning(tmp_path, backend, refuse):
    """A vector call hands the engine its requests 256 at a time; all but the
    last batch are submitted on a helper thread while the caller plans the
    next, in order. A batch the engine refuses fails its own tensors' writes
    with the errno (each keeps its data); the rest are written, and every
    tensor reads back bit for bit."""
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    tensors = [random_tensor((4096 + 16 * i,), torch.uint8) for i in range(700)]  # staged: torch's memory
    expected = [t.clone() for t in tensors]
    with Offloader(tmp_path, backend=backend) as off:
        watched = off._engine = _WatchedEngine(off._engine, refuse)
        handle = off.async_writev(tensors)
        assert [n for _, n in watched.batches] == [256, 256, 188]
        caller = threading.current_thread()
        assert [thread is caller for thread, _ in watched.batches] == [False, False, True]
        if refuse is None:
            handle.wait(timeout=60)
        else:
            with pytest.raises(OSError) as info:
                handle.wait(timeout=60)
            assert info.value.errno == errno.ENOMEM
        refused = range(256, 512) if refuse == 2 else range(0)
        for i, (t, e) in enumerate(zip(tensors, expected)):
            assert (t.untyped_storage().nbytes() == 0) == (i not in refused), i
            assert i not in refused or same_bits(t, e), i  # the write failed: its data is back
        off.sync_readv([t for i, t in enumerate(tensors) if i not in refused])
        assert all(same_bits(t, e) for t, e in zip(tensors, expected))
        watched.batches.clear()
        watched._refuse = None
        off.async_writev(tensors[:300]).wait()  # the next call: the helper again (or a new one)
        assert [thread is caller for thread, _ in watched.batches] == [False, True]
