"""offload as a storage layer for torch.distributed.checkpoint (DCP).

``Writer`` and ``Reader`` implement DCP's ``StorageWriter`` / ``StorageReader``
over offload's engine (io_uring, O_DIRECT, many large requests in flight).
The files are DCP's own ``FileSystemWriter`` layout, byte for byte in kind:
``__{rank}_{n}.distcp`` data files holding one ``torch.save`` record per item
at the offsets ``.metadata`` lists, and ``.metadata`` the pickled
``Metadata``. A checkpoint written by either loads with the other.

Durability and atomicity: every file (data and ``.metadata``) is written
as an AtomicFile, as ``offload.save`` writes: allocated whole first (ENOSPC
before any byte moves), fsynced, renamed into place, the directory fsynced.
``.metadata`` is written last, in ``finish``, and overwriting removes the old
``.metadata`` before any data file is touched, so a crash at any moment
leaves either a complete checkpoint or one that DCP refuses to load (no
``.metadata``), never old metadata over new bytes.

Errors name the file. In a distributed save or load, DCP gathers every
rank's exception in its collectives (``CheckpointException`` on all ranks),
so a rank that fails does not leave the others waiting.
"""
import collections
import dataclasses
import io
import os
import pickle
import struct
import uuid

import torch

try:
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
except ImportError as error:  # the rest of offload works on older torch
    raise ImportError(f"offload.dcp needs the torch.distributed.checkpoint storage API of newer torch "
                      f"(this is torch {torch.__version__}: {error})") from error

from ._direct_io import open_data_for_reading, round_down, round_up
from ._completion_loop import CompletionLoop
from ._engines import open_engine
from ._errors import os_error
from ._atomic_file import AtomicFile
from .checkpoint import CheckpointError, _write_atomically, read_unaligned_end
from ._pool import buffer_pool

_METADATA = ".metadata"
_SUFFIX = ".distcp"
_SEGMENT = 64 << 20   # bytes read into one pool buffer
_SEGMENTS_IN_FLIGHT = 4
_GAP = 1 << 20        # items closer than this are read in one request
_WAIT_MS = 50


class _AtPath:
    """A checkpoint is a directory: its path is DCP's checkpoint_id."""

    path: str

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class Writer(_AtPath, StorageWriter):
    """Writes a DCP checkpoint into the directory ``path`` (created if
    needed), durably, as described in the module docstring; ``backend``
    picks the engine as the Offloader does."""

    def __init__(self, path, *, backend: str = "auto", direct=None):
        super().__init__()
        self.path = os.fspath(path)
        self.backend, self.direct = backend, direct
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = True

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        os.makedirs(self.path, exist_ok=True)
        if self.is_coordinator:  # before any rank writes data (the plans are gathered in between)
            metadata = os.path.join(self.path, _METADATA)
            if os.path.exists(metadata):
                os.unlink(metadata)
                _fsync_dir(self.path)
        return plan

    def prepare_global_plan(self, plans):
        return [plan if plan.storage_data is not None else
                dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_")) for i, plan in enumerate(plans)]

    def write_data(self, plan, planner) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0{_SUFFIX}"
        pieces, results, offset = [], [], 0
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                record = [_bytes_tensor(data.getbuffer())]
            else:
                record = _torch_save_pieces(data)
            length = sum(p.numel() for p in record)
            pieces += record
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
            offset += length
        path, entries, begin = os.path.join(self.path, name), [], 0
        for piece in pieces:
            entries.append(_Extent(begin, begin + piece.numel()))
            begin += piece.numel()
        try:
            _write_atomically(path, b"", [(None, p) for p in pieces], entries, backend=self.backend,
                              direct=self.direct)
        except OSError as error:
            if error.filename is not None:
                raise
            raise os_error(error.errno, path, "while saving a DCP checkpoint") from None
        future = torch.futures.Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results) -> None:
        metadata.version = "1.0.0"
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        target = AtomicFile(os.path.join(self.path, _METADATA), direct=False)
        try:
            with os.fdopen(os.dup(target.fd), "wb") as f:
                pickle.dump(metadata, f)
            target.commit()
        except BaseException:
            target.abort()
            raise

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


