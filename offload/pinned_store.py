"""Offloader(None): device (GPU) tensors kept in page-locked CPU memory, no disk.

Every copy goes through one copy stream per device, in order, so a host buffer
given back by one tensor and reused by another is only written after the last
copy out of it, and a read is ordered after the write that filled its buffer.
Operations complete when their copy is queued; the ordering guarantees are the
stream's:

- write: the device-to-host copy waits for an event on the caller's stream
  (the tensor as of the call); the tensor's device memory is released once
  the copy out of it cannot be overtaken (record_stream, or a wait on the test
  device);
- read: the tensor gets device memory on the caller's stream, the copy into
  it is queued after the write's, and the caller's current stream waits for
  it when the read completes.
"""
import torch

from . import _core, _signals
from .devices import raw_bytes
from .offloader import _WRITE, Offloader

_signals.bookkeeping_module(__file__)


class _HostMemory:
    """Where a PinnedStore keeps bytes, as the Offloader sees a backing file."""

    direct = False
    path = "<pinned memory>"
    fd = -1

    def close(self) -> None:
        """The host buffers belong to the pipelines, which close() frees."""


class PinnedStore(Offloader):
    """``Offloader(None)``: the Offloader's calls, handles, ordering rules and
    lifecycle, for device tensors kept in page-locked CPU memory. Each
    operation completes once its copy is queued on the device's copy stream
    (which orders the rest, above); the engine, one thread fed zero-length
    requests, only hands completions back in issue order through the same
    completion loop as the disk's. ``backend`` is "pinned"; CPU tensors are
    refused; ``discard`` is not offered (nothing outlives a read here)."""

    def _open_store(self, dir_name, n_entries, backend, direct, chunk_bytes, threads, register_buffers):
        return _core.make_thread_engine(1, chunk_bytes, 1), _HostMemory()

    def __init__(self, dir_name=None, *args, **options):
        super().__init__(None, *args, **options)
        self.backend = "pinned"

    @property
    def file_bytes(self) -> int:
        return 0

    def warm(self, tensors) -> int:
        """Nothing to fault in: host buffers are made (and pinned) on first write."""
        return 0

    def inject_faults(self, error_rate: float = 0.0, errnos=(), short_rate: float = 0.0,
                      delay_rate: float = 0.0, delay_ms: int = 0, seed: int = 1) -> None:
        """Refused (unless it injects nothing): a PinnedStore does no I/O for a
        fault to fail, so a test of error handling would pass without one."""
        if error_rate or short_rate or (delay_rate and delay_ms):
            raise NotImplementedError("Offloader(None) does no I/O: there is nothing to inject faults into "
                                      "(Offloader(directory, device=...) injects them into its disk I/O)")

    def _check_cpu_tensor_allowed(self) -> None:
        raise ValueError("Offloader(None) keeps GPU tensors in pinned CPU memory; this tensor "
                         "is on the CPU already (give the Offloader a directory to move it to disk)")

    def _reserve_extents(self, tensors, records) -> None:
        """No file to grow."""

    def _new_pipeline(self, device):
        return PinnedPipeline(device)

    def _start_write(self, op) -> None:
        storage, layout = self._layout_to_write(op)
        del storage
        op.keep = self._pipeline(self._device_for(op.tensor)).start_write(op, layout.nbytes)
        op.record.released(op.tensor)
        self._submit(_core.KIND_WRITE, self._new_tag(op), 0, 0, 0)  # completes in order

    def _start_read(self, op) -> None:
        if op.record.stored:
            device = self._device_for(op.tensor)
            # The copy's event, and the caller's stream to order after it (the
            # completion may be reaped on the progress thread).
            op.keep = (self._pipeline(device).start_read(op, op.record.layout.nbytes), device.caller_stream())
        self._submit(_core.KIND_READ, self._new_tag(op), 0, 0, 0)  # completes in order

    def _complete(self, op, result) -> None:
        """The copy is queued; the stream orders the rest."""
        record = op.record
        if op.kind == _WRITE:
            record.stored = True
        elif op.keep is not None:
            self._device_for(op.tensor).order_before_caller(*op.keep)
            record.stored = False
            record.returned(op.tensor)
        self._finished(op, None)



class PinnedPipeline:
    """Moves one device's tensors into and out of page-locked host buffers.
    Each tensor keeps its host buffer while this Offloader knows it."""

    def __init__(self, device):
        self.device = device
        self._pool = _core.BufferPool(1 << 62)  # host buffers are the store itself: keep them
        self._pinned = {}                       # address -> capacity, page-locked once

    def _host_buffer(self, record, nbytes: int):
        host = getattr(record, "host", None)
        if host is None or host.capacity < nbytes:
            host = self._pool.acquire(nbytes)
            if host.address not in self._pinned:
                self.device.pin(host.address, host.capacity)
                self._pinned[host.address] = host.capacity
            record.host = host
        return host

    def start_write(self, op, nbytes: int):
        """Queues the copy out of op.tensor; returns what the completion needs."""
        t = op.tensor
        host = self._host_buffer(op.record, max(nbytes, 1))
        raw = raw_bytes(t)
        view = _core_view(host, nbytes)
        event = self.device.copy(view, raw, self.device.caller_event())
        del raw
        self.device.release_after(t, event)  # frees t's device memory once the copy is safe
        return event

    def start_read(self, op, nbytes: int):
        t = op.tensor
        self.device.allocate(t, nbytes)  # on the caller's stream
        raw = raw_bytes(t)
        self.device.used_by_copy_stream(raw)
        return self.device.copy(raw, _core_view(op.record.host, nbytes), self.device.caller_event())

    def progress(self) -> None:
        """Nothing to hand on: the copy stream orders every step."""

    def has_pending(self, kind) -> bool:
        return False  # every operation is in the engine until it completes

    def busy(self) -> bool:
        return False  # nothing waits for a reap to move on

    def close(self) -> None:
        for address in self._pinned:
            self.device.unpin(address)
        self._pinned.clear()


def _core_view(buffer, nbytes: int):
    return torch.frombuffer(buffer, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
