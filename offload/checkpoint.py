"""Checkpoints at disk speed: safetensors files saved and loaded through the
engine, with O_DIRECT, large aligned requests and many in flight.

    offload.save(model.state_dict(), "ckpt/model.safetensors")
    sd = offload.load("ckpt/model.safetensors", device="cuda")
    sd = await offload.load_async("ckpt/model.safetensors")
    sd = offload.load("ckpt/model.safetensors.index.json")   # sharded (Hugging Face layout)
"""
import asyncio
import contextlib
import errno
import json
import os
import sys
import threading

import torch

from . import _sharding
from ._atomic_file import fsync_directory
from ._checkpoint_reading import Loader, load_file
from ._checkpoint_writing import write_files_atomically
from ._safetensors import CODES, CheckpointError, build_header, read_header
from ._tensors import has_no_data, overrides_dispatch

__all__ = ["save", "load", "load_async", "inspect", "CheckpointError"]

def save(tensors, path, metadata=None, *, stripe=(), max_shard_bytes=None, progress=None,
         backend: str = "auto", direct=None, device=None) -> None:
    """Writes ``tensors`` (a {name: tensor} mapping) to ``path`` as a
    safetensors file, atomically: the bytes go to a temporary file with
    O_DIRECT in 8 MiB requests, which is fsynced, renamed over ``path``, and
    the directory fsynced. A crash at any moment leaves the old file or the
    new one. ``metadata`` ({str: str}) is stored as ``__metadata__``.

    A ``path`` ending in ``.index.json`` saves a sharded checkpoint in
    Hugging Face's layout: the index there, and shards of about equal size
    (``<prefix>-00001-of-0000N.safetensors``), one per directory (the
    index's, then each of ``stripe``), more where ``max_shard_bytes`` asks.
    Every shard is written at once, all of them in flight together. A shard
    in another directory is reached through a symlink beside the index, so
    any loader of the layout finds it. Atomic as a whole: the shards go
    under names no file has (``-2``... appended where needed), durable
    before the index is replaced, so a crash at any moment leaves the old
    checkpoint or the new one; the old one's shards are removed after.
    ``metadata`` goes to every shard.

    CPU and CUDA tensors (copied out through page-locked staging, overlapped
    with the writes) are accepted; the tensors are only read. Tensors sharing
    memory (tied weights) are refused, as safetensors' ``save_file`` does:
    save one of them or clone. ``progress``: a tqdm bar (None: when stderr is
    a terminal). ``direct``: None uses O_DIRECT where the file system accepts
    it, and where it does not writes through the page cache with a warning
    naming the directory; False uses the page cache silently; True insists.
    ``device``: a device backend for tests (offload.devices).
    """
    named = _checked(tensors)
    if os.fspath(path).endswith(_sharding.INDEX_SUFFIX):
        _save_sharded(named, os.fspath(path), metadata, stripe, max_shard_bytes, progress=progress,
                      backend=backend, direct=direct, device=device)
        return
    if stripe or max_shard_bytes:
        raise ValueError("stripe= and max_shard_bytes= are for sharded checkpoints: a path ending in "
                         f"{_sharding.INDEX_SUFFIX} (Hugging Face's layout)")
    if os.path.isdir(path):  # (the rename over it would fail naming the temporary file)
        raise IsADirectoryError(errno.EISDIR, "offload.save writes a file, and this is a directory: name the "
                                "file in it (a sharded checkpoint: its .index.json)", os.fspath(path))
    header, entries = build_header(named, metadata)
    _write_atomically(path, header, named, entries, progress=progress, backend=backend, direct=direct,
                      device=device)


def _save_sharded(named, index_path, metadata, stripe, max_shard_bytes, **options) -> None:
    """``save`` of a sharded checkpoint (see there)."""
    directories = _sharding.check_directories(index_path, stripe)
    shards = _sharding.plan(named, len(directories), max_shard_bytes)
    homes = [directories[i % len(directories)] for i in range(len(shards))]
    names = _sharding.shard_names(_sharding.prefix_of(index_path), len(shards), directories)
    index_dir = directories[0]
    replaced = _sharding.old_shards(index_path)
    files = []
    for shard, home, name in zip(shards, homes, names):
        header, entries = build_header(shard, metadata)
        files.append((os.path.join(home, name), header, shard, entries))
    made = []  # what this save put in place: removed if it fails before the index
    try:
        if files:
            write_files_atomically(files, committed=made, **options)
        for (path, *_), home, name in zip(files, homes, names):
            if home != index_dir:
                made.append(_sharding.link(index_dir, name, path))
        fsync_directory(index_dir)
        weight_map = {name: file_name for shard, file_name in zip(shards, names) for name, _ in shard}
        total = sum(t.numel() * t.element_size() for _, t in named)
        _sharding.write_index(index_path, weight_map, total)
    except BaseException:
        for path in reversed(made):
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    _sharding.remove(index_dir, replaced - set(names))