class Reader(_AtPath, StorageReader):
    """Reads a DCP checkpoint from ``path``: each rank's items are read with
    O_DIRECT in requests of up to 64 MiB (neighbours merged), many in flight,
    and each tensor is copied from the read buffer straight into the
    destination DCP resolves (no intermediate tensor)."""

    def __init__(self, path, *, backend: str = "auto", direct=None):
        super().__init__()
        self.path = os.fspath(path)
        self.backend, self.direct = backend, direct
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = os.path.join(self.path, _METADATA)
        try:
            with open(path, "rb") as f:
                metadata = pickle.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no DCP metadata: not a checkpoint, or its save did not finish") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as error:
            raise CheckpointError(f"{path}: not DCP metadata ({error})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> torch.futures.Future:
        per_file = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info.offset, info.length, item))
        for relative, items in per_file.items():
            _FileReader(os.path.join(self.path, relative), items, planner, self.backend, self.direct).run()
        future = torch.futures.Future()
        future.set_result(None)
        return future


# ------------------------------------------------------------------ writing
def _bytes_tensor(buffer) -> torch.Tensor:
    return torch.frombuffer(bytearray(buffer), dtype=torch.uint8) if len(buffer) else \
        torch.empty(0, dtype=torch.uint8)


def _torch_save_pieces(tensor) -> list:
    """``torch.save(tensor)``'s bytes as three pieces: the record's head, the
    storage's bytes (the tensor's own memory, not copied here) and its tail.
    The head and tail come from torch.save itself, run with the data skipped
    (it seeks over the storage) and CRC-32s off (torch.load does not check
    them when they are off)."""
    tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    storage = tensor.untyped_storage()
    sink = _SeekingSink()
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        with torch.serialization.skip_data():
            torch.save(tensor, sink)
    finally:
        torch.serialization.set_crc32_options(crc)
    head, gap, tail = sink.around_gap()
    if gap != storage.nbytes():
        raise CheckpointError(f"torch.save skipped {gap} bytes for a storage of {storage.nbytes()}")
    data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (gap,), (1,)) if gap else \
        torch.empty(0, dtype=torch.uint8)
    return [_bytes_tensor(head), data, _bytes_tensor(tail)]


class _SeekingSink:
    """A file for torch.save that keeps what is written and where, and
    allocates nothing for the span it seeks over (the skipped storage)."""

    def __init__(self):
        self.pieces, self.pos = [], 0

    def write(self, b) -> int:
        b = bytes(b)
        self.pieces.append((self.pos, b))
        self.pos += len(b)
        return len(b)

    def seek(self, offset, whence=io.SEEK_SET) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset if whence == io.SEEK_CUR else \
            max((p + len(b) for p, b in self.pieces), default=0) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def around_gap(self):
        """(bytes before the one unwritten span, its length, bytes after)."""
        image, end = bytearray(), 0
        gap_at, gap = None, 0
        for pos, b in sorted(self.pieces, key=lambda piece: piece[0]):
            if pos > end:
                if gap_at is not None:
                    raise CheckpointError("torch.save left more than one span unwritten")
                gap_at, gap = len(image), pos - end
            elif pos < end:
                raise CheckpointError("torch.save wrote over its own bytes")
            image += b
            end = pos + len(b)
        if gap_at is None:  # an empty storage: nothing was skipped
            gap_at = len(image)
        return bytes(image[:gap_at]), gap, bytes(image[gap_at:])


