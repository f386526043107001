"""offload as a storage layer for torch.distributed.checkpoint (DCP).

``Writer`` and ``Reader`` implement DCP's ``StorageWriter`` / ``StorageReader``
over offload's engine (io_uring, O_DIRECT, many large requests in flight).
The files are DCP's own ``FileSystemWriter`` layout, byte for byte in kind:
``__{rank}_{n}.distcp`` data files holding one ``torch.save`` record per item
at the offsets ``.metadata`` lists, and ``.metadata`` the pickled
``Metadata``. A checkpoint written by either loads with the other. Records
of at least 1 MiB are placed so that the storage's bytes start on a 4 KiB
boundary of the file (the gap before them is zeros, which no reader reads):
that is what lets ``Reader`` read them straight into their destination.

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
import dataclasses
import math
import os
import pickle
import uuid

import torch

try:
    from torch.distributed.checkpoint import StorageReader, StorageWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    if not hasattr(torch.serialization, "skip_data"):  # torch 2.5+: save_pieces writes around the data
        raise ImportError("cannot import name 'skip_data' from 'torch.serialization'")
except ImportError as error:  # the rest of offload works on older torch
    raise ImportError(f"offload.dcp needs the torch.distributed.checkpoint storage API of newer torch "
                      f"(this is torch {torch.__version__}: {error})") from error

from . import _sharding
from ._atomic_file import AtomicFile, HeldFrees, fsync_directory, unlink_later
from ._dcp_reading import RankReader, ReadStats
from ._direct_io import BLOCK, round_up
from ._tensors import has_no_data
from ._torch_records import bytes_tensor, save_pieces
from ._checkpoint_writing import write_files_atomically
from .checkpoint import CheckpointError

__all__ = ["Writer", "Reader", "ReadStats"]

_METADATA = ".metadata"
_SUFFIX = ".distcp"
_ALIGNED_MIN = 1 << 20  # storages at least this long start on a BLOCK boundary of the file


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
    needed), durably, as described in the module docstring. Each rank
    writes ``files_per_rank`` data files at once through one engine (DCP's
    FileSystemWriter makes the same with ``thread_count``), items split
    over them by size. ``backend`` picks the engine as the Offloader does.

    ``stripe``: more directories (existing ones, on other drives) to spread
    each rank's data files over, round-robin, ``path`` first; one file per
    directory unless ``files_per_rank`` says otherwise. A file in another
    directory is stored under a name of its own save (no two checkpoints
    share one) and reached through a symlink in ``path``, so DCP's own
    reader loads it too. Overwriting removes the files the old links
    reached. A directory that refuses O_DIRECT gets its files written
    through the page cache, with a warning naming it."""

    def __init__(self, path, *, files_per_rank=None, stripe=(), backend: str = "auto", direct=None):
        super().__init__()
        self.stripe = _sharding.stripe_directories(path, stripe)
        if files_per_rank is None:
            files_per_rank = 1 + len(self.stripe)
        if int(files_per_rank) < 1:
            raise ValueError(f"files_per_rank must be at least 1, got {files_per_rank}")
        self.path = os.fspath(path)
        self.files_per_rank = int(files_per_rank)
        self.backend, self.direct = backend, direct
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = True
        # The files this save replaces, freed when it is over: the coordinator's
        # after the metadata is committed, another rank's after its data.
        self.replaced = HeldFrees()

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            _sharding.stripe_directories(self.path, self.stripe)  # (not among its own stripe)
        self.save_id = uuid.uuid4().hex
        self.replaced.release()  # (a save that failed before its finish)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        os.makedirs(self.path, exist_ok=True)
        if self.is_coordinator:  # before any rank writes data (the plans are gathered in between)
            metadata = os.path.join(self.path, _METADATA)
            if os.path.exists(metadata):
                os.unlink(metadata)
                fsync_directory(self.path)
        return plan

    def prepare_global_plan(self, plans):
        return [plan if plan.storage_data is not None else
                dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_")) for i, plan in enumerate(plans)]

    def write_data(self, plan, planner) -> torch.futures.Future:
        try:
            with self.replaced.holding():
                results = self._write_data(plan, planner)
        except BaseException:
            self.replaced.release()
            raise
        if not self.is_coordinator:
            self.replaced.release()
        future = torch.futures.Future()
        future.set_result(results)
        return future

    def _write_data(self, plan, planner) -> list:
        files, results, links, names = [], [], [], []
        directories = [self.path] + self.stripe
        for n, items in enumerate(_split(plan.items, self.files_per_rank)):
            name = f"{plan.storage_data.prefix}{n}{_SUFFIX}"
            home = directories[n % len(directories)]
            names.append(name)
            where = os.path.join(self.path, name)
            if home != self.path:  # a file of this save's own, linked from the checkpoint
                links.append((name, os.path.join(home, f"{self.save_id}{name}")))
                where = links[-1][1]
            pieces, entries, offset = [], [], 0
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    record = [bytes_tensor(data.getbuffer())]
                else:
                    if has_no_data(data):  # torch would crash on it
                        raise ValueError(f"{item.index.fqn!r} has no data: its memory was released "
                                         "(offloaded? read it back first)")
                    record = save_pieces(data)
                    head, storage = record[0].numel(), record[1].numel()
                    if storage >= _ALIGNED_MIN:
                        offset = round_up(offset + head, BLOCK) - head
                start = offset
                for piece in record:
                    entries.append(_Extent(offset, offset + piece.numel()))
                    offset += piece.numel()
                pieces += record
                results.append(WriteResult(index=item.index, size_in_bytes=offset - start,
                                           storage_data=_StorageInfo(name, start, offset - start)))
            files.append((where, b"", [(None, p) for p in pieces], entries))
        replaced = {name: _sharding.link_target(os.path.join(self.path, name)) for name in names}
        write_files_atomically(files, backend=self.backend, direct=self.direct)
        for name, target in links:
            _sharding.link(self.path, name, target)
        if links:
            fsync_directory(self.path)
        written = {os.path.realpath(where) for where, *_ in files}
        for name, old in replaced.items():  # the file an old striped save's link of this name reached
            if old is not None and old not in written and os.path.basename(old).endswith(name):
                unlink_later(old)
        return results

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
        finally:
            self.replaced.release()

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


class Reader(_AtPath, StorageReader):
    """Reads a DCP checkpoint from ``path``: all of a rank's data files at
    once, through one engine, with O_DIRECT where the file system allows.
    Large records go straight into CPU destinations, or to CUDA ones through
    page-locked staging; the rest are read in merged requests and copied
    (offload/_dcp_reading.py says which goes which way). ``stats``: the bytes
    that went each way since the last ``reset`` (DCP resets it for each
    load). ``device``: a device backend for tests (offload.devices)."""

    def __init__(self, path, *, backend: str = "auto", direct=None, device=None):
        super().__init__()
        self.path = os.fspath(path)
        self.backend, self.direct, self.device = backend, direct, device
        self.storage_data = {}
        self.stats = ReadStats()
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}
        self.stats = ReadStats()
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
        RankReader({os.path.join(self.path, relative): items for relative, items in per_file.items()}, planner,
                   self.backend, self.direct, self.device, self.stats).run()
        future = torch.futures.Future()
        future.set_result(None)
        return future


# ------------------------------------------------------------------ writing
def _split(items, files: int) -> list:
    """The write items in ``files`` groups, as DCP's FileSystemWriter splits
    them over its threads: bytes items in turn, tensors largest first, each
    into the group with the fewest bytes so far. Empty groups are dropped."""
    groups = [[] for _ in range(files)]
    sizes = [0] * files
    bytes_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
    tensor_items = sorted((item for item in items if item.type != WriteItemType.BYTE_IO), key=_item_bytes,
                          reverse=True)
    for i, item in enumerate(bytes_items):
        groups[i % files].append(item)
    for item in tensor_items:
        smallest = sizes.index(min(sizes))
        groups[smallest].append(item)
        sizes[smallest] += _item_bytes(item)
    return [group for group in groups if group]


def _item_bytes(item) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.size) * torch.empty(0, dtype=data.properties.dtype).element_size()


class _Extent:
    __slots__ = ("begin", "end")

    def __init__(self, begin, end):
        self.begin, self.end = begin, end
