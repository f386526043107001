"""The Offloader: tensors to and from a private file, with callbacks and await."""
import collections
import os
import threading
import weakref

from . import _core, _fork, _signals
from ._backing_file import BackingFile
from ._completion_loop import CompletionLoop, gc_paused
from ._pool import buffer_pool
from ._striped_file import StripedFile
from ._engines import open_engine
from ._errors import OffloaderClosedError, OffloaderForkedError, os_error
from ._tensors import (TensorLayout, attach_buffer, attach_storage, check_tensor,
                       check_whole_storage, detach_storage, snapshot_storage, still_whole)
from .handle import Handle

_READ, _WRITE = 0, 1
_BATCH = 256          # requests per submission in vector calls


class _Record:
    """What this Offloader knows about one tensor it has seen."""

    __slots__ = ("ref", "layout", "offset", "capacity", "stored", "on_disk", "busy", "queue", "host",
                 "in_file")

    def __init__(self, ref):
        self.ref = ref
        self.layout = None
        self.offset = -1          # extent in the backing file, -1 when none
        self.capacity = 0
        self.stored = False       # the extent holds the data and the tensor's memory is released
        self.on_disk = False      # what `stored` will be once every queued operation has run
        self.busy = False         # an operation on this tensor is in the engine
        self.queue = None         # operations issued after the busy one, in order
        self.host = None          # Offloader(None): the page-locked buffer holding the data
        self.in_file = False      # the extent holds the bytes of the last successful write


class _Op:
    __slots__ = ("kind", "tensor", "record", "handle", "keep", "checked", "in_place", "tag")

    def __init__(self, kind, tensor, record, handle):
        self.kind = kind
        self.tensor = tensor    # strong references until the completion is reaped
        self.record = record
        self.handle = handle
        self.keep = None        # the memory the kernel reads from or writes into
        self.checked = False    # validated at issue, nothing ran in between
        self.in_place = False   # a read into the tensor's own storage, resized for it
        self.tag = 0            # its engine request's


def _forget_tensor(offloader_ref, key, ref):
    # A weakref callback may run anywhere (even inside the allocator, from the
    # cyclic GC): only note the death; the next call of the Offloader cleans up.
    offloader = offloader_ref()
    if offloader is not None:
        offloader._dead.append((key, ref))


def _shutdown(engine, backing_file):
    engine.close()       # waits for in-flight I/O before anything is freed
    backing_file.close()


_signals.bookkeeping_module(__file__)


