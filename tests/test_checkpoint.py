"""offload.save / load / load_async: safetensors files through the engine."""
import asyncio
import errno
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import warnings

import pytest
import torch

import offload
from conftest import LoopTicks, random_tensor, same_bits
from offload import CheckpointError
from offload._safetensors import DTYPES
from offload.devices import LateCopyDevice

safetensors_torch = pytest.importorskip("safetensors.torch")

ALL_DTYPES = sorted(set(DTYPES.values()), key=str)


def mixed_state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {f"t.{dtype}".replace("torch.", ""): random_tensor((7, 13), dtype, g) for dtype in ALL_DTYPES}
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.empty(0, 3)
    sd["transposed"] = torch.randn(64, 32, generator=g).t()
    sd["big"] = random_tensor((9 << 20,), torch.uint8, g)            # spans several 8 MiB chunks
    sd["odd"] = random_tensor((12345,), torch.int16, g)
    return sd


def assert_same(loaded, expected):
    assert list(sorted(loaded)) == list(sorted(expected))
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert same_bits(loaded[name].contiguous(), t.contiguous()), name


@pytest.mark.parametrize("backend", ["uring", "threads"])
@pytest.mark.parametrize("direct", [True, False])
def test_every_dtype_round_trips_bit_for_bit(tmp_path, backend, direct):
    from conftest import uring_refusal
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    sd = mixed_state_dict()
    path = tmp_path / "model.safetensors"
    offload.save(sd, path, {"step": "7"}, backend=backend, direct=direct)
    loaded = offload.load(path, backend=backend, direct=direct)
    assert_same(loaded, sd)
    assert loaded.metadata == {"step": "7"}


@pytest.fixture
def core_copies(monkeypatch):
    """The lengths of the copies made through the core's memcpy, in order."""
    from offload import _core, _tensors
    lengths = []
    real = _core.copy_memory
    monkeypatch.setattr(_tensors._core, "copy_memory", lambda dst, src, n: (lengths.append(n), real(dst, src, n)))
    return lengths


def test_a_save_copies_cpu_tensors_on_its_own_thread_bit_for_bit(tmp_path, core_copies):
    """CPU tensors reach the staging slots through the core's memcpy (one
    thread, no GIL), not torch's copy_, which takes every core; the strided
    and empty tensors among them still come back bit for bit."""
    sd = mixed_state_dict()
    offload.save(sd, tmp_path / "m.safetensors")
    payload = sum(t.numel() * t.element_size() for t in sd.values())
    assert sum(core_copies) == payload
    assert_same(offload.load(tmp_path / "m.safetensors"), sd)


def test_copy_bytes_takes_the_core_copy_only_where_it_is_plain_memcpy(core_copies):
    from offload import _tensors
    g = torch.Generator().manual_seed(1)
    src = random_tensor((3 << 20,), torch.uint8, g)
    dst = torch.zeros_like(src)
    _tensors.copy_bytes(dst[1:], src[:-1])               # contiguous, unaligned: memcpy
    assert core_copies == [src.numel() - 1] and same_bits(dst[1:], src[:-1]) and int(dst[0]) == 0
    strided = torch.zeros(64, 32, dtype=torch.float32)
    source = torch.randn(32, 64, generator=g)
    _tensors.copy_bytes(strided.t(), source)               # strided: copy_ does it
    _tensors.copy_bytes(torch.zeros(5, dtype=torch.float64), torch.arange(5.0))   # dtypes differ
    _tensors.copy_bytes(torch.empty(0), torch.empty(0))
    assert len(core_copies) == 1
    assert same_bits(strided.t(), source)


def test_device_paths_through_late_copies(tmp_path):
    """Save from and load to a "device" whose copies land late on another
    thread: a staging slot reused early or a chunk written before its copy
    finished would corrupt bytes."""
    sd = mixed_state_dict(1)
    path = tmp_path / "gpu.safetensors"
    offload.save(sd, path, device=LateCopyDevice(seed=1, max_delay=0.003))
    assert_same(safetensors_torch.load_file(str(path)), sd)
    loaded = offload.load(path, device=LateCopyDevice(seed=2, max_delay=0.003))
    assert_same(loaded, sd)


@pytest.mark.parametrize("bug", ["", "wait_before_write"])
def test_a_save_that_writes_a_chunk_before_its_copy_is_caught(tmp_path, bug):
    """The device test above can fail: with the wait for a chunk's copy left
    out of the staging pipeline, lazy copies have not happened when the disk
    takes the bytes."""
    sd = {"w": random_tensor((3 << 20,), torch.uint8)}
    path = tmp_path / "m.safetensors"
    offload.save(sd, path, device=LateCopyDevice(lazy=True, skip=bug))
    assert same_bits(safetensors_torch.load_file(str(path))["w"], sd["w"]) == (bug == "")


