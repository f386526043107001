"""One suite, run against every engine with O_DIRECT on and off."""
import asyncio
import collections
import copy
import errno
import io
import random
import threading
import time

import pytest
import torch

from offload._tensors import GUARDS
from conftest import (AUTOGRAD_ROUND_TRIPS, LoopTicks, assert_no_change_to_autograd,
                      assert_the_base_goes_and_returns_with_its_view, random_tensor, same_bits)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(offloader, dtype):
    t = random_tensor((37, 129), dtype)
    expected = t.clone()
    offloader.sync_write(t)
    assert t.untyped_storage().nbytes() == 0
    assert t.shape == (37, 129) and t.dtype == dtype
    offloader.sync_read(t)
    assert same_bits(t, expected)


@pytest.mark.parametrize("nbytes", [1, 3, 4095, 4096, 4097, 65537, (4 << 20) + 1, (9 << 20) - 7])
def test_odd_sizes_keep_every_byte(offloader, nbytes):
    t = random_tensor((nbytes,), torch.uint8)
    expected = t.clone()
    offloader.sync_write(t)
    offloader.sync_read(t)
    assert same_bits(t, expected)


def test_zero_element_tensors(offloader):
    t = torch.empty(0, 5, dtype=torch.float32)
    called = []
    offloader.async_write(t, callback=lambda: called.append("w")).wait()
    offloader.async_read(t, callback=lambda: called.append("r")).wait()
    offloader.synchronize()
    assert called == ["w", "r"] and t.shape == (0, 5)


def test_memory_is_released_and_restored(offloader):
    t = torch.randn(1000, 1000)
    offloader.sync_write(t)
    assert t.untyped_storage().nbytes() == 0
    offloader.sync_read(t)
    assert t.untyped_storage().nbytes() == 4_000_000


NO_GUARDS = ("this torch build cannot make a storage's data refuse access (CPU-only wheels lack "
             "torch._C._set_storage_data_ptr_access_error_msg, CUDA builds before 2.12 the call that clears it): "
             "touching an offloaded tensor crashes there")
# What each touch raises: torch's own bounds check comes first where a touch
# slices (repr of a large tensor prints its ends), the guard everywhere else.
TOUCHES = {
    "repr": (repr, "offloaded|out of bounds for storage of size 0"),
    "a kernel": (lambda t: t.sum(), "offloaded"),
    "an in-place kernel": (lambda t: t.add_(1), "offloaded"),
    "data_ptr()": (lambda t: t.data_ptr(), "offloaded"),
    "copy.deepcopy": (copy.deepcopy, "offloaded"),
    "torch.save": (lambda t: torch.save(t, io.BytesIO()), "offloaded"),
}


def test_guards_are_on_wherever_torch_has_them():
    """CUDA builds of torch have the calls; if one stops passing the probe
    (a changed signature or behaviour), offloaded tensors would crash again."""
    has = all(hasattr(torch._C, name) for name in ("_set_storage_data_ptr_access_error_msg",
                                                    "_clear_storage_data_ptr_access_error_msg"))
    assert GUARDS == has


@pytest.mark.skipif(not GUARDS, reason=NO_GUARDS)
@pytest.mark.parametrize("numel", [1000, 1 << 20], ids=["small", "large"])
@pytest.mark.parametrize("form", ["single", "vector", "discard"])
def test_touching_an_offloaded_tensor_raises_until_it_is_read_back(offloader, numel, form):
    """Small tensors (moved in place on a page-cache file) and large ones
    (staged, or from pool memory); written alone, in a vector, or read and
    discarded: every touch of the offloaded tensor raises a RuntimeError
    (that says it is offloaded, where it reaches the data); read back, it
    has its bytes and works."""
    t = random_tensor((numel,), torch.float32)
    expected = t.clone()
    if form == "vector":
        offloader.sync_writev([t])
    else:
        offloader.sync_write(t)
    if form == "discard":  # the read gives it pool memory; discard empties that
        offloader.sync_read(t)
        offloader.discard(t)
    for touch, raises in TOUCHES.values():
        with pytest.raises(RuntimeError, match=raises):
            touch(t)
    assert t.untyped_storage().nbytes() == 0 and t.shape == (numel,)
    offloader.sync_read(t)
    assert same_bits(t, expected)
    for touch, _ in TOUCHES.values():
        touch(t)