class _Extent:
    __slots__ = ("begin", "end")

    def __init__(self, begin, end):
        self.begin, self.end = begin, end


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ reading
class _FileReader:
    """Reads one data file's items: merged, aligned O_DIRECT requests into
    pool buffers, then each item handed to the planner."""

    def __init__(self, path, items, planner, backend, direct):
        self.path, self.planner = path, planner
        self.items = sorted(items, key=lambda x: x[0])
        self.backend, self.direct = backend, direct
        self._error = None

    def run(self) -> None:
        try:
            meta_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path}: a data file of this checkpoint is missing") from None
        fd, engine = meta_fd, None
        try:
            size = os.fstat(meta_fd).st_size
            end = max(offset + length for offset, length, _ in self.items)
            if end > size:
                raise CheckpointError(f"{self.path}: truncated: the metadata lists bytes up to {end}, "
                                      f"the file has {size}")
            fd = open_data_for_reading(self.path, meta_fd, self.direct)
            engine = open_engine(self.backend, 64, 8 << 20, 8, 256 << 20)
            completions = CompletionLoop(engine, None)  # driven here alone: no waits, no handles
            in_flight = completions.pending
            pending = collections.deque(self._segments())
            while pending or in_flight:
                # At most _SEGMENTS_IN_FLIGHT buffers at once: each is copied out
                # while the others are read, then reused for the next segment.
                while pending and len(in_flight) < _SEGMENTS_IN_FLIGHT and self._error is None:
                    lo, hi, group = pending.popleft()
                    buffer = buffer_pool().acquire(round_up(hi - lo))
                    aligned_hi = read_unaligned_end(meta_fd, self.path, memoryview(buffer), lo, hi, size)
                    if aligned_hi > lo:
                        tag = completions.new_tag(self._landed, (buffer, lo, group))
                        engine.submit_read(tag, fd, buffer.address, aligned_hi - lo, lo)
                    else:
                        self._deliver(buffer, lo, group)
                if not in_flight:
                    break
                engine.wait(_WAIT_MS)
                completions.reap()
            if self._error is not None:
                raise self._error
        finally:
            if engine is not None:
                engine.close()  # waits for reads in flight before their buffers go
            if fd != meta_fd:
                os.close(fd)
            os.close(meta_fd)

    def _landed(self, segment, result) -> None:
        if result < 0:
            self._error = self._error or os_error(-result, self.path, "while loading a DCP checkpoint")
        elif self._error is None:
            self._deliver(*segment)

    def _segments(self) -> list:
        segments, group, lo, hi = [], [], 0, 0
        for offset, length, item in self.items:
            if group and (offset - hi > _GAP or offset + length - lo > _SEGMENT):
                segments.append((lo, hi, group))
                group = []
            if not group:
                lo = round_down(offset)
                hi = offset
            group.append((offset, length, item))
            hi = max(hi, offset + length)
        if group:
            segments.append((lo, hi, group))
        return segments

    def _deliver(self, buffer, lo, group) -> None:
        view = memoryview(buffer)
        for offset, length, item in group:
            record = view[offset - lo:offset - lo + length]
            if item.type == LoadItemType.BYTE_IO:
                self.planner.load_bytes(item, io.BytesIO(bytes(record)))
                continue
            tensor = _torch_load(record, buffer, offset - lo, self.path)
            for dim, (start, count) in enumerate(zip(item.storage_offsets, item.lengths)):
                tensor = tensor.narrow(dim, start, count)
            target = self.planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise CheckpointError(f"{self.path}: item {item.storage_index.fqn!r} has shape "
                                      f"{tuple(tensor.size())}, the destination {tuple(target.size())}")
            target.copy_(tensor)
            self.planner.commit_tensor(item, target)


# --------------------------------------------------------- torch.save records
def _storage_record(raw):
    """(offset, size) of the storage bytes in a one-storage torch.save record."""
    for name, start, size in _zip_records(raw):
        if name.endswith("/data/0"):
            return start, size
    raise CheckpointError("torch.save record without a storage")