@pytest.mark.parametrize("bug", ["", "wait_before_reuse"])
def test_a_load_that_reuses_a_slot_before_its_copy_is_caught(tmp_path, bug):
    """More chunks than staging slots: with the wait before reusing a slot left
    out, the disk overwrites a chunk that lazy copies have not taken yet."""
    sd = {"w": random_tensor((150 << 20,), torch.uint8)}  # 19 chunks of 8 MiB, 16 slots
    path = tmp_path / "m.safetensors"
    offload.save(sd, path)
    loaded = offload.load(path, device=LateCopyDevice(lazy=True, skip=bug))
    assert same_bits(loaded["w"], sd["w"]) == (bug == "")


def test_interop_with_the_safetensors_package_both_ways(tmp_path):
    sd = {k: v.contiguous() for k, v in mixed_state_dict(2).items()}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    offload.save(sd, ours, {"format": "pt", "note": "ünïcode"})
    from safetensors import safe_open
    with safe_open(str(ours), "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ünïcode"}
    assert_same(safetensors_torch.load_file(str(ours)), sd)
    safetensors_torch.save_file(sd, str(theirs), {"format": "pt"})
    loaded = offload.load(theirs)
    assert_same(loaded, sd)
    assert loaded.metadata == {"format": "pt"}


def test_lazy_conjugates_and_negations_are_stored_as_their_values(tmp_path):
    """``x.conj()`` and negative views keep a flag, not their values, in
    memory, and safetensors has no such flag: their values are stored (the
    safetensors package stores the raw bytes, silently giving back the
    conjugate)."""
    g = torch.Generator().manual_seed(3)
    sd = {"conj": torch.randn(300, dtype=torch.complex64, generator=g).conj(),
          "neg": torch._neg_view(torch.randn(200, 3, dtype=torch.float64, generator=g)),
          "plain": torch.randn(100, generator=g)}
    assert sd["conj"].is_conj() and sd["neg"].is_neg()
    path = tmp_path / "lazy.safetensors"
    offload.save(sd, path)
    for loaded in (offload.load(path), safetensors_torch.load_file(str(path))):
        for name, t in sd.items():
            assert not loaded[name].is_conj() and not loaded[name].is_neg()
            assert torch.equal(loaded[name], t.resolve_conj().resolve_neg()), name


def test_one_element_views_with_any_strides_are_saved(tmp_path):
    """``x[::2]`` of two elements is one element with stride 2, which torch
    calls contiguous and reshape(-1) keeps: the save took its bytes through
    view(torch.uint8), which refuses that stride. Found by a random test."""
    sd = {"one": torch.tensor([7, 8], dtype=torch.int64)[::2],
          "corner": torch.arange(12.0).view(3, 4)[2:, 3:], "scalar": torch.tensor(2.5)}
    assert sd["one"].stride() == (2,) and sd["one"].is_contiguous()
    path = tmp_path / "one.safetensors"
    offload.save(sd, path)
    for loaded in (offload.load(path), safetensors_torch.load_file(str(path))):
        for name, t in sd.items():
            assert loaded[name].shape == t.shape and torch.equal(loaded[name], t), name


def test_loaded_tensors_share_buffers_so_the_offloader_asks_for_a_clone(tmp_path):
    """offload.load's CPU tensors view buffers they share with their
    neighbours in the file, which a write could not free: the Offloader
    refuses one with a message that says so, and takes its clone."""
    sd = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    offload.save(sd, tmp_path / "m.safetensors")
    loaded = offload.load(tmp_path / "m.safetensors")
    with offload.Offloader(tmp_path) as off:
        with pytest.raises(ValueError, match="offload.load share a buffer"):
            off.sync_write(loaded["w2"])
        assert torch.equal(loaded["w2"], sd["w2"])
        own = loaded["w2"].clone()
        off.sync_write(own)
        off.sync_read(own)
        assert torch.equal(own, sd["w2"])


def write_raw(path, entries, metadata=None, tail=b""):
    """A safetensors file laid out exactly as given: entries are
    (name, tensor) in file order, with no regard for alignment."""
    header, data, offset = {}, b"", 0
    if metadata:
        header["__metadata__"] = metadata
    codes = {v: k for k, v in DTYPES.items()}
    for name, t in entries:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data + tail)


