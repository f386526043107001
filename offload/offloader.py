"""The Offloader: tensors to and from a private file, with callbacks and await.

This file holds its public calls, the rules that order operations on one
tensor (a record per tensor: at most one operation in the engine, the rest
queued in issue order), and its lifecycle. How bytes move to the file is
_disk_transfers.py; completions, waits and callbacks, _completion_loop.py."""
import collections
import functools
import os
import threading
import weakref

from . import _core, _fork, _signals
from ._backing_file import BackingFile
from ._completion_loop import CompletionLoop, gc_paused
from ._disk_transfers import DiskPort, DiskTransfers
from ._engines import close_engine, open_engine
from ._errors import OffloaderClosedError, OffloaderForkedError
from ._pool import buffer_pool, provision
from ._progress_thread import ProgressThread
from ._records import READ as _READ, WRITE as _WRITE, Op as _Op, Record as _Record
from ._striped_file import StripedFile
from .devices import DeviceResolver
from ._tensors import check_tensor, check_whole_storage, detach_storage, layout_of, storage_swaps
from .handle import Handle


# Vector reads of small tensors of a page-cache file into their own storage
# up to this size; larger ones into pool buffers, in one batch (measured:
# in place faster up to 16 KiB, the pool from 32 KiB; BENCHMARKS.md).
_VECTOR_READ_IN_PLACE_BYTES = 16 << 10


def _forget_tensor(offloader_ref, record):
    # A weakref callback may run anywhere (even inside the allocator, from the
    # cyclic GC): only note the death; the next call of the Offloader cleans up.
    offloader = offloader_ref()
    if offloader is not None:
        offloader._dead.append(record)


def _shutdown(engine, backing_file):
    """Frees the engine once its I/O is done, then the file (an engine
    given up on keeps the file: see close_engine)."""
    close_engine(engine, backing_file, then=backing_file.close)


_signals.bookkeeping_module(__file__)


