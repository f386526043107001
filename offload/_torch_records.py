"""torch.save records of one tensor, the unit of DCP's FileSystemWriter
layout: written from a tensor's own memory (torch.save runs with its data
skipped, for the bytes around it), and read back without torch.load (a
restricted unpickler; the storage is a view of the read buffer). Also the
record's layout from its first bytes alone: where its storage's bytes lie
and what tensor they make, so a reader can send them straight to their
destination."""
import contextlib
import io
import pickle
import struct

import torch

from ._safetensors import CheckpointError


def bytes_tensor(buffer) -> torch.Tensor:
    return torch.frombuffer(bytearray(buffer), dtype=torch.uint8) if len(buffer) else \
        torch.empty(0, dtype=torch.uint8)


def save_pieces(tensor) -> list:
    """``torch.save(tensor)``'s bytes as three pieces: the record's head, the
    storage's bytes (the tensor's own memory, not copied here, unless the
    tensor views only part of its storage: then a copy of the view) and its
    tail.
    The head and tail come from torch.save itself, run with the data skipped
    (it seeks over the storage) and CRC-32s off (torch.load does not check
    them when they are off)."""
    tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        # A view of a larger storage: torch.save would store all of it (as
        # DCP's FileSystemWriter does, keep only the view's own bytes).
        tensor = tensor.clone()
    storage = tensor.untyped_storage()
    sink = _SeekingSink()
    with _crc32s_off(), torch.serialization.skip_data():
        torch.save(tensor, sink)
    head, gap, tail = sink.around_gap()
    if gap != storage.nbytes():
        raise CheckpointError(f"torch.save skipped {gap} bytes for a storage of {storage.nbytes()}")
    data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (gap,), (1,)) if gap else \
        torch.empty(0, dtype=torch.uint8)
    return [bytes_tensor(head), data, bytes_tensor(tail)]


_get_crc32_options = getattr(torch.serialization, "get_crc32_options", None)  # torch 2.6+


@contextlib.contextmanager
def _crc32s_off():
    """torch.save without CRC-32s where torch lets them be turned off (2.6
    and later). Older torch writes them, with 0 for the skipped storage;
    torch.load does not check them (such records load on 2.5 and 2.13)."""
    if _get_crc32_options is None:
        yield
        return
    crc = _get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(crc)


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


def _zip_records(raw):
    """(name, data offset, size) of each member of a stored (uncompressed)
    zip: ``raw`` is its bytes, or a _Probed part of them."""
    if not isinstance(raw, _Probed):
        raw = memoryview(raw)
    # The end of central directory is in the last 64 KiB + 22 bytes (or in
    # the probed tail).
    tail = raw.tail if isinstance(raw, _Probed) else bytes(raw[max(0, len(raw) - (1 << 16) - 22):])
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
    if metadata:  # {"conj": True} or {"neg": True}: the stored bytes are not the values
        raise ValueError(f"a record with tensor metadata {sorted(metadata)}: torch.load rebuilds it")
    dtype, untyped = storage
    return torch.empty(0, dtype=dtype, device=untyped.device).set_(untyped, offset, size, stride)


def tensor_in_record(record, buffer, record_offset, path) -> torch.Tensor:
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
            tensor = _load_record(record)
        except Exception as error:
            raise CheckpointError(f"{path}: a record is not a torch.save tensor ({error})") from None
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: a record holds a {type(tensor).__name__}, not a tensor")
        return tensor


def _load_record(record) -> torch.Tensor:
    """A record this module does not parse itself, through torch.load (a copy)."""
    return torch.load(io.BytesIO(bytes(record)), map_location="cpu", weights_only=True)


class _Probed:
    """The first and last bytes of a record of ``size`` bytes, sliced as the
    whole record would be; a slice reaching between them raises ValueError."""

    def __init__(self, head, tail, size):
        self.head, self.tail, self.size = bytes(head), bytes(tail), size

    def __len__(self):
        return self.size

    def __getitem__(self, span):
        lo, hi, _ = span.indices(self.size)
        if hi <= len(self.head):
            return self.head[lo:hi]
        tail_at = self.size - len(self.tail)
        if lo >= tail_at:
            return self.tail[lo - tail_at:hi - tail_at]
        raise ValueError("the record's layout lies beyond the bytes probed")


def record_layout(head, tail, record_length: int):
    """Where a one-tensor torch.save record keeps its storage's bytes, from
    the record's first bytes ``head`` and last bytes ``tail`` alone (the zip
    directory, the local headers and the pickle lie there; the storage's
    bytes between them): (their offset in the record, their length, the
    tensor on the meta device: dtype, shape, strides, storage offset). None
    when the probed bytes do not show it all, or the record is not of that
    kind: the caller then reads the whole record."""
    try:
        raw = _Probed(head, tail, record_length)
        members = {name.split("/", 1)[-1]: (start, size) for name, start, size in _zip_records(raw)}
        start, size = members["data/0"]
        pkl_start, pkl_size = members["data.pkl"]
        if start + size > record_length:
            return None
        storage = torch.UntypedStorage(size, device="meta")
        tensor = _RecordUnpickler(io.BytesIO(raw[pkl_start:pkl_start + pkl_size]), storage).load()
        return (start, size, tensor) if isinstance(tensor, torch.Tensor) else None
    except (ValueError, KeyError, pickle.UnpicklingError, struct.error, RuntimeError, TypeError, EOFError):
        return None
