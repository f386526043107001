"""Sharded checkpoints striped over several directories: offload.save of a
``.index.json`` path with ``stripe=``, and offload.load reading the shards
of different file systems at once. Real loop-mounted file systems, real
files, data compared bit for bit."""
import asyncio
import errno
import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

import offload
from offload import CheckpointError, _checkpoint_writing, checkpoint
from offload.devices import LateCopyDevice

from conftest import same_bits

INDEX = "model.safetensors.index.json"


def state_dict(seed=0, scale=1):
    g = torch.Generator().manual_seed(seed)
    sd = {f"layers.{i}.weight": torch.randn(256 * scale, 64 * (i + 1), generator=g) for i in range(6)}
    sd["embed"] = torch.randn(1000 * scale, 256, generator=g).to(torch.bfloat16)
    sd["steps"] = torch.arange(7, dtype=torch.int64)
    sd["mask"] = torch.rand(4099, generator=g) > 0.5
    return sd


def same(a, b):
    return list(sorted(a)) == list(sorted(b)) and all(same_bits(a[k], b[k]) for k in a)


def shard_files(index_path):
    with open(index_path) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def test_a_striped_save_puts_shards_on_every_file_system_and_loads_bit_identical(loop_fs):
    first, second = loop_fs(64), loop_fs(64)
    sd = state_dict()
    index = os.path.join(first, INDEX)
    offload.save(sd, index, {"format": "pt"}, stripe=[second])

    names = shard_files(index)
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    devices = {os.stat(os.path.join(first, n)).st_dev for n in names}
    assert devices == {os.stat(first).st_dev, os.stat(second).st_dev}
    assert os.path.islink(os.path.join(first, names[1]))  # the index reaches the other drive's shard
    assert os.path.isfile(os.path.join(second, names[1])) and not os.path.islink(os.path.join(second, names[1]))
    sizes = [os.path.getsize(os.path.join(first, n)) for n in names]
    largest = max(t.nbytes for t in sd.values())
    assert abs(sizes[0] - sizes[1]) <= largest  # bytes spread evenly, to a tensor
    with open(index) as f:
        assert json.load(f)["metadata"]["total_size"] == sum(t.nbytes for t in sd.values())

    loaded = offload.load(index)
    assert same(sd, loaded) and loaded.metadata == {"format": "pt"}
    assert same(sd, asyncio.run(offload.load_async(index)))
    # Any loader of Hugging Face's layout finds every shard from the index's directory.
    by_shard = {n: load_file(os.path.join(first, n)) for n in names}
    assert same(sd, {k: v for shard in by_shard.values() for k, v in shard.items()})