@pytest.mark.skipif(not GUARDS, reason=NO_GUARDS)
def test_an_offloaded_tensor_whose_read_failed_still_refuses_to_be_touched(offloader):
    for numel in (1000, 1 << 20):
        t = random_tensor((numel,), torch.float32)
        expected = t.clone()
        offloader.sync_write(t)
        offloader.inject_faults(error_rate=1.0, errnos=[errno.EIO])
        with pytest.raises(OSError):
            offloader.sync_read(t)
        offloader.inject_faults()
        with pytest.raises(RuntimeError, match="offloaded"):
            t.sum()
        offloader.sync_read(t)
        assert same_bits(t, expected)


def test_many_concurrent_async_operations_with_callbacks(offloader):
    rng = torch.Generator().manual_seed(0)
    tensors = [random_tensor((random.Random(i).randint(1, 300_000),), torch.uint8, rng) for i in range(200)]
    expected = [t.clone() for t in tensors]
    done = []
    handles = [offloader.async_write(t, callback=lambda i=i: done.append(("w", i)))
               for i, t in enumerate(tensors)]
    offloader.synchronize()
    assert all(h.done() for h in handles)
    assert sorted(done) == [("w", i) for i in range(200)]
    done.clear()
    for i, t in enumerate(tensors):
        offloader.async_read(t, callback=lambda i=i: done.append(("r", i)))
    offloader.synchronize()
    assert sorted(done) == [("r", i) for i in range(200)]
    assert all(same_bits(a, b) for a, b in zip(tensors, expected))


def test_callback_runs_exactly_once_on_the_calling_thread(offloader):
    import threading
    t = torch.randn(100_000)
    threads = []
    handle = offloader.async_write(t, callback=lambda: threads.append(threading.get_ident()))
    handle.wait()
    offloader.synchronize()
    offloader.synchronize()
    assert threads == [threading.get_ident()]


@pytest.mark.parametrize("numel", [1000, 100_000], ids=["4KB", "400KB"])  # in place on a page-cache file, and not
def test_a_callback_has_run_when_its_handle_says_done(offloader, numel):
    """wait(), done() and await return only after the callback ran, also for
    a transfer the engine finished within the call that started it."""
    t, ran = torch.randn(numel), []
    offloader.async_write(t, callback=lambda: ran.append("write")).wait()
    assert ran == ["write"]
    handle = offloader.async_read(t, callback=lambda: ran.append("read"))
    while not handle.done():
        time.sleep(0.001)
    assert ran == ["write", "read"]

    async def main():
        await offloader.write(t, callback=lambda: ran.append("await"))
        assert ran[-1] == "await"

    asyncio.run(main())


def test_callback_chain_read_compute_write(offloader):
    t = torch.randn(256, 256)
    expected = t * 2
    offloader.sync_write(t)

    def compute_then_offload():
        t.mul_(2.0)
        offloader.async_write(t)

    offloader.async_read(t, callback=compute_then_offload)
    offloader.synchronize()
    assert t.untyped_storage().nbytes() == 0
    offloader.sync_read(t)
    assert torch.equal(t, expected)


def test_operations_on_one_tensor_take_effect_in_issue_order(offloader):
    t = torch.randn(3 << 20)  # 12 MiB: several chunks in flight
    expected = t.clone()
    order = []
    for round_ in range(5):
        offloader.async_write(t, callback=lambda r=round_: order.append(("w", r)))
        offloader.async_read(t, callback=lambda r=round_: order.append(("r", r)))
    offloader.synchronize()
    assert order == [(k, r) for r in range(5) for k in ("w", "r")]
    assert torch.equal(t, expected)