def _write_atomically(path, header, named, entries, *, progress=None, backend="auto", direct=None,
                      device=None) -> None:
    """Writes ``header`` then each tensor of ``named`` at its entry's
    ``begin`` after it, as one new file that replaces ``path`` atomically
    (AtomicFile: fsynced, renamed, directory fsynced), streamed in aligned
    O_DIRECT requests."""
    write_files_atomically([(path, header, named, entries)], progress=progress, backend=backend,
                           direct=direct, device=device)


def load(path, device="cpu", *, progress=None, backend: str = "auto", direct=None) -> dict:
    """Reads a safetensors file (or a sharded checkpoint's ``.index.json``)
    into a {name: tensor} dict on ``device``, in file order.

    The data region is read with O_DIRECT in large aligned requests, many in
    flight. On the CPU, tensors are views into pooled, huge-page buffers of
    about 64 MiB that they share with their neighbours in the file (no extra
    copy); a tensor whose offset is not aligned for its dtype is copied out.
    To a device, chunks stream through page-locked staging buffers, the
    copies of one overlapping the disk reads of the next; when load returns,
    the data is ordered before later work on the current stream.
    ``__metadata__`` is in the ``metadata`` attribute of the returned dict.
    """
    return _load_sync(path, device, progress, backend, direct)


async def load_async(path, device="cpu", *, progress=None, backend: str = "auto", direct=None) -> dict:
    """``load`` inside asyncio: completions are reaped by the event loop
    (the engine's eventfd), which keeps running other tasks meanwhile."""
    shards = _shards(path)
    loaded = {}

    def open_loader(shard, names):
        return Loader(shard, device, progress, backend, direct, names)

    async def load_group(group, loader):
        for i, (shard, names) in enumerate(group):
            loader = loader if i == 0 else open_loader(shard, names)
            try:
                loader.completions.poll()  # (a file with nothing to read is done already)
                await loader.done
                loaded[shard] = loader.result(), loader.header.metadata
            finally:
                loader.close()
    # Shards on different file systems at once (as load does): every group's
    # first shard starts here, before any is awaited.
    groups, firsts = _sharding.load_groups(shards), []
    try:
        for group in groups:
            firsts.append(open_loader(*group[0]))
    except BaseException:
        for loader in firsts:
            loader.close()
        raise
    try:
        outcomes = await asyncio.gather(*(load_group(g, first) for g, first in zip(groups, firsts)),
                                        return_exceptions=True)
    finally:
        for loader in firsts:  # (closed already, unless cancelled before its task began)
            loader.close()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return _merged(shards, loaded)


def inspect(path) -> dict:
    """The header of a safetensors file: {"tensors": [...], "metadata": {...}, ...}.
    For a sharded checkpoint's ``.index.json``: every shard's, under
    "shards" (each with its "location", symlinks resolved), and all their
    tensors under "tensors", each naming its "shard"; under "unlisted", files
    beside the index named as shards that it does not list (left by a save
    that did not finish: remove them by hand)."""
    if not os.fspath(path).endswith(_sharding.INDEX_SUFFIX):
        return _inspect_file(path)
    shards, tensors, metadata = [], [], {}
    for shard, names in _shards(path):
        info = _inspect_file(shard)
        info["tensors"] = [dict(t, shard=os.path.basename(shard)) for t in info["tensors"] if t["name"] in names]
        info["location"] = os.path.realpath(shard)
        shards.append(info)
        tensors += info["tensors"]
        metadata.update(info["metadata"])
    return {"path": os.fspath(path), "file_bytes": sum(s["file_bytes"] for s in shards), "metadata": metadata,
            "tensors": tensors, "shards": shards, "unlisted": _sharding.unlisted_shards(path)}


def _inspect_file(path) -> dict:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = read_header(fd, os.fspath(path))
    finally:
        os.close(fd)
    return {"path": os.fspath(path), "file_bytes": header.file_size, "data_offset": header.data_start,
            "metadata": header.metadata, "tensors": header.describe()}


class StateDict(dict):
    """A dict of tensors with the file's ``__metadata__`` as ``metadata``."""

    metadata = {}


