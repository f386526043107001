"""Written tensors' memory given back off the caller's path (_releaser.py):
which storages go to the helper thread, that the caller never waits for
it, and that the data written is the data read back."""
import os

import pytest
import torch

from offload import Offloader, _core, _releaser
from conftest import random_tensor, same_bits

LARGE = 40 << 20  # bytes: above _releaser.MIN_BYTES
pytestmark = pytest.mark.skipif(not hasattr(torch.UntypedStorage, "resizable"),
                                reason="torch without UntypedStorage.resizable(): writes snapshot a CPU tensor's "
                                       "bytes and free its storage as it is (_tensors.resizable)")


def large_tensor():
    """Random float32 bits in a storage of their own (random_tensor's is a
    view of a uint8 tensor, whose base holds the storage too)."""
    return random_tensor((LARGE // 4,), torch.float32).clone()


@pytest.fixture
def discards(monkeypatch):
    """(address, length) of every discard_pages call, made as it would be."""
    calls, real = [], _core.discard_pages

    def recorded(address, length):
        calls.append((address, length))
        return real(address, length)

    monkeypatch.setattr(_core, "discard_pages", recorded)
    _releaser.wait_released()
    return calls


def test_a_large_written_tensor_is_given_back_on_the_helper_thread(tmp_path, discards):
    t = large_tensor()
    expected, address, done = t.clone(), t.data_ptr(), []
    before = _releaser.released_bytes()
    with Offloader(tmp_path) as off:
        off.async_write(t, callback=lambda: done.append(True))
        off.synchronize()
        assert done and t.untyped_storage().nbytes() == 0
        _releaser.wait_released()
        # The tensor's own memory, every whole page of it.
        assert discards == [(address, LARGE)]
        assert _releaser.released_bytes() - before >= LARGE - 8192
        off.sync_read(t)
        assert same_bits(t, expected)


def test_small_tensors_are_freed_inline_and_a_view_takes_its_base_along_to_the_helper(tmp_path, discards):
    small = random_tensor((1 << 18,), torch.float32)  # 1 MiB: below MIN_BYTES
    base = large_tensor()
    view = base.view(-1, 1024)  # the whole storage, which its base holds too
    address = base.data_ptr()
    with Offloader(tmp_path) as off:
        off.sync_write(small)
        off.sync_write(view)
        # The base went with the view (it sees no memory at once), so nothing
        # else holds the storage written: the helper gives it back.
        assert base.untyped_storage().nbytes() == 0
        _releaser.wait_released()
        assert discards == [(address, LARGE)]


def test_the_caller_never_waits_for_the_helper_and_what_waits_is_bounded(tmp_path, discards, monkeypatch):
    """With the helper thread held, writes still complete and synchronize()
    returns; past MAX_PENDING bytes waiting, storages are freed inline."""
    monkeypatch.setattr(_releaser, "MAX_PENDING", 2 * LARGE)
    tensors = [large_tensor() for _ in range(4)]
    expected = [t.clone() for t in tensors]
    releaser = _releaser._releaser
    with Offloader(tmp_path) as off:
        with releaser.in_hand:  # the helper cannot take anything off its queue
            for t in tensors:
                off.sync_write(t)
            assert discards == [] and releaser._pending == 2 * LARGE
        _releaser.wait_released()
        assert len(discards) == 2 and releaser._pending == 0
        off.sync_readv(tensors)
    assert all(same_bits(a, b) for a, b in zip(tensors, expected))


def test_a_fork_waits_for_the_storage_in_hand_and_the_child_starts_afresh(tmp_path):
    t = large_tensor()
    with Offloader(tmp_path) as off:
        off.sync_write(t)
        pid = os.fork()
        if pid == 0:  # the child: its own releaser, which works
            code = 1
            try:
                child = _releaser._releaser
                if child._thread is None and not child._queue:
                    _releaser.release(torch.empty(LARGE // 4).untyped_storage())
                    _releaser.wait_released()
                    code = 0 if child._pending == 0 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        _releaser.wait_released()
        off.sync_read(t)


def test_stop_frees_what_is_left_on_the_calling_thread():
    releaser = _releaser._Releaser()
    storages = [torch.empty(LARGE // 4).untyped_storage() for _ in range(2)]
    with releaser.in_hand:  # the helper cannot take anything
        for s in storages:
            releaser.release(s, None)
        assert len(releaser._queue) == 2
        releaser.stop()
        assert all(s.nbytes() == 0 for s in storages) and releaser.released == 0
    releaser._thread.join(timeout=10)
    assert not releaser._thread.is_alive()


def test_pinned_memory_is_freed_inline(tmp_path, discards, monkeypatch):
    """Pinned memory goes back to torch's host cache, pages and all (a device
    may DMA from them): never to the helper thread."""
    monkeypatch.setattr(_releaser, "_pinned", lambda storage: True)
    with Offloader(tmp_path) as off:
        off.sync_write(large_tensor())
    _releaser.wait_released()
    assert discards == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pinned_cuda_host_tensor_is_written_read_and_freed_inline(tmp_path, discards):
    torch.cuda.init()
    t = large_tensor().pin_memory()
    expected = t.clone()
    assert _releaser._pinned(t.untyped_storage())
    with Offloader(tmp_path) as off:
        off.sync_write(t)
        _releaser.wait_released()
        assert discards == []
        off.sync_read(t)
    assert same_bits(t, expected)


def test_discard_pages_gives_back_only_the_pages_wholly_inside_the_range():
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 6 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\xab" * (6 * page))
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    # From 100 bytes into page 1 to 100 bytes into page 4: pages 2 and 3 only.
    assert _core.discard_pages(address + page + 100, 3 * page) == 2 * page
    data = bytes(region)
    assert data[:2 * page] == b"\xab" * (2 * page)
    assert data[2 * page:4 * page] == bytes(2 * page)
    assert data[4 * page:] == b"\xab" * (2 * page)
    assert _core.discard_pages(address + 1, page) == 0  # no whole page inside
    assert bytes(region)[:page] == b"\xab" * page
    del data
    region.close()