def test_read_issued_behind_a_write_gets_the_written_data(offloader):
    tensors = [torch.full((1 << 18,), float(i)) for i in range(16)]
    for t in tensors:
        offloader.async_write(t)
        offloader.async_read(t)
    offloader.synchronize()
    assert all(torch.equal(t, torch.full((1 << 18,), float(i))) for i, t in enumerate(tensors))


def test_asyncio_gather_of_hundreds(offloader):
    tensors = [torch.randn(1000 + i) for i in range(300)]
    expected = [t.clone() for t in tensors]

    async def main():
        await asyncio.gather(*(offloader.write(t) for t in tensors))
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        await asyncio.gather(*(offloader.read(t) for t in tensors))

    asyncio.run(main())
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


@pytest.mark.asyncio
async def test_await_finishes_through_the_event_loop_without_polling(offloader):
    t = torch.randn(1 << 20)
    expected = t.clone()
    async with LoopTicks() as ticks:
        await offloader.write(t)
        await offloader.read(t)
    assert torch.equal(t, expected)
    assert ticks.count > 0  # the loop kept running other tasks while the I/O was in flight


@pytest.mark.asyncio
async def test_await_lists_and_handles(offloader):
    ts = [torch.randn(50_000) for _ in range(10)]
    expected = [t.clone() for t in ts]
    await offloader.write(ts)
    handle = offloader.async_readv(ts)
    await handle
    assert handle.done()
    assert all(torch.equal(a, b) for a, b in zip(ts, expected))


def test_vector_forms_one_callback_for_the_group(offloader):
    ts = [torch.randn(7, 1000 + i) for i in range(20)]
    expected = [t.clone() for t in ts]
    calls = []
    h = offloader.async_writev(ts, callback=lambda: calls.append("w"))
    h.wait()
    offloader.synchronize()
    assert calls == ["w"] and all(t.untyped_storage().nbytes() == 0 for t in ts)
    offloader.async_readv(ts, callback=lambda: calls.append("r"))
    offloader.synchronize()
    assert calls == ["w", "r"]
    assert all(torch.equal(a, b) for a, b in zip(ts, expected))
    offloader.sync_writev(ts)
    offloader.sync_readv(ts)
    assert all(torch.equal(a, b) for a, b in zip(ts, expected))


def test_tensors_are_identified_by_object_not_id(offloader):
    # Tensors that die free their record; a new tensor that gets the same id()
    # must not inherit the dead one's state or data.
    seen_ids = set()
    for i in range(50):
        t = torch.full((1024,), float(i))
        seen_ids.add(id(t))
        offloader.sync_write(t)
        del t  # refcounting frees it here
    fresh = torch.zeros(1024)
    with pytest.raises(RuntimeError, match="never written"):
        offloader.sync_read(fresh)
    offloader.sync_write(fresh)
    offloader.sync_read(fresh)
    assert torch.equal(fresh, torch.zeros(1024))
    assert len(seen_ids) < 50  # ids really were reused, so the test tested something


def test_dead_tensors_give_their_file_space_back(offloader):
    for _ in range(20):
        t = torch.randn(1 << 20)
        offloader.sync_write(t)
        del t
    offloader.synchronize()
    assert offloader.file_bytes <= 2 * (4 << 20)


def test_backing_file_stays_bounded_over_100_write_read_cycles(offloader):
    tensors = [torch.randn(1000 * (i + 1)) for i in range(8)]
    offloader.sync_writev(tensors)
    offloader.sync_readv(tensors)
    high_water = offloader.file_bytes
    for _ in range(100):
        offloader.sync_writev(tensors)
        offloader.sync_readv(tensors)
        for t in tensors:
            t.add_(1)
    assert offloader.file_bytes == high_water


