"""Offloader behaviour beyond the conformance suite: threads and the GIL."""
import threading
import time

import pytest
import torch

from offload import Offloader
from conftest import OtherThreadTicks


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
def test_several_python_threads_share_one_offloader(tmp_path, backend):
    from conftest import uring_refusal
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    errors = []

    with Offloader(tmp_path, backend=backend) as off:
        def worker(seed):
            try:
                g = torch.Generator().manual_seed(seed)
                tensors = [torch.randn(int(torch.randint(1, 100_000, (1,), generator=g)), generator=g)
                           for _ in range(10)]
                expected = [t.clone() for t in tensors]
                for _ in range(20):
                    off.sync_writev(tensors)
                    off.sync_readv(tensors)
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