# ------------------------------------------------------------------ helpers
def _load_sync(path, device, progress, backend, direct) -> dict:
    """The shards on each file system load one after another, those on
    different file systems (several drives) at once, a thread per file
    system; the result is in the index's shard order either way."""
    shards = _shards(path)
    loaded = {}
    errors = []

    def load_group(group):
        try:
            for shard, names in group:
                loaded[shard] = load_file(shard, device, progress, backend, direct, names)
        except BaseException as error:  # (raised by the caller once every group has stopped)
            errors.append(error)
    def load_group_on_the_callers_stream(group):
        with callers_stream():
            load_group(group)
    groups = _sharding.load_groups(shards) or [[]]  # (an index listing no tensors: nothing to read)
    callers_stream = _callers_stream(device) if len(groups) > 1 else contextlib.nullcontext
    threads = [threading.Thread(target=load_group_on_the_callers_stream, args=(group,),
                                name="offload-load-shards", daemon=True) for group in groups[1:]]
    for thread in threads:
        thread.start()
    load_group(groups[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return _merged(shards, loaded)


def _callers_stream(device):
    """For loads to a CUDA device on other threads: a context manager factory
    that makes the calling thread's current stream current there too, so the
    tensors are allocated on it and the data is ordered before later work on
    it, as for a load on the calling thread. Nothing to do for the CPU and
    test devices."""
    try:
        target = torch.device(device)  # ('cuda', 0, torch.device...; a test device is none of them)
    except (TypeError, RuntimeError):
        return contextlib.nullcontext
    if target.type != "cuda" or not torch.cuda.is_available():  # (the loaders refuse the latter)
        return contextlib.nullcontext
    stream = torch.cuda.current_stream(target)
    return lambda: torch.cuda.stream(stream)


def _merged(shards, loaded) -> StateDict:
    """The tensors and metadata of every shard (``loaded``: file -> (tensors,
    metadata)), in the index's shard order."""
    result, result_metadata = {}, {}
    for shard, _ in shards:
        tensors, metadata = loaded[shard]
        result.update(tensors)
        result_metadata.update(metadata)
    return _with_metadata(result, result_metadata)


def _with_metadata(result, metadata) -> StateDict:
    out = StateDict(result)
    out.metadata = metadata
    return out


def _shards(path):
    """(file, names wanted or None) for a file or a sharded index."""
    path = os.fspath(path)
    if not path.endswith(".index.json"):
        return [(path, None)]
    try:
        with open(path) as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}: not a sharded checkpoint index ({error})") from None
    shards = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{path}: tensor {name!r} maps to {shard!r}: shards must be file names "
                                  "in the index's directory")
        shards.setdefault(shard, []).append(name)
    directory = os.path.dirname(path)
    return [(os.path.join(directory, shard), set(names)) for shard, names in shards.items()]


def _checked(tensors) -> list:
    if not hasattr(tensors, "items"):
        raise TypeError("save() takes a mapping of names to tensors (a state_dict)")
    named, spans = [], []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided or t.dtype not in CODES or t.is_nested:
            kind = "nested" if t.is_nested else f"{t.layout} {t.dtype}"
            raise ValueError(f"{name!r}: cannot store a {kind} tensor in safetensors")
        if overrides_dispatch(t):
            raise ValueError(f"{name!r} is a {type(t).__name__}, a tensor subclass with no memory of its own "
                             "(FakeTensor, DTensor, wrapper tensors): save the plain tensor it wraps")
        if t.is_conj() or t.is_neg():
            # A lazy conjugate or negation: the bytes in memory are not the values, and
            # safetensors has no flag for it. Its values are stored (a copy of this tensor).
            t = t.resolve_conj().resolve_neg()
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name!r}: tensors on {t.device} are not supported: use CPU or CUDA tensors")
        if has_no_data(t):
            raise ValueError(f"{name!r} has no data: its memory was released (offloaded?)")
        nbytes = t.numel() * t.element_size()
        if nbytes:
            start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            spans.append((t.device, start, start + nbytes, name))
        named.append((name, t))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError(f"{a[3]!r} and {b[3]!r} share memory (tied weights?): safetensors stores "
                             "each tensor once; save one of them, or a clone")
    # The safetensors package's order: larger elements first (keeps offsets aligned), then by name.
    named.sort(key=lambda item: (-item[1].element_size(), item[0]))
    return named


def main(argv) -> int:
    """python -m offload inspect FILE [--json] (a safetensors file, or a sharded checkpoint's index)"""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m offload inspect",
                                     description="List the tensors of a safetensors file, or of every shard "
                                                 "of a sharded checkpoint's .index.json.")
    parser.add_argument("file")
    parser.add_argument("--json", action="store_true", help="print the header as JSON")
    args = parser.parse_args(argv)
    try:
        info = inspect(args.file)
    except (OSError, CheckpointError) as error:
        print(f"offload inspect: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    tensors = info["tensors"]
    if "shards" in info:
        print(f"{info['path']}: {len(tensors)} tensors in {len(info['shards'])} shards, {info['file_bytes']} bytes")
        for shard in info["shards"]:
            print(f"  shard {os.path.basename(shard['path'])}: {len(shard['tensors'])} tensors, "
                  f"{shard['file_bytes']} bytes, at {shard['location']}")
        for name in info["unlisted"]:
            print(f"  not in the index: {name} (left by a save that did not finish? nothing reads it: "
                  "remove it by hand)")
    else:
        print(f"{info['path']}: {len(tensors)} tensors, {info['file_bytes']} bytes, data at {info['data_offset']}")
    for key, value in info["metadata"].items():
        print(f"  metadata {key} = {value}")
    width = max([len(t["name"]) for t in tensors] + [4])
    for t in tensors:
        print(f"  {t['name']:{width}}  {t['dtype']:14} {str(tuple(t['shape'])):20} {t['bytes']:>12} B")
    return 0
