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

_signals.bookkeeping_module(__file__)


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

    def close(self) -> None:
        for address in self._pinned:
            self.device.unpin(address)
        self._pinned.clear()


def _core_view(buffer, nbytes: int):
    return torch.frombuffer(buffer, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]
