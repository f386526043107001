"""Reading safetensors files at disk speed: the data region in large aligned
requests, many in flight. On the CPU into pooled buffers that the tensors
view (new ones faulted in on a helper thread, piece by piece, ahead of the
reads); to a device through page-locked staging slots."""
import bisect
import collections
import os
import threading

import torch

from . import _core
from ._completion_loop import CompletionLoop
from ._direct_io import BLOCK, open_data_for_reading, round_down, round_up
from ._engines import close_engine, open_engine
from ._errors import os_error
from ._pool import advised_page_sizes, buffer_pool, collapse_when_idle
from ._progress_bar import ProgressBar
from ._safetensors import CheckpointError, read_header
from ._tensors import flat_bytes
from .device_pipeline import StagingRing
from .devices import DeviceResolver
from .handle import Handle

_SEGMENT = 64 << 20   # CPU loads: tensors share read buffers of about this size
_PIECE = 32 << 20     # CPU loads: new buffers are faulted in, and read, this much at a time
_CHUNK = 8 << 20      # device loads: bytes per request, and per staging slot
_SLOTS = 16           # device loads: staging slots in flight


def _prefault_threads() -> int:
    """Threads that fault in a CPU load's new buffers: OFFLOAD_PREFAULT_THREADS,
    else one. One thread faulted 1.1-3.5 GB/s of 4 KiB pages on the VMs
    measured, less than fast NVMe reads, but more threads did not load faster
    there (BENCHMARKS.md, checkpoints; likely their faults wait on the same host):
    the setting is for machines where they do."""
    setting = os.environ.get("OFFLOAD_PREFAULT_THREADS", "").strip()
    return int(setting) if setting.isdigit() and int(setting) > 0 else 1


def load_file(path, device, progress, backend, direct, names=None):
    """({name: tensor}, __metadata__) of one safetensors file, only
    ``names`` when given (a set)."""
    loader = Loader(path, device, progress, backend, direct, names)
    try:
        loader.done.wait()
        return loader.result(), loader.header.metadata
    finally:
        loader.close()


class Loader:
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
            self.completions.owner = f"the load of {self.path!r}"
            self.completions.waiting, self.completions.awaiting = "waiting on", "awaiting"
            self.done = Handle(self.completions, 1, None)  # finished once every tensor is loaded
            self.bar = ProgressBar(progress, sum(e.nbytes for e in wanted),
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
        self.flats = [flat_bytes(t) for t in self.outputs]
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
        if self.engine is None:
            self._release()
        else:  # the buffers go once nothing is in flight (given up on, the engine keeps this loader)
            engine, self.engine = self.engine, None
            close_engine(engine, self, then=self._release)

    def _release(self):
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
    flat_bytes(copy).copy_(raw)
    return copy