def _zip_records(raw):
    """(name, data offset, size) of each member of a stored (uncompressed) zip."""
    raw = memoryview(raw)
    tail = bytes(raw[max(0, len(raw) - (1 << 16) - 22):])
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise ValueError("no end of central directory")
    count, cd_size, cd_offset = struct.unpack("<HII", tail[eocd + 10:eocd + 20])
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF:  # zip64
        locator = tail.rfind(b"PK\x06\x07", 0, eocd)
        if locator < 0:
            raise ValueError("zip64 without a locator")
        (eocd64,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
        count, cd_size, cd_offset = struct.unpack("<QQQ", bytes(raw[eocd64 + 32:eocd64 + 56]))
    records, at = [], cd_offset
    for _ in range(count):
        header = bytes(raw[at:at + 46])
        if header[:4] != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        method, size, name_len, extra_len, comment_len, local = (
            struct.unpack("<H", header[10:12])[0], struct.unpack("<I", header[24:28])[0],
            *struct.unpack("<HHH", header[28:34]), struct.unpack("<I", header[42:46])[0])
        name = bytes(raw[at + 46:at + 46 + name_len]).decode()
        extra = bytes(raw[at + 46 + name_len:at + 46 + name_len + extra_len])
        if size == 0xFFFFFFFF or local == 0xFFFFFFFF:
            size, local = _zip64_sizes(extra, size, local)
        if method != 0:
            raise ValueError(f"{name} is compressed")
        local_name, local_extra = struct.unpack("<HH", bytes(raw[local + 26:local + 30]))
        records.append((name, local + 30 + local_name + local_extra, size))
        at += 46 + name_len + extra_len + comment_len
    return records


def _zip64_sizes(extra, size, local):
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[at:at + 4])
        if tag == 1:
            fields = extra[at + 4:at + 4 + length]
            values = list(struct.unpack(f"<{length // 8}Q", fields))
            if size == 0xFFFFFFFF:
                values.pop(0)            # uncompressed size
                size = values.pop(0)     # compressed (stored: the same)
            if local == 0xFFFFFFFF:
                local = values.pop(0)
            return size, local
        at += 4 + length
    raise ValueError("zip64 sizes missing")


class _RecordUnpickler(pickle.Unpickler):
    """Unpickles a torch.save record of one tensor, allowing only what such a
    record contains; the storage is a view of the read buffer."""

    def __init__(self, file, storage):
        super().__init__(file)
        self.storage = storage

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            import collections
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            try:
                return _StorageType(torch.storage._get_dtype_from_pickle_storage_type(name))
            except KeyError:
                pass
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor record")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[2] == "0"):
            raise pickle.UnpicklingError("not a tensor record's storage")
        return (pid[1].dtype, self.storage)


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype


def _rebuild(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    dtype, untyped = storage
    return torch.empty(0, dtype=dtype).set_(untyped, offset, size, stride)


def _torch_load(record, buffer, record_offset, path) -> torch.Tensor:
    """The tensor a torch.save record holds, viewing the read buffer (no
    copy). Records of another shape fall back to torch.load."""
    try:
        members = {name.split("/", 1)[-1]: (start, size) for name, start, size in _zip_records(record)}
        start, size = members["data/0"]
        pkl_start, pkl_size = members["data.pkl"]
        storage = torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=record_offset + start) \
            .untyped_storage() if size else torch.UntypedStorage(0)
        tensor = _RecordUnpickler(io.BytesIO(bytes(record[pkl_start:pkl_start + pkl_size])), storage).load()
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("not a tensor")
        return tensor
    except (ValueError, KeyError, pickle.UnpicklingError, struct.error, RuntimeError, TypeError):
        try:
            return _load_record(record)
        except Exception as error:
            raise CheckpointError(f"{path}: a record is not a torch.save tensor ({error})") from None


def _load_record(record) -> torch.Tensor:
    """A record this module does not parse itself, through torch.load (a copy)."""
    return torch.load(io.BytesIO(bytes(record)), map_location="cpu", weights_only=True)