def test_views_are_refused_and_never_touched(offloader):
    base = torch.arange(100, dtype=torch.float32)
    for view in (base[10:20], base[::2], base.view(10, 10)[:, 3]):
        with pytest.raises(ValueError, match="view"):
            offloader.sync_write(view)
    assert torch.equal(base, torch.arange(100, dtype=torch.float32))


def test_tensors_with_live_views_are_refused(offloader):
    base = torch.arange(100, dtype=torch.float32)
    view = base[:10]
    with pytest.raises(ValueError, match="share"):
        offloader.sync_write(base)
    assert base.untyped_storage().nbytes() == 400 and view.sum() == 45


def test_a_tensor_grown_between_round_trips_gets_room_of_its_new_size_in_the_file(offloader):
    """Its extent is too small for it now: the write takes a new one rather
    than running over the tensor stored after it, and gives the old one back
    (the next tensor of that size goes there)."""
    t, neighbour = torch.randn(1 << 14), torch.randn(1 << 14)   # 64 KiB each, side by side in the file
    expected_neighbour = neighbour.clone()
    offloader.sync_writev([t, neighbour])
    offloader.sync_read(t)
    t.data = torch.randn(1 << 18)                                 # 1 MiB now
    expected = t.clone()
    offloader.sync_write(t)
    end = offloader.file_bytes
    offloader.sync_write(torch.randn(1 << 14))
    assert offloader.file_bytes == end
    offloader.sync_readv([t, neighbour])
    assert torch.equal(t, expected) and torch.equal(neighbour, expected_neighbour)


def test_a_tensor_given_a_live_view_after_it_was_read_back_is_refused(offloader):
    """The check on a tensor written before (on a page-cache file, small ones
    move in their own storage, which a write empties) sees the new view."""
    t = torch.arange(100, dtype=torch.float32)
    offloader.sync_write(t)
    offloader.sync_read(t)
    view = t[:10]
    with pytest.raises(ValueError, match="share"):
        offloader.sync_write(t)
    assert t.untyped_storage().nbytes() == 400 and view.sum() == 45


def test_an_output_autograd_saved_is_refused_until_the_backward_ran(offloader):
    """relu saves its output as a second tensor on the same storage: the
    write says so, and the backward still reads it; afterwards it goes."""
    x = torch.randn(1000, requires_grad=True)
    y = torch.relu(x)
    z = (y * 3).sum()
    with pytest.raises(ValueError, match="saved for backward"):
        offloader.sync_write(y)
    z.backward()
    assert same_bits(x.grad, (x.detach() > 0) * 3.0)
    expected = y.detach().clone()
    offloader.sync_write(y)
    offloader.sync_read(y)
    assert same_bits(y, expected)


def test_dense_non_contiguous_layouts_round_trip(offloader):
    transposed = torch.randn(300, 70).t()
    channels_last = torch.randn(2, 3, 17, 19).contiguous(memory_format=torch.channels_last)
    for t in (transposed, channels_last):
        expected, stride = t.clone(), t.stride()
        offloader.sync_write(t)
        offloader.sync_read(t)
        assert t.stride() == stride and torch.equal(t, expected)


def test_parameters_and_grad_requiring_tensors(offloader):
    p = torch.nn.Parameter(torch.randn(64, 64))
    expected = p.detach().clone()
    offloader.sync_write(p)
    offloader.sync_read(p)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert torch.equal(p.detach(), expected)
    (p * 2).sum().backward()
    assert torch.equal(p.grad, torch.full((64, 64), 2.0))



@pytest.mark.parametrize("numel", [1024, 1 << 18], ids=["4KiB", "1MiB"])  # 4 KiB: in place on a page-cache file
@pytest.mark.parametrize("round_trip", AUTOGRAD_ROUND_TRIPS, ids=str)
def test_a_round_trip_between_forward_and_backward_is_no_change_to_autograd(offloader, round_trip, numel):
    """Tensors saved for backward, offloaded and read back before it: the
    backward runs (their version counters are as they were), a leaf used
    again afterwards accumulates its gradient once per backward (the same
    accumulator), and the gradient is bit for bit that of a run that never
    offloaded."""
    assert_no_change_to_autograd(offloader, round_trip, numel)


