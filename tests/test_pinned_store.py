"""Offloader(None): device tensors in page-locked CPU memory, no disk, proven on
the CPU with the late-copy test device (and on CUDA where there is one)."""
import asyncio
import sys
import textwrap

import pytest
import torch

from offload import Offloader
from offload.devices import LateCopyDevice
from conftest import run_python
from conftest import (AUTOGRAD_ROUND_TRIPS, assert_no_change_to_autograd,
                      assert_the_base_goes_and_returns_with_its_view, random_tensor, same_bits)


def test_round_trip_releases_and_restores_device_memory():
    t = torch.randn(1 << 20)
    expected = t.clone()
    with Offloader(None, device=LateCopyDevice(seed=1)) as store:
        assert store.backend == "pinned" and store.direct is False
        store.sync_write(t)
        assert t.untyped_storage().nbytes() == 0
        store.sync_read(t)
        assert torch.equal(t, expected)


def test_a_tensor_grown_between_round_trips_gets_a_host_buffer_of_its_new_size():
    """Each tensor keeps its host buffer; one given a larger storage between
    round trips needs a larger one, or its copy would run over its
    neighbours' (a small buffer is carved from a slab shared with others)."""
    with Offloader(None, device=LateCopyDevice(seed=2)) as store:
        t, neighbour = torch.randn(1 << 10), torch.randn(1 << 10)
        expected_neighbour = neighbour.clone()
        store.sync_writev([t, neighbour])
        store.sync_readv([t, neighbour])
        t.data = torch.randn(1 << 18)
        expected = t.clone()
        store.sync_writev([t, neighbour])
        store.sync_readv([t, neighbour])
        assert torch.equal(t, expected) and torch.equal(neighbour, expected_neighbour)


@pytest.mark.parametrize("round_trip", [name for name in AUTOGRAD_ROUND_TRIPS if name != "discarded"], ids=str)
def test_a_round_trip_is_no_change_to_autograd(round_trip):
    """As in the Offloader's conformance suite: version counters and the
    gradient accumulator survive the trip (discard is not offered here)."""
    with Offloader(None, device=LateCopyDevice(seed=8)) as store:
        assert_no_change_to_autograd(store, round_trip, 1 << 16)


@pytest.mark.parametrize("round_trip", [name for name in AUTOGRAD_ROUND_TRIPS if name != "discarded"], ids=str)
def test_a_view_takes_its_base_along(round_trip):
    """As in the Offloader's conformance suite: the base of a view goes and
    comes back with it."""
    with Offloader(None, device=LateCopyDevice(seed=10)) as store:
        assert_the_base_goes_and_returns_with_its_view(store, round_trip, 1 << 16)


def test_stress_with_random_delays_callbacks_and_ordering():
    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    tensors = [random_tensor((int(torch.randint(0, 100_000, (1,), generator=gen)),), dtypes[i % 4], gen)
               for i in range(100)]
    expected = [t.clone() for t in tensors]
    calls = []
    with Offloader(None, device=LateCopyDevice(seed=4, max_delay=0.0005)) as store:
        for round_ in range(5):
            for i, t in enumerate(tensors):
                store.async_write(t, callback=lambda i=i: calls.append(i))
                store.async_read(t)          # queued behind its write
            store.synchronize()
            assert all(same_bits(a, b) for a, b in zip(tensors, expected))
    assert sorted(calls) == sorted(list(range(100)) * 5)


def test_await_and_vector_forms():
    ts = [torch.randn(10_000) for _ in range(20)]
    expected = [t.clone() for t in ts]
    with Offloader(None, device=LateCopyDevice(seed=5)) as store:
        async def main():
            await store.write(ts)
            await store.read(ts)
        asyncio.run(main())
        store.sync_writev(ts)
        store.sync_readv(ts)
    assert all(torch.equal(a, b) for a, b in zip(ts, expected))


def test_fault_injection_is_refused_where_there_is_no_io():
    """Its operations never reach a disk: injected faults would fail nothing,
    and a test of error handling would pass on nothing."""
    with Offloader(None, device=LateCopyDevice(seed=6)) as store:
        with pytest.raises(NotImplementedError, match="no I/O"):
            store.inject_faults(error_rate=1.0, errnos=[5])
        with pytest.raises(NotImplementedError):
            store.inject_faults(delay_rate=1.0, delay_ms=10)
        store.inject_faults()  # nothing to inject: allowed
        assert store.faults_injected == 0


def test_cpu_tensors_without_a_device_are_refused():
    with Offloader(None) as store:
        with pytest.raises(ValueError, match="CPU already"):
            store.async_write(torch.randn(3))


PLANTED = textwrap.dedent("""
    import sys, torch
    from offload import Offloader
    from offload.devices import LateCopyDevice
    device = LateCopyDevice(seed=1, max_delay=0.001, skip=sys.argv[1], lazy=True)
    tensors = [torch.randn(30_000) for _ in range(10)]
    expected = [t.clone() for t in tensors]
    with Offloader(None, device=device) as store:
        store.sync_writev(tensors)
        store.sync_readv(tensors)
        ok = all(torch.equal(a, b) for a, b in zip(tensors, expected))
    print("intact" if ok else "corrupted")
""")


@pytest.mark.parametrize("bug", ["", "wait_before_release", "order_before_caller"])
def test_planted_bugs_are_caught(bug):
    result = run_python([sys.executable, "-c", PLANTED, bug], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("intact" if bug == "" else "corrupted")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_activation_offloading():
    activation = torch.randn(4096, 4096, device="cuda")
    expected = activation.clone()
    with Offloader(None) as store:
        store.async_write(activation)
        y = torch.randn(4096, 4096, device="cuda") @ torch.randn(4096, 4096, device="cuda")
        store.synchronize()
        assert activation.untyped_storage().nbytes() == 0
        store.sync_read(activation)
        assert torch.equal(activation, expected) and torch.isfinite(y).all()
