"""The safetensors file format: an 8-byte little-endian header length, a
JSON header, then the tensors' bytes, contiguous, in the header's offsets.

The parser treats the file as hostile: every way a header can lie raises
``CheckpointError`` naming the file and, where there is one, the tensor.
Nothing is ever unpickled.
"""
import errno
import json
import os
import struct

import torch

from ._errors import os_error

MAX_HEADER_BYTES = 100 << 20   # the safetensors package's own limit
DATA_ALIGNMENT = 4096          # save() pads the header so that the data starts here

_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}
DTYPES = {code: getattr(torch, name) for code, name in _DTYPES.items() if hasattr(torch, name)}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that is not a valid safetensors file (or not the one
    the caller meant). The message names the file and the tensor."""


class TensorEntry:
    """One tensor of a file: where its bytes are, relative to the data region."""

    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Header:
    """A parsed header: entries in file order, metadata, where data starts."""

    def __init__(self, path, entries, metadata, data_start, file_size):
        self.path, self.entries, self.metadata = path, entries, metadata
        self.data_start, self.file_size = data_start, file_size

    def describe(self) -> list:
        return [{"name": e.name, "dtype": str(e.dtype).replace("torch.", ""), "shape": list(e.shape),
                 "bytes": e.nbytes, "offset": self.data_start + e.begin} for e in self.entries]


def read_header(fd: int, path: str) -> Header:
    """Parses the header of the open file ``fd`` (any file position; pread)."""
    import os
    file_size = os.fstat(fd).st_size
    if file_size < 8:
        raise CheckpointError(f"{path}: {file_size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, path))
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + length > file_size:
        raise CheckpointError(f"{path}: header length {length} runs past the end of the "
                              f"{file_size}-byte file (truncated?)")
    return parse_header(_pread_exact(fd, length, 8, path), file_size, path)


def parse_header(raw: bytes, file_size: int, path: str) -> Header:
    """Validates a header (the bytes after the length) for a file of ``file_size`` bytes."""
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    try:
        text = raw.decode("utf-8")
        document = json.loads(text, object_pairs_hook=_refuse_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{path}: the header is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{path}: the header is a JSON {type(document).__name__}, not an object")
    metadata = document.pop("__metadata__", None)
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    entries = [_entry(name, info, path) for name, info in document.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for entry in entries:
        if entry.begin != expected:
            what = "overlaps the tensor before it" if entry.begin < expected else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {entry.name!r} at data offset {entry.begin} {what} "
                                  f"(expected {expected}): extents must be contiguous and disjoint")
        expected = entry.end
    if expected > data_size:
        late = next(e for e in entries if e.end > data_size)
        raise CheckpointError(f"{path}: tensor {late.name!r} ends at data offset {late.end}, past the "
                              f"{data_size} bytes of data in the file (truncated mid-tensor?)")
    if expected < data_size:
        raise CheckpointError(f"{path}: {data_size - expected} bytes after the last tensor: not a "
                              "valid safetensors file (or a different one was appended)")
    return Header(path, entries, metadata or {}, data_start, file_size)


def build_header(named, metadata) -> tuple:
    """The header bytes (length prefix included, padded with spaces so the
    data starts at a multiple of DATA_ALIGNMENT) and the entries, for
    ``named``: (name, tensor) pairs in the order they are stored."""
    document, entries, offset = {}, [], 0
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must map strings to strings")
        document["__metadata__"] = dict(metadata)
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        document[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + nbytes]}
        entries.append(TensorEntry(name, t.dtype, tuple(t.shape), offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(document, separators=(",", ":")).encode()
    padded = -(-(8 + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - 8
    return struct.pack("<Q", padded) + text + b" " * (padded - len(text)), entries


def _entry(name, info, path) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {name!r}: expected an object, got {type(info).__name__}")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r}: unknown or unsupported dtype {code!r}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CheckpointError(f"{path}: tensor {name!r}: shape must be a list of non-negative integers, "
                              f"got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets must be [begin, end] with "
                              f"0 <= begin <= end, got {offsets!r}")
    dtype = DTYPES[code]
    if not _torch_can_hold(shape, dtype):
        raise CheckpointError(f"{path}: tensor {name!r}: shape {shape} is beyond what torch can hold "
                              "(a size, stride or their product overflows int64)")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes != offsets[1] - offsets[0]:
        raise CheckpointError(f"{path}: tensor {name!r}: shape {shape} of {code} is {nbytes} bytes but "
                              f"its data_offsets span {offsets[1] - offsets[0]}")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _torch_can_hold(shape, dtype) -> bool:
    """Whether torch can make a tensor of ``shape``. Only an empty tensor's
    shape can fail with a valid file (any other is bounded by the file's
    size), so those are asked of torch itself, on the meta device (no
    memory): its limits on sizes, strides and their products differ by
    version."""
    if any(n > _INT64_MAX for n in shape):
        return False
    if 0 not in shape:
        return True
    try:
        torch.empty(shape, dtype=dtype, device="meta")
    except (RuntimeError, ValueError, OverflowError):
        return False
    return True


_INT64_MAX = (1 << 63) - 1


def _refuse_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the name {duplicate!r} appears twice")
    return dict(pairs)


def _pread_exact(fd, length, offset, path) -> bytes:
    try:
        data = os.pread(fd, length, offset)
    except OSError as error:  # (pread names no file)
        raise os_error(error.errno, os.fspath(path), "a directory, not a checkpoint file"
                       if error.errno == errno.EISDIR else "while reading the header") from None
    if len(data) != length:
        raise CheckpointError(f"{path}: the file ended after {offset + len(data)} bytes (truncated)")
    return data