@pytest.mark.parametrize("numel", [1024, 1 << 18], ids=["4KiB", "1MiB"])
@pytest.mark.parametrize("round_trip", AUTOGRAD_ROUND_TRIPS, ids=str)
def test_a_view_offloaded_beside_its_base_takes_the_base_along(offloader, round_trip, numel):
    """A view that covers its whole storage is offloaded while its base lives
    on (autograd saved it): the base goes and comes back with the view."""
    assert_the_base_goes_and_returns_with_its_view(offloader, round_trip, numel)


@pytest.mark.parametrize("numel", [1024, 1 << 18], ids=["4KiB", "1MiB"])
def test_tensors_made_in_inference_mode_round_trip(offloader, numel):
    """They have no version counter (autograd never saves them): nothing to
    bump or restore, and every form of round trip works, inside inference
    mode or outside it."""
    with torch.inference_mode():
        t = torch.randn(numel)
    expected = t.clone()
    for round_trip in AUTOGRAD_ROUND_TRIPS.values():
        round_trip(offloader, [t])
        assert same_bits(t, expected)
    with torch.inference_mode():
        AUTOGRAD_ROUND_TRIPS["vector"](offloader, [t])
    assert same_bits(t, expected) and t.is_inference()


@pytest.mark.parametrize("numel", [1024, 1 << 18], ids=["4KiB", "1MiB"])
def test_a_backward_over_a_tensor_still_offloaded_raises_and_runs_once_it_is_back(offloader, numel):
    """The tensor's memory is gone: autograd refuses the saved tensor (it
    does not read freed memory); read back, the same graph runs."""
    w = torch.randn(numel, requires_grad=True)
    z = (w * w).sum()
    offloader.sync_write(w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward(retain_graph=True)
    offloader.sync_read(w)
    z.backward()
    assert same_bits(w.grad, 2 * w.detach())


def test_mixed_random_workload(offloader):
    rng = random.Random(7)
    live = {}
    for step in range(400):
        key = rng.randrange(30)
        if key not in live:
            t = random_tensor((rng.randint(1, 200_000),), torch.uint8)
            live[key] = (t, t.clone(), False)
        t, expected, offloaded = live[key]
        if offloaded:
            offloader.async_read(t)
        else:
            offloader.async_write(t)
        live[key] = (t, expected, not offloaded)
        if step % 50 == 0:
            offloader.synchronize()
    for t, expected, offloaded in live.values():
        if offloaded:
            offloader.async_read(t)
    offloader.synchronize()
    assert all(torch.equal(t, expected) for t, expected, _ in live.values())


@pytest.mark.slow
def test_tensor_over_2_gib(engine_config, tmp_path):
    if not engine_config["direct"]:
        pytest.skip("the 2.5 GiB case runs O_DIRECT on each engine; the buffered path chunks the same way")
    if "stripes" in engine_config:
        pytest.skip("striping has its own large case (test_striping.py)")
    from offload import Offloader
    n = (5 << 30) // 2 // 8  # 2.5 GiB of int64
    t = torch.arange(n, dtype=torch.int64)
    with Offloader(tmp_path, **engine_config) as off:
        off.sync_write(t)
        assert t.untyped_storage().nbytes() == 0
        off.sync_read(t)
    assert t[-1].item() == n - 1
    assert torch.equal(t, torch.arange(n, dtype=torch.int64))


def test_large_vector_calls_are_submitted_in_batches(offloader):
    # More tensors than one submission batch, odd sizes so every write is staged.
    tensors = [random_tensor((1000 + i,), torch.uint8) for i in range(700)]
    expected = [t.clone() for t in tensors]
    calls = []
    offloader.async_writev(tensors, callback=lambda: calls.append("w"))
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # every tensor released
    offloader.sync_readv(tensors)
    assert calls == ["w"]
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


def test_discard_returns_a_read_tensor_to_the_file_without_writing(offloader):
    t = random_tensor((300_000,), torch.uint8)
    original = t.clone()
    offloader.sync_write(t)
    offloader.sync_read(t)
    moved = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, t.shape, t.stride())
    t.add_(1)                                     # changes after the read are abandoned
    offloader.discard(t)
    assert t.untyped_storage().nbytes() == 0
    assert same_bits(moved, original + 1)         # a tensor sharing the memory keeps it
    offloader.discard(t)                          # offloaded already: nothing to do
    offloader.sync_read(t)
    assert same_bits(t, original)


