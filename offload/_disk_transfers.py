"""How an Offloader moves one operation's bytes between a tensor and its
backing file: extents claimed, pool buffers read into, writes staged through
pool blocks or made in place, requests batched for the engine, completions
turned back into tensor state. The ordering rules (which operation runs
when) are offloader.py's; this is the mechanism under them.

DiskTransfers is a part of the Offloader class (a base class holding these
methods, with the Offloader's state): each runs with the Offloader's lock
held. PinnedStore overrides ``_start_write``, ``_start_read`` and
``_complete`` with its own."""
import functools

from . import _core, _signals
from ._errors import os_error
from ._pool import fault_in, provision
from ._records import READ as _READ, WRITE as _WRITE, Op as _Op
from ._releaser import release
from ._striped_file import StripedFile
from ._submitter import BatchSubmitter
from ._tensors import (attach_buffer, attach_storage, check_tensor, check_whole_storage, detach_storage,
                       empty_storage, layout_of, must_be_resizable, refill_storage, resizable, snapshot_storage,
                       still_whole)
from .handle import Handle

_signals.bookkeeping_module(__file__)

_BATCH = 256  # requests per submission in vector calls


def _provision_for_read(record, write, nbytes) -> None:
    """Run by the releaser's thread once ``write``'s memory is free: asks for
    a block of ``nbytes`` for the tensor's read, unless that read took its
    block already (or the tensor died). Such a late request would have a
    block faulted in for no one, beside whatever the process does next
    (on a VM that hands freed memory to its host, that stalled the next
    writes for tens of milliseconds at a time: BENCHMARKS.md). Read without
    the Offloader's lock: a read that starts at this very moment may still
    find its block asked for, and the pool then caches it, as before."""
    if record.awaiting_block is write:
        provision({nbytes: 1})