class Offloader(DiskTransfers):
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
        self._on_death = functools.partial(_forget_tensor, owner)  # what a tensor's record calls at its death
        self._completions = loop = CompletionLoop(self._engine, lambda: owner()._refusal(),
                                                  lambda: owner()._tend(), storage_swaps)
        self._lock = loop.lock
        loop.progress = self._progress = ProgressThread(loop, lambda: _needs_progress(owner),
                                                        f"offload-progress {self._file.path}")
        self.backend = self._engine.name
        self.direct, self.path, self._fd = self._file.direct, self._file.path, self._file.fd
        loop.owner = f"the Offloader on {self.path!r}"
        # Small tensors of a page-cache file move from and into their own
        # storage (resized to 0 and back), no pool buffer: the engine runs such
        # transfers within the call, so nothing can change the memory meanwhile.
        # (Not with a test device: its tensors take the device path.)
        self._in_place_bytes = 0 if self._file.direct or device is not None else self._engine.inline_bytes
        self._records = {}   # id(tensor) -> _Record, checked against its weak reference
        self._dead = []      # records of tensors that died
        self._freed = []     # (record, write, block bytes) of writes that freed a tensor's memory since the last reap
        self._fresh_reads = []  # new blocks reads of the batch in hand were given, to fault in on a helper
        self._batch = None  # requests of a vector call, submitted together
        self._submitter = None  # submits a long vector call's batches beside its planning
        self._register = register_buffers
        self._test_device = device
        self._staging = (staging_buffers, staging_buffer_bytes)
        self._chunk_bytes = chunk_bytes
        self._pipelines = {}  # device backend -> DevicePipeline, made on first use
        self._devices = DeviceResolver(device)
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
        memory never touched inside the I/O. The buffers wait in the pool (beyond its idle limit, lazily
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
            if record is None or record() is not t or record.layout is None:
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
            record.released(t)
            record.stored = record.on_disk = True

    @_signals.interruptible
    def synchronize(self) -> None:
        """Waits for every operation in flight, runs every due callback, then
        raises the first error no handle has reported yet (if any). Interrupted
        (Ctrl-C), it leaves the operations running; call it again."""
        self._wait_until_quiet(None, "synchronize()")

    @_signals.interruptible
    def sync_write_events(self) -> None:
        """Waits for every write issued so far (TensorNVMe's name), running due
        callbacks; raises the first error no handle reported."""
        self._wait_until_quiet(_WRITE, "sync_write_events()")

    @_signals.interruptible
    def sync_read_events(self) -> None:
        """Waits for every read issued so far (TensorNVMe's name), as above."""
        self._wait_until_quiet(_READ, "sync_read_events()")

    @_signals.interruptible
    def _wait_until_quiet(self, kind, what) -> None:
        """Waits until no operation of ``kind`` (None: of any kind) is in
        flight and no callback is due; ``what`` names the call in a quiet
        wait's warning."""
        if self._closing and self._owner_pid != os.getpid():
            raise self._refusal()
        loop = self._completions
        loop.wait_until((lambda: not loop.pending) if kind is None else (lambda: not self._kind_in_flight(kind)),
                        what)
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
        ``delay_ms`` late with probability ``delay_rate``. A read failed so
        leaves a pattern, not its data, in the memory it was filling, as a
        real failure may; the bytes a short transfer leaves unreported hold
        a pattern too (in memory for a read, in the file for a write) until
        the engine moves them again. Call with no arguments to stop."""
        with self._lock:
            self._engine.set_faults(error_rate, list(errnos), short_rate, delay_rate, delay_ms, seed)

    @property
    def faults_injected(self) -> int:
        """Faults ``inject_faults`` has injected so far (errors, short
        transfers and delays), for tests that check they were exercised."""
        return self._engine.faults_injected

    def close(self) -> None:
        """Stops admission, waits for every operation admitted, runs due
        callbacks, then frees the engine and removes the backing file; raises
        the first error no handle reported. Tensors still offloaded lose their
        data. Thread-safe and idempotent: a call that starts after close()
        began raises ``OffloaderClosedError``; a second close() returns once
        the first has finished. A ``sync_*`` call, ``wait()`` or ``await``
        already waiting gets its result (or, if close() is interrupted before
        the drain ends, ``OffloaderClosedError``), never a hang. When no
        request finishes for 60 s (a hung device, a lost completion), one
        RuntimeWarning says so and the wait goes on; an interrupt stops it,
        and one in the engine's own wait that follows gives the engine up:
        it is kept, with the memory and file of what it had in flight, for
        the life of the process (one more RuntimeWarning), so nothing the
        kernel may still use is freed."""
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
        try:
            with self._lock:
                self._completions.closed = True
                pipelines = list(self._pipelines.values())
                self._pipelines.clear()

                def release(file=self._file):  # once the engine has let go of them
                    if file is not None:
                        file.close()
                    for pipeline in pipelines:
                        pipeline.close()
                try:
                    # Drains the engine (without the GIL). Given up on, it
                    # keeps the operations in flight, the pipelines' buffers
                    # and the file.
                    if self._finalizer.detach() is not None:
                        close_engine(self._engine, self._file, dict(self._completions.pending), pipelines,
                                     then=release)
                    else:  # a forked child's: the engine and file are the parent's
                        release(file=None)
                finally:
                    self._completions.close()
                    self._records.clear()
                    self._progress.stop()
        finally:
            self._progress.join()
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
    def staged_bytes(self) -> int:
        """Bytes written so far through staging blocks: copied out of
        tensors whose memory O_DIRECT could not take as it is (its address
        or length off the file's DIO alignment). A read's pool block and
        memory on the alignment are written without a copy, unless a
        vector call's small tensors side by side share one I/O with staged
        ones: then they are copied into its block too."""
        return self._engine.staged_bytes

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
        if loop.pending or loop.due or self._dead or loop.deferred_error is not None:
            loop.poll()

    def _issue_one(self, kind, t, callback) -> Handle:
        """One tensor: none of the vector calls' batching, and small tensors
        of a page-cache file moved within the call when they can be."""
        self._begin_call(callback)
        with self._lock:
            if self._closing:
                raise self._refusal()
            if self._in_place_bytes:
                move_in_place = self._write_in_place if kind == _WRITE else self._read_in_place
                handle = move_in_place(t, self._records.get(id(t)), None, callback)
                if handle is not None:
                    return handle
            record = self._plan(kind, t)
            handle = Handle(self._completions, 1, callback, self)
            self._start_one(kind, t, record, handle)
            self._resume_progress()
            return handle

    def _issue(self, kind, tensors, callback) -> Handle:
        self._begin_call(callback)
        with self._lock:
            if self._closing:
                raise self._refusal()
            with gc_paused(len(tensors)), storage_swaps(len(tensors)):
                records = [self._plan(kind, t) for t in tensors]
                if len({id(t) for t in tensors}) < len(tensors):
                    raise ValueError("the same tensor appears twice in one call")
                handle = Handle(self._completions, len(tensors), callback, self)
                if kind == _WRITE and len(tensors) > 1:
                    self._reserve_extents(tensors, records)
                self._batch = _core.Requests()
                try:
                    for t, record in zip(tensors, records):
                        if not (self._in_place_bytes and self._moved_now(kind, t, record, handle)):
                            self._start_one(kind, t, record, handle)
                finally:
                    self._flush_batch()
                self._resume_progress()
        if not tensors:
            with self._lock:
                self._completions.finish(handle)
        return handle

    def _moved_now(self, kind, t, record, handle) -> bool:
        """A vector call's in-place move of one of its tensors (validated by
        _plan): True when it was moved in place, counted on ``handle``.
        Reads over _VECTOR_READ_IN_PLACE_BYTES go to pool buffers instead,
        in one batch: memory malloc hands back for them is new (page faults
        in the read), where the pool's is not (BENCHMARKS.md, "The 4 KiB
        pair rate")."""
        if kind == _WRITE:
            move = self._write_in_place
        elif record.layout.nbytes > _VECTOR_READ_IN_PLACE_BYTES:
            return False
        else:
            move = self._read_in_place
        try:
            return move(t, record, handle) is not None
        except Exception as error:  # nothing reached the engine: the call's handle reports it
            if handle._operation_finished(error):
                self._completions.finish(handle)
        return True

    def _start_one(self, kind, t, record, handle) -> None:
        """Starts ``t``'s operation, or queues it behind the one in flight."""
        record = record or self._new_record(t)
        op = _Op(kind, t, record, handle)
        record.on_disk = kind == _WRITE
        if kind == _WRITE and (record.layout is None or not record.layout.matches(t)):
            record.layout = layout_of(t)
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
        if record is not None and record() is not t:
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
        record = _Record(t, self._on_death)
        self._records[record.key] = record
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
        return self._devices.for_tensor(t)

    def _pipeline(self, device):
        """The pipeline that moves ``device``'s tensors, made on first use."""
        pipeline = self._pipelines.get(device)
        if pipeline is None:
            pipeline = self._pipelines[device] = self._new_pipeline(device)
        return pipeline

    def _new_pipeline(self, device):
        from .device_pipeline import DevicePipeline
        return DevicePipeline(DiskPort(self), device, *self._staging)

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
        record.layout = layout_of(t)
        return storage, record.layout

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
        """After each reap (the lock held): forget tensors that died, have
        blocks provisioned for the reads of tensors whose writes freed their
        memory (one request for the lot), and hand the disk the device copies
        that landed meanwhile."""
        while self._dead:
            # In the order they died: a list of tensors dies last one first,
            # and the last one written holds the file's tail, so each extent
            # given back shortens the file instead of joining a free range.
            dead, self._dead = self._dead, []
            for record in dead:
                self._forget(record)
        if self._freed:
            freed, self._freed, counts = self._freed, [], {}
            for record, write, nbytes in freed:
                if record.awaiting_block is write:  # its read has not taken a block yet
                    counts[nbytes] = counts.get(nbytes, 0) + 1
            if counts:
                provision(counts)
        for pipeline in self._pipelines.values():
            pipeline.progress()
        self._resume_progress()

    def _needs_progress(self) -> bool:
        """Whether something in flight would stall until the next reap: chunks
        behind the engine's in-flight window, or a device transfer under way
        (the lock held)."""
        return bool(self._engine.backlog) or any(p.busy() for p in self._pipelines.values())

    def _resume_progress(self) -> None:
        """Has the progress thread move what would stall between calls (the lock held)."""
        if self._needs_progress():
            self._progress.resume()  # it stays parked while a thread waits

    def _forget(self, record) -> None:
        if self._records.get(record.key) is record:  # (not a later tensor's, given the same id)
            del self._records[record.key]
            record.awaiting_block = None  # no read will come
            if record.offset >= 0:
                self._file.release(record.offset, record.capacity)


def _needs_progress(owner):
    """The Offloader's answer, or None once it is gone."""
    offloader = owner()
    return None if offloader is None else offloader._needs_progress()


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
