"""Gives written tensors' memory back off the caller's path.

A write from a tensor's own memory frees that memory when it completes.
For a large tensor the free is not cheap: torch's allocator unmaps it, and
the kernel drops its pages one by one (64 MiB took 4.4 ms on the
development VM). Done inline, it held back the callbacks of the tensors it
completed with, and ``synchronize()``: the disk's last completions came
two tensors at a time, and their frees were the last ~9 ms of a 1 GiB
write (BENCHMARKS.md, "Freeing written tensors").

``release(storage)`` hands such a storage to a helper thread instead. The
thread gives its pages back to the kernel (``MADV_DONTNEED``, without the
GIL), then frees the storage, which leaves nothing to unmap but the empty
range. The storage is referenced until then, so its address is never
reused while its pages are given back.

Guarantees:

- Only storages of ``MIN_BYTES`` or more that no tensor references (one
  that does is freed inline, as before), never pinned memory
  (whose pages a device may hold), and in memory torch's CPU allocator
  handed out: the caller promises the last.
- At most ``MAX_PENDING`` bytes wait for the thread at once; beyond that,
  and after a fork or at exit, a storage is freed inline, as without it.
- The memory is given back within the time the thread needs (a few
  milliseconds a tensor), and then the caller's ``then()`` runs there (the
  Offloader asks for the block the tensor's read will want, unless that
  read took one already: on a VM that hands freed memory to its host, the
  memory just freed is the likeliest to be still backed).
  ``wait_released()`` returns once everything handed over so far is done.
  Neither ``synchronize()`` nor a callback waits for it.
"""
import atexit
import collections
import os
import threading

import torch

from . import _core, _signals
from ._tensors import unshared

_signals.bookkeeping_module(__file__)

# glibc serves allocations above 32 MiB (its largest mmap threshold) from
# mappings of their own, which a free unmaps: what costs the time. Smaller
# ones mostly come from its heap, where a free is cheap and giving pages
# back would make the next allocation fault them in again.
MIN_BYTES = (32 << 20) + 1
# Memory handed over and not yet given back, at most: one burst of the
# engine's window (128 MiB in flight) completes at once, twice over.
MAX_PENDING = 256 << 20


def _pinned(storage) -> bool:
    """``storage.is_pinned()``, asked only once a runtime that pins host
    memory is up in this process (asking would start CUDA otherwise, and no
    memory can be pinned before it is)."""
    for name in ("cuda", "xpu"):
        is_initialized = getattr(getattr(torch, name, None), "is_initialized", None)
        if is_initialized is not None and is_initialized():
            return storage.is_pinned()
    return False


class _Releaser:
    def __init__(self):
        self._queue = collections.deque()  # (storage, then), in completion order
        self._pending = 0                  # their bytes
        self._busy = False
        self._stopping = False
        self._ready = threading.Condition()
        self.in_hand = threading.Lock()    # held while a storage is given back and freed
        self._thread = None
        self.released = 0                  # bytes given back on the thread

    def release(self, storage, then) -> bool:
        nbytes = storage.nbytes()
        if nbytes >= MIN_BYTES and unshared(storage) and not _pinned(storage):
            with self._ready:
                if not self._stopping and self._pending + nbytes <= MAX_PENDING:
                    self._queue.append((storage, then))
                    self._pending += nbytes
                    if self._thread is None:
                        self._thread = threading.Thread(target=self._run, daemon=True, name="offload-release")
                        self._thread.start()
                    else:
                        self._ready.notify_all()
                    return True
        storage.resize_(0)
        return False

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
            # Taken off the queue only with in_hand held: a fork waits for it,
            # so no storage is ever left in this thread's hands in a child.
            with self.in_hand:
                with self._ready:
                    if not self._queue:
                        continue
                    storage, then = self._queue.popleft()
                    self._busy = True
                nbytes = storage.nbytes()
                try:
                    self.released += max(_core.discard_pages(storage.data_ptr(), nbytes), 0)
                except OSError:
                    pass  # locked memory, say: the free below unmaps it as ever
                storage.resize_(0)
                del storage
            try:
                if then is not None:
                    then()
            finally:
                with self._ready:
                    self._pending -= nbytes
                    self._busy = False
                    self._ready.notify_all()

    def wait(self) -> None:
        with self._ready:
            self._ready.wait_for(lambda: not self._queue and not self._busy)

    def stop(self) -> None:
        """Frees what is left on the calling thread (at exit: their ``then``
        is not called), and stops the thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
            self._ready.wait_for(lambda: not self._busy)
            left, self._queue = list(self._queue), collections.deque()
            self._pending = 0
        for storage, _ in left:
            storage.resize_(0)


_releaser = _Releaser()


def release(storage, then=None) -> bool:
    """Frees ``storage`` (a written tensor's, referenced by the caller alone;
    see the module's guarantees): when large, on the helper thread, which
    then calls ``then()`` (returns True); otherwise now (returns False, and
    ``then`` is not called)."""
    return _releaser.release(storage, then)


def wait_released() -> None:
    """Returns once every storage handed to ``release`` so far is freed."""
    _releaser.wait()


def released_bytes() -> int:
    """Bytes the helper thread gave back to the kernel so far."""
    return _releaser.released


def _hold_for_fork() -> None:
    _releaser.in_hand.acquire()


def _after_fork_in_parent() -> None:
    _releaser.in_hand.release()


def _start_over_in_child() -> None:
    # The thread is the parent's, and its lock may have been taken there
    # mid-move. Whatever waited for it is the child's copy: dropping the old
    # releaser frees those storages here, as any other memory of the child.
    global _releaser
    _releaser = _Releaser()


atexit.register(lambda: _releaser.stop())
os.register_at_fork(before=_hold_for_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_start_over_in_child)