def test_discard_refuses_what_the_file_does_not_hold(offloader):
    never_written = torch.ones(10)
    with pytest.raises(RuntimeError, match="never written"):
        offloader.discard(never_written)
    t = torch.ones(1 << 20)
    offloader.sync_write(t)
    offloader.inject_faults(delay_rate=1.0, delay_ms=500)   # the read stays in flight while discard is tried
    h = offloader.async_read(t)
    with pytest.raises(RuntimeError, match="in flight"):
        offloader.discard(t)
    offloader.inject_faults()
    h.wait()
    offloader.inject_faults(error_rate=1.0, errnos=[5])
    with pytest.raises(OSError):
        offloader.sync_write(t)                   # failed: t keeps its data, the file may be torn
    offloader.inject_faults()
    with pytest.raises(RuntimeError, match="does not hold"):
        offloader.discard(t)
    assert torch.equal(t, torch.ones(1 << 20))


def test_vector_writes_of_mixed_small_tensors_fail_per_tensor(offloader):
    """A vector write of many small and odd-sized tensors round-trips, and
    when every request fails each tensor gets exactly its own bytes back,
    whether it was staged (first write) or written in place (after a read)."""
    g = torch.Generator().manual_seed(5)
    tensors = [random_tensor((n,), torch.uint8, g) for n in [65536] * 100 + [1, 4097, 300_000, 1 << 20] * 10]
    expected = [t.clone() for t in tensors]
    offloader.sync_writev(tensors)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    offloader.sync_readv(tensors)
    assert all(same_bits(t, e) for t, e in zip(tensors, expected))
    offloader.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError):
        offloader.sync_writev(tensors)                # in place from pool buffers this time
    offloader.inject_faults()
    assert all(same_bits(t, e) for t, e in zip(tensors, expected))
    offloader.sync_writev(tensors)
    offloader.sync_readv(tensors)
    assert all(same_bits(t, e) for t, e in zip(tensors, expected))


def test_small_tensors_side_by_side_fail_and_recover_together(offloader):
    """Small tensors of one vector call share I/Os on an O_DIRECT file (the
    first write staged into shared blocks, reads and later writes
    vectored). When those I/Os fail, every tensor in them fails: each write
    leaves its tensor its own bytes, each read leaves its tensor offloaded
    and readable again."""
    g = torch.Generator().manual_seed(9)
    tensors = [random_tensor((n,), torch.uint8, g) for n in [65536] * 64 + [4097, 1, 12288] * 8]
    expected = [t.clone() for t in tensors]
    engine = offloader._engine
    merged = engine.merged_writes, engine.merged_vectored
    offloader.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError):
        offloader.sync_writev(tensors)                # the first write: staged
    assert all(same_bits(t, e) for t, e in zip(tensors, expected))
    offloader.inject_faults()
    offloader.sync_writev(tensors)
    offloader.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError):
        offloader.sync_readv(tensors)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    offloader.inject_faults()
    offloader.sync_readv(tensors)
    assert all(same_bits(t, e) for t, e in zip(tensors, expected))
    if offloader.direct:
        assert engine.merged_writes > merged[0] and engine.merged_vectored > merged[1]


