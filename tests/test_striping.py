"""An Offloader over several directories (one per drive): data spreads over
real, separate file systems, and a full or failing one is named and loses
nothing. The conformance suite also runs on a striped Offloader."""
import errno
import os
import warnings

import pytest
import torch

from offload import Offloader
from conftest import ENGINES, random_tensor, uring_refusal

MIB = 1 << 20


@pytest.fixture(params=ENGINES)
def backend(request):
    if request.param == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    return request.param


def used_bytes(mount) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_each_tensor_is_spread_over_every_file_system(loop_fs, backend):
    disks = [loop_fs(96), loop_fs(96)]
    before = [used_bytes(d) for d in disks]
    tensors = [random_tensor((16 * MIB,), torch.uint8) for _ in range(3)]    # 48 MiB
    expected = [t.clone() for t in tensors]
    with Offloader(disks, backend=backend, chunk_bytes=MIB) as off:
        off.sync_writev(tensors)
        grown = [used_bytes(d) - b for d, b in zip(disks, before)]
        # Each holds its half (1 MiB units in turn), give or take preallocation.
        assert all(20 * MIB <= g <= 40 * MIB for g in grown), grown
        off.sync_readv(tensors)
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
        for t in tensors:                                  # one at a time too
            off.sync_write(t)
            off.sync_read(t)
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    assert [used_bytes(d) for d in disks] == before        # both files removed


def test_a_full_file_system_fails_the_write_naming_it_and_loses_nothing(loop_fs, backend):
    roomy, tiny = loop_fs(96), loop_fs(16)
    kept, failed = [], None
    with Offloader([roomy, tiny], backend=backend, chunk_bytes=MIB) as off:
        for i in range(24):                                # 96 MiB worth; the small one holds < 16
            t = torch.full((MIB,), float(i))               # 4 MiB
            try:
                off.sync_write(t)
            except OSError as error:
                assert error.errno == errno.ENOSPC
                assert str(tiny) in str(error) and str(roomy) not in str(error), str(error)
                failed = t
                break
            kept.append(t)
        assert failed is not None, "the small file system never filled up"
        assert len(kept) >= 2
        assert torch.equal(failed, torch.full((MIB,), float(len(kept))))   # still in memory, intact
        off.sync_readv(kept)
        assert all(torch.equal(t, torch.full((MIB,), float(i))) for i, t in enumerate(kept))
        off.sync_writev(kept[:2])                          # space it had is still usable
        off.sync_readv(kept[:2])
        assert all(torch.equal(t, torch.full((MIB,), float(i))) for i, t in enumerate(kept[:2]))


def test_an_io_error_names_the_directory_it_happened_in(tmp_path, backend):
    directories = [tmp_path / "a", tmp_path / "b"]
    for d in directories:
        d.mkdir()
    t = random_tensor((4 * MIB,), torch.uint8)
    expected = t.clone()
    with Offloader(directories, backend=backend, chunk_bytes=MIB) as off:
        off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
        with pytest.raises(OSError) as raised:
            off.sync_write(t)
        assert raised.value.errno == errno.EIO
        named = [str(d) for d in directories if str(d) in str(raised.value)]
        assert len(named) == 1, str(raised.value)          # one directory, not the whole set
        assert torch.equal(t, expected)                    # a failed write keeps the tensor
        off.inject_faults()
        off.sync_write(t)
        off.sync_read(t)
        assert torch.equal(t, expected)


def test_a_directory_without_o_direct_falls_back_on_its_own(ramfs, tmp_path, backend):
    direct_dir = tmp_path / "direct"
    direct_dir.mkdir()
    tensors = [random_tensor((n,), torch.uint8) for n in (1, 5000, 3 * MIB + 17, 8 * MIB)]
    expected = [t.clone() for t in tensors]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = Offloader([direct_dir, ramfs], backend=backend, chunk_bytes=MIB)
    with off:
        messages = [str(w.message) for w in caught if "O_DIRECT" in str(w.message)]
        assert len(messages) == 1 and str(ramfs) in messages[0], messages
        assert off.direct                                  # O_DIRECT in use, on the other directory
        off.sync_writev(tensors)
        off.sync_readv(tensors)
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


def test_one_directory_in_a_list_is_that_directory_alone(tmp_path):
    with Offloader([tmp_path]) as listed, Offloader(tmp_path) as plain:
        assert listed.path.startswith(str(tmp_path)) and " + " not in listed.path
        assert listed.direct == plain.direct
    with pytest.raises(ValueError, match="at least one directory"):
        Offloader([])
