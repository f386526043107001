"""Checkpoints at disk speed: safetensors files saved and loaded through the
engine, with O_DIRECT, large aligned requests and many in flight.

    offload.save(model.state_dict(), "ckpt/model.safetensors")
    sd = offload.load("ckpt/model.safetensors", device="cuda")
    sd = await offload.load_async("ckpt/model.safetensors")
    sd = offload.load("ckpt/model.safetensors.index.json")   # sharded (Hugging Face layout)
"""
import asyncio
import bisect
import collections
import contextlib
import errno
import json
import os
import sys
import threading
import warnings

import torch

from . import _core, _sharding
from ._direct_io import BLOCK, open_data_for_reading, round_down, round_up
from ._atomic_file import AtomicFile, HeldFrees, fsync_directory
from ._completion_loop import CompletionLoop
from ._engines import open_engine
from ._errors import os_error
from ._safetensors import CODES, CheckpointError, build_header, read_header
from ._tensors import byte_view, copy_bytes, has_no_data, overrides_dispatch
from .device_pipeline import CopyQueue, StagingRing, device_skip
from .devices import DeviceResolver
from .handle import Handle
from ._pool import advised_page_sizes, buffer_pool, collapse_when_idle

__all__ = ["save", "load", "load_async", "inspect", "CheckpointError"]

_CHUNK = 8 << 20      # bytes per request of a save, and per staging slot
_SEGMENT = 64 << 20   # CPU loads: tensors share read buffers of about this size
_SLOTS = 16           # staging buffers in flight (saves, device loads)
_PIECE = 32 << 20     # CPU loads: new buffers are faulted in, and read, this much at a time
_WAIT_MS = 50


def _prefault_threads() -> int:
    """Threads that fault in a CPU load's new buffers: OFFLOAD_PREFAULT_THREADS,
    else one. One thread faulted 1.1-3.5 GB/s of 4 KiB pages on the VMs
    measured, less than fast NVMe reads, but more threads did not load faster
    there (BENCHMARKS.md, checkpoints; likely their faults wait on the same host):
    the setting is for machines where they do."""
    setting = os.environ.get("OFFLOAD_PREFAULT_THREADS", "").strip()
    return int(setting) if setting.isdigit() and int(setting) > 0 else 1


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
    a terminal). ``device``: a device backend for tests (offload.devices).
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
            _write_files_atomically(files, committed=made, warn_buffered=len(directories) > 1, **options)
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
    _write_files_atomically([(path, header, named, entries)], progress=progress, backend=backend,
                            direct=direct, device=device)


def _write_files_atomically(files, *, progress=None, backend="auto", direct=None, device=None,
                            committed=None, warn_buffered=False) -> None:
    """``_write_atomically`` of several files (path, header, named, entries)
    at once: one engine, one staging ring, the files' chunks interleaved so
    that every file has writes in flight. Once all are written, they are
    fsynced at once (a thread each), then each is committed in turn; a
    failure before that leaves every old file as it was. The files replaced
    are freed once the last is committed (``HeldFrees``). The paths
    committed are appended to ``committed`` as they are. Errors name the
    file. ``warn_buffered``: warn for each directory that refuses O_DIRECT
    (its files go through the page cache)."""
    targets, engine = [], None
    try:
        for path, header, named, entries in files:
            targets.append(AtomicFile(path, direct))
        if warn_buffered and direct is None:
            for directory in sorted({t.directory for t in targets if not t.direct}):
                warnings.warn(f"offload.save: the file system of {directory!r} refuses O_DIRECT; its shards "
                              "are written through the page cache", RuntimeWarning, stacklevel=4)
        outputs = [_OutFile(target, header, named, entries)
                   for target, (_, header, named, entries) in zip(targets, files)]
        for out in outputs:
            # Allocating the whole file first: ENOSPC before any byte moves, and
            # the O_DIRECT writes land in allocated extents.
            try:
                if out.total:
                    os.posix_fallocate(out.target.fd, 0, out.total)
            except OSError as error:
                raise os_error(error.errno, out.target.path, "while allocating the new file") from None
        engine = open_engine(backend, 64, 4 << 20, 8)
        name = os.path.basename(targets[0].path) + (f" and {len(targets) - 1} more" if len(targets) > 1 else "")
        with _progress(progress, sum(out.total for out in outputs), f"saving {name}") as bar:
            _Writer(engine, outputs, device, bar).run()
        for out in outputs:
            os.ftruncate(out.target.fd, out.total)
        if len(targets) > 1:  # files on several drives: their fsyncs overlap too
            _fsync_all(targets)
        held = HeldFrees()
        try:
            with held.holding():
                for target in targets:
                    try:
                        target.commit()
                    except OSError as error:
                        if error.filename is not None:
                            raise
                        raise os_error(error.errno, target.path, "while making the new file durable") from None
                    if committed is not None:
                        committed.append(target.path)
        finally:
            held.release()
    except BaseException:
        for target in targets:
            target.abort()  # (nothing to undo for one already committed)
        raise
    finally:
        if engine is not None:
            engine.close()