class _Modelled:
    """One tensor of the random-operations test, and what it must hold: its
    bytes (``expected``), the file's copy (``file``: the bytes of its last
    successful write, None where the file holds none, UNKNOWN where a vector
    call's error leaves it open), and the calls issued on it since it last
    settled."""
    UNKNOWN = object()

    def __init__(self, t):
        self.t, self.expected, self.file, self.calls = t, t.clone(), None, []
        self.offloaded = False  # what the calls issued on it so far will leave, if they succeed

    def settle(self) -> None:
        """Waits for its calls; then it is resident with exactly its bytes, or
        empty with them in the file."""
        for kind, handle, single in self.calls:
            try:
                handle.wait()
            except (OSError, RuntimeError):
                pass
            if kind == "write":
                error = handle.exception()
                if error is None:
                    self.file = self.expected.clone()
                elif not single:
                    self.file = _Modelled.UNKNOWN  # the error may be another tensor's
                elif isinstance(error, OSError):
                    self.file = None  # the write began overwriting the file's copy
                # else refused when its turn came (the read before it failed): the file is as it was
        self.calls = []
        self.offloaded = self.t.numel() > 0 and self.t.untyped_storage().nbytes() == 0
        if not self.offloaded:
            assert same_bits(self.t, self.expected)
        elif GUARDS:  # touching it raises, rather than reading address 0
            with pytest.raises(RuntimeError, match="offloaded"):
                self.t.sum()


def test_random_operations_against_a_model(offloader):
    """Random single and vector calls on tensors of 1 B to 512 KiB (most under
    the 64 KiB in-place limit), queued behind one another, with edits,
    discards, tensors dropped mid-flight and injected faults (errors, short
    transfers, delays) switched on and off. Once its calls finish, every
    tensor is resident with exactly its bytes or empty with them in the file;
    a discard brings back the bytes of the last successful write; each
    callback runs once if its call succeeded, never otherwise."""
    run = _ModelRun(offloader, seed=11)
    run.steps(1200)
    run.finish()