def test_tensors_at_offsets_unaligned_for_their_dtype_load_correctly(tmp_path):
    entries = [("a", torch.arange(3, dtype=torch.uint8)), ("b", torch.randn(1000)),
               ("c", torch.arange(7, dtype=torch.int8)), ("d", torch.randn(50, dtype=torch.float64)),
               ("e", torch.randn(5000))]
    path = tmp_path / "unaligned.safetensors"
    write_raw(path, entries)
    loaded = offload.load(path)
    for name, t in entries:
        assert same_bits(loaded[name], t), name
    assert list(loaded) == [name for name, _ in entries]


def test_sharded_index_loads_like_hugging_face_writes_it(tmp_path):
    sd = {f"layer{i}.weight": torch.randn(100, 10 + i) for i in range(6)}
    shards = {"model-00001-of-00002.safetensors": list(sd)[:3],
              "model-00002-of-00002.safetensors": list(sd)[3:]}
    for shard, names in shards.items():
        safetensors_torch.save_file({n: sd[n] for n in names}, str(tmp_path / shard))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1},
                                 "weight_map": {n: s for s, names in shards.items() for n in names}}))
    assert_same(offload.load(index), sd)
    assert_same(asyncio.run(offload.load_async(index)), sd)
    # An index naming a tensor its shard lacks, or a shard outside the directory, is refused.
    index.write_text(json.dumps({"weight_map": {"missing": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="'missing' listed in the index"):
        offload.load(index)
    index.write_text(json.dumps({"weight_map": {"x": "../model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="file names"):
        offload.load(index)


@pytest.mark.asyncio
async def test_load_async_lets_the_event_loop_run(tmp_path, monkeypatch):
    from offload import _checkpoint_reading as engines_of
    sd = {"w": torch.randn(4 << 20), "b": torch.randn(1000)}
    path = tmp_path / "w.safetensors"
    offload.save(sd, path)
    real = engines_of.open_engine

    def slow_engine(*args):  # every completion arrives 50 ms late: the loop must run meanwhile
        engine = real(*args)
        engine.set_faults(0.0, [], 0.0, 1.0, 50, 1)
        return engine

    monkeypatch.setattr(engines_of, "open_engine", slow_engine)
    async with LoopTicks() as ticks:
        loaded = await offload.load_async(path)
    assert_same(loaded, sd)
    assert ticks.count > 10


def test_save_replaces_atomically_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    offload.save({"v": torch.zeros(10)}, path)
    offload.save({"v": torch.ones(10)}, path)
    assert torch.equal(offload.load(path)["v"], torch.ones(10))
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_what_save_refuses(tmp_path):
    path = tmp_path / "x.safetensors"
    w = torch.randn(10, 10)
    with pytest.raises(ValueError, match="share memory"):
        offload.save({"embed": w, "head": w}, path)           # tied weights
    with pytest.raises(ValueError, match="share memory"):
        offload.save({"a": w[:5], "b": w[3:]}, path)           # overlapping views
    offload.save({"a": w[:5], "b": w[5:]}, path)               # disjoint views are fine
    assert torch.equal(offload.load(path)["b"], w[5:])
    with pytest.raises(TypeError):
        offload.save({1: w}, path)
    with pytest.raises(TypeError):
        offload.save([w], path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the PyTorch API of nested tensors is in prototype stage"
        nested = torch.nested.as_nested_tensor([torch.randn(3), torch.randn(5)])
    with pytest.raises(ValueError, match="nested"):
        offload.save({"nested": nested}, path)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(10)
    with pytest.raises(ValueError, match="FakeTensor"):
        offload.save({"fake": fake}, path)
    with offload.Offloader(tmp_path) as off:
        gone = torch.randn(10)
        off.sync_write(gone)
        with pytest.raises(ValueError, match="released"):
            offload.save({"gone": gone}, path)
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]


def test_progress_bar_when_asked(tmp_path, capsys):
    path = tmp_path / "p.safetensors"
    offload.save({"w": torch.randn(1 << 20)}, path, progress=True)
    offload.load(path, progress=True)
    err = capsys.readouterr().err
    assert "saving p.safetensors" in err and "loading p.safetensors" in err
    offload.save({"w": torch.randn(10)}, path)  # stderr is not a terminal here: no bar
    assert capsys.readouterr().err == ""


_KILLED_SAVER = """
import sys, torch, offload
v = torch.full((%d,), 2.0)
print("saving", flush=True)
offload.save({"v": v}, sys.argv[1])
print("saved", flush=True)
"""


def test_sigkill_in_the_middle_of_save_keeps_the_previous_file(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    offload.save({"v": torch.ones(1000)}, path)
    n = 192 << 20  # 768 MiB of float32: the save takes a while
    interrupted = 0
    for delay in (0.02, 0.1, 0.2):
        child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVER % n, str(path)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "saving\n"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate()
        loaded = offload.load(path)  # whatever moment it died, a whole file is there
        if loaded["v"].numel() == 1000:
            assert torch.equal(loaded["v"], torch.ones(1000))
            interrupted += "saved" not in rest
        else:
            assert loaded["v"].numel() == n and bool((loaded["v"] == 2.0).all())
    assert interrupted >= 1, "no kill landed inside save(): the test proved nothing"
    assert [name for name in os.listdir(tmp_path) if name != "ckpt.safetensors"] == []


STALLED = os.path.join(os.path.dirname(__file__), "helpers", "stalled_engine.py")


def interrupted_twice(operation, path, backend):
    """Runs ``operation`` on an engine that never finishes a request, in a
    process of its own, with two SIGINTs; checks it ended within seconds,
    its engine given up with one warning."""
    out = subprocess.run([sys.executable, STALLED, operation, str(path), backend], capture_output=True,
                         text=True, timeout=60).stdout.split()
    assert out[0] == "interrupted" and float(out[1]) < 10 and out[2:] == ["1", "1"], out


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_save_whose_writes_never_complete_can_be_interrupted_and_keeps_the_previous_file(tmp_path, backend):
    """A save's engine that cannot drain (a drive that never answers): two
    Ctrl-Cs end it within seconds (the engine given up, one warning), and
    the old file is the one there. Before, the second wait ignored signals."""
    from conftest import uring_refusal
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    path = tmp_path / "ckpt.safetensors"
    offload.save({"v": torch.ones(1000)}, path)
    interrupted_twice("save", path, backend)
    assert torch.equal(offload.load(path)["v"], torch.ones(1000))
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_a_load_whose_reads_never_complete_can_be_interrupted(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    offload.save({"v": torch.ones(4 << 20)}, path)
    interrupted_twice("load", path, "auto")


def test_enospc_during_save_keeps_the_old_file(tiny_fs):
    path = tiny_fs / "ckpt.safetensors"
    offload.save({"v": torch.ones(1000)}, path)
    with pytest.raises(OSError) as raised:
        offload.save({"v": torch.randn(8 << 20)}, path)  # 32 MiB on a 16 MiB file system
    assert raised.value.errno == errno.ENOSPC
    assert torch.equal(offload.load(path)["v"], torch.ones(1000))
    assert os.listdir(tiny_fs) == ["ckpt.safetensors", "lost+found"] or \
        sorted(os.listdir(tiny_fs)) == ["ckpt.safetensors", "lost+found"]


@pytest.mark.parametrize("rate", [1.0, 0.2])
def test_a_failed_write_fails_the_save_and_keeps_the_old_file(tmp_path, monkeypatch, rate):
    from offload import _checkpoint_writing as engines_of
    path = tmp_path / "ckpt.safetensors"
    offload.save({"v": torch.ones(1000)}, path)
    real = engines_of.open_engine

    def failing_engine(*args):
        engine = real(*args)
        engine.set_faults(rate, [errno.EIO], 0.0, 0.0, 0, 7)
        return engine

    monkeypatch.setattr(engines_of, "open_engine", failing_engine)
    with pytest.raises(OSError) as raised:
        offload.save({"v": torch.randn(16 << 20)}, path)   # 64 MiB: 8 requests, some fail
    assert raised.value.errno == errno.EIO and "ckpt.safetensors" in str(raised.value)
    monkeypatch.undo()
    assert torch.equal(offload.load(path)["v"], torch.ones(1000))
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


def fsync_spy(monkeypatch, fail_first=False):
    """Records os.fsync and os.rename in order: ("fsync", "file" or "dir"),
    ("rename", destination). ``fail_first``: the first fsync of a regular file
    raises EIO, as a failed writeback does (Linux reports it once)."""
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def fsync(fd):
        kind = "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"
        events.append(("fsync", kind))
        if fail_first and kind == "file" and ("fsync", "file") not in events[:-1]:
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    def rename(src, dst, **kwargs):
        events.append(("rename", os.fspath(dst)))
        return real_rename(src, dst, **kwargs)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return events


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_save_is_durable_before_it_replaces_the_old_checkpoint(tmp_path, monkeypatch, sharded):
    """Each new file (a sharded save's shards and index) is fsynced before it
    is renamed into place, and the directory after the last rename."""
    path = tmp_path / ("model.safetensors.index.json" if sharded else "ckpt.safetensors")
    offload.save({"v": torch.ones(1000), "w": torch.ones(10)}, path)
    events = fsync_spy(monkeypatch)
    options = {"max_shard_bytes": 1 << 20} if sharded else {}
    offload.save({"v": torch.randn(1 << 20), "w": torch.randn(1 << 18)}, path, **options)
    monkeypatch.undo()
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert len(renames) == (3 if sharded else 1), events  # two shards and the index
    for before, at in zip([-1] + renames, renames):
        assert ("fsync", "file") in events[before + 1:at], events
    assert ("fsync", "dir") in events[renames[-1]:], events
    assert len(offload.load(path)) == 2


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_failed_fsync_fails_the_save_and_keeps_the_old_checkpoint(tmp_path, monkeypatch, sharded):
    """The error of a writeback that failed is reported once: a save that
    met it must fail, not succeed on a second fsync that reports nothing."""
    path = tmp_path / ("model.safetensors.index.json" if sharded else "ckpt.safetensors")
    old = {"v": torch.ones(1000), "w": torch.ones(10)}
    offload.save(old, path)
    before = sorted(os.listdir(tmp_path))
    fsync_spy(monkeypatch, fail_first=True)
    options = {"max_shard_bytes": 1 << 20} if sharded else {}  # two shards, fsynced at once
    with pytest.raises(OSError) as raised:
        offload.save({"v": torch.randn(1 << 20), "w": torch.randn(1 << 18)}, path, **options)
    monkeypatch.undo()
    assert raised.value.errno == errno.EIO and str(tmp_path) in str(raised.value)
    assert_same(offload.load(path), old)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_file_that_shrinks_while_it_loads_is_refused(tmp_path, monkeypatch):
    """Cut inside its last block after the header was read: the bytes
    O_DIRECT cannot read are read with pread, which comes up short."""
    from offload import _checkpoint_reading
    path = tmp_path / "ckpt.safetensors"
    offload.save({"v": torch.randn(10000)}, path)   # 40,000 bytes of data: the file ends mid-block
    size = os.path.getsize(path)
    assert size % 4096
    real = _checkpoint_reading.read_header

    def then_cut(*args, **kwargs):
        header = real(*args, **kwargs)
        os.truncate(path, size - 100)
        return header
    monkeypatch.setattr(_checkpoint_reading, "read_header", then_cut)
    with pytest.raises(CheckpointError, match="shrank"):
        offload.load(path)


def test_injected_read_errors_surface_as_oserror(tmp_path, monkeypatch):
    from offload import _checkpoint_reading as engines_of
    path = tmp_path / "e.safetensors"
    offload.save({"w": torch.randn(4 << 20)}, path)
    real = engines_of.open_engine

    def failing_engine(*args):
        engine = real(*args)
        engine.set_faults(1.0, [errno.EIO], 0.0, 0.0, 0, 1)
        return engine

    monkeypatch.setattr(engines_of, "open_engine", failing_engine)
    with pytest.raises(OSError) as raised:
        offload.load(path)
    assert raised.value.errno == errno.EIO and "e.safetensors" in str(raised.value)


# ------------------------------------------------------------------ hostile files
def valid_file(tmp_path):
    path = tmp_path / "v.safetensors"
    write_raw(path, [("w", torch.randn(10)), ("b", torch.arange(4, dtype=torch.int64))])
    return path


def with_header(tmp_path, header, data=b"\0" * 72, length=None):
    path = tmp_path / "h.safetensors"
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


@pytest.mark.parametrize("header,data,match", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "'w'.*truncated"),
    ({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "'w'.*unknown.*dtype"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "'w'.*12 bytes"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "'w'.*shape"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "'w'.*data_offsets"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "gap"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 20, "12 bytes after"),
    ({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}, b"\0" * 8, "'w'"),
    ({"w": [1, 2]}, b"", "'w'.*expected an object"),
    ([1, 2], b"", "not an object"),
    ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
    (b'{"w": {"dtype": "F32"', b"", "not valid JSON"),
    (b"\xff\xfe{}", b"", "not valid JSON"),
    (b'{"w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "w": {}}', b"", "twice"),
])
def test_hostile_headers_give_a_clear_error(tmp_path, header, data, match):
    path = with_header(tmp_path, header, data)
    with pytest.raises(CheckpointError, match=match) as raised:
        offload.load(path)
    assert "h.safetensors" in str(raised.value)


def test_hostile_lengths_and_truncation(tmp_path):
    with pytest.raises(CheckpointError, match="exceeds"):
        offload.load(with_header(tmp_path, {}, length=1 << 62))
    with pytest.raises(CheckpointError, match="past the end"):
        offload.load(with_header(tmp_path, {}, b"", length=1000))
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        offload.load(path)
    good = valid_file(tmp_path)
    data = good.read_bytes()
    for cut in (len(data) - 1, len(data) - 40, 20):
        good.write_bytes(data[:cut])
        with pytest.raises(CheckpointError):
            offload.load(good)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)
_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(list(DTYPES) + ["X", "", "f32"]) | _json_values,
    "shape": st.lists(st.integers(-2, 40), max_size=4) | _json_values,
    "data_offsets": st.lists(st.integers(-8, 400), min_size=0, max_size=3) | _json_values,
})


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(header=st.dictionaries(st.text(max_size=6), _entries | _json_values, max_size=5),
       data_size=st.integers(0, 400))
def test_fuzz_the_header_parser(header, data_size):
    """Random headers, valid and not: either a clear CheckpointError, or a
    parse whose extents tile the data region exactly."""
    from offload._safetensors import parse_header
    raw = json.dumps(header).encode()
    try:
        parsed = parse_header(raw, 8 + len(raw) + data_size, "fuzz.safetensors")
    except CheckpointError as error:
        assert "fuzz.safetensors" in str(error)
        return
    position = 0
    for entry in sorted(parsed.entries, key=lambda e: e.begin):
        assert entry.begin == position and entry.end <= data_size
        position = entry.end
    assert position == data_size


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.none() | st.integers(0, 10_000))
def test_fuzz_whole_files(tmp_path_factory, flips, cut):
    """Bytes of a valid file changed or cut anywhere: load either works
    (the bytes that changed were tensor data) or raises CheckpointError."""
    directory = tmp_path_factory.mktemp("fuzz")
    path = valid_file(directory)
    data = bytearray(path.read_bytes())
    for position, value in flips:
        data[position % len(data)] = value
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    path.write_bytes(bytes(data))
    try:
        loaded = offload.load(path)
    except CheckpointError:
        return
    total = sum(t.numel() * t.element_size() for t in loaded.values())
    assert total <= len(data)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_save_and_load(tmp_path):
    sd = {k: v.cuda() for k, v in mixed_state_dict(4).items()}
    path = tmp_path / "cuda.safetensors"
    offload.save(sd, path)
    assert_same({k: v.cpu() for k, v in offload.load(path).items()}, {k: v.cpu() for k, v in sd.items()})
    loaded = offload.load(path, device="cuda")
    assert all(t.is_cuda for t in loaded.values())
    assert_same({k: v.cpu() for k, v in loaded.items()}, {k: v.cpu() for k, v in sd.items()})


def test_saving_onto_a_directory_names_it_and_says_what_to_do(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    with pytest.raises(IsADirectoryError, match="name the file in it") as raised:
        offload.save({"w": torch.ones(3)}, target)
    assert raised.value.filename == str(target) and os.listdir(tmp_path) == ["ckpt"]
    assert os.listdir(target) == []


def test_loading_a_directory_names_it(tmp_path):
    """A directory where a checkpoint file should be (the path itself, or a
    shard the index lists) is named in the error, not left as a bare EISDIR."""
    with pytest.raises(IsADirectoryError, match="not a checkpoint file") as raised:
        offload.load(tmp_path)
    assert raised.value.filename == str(tmp_path)
    index = tmp_path / "m" / "model.safetensors.index.json"
    index.parent.mkdir()
    offload.save({"w": torch.ones(3), "v": torch.zeros(4096)}, index, max_shard_bytes=4096)
    shard = json.loads(index.read_text())["weight_map"]["w"]
    os.unlink(index.parent / shard)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", index.parent / shard)
    for load in (offload.load, lambda path: asyncio.run(offload.load_async(path))):
        with pytest.raises(IsADirectoryError) as raised:
            load(index)
        assert raised.value.filename == str(index.parent / shard)


def test_a_device_this_torch_cannot_load_to_is_refused_by_name(tmp_path):
    path = tmp_path / "m.safetensors"
    offload.save({"w": torch.ones(3)}, path)
    for device in ("meta", "mps"):
        with pytest.raises(ValueError, match=f"cannot load to {device}: use 'cpu' or a CUDA device"):
            offload.load(path, device=device)
    if not torch.cuda.is_available():  # torch's own AssertionError before
        for device in ("cuda", "cuda:0"):
            with pytest.raises(ValueError, match=f"cannot load to {device}: CUDA is not available"):
                offload.load(path, device=device)
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_an_empty_tensor_with_a_size_beyond_int64_is_refused_by_name(tmp_path):
    path = tmp_path / "huge.safetensors"
    header = json.dumps({"fine": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "huge": {"dtype": "F32", "shape": [10 ** 30, 0, 4], "data_offsets": [8, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match="'huge': shape .* beyond what torch can hold"):
        offload.load(path)


def test_differential_fuzz_against_the_safetensors_package(tmp_path):
    """1,000 mutated files, seeded: offload and safetensors agree on each (the
    long run's figures are in RELIABILITY.md)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
    try:
        import safetensors_fuzz
    finally:
        sys.path.pop(0)
    summary = safetensors_fuzz.run(str(tmp_path), files=1000, seed=11)
    assert summary["disagreements"] == [], summary
    assert summary["both_refuse"] > 500 and summary["both_load"] > 50  # the mutations hit both ways


def test_a_file_system_without_o_direct_saves_and_loads_buffered(ramfs):
    """save and load share the Offloader's O_DIRECT rule (offload/_direct_io.py):
    direct=None falls back to buffered I/O where the file system refuses
    O_DIRECT (a save says so, naming the directory; direct=False is silent),
    direct=True refuses with EINVAL."""
    sd = mixed_state_dict(3)
    path = ramfs / "model.safetensors"
    with pytest.warns(RuntimeWarning, match=f"{re.escape(repr(str(ramfs)))} refuses O_DIRECT") as caught:
        offload.save(sd, path)
    assert len(caught) == 1 and caught[0].filename == __file__  # it points at the caller's line
    assert_same(offload.load(path), sd)
    offload.save(sd, path, direct=False)  # silent: the suite turns warnings into errors
    assert_same(offload.load(path), sd)
    assert_same(asyncio.run(offload.load_async(path)), sd)
    for call in (lambda: offload.save(sd, ramfs / "other.safetensors", direct=True),
                 lambda: offload.load(path, direct=True)):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.EINVAL
    assert sorted(os.listdir(ramfs)) == ["model.safetensors"]  # the refused save left nothing behind


def test_a_failure_to_fault_buffers_in_fails_the_load_instead_of_hanging(tmp_path, monkeypatch):
    """Segments after the first land in fresh buffers faulted in by a helper
    thread; if that fails, the load raises the error."""
    import threading
    sd = {f"t{i}": random_tensor(((40 << 20) + 5 * 4096,), torch.uint8) for i in range(3)}  # sizes no cache holds
    path = tmp_path / "m.safetensors"
    offload.save(sd, path)

    def refused(*args):
        raise OSError(errno.ENOMEM, "madvise refused (injected)")
    monkeypatch.setattr(offload._core, "prefault", refused)
    outcome = []
    loader = threading.Thread(target=lambda: outcome.append(_load_outcome(path)), daemon=True)
    loader.start()
    loader.join(60)
    assert outcome and isinstance(outcome[0], OSError) and "injected" in str(outcome[0]), outcome


@pytest.mark.parametrize("sizes, small_pages", [([2048], True), ([], True), ([256, 64], False), ([2048, 256], True)],
                         ids=["2MiB", "no-thp", "256KiB", "both"])
def test_fresh_segment_buffers_fault_in_on_small_pages_only_where_huge_ones_are_2_mib(
        tmp_path, monkeypatch, sizes, small_pages):
    """A fresh 2 MiB huge page is slow to fault in where compaction or a
    VM's host is in the way, so segment buffers fault in on 4 KiB pages
    then; smaller huge pages, where the system enables them for advised
    memory, fault in as fast and split no request, so they keep them."""
    sd = {f"t{i}": random_tensor(((40 << 20) + 7 * 4096,), torch.uint8) for i in range(3)}
    path = tmp_path / "m.safetensors"
    offload.save(sd, path)
    offload.buffer_pool().trim()   # no cached buffer to recycle: the segments after the first are fresh
    real, calls = offload._core.prefault, []

    def recorded(address, length, small):
        calls.append(small)
        return real(address, length, small)
    monkeypatch.setattr(offload._core, "prefault", recorded)
    monkeypatch.setattr(offload._checkpoint_reading, "advised_page_sizes", lambda: sizes)
    loaded = offload.load(path)
    assert calls and set(calls) == {small_pages}, calls
    assert all(same_bits(loaded[k], v) for k, v in sd.items())


def test_fresh_segment_buffers_fault_in_on_as_many_threads_as_the_setting_says(tmp_path, monkeypatch):
    import threading
    sd = {f"t{i}": random_tensor(((40 << 20) + 9 * 4096,), torch.uint8) for i in range(5)}
    path = tmp_path / "m.safetensors"
    offload.save(sd, path)
    real = offload._core.prefault
    for setting, threads in (("", 1), ("3", 3), ("none", 1)):
        offload.buffer_pool().trim()   # no cached buffer to recycle: the segments after the first are fresh
        faulted_on = []

        def recorded(address, length, small):
            faulted_on.append(threading.get_ident())
            return real(address, length, small)
        monkeypatch.setattr(offload._core, "prefault", recorded)
        monkeypatch.setenv("OFFLOAD_PREFAULT_THREADS", setting)
        loaded = offload.load(path)
        assert len(faulted_on) >= 3 and len(set(faulted_on)) == threads, (setting, faulted_on)
        assert all(same_bits(loaded[k], v) for k, v in sd.items())
        del loaded


def test_every_read_of_a_fresh_load_lands_in_memory_faulted_in_before_it_and_the_disk_starts_early(
        tmp_path, monkeypatch):
    """A read into memory not faulted in yet faults it inside the
    submission, on 2 MiB pages, one request after another; so new buffers,
    the first included, are faulted in piece by piece first, each piece read
    once it is in. Checked by where the reads go, not by timing."""
    sd = {"big": random_tensor((100 << 20,), torch.uint8), "small": random_tensor((3 << 20,), torch.uint8)}
    path = tmp_path / "m.safetensors"
    offload.save(sd, path)
    offload.buffer_pool().trim()   # nothing cached: every buffer of the load is new memory
    real_prefault, real_read = offload._core.prefault, offload._checkpoint_reading.Loader._read
    faulted, reads = [], []

    def prefault(address, length, small):
        real_prefault(address, length, small)
        faulted.append((address, address + length))

    def read(self, buffer, buffer_offset, lo, hi, on_done):
        start = buffer.address + buffer_offset
        reads.append((start, hi - lo, any(a <= start and start + (hi - lo) <= b for a, b in faulted)))
        return real_read(self, buffer, buffer_offset, lo, hi, on_done)
    monkeypatch.setattr(offload._core, "prefault", prefault)
    monkeypatch.setattr(offload._checkpoint_reading.Loader, "_read", read)
    loaded = offload.load(path)
    assert all(same_bits(loaded[k], v) for k, v in sd.items())
    assert reads and all(inside for _, _, inside in reads), reads
    assert max(n for _, n, _ in reads) <= offload._checkpoint_reading._PIECE  # the first read waits for one piece only


def test_fresh_buffers_read_piece_by_piece_keep_every_byte_at_unaligned_bounds(tmp_path):
    # Tensors of odd sizes: segments begin and end mid-block, one piece ends
    # a segment mid-file, and the last ends the file mid-block.
    sizes = [(33 << 20) + 7, (65 << 20) + 3, (1 << 20) + 1, 4099]
    sd = {f"t{i}": random_tensor((n,), torch.uint8) for i, n in enumerate(sizes)}
    path = tmp_path / "odd.safetensors"
    offload.save(sd, path)
    assert os.path.getsize(path) % 4096
    offload.buffer_pool().trim()
    for _ in range(2):                 # new buffers, then recycled ones
        loaded = offload.load(path)
        assert all(same_bits(loaded[k], v) for k, v in sd.items())
        del loaded


def _load_outcome(path):
    try:
        return offload.load(path)
    except Exception as error:
        return error


def test_a_save_and_a_load_whose_requests_stop_finishing_warn_once_and_finish(tmp_path, monkeypatch):
    """offload.save drives its engine itself and offload.load waits on its
    loader (load_async awaits it): when no request finishes for the
    threshold (every completion held 0.9 s, threshold 0.5 s), one warning
    each names the file; each finishes with the right bytes."""
    from offload import _checkpoint_reading, _checkpoint_writing, _completion_loop

    def slowed(module):
        real = module.open_engine

        def slow(*args, **kwargs):
            engine = real(*args, **kwargs)
            engine.set_faults(0.0, [], 0.0, 1.0, 900, 1)
            return engine
        monkeypatch.setattr(module, "open_engine", slow)

    monkeypatch.setattr(_completion_loop, "QUIET_WAIT_WARNING_S", 0.5)
    slowed(_checkpoint_writing)
    slowed(_checkpoint_reading)
    sd = {"w": torch.randn(1 << 20), "b": torch.randn(1000)}
    path = tmp_path / "w.safetensors"
    for what, run in (("saving", lambda: offload.save(sd, path, progress=False)),
                      ("waiting on the load of", lambda: offload.load(path, progress=False)),
                      ("awaiting the load of", lambda: asyncio.run(offload.load_async(path, progress=False)))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = run()
        quiet = [str(w.message) for w in caught if "none finishing" in str(w.message)]
        assert len(quiet) == 1 and quiet[0].startswith(f"offload: {what} {str(path)!r}"), (what, quiet)
        if loaded is not None:
            assert all(same_bits(loaded[k], v) for k, v in sd.items())
