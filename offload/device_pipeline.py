"""Device (GPU) tensors to and from the backing file, chunk by chunk, through
a bounded ring of page-locked, page-aligned staging buffers, so the copy of
one chunk overlaps the disk I/O of others.

Ordering, and what each step waits for:

- write: the device-to-host copy of a chunk waits for an event recorded on the
  caller's stream at the call (so earlier work on it finishes first); the disk
  write of a chunk starts only after its copy has really happened (and as soon
  as it has: the device wakes the Offloader's wait for it); a slot is
  reused only after the disk is done with it; the tensor's device memory is
  released only when every copy out of it has finished.
- read: the tensor's device memory is allocated on the caller's stream and
  handed to the copy stream (record_stream); a slot is refilled from disk only
  after the copy out of it happened; when the read completes, the stream
  that was current at the call waits for the last copy (copies run in order
  on one stream), whichever thread completes it.
- Between the owner's calls, its progress thread does the reaping that moves
  these steps along (``busy()`` says when one is needed).
"""
import collections

import torch

from . import _core, _signals
from ._errors import os_error
from .devices import raw_bytes

_signals.bookkeeping_module(__file__)

READ, WRITE = 0, 1


def device_skip(device) -> str:
    """The ordering step a test device was told to leave out ("": none)."""
    return getattr(device, "skip", "")


class StagingRing:
    """``slots`` buffers of ``slot_bytes``, never more: page-aligned blocks of
    ``pool`` (default: a private one; huge-page backed), page-locked by the
    device when there is one, registered with io_uring as fixed buffers on
    first use. A slot given back with an event is handed out again only
    after that event; the oldest slot given back goes first, and a slot
    never used only when none is free (its pages may still have to be
    faulted in, which in a fresh process can cost more than the disk takes
    to write a slot)."""

    def __init__(self, device, slots: int, slot_bytes: int, pool=None):
        self.device = device
        self.slot_bytes = slot_bytes
        self._pool = _core.BufferPool(0) if pool is None else pool
        self.buffers = [self._pool.acquire(slot_bytes) for _ in range(slots)]
        self.views = [torch.frombuffer(b, dtype=torch.uint8) for b in self.buffers]
        self._pinned = []
        for b in self.buffers if device is not None else ():
            device.pin(b.address, b.capacity)
            self._pinned.append(b.address)
        self._free = collections.deque()
        self._unused = collections.deque(range(slots))
        self._events = [None] * slots

    def has_free(self) -> bool:
        return bool(self._free or self._unused)

    def take(self) -> int:
        slot = self._free.popleft() if self._free else self._unused.popleft()
        event, self._events[slot] = self._events[slot], None
        if event is not None and device_skip(self.device) != "wait_before_reuse":
            event.synchronize()  # a copy out of / into this slot is still queued
        return slot

    def give(self, slot: int, event=None) -> None:
        self._events[slot] = event
        self._free.append(slot)

    def close(self) -> None:
        for slot, event in enumerate(self._events):
            if event is not None:
                event.synchronize()
        for address in self._pinned:
            self.device.unpin(address)
        self._pinned.clear()
        self.views.clear()
        self.buffers.clear()


class CopyQueue:
    """Staging slots whose copy out of device memory is queued, oldest first.
    The disk may take a slot's bytes only once its copy has happened, and
    should take them as soon as it has: ``add`` has each device call ``wake``
    when its copy lands, and ``pop_landed`` hands back the oldest slot's entry
    once it has. The Offloader's pipeline and the checkpoint writer both keep
    that rule through this class."""

    def __init__(self, skip: str = ""):
        self._queue = collections.deque()  # (entry, events)
        self._skip_wait = skip == "wait_before_write"  # a planted bug of the test device

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self):
        return (entry for entry, _ in self._queue)

    def add(self, entry, copies, wake) -> None:
        """``copies``: (device, event) of the last copy into the entry's slot
        on each device (copies on one device run in order); none when the
        bytes are already there."""
        self._queue.append((entry, [event for _, event in copies]))
        for device, event in copies:
            device.notify_when_done(event, wake)

    def pop_landed(self, busy: bool):
        """The oldest entry if its copies have landed, else None; when
        ``busy`` is false (the disk has none of our I/O to do meanwhile) it
        waits for them instead."""
        if not self._queue:
            return None
        entry, events = self._queue[0]
        if not self._skip_wait and not all(event.query() for event in events):
            if busy:
                return None
            for event in events:
                event.synchronize()
        self._queue.popleft()
        return entry

    def settle(self) -> None:
        """Waits for every queued copy and forgets them (before the slots go)."""
        while self._queue:
            for event in self._queue.popleft()[1]:
                event.synchronize()