def _fsync_all(targets) -> None:
    """fsyncs every target's file, each on a thread of its own (fsync lets
    go of the GIL); raises the first error, naming its file."""
    errors = [None] * len(targets)

    def sync(i):
        try:
            os.fsync(targets[i].fd)
        except OSError as error:
            errors[i] = os_error(error.errno, targets[i].path, "while making the new file durable")
    threads = [threading.Thread(target=sync, args=(i,), name="offload-fsync") for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error


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
        return _Loader(shard, device, progress, backend, direct, names)

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
    tensors under "tensors", each naming its "shard"."""
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
            "tensors": tensors, "shards": shards}


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
                loaded[shard] = _load_file(shard, device, progress, backend, direct, names)
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


def _load_file(path, device, progress, backend, direct, names=None):
    """({name: tensor}, __metadata__) of one safetensors file, only
    ``names`` when given (a set)."""
    loader = _Loader(path, device, progress, backend, direct, names)
    try:
        loader.done.wait()
        return loader.result(), loader.header.metadata
    finally:
        loader.close()


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


def _flat_bytes(t) -> torch.Tensor:
    """A flat uint8 view of ``t``'s bytes in row-major order (a copy if t is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t) if t.numel() else torch.empty(0, dtype=torch.uint8)


class _progress:
    """A tqdm bar over bytes when asked (or stderr is a terminal and tqdm is installed)."""

    def __init__(self, enabled, total, description):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                if enabled is True:
                    raise
                return
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=description, file=sys.stderr)

    def update(self, n):
        if self.bar is not None:
            self.bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


class _OutFile:
    """One file of a save: where it goes, its header, and its tensors at
    their offsets (after the header; gaps between them are zeros)."""

    __slots__ = ("target", "header", "tensors", "starts", "total")

    def __init__(self, target, header, named, entries):
        self.target, self.header = target, header
        self.tensors = [t for _, t in named]
        self.starts = [len(header) + e.begin for e in entries]
        self.total = len(header) + (entries[-1].end if entries else 0)


