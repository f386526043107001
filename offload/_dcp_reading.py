"""How ``offload.dcp.Reader`` moves one rank's items from a checkpoint's data
files into the tensors DCP resolves: every file of the rank at once, through
one engine. Each tensor record goes one of three ways:

- in place: a record of at least 1 MiB whose requested elements are one run
  of bytes in the file, destined for contiguous CPU memory of the same dtype,
  is read by the disk straight into that memory, when O_DIRECT's alignment
  allows it (file offset and memory address on the file's DIO alignment,
  statx; any on a file read without O_DIRECT). The planner's
  ``commit_tensor`` runs once the bytes are there;
- through staging: the same kind of record destined for device (CUDA)
  memory goes through page-locked slots, 8 MiB at a time, by the staging
  pipeline's rules: a slot is read into again only after the copy out of it
  has happened, copies wait for the caller's stream as of the call, and the
  caller's stream is ordered after the last copy before ``commit_tensor``
  runs and ``read_data`` returns. Destined for CPU memory that O_DIRECT's
  alignment refuses (torch's own allocations, 64 bytes past a page, on a
  disk that wants 512), it takes slots of its own (each device has its
  ring), each chunk copied out by the CPU as it lands: however large the
  record, the bounce memory stays 24 slots of 8 MiB, and a new process
  faults in only those, with the pool's helper thread beside the reads
  (whole-record buffers, four in flight, made a fresh process's first load
  several times slower: BENCHMARKS.md);
- copied: everything else (small records, resharded pieces that are not one
  run of bytes, strided or converted destinations, bytes items) is read in
  merged segments of up to 64 MiB into pool buffers (new ones faulted in
  by the helper too) and copied into the destination with ``Tensor.copy_``.

The way is chosen from each candidate record's first and last 4 KiB (zip
directory, local headers, pickle), read in batches of 256 records before
anything else.
"""
import collections
import itertools
import dataclasses
import io
import os

from torch.distributed.checkpoint.planner import LoadItemType

from ._completion_loop import CompletionLoop, QuietWatch
from ._direct_io import BLOCK, open_data_for_reading, round_down, round_up, transfer_alignment
from ._engines import close_engine, open_engine
from ._errors import os_error
from ._pool import buffer_pool, fault_in
from ._safetensors import CheckpointError
from ._tensors import byte_view, has_no_data
from ._torch_records import record_layout, tensor_in_record
from ._checkpoint_reading import read_unaligned_end
from .device_pipeline import StagingRing
from .devices import DeviceResolver

_SEGMENT = 64 << 20      # bytes of merged records read into one pool buffer
_SEGMENTS_IN_FLIGHT = 4
_GAP = 1 << 20           # records closer than this are read in one request
_PLACED_MIN = 1 << 20    # records at least this long are probed for the other two ways
_PROBE = 4096            # bytes probed at each end of a record
_PROBES_AT_ONCE = 256    # records probed in one batch (a 4 MiB buffer)
_CHUNK = 8 << 20         # staging slot size
_SLOTS = 16
_HOST_SLOTS = 24        # for CPU destinations: 192 MiB (16, 24, 32 and 48 tried: BENCHMARKS.md)
_WAIT_MS = 50


@dataclasses.dataclass
class ReadStats:
    """Bytes of tensor data a Reader moved, by way (module docstring)."""

    in_place: int = 0   # read by the disk straight into the destination
    staged: int = 0     # to device memory through page-locked slots
    copied: int = 0     # read into a buffer, then copied
    probed: int = 0     # records whose layout was probed


class _File:
    """One data file: its descriptors, size and O_DIRECT alignment."""

    def __init__(self, path, items, direct):
        self.path, self.items = path, items
        self.meta_fd = self.fd = -1
        try:
            self.meta_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: a data file of this checkpoint is missing") from None
        self.size = os.fstat(self.meta_fd).st_size
        end = max(offset + length for offset, length, _ in items)
        if end > self.size:
            self.close()
            raise CheckpointError(f"{path}: truncated: the metadata lists bytes up to {end}, "
                                  f"the file has {self.size}")
        try:
            self.fd = open_data_for_reading(path, self.meta_fd, direct)
        except BaseException:
            self.close()
            raise
        self.direct = self.fd != self.meta_fd
        self.memory_align, self.offset_align = transfer_alignment(self.fd, self.direct)

    def close(self):
        if self.fd >= 0 and self.fd != self.meta_fd:
            os.close(self.fd)
        if self.meta_fd >= 0:
            os.close(self.meta_fd)
        self.fd = self.meta_fd = -1


