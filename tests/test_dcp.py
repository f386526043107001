"""offload.dcp: torch.distributed.checkpoint storage over offload's engine,
checked against DCP's own FileSystemWriter/Reader both ways, on real files,
in one process and over gloo with 2 ranks."""
import errno
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import dcp_refusal, popen_python, random_tensor, run_python, same_bits

REFUSAL = dcp_refusal()  # a torch older than DCP's storage API: offload.dcp says so at import
if REFUSAL:
    pytest.skip(REFUSAL, allow_module_level=True)

from torch.distributed.checkpoint.api import CheckpointException

import offload._atomic_file
import offload._dcp_reading
import offload._torch_records
import offload.dcp
from offload._tensors import GUARDS
from offload.checkpoint import CheckpointError
from offload.devices import LateCopyDevice
from test_checkpoint import interrupted_twice
from test_optim_distributed import free_port

# DCP warns that it runs without a process group, and about its own internals.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
              pytest.mark.filterwarnings("ignore::FutureWarning:torch.distributed")]

WORKER = os.path.join(os.path.dirname(__file__), "helpers", "dcp_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
from dcp_worker import full_state, zeroed  # noqa: E402

# DCP gathers each rank's error into a CheckpointException (a BaseException)
# whose message carries the original one.
FAILS = (Exception, CheckpointException)

STORAGE = {"offload": (offload.dcp.Writer, offload.dcp.Reader),
           "torch": (dcp.FileSystemWriter, dcp.FileSystemReader)}


def state_dict():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(3 << 20, generator=g)  # 12 MiB: several requests
    return {"model": {"w": torch.randn(300, 200, generator=g), "t": torch.randn(50, 40, generator=g).t(),
                      "half": torch.randn(77, generator=g).half(), "empty": torch.empty(0, 5)},
            "big": big, "ids": torch.arange(1001, dtype=torch.int32), "step": 12, "name": "run-1"}


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("writer,reader", [("offload", "offload"), ("offload", "torch"), ("torch", "offload")])
def test_round_trip_and_interop_with_dcp_storage(tmp_path, writer, reader):
    sd = state_dict()
    dcp.save(sd, storage_writer=STORAGE[writer][0](tmp_path / "ck"))
    out = zeroed(sd)
    dcp.load(out, storage_reader=STORAGE[reader][1](tmp_path / "ck"))
    assert same(out, sd)
    assert sorted(os.listdir(tmp_path / "ck")) == [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("reader", ["offload", "torch"])
def test_a_torch_that_cannot_turn_crc32s_off_saves_records_both_readers_load(tmp_path, monkeypatch, reader):
    """torch 2.5 has torch.serialization.skip_data but no CRC-32 options: the
    records are written with its CRC-32s on, and load as they do elsewhere."""
    monkeypatch.setattr(offload._torch_records, "_get_crc32_options", None)
    sd = state_dict()
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = zeroed(sd)
    dcp.load(out, storage_reader=STORAGE[reader][1](tmp_path / "ck"))
    assert same(out, sd)


def test_a_load_whose_reads_never_complete_can_be_interrupted(tmp_path):
    """The reader's engine never finishes a read (a drive that stopped
    answering): two Ctrl-Cs end the load within seconds, the engine given up."""
    dcp.save({"v": torch.ones(4 << 20)}, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    interrupted_twice("dcp-load", tmp_path / "ck", "auto")


@pytest.mark.parametrize("writer,reader", [("offload", "offload"), ("offload", "torch"), ("torch", "offload")])
def test_lazy_conjugates_and_negations_load_as_their_values(tmp_path, writer, reader):
    """torch.save records keep ``x.conj()``'s flag beside its raw bytes; the
    reader's own parsing leaves such records to torch.load, which applies it."""
    g = torch.Generator().manual_seed(4)
    sd = {"conj": torch.randn(3 << 18, dtype=torch.complex64, generator=g).conj(),  # 6 MiB: read straight
          "neg": torch._neg_view(torch.randn(1000, generator=g)), "plain": torch.randn(1000, generator=g)}
    dcp.save(sd, storage_writer=STORAGE[writer][0](tmp_path / "ck"))
    out = {name: torch.zeros_like(t.resolve_conj().resolve_neg()) for name, t in sd.items()}
    dcp.load(out, storage_reader=STORAGE[reader][1](tmp_path / "ck"))
    for name, t in sd.items():
        assert torch.equal(out[name], t), name


@pytest.mark.parametrize("reader", ["offload", "torch"])
def test_views_of_a_larger_storage_store_their_own_bytes_only(tmp_path, reader):
    """torch.save keeps a view's whole storage; a checkpoint keeps the
    view's bytes, as DCP's FileSystemWriter does (a slice of a 16 MiB flat
    buffer took 16 MiB of the file before)."""
    flat = torch.randn(1 << 22)  # 16 MiB
    sd = {"head": flat[:10], "strided": flat[::1024], "t": torch.randn(30, 40).t()}
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    assert sum(f.stat().st_size for f in (tmp_path / "ck").iterdir()) < 1 << 20
    out = {name: torch.zeros_like(t) for name, t in sd.items()}
    dcp.load(out, storage_reader=STORAGE[reader][1](tmp_path / "ck"))
    for name, t in sd.items():
        assert torch.equal(out[name], t), name


def test_offloaded_tensors_are_refused_by_name_not_crashed_on(tmp_path):
    """A tensor written to an Offloader has no memory until it is read back:
    saving it, or loading into it, crashed the process (SIGSEGV), or for
    large destinations failed with EINVAL from the engine. Where torch can
    guard an offloaded tensor's storage, DCP's own planner touches it first
    and raises the guard's error."""
    with offload.Offloader(tmp_path) as off:
        gone = torch.randn(1000)
        off.sync_write(gone)
        refused = "this tensor is offloaded" if GUARDS else "'gone' has no data: its memory was released"
        with pytest.raises(FAILS, match=refused):
            dcp.save({"gone": gone}, storage_writer=offload.dcp.Writer(tmp_path / "w"))
        sd = {"small": torch.randn(1000), "large": torch.randn(1 << 21)}  # copied, and read straight in
        dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
        for name in sd:
            into = {key: torch.zeros_like(t) for key, t in sd.items()}
            off.sync_write(into[name])
            with pytest.raises(FAILS, match=f"'{name}': the tensor to load into has no data"):
                dcp.load(into, storage_reader=offload.dcp.Reader(tmp_path / "ck"))
            off.sync_read(into[name])
            dcp.load(into, storage_reader=offload.dcp.Reader(tmp_path / "ck"))
            assert all(torch.equal(into[key], t) for key, t in sd.items())


def layouts(path):
    """Each tensor record of a checkpoint: (file, offset of its storage's
    bytes in the file, their length), read from the files as a reader would."""
    import pickle
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    found = []
    for info in metadata.storage_data.values():
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        layout = offload._torch_records.record_layout(record[:4096], record[-4096:], len(record))
        if layout is not None:
            found.append((info.relative_path, info.offset + layout[0], layout[1]))
    return found


def test_several_files_per_rank_load_with_both_readers(tmp_path):
    sd = state_dict()
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck", files_per_rank=3))
    assert sorted(os.listdir(tmp_path / "ck")) == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert len({file for file, _, _ in layouts(tmp_path / "ck")}) == 3
    for reader in STORAGE.values():
        out = zeroed(sd)
        dcp.load(out, storage_reader=reader[1](tmp_path / "ck"))
        assert same(out, sd)


def test_a_striped_save_spreads_each_rank_over_file_systems_and_loads_with_both_readers(loop_fs):
    first, second = loop_fs(64), loop_fs(64)
    sd = state_dict()
    checkpoint = first / "ck"
    dcp.save(sd, storage_writer=offload.dcp.Writer(checkpoint, stripe=[second]))
    assert sorted(os.listdir(checkpoint)) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert os.path.islink(checkpoint / "__0_1.distcp") and not os.path.islink(checkpoint / "__0_0.distcp")
    elsewhere = [n for n in os.listdir(second) if n.endswith("__0_1.distcp")]
    assert len(elsewhere) == 1 and os.stat(checkpoint / "__0_1.distcp").st_dev == os.stat(second).st_dev
    for reader in STORAGE.values():
        out = zeroed(sd)
        dcp.load(out, storage_reader=reader[1](checkpoint))
        assert same(out, sd)
    # Overwritten (a new save, its own file in the other directory): the old one goes.
    sd["big"] += 1
    dcp.save(sd, storage_writer=offload.dcp.Writer(checkpoint, stripe=[second]))
    now = [n for n in os.listdir(second) if n.endswith(".distcp")]
    assert len(now) == 1 and now != elsewhere
    out = zeroed(sd)
    dcp.load(out, storage_reader=offload.dcp.Reader(checkpoint))
    assert same(out, sd)
    # And overwritten without striping: the link becomes a file, the file it reached goes.
    dcp.save(sd, storage_writer=offload.dcp.Writer(checkpoint, files_per_rank=2))
    assert not os.path.islink(checkpoint / "__0_1.distcp")
    assert not [n for n in os.listdir(second) if n.endswith(".distcp")]
    out = zeroed(sd)
    dcp.load(out, storage_reader=dcp.FileSystemReader(checkpoint))
    assert same(out, sd)


def test_an_overwrite_frees_the_files_it_replaced_once_the_metadata_is_committed(tmp_path, monkeypatch):
    """Freeing a large file's blocks beside the save's last fsyncs stalled
    them: the old data files (the one renamed over and the one a link
    reached) are freed after the new metadata is in place, and are freed."""
    second = tmp_path / "second"
    second.mkdir()
    checkpoint = tmp_path / "ck"
    sd = state_dict()
    dcp.save(sd, storage_writer=offload.dcp.Writer(checkpoint, stripe=[second]))
    old = {os.stat(checkpoint / name).st_ino for name in ("__0_0.distcp", "__0_1.distcp")}
    freed = []
    close_all = offload._atomic_file._close_all

    def recording(fds):
        freed.extend((os.fstat(fd).st_ino, os.path.exists(checkpoint / ".metadata")) for fd in fds)
        close_all(fds)
    monkeypatch.setattr(offload._atomic_file, "_close_all", recording)
    sd["big"] += 1
    dcp.save(sd, storage_writer=offload.dcp.Writer(checkpoint, stripe=[second]))
    offload._atomic_file.wait_for_frees()
    assert {ino for ino, _ in freed} == old
    assert all(metadata_there for _, metadata_there in freed), freed
    assert not [fd for fd in os.listdir("/proc/self/fd") if ".distcp (deleted)" in _fd_target(fd)]
    out = zeroed(sd)
    dcp.load(out, storage_reader=offload.dcp.Reader(checkpoint))
    assert same(out, sd)


def _fd_target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_the_files_a_writer_holds_are_never_copied_nor_kept(tmp_path):
    """A Writer pickled or copied (DCP's async save may) holds no file of
    the original, so none is closed twice; one dropped frees what it held."""
    import copy
    import pickle
    from offload._atomic_file import HeldFrees
    path = tmp_path / "held"
    path.write_bytes(b"x" * 4096)
    held = HeldFrees()
    held.fds.append(os.open(path, os.O_RDONLY))
    os.unlink(path)
    assert copy.deepcopy(held).fds == [] and pickle.loads(pickle.dumps(held)).fds == []
    fd = held.fds[0]
    del held
    with pytest.raises(OSError) as error:
        os.fstat(fd)
    assert error.value.errno == errno.EBADF


def test_large_storages_start_on_a_block_boundary_of_the_file(tmp_path):
    sd = {"a": torch.randn(1 << 20), "b": torch.randn(5), "c": torch.randn(300, 1000), "d": torch.randn(7, 3)}
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    found = {size: start for _, start, size in layouts(tmp_path / "ck")}
    assert sorted(found) == sorted(v.numel() * 4 for v in sd.values())
    assert found[4 << 20] % 4096 == 0 and found[1200000] % 4096 == 0


def aligned_zeros(t, misalign=0):
    """A zeroed tensor shaped like ``t`` whose memory starts ``misalign``
    bytes past a page boundary (torch's own allocations start 64 past one)."""
    raw = torch.zeros(t.numel() * t.element_size() + 8192, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096 + misalign
    return raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def test_large_records_are_read_straight_into_aligned_memory(tmp_path):
    sd = {"big": random_tensor((3 << 20,), torch.float32), "wide": random_tensor((1000, 700), torch.bfloat16),
          "small": torch.randn(100)}
    large = sum(sd[k].numel() * sd[k].element_size() for k in ("big", "wide"))
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = {k: aligned_zeros(v) for k, v in sd.items()}
    reader = offload.dcp.Reader(tmp_path / "ck")
    dcp.load(out, storage_reader=reader)
    assert all(same_bits(out[k], sd[k]) for k in sd)
    assert reader.stats.probed == 2
    assert reader.stats.in_place == large
    assert reader.stats.copied == 400
    # Memory off the file system's DIO alignment is copied, as are records
    # written by DCP's own writer (storages at any offset); bits the same.
    for misalign, writer in ((64, offload.dcp.Writer), (0, dcp.FileSystemWriter)):
        dcp.save(sd, storage_writer=writer(tmp_path / "ck2"))
        out = {k: aligned_zeros(v, misalign) for k, v in sd.items()}
        reader = offload.dcp.Reader(tmp_path / "ck2")
        dcp.load(out, storage_reader=reader)
        assert all(same_bits(out[k], sd[k]) for k in sd)
        if direct_io(tmp_path):
            assert reader.stats.in_place == 0 and reader.stats.copied == large + 400


def test_a_large_record_loaded_into_another_dtype_is_converted(tmp_path):
    """Only a destination of the record's dtype takes its bytes as they are:
    another gets the values converted, as DCP's own reader does."""
    sd = {"big": torch.randn(1 << 20)}                          # 4 MiB: large enough to be read in place
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = {"big": aligned_zeros(torch.empty(1 << 20, dtype=torch.float64))}
    reader = offload.dcp.Reader(tmp_path / "ck")
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["big"], sd["big"].double()) and reader.stats.in_place == 0


def watch_acquires(monkeypatch) -> list:
    """The sizes of the pool buffers the DCP reader acquires from now on."""
    acquired, pool = [], offload._dcp_reading.buffer_pool()

    class Watched:
        def acquire(self, nbytes):
            acquired.append(nbytes)
            return pool.acquire(nbytes)
    monkeypatch.setattr(offload._dcp_reading, "buffer_pool", Watched)
    return acquired


def test_memory_o_direct_refuses_streams_through_slots_however_large_the_record(tmp_path, monkeypatch):
    """A record for CPU memory off the DIO alignment (or at an odd file
    offset, as DCP's own writer puts it) is read a slot at a time and copied
    out as each lands: no bounce buffer larger than a slot, whatever the
    record's size, and every slot read into again (more chunks than slots)."""
    if not direct_io(tmp_path):
        pytest.skip("the file system refuses O_DIRECT: every record goes straight into its memory")
    monkeypatch.setattr(offload._dcp_reading, "_CHUNK", 1 << 20)
    monkeypatch.setattr(offload._dcp_reading, "_HOST_SLOTS", 2)
    acquired = watch_acquires(monkeypatch)
    sd = {"big": random_tensor((5 << 20,), torch.float32), "wide": random_tensor((1000, 1700), torch.bfloat16),
          "small": torch.randn(100)}
    large = sum(sd[k].numel() * sd[k].element_size() for k in ("big", "wide"))
    for misalign, writer in ((64, offload.dcp.Writer), (0, dcp.FileSystemWriter)):
        dcp.save(sd, storage_writer=writer(tmp_path / writer.__name__))
        out = {k: aligned_zeros(v, misalign) for k, v in sd.items()}
        reader = offload.dcp.Reader(tmp_path / writer.__name__)
        acquired.clear()
        dcp.load(out, storage_reader=reader)
        assert all(same_bits(out[k], sd[k]) for k in sd)
        assert reader.stats.in_place == 0 and reader.stats.copied == large + 400
        probes = 2 * 4 * offload._dcp_reading._PROBE
        assert acquired and max(n for n in acquired if n != probes) <= 1 << 20, acquired


FRESH_PROCESS_LOAD = """
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
import offload.dcp
from offload import _pool
warnings.simplefilter("ignore")
path, n = sys.argv[1], int(sys.argv[2])
raw = torch.zeros(n * 4 + 8192, dtype=torch.uint8)
start = -raw.data_ptr() % 4096 + 64                 # 64 bytes past a page, as torch allocates
out = {"big": raw[start:start + n * 4].view(torch.float32), "small": torch.zeros(64, 1024)}
reader = offload.dcp.Reader(path)
dcp.load(out, storage_reader=reader)
_pool.wait_provisioned()
gen = torch.Generator().manual_seed(3)
intact = torch.equal(out["big"], torch.randn(n, generator=gen))
intact = intact and torch.equal(out["small"], torch.randn(64, 1024, generator=gen))
print(reader.stats.copied, _pool.faulted_in_for_reads(), intact)
"""


def test_a_fresh_process_hands_its_new_buffers_to_the_helper_and_loads_every_byte(tmp_path):
    """A new process's slots, and the buffer its small records are read
    into, are new memory: the pool's helper thread faults them in beside the
    reads (which fault in what they reach first), and the data lands
    intact."""
    if not direct_io(tmp_path):
        pytest.skip("the file system refuses O_DIRECT: the record goes straight into its memory")
    n = 12 << 20  # 48 MiB: more chunks than slots
    gen = torch.Generator().manual_seed(3)
    dcp.save({"big": torch.randn(n, generator=gen), "small": torch.randn(64, 1024, generator=gen)},
             storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    result = run_python([sys.executable, "-c", FRESH_PROCESS_LOAD, str(tmp_path / "ck"), str(n)],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    copied, faulted, intact = result.stdout.split()
    assert int(copied) == (n + 64 * 1024) * 4 and intact == "True"
    slots = offload._dcp_reading._HOST_SLOTS * offload._dcp_reading._CHUNK
    assert slots + 64 * 1024 * 4 <= int(faulted) <= slots + (8 << 20)  # and the small record's segment


class _OwnsSome(LateCopyDevice):
    """The test device, owning only the tensors given (the rest are CPU tensors)."""

    def __init__(self, owned, **options):
        super().__init__(**options)
        self.owned = {t.data_ptr() for t in owned}

    def owns(self, t) -> bool:
        return t.data_ptr() in self.owned


def test_device_and_refused_cpu_destinations_each_stream_through_slots_of_their_own(tmp_path, monkeypatch):
    if not direct_io(tmp_path):
        pytest.skip("the file system refuses O_DIRECT: CPU records go straight into their memory")
    monkeypatch.setattr(offload._dcp_reading, "_CHUNK", 1 << 20)
    monkeypatch.setattr(offload._dcp_reading, "_SLOTS", 2)
    monkeypatch.setattr(offload._dcp_reading, "_HOST_SLOTS", 2)
    acquired = watch_acquires(monkeypatch)
    sd = {"a_host": random_tensor((3 << 20,), torch.float32), "b_device": random_tensor((3 << 20,), torch.float32),
          "c_host": random_tensor((1 << 20,), torch.float32)}
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = {k: aligned_zeros(v, 64) for k, v in sd.items()}
    reader = offload.dcp.Reader(tmp_path / "ck", device=_OwnsSome([out["b_device"]], lazy=True))
    dcp.load(out, storage_reader=reader)
    assert all(same_bits(out[k], sd[k]) for k in sd)
    assert reader.stats.staged == 12 << 20 and reader.stats.copied == 16 << 20 and reader.stats.in_place == 0
    probes = 3 * 4 * offload._dcp_reading._PROBE
    assert max(n for n in acquired if n != probes) <= 1 << 20, acquired  # no record-sized buffer


def test_records_are_probed_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(offload._dcp_reading, "_PROBES_AT_ONCE", 2)
    sd = {f"t{i}": random_tensor((1 << 18,), torch.float32) for i in range(5)}
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = {k: aligned_zeros(v) for k, v in sd.items()}
    reader = offload.dcp.Reader(tmp_path / "ck")
    dcp.load(out, storage_reader=reader)
    assert reader.stats.probed == 5 and reader.stats.in_place == 5 << 20
    assert all(same_bits(out[k], sd[k]) for k in sd)


def test_without_o_direct_large_records_go_straight_into_any_memory(tmp_path):
    sd = {"big": random_tensor((3 << 20,), torch.float32), "t": torch.randn(600, 700).t()}
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = zeroed(sd)
    reader = offload.dcp.Reader(tmp_path / "ck", direct=False)
    dcp.load(out, storage_reader=reader)
    assert same_bits(out["big"], sd["big"]) and same_bits(out["t"], sd["t"])
    assert reader.stats.in_place == 12 << 20  # the transposed one is stored strided: copied
    assert reader.stats.copied == 600 * 700 * 4


def direct_io(path) -> bool:
    """Whether files under ``path`` take O_DIRECT."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_TMPFILE | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("bug", ["", "wait_before_reuse"])
def test_device_destinations_stream_through_staging_slots(tmp_path, monkeypatch, bug):
    """More chunks than slots: each slot is read into again only after the
    copy out of it; with that wait left out, lazy copies take the next
    chunk's bytes. Copies from the slots go to "device" memory (the test
    device's, CPU memory here)."""
    monkeypatch.setattr(offload._dcp_reading, "_CHUNK", 1 << 20)
    monkeypatch.setattr(offload._dcp_reading, "_SLOTS", 2)
    sd = {"w": random_tensor((3 << 20,), torch.float32), "b": torch.randn(10)}
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = zeroed(sd)
    reader = offload.dcp.Reader(tmp_path / "ck", device=LateCopyDevice(lazy=True, skip=bug))
    dcp.load(out, storage_reader=reader)
    assert reader.stats.staged == 12 << 20
    assert same_bits(out["w"], sd["w"]) == (bug == "")
    assert same_bits(out["b"], sd["b"])


def test_records_are_parsed_without_torch_load(tmp_path, monkeypatch):
    sd = state_dict()
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))

    real_load = torch.load

    def load_no_tensors(*args, **kwargs):  # DCP's planner loads its non-tensor items with it
        value = real_load(*args, **kwargs)
        if isinstance(value, torch.Tensor):
            raise AssertionError("a tensor record went through torch.load")
        return value
    monkeypatch.setattr(torch, "load", load_no_tensors)
    out = zeroed(sd)
    dcp.load(out, storage_reader=offload.dcp.Reader(tmp_path / "ck"))
    assert same(out, sd)


def test_async_save(tmp_path):
    sd = state_dict()
    future = dcp.async_save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    future.result()
    out = zeroed(sd)
    dcp.load(out, storage_reader=offload.dcp.Reader(tmp_path / "ck"))
    assert same(out, sd)


def run(command, storage, path, world, out=None, expect_ok=True):
    port = free_port()
    ranks = [popen_python([sys.executable, WORKER, command, storage, str(path), str(rank), str(world), str(port)]
                          + ([str(out)] if out else []), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) for rank in range(world)]
    outputs = []
    for rank, process in enumerate(ranks):
        output, _ = process.communicate(timeout=120)
        outputs.append((process.returncode, output))
        if expect_ok:
            assert process.returncode == 0, f"{command} rank {rank} of {world} failed:\n{output}"
    return outputs


@pytest.mark.slow
def test_two_ranks_save_and_reshard_both_ways(tmp_path):
    run("save", "offload", tmp_path / "two", 2)
    assert sorted(os.listdir(tmp_path / "two")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for reader in ("offload", "torch"):  # 2 -> 1 (this process), by both readers
        loaded = zeroed(full_state())
        dcp.load(loaded, storage_reader=STORAGE[reader][1](tmp_path / "two"))
        assert same(loaded, full_state())
    dcp.save(full_state(), storage_writer=offload.dcp.Writer(tmp_path / "one"))
    # 1 -> 2, read without O_DIRECT: each rank reads its half of the saved
    # "big" (rows 0-65535 of one record, or the rest) straight into its shard.
    outputs = run("load", "offload-buffered", tmp_path / "one", 2, tmp_path / "1to2.pt")
    assert same(torch.load(tmp_path / "1to2.pt", weights_only=True), full_state())
    assert all("ReadStats(in_place=1048576, " in output for _, output in outputs), outputs


@pytest.mark.slow
def test_a_rank_that_fails_to_write_fails_every_rank(tmp_path):
    outputs = run("save-fails", "offload", tmp_path / "ck", 2, expect_ok=False)
    assert all(code != 0 for code, _ in outputs), outputs
    assert all("No space left on device" in output for _, output in outputs), outputs
    assert not os.path.exists(tmp_path / "ck" / ".metadata")  # nothing loads as complete


def saved(tmp_path, name="ck", sd=None):
    sd = state_dict() if sd is None else sd
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / name))
    return tmp_path / name, sd


def test_a_missing_shard_names_the_file(tmp_path):
    path, sd = saved(tmp_path)
    os.unlink(path / "__0_0.distcp")
    with pytest.raises(FAILS, match="__0_0.distcp"):
        dcp.load(zeroed(sd), storage_reader=offload.dcp.Reader(path))


def test_a_truncated_shard_names_the_file(tmp_path):
    path, sd = saved(tmp_path)
    os.truncate(path / "__0_0.distcp", os.path.getsize(path / "__0_0.distcp") // 2)
    with pytest.raises(FAILS, match="__0_0.distcp: truncated"):
        dcp.load(zeroed(sd), storage_reader=offload.dcp.Reader(path))


def test_metadata_from_another_checkpoint_is_refused(tmp_path):
    path, sd = saved(tmp_path)
    other_sd = {"model": {"w": torch.randn(10, 10)}, "big": torch.randn(100), "extra": torch.randn(4096)}
    other, _ = saved(tmp_path, "other", other_sd)
    os.replace(other / ".metadata", path / ".metadata")
    with pytest.raises(FAILS, match="__0_0.distcp"):
        dcp.load(zeroed(other_sd), storage_reader=offload.dcp.Reader(path))


def test_metadata_asking_more_than_a_record_holds_is_refused(tmp_path):
    """Records of the same length, another shape: (400, 150) saved, the
    metadata of a (300, 200) one."""
    path, _ = saved(tmp_path, "ck", {"w": torch.randn(400, 150)})
    wider = {"w": torch.randn(300, 200)}
    other, _ = saved(tmp_path, "other", wider)
    os.replace(other / ".metadata", path / ".metadata")
    with pytest.raises(FAILS, match=r"__0_0.distcp: item 'w' asks for elements \[0, 0\] \+ \[300, 200\] "
                                   r"of a record of shape \(400, 150\)"):
        dcp.load(zeroed(wider), storage_reader=offload.dcp.Reader(path))


def test_no_metadata_is_not_a_checkpoint(tmp_path):
    path, sd = saved(tmp_path)
    os.unlink(path / ".metadata")
    with pytest.raises(FileNotFoundError, match="no DCP metadata: not a checkpoint"):
        offload.dcp.Reader(path).read_metadata()
    with pytest.raises(FAILS) as failed:
        dcp.load(zeroed(sd), storage_reader=offload.dcp.Reader(path))
    # Some torch versions (2.11) log the reader's error and raise only "metadata
    # is None"; where torch passes the reader's error on, it must be ours.
    message = str(failed.value)
    assert "metadata read failed" not in message or "no DCP metadata" in message
    assert "metadata" in message


def test_a_full_disk_fails_the_save_and_leaves_no_checkpoint(tiny_fs):
    sd = {"big": torch.randn(6 << 20)}  # 24 MiB on a 16 MiB file system
    with pytest.raises(FAILS) as raised:
        dcp.save(sd, storage_writer=offload.dcp.Writer(tiny_fs / "ck"))
    assert "No space left on device" in str(raised.value) and "__0_0.distcp" in str(raised.value)
    assert not os.path.exists(tiny_fs / "ck" / ".metadata")


def test_a_full_stripe_directory_fails_the_save_naming_it(loop_fs):
    roomy, full = loop_fs(128), loop_fs(16)
    sd = {"a": torch.randn(6 << 20), "b": torch.randn(6 << 20)}  # 24 MiB each, one per directory
    with pytest.raises(FAILS) as raised:
        dcp.save(sd, storage_writer=offload.dcp.Writer(roomy / "ck", stripe=[full]))
    assert "No space left on device" in str(raised.value) and str(full) in str(raised.value)
    assert not os.path.exists(roomy / "ck" / ".metadata")
    assert sorted(os.listdir(full)) == ["lost+found"] and sorted(os.listdir(roomy / "ck")) == []


def test_overwriting_removes_the_old_metadata_before_any_data(tmp_path, monkeypatch):
    path, sd = saved(tmp_path)

    def full_disk(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full_disk)
    with pytest.raises(FAILS, match="No space left"):
        dcp.save(sd, storage_writer=offload.dcp.Writer(path))
    assert not os.path.exists(path / ".metadata")  # the old one would describe the new bytes


def test_a_read_error_mid_load_names_the_file(tmp_path, monkeypatch):
    path, sd = saved(tmp_path)
    real = offload._dcp_reading.open_engine

    def failing(*args, **kwargs):
        engine = real(*args, **kwargs)
        engine.set_faults(1.0, [errno.EIO], 0.0, 0.0, 0, 1)
        return engine
    monkeypatch.setattr(offload._dcp_reading, "open_engine", failing)
    with pytest.raises(FAILS, match="Input/output error") as raised:
        dcp.load(zeroed(sd), storage_reader=offload.dcp.Reader(path))
    assert "__0_0.distcp" in str(raised.value)


def test_a_hostile_record_is_not_unpickled_beyond_tensors(tmp_path):
    import io
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    blob = io.BytesIO()
    torch.save(Evil(), blob)  # a torch.save record whose pickle calls os.system
    with pytest.raises(CheckpointError):
        offload._torch_records.tensor_in_record(memoryview(blob.getvalue()), bytearray(blob.getvalue()), 0, "f.distcp")
    with pytest.raises(pickle.UnpicklingError):
        offload._torch_records._RecordUnpickler(io.BytesIO(pickle.dumps(Evil())), None).load()


@pytest.mark.slow
def test_a_rank_that_fails_to_read_fails_every_rank(tmp_path):
    run("save", "offload", tmp_path / "ck", 2)
    os.unlink(tmp_path / "ck" / "__1_0.distcp")  # only rank 1 reads it
    outputs = run("load", "offload", tmp_path / "ck", 2, tmp_path / "out.pt", expect_ok=False)
    assert all(code != 0 for code, _ in outputs), outputs
    assert all("__1_0.distcp: a data file of this checkpoint is missing" in output for _, output in outputs), outputs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_destinations_stream_through_staging_slots(tmp_path):
    sd = {"w": random_tensor((5 << 20,), torch.float32), "b": torch.randn(10), "t": torch.randn(600, 700).t()}
    dcp.save(sd, storage_writer=offload.dcp.Writer(tmp_path / "ck"))
    out = {k: torch.zeros_like(v, device="cuda") for k, v in sd.items()}
    reader = offload.dcp.Reader(tmp_path / "ck")
    dcp.load(out, storage_reader=reader)
    assert reader.stats.staged == 20 << 20  # the strided and the small one: copied
    assert all(same_bits(out[k].cpu(), sd[k]) for k in sd)


def test_a_load_whose_reads_stop_finishing_warns_once_and_loads(tmp_path, monkeypatch):
    """The DCP reader drives its engine itself: when no read finishes for
    the threshold (every completion held 0.9 s here, threshold 0.5 s), one
    warning names a data file, and the load goes on to the right bytes."""
    import warnings
    from offload import _completion_loop
    path, sd = saved(tmp_path)
    real = offload._dcp_reading.open_engine

    def slow(*args, **kwargs):
        engine = real(*args, **kwargs)
        engine.set_faults(0.0, [], 0.0, 1.0, 900, 1)
        return engine
    monkeypatch.setattr(offload._dcp_reading, "open_engine", slow)
    monkeypatch.setattr(_completion_loop, "QUIET_WAIT_WARNING_S", 0.5)
    out = zeroed(sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(out, storage_reader=offload.dcp.Reader(path))
    quiet = [str(w.message) for w in caught if "none finishing" in str(w.message)]
    assert len(quiet) == 1 and quiet[0].startswith("offload: loading '") and ".distcp'" in quiet[0], quiet
    assert same(out, sd)
