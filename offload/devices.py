"""The device side of GPU offloading, behind one small interface.

The GPU pipeline (``device_pipeline.py``) only ever asks a device to copy
bytes between its memory and a host staging buffer on a dedicated copy stream,
to record, query and wait on events, and to call back once one has happened.
``CudaDevice`` does that with CUDA; ``LateCopyDevice`` does it on the CPU with
copies that run late, on another thread, after random delays, so that
ordering and buffer-reuse bugs in the pipeline corrupt data in tests on
machines without a GPU.
"""
import queue
import random
import threading

import torch

from . import _signals
from ._tensors import TensorLayout, _storage_use_count, attach_storage, detach_storage, empty_storage, refill_storage

_signals.bookkeeping_module(__file__)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``t``'s whole storage (same device, same memory)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class DeviceResolver:
    """Which device backend moves a tensor, for the Offloader and checkpoints
    alike: ``test_device`` (when given) for the tensors it owns, one
    CudaDevice per CUDA device (made on first use, then the same one), None
    for a CPU tensor (plain disk I/O)."""

    def __init__(self, test_device=None):
        self.test_device = test_device
        self._cuda = {}  # CUDA device index -> CudaDevice

    def for_tensor(self, t):
        test = self.test_device
        if test is None:
            if t.is_cpu:
                return None
        elif test.owns(t):
            return test
        if t.is_cuda:
            device = self._cuda.get(t.device.index)
            if device is None:
                device = self._cuda[t.device.index] = CudaDevice(t.device.index)
            return device
        return None

    @staticmethod
    def for_target(device):
        """For a ``device=`` argument naming where new tensors go ('cpu', a
        CUDA device, or a test backend): (the torch.device to allocate them
        on, the backend that fills them or None for the CPU)."""
        if hasattr(device, "copy") and hasattr(device, "owns"):
            return torch.device("cpu"), device  # a test backend: its "device memory" is CPU memory
        try:
            device = torch.device(device)
        except RuntimeError as error:  # a bare index with no accelerator (torch.device(0))
            raise ValueError(f"cannot load to {device!r}: {error}") from None
        if device.type == "cpu":
            return device, None
        if device.type != "cuda":
            raise ValueError(f"cannot load to {device}: use 'cpu' or a CUDA device")
        if not torch.cuda.is_available():
            raise ValueError(f"cannot load to {device}: CUDA is not available to this torch "
                             f"({torch.__version__}); load to 'cpu'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index), CudaDevice(index)


class CudaDevice:
    """CUDA: copies on a dedicated stream per device, ordered after the
    caller's stream with events; staging memory is page-locked with
    cudaHostRegister (not torch's power-of-two pinned allocator)."""

    name = "cuda"

    def __init__(self, index: int):
        self.index = index
        self.device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.device)
        self._watched = None  # (event, wake) pairs for the watcher thread, made on first use

    def owns(self, t) -> bool:
        return t.is_cuda and t.device.index == self.index

    def caller_event(self):
        """An event on the caller's current stream: work queued so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after) -> "torch.cuda.Event":
        """Queues dst.copy_(src) on the copy stream once ``after`` has happened;
        returns an event that is ready when the copy is done."""
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                self.copy_stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps rather than spins
            event.record(self.copy_stream)
        return event

    def notify_when_done(self, event, wake) -> None:
        """Calls ``wake()`` from a watcher thread once ``event`` has happened."""
        if self._watched is None:
            self._watched = queue.SimpleQueue()
            threading.Thread(target=self._watch, args=(self._watched,), name=f"offload-cuda{self.index}-copies",
                             daemon=True).start()
        self._watched.put((event, wake))

    @staticmethod
    def _watch(watched) -> None:
        while True:
            item = watched.get()
            if item is None:
                return
            event, wake = item
            try:
                event.synchronize()  # without the GIL
            except RuntimeError:
                pass  # a CUDA error: the pipeline's own query()/synchronize() raises it to the caller
            wake()

    def close(self) -> None:
        """Stops the watcher thread once it has woken for every event given."""
        if self._watched is not None:
            self._watched.put(None)
            self._watched = None

    def caller_stream(self):
        """The caller's current stream, for ``order_before_caller`` on another thread."""
        return torch.cuda.current_stream(self.device)

    def order_before_caller(self, event, stream=None) -> None:
        """Later work on ``stream`` (default: the current one) runs after ``event``."""
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    def used_by_copy_stream(self, t: torch.Tensor) -> None:
        """Memory allocated on the caller's stream is written by the copy stream."""
        t.record_stream(self.copy_stream)

    def allocate(self, t: torch.Tensor, nbytes: int) -> None:
        """Gives t (whose memory was released) nbytes of device memory, on
        the caller's current stream (the caching allocator's)."""
        refill_storage(t.untyped_storage(), nbytes)

    def release(self, t: torch.Tensor) -> None:
        """Frees t's memory; no copy into or out of it is pending."""
        empty_storage(t.untyped_storage())

    def release_after(self, t: torch.Tensor, event) -> None:
        """Frees t's storage now; the caching allocator hands the memory out
        again only after the copy stream's work queued so far (record_stream)."""
        t.record_stream(self.copy_stream)
        empty_storage(t.untyped_storage())

    @staticmethod
    def pin(address: int, nbytes: int) -> None:
        rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({rc}) for {nbytes} bytes of staging memory")

    @staticmethod
    def unpin(address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


class _LateEvent:
    __slots__ = ("_device", "_sequence", "_done", "_then")

    def __init__(self, device=None, sequence=0, done=False):
        self._device, self._sequence = device, sequence
        self._then = None  # called by the copy thread once the copy has happened
        self._done = threading.Event()
        if done:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.is_set():
            self._device._demand(self._sequence)
            self._done.wait()


def _only_holder(storage) -> bool:
    """True when nothing but this wrapper holds ``storage`` (so it may be reused)."""
    return _storage_use_count is not None and _storage_use_count(storage._cdata) == 1


class LateCopyDevice:
    """A test device: its "device memory" is CPU tensors, and its copy stream is
    a worker thread that runs copies in order, each after a random delay of
    up to ``max_delay`` seconds (exactly ``delay`` when that is given), or,
    with ``lazy=True``, only once some event at or after it is waited on (so a
    copy nobody waits for has deterministically not happened yet). An event
    becomes ready only once its copy has really happened, so a staging buffer
    reused early, a write issued before its copy finished, or a read reported
    done too soon shows up as wrong bytes.

    Its memory is CPU memory, recycled like CUDA's caching allocator's (up to
    ``cache_bytes`` of freed memory kept), so a late copy into memory already
    handed to another tensor corrupts that tensor, as on a GPU.

    ``owns`` claims every CPU tensor given to an Offloader built with it.
    ``skip`` names one ordering step for the pipeline to leave out, to prove
    that the tests catch it: "wait_before_reuse", "wait_before_write",
    "order_before_caller" or "wait_before_release".
    """

    name = "late-copy"

    def __init__(self, seed: int = 0, max_delay: float = 0.002, skip: str = "", lazy: bool = False,
                 cache_bytes: int = 2 << 30, delay=None):
        self._rng = random.Random(seed)
        self.cache_bytes = cache_bytes  # freed "device memory" kept for reuse, at most
        self._cached = {}               # nbytes -> storages
        self._cached_bytes = 0
        self._max_delay = max_delay
        self._delay = delay
        self._lazy = lazy
        self.skip = skip
        self._queue = queue.Queue()
        self._sequence = 0
        self._demanded = 0
        self._demand_cv = threading.Condition()
        self._worker = threading.Thread(target=self._run, name="late-copy-stream", daemon=True)
        self._worker.start()
        self.copies = 0

    def owns(self, t) -> bool:
        return t.device.type == "cpu"

    def caller_event(self):
        return _LateEvent(done=True)  # the CPU "caller stream" has no queued work

    def copy(self, dst, src, after):
        self._sequence += 1
        event = _LateEvent(self, self._sequence)
        delay = self._delay if self._delay is not None else self._rng.uniform(0, self._max_delay)
        self._queue.put((dst, src, after, delay, event))
        return event

    def notify_when_done(self, event, wake) -> None:
        """Calls ``wake()`` (from the copy thread, or here) once ``event`` has happened."""
        event._then = wake
        if event.query():  # the copy thread may have looked for _then before it was set
            wake()

    def close(self) -> None:
        pass

    def caller_stream(self):
        return None  # the CPU

    def order_before_caller(self, event, stream=None) -> None:
        if self.skip != "order_before_caller":
            event.synchronize()  # the caller's "stream" is the CPU: wait for real

    def used_by_copy_stream(self, t) -> None:
        pass

    def allocate(self, t, nbytes: int) -> None:
        """Memory freed earlier is handed out again, as CUDA's caching
        allocator does (glibc would map fresh pages and charge every read
        their first-touch faults, which a GPU never pays)."""
        sized = self._cached.get(nbytes)
        if sized:
            storage = sized.pop()
            self._cached_bytes -= nbytes
        else:
            storage = torch.UntypedStorage(nbytes)
        attach_storage(t, storage, TensorLayout(t))

    def release(self, t) -> None:
        storage = t.untyped_storage()
        detach_storage(t, TensorLayout(t))
        if 0 < storage.nbytes() <= self.cache_bytes - self._cached_bytes and _only_holder(storage):
            self._cached.setdefault(storage.nbytes(), []).append(storage)
            self._cached_bytes += storage.nbytes()

    def release_after(self, t, event) -> None:
        if self.skip != "wait_before_release":
            event.synchronize()  # CPU memory has no stream-ordered allocator: wait
        if event.query():
            self.release(t)
        else:  # the planted bug: the memory goes while a copy out of it is queued
            t.untyped_storage().resize_(0)

    @staticmethod
    def pin(address: int, nbytes: int) -> None:
        pass

    @staticmethod
    def unpin(address: int) -> None:
        pass

    def _demand(self, sequence: int) -> None:
        with self._demand_cv:
            self._demanded = max(self._demanded, sequence)
            self._demand_cv.notify()

    def _run(self):
        import time
        while True:
            dst, src, after, delay, event = self._queue.get()
            if self._lazy:
                with self._demand_cv:
                    self._demand_cv.wait_for(lambda: self._demanded >= event._sequence)
            if after is not None:
                after.synchronize()
            time.sleep(delay)
            if dst.untyped_storage().nbytes() and src.untyped_storage().nbytes():
                dst.copy_(src)  # (memory freed under a queued copy is a bug the tests must see)
            del dst, src  # hold no view of the tensor once its copy is done
            self.copies += 1
            event._done.set()
            then = event._then  # read after set(): notify_when_done() covers the other order
            if then is not None:
                then()