class _Staged:
    """A record on its way to device memory through the slots."""

    __slots__ = ("item", "target", "flat", "lo", "hi", "device", "chunks_left")

    def __init__(self, item, target, lo, hi, device):
        self.item, self.target, self.lo, self.hi, self.device = item, target, lo, hi, device
        self.flat = byte_view(target)
        self.chunks_left = 0


class _HostCopies:
    """The slots' "device" for CPU destinations whose memory O_DIRECT
    refuses: each chunk is copied out by the CPU as it lands, so the slot is
    free again at once (no events, nothing to pin or order)."""

    skip = ""

    @staticmethod
    def copy(dst, src, after):
        dst.copy_(src)

    @staticmethod
    def caller_event():
        return None

    @staticmethod
    def order_before_caller(event, stream=None):
        pass

    @staticmethod
    def pin(address, nbytes):
        pass

    @staticmethod
    def unpin(address):
        pass


HOST = _HostCopies()


def _asked_of(tensor, item):
    """The elements of a record's ``tensor`` that ``item`` asks for (a view),
    or None when it asks for more than the record holds."""
    try:
        for dim, (first, count) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, first, count)
    except (RuntimeError, IndexError):
        return None
    return tensor


class RankReader:
    """Reads one ``read_data`` call's items: ``items`` maps each data file's
    path to its (offset, length, ReadItem) triples. ``device``: a test device
    backend (offload.devices), else CUDA destinations use CUDA."""

    def __init__(self, items, planner, backend, direct, device, stats):
        self.items, self.planner = items, planner
        self.backend, self.direct = backend, direct
        self.devices = DeviceResolver(device)
        self.stats = stats
        self.files = []
        self.engine = self.completions = None
        self.rings = {}        # device -> its StagingRing (HOST: CPU memory O_DIRECT refuses)
        self.segments_in_flight = 0
        self.after = {}        # device -> the caller's stream as of the call
        self.last_event = {}   # device -> its last copy's event
        self.staged_done = []
        self.chunks = collections.defaultdict(collections.deque)  # device -> (file, record, lo, hi) not read yet
        self.error = None

    def run(self) -> None:
        try:
            for path, items in self.items.items():
                self.files.append(_File(path, items, self.direct))
            self.engine = open_engine(self.backend, 64, 8 << 20, 8, 256 << 20)
            self.completions = CompletionLoop(self.engine, None)  # driven here alone
            self.completions.owner = f"{self.files[0].path!r}" if self.files else "a DCP checkpoint"
            self.quiet = QuietWatch(self.completions, "loading")
            placed, staged, copied = self._sort_out()
            self._move(placed, staged, copied)
            for device, event in self.last_event.items():
                device.order_before_caller(event)
            for record in self.staged_done:
                self.planner.commit_tensor(record.item, record.target)
        finally:
            if self.engine is None:
                self._release()
            else:  # reads in flight first (given up on, the engine keeps the slots and files)
                close_engine(self.engine, self, then=self._release)

    def _release(self) -> None:
        for ring in self.rings.values():
            ring.close()         # waits for copies out of the slots
        for f in self.files:
            f.close()

    # ------------------------------------------------------------ planning
    def _destination(self, item):
        """The tensor ``item`` loads into, refused when it has no memory (an
        offloaded one: writing into it would crash the process)."""
        target = self.planner.resolve_tensor(item).detach()
        if has_no_data(target):
            raise ValueError(f"{item.storage_index.fqn!r}: the tensor to load into has no data: its memory "
                             "was released (offloaded? read it back first)")
        return target

    def _sort_out(self):
        """(placed, staged, copied): the records of each way."""
        candidates, copied = [], []
        # A record of each file in turn: the reads in flight spread over every
        # file (every drive, when the files are striped over several).
        in_turn = itertools.zip_longest(*[[(f, *entry) for entry in f.items] for f in self.files])
        for f, offset, length, item in (e for turn in in_turn for e in turn if e is not None):
            if item.type == LoadItemType.TENSOR and length >= _PLACED_MIN:
                candidates.append((f, offset, length, item, self._destination(item)))
            else:
                copied.append((f, offset, length, item, None))
        placed, staged = [], []
        for candidate, layout in zip(candidates, self._probe(candidates)):
            way = self._way(candidate, layout)
            if way is None:
                copied.append(candidate)
            elif isinstance(way, _Staged):
                staged.append((candidate[0], way))
            else:
                placed.append(way)
        return placed, staged, copied

    def _probe(self, candidates) -> list:
        """The layout (``record_layout``) of each candidate record, from its
        first and last 4 KiB, read _PROBES_AT_ONCE records at a time."""
        layouts = []
        for first in range(0, len(candidates), _PROBES_AT_ONCE):
            layouts += self._probe_some(candidates[first:first + _PROBES_AT_ONCE])
        return layouts

    def _probe_some(self, candidates) -> list:
        self.stats.probed += len(candidates)
        stride = 4 * _PROBE  # two windows of 2 x _PROBE: each end, rounded out to blocks
        buffer = buffer_pool().acquire(len(candidates) * stride)
        windows = []
        for i, (f, offset, length, _, _) in enumerate(candidates):
            end = offset + length
            head_lo, tail_lo = round_down(offset), round_down(end - _PROBE)
            self._read(f, buffer, i * stride, head_lo, head_lo + 2 * _PROBE, None)
            self._read(f, buffer, i * stride + 2 * _PROBE, tail_lo, min(round_up(end), f.size), None)
            windows.append((i * stride + offset - head_lo, i * stride + 2 * _PROBE + end - _PROBE - tail_lo))
        self._drain()
        view = memoryview(buffer)
        return [record_layout(view[head:head + _PROBE], view[tail:tail + _PROBE], length)
                for (head, tail), (_, _, length, _, _) in zip(windows, candidates)]

    def _way(self, candidate, layout):
        """How the record goes (module docstring): in place, as (file, item,
        target, file offset, bytes); through staging, as a _Staged; or
        copied, as None (which also reports what does not fit)."""
        f, offset, length, item, target = candidate
        if layout is None:
            return None
        start, size, tensor = layout
        tensor = _asked_of(tensor, item)
        if tensor is None:  # the plan asks for more than the record holds: the copied path says so
            return None
        itemsize = tensor.element_size()
        nbytes = tensor.numel() * itemsize
        if (not tensor.is_contiguous() or not target.is_contiguous() or tensor.dtype != target.dtype
                or tensor.shape != target.shape or nbytes == 0
                or (tensor.storage_offset() + tensor.numel()) * itemsize > size):
            return None
        lo = offset + start + tensor.storage_offset() * itemsize
        device = self.devices.for_tensor(target)
        if device is None:
            if not f.direct or not (lo % f.offset_align or target.data_ptr() % f.memory_align):
                return (f, item, target, lo, nbytes)
            device = HOST  # memory O_DIRECT refuses (torch's own, on most disks): the CPU copies it out
        if device not in self.rings:
            ring = self.rings[device] = StagingRing(device, _HOST_SLOTS if device is HOST else _SLOTS, _CHUNK,
                                                    buffer_pool())
            fresh = [b for b in ring.buffers if b.fresh]
            if fresh:  # a helper faults them in too, ahead of the reads (new memory: BENCHMARKS.md)
                fault_in(fresh)
        if device not in self.after:
            self.after[device] = device.caller_event()
        return _Staged(item, target, lo, lo + nbytes, device)

    # -------------------------------------------------------------- moving
    def _move(self, placed, staged, copied) -> None:
        for f, item, target, lo, nbytes in placed:
            self._read_in_place(f, item, target, lo, nbytes)
        for f, record in staged:
            first = round_down(record.lo, max(BLOCK, f.offset_align))
            for lo in range(first, record.hi, _CHUNK):
                self.chunks[record.device].append((f, record, lo, min(lo + _CHUNK, record.hi)))
                record.chunks_left += 1
        by_file = collections.defaultdict(list)
        for record in copied:
            by_file[record[0]].append(record)
        segments = collections.deque(segment for f, records in by_file.items()
                                     for segment in self._segments(f, records))
        while True:
            while segments and self.segments_in_flight < _SEGMENTS_IN_FLIGHT and self.error is None:
                self._read_segment(*segments.popleft())
            for device in list(self.chunks):
                self._read_chunks(device)
            if not self.completions.pending:
                break
            self._wait()
            self.completions.reap()
        if self.error is not None:
            raise self.error

    def _read_in_place(self, f, item, target, lo, nbytes) -> None:
        """The disk reads the record's bytes into ``target``'s memory; a last
        part shorter than the offset alignment is read with pread."""
        aligned = round_down(nbytes, f.offset_align) if f.direct else nbytes
        if aligned < nbytes:
            rest = byte_view(target)[aligned:].numpy()
            if os.preadv(f.meta_fd, [rest], lo + aligned) != nbytes - aligned:
                raise CheckpointError(f"{f.path}: the file shrank while being read")

        def landed():
            self.stats.in_place += nbytes
            self.planner.commit_tensor(item, target)
        if aligned:
            tag = self.completions.new_tag(self._landed, (f, landed))
            self.engine.submit_read(tag, f.fd, target.data_ptr(), aligned, lo)
        else:
            landed()

    def _read_chunks(self, device) -> None:
        """Reads ``device``'s next chunks into its free slots."""
        chunks, ring = self.chunks[device], self.rings[device]
        while chunks and ring.has_free() and self.error is None:
            self._read_chunk(ring, *chunks.popleft())

    def _read_chunk(self, ring, f, record, lo, hi) -> None:
        slot = ring.take()  # waits for the copy out of it, if still queued
        self._read(f, ring.buffers[slot], 0, lo, hi, lambda: self._copy_out(ring, slot, record, lo, hi))

    def _copy_out(self, ring, slot, record, lo, hi) -> None:
        a, b = max(lo, record.lo), hi
        event = record.device.copy(record.flat[a - record.lo:b - record.lo], ring.views[slot][a - lo:b - lo],
                                   self.after[record.device])
        ring.give(slot, event)
        self.last_event[record.device] = event
        if record.device is HOST:
            self.stats.copied += b - a
            self._read_chunks(HOST)  # the slot is free already: keep the disk busy through the reap
        else:
            self.stats.staged += b - a
        record.chunks_left -= 1
        if record.chunks_left == 0:
            self.staged_done.append(record)

    @staticmethod
    def _segments(f, records) -> list:
        """``f``'s records to copy, merged into (file, lo, hi, records) segments."""
        segments, group, lo, hi = [], [], 0, 0
        for candidate in sorted(records, key=lambda c: c[1]):
            _, offset, length, _, _ = candidate
            if group and (offset - hi > _GAP or offset + length - lo > _SEGMENT):
                segments.append((f, lo, hi, group))
                group = []
            if not group:
                lo, hi = round_down(offset), offset
            group.append(candidate)
            hi = max(hi, offset + length)
        if group:
            segments.append((f, lo, hi, group))
        return segments

    def _read_segment(self, f, lo, hi, group) -> None:
        buffer = buffer_pool().acquire(round_up(hi - lo))
        if buffer.fresh:  # a helper faults it in too, beside the read
            fault_in([buffer])
        self.segments_in_flight += 1

        def landed():
            self.segments_in_flight -= 1
            if self.error is None:
                self._deliver(f, buffer, lo, group)
        self._read(f, buffer, 0, lo, hi, landed)

    def _deliver(self, f, buffer, lo, group) -> None:
        view = memoryview(buffer)
        for _, offset, length, item, target in group:
            record = view[offset - lo:offset - lo + length]
            if item.type == LoadItemType.BYTE_IO:
                self.planner.load_bytes(item, io.BytesIO(bytes(record)))
                continue
            whole = tensor_in_record(record, buffer, offset - lo, f.path)
            tensor = _asked_of(whole, item)
            if tensor is None:
                raise CheckpointError(f"{f.path}: item {item.storage_index.fqn!r} asks for elements "
                                      f"{list(item.storage_offsets)} + {list(item.lengths)} of a record "
                                      f"of shape {tuple(whole.size())}")
            if target is None:
                target = self._destination(item)
            if target.size() != tensor.size():
                raise CheckpointError(f"{f.path}: item {item.storage_index.fqn!r} has shape "
                                      f"{tuple(tensor.size())}, the destination {tuple(target.size())}")
            target.copy_(tensor)
            self.stats.copied += tensor.numel() * tensor.element_size()
            self.planner.commit_tensor(item, target)

    # ---------------------------------------------------------- the engine
    def _read(self, f, buffer, buffer_offset, lo, hi, on_done) -> None:
        """Reads file bytes [lo, hi) into ``buffer`` at ``buffer_offset``: the
        aligned part through the engine, a last partial block (end of file)
        with pread; ``on_done()`` once all are there (not after an error)."""
        aligned_hi = read_unaligned_end(f.meta_fd, f.path, memoryview(buffer)[buffer_offset:], lo, hi, f.size)
        if aligned_hi == lo:
            if on_done is not None:
                on_done()
            return
        tag = self.completions.new_tag(self._landed, (f, on_done))
        self.engine.submit_read(tag, f.fd, buffer.address + buffer_offset, aligned_hi - lo, lo)

    def _landed(self, read, result) -> None:
        f, on_done = read
        if result < 0:
            if self.error is None:
                self.error = os_error(-result, f.path, "while loading a DCP checkpoint")
        elif self.error is None and on_done is not None:
            on_done()

    def _wait(self) -> None:
        """One wait on the engine, and the look that warns when nothing finishes."""
        self.engine.wait(_WAIT_MS)
        self.quiet.saw(len(self.completions.pending))

    def _drain(self) -> None:
        while self.completions.pending:
            self._wait()
            self.completions.reap()
        if self.error is not None:
            raise self.error