class Offloader:
    """Moves CPU tensors to a private file in ``dir_name`` and back.

    Writing a tensor puts its bytes in the file and releases its memory (the
    tensor keeps dtype, shape and strides, with an empty storage); reading
    gives it memory again holding the same bytes. Calls on the same tensor take
    effect in the order they were issued. Every call first reaps the completed
    operations and runs their callbacks, on the calling thread.

    Lifecycle. ``close()`` may be called from any thread, any number of
    times: it stops admission first (calls that start after it raise
    ``OffloaderClosedError``), then waits for what was admitted, so it returns
    however many threads keep calling. An Offloader belongs to the process
    that created it: in a forked child every call raises
    ``OffloaderForkedError`` and nothing the child does touches the parent's
    engine or file; it cannot be pickled. A ``KeyboardInterrupt`` (or another
    exception raised by a signal handler installed before the Offloader was
    created) never lands inside the Offloader's bookkeeping, only where it
    waits or runs callbacks: once ``synchronize()`` returns, every tensor is
    either in memory and writable, or released with its bytes in the file and
    readable. A cancelled ``await`` leaves its operation running to its end.

    Parameters
    ----------
    dir_name : str, os.PathLike, a list of them, or None
        Directory for the backing file (created 0600, removed by ``close()``).
        Several directories (one per NVMe drive): a backing file in each, used
        as one striped file (RAID-0 in ``chunk_bytes`` units), so every tensor
        larger than a unit is spread over all of them and their I/O runs at
        once; an error on one names its directory. One directory in a list
        behaves as that directory alone.
        None keeps device (CUDA) tensors in page-locked CPU memory instead, with
        no disk at all (activation offloading): the Offloader is then a
        ``PinnedStore`` (offload/pinned_store.py), and ``backend`` "pinned".
    n_entries : int
        Queue depth: chunk I/Os in flight at once (io_uring SQ size).
    backend : {"auto", "uring", "threads"}
        ``auto`` uses io_uring and falls back to threads with a warning that
        names the reason. ``backend`` afterwards names the engine in use.
    direct : bool or None
        O_DIRECT: None uses it where the file system accepts it (``direct``
        afterwards says whether it is in use), True requires it, False never.
    chunk_bytes : int
        Largest single I/O; bigger tensors are split and run concurrently.
    threads : int
        Worker threads of the ``threads`` engine.
    staging_buffers, staging_buffer_bytes : int
        CUDA tensors move through this many page-locked staging buffers of this
        size (per device, allocated on first use, never more): 16 x 16 MiB, twice
        the engine's 128 MiB of I/O in flight, so the disk stays busy while
        some buffers are being copied.
    register_buffers : bool
        Register the buffers I/O runs on with io_uring as fixed buffers (on
        first use; memory blocks stay registered while they live). Refusal
        (RLIMIT_MEMLOCK) is not an error: one warning, and I/O goes on.
    device : object or None
        A device backend to use instead of CUDA (tests pass
        ``offload.devices.LateCopyDevice()`` to run the GPU pipeline on the CPU).
    """

    def __init__(self, dir_name, n_entries: int = 128, backend: str = "auto", *, direct=None,
                 chunk_bytes: int = 4 << 20, threads: int = 8, staging_buffers: int = 16,
                 staging_buffer_bytes: int = 16 << 20, register_buffers: bool = True, device=None):
        if n_entries < 1 or chunk_bytes < 4096 or chunk_bytes % 4096 or chunk_bytes > 1 << 30:
            raise ValueError("n_entries must be >= 1 and chunk_bytes a multiple of 4096 up to 1 GiB")
        if staging_buffers < 1 or staging_buffer_bytes < 4096 or staging_buffer_bytes % 4096:
            raise ValueError("staging_buffers must be >= 1 and staging_buffer_bytes a multiple of 4096")
        self._closing = True
        self._owner_pid = os.getpid()
        self._close_done = threading.Event()
        self._closer = None    # the thread running close()
        self._pool = buffer_pool()
        self._engine, self._file = self._open_store(dir_name, n_entries, backend, direct, chunk_bytes, threads,
                                                    register_buffers)
        self._finalizer = weakref.finalize(self, _shutdown, self._engine, self._file)
        self._self_ref = owner = weakref.ref(self)  # (the loop must not keep the Offloader alive)
        self._completions = loop = CompletionLoop(self._engine, lambda: owner()._refusal(),
                                                  lambda: owner()._tend())
        self._lock = loop.lock
        self.backend = self._engine.name
        self.direct, self.path, self._fd = self._file.direct, self._file.path, self._file.fd
        # Small tensors of a page-cache file move from and into their own
        # storage (resized to 0 and back), no pool buffer: the engine runs such
        # transfers within the call, so nothing can change the memory meanwhile.
        # (Not with a test device: its tensors take the device path.)
        self._in_place_bytes = 0 if self._file.direct or device is not None else self._engine.inline_bytes
        self._records = {}   # id(tensor) -> _Record, checked against the weakref
        self._dead = []      # (key, weakref) of tensors that died
        self._batch = None  # requests of a vector call, submitted together
        self._register = register_buffers
        self._test_device = device
        self._staging = (staging_buffers, staging_buffer_bytes)
        self._chunk_bytes = chunk_bytes
        self._pipelines = {}  # device backend -> DevicePipeline, made on first use
        self._cuda_devices = {}  # CUDA device index -> CudaDevice
        _fork.track(self)
        _signals.install()
        self._closing = False

    def __new__(cls, *args, **options):
        if cls is Offloader and (args[0] if args else options.get("dir_name", "")) is None:
            # Offloader(None): the pinned-memory store
            from .pinned_store import PinnedStore
            cls = PinnedStore
        return super().__new__(cls)

    def _open_store(self, dir_name, n_entries, backend, direct, chunk_bytes, threads, register_buffers):
        """The engine and the backing file (one directory, or striped over several)."""
        engine = open_engine(backend, n_entries, chunk_bytes, threads)
        engine.set_staging_pool(self._pool, register_buffers)
        directories = list(dir_name) if isinstance(dir_name, (list, tuple)) else [dir_name]
        try:
            if not directories:
                raise ValueError("Offloader needs at least one directory")
            if len(directories) == 1:
                return engine, BackingFile(directories[0], direct, self._pool)
            return engine, StripedFile(directories, direct, self._pool, engine, chunk_bytes)
        except BaseException:
            engine.close()
            raise

    # ------------------------------------------------------------------ API
    def async_write(self, t, callback=None) -> Handle:
        """Starts writing ``t`` and releases its memory: ``t`` has an empty
        storage from now on; its old one is the Offloader's until the bytes
        are in the file, then freed. ``callback()`` runs once they are there.
        If the write fails, ``t`` gets its data back and the handle (and
        ``synchronize()``) raise the OSError."""
        return self._issue_one(_WRITE, t, callback)

    def async_read(self, t, callback=None) -> Handle:
        """Starts reading ``t`` back; ``callback()`` runs once ``t`` holds its
        bytes again. Reading a tensor that is in memory does nothing."""
        return self._issue_one(_READ, t, callback)

    def async_writev(self, tensors, callback=None) -> Handle:
        """async_write for several tensors; one handle and one callback for all."""
        return self._issue(_WRITE, list(tensors), callback)

    def async_readv(self, tensors, callback=None) -> Handle:
        """async_read for several tensors; one handle and one callback for all."""
        return self._issue(_READ, list(tensors), callback)

    def sync_write(self, t) -> None:
        self.async_write(t).wait()

    def sync_read(self, t) -> None:
        self.async_read(t).wait()

    def sync_writev(self, tensors) -> None:
        self.async_writev(tensors).wait()

    def sync_readv(self, tensors) -> None:
        self.async_readv(tensors).wait()

    def write(self, t, callback=None) -> Handle:
        """``await off.write(t)`` (or a list): starts now, finishes through the event loop."""
        if isinstance(t, (list, tuple)):
            return self._issue(_WRITE, list(t), callback)
        return self._issue_one(_WRITE, t, callback)

    def read(self, t, callback=None) -> Handle:
        """``await off.read(t)`` (or a list): starts now, finishes through the event loop."""
        if isinstance(t, (list, tuple)):
            return self._issue(_READ, list(t), callback)
        return self._issue_one(_READ, t, callback)

    def warm(self, tensors) -> int:
        """Faults in, now, the buffers that reading ``tensors`` back will land
        in (CPU tensors of a file-backed Offloader; others are skipped), so the
        first reads of a process run at disk speed instead of paying for
        memory never touched inside the I/O (0.4-3 GB/s on the development
        VM). The buffers wait in the pool (beyond its idle limit, lazily
        freed: the kernel may still take them back under memory pressure).
        Holds no lock: call it from a thread of your own to overlap it with
        other start-up work. Returns the bytes faulted in."""
        if self._test_device is not None:
            return 0
        round_up = self._file.extents.round_up
        sizes = [round_up(t.numel() * t.element_size()) for t in tensors if t.is_cpu and t.numel()]
        # And the blocks a first write stages its chunks through (as many as it
        # keeps in flight); smaller tensors stage through blocks of their own size.
        large = sum(size for size in sizes if size >= self._chunk_bytes)
        sizes += [self._chunk_bytes] * (min(large, self._engine.max_in_flight_bytes) // self._chunk_bytes)
        return self._pool.warm(sizes)

    def discard(self, t) -> None:
        """Returns ``t`` to its offloaded state without writing: its memory is
        released and the file still holds the bytes of its last write, which
        the next read brings back. For data read only to be used (weights for
        a forward pass) or to abandon changes. Changes made to ``t`` since it
        was read are lost. On the CPU, other tensors sharing ``t``'s memory
        keep it; a device tensor's memory is freed. ``t`` must have been
        written to this Offloader, and have no operation in flight; discarding
        a tensor that is offloaded already does nothing."""
        self._completions.poll()
        with self._lock:
            if self._closing:
                raise self._refusal()
            check_tensor(t)
            record = self._records.get(id(t))
            if record is None or record.ref() is not t or record.layout is None:
                raise RuntimeError("this tensor was never written to this Offloader: nothing to return to")
            if record.busy:
                raise RuntimeError(f"this {record.layout.describe()} has operations in flight: "
                                   "wait for them before discarding it")
            if record.stored:
                return
            if not record.in_file:
                raise RuntimeError(f"cannot discard this {record.layout.describe()}: the store does not "
                                   "hold its bytes (its last write failed, or this is Offloader(None))")
            if not record.layout.matches(t):
                raise ValueError(f"the tensor changed since it was written: it was a "
                                 f"{record.layout.describe()}, now {t.dtype} {tuple(t.shape)}")
            device = self._device_for(t)
            if device is None:
                detach_storage(t, record.layout)
            else:
                device.release(t)
            record.stored = record.on_disk = True

    @_signals.interruptible
    def synchronize(self) -> None:
        """Waits for every operation in flight, runs every due callback, then
        raises the first error no handle has reported yet (if any). Interrupted
        (Ctrl-C), it leaves the operations running; call it again."""
        self._wait_until_quiet(None)

    @_signals.interruptible
    def sync_write_events(self) -> None:
        """Waits for every write issued so far (TensorNVMe's name), running due
        callbacks; raises the first error no handle reported."""
        self._wait_until_quiet(_WRITE)

    @_signals.interruptible
    def sync_read_events(self) -> None:
        """Waits for every read issued so far (TensorNVMe's name), as above."""
        self._wait_until_quiet(_READ)

    @_signals.interruptible
    def _wait_until_quiet(self, kind) -> None:
        """Waits until no operation of ``kind`` (None: of any kind) is in
        flight and no callback is due."""
        if self._closing and self._owner_pid != os.getpid():
            raise self._refusal()
        loop = self._completions
        loop.wait_until((lambda: not loop.pending) if kind is None else (lambda: not self._kind_in_flight(kind)))
        _warn_if_unregistered(self._engine)
        loop.raise_unreported()

    def _kind_in_flight(self, kind) -> bool:
        for _, entry in self._completions.pending.values():
            if (entry if type(entry) is _Op else entry.transfer.op).kind == kind:
                return True
        if any(pipeline.has_pending(kind) for pipeline in self._pipelines.values()):
            return True
        return any(op.kind == kind for record in self._records.values() if record.queue for op in record.queue)

    def inject_faults(self, error_rate: float = 0.0, errnos=(), short_rate: float = 0.0,
                      delay_rate: float = 0.0, delay_ms: int = 0, seed: int = 1) -> None:
        """For testing error handling on a normal build: from now on each chunk
        I/O fails with an errno from ``errnos`` with probability ``error_rate``
        (EAGAIN and EINTR are retried by the engine), reports a short transfer
        with probability ``short_rate`` (the rest is resubmitted), or completes
        ``delay_ms`` late with probability ``delay_rate``. Call with no
        arguments to stop."""
        with self._lock:
            self._engine.set_faults(error_rate, list(errnos), short_rate, delay_rate, delay_ms, seed)

    def close(self) -> None:
        """Stops admission, waits for every operation admitted, runs due
        callbacks, then frees the engine and removes the backing file; raises
        the first error no handle reported. Tensors still offloaded lose their
        data. Thread-safe and idempotent: a call that starts after close()
        began raises ``OffloaderClosedError``; a second close() returns once
        the first has finished. A ``sync_*`` call, ``wait()`` or ``await``
        already waiting gets its result (or, if close() is interrupted before
        the drain ends, ``OffloaderClosedError``), never a hang."""
        with self._lock:
            first, self._closing = not self._closing, True
        if not first:
            if self._owner_pid == os.getpid() and threading.get_ident() != self._closer:
                self._close_done.wait()
            return
        self._closer = threading.get_ident()
        try:
            self._drain()
        finally:
            self._tear_down()

    @_signals.interruptible
    def _drain(self) -> None:
        # A callback that issues more is refused, as it must be now.
        first_error = self._completions.drain(OffloaderClosedError)
        _warn_if_unregistered(self._engine)
        if first_error is not None:
            raise first_error
        self._completions.raise_unreported()

    def _tear_down(self) -> None:
        with self._lock:
            self._completions.closed = True
            self._finalizer()  # drains the engine (without the GIL), closes the file
            for pipeline in self._pipelines.values():
                pipeline.close()
            self._pipelines.clear()
            self._completions.close()
            self._records.clear()
        self._close_done.set()

    def _refusal(self) -> OffloaderClosedError:
        """The error for a call this Offloader no longer admits."""
        if self._owner_pid != os.getpid():
            return OffloaderForkedError(
                f"this Offloader ({self.path}) belongs to process {self._owner_pid}, and this is a "
                f"forked child ({os.getpid()}): its ring, threads and file are the parent's. Create a "
                "new Offloader in the child, or start workers with the 'spawn' or 'forkserver' method")
        return OffloaderClosedError(f"this Offloader ({self.path}) is closed" if self._completions.closed
                                    else f"this Offloader ({self.path}) is closing")

    def _abandon_in_child(self) -> None:
        """Right after fork(), in the child: never touch the parent's engine or
        file again (no finalizer, no close), refuse every call."""
        self._finalizer.detach()
        self._closing = self._completions.closed = True
        self._close_done.set()

    def __reduce__(self):
        raise TypeError(f"cannot pickle an Offloader ({self.path}): it belongs to the process that "
                        "created it (an io_uring ring or threads, and a private file); create one in "
                        "each process instead")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:
                pass  # the exception already propagating is the one to see

    @property
    def closed(self) -> bool:
        return self._completions.closed

    @property
    def device(self):
        """The device backend given at construction (a test device), or None:
        CUDA tensors then move through CUDA, CPU tensors through the disk."""
        return self._test_device

    @property
    def registered_buffers(self) -> int:
        """Memory blocks registered with io_uring as fixed buffers right now."""
        return self._engine.fixed_buffers[0]

    @property
    def file_bytes(self) -> int:
        """Bytes of the backing file in use (the end of the last live extent)."""
        return self._file.extents.end

    def __repr__(self):
        state = "closed" if self.closed else f"{len(self._completions.pending)} in flight"
        return (f"<offload.Offloader {self.path!r} backend={self.backend} "
                f"direct={self.direct} {state}>")

    # ------------------------------------------------------------ internals
    def _begin_call(self, callback) -> None:
        """What every call does first: check the callback, then reap and run
        due callbacks (skipped when nothing is in flight or due)."""
        if callback is not None and not callable(callback):
            raise TypeError("callback must be callable with no arguments")
        loop = self._completions
        if loop.pending or loop.due or self._dead:
            loop.poll()

    def _issue_one(self, kind, t, callback) -> Handle:
        """One tensor: none of the vector calls' batching, and small tensors
        of a page-cache file moved within the call when they can be."""
        self._begin_call(callback)
        with self._lock:
            if self._closing:
                raise self._refusal()
            handle = self._move_now(kind, t, callback) if self._in_place_bytes else None
            if handle is None:
                record = self._plan(kind, t)
                handle = Handle(self._completions, 1, callback, self)
                self._start_one(kind, t, record, handle)
            return handle

    def _issue(self, kind, tensors, callback) -> Handle:
        self._begin_call(callback)
        with self._lock:
            if self._closing:
                raise self._refusal()
            with gc_paused(len(tensors)):
                records = [self._plan(kind, t) for t in tensors]
                if len({id(t) for t in tensors}) < len(tensors):
                    raise ValueError("the same tensor appears twice in one call")
                handle = Handle(self._completions, len(tensors), callback, self)
                if kind == _WRITE and len(tensors) > 1:
                    self._reserve_extents(tensors, records)
                self._batch = []
                try:
                    for t, record in zip(tensors, records):
                        self._start_one(kind, t, record, handle)
                finally:
                    self._flush_batch()
        if not tensors:
            with self._lock:
                self._completions.finish(handle)
        return handle

    def _reserve_extents(self, tensors, records) -> None:
        """Grows the file once for the new extents a vector write will claim."""
        round_up, need = self._file.extents.round_up, 0
        for t, record in zip(tensors, records):
            padded = round_up(t.numel() * t.element_size())
            if record is None or record.offset < 0 or record.capacity < padded:
                need += padded
        if need:
            self._file.reserve(need)

    def _move_now(self, kind, t, callback):
        """The steady state of small tensors (<= 64 KiB) of a page-cache file:
        the write goes from the tensor's own memory, which is then freed in
        place (its storage resized to 0); the read resizes the storage back
        and reads into it. The engine nearly always finishes such transfers
        within the call: the handle is then done on return (its callback runs
        on the next call). If not, the operation stays in flight as any other,
        a write keeping the storage and giving ``t`` an empty one. Returns
        None, having changed nothing, for what the general path must take,
        or refuse: a first write, a changed layout, a misuse, other memory,
        a device tensor, an operation in flight on ``t``..."""
        record = self._records.get(id(t))
        if record is None or record.busy or record.ref() is not t:
            return None
        layout, storage = record.layout, t.untyped_storage()
        if (layout is None or layout.nbytes > self._in_place_bytes or not t.is_cpu or not storage.resizable()
                or not layout.matches(t)):
            return None
        nbytes = layout.nbytes
        if kind == _WRITE:
            if record.on_disk or record.stored or record.capacity < nbytes:
                return None
            if not still_whole(t, storage, layout):
                check_whole_storage(t, storage)  # raises what the general path would
                return None
        elif not record.stored or storage.nbytes():
            return None
        handle = Handle(self._completions, 1, callback, self)
        tag = self._completions.take_tag()  # pending only if it stays in flight
        if kind == _WRITE:
            record.in_file = False  # the extent is being overwritten
            result = self._engine.submit_write_now(tag, self._fd, storage.data_ptr(), nbytes, record.offset)
            record.on_disk = result is None or result >= 0
            if result is None:
                op = _Op(kind, t, record, handle)
                op.tag, self._completions.pending[tag] = tag, (self._complete, op)
                op.keep, record.busy = storage, True
                detach_storage(t, layout)
                return handle
            if result >= 0:
                storage.resize_(0)
                record.stored = record.in_file = True
        else:
            storage.resize_(nbytes)
            try:
                result = self._engine.submit_read_now(tag, self._fd, storage.data_ptr(), nbytes, record.offset)
            except BaseException:
                storage.resize_(0)
                raise
            if result is None:
                op = _Op(kind, t, record, handle)
                op.tag, self._completions.pending[tag] = tag, (self._complete, op)
                op.keep, op.in_place, record.busy, record.on_disk = storage, True, True, False
                return handle
            if result >= 0:
                record.stored = record.on_disk = False
            else:  # no data again; the file still holds it
                storage.resize_(0)
        if result < 0:
            handle._error = self._io_error(kind, result, layout, tag)
        handle._remaining = 0
        if result < 0 or callback is not None:  # a new handle: no futures to wake
            self._completions.finish(handle)
        return handle

    def _start_one(self, kind, t, record, handle) -> None:
        """Starts ``t``'s operation, or queues it behind the one in flight."""
        record = record or self._new_record(t)
        op = _Op(kind, t, record, handle)
        record.on_disk = kind == _WRITE
        if kind == _WRITE and (record.layout is None or not record.layout.matches(t)):
            record.layout = TensorLayout(t)  # kept while unchanged: fewer objects for the GC to age
        if record.busy:
            if record.queue is None:
                record.queue = collections.deque()
            record.queue.append(op)
        else:
            op.checked = True  # _plan validated it just now
            self._start(op)

    def _plan(self, kind, t):
        """Raises if ``t`` cannot take this operation now; returns its record."""
        record = self._records.get(id(t))
        if record is not None and record.ref() is not t:
            record = None  # a dead tensor's id, reused
        if record is None or record.layout is None:  # (a tensor's layout kind never changes)
            check_tensor(t)
        cpu = t.is_cpu
        if (cpu and self._test_device is None) or self._device_for(t) is None:  # cheap test first
            if not cpu:
                raise ValueError(f"tensors on {t.device} are not supported: use CPU or CUDA tensors")
            self._check_cpu_tensor_allowed()
        if kind == _WRITE:
            if record is not None and record.on_disk:
                raise RuntimeError(f"this {record.layout.describe()} is already offloaded (or being "
                                   "offloaded): read it back before writing it again")
            if record is None or not record.busy:
                check_whole_storage(t, t.untyped_storage())
        else:
            if record is None or record.layout is None:
                raise RuntimeError("this tensor was never written to this Offloader: nothing to read")
            if not record.layout.matches(t):
                raise ValueError(f"the tensor changed since it was written: it was a "
                                 f"{record.layout.describe()} with strides {record.layout.stride}, "
                                 f"now {t.dtype} {tuple(t.shape)} with strides {t.stride()}")
        return record

    def _new_record(self, t) -> _Record:
        key = id(t)
        record = _Record(weakref.ref(t, lambda ref, k=key, o=self._self_ref: _forget_tensor(o, k, ref)))
        self._records[key] = record
        return record

    def _start(self, op) -> None:
        op.record.busy = True
        try:
            if op.kind == _WRITE:
                self._start_write(op)
            else:
                self._start_read(op)
        except Exception as error:  # nothing of it reached the engine
            pending = self._completions.pending
            for tag in [tag for tag, (_, entry) in pending.items() if entry is op]:
                del pending[tag]
            self._finished(op, error)

    def _new_tag(self, op) -> int:
        """A tag for one engine request of ``op``."""
        op.tag = tag = self._completions.new_tag(self._complete, op)
        return tag

    def _device_for(self, t):
        """The device backend that moves ``t``, or None for plain CPU I/O."""
        if self._test_device is None and t.is_cpu:
            return None
        if self._test_device is not None and self._test_device.owns(t):
            return self._test_device
        if t.is_cuda:
            index = t.device.index
            device = self._cuda_devices.get(index)
            if device is None:
                from .devices import CudaDevice
                device = self._cuda_devices[index] = CudaDevice(index)
            return device
        return None

    def _pipeline(self, device):
        pipeline = self._pipelines.get(device)
        if pipeline is None:
            from .device_pipeline import DevicePipeline
            pipeline = self._pipelines[device] = DevicePipeline(_Disk(self), device, *self._staging)
        return pipeline

    def _check_cpu_tensor_allowed(self) -> None:
        """CPU tensors go to the file (the pinned store refuses them)."""

    def _layout_to_write(self, op):
        """``op.tensor``'s storage and layout as the write will take them."""
        t, record = op.tensor, op.record
        if record.stored:
            raise RuntimeError("cannot write this tensor: the read queued before this write failed, "
                               "so the tensor has no data (its data is still in the file)")
        storage = t.untyped_storage()
        if op.checked:
            return storage, record.layout
        check_whole_storage(t, storage)  # queued behind other operations: it may have changed since
        record.layout = TensorLayout(t)
        return storage, record.layout

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
            if not storage.resizable():
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
        else:
            # torch's memory (64-byte aligned, 4 KiB pages): the engine copies
            # each chunk into a pool block just before the chunk's I/O starts
            # and recycles the block when it is done, so a write touches no
            # more fresh memory than is in flight. The storage is t's no more
            # (t is empty from here); it is freed when the write completes.
            # Memory torch does not own (numpy's, a buffer's) may still be
            # changed through its owner: it is snapshotted now instead.
            if not storage.resizable():
                storage = snapshot_storage(storage, nbytes)
                address = storage.data_ptr()
            op.keep = storage
            self._submit(_core.KIND_WRITE, tag, 0, padded, record.offset, address, nbytes)
            detach_storage(t, layout)

    def _start_read(self, op) -> None:
        record = op.record
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
        # A fresh block is not registered on this first use: registering pins
        # (faults in) all of it at once in the submitting thread, which held
        # a fresh process's first reads to 2.0-2.2 GB/s where letting the
        # read fault its pages ran at 2.8 (reserved huge pages, this VM). It
        # is registered when it comes back from the pool, touched.
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
        if self._batch is not None:
            self._batch.append((kind, tag, self._fd, address, length, offset, copy_from, copy_length,
                                region[0], region[1]))
            if len(self._batch) >= _BATCH:  # start the disk on these while the rest are prepared
                self._flush_batch(more=True)
        elif kind == _core.KIND_WRITE:
            self._engine.submit_write(tag, self._fd, address, length, offset, copy_from, copy_length,
                                      region[0], region[1])
        else:
            self._engine.submit_read(tag, self._fd, address, length, offset, region[0], region[1])

    def _flush_batch(self, more: bool = False) -> None:
        batch = self._batch
        self._batch = [] if more else None
        if not batch:
            return
        try:
            self._engine.submit(batch)
        except OSError as error:  # nothing started: each completes with the error
            for request in batch:
                self._completions.complete(request[1], -error.errno)
            return
        if more:  # complete what already landed while the rest is prepared, not all at the end
            self._completions.reap()

    def _complete(self, op, result) -> None:
        """``op``'s request finished with ``result`` (bytes, or -errno)."""
        record, t = op.record, op.tensor
        layout = record.layout
        error = self._io_error(op.kind, result, layout, op.tag) if result < 0 else None
        if op.kind == _WRITE:
            if error is None:
                record.stored = record.in_file = True
                if op.keep.resizable():
                    # Written from t's own storage: t gets it back (unless it was
                    # given another meanwhile), emptied; freed even if a view's
                    # base still holds it.
                    if not t.untyped_storage().nbytes():
                        attach_storage(t, op.keep, layout)
                    op.keep.resize_(0)
            else:
                attach_storage(t, op.keep, layout)
        elif op.in_place:
            if error is None:
                record.stored = False
            else:  # no data again; the file still holds it
                op.keep.resize_(0)
        elif op.keep is not None and error is None:
            attach_buffer(t, op.keep, layout)
            record.stored = False
        self._finished(op, error)

    def _io_error(self, kind, result, layout, tag=None) -> OSError:
        verb = "writing" if kind == _WRITE else "reading"
        path = self.path
        if isinstance(self._file, StripedFile) and tag is not None:  # the directory it failed in
            path = self._file.path_of(self._engine.failed_fd(tag))
        return os_error(-result, path, f"while {verb} a {layout.describe()}")

    def _finished(self, op, error) -> None:
        record = op.record
        record.busy = False
        if error is not None:  # recompute what the queued operations will leave
            record.on_disk = record.queue[-1].kind == _WRITE if record.queue else record.stored
        op.tensor = op.keep = None
        if op.handle._operation_finished(error):
            self._completions.finish(op.handle)
        if record.queue:
            next_op = record.queue.popleft()
            self._start(next_op)

    def _tend(self) -> None:
        """After each reap (the lock held): forget tensors that died, and
        hand the disk the device copies that landed meanwhile."""
        while self._dead:
            self._forget(*self._dead.pop())
        for pipeline in self._pipelines.values():
            pipeline.progress()

    def _forget(self, key, ref) -> None:
        record = self._records.get(key)
        if record is not None and record.ref is ref:
            del self._records[key]
            if record.offset >= 0:
                self._file.release(record.offset, record.capacity)


class _Disk:
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


_registration_refusal_reported = False


def _warn_if_unregistered(engine) -> None:
    """Says once per process that io_uring refused fixed buffers (I/O goes on)."""
    global _registration_refusal_reported
    error = engine.fixed_buffers[1]
    if error and not _registration_refusal_reported:
        _registration_refusal_reported = True
        import errno as errno_names
        import warnings
        warnings.warn(f"offload: io_uring refused fixed buffers ({errno_names.errorcode.get(-error, error)}"
                      f"{': RLIMIT_MEMLOCK is too low' if -error == errno_names.ENOMEM else ''}); "
                      "I/O continues unregistered", RuntimeWarning, stacklevel=3)


class DiskOffloader(Offloader):
    """TensorNVMe's name and signature, for code that switches:
    ``DiskOffloader(dir_name, n_entries=16, backend="uring")``. The directory
    is created if missing, as TensorNVMe does. TensorNVMe's "aio" and
    "pthread" backends map to the "threads" engine; "gds" is not offered."""

    def __init__(self, dir_name, n_entries: int = 16, backend: str = "uring", **options):
        if backend == "gds":
            raise ValueError("offload has no GPUDirect Storage backend: use 'uring' (CUDA tensors move "
                             "through page-locked staging)")
        os.makedirs(dir_name, exist_ok=True)
        super().__init__(dir_name, n_entries, {"aio": "threads", "pthread": "threads"}.get(backend, backend),
                         **options)