class _Transfer:
    """One device tensor moving, as chunks of at most slot_bytes."""

    __slots__ = ("pipeline", "op", "kind", "raw", "offset", "nbytes", "chunks", "next_chunk",
                 "unfinished", "after", "stream", "last_event", "error")

    def __init__(self, pipeline, op, kind, raw, offset, nbytes, slot_bytes, after):
        self.pipeline = pipeline
        self.op, self.kind, self.raw, self.offset, self.nbytes = op, kind, raw, offset, nbytes
        self.chunks = -(-nbytes // slot_bytes)
        self.next_chunk = 0
        self.unfinished = self.chunks
        self.after = after
        self.stream = None  # a read's: the caller's stream at the call, ordered after its last copy
        self.last_event = None
        self.error = None


class _Chunk:
    __slots__ = ("transfer", "start", "length", "slot")

    def __init__(self, transfer, start, length, slot):
        self.transfer, self.start, self.length, self.slot = transfer, start, length, slot


class DevicePipeline:
    """Runs the transfers of one device for one owner (an Offloader), whose
    side of it is ``disk``: ``disk.submit(kind, buffer, length, offset,
    handler, entry)`` starts one request of a staging buffer on the file (its
    completion, or its refusal, calls ``handler(entry, result)`` on the
    reaping thread), ``disk.round_up(n)`` pads a length for the file,
    ``disk.path`` names it in errors, ``disk.wake()`` wakes a thread waiting
    for completions, and ``disk.finished(op, error)`` is told when ``op``'s
    transfer ended. The owner calls ``start_write``/``start_read``, and
    ``progress`` after each reap, with its lock held."""

    def __init__(self, disk, device, slots: int, slot_bytes: int):
        self._disk = disk
        self.device = device
        self.ring = StagingRing(device, slots, slot_bytes)
        self._wake = disk.wake  # a no-op once the engine is closed
        self._waiting = collections.deque()  # transfers with chunks not started yet
        self._copying = CopyQueue(device_skip(device))  # write chunks whose copy is queued
        self._on_disk = 0                     # chunks whose disk I/O is in flight

    def has_pending(self, kind) -> bool:
        """Whether a transfer of ``kind`` (READ or WRITE) waits for a staging
        slot or a device copy (those have no request in the engine yet)."""
        return any(t.kind == kind for t in self._waiting) or any(c.transfer.kind == kind for c in self._copying)

    def start_write(self, op, offset: int, nbytes: int) -> None:
        """Starts writing op.tensor; it keeps its memory until the write is done."""
        t = op.tensor
        transfer = _Transfer(self, op, WRITE, raw_bytes(t), offset, nbytes, self.ring.slot_bytes,
                             self.device.caller_event())
        self._begin(transfer)

    def start_read(self, op, offset: int, nbytes: int) -> None:
        """Gives op.tensor device memory again and starts filling it."""
        t = op.tensor
        self.device.allocate(t, nbytes)  # on the caller's stream
        raw = raw_bytes(t)
        self.device.used_by_copy_stream(raw)
        transfer = _Transfer(self, op, READ, raw, offset, nbytes, self.ring.slot_bytes,
                             self.device.caller_event())
        transfer.stream = self.device.caller_stream()  # the read may finish on the progress thread
        self._begin(transfer)

    def _begin(self, transfer) -> None:
        if transfer.chunks == 0:
            self._finish(transfer)
            return
        self._waiting.append(transfer)
        self._pump()

    def _pump(self) -> None:
        # Fill every free slot: queue all the device-to-host copies first, so
        # that they run back to back on the copy stream, then hand the disk
        # each chunk whose copy has landed.
        while self._waiting and self.ring.has_free():
            transfer = self._waiting[0]
            k = transfer.next_chunk
            transfer.next_chunk += 1
            if transfer.next_chunk == transfer.chunks:
                self._waiting.popleft()
            start = k * self.ring.slot_bytes
            chunk = _Chunk(transfer, start, min(self.ring.slot_bytes, transfer.nbytes - start),
                           self.ring.take())
            if transfer.kind == WRITE:
                copied = self.device.copy(self.ring.views[chunk.slot][:chunk.length],
                                          transfer.raw[chunk.start:chunk.start + chunk.length],
                                          transfer.after)
                self._copying.add(chunk, [(self.device, copied)], self._wake)
            else:
                self._start_io(chunk)
        self._write_copied()

    def busy(self) -> bool:
        """Whether a transfer is under way: its next steps need a reap."""
        return bool(self._waiting or self._copying or self._on_disk)

    def progress(self) -> None:
        """Hands the disk the chunks whose copies landed since (the Offloader's
        reaper calls this; the device's wake-up brings it here)."""
        if self._copying:
            self._write_copied()

    def _write_copied(self) -> None:
        """Starts the disk write of every chunk whose copy out of the device has
        landed, oldest first (copies run in order). The calling thread blocks on
        a copy only when the disk has none of our I/O left to do meanwhile;
        otherwise the copy's wake-up (or the next disk completion) brings it
        back here."""
        while (chunk := self._copying.pop_landed(busy=self._on_disk > 0)) is not None:
            self._start_io(chunk)

    def _start_io(self, chunk) -> None:
        transfer = chunk.transfer
        self._on_disk += 1  # complete() counts it back, whether the disk or submit fails it
        self._disk.submit(_core.KIND_WRITE if transfer.kind == WRITE else _core.KIND_READ,
                          self.ring.buffers[chunk.slot], self._disk.round_up(chunk.length),
                          transfer.offset + chunk.start, self.complete, chunk)

    def complete(self, chunk, result: int) -> None:
        """A chunk's disk I/O finished (called by the owner's reaper)."""
        self._on_disk -= 1
        transfer = chunk.transfer
        if result < 0 and transfer.error is None:
            verb = "writing" if transfer.kind == WRITE else "reading"
            transfer.error = os_error(-result, self._disk.path,
                                      f"while {verb} a {transfer.op.record.layout.describe()} "
                                      f"on {transfer.raw.device}")
        if transfer.kind == READ and transfer.error is None:
            event = self.device.copy(transfer.raw[chunk.start:chunk.start + chunk.length],
                                     self.ring.views[chunk.slot][:chunk.length], transfer.after)
            transfer.last_event = event
            self.ring.give(chunk.slot, event)
        else:
            self.ring.give(chunk.slot)
        transfer.unfinished -= 1
        if transfer.error is not None and transfer in self._waiting:
            # Do not start the rest of a failed transfer.
            transfer.unfinished -= transfer.chunks - transfer.next_chunk
            self._waiting.remove(transfer)
        if transfer.unfinished == 0:
            self._finish(transfer)
        self._pump()

    def _finish(self, transfer) -> None:
        op, error = transfer.op, transfer.error
        transfer.raw = None  # no reference to the memory may outlive the transfer (alias checks)
        if transfer.kind == WRITE:
            if error is None:
                self.device.release(op.tensor)  # every copy out of it has finished (synchronized above)
                op.record.released(op.tensor)
                op.record.stored = op.record.in_file = True
        elif error is None:
            if transfer.last_event is not None:
                self.device.order_before_caller(transfer.last_event, transfer.stream)
            op.record.stored = False
            op.record.returned(op.tensor)
        else:
            if transfer.last_event is not None:
                transfer.last_event.synchronize()  # copies into the memory we are about to free
            self.device.release(op.tensor)
        transfer.after = transfer.stream = transfer.last_event = transfer.pipeline = None
        self._disk.finished(op, error)

    def close(self) -> None:
        self.ring.close()
        self.device.close()