def test_shards_on_different_file_systems_load_at_once(loop_fs, monkeypatch):
    first, second = loop_fs(32), loop_fs(32)
    sd = state_dict()
    index = os.path.join(first, INDEX)
    offload.save(sd, index, stripe=[second])
    both_loading = threading.Barrier(2, timeout=20)  # broken unless the two loads overlap
    real = checkpoint.load_file

    def load_file_meeting_the_other(*args, **kwargs):
        both_loading.wait()
        return real(*args, **kwargs)
    monkeypatch.setattr(checkpoint, "load_file", load_file_meeting_the_other)
    assert same(sd, offload.load(index))

    events = []
    real_loader = checkpoint.Loader

    class Loader(real_loader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            events.append("open")

        def close(self):
            if self.engine is not None:  # (a second close does nothing)
                events.append("close")
            super().close()
    monkeypatch.setattr(checkpoint, "Loader", Loader)
    assert same(sd, asyncio.run(offload.load_async(index)))
    assert events == ["open", "open", "close", "close"]  # both shards in flight together


def test_the_device_pipeline_saves_and_loads_a_striped_checkpoint_on_the_late_copy_device(loop_fs):
    # Two drives: two loads through one test device at once, on two threads,
    # its copies finishing late and out of order.
    first, second = loop_fs(64), loop_fs(64)
    sd = state_dict(scale=8)
    index = os.path.join(first, INDEX)
    offload.save(sd, index, stripe=[second], device=LateCopyDevice(seed=1, max_delay=0.003))
    assert same(sd, offload.load(index))
    assert same(sd, offload.load(index, device=LateCopyDevice(seed=2, max_delay=0.003)))
    assert same(sd, asyncio.run(offload.load_async(index, device=LateCopyDevice(seed=3, max_delay=0.003))))


def test_resaving_replaces_the_checkpoint_and_removes_its_old_shards(loop_fs, tmp_path):
    first, second = loop_fs(64), loop_fs(64)
    index = os.path.join(first, INDEX)
    stray = os.path.join(second, "notes.txt")
    with open(stray, "w") as f:
        f.write("not ours")
    old, new = state_dict(seed=1), state_dict(seed=2)
    offload.save(old, index, stripe=[second])
    offload.save(new, index, stripe=[second], max_shard_bytes=512 << 10)
    names = shard_files(index)
    assert len(names) > 2 and len(names) % 2 == 0
    assert same(new, offload.load(index))
    assert sorted(os.listdir(first)) == sorted(names + [INDEX, "lost+found"])
    assert sorted(os.listdir(second)) == sorted(names[1::2] + ["notes.txt", "lost+found"])

    # Saving again with the same shard count: names that exist already are not reused.
    offload.save(old, index, stripe=[second], max_shard_bytes=512 << 10)
    again = shard_files(index)
    assert not set(again) & set(names) and all("-2.safetensors" in n for n in again)
    assert same(old, offload.load(index))
    assert sorted(os.listdir(first)) == sorted(again + [INDEX, "lost+found"])
    with open(stray) as f:
        assert f.read() == "not ours"


def an_old_checkpoint(loop_fs, first_mib=64, second_mib=64):
    """A checkpoint striped over two new file systems: (first, second, index, its state dict)."""
    first, second = loop_fs(first_mib), loop_fs(second_mib)
    index = os.path.join(first, INDEX)
    old = state_dict(seed=1)
    offload.save(old, index, stripe=[second])
    return first, second, index, old


def listing(*directories):
    return [sorted(os.listdir(d)) for d in directories]


def test_a_failure_before_the_index_is_replaced_keeps_the_old_checkpoint(loop_fs, monkeypatch):
    first, second, index, old = an_old_checkpoint(loop_fs)
    before = listing(first, second)

    def fail(*args):
        raise OSError(errno.EIO, "injected: the index could not be written")
    monkeypatch.setattr(offload._sharding, "write_index", fail)
    with pytest.raises(OSError, match="injected"):
        offload.save(state_dict(seed=2), index, stripe=[second])
    # Every new shard (and its link) is gone; the old checkpoint is whole.
    assert listing(first, second) == before
    assert same(old, offload.load(index))


def test_a_full_file_system_among_the_directories_fails_naming_it_and_keeps_the_old_checkpoint(loop_fs):
    roomy, full, index, old = an_old_checkpoint(loop_fs, 128, 16)
    before = listing(roomy, full)
    too_big = state_dict(seed=2, scale=16)  # ~40 MiB: half of it does not fit 16 MiB
    with pytest.raises(OSError) as raised:
        offload.save(too_big, index, stripe=[full])
    assert raised.value.errno == errno.ENOSPC and str(full) in str(raised.value)
    assert listing(roomy, full) == before
    assert same(old, offload.load(index))


def test_an_io_error_fails_the_save_naming_the_shard_and_keeps_the_old_checkpoint(loop_fs, monkeypatch):
    first, second, index, old = an_old_checkpoint(loop_fs)
    before = listing(first, second)
    real = _checkpoint_writing.open_engine

    def failing_engine(*args):
        engine = real(*args)
        engine.set_faults(1.0, [errno.EIO], 0.0, 0.0, 0, 7)  # every write fails
        return engine
    monkeypatch.setattr(_checkpoint_writing, "open_engine", failing_engine)
    with pytest.raises(OSError) as raised:
        offload.save(state_dict(seed=2, scale=4), index, stripe=[second])
    monkeypatch.undo()
    assert raised.value.errno == errno.EIO
    failed = raised.value.filename
    # One of the new shards (the old ones hold the plain names), in its own directory.
    assert os.path.dirname(failed) in (str(first), str(second)) and failed.endswith("-of-00002-2.safetensors")
    assert listing(first, second) == before
    assert same(old, offload.load(index))


def test_a_directory_that_refuses_o_direct_gets_its_own_fallback_and_a_warning(tmp_path, ramfs):
    sd = state_dict()
    index = os.path.join(tmp_path, INDEX)
    with pytest.warns(RuntimeWarning, match=f"{ramfs}.*refuses O_DIRECT") as caught:
        offload.save(sd, index, stripe=[ramfs])
    assert len([w for w in caught if "O_DIRECT" in str(w.message)]) == 1  # not for the directory that takes it
    assert sorted(os.listdir(ramfs)) == ["model-00002-of-00002.safetensors"]
    assert same(sd, offload.load(index))


def test_max_shard_bytes_in_one_directory_makes_even_shards(tmp_path):
    sd = {f"t{i}": torch.full((1 << 16,), float(i)) for i in range(10)}  # 256 KiB each
    index = os.path.join(tmp_path, INDEX)
    offload.save(sd, index, max_shard_bytes=1 << 20)
    names = shard_files(index)
    assert len(names) == 3 and not any(os.path.islink(os.path.join(tmp_path, n)) for n in names)
    counts = sorted(len(load_file(os.path.join(tmp_path, n))) for n in names)
    assert counts == [3, 3, 4]
    assert same(sd, offload.load(index))


def test_tensors_of_uneven_sizes_go_largest_first_so_the_shards_hold_equal_bytes(tmp_path):
    """Four 1 MiB tensors that come before one of 4 MiB in the file's order
    (by name), two shards: placed in that order, the fewest-bytes rule would
    leave 6 MiB beside 2; largest first, each shard holds 4 MiB."""
    sd = {f"a{i}": torch.full((1 << 18,), float(i)) for i in range(4)}   # 1 MiB each
    sd["b"] = torch.full((1 << 20,), 9.0)                                # 4 MiB
    index = os.path.join(tmp_path, INDEX)
    os.mkdir(tmp_path / "other")
    offload.save(sd, index, stripe=[tmp_path / "other"])
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    shards = {}
    for name in sorted(sd):
        shards.setdefault(weight_map[name], []).append(name)
    assert sorted(shards.values()) == [["a0", "a1", "a2", "a3"], ["b"]]
    assert same(sd, offload.load(index))


def test_an_empty_state_dict_saves_an_index_that_lists_nothing(tmp_path):
    index = os.path.join(tmp_path, INDEX)
    os.mkdir(tmp_path / "other")
    offload.save({}, index, stripe=[tmp_path / "other"])
    assert shard_files(index) == [] and sorted(os.listdir(tmp_path)) == [INDEX, "other"]
    assert offload.load(index) == {} and asyncio.run(offload.load_async(index)) == {}


def test_a_sharded_save_is_asked_for_by_its_index_path(tmp_path):
    sd = state_dict()
    with pytest.raises(ValueError, match="index.json"):
        offload.save(sd, os.path.join(tmp_path, "model.safetensors"), stripe=[tmp_path])
    with pytest.raises(ValueError, match="listed twice"):
        offload.save(sd, os.path.join(tmp_path, INDEX), stripe=[tmp_path])
    with pytest.raises(ValueError, match="list of directories"):
        offload.save(sd, os.path.join(tmp_path, INDEX), stripe=str(tmp_path / "x"))
    with pytest.raises(CheckpointError, match="no such directory"):
        offload.save(sd, os.path.join(tmp_path, INDEX), stripe=[tmp_path / "missing"])
    assert os.listdir(tmp_path) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shards_loaded_to_cuda_on_other_threads_use_the_callers_stream(loop_fs, monkeypatch):
    first, second = loop_fs(64), loop_fs(64)
    sd = state_dict()
    index = os.path.join(first, INDEX)
    offload.save(sd, index, stripe=[second])
    streams = []
    real = checkpoint.load_file

    def load_file_noting_the_stream(*args, **kwargs):
        streams.append(torch.cuda.current_stream())
        return real(*args, **kwargs)
    monkeypatch.setattr(checkpoint, "load_file", load_file_noting_the_stream)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        loaded = offload.load(index, device="cuda")
        cpu = {k: v.cpu() for k, v in loaded.items()}  # on the side stream: after the copies
    assert len(streams) == 2 and all(s == side for s in streams)
    assert same(sd, cpu)