class _Writer:
    """Streams each file's header + tensors into it as aligned 8 MiB writes,
    the copy into one staging slot overlapping the writes of the others. A chunk
    goes to the disk as soon as its device copies have landed, by the same
    rule (``CopyQueue``) as the Offloader's pipeline: the device wakes the
    wait, and the writer blocks on a copy only when the disk is idle."""

    def __init__(self, engine, files, device, bar):
        self.engine, self.files, self.bar = engine, files, bar
        self.devices = DeviceResolver(device)
        self.after = {}   # device -> event on the caller's stream
        self.flat = {}    # (file, tensor index) -> its flat bytes, while being copied
        # The device whose page-locking the staging slots use (None: plain CPU).
        self.pin_device = device if device is not None else next(
            (self.devices.for_tensor(t) for out in files for t in out.tensors if t.is_cuda), None)
        self.slots = None
        self.completions = CompletionLoop(engine, None)  # driven here alone: no waits, no handles
        self.error = None

    def run(self) -> None:
        # Round-robin over the files: chunk k of every file before chunk k + 1.
        counts = [-(-out.total // _CHUNK) for out in self.files]
        order = [(f, k) for k in range(max(counts, default=0)) for f, n in enumerate(counts) if k < n]
        self.slots = StagingRing(self.pin_device, min(_SLOTS, max(len(order), 1)), _CHUNK, buffer_pool())
        copying = CopyQueue(device_skip(self.pin_device))  # (file, chunk index, slot, length)
        try:
            next_chunk = 0
            while self.error is None and (next_chunk < len(order) or copying):
                # Fill every free slot (device copies queue back to back), handing
                # the disk each chunk as soon as its bytes are in its slot.
                while next_chunk < len(order) and self.slots.has_free() and self.error is None:
                    f, index = order[next_chunk]
                    slot = self.slots.take()
                    length, copies = self._fill(f, index, slot)
                    copying.add((f, index, slot, length), copies, self.engine.wake)
                    next_chunk += 1
                    self._submit_landed(copying)
                    self.completions.reap()
                self._submit_landed(copying)
                if self.completions.pending:
                    self.engine.wait(_WAIT_MS)  # a completion, or a device copy landing, wakes it
                self.completions.reap()
            self._drain()  # a failure may still come with the last completions
            if self.error is not None:
                raise self.error
        finally:
            copying.settle()  # never free a slot a device still copies into
            self._drain()     # nor one the kernel may still read
            self.slots.close()

    def _drain(self) -> None:
        while self.completions.pending:
            self.engine.wait(_WAIT_MS)
            self.completions.reap()

    def _submit_landed(self, copying) -> None:
        """Writes every chunk whose bytes are in its slot; waits for a device
        copy only when the disk has nothing of ours to do meanwhile."""
        while (chunk := copying.pop_landed(busy=bool(self.completions.pending))) is not None:
            f, index, slot, length = chunk
            tag = self.completions.new_tag(self._written, chunk)
            self.engine.submit_write(tag, self.files[f].target.fd, self.slots.buffers[slot].address, length,
                                     index * _CHUNK)

    def _fill(self, f, index, slot):
        """Copies the bytes of chunk ``index`` of file ``f`` into ``slot``
        (zeros where no tensor is: padding); returns (padded length, [(device,
        its last copy's event)] for the device copies)."""
        out = self.files[f]
        lo = index * _CHUNK
        hi = min(lo + _CHUNK, out.total)
        view = self.slots.views[slot]
        last = {}  # device -> event of its last copy into the slot
        covered = lo  # bytes below this are filled
        if lo < len(out.header):
            n = min(hi, len(out.header)) - lo
            view[:n].copy_(torch.frombuffer(bytearray(out.header[lo:lo + n]), dtype=torch.uint8))
            covered = lo + n
        first = max(0, bisect.bisect_right(out.starts, lo) - 1)
        for i in range(first, len(out.tensors)):
            start = out.starts[i]
            if start >= hi:
                break
            t = out.tensors[i]
            end = start + t.numel() * t.element_size()
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            if a > covered:
                view[covered - lo:a - lo].zero_()
            covered = b
            src = self._flat(f, i)[a - start:b - start]
            dst = view[a - lo:b - lo]
            device = self.devices.for_tensor(t)
            if device is None:
                copy_bytes(dst, src)
                if b == end:
                    del self.flat[f, i]  # (a contiguous copy of a strided tensor goes now)
            else:  # device copies are asynchronous: their sources stay referenced until the end
                last[device] = device.copy(dst, src, self._caller_event(device))
        padded = round_up(hi - lo)
        if padded > covered - lo:
            view[covered - lo:padded].zero_()
        return padded, list(last.items())

    def _written(self, chunk, result) -> None:
        f, index, slot, length = chunk
        out = self.files[f]
        self.slots.give(slot)
        if result < 0 and self.error is None:
            self.error = os_error(-result, out.target.path, f"while saving (bytes {index * _CHUNK}+ "
                                                            "of the new file; the old one is untouched)")
        elif result >= 0:
            self.bar.update(min(length, out.total - index * _CHUNK))

    def _flat(self, f, i):
        flat = self.flat.get((f, i))
        if flat is None:
            flat = self.flat[f, i] = _flat_bytes(self.files[f].tensors[i])
        return flat

    def _caller_event(self, device):
        """The caller's stream as of the save (one event per device): copies wait for it."""
        event = self.after.get(device)
        if event is None:
            event = self.after[device] = device.caller_event()
        return event


class _Loader:
    """Reads one file's tensors: the data region in aligned requests into
    pooled buffers (CPU: the tensors' own memory; device: staging slots whose
    chunks are copied to the device as they land)."""

    def __init__(self, path, device, progress, backend, direct, names):
        self.path = os.fspath(path)
        self.target, self.device = DeviceResolver.for_target(device)
        self.meta_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.fd = -1
        self.engine = None
        self.slots = None
        self.error = None
        self.prefaulters, self.prefaulting = [], 0
        self.small_page_buffers = []  # new buffers faulted in on 4 KiB pages
        self.completions = None
        try:
            self.header = read_header(self.meta_fd, self.path)
            wanted = self.header.entries
            if names is not None:
                found = {e.name for e in wanted}
                missing = sorted(names - found)
                if missing:
                    raise CheckpointError(f"{self.path}: tensor {missing[0]!r} listed in the index is not "
                                          f"in this shard ({len(missing)} missing)")
                wanted = [e for e in wanted if e.name in names]
            self.entries = wanted
            self.fd = open_data_for_reading(self.path, self.meta_fd, direct)
            # 8 MiB reads, 256 MiB in flight: faster cold loads than 4 MiB reads
            # and 128 MiB in flight in an A/B (BENCHMARKS.md, checkpoints).
            self.engine = open_engine(backend, 64, 8 << 20, 8, 256 << 20)
            self.completions = CompletionLoop(self.engine, self._refusal, self._advance)
            self.done = Handle(self.completions, 1, None)  # finished once every tensor is loaded
            self.bar = _progress(progress, sum(e.nbytes for e in wanted),
                                 f"loading {os.path.basename(self.path)}")
            self.tensors = {}
            if self.device is None:
                self._start_cpu()
            else:
                self._start_device()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- CPU
    def _start_cpu(self):
        """Groups the tensors into segments of about 64 MiB, each read into
        one pooled buffer. Recycled buffers are read into at once; new ones,
        the first included, are faulted in by helper threads first, 32 MiB
        at a time, each piece read as soon as it is in: the disk starts after
        the first piece, and reads one while the next is faulted in (a read
        into memory not faulted in yet faults it inside the submission, on
        the pool's 2 MiB pages, one request after another). Where the pool's
        huge pages would be 2 MiB ones they are faulted in on 4 KiB pages
        instead (a fresh 2 MiB page can wait on compaction, or on a VM's
        host: BENCHMARKS.md); a system that enables smaller huge pages (256
        KiB, say) gets those, which fault in as fast and split no request.
        Buffers on 4 KiB pages go back onto 2 MiB ones once idle, on the
        pool's helper thread while the pool is quiet (``collapse_when_idle``),
        so a later load of the same sizes reads into huge pages.
        The engine bounds what is in flight."""
        segments, current = [], []
        for entry in self.entries:
            if current and entry.end - current[0].begin > _SEGMENT:
                segments.append(current)
                current = []
            current.append(entry)
        if current:
            segments.append(current)
        pool, base = buffer_pool(), self.header.data_start
        self.segments, fresh = [], []
        for group in segments:
            lo = round_down(base + group[0].begin)
            hi = base + group[-1].end
            if group[-1].end == group[0].begin:  # zero-size tensors only: nothing to read
                self.segments.append((group, None, lo))
                continue
            buffer = pool.acquire(round_up(hi - lo))
            self.segments.append((group, buffer, lo))
            data = group[-1].end - group[0].begin  # the bytes of tensors in [lo, hi), for the progress bar
            if not buffer.fresh:  # recycled: faulted in already
                self._read_segment((buffer, 0, lo, hi, data))
                continue
            slack = hi - lo - data  # bytes before the first tensor, from rounding lo down to a block
            for start in range(lo, hi, _PIECE):  # new memory: piece by piece
                end = min(start + _PIECE, hi)
                fresh.append((buffer, start - lo, start, end, end - start - (slack if start == lo else 0)))
        if fresh:
            sizes = advised_page_sizes()
            two_mib = bool(sizes) and max(sizes) >= 2048
            self.small_pages = two_mib or not sizes
            if two_mib:  # back onto huge pages once loaded and idle (_finish_cpu)
                self.small_page_buffers = list({id(read[0]): read[0] for read in fresh}.values())
            self.prefaulted = collections.deque()
            self.prefaulting = len(fresh)
            threads = min(_prefault_threads(), len(fresh))
            # Thread j takes pieces j, j + threads, ...: the first ones land first.
            self.prefaulters = [threading.Thread(target=self._prefault, args=(fresh[j::threads],), daemon=True,
                                                 name="offload-prefault") for j in range(threads)]
            for thread in self.prefaulters:
                thread.start()

    def _prefault(self, reads):
        try:
            for read in reads:
                if self.error is not None:
                    break
                buffer, offset, lo, hi, _ = read
                _core.prefault(buffer.address + offset, min(round_up(hi - lo), buffer.capacity - offset),
                               self.small_pages)
                self.prefaulted.append(read)
                self.engine.wake()  # the reaper (a wait, or the event loop) reads it next
        except BaseException as error:  # the loader must not wait for segments that will never come
            if self.error is None:
                self.error = error
            self.engine.wake()

    def _read_segment(self, read):
        """Reads file bytes [lo, hi) into the buffer at ``offset`` (a segment, or a piece of one)."""
        buffer, offset, lo, hi, data = read
        self._read(buffer, offset, lo, hi, lambda n: self.bar.update(data))

    def _read(self, buffer, buffer_offset, lo, hi, on_done):
        """Reads file bytes [lo, hi) into buffer+buffer_offset: the aligned part
        through the engine, a last partial block (end of file) with pread."""
        aligned_hi = read_unaligned_end(self.meta_fd, self.path, memoryview(buffer)[buffer_offset:], lo, hi,
                                        self.header.file_size)
        if aligned_hi == lo:
            on_done(hi - lo)
            return
        tag = self.completions.new_tag(self._landed, (on_done, hi - lo))
        self.engine.submit_read(tag, self.fd, buffer.address + buffer_offset, aligned_hi - lo, lo)

    def _landed(self, read, result) -> None:
        on_done, length = read
        if result < 0:
            if self.error is None:
                self.error = os_error(-result, self.path, "while loading")
        elif self.error is None:
            on_done(length)

    def _finish_cpu(self):
        base = self.header.data_start
        for group, buffer, lo in self.segments:
            storage = None
            if buffer is not None:
                storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
            for entry in group:
                self.tensors[entry.name] = _tensor_in(storage, base + entry.begin - lo, entry)
        self.segments = []
        for buffer in self.small_page_buffers:  # live (the tensors view them): collapsed once released
            collapse_when_idle(buffer)
        self.small_page_buffers = []

    # ------------------------------------------------------------- device
    def _start_device(self):
        base = self.header.data_start
        self.outputs = [torch.empty(e.shape, dtype=e.dtype, device=self.target) for e in self.entries]
        self.flats = [_flat_bytes(t) for t in self.outputs]
        self.starts = [base + e.begin for e in self.entries]
        if self.entries:
            lo = round_down(self.starts[0])
            hi = base + self.entries[-1].end
            self.chunks = [(c, min(c + _CHUNK, hi)) for c in range(lo, hi, _CHUNK)]
        else:
            self.chunks = []
        self.next_chunk = 0
        self.last_event = None
        self.slots = StagingRing(self.device, min(_SLOTS, max(1, len(self.chunks))), _CHUNK, buffer_pool())
        self._pump()

    def _pump(self):
        while self.slots.has_free() and self.next_chunk < len(self.chunks) and self.error is None:
            lo, hi = self.chunks[self.next_chunk]
            self.next_chunk += 1
            slot = self.slots.take()
            self._read(self.slots.buffers[slot], 0, lo, hi,
                       lambda n, slot=slot, lo=lo, hi=hi: self._copy_out(slot, lo, hi))

    def _copy_out(self, slot, lo, hi):
        """Chunk [lo, hi) is in ``slot``: queue its pieces' copies to the device."""
        view, event = self.slots.views[slot], None
        first = max(0, bisect.bisect_right(self.starts, lo) - 1)
        for i in range(first, len(self.entries)):
            start = self.starts[i]
            if start >= hi:
                break
            end = start + self.entries[i].nbytes
            a, b = max(start, lo), min(end, hi)
            if a < b:
                event = self.device.copy(self.flats[i][a - start:b - start], view[a - lo:b - lo], None)
                self.bar.update(b - a)
        self.slots.give(slot, event)
        if event is not None:
            self.last_event = event

    def _finish_device(self):
        if self.last_event is not None:
            self.device.order_before_caller(self.last_event)  # copies run in order on one stream
        for entry, t in zip(self.entries, self.outputs):
            self.tensors[entry.name] = t

    # -------------------------------------------------------------- driving
    def _advance(self) -> None:
        """After each reap (the completion loop's tend): start the segments
        faulted in meanwhile and the device chunks a slot is free for, and
        finish ``done`` once every tensor is loaded, or failed."""
        if not self.done._remaining:
            return
        while self.prefaulting and self.prefaulted and self.error is None:
            self.prefaulting -= 1
            self._read_segment(self.prefaulted.popleft())
        if self.device is not None and self.error is None:
            self._pump()
        if self.completions.pending or (self.error is None and (self.prefaulting or (
                self.device is not None and self.next_chunk < len(self.chunks)))):
            return
        if self.error is None:
            if self.device is None:
                self._finish_cpu()
            else:
                self._finish_device()
        self.done._operation_finished(self.error)
        self.completions.finish(self.done)

    def _refusal(self) -> CheckpointError:
        return CheckpointError(f"{self.path}: the load was closed before it finished")

    def result(self) -> dict:
        return {e.name: self.tensors[e.name] for e in self.entries}

    def close(self):
        self.small_page_buffers = []
        if self.prefaulters:
            self.error = self.error or CheckpointError("closed")
            for thread in self.prefaulters:
                thread.join()  # they touch buffers that are about to go
            self.prefaulters = []
        if self.engine is not None:
            self.engine.close()  # waits for anything in flight before buffers go
            self.engine = None
        if self.completions is not None:
            self.completions.close()
            # The loop calls back into this loader, and ``done`` into the loop:
            # let go of both, and of the tensors (the caller has them), so no
            # cycle keeps a shard's worth of memory until the cyclic GC runs.
            self.completions = self.done = None
            self.tensors = {}
        if self.slots is not None:
            self.slots.close()
            self.slots = None
        if self.fd >= 0 and self.fd != self.meta_fd:
            os.close(self.fd)
        self.fd = -1
        if self.meta_fd >= 0:
            os.close(self.meta_fd)
            self.meta_fd = -1
        bar = getattr(self, "bar", None)
        if bar is not None:
            bar.__exit__()
            self.bar = None


def read_unaligned_end(fd, path, view, lo, hi, file_size) -> int:
    """Reads into ``view`` (file byte ``lo`` at its start) the part of
    [lo, hi) past the file's last whole 4 KiB block, which O_DIRECT cannot
    read, with pread on ``fd`` (opened without O_DIRECT). Returns where the
    aligned part, left to the caller, ends."""
    aligned_hi = hi if hi % BLOCK == 0 else min(round_up(hi), round_down(file_size))
    aligned_hi = max(aligned_hi, lo)
    if aligned_hi < hi:
        got = os.preadv(fd, [view[aligned_hi - lo:hi - lo]], aligned_hi)
        if got != hi - aligned_hi:
            raise CheckpointError(f"{path}: the file shrank while being read")
    return aligned_hi


def _tensor_in(storage, offset, entry) -> torch.Tensor:
    """The tensor of ``entry`` whose bytes are at ``offset`` in ``storage``:
    a view when the offset suits the dtype, else a copy."""
    itemsize = torch.empty(0, dtype=entry.dtype).element_size()
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (entry.nbytes,))
    if offset % itemsize == 0:
        typed = torch.empty(0, dtype=entry.dtype)
        return typed.set_(storage, offset // itemsize, entry.shape)
    copy = torch.empty(entry.shape, dtype=entry.dtype)
    _flat_bytes(copy).copy_(raw)
    return copy


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
    else:
        print(f"{info['path']}: {len(tensors)} tensors, {info['file_bytes']} bytes, data at {info['data_offset']}")
    for key, value in info["metadata"].items():
        print(f"  metadata {key} = {value}")
    width = max([len(t["name"]) for t in tensors] + [4])
    for t in tensors:
        print(f"  {t['name']:{width}}  {t['dtype']:14} {str(tuple(t['shape'])):20} {t['bytes']:>12} B")
    return 0