class DiskTransfers:
    """The Offloader's disk mechanism (see the module docstring)."""

    def _reserve_extents(self, tensors, records) -> None:
        """Grows the file once for the new extents a vector write will claim."""
        round_up, need = self._file.extents.round_up, 0
        for t, record in zip(tensors, records):
            padded = round_up(t.numel() * t.element_size())
            if record is None or record.offset < 0 or record.capacity < padded:
                need += padded
        if need:
            self._file.reserve(need)

    # The steady state of small tensors (<= the engine's inline_bytes, 64 KiB)
    # of a page-cache file: a write goes from the tensor's own memory, which
    # is then freed in place (its storage resized to 0); a read resizes the
    # storage back and reads into it. The engine nearly always finishes such
    # a transfer within the call, and the operation is then counted on its
    # handle at once (a callback runs on the next call); if not, it stays in
    # flight as any other, a write keeping the storage and giving ``t`` an
    # empty one. Each kind is one function, checks and move together. Both
    # return None, having changed nothing, for what the general path must
    # take or refuse: a changed layout, a misuse, other memory, a device
    # tensor, an operation in flight on ``t``...

    def _write_in_place(self, t, record, handle=None, callback=None):
        """Writes ``t`` in place if it can be (see above), ``record`` being
        what the records hold under its id. Returns the handle the write is
        counted on: ``handle`` (a vector call's), or without one a handle of
        its own with ``callback``. A first write (no ``record``) gets one
        from _first_record. Raises for a tensor that no longer covers its
        storage, as the general path would."""
        if record is None:
            record = self._first_record(t)
            if record is None:
                return None
        elif record.busy or record.on_disk or record.stored or record() is not t:
            return None
        layout = record.layout
        if (layout is None or layout.nbytes > self._in_place_bytes or record.capacity < layout.nbytes
                or not t.is_cpu or not layout.matches(t)):
            return None
        nbytes = layout.nbytes
        storage = t.untyped_storage()
        if not resizable(storage):
            return None
        if not still_whole(t, storage, layout):
            check_whole_storage(t, storage)  # raises what the general path would
            return None
        tag = self._completions.take_tag()  # pending only if it stays in flight
        record.in_file = False  # the extent is being overwritten
        result = self._engine.submit_write_now(tag, self._fd, storage.data_ptr(), nbytes, record.offset)
        if result is not None and result >= 0:
            empty_storage(storage)
            record.released(t)
            record.stored = record.in_file = record.on_disk = True
            return self._finished_in_call(handle, callback)
        handle = handle if handle is not None else Handle(self._completions, 1, callback, self)
        if result is None:
            self._left_in_flight(_WRITE, t, record, handle, tag, storage)
            record.on_disk = True
            detach_storage(t, layout)
            record.released(t)
        elif handle._operation_finished(self._io_error(_WRITE, result, layout, tag)):
            self._completions.finish(handle)
        return handle

    def _read_in_place(self, t, record, handle=None, callback=None):
        """Reads ``t`` back in place if it can be (see above); returns the
        handle as _write_in_place does."""
        if record is None or record.busy or not record.stored or record() is not t:
            return None
        layout = record.layout
        nbytes = layout.nbytes
        if nbytes > self._in_place_bytes or not t.is_cpu or not layout.matches(t):
            return None
        storage = t.untyped_storage()
        if storage.nbytes() or not resizable(storage):
            return None
        tag = self._completions.take_tag()
        refill_storage(storage, nbytes)
        try:
            result = self._engine.submit_read_now(tag, self._fd, storage.data_ptr(), nbytes, record.offset)
        except BaseException:
            empty_storage(storage)
            raise
        if result is not None and result >= 0:
            record.stored = record.on_disk = False
            record.returned(t)
            return self._finished_in_call(handle, callback)
        handle = handle if handle is not None else Handle(self._completions, 1, callback, self)
        if result is None:
            self._left_in_flight(_READ, t, record, handle, tag, storage).in_place = True
            record.on_disk = False
            return handle
        empty_storage(storage)  # no data again; the file still holds it
        if handle._operation_finished(self._io_error(_READ, result, layout, tag)):
            self._completions.finish(handle)
        return handle

    def _left_in_flight(self, kind, t, record, handle, tag, storage) -> _Op:
        """An in-place transfer the engine did not finish within the call:
        an operation in flight on ``t`` as any other, completed by the
        engine under ``tag``, holding ``storage`` until then."""
        op = _Op(kind, t, record, handle)
        op.tag, self._completions.pending[tag] = tag, (self._complete, op)
        op.keep, record.busy = storage, True
        return op

    def _finished_in_call(self, handle, callback):
        """An in-place operation succeeded within its call: counted on
        ``handle``, or, for a call of its own, a handle made finished."""
        loop = self._completions
        if handle is None:
            handle = Handle(loop, 0, callback, self)
            if callback is not None:
                loop.finish(handle)  # due on the next call
        elif handle._operation_finished(None):
            loop.finish(handle)
        return handle

    def _first_record(self, t):
        """For _write_in_place, the record of a tensor written for the first time,
        its extent claimed where the file grants it, when the tensor is one
        that path moves (small, whole, dense CPU memory torch allocated).
        Raises what _plan raises for a tensor no write accepts; None, with
        nothing changed, for the rest, a file that refused to grow included
        (the general path claims again and reports the refusal on the
        handle)."""
        check_tensor(t)
        if not t.is_cpu:  # (no test device here: it turns this path off)
            return None
        self._check_cpu_tensor_allowed()
        storage = t.untyped_storage()
        if not 0 < t.nbytes <= self._in_place_bytes or not resizable(storage):
            return None
        check_whole_storage(t, storage)
        layout = layout_of(t)
        try:
            offset, capacity = self._file.claim(layout.nbytes)
        except OSError:
            return None
        record = self._new_record(t)
        record.layout, record.offset, record.capacity = layout, offset, capacity
        return record

    def _start_write(self, op) -> None:
        t, record = op.tensor, op.record
        storage, layout = self._layout_to_write(op)
        nbytes = layout.nbytes
        padded = self._file.extents.round_up(nbytes)
        record.in_file = False  # the extent is being overwritten
        if record.offset < 0 or record.capacity < padded:
            if record.offset >= 0:
                self._file.release(record.offset, record.capacity)
                record.offset = -1
            record.offset, record.capacity = self._file.claim(nbytes)
        device = self._device_for(t)
        if device is not None:
            if not must_be_resizable(storage):
                raise ValueError("device tensors must own resizable storage (allocated by torch)")
            del storage
            self._pipeline(device).start_write(op, record.offset, nbytes)
            return
        tag = self._new_tag(op)
        address = storage.data_ptr()
        capacity = self._pool.live_capacity(address)
        if capacity >= padded:
            # A pool buffer that a read (of any Offloader) made t's storage:
            # aligned, padded, reachable only through t, which lets go of it
            # now. The engine writes it in place and it stays referenced until
            # the completion. Memory of any other origin could be changed
            # behind our back mid-write, so it is snapshotted below instead.
            op.keep = storage
            self._submit(_core.KIND_WRITE, tag, address, padded, record.offset,
                         region=(address, capacity))
            detach_storage(t, layout)
            record.released(t)
        else:
            # torch's memory. The storage is t's no more (t is empty from
            # here); it is freed when the write completes. Memory torch does
            # not own (numpy's, a buffer's) may still be changed through its
            # owner: it is snapshotted now instead. Where the file's O_DIRECT
            # alignment admits its address and length (most NVMe: 4-byte
            # memory alignment; a buffered file: any), the engine writes it
            # as it is. Otherwise (here: 64 bytes past a page, against a
            # 512-byte alignment) the engine copies each chunk into a pool
            # block just before the chunk's I/O starts and recycles the block
            # when it is done, so a write touches no more fresh memory than
            # is in flight.
            if not resizable(storage):
                storage = snapshot_storage(storage, nbytes)
                address = storage.data_ptr()
            op.keep, op.frees = storage, padded
            if address % self._file.memory_alignment == 0 and nbytes % self._file.length_alignment == 0:
                self._submit(_core.KIND_WRITE, tag, address, nbytes, record.offset)
            else:
                self._submit(_core.KIND_WRITE, tag, 0, padded, record.offset, address, nbytes)
            detach_storage(t, layout)
            record.released(t)

    def _start_read(self, op) -> None:
        record = op.record
        record.awaiting_block = None  # this read takes its block now: none to provision for it
        if not record.stored:  # in memory already: complete through the engine, in order
            self._submit(_core.KIND_READ, self._new_tag(op), 0, 0, 0)
            return
        device = self._device_for(op.tensor)
        if device is not None:
            self._pipeline(device).start_read(op, record.offset, record.layout.nbytes)
            return
        tag = self._new_tag(op)
        length = self._file.extents.round_up(record.layout.nbytes)
        op.keep = buffer = self._pool.acquire(length)
        if buffer.fresh:  # a helper faults it in too, ahead of the engine
            self._fresh_reads.append(buffer)
            if self._batch is None:
                self._fault_in_fresh()
        # A fresh block is not registered on this first use: registering pins
        # (faults in) all of it at once in the submitting thread, serializing
        # what the read's own page faults spread over the I/O. It is
        # registered when it comes back from the pool, touched.
        self._submit(_core.KIND_READ, tag, buffer.address, length, record.offset,
                     region=(0, 0) if buffer.fresh else (buffer.address, buffer.capacity))

    def _submit(self, kind, tag, address, length, offset, copy_from=0, copy_length=0,
                region=(0, 0)) -> None:
        """Hands one request to the engine, or to the batch of a vector call
        (one submission, one io_uring_submit, for the whole group). ``region``
        is the pool block the memory lies in: io_uring registers its mapping
        as a fixed buffer on first use."""
        if not self._register:
            region = (0, 0)
        batch = self._batch
        if batch is not None:
            if kind == _core.KIND_WRITE:
                queued = batch.write(tag, self._fd, address, length, offset, copy_from, copy_length,
                                     region[0], region[1])
            else:
                queued = batch.read(tag, self._fd, address, length, offset, region[0], region[1])
            if queued >= _BATCH:  # start the disk on these while the rest are prepared
                self._flush_batch(more=True)
        elif kind == _core.KIND_WRITE:
            self._engine.submit_write(tag, self._fd, address, length, offset, copy_from, copy_length,
                                      region[0], region[1])
        else:
            self._engine.submit_read(tag, self._fd, address, length, offset, region[0], region[1])

    def _fault_in_fresh(self) -> None:
        fault_in(self._fresh_reads)
        self._fresh_reads = []

    def _flush_batch(self, more: bool = False) -> None:
        """Hands the vector call's batch to the engine: with ``more`` (the
        call goes on planning), on the submitter's thread, else here, once
        the batch before is in (see _submitter.py)."""
        batch = self._batch
        self._batch = _core.Requests() if more else None
        if self._fresh_reads:
            self._fault_in_fresh()
        if self._submitter is not None:
            self._fail_refused(*self._submitter.collect())
        if not batch:
            return
        if more:
            self._completions.reap()  # complete what already landed, not all at the end
            if self._submitter is None:
                self._submitter = BatchSubmitter(self._engine)
            self._submitter.hand(batch)
            return
        try:
            self._engine.submit(batch)
        except OSError as error:
            self._fail_refused(batch, error)

    def _fail_refused(self, batch, error) -> None:
        """A batch the engine refused started nothing: each of its requests
        completes with the error."""
        if batch is not None:
            for tag in batch.tags():
                self._completions.complete(tag, -error.errno)

    def _complete(self, op, result) -> None:
        """``op``'s request finished with ``result`` (bytes, or -errno)."""
        record, t = op.record, op.tensor
        layout = record.layout
        error = self._io_error(op.kind, result, layout, op.tag) if result < 0 else None
        if op.kind == _WRITE:
            if error is None:
                record.stored = record.in_file = True
                # The tensor's memory goes now, and the read that brings it
                # back wants a block: provisioned once the memory is free (on
                # a VM that hands freed memory to its host, that block is
                # then likely the memory just freed, still backed).
                provide = op.frees
                if provide:
                    record.awaiting_block = op
                if resizable(op.keep):
                    # Written from t's own storage: emptied, so freed even if
                    # some tensor still holds it. Where small tensors are read
                    # back in place (a page-cache file), t gets it back (unless
                    # it was given another meanwhile) for that read to refill.
                    if self._in_place_bytes and not t.untyped_storage().nbytes():
                        attach_storage(t, op.keep, layout)
                        empty_storage(op.keep)
                    elif provide and release(op.keep, functools.partial(_provision_for_read, record, op, provide)):
                        provide = 0  # large: freed off this path, then provisioned
                    else:
                        op.keep.resize_(0)
                if provide:
                    self._freed.append((record, op, provide))  # provisioned after the reap
            else:
                attach_storage(t, op.keep, layout)
                record.returned(t)
        elif op.in_place:
            if error is None:
                record.stored = False
                record.returned(t)
            else:  # no data again; the file still holds it
                empty_storage(op.keep)
        elif op.keep is not None and error is None:
            attach_buffer(t, op.keep, layout)
            record.stored = False
            record.returned(t)
        self._finished(op, error)

    def _io_error(self, kind, result, layout, tag=None) -> OSError:
        verb = "writing" if kind == _WRITE else "reading"
        path = self.path
        if isinstance(self._file, StripedFile) and tag is not None:  # the directory it failed in
            path = self._file.path_of(self._engine.failed_fd(tag))
        return os_error(-result, path, f"while {verb} a {layout.describe()}")


class DiskPort:
    """An Offloader's file as its device pipelines see it (DevicePipeline's
    ``disk``): staged requests in, completions out, nothing else."""

    def __init__(self, offloader):
        self._engine, self._fd, self._loop = offloader._engine, offloader._fd, offloader._completions
        self._register = offloader._register
        self.path = offloader.path
        self.round_up = offloader._file.extents.round_up
        self.wake = offloader._engine.wake
        self.finished = offloader._finished

    def submit(self, kind, buffer, length, offset, handler, entry) -> None:
        region = (buffer.address, buffer.capacity) if self._register else (0, 0)
        tag = self._loop.new_tag(handler, entry)
        submit = self._engine.submit_write if kind == _core.KIND_WRITE else self._engine.submit_read
        try:
            submit(tag, self._fd, buffer.address, length, offset, region=region[0], region_length=region[1])
        except OSError as error:
            self._loop.complete(tag, -error.errno)