def test_random_operations_from_three_threads_at_once(offloader):
    """The same from three threads sharing the Offloader, each on tensors of
    its own; faults switched on and off by any of them apply to all."""
    runs = [_ModelRun(offloader, seed=20 + i) for i in range(3)]
    errors = []

    def steps(run):
        try:
            run.steps(400)
        except BaseException as error:
            errors.append(error)
    threads = [threading.Thread(target=steps, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    _ModelRun.finish_all(offloader, runs)


def test_random_operations_against_a_model_through_the_device_pipeline(tmp_path):
    """The same through the GPU tier's staging pipeline, on the test device
    (copies that finish late, on another thread) with small staging slots."""
    from offload import Offloader
    from offload.devices import LateCopyDevice
    device = LateCopyDevice(seed=12, max_delay=0.0002)
    with Offloader(tmp_path, device=device, staging_buffers=2, staging_buffer_bytes=64 << 10) as offloader:
        run = _ModelRun(offloader, seed=11)
        run.steps(600)
        run.finish()
    assert device.copies > 1000


class _ModelRun:
    """Random operations on tensors of its own, each beside its _Modelled."""

    def __init__(self, offloader, seed):
        self.offloader = offloader
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.live, self.handles, self.callbacks = [], [], {}
        self.seen = collections.Counter()  # what the run exercised

    def new_tensor(self):
        rng = self.rng
        nbytes = rng.randint(1, 64 << 10) if rng.random() < 0.7 else rng.randint(1, 512 << 10)
        dtype = rng.choice([torch.uint8, torch.float32, torch.bfloat16])
        numel = max(1, nbytes // dtype.itemsize)
        t = random_tensor((numel,), dtype, self.gen)
        if numel % 2 == 0 and rng.random() < 0.2:
            t = t.view(2, numel // 2).t()  # covers its storage, not contiguous
        self.live.append(_Modelled(t))

    def steps(self, count):
        offloader, rng, live, seen = self.offloader, self.rng, self.live, self.seen
        for step in range(count):
            # Memory freed by a write is scribbled over, so that a tensor given
            # back memory without its bytes cannot pass by holding them still.
            scribbles = [torch.full((rng.randint(1, 64 << 10),), 0xA5, dtype=torch.uint8) for _ in range(3)]
            del scribbles
            r = rng.random()
            if r < 0.03:
                if rng.random() < 0.5:
                    offloader.inject_faults()
                else:
                    offloader.inject_faults(error_rate=rng.choice([0.05, 0.5]), errnos=[errno.EIO, errno.ENOSPC],
                                            short_rate=0.2, delay_rate=0.1, delay_ms=1, seed=step)
            elif r < 0.12 or len(live) < 3:
                self.new_tensor()
            elif r < 0.16:  # dropped, whatever it is doing
                x = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.5:
                    x.settle()
            elif r < 0.24:
                x = rng.choice(live)
                x.settle()
                if not x.offloaded and rng.random() < 0.5:
                    x.t.add_(1)
                    x.expected.add_(1)
                    seen["edited"] += 1
            elif r < 0.28:
                self.discard(rng.choice(live))
            else:
                self.call(writes=rng.random() < 0.5, vector=rng.random() < 0.4)

    def discard(self, x):
        x.settle()
        if x.offloaded or x.file is _Modelled.UNKNOWN:
            return
        if x.file is None:
            with pytest.raises(RuntimeError):
                self.offloader.discard(x.t)
            self.seen["discard refused"] += 1
        else:
            self.offloader.discard(x.t)
            x.expected, x.offloaded = x.file.clone(), True
            self.seen["discarded"] += 1

    def call(self, writes, vector):
        """An async call, single or vector, on tensors it may take (as far as
        the calls issued so far go)."""
        group = [x for x in self.live if x.offloaded != writes]
        if not group:
            return
        rng, offloader, callbacks = self.rng, self.offloader, self.callbacks
        chosen = rng.sample(group, min(len(group), rng.randint(2, 12))) if vector else [rng.choice(group)]
        number = len(self.handles)

        def callback():
            callbacks[number] = callbacks.get(number, 0) + 1
        tensors = [x.t for x in chosen]
        method = {(True, True): offloader.async_writev, (True, False): offloader.async_write,
                  (False, True): offloader.async_readv, (False, False): offloader.async_read}[writes, vector]
        try:
            handle = method(tensors if vector else tensors[0], callback=callback)
        except RuntimeError:  # a call issued before failed by now: this one is refused, whole
            assert any(x.calls for x in chosen)
            for x in chosen:
                x.settle()
            assert any(x.offloaded == writes for x in chosen)
            self.seen["call refused"] += 1
            return
        self.handles.append(handle)
        for x in chosen:
            x.calls.append(("write" if writes else "read", handle, not vector))
            x.offloaded = writes

    def finish(self):
        _ModelRun.finish_all(self.offloader, [self])
        assert self.seen["edited"] and self.seen["discarded"] and self.seen["call refused"], self.seen

    @staticmethod
    def finish_all(offloader, runs):
        """Faults off; every tensor settled, read back and compared; every
        call's callback counted."""
        offloader.inject_faults()
        for run in runs:
            for x in run.live:
                x.settle()
                if x.offloaded:
                    offloader.sync_read(x.t)
                    x.settle()
                assert not x.offloaded
            for handle in run.handles:  # those of tensors dropped too: each error seen on its handle
                try:
                    handle.wait()
                except (OSError, RuntimeError):
                    pass
        offloader.synchronize()  # nothing left unreported
        for run in runs:
            failed = 0
            for number, handle in enumerate(run.handles):
                failed += handle.exception() is not None
                assert run.callbacks.get(number, 0) == (handle.exception() is None), number
            assert 0 < failed < len(run.handles)
