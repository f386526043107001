"""Activation offloading: tensors autograd saves for backward go to an
Offloader during forward and come back, read ahead, during backward.

Built on ``torch.autograd.graph.saved_tensors_hooks``. What each saved tensor
becomes:

- At least ``min_bytes``, not a parameter: copied at pack time into memory
  the library owns (for CPU tensors a recycled, page-aligned pool buffer,
  written to disk in place; for device tensors a clone on the device, copied
  out through the Offloader's staging), then written asynchronously. The
  copy is the snapshot: backward sees the value the tensor had when it was
  saved, even if it is changed in place afterwards. The same tensor saved by
  several ops (same object, same version) is written once.
- Smaller tensors, parameters and views of parameters: kept as they are,
  and checked at unpack the way autograd would (changed in place since it
  was saved: RuntimeError).

Memory: at most ``prefetch + 1`` writes are in flight during forward (a pack
waits for the oldest beyond that), and at most ``prefetch`` reads are ahead of
backward, so the copies the library holds stay within about
``prefetch + 2`` saved tensors. After backward (or once autograd frees the
graph) nothing of the step stays in the Offloader: its file space is reused.

Errors: a write that fails raises its OSError (errno, shape) in forward, at
the latest when the ``with`` block ends; a read that fails raises in
backward, and a backward retried on the same graph (``retain_graph=True``)
reads again what failed. The Offloader stays usable for the next step
either way.
Double backward works (``create_graph=True``, or ``retain_graph=True`` and a
second backward): a saved tensor read back stays resident until autograd
frees it.
"""
import collections
import weakref

import torch

from .._tensors import TensorLayout, _is_dense, attach_buffer
from .._pool import buffer_pool


class _Saved:
    """A saved tensor that went to the Offloader: its private copy ("stash")
    and the step it belongs to. Autograd holds it until the graph is freed."""

    __slots__ = ("step", "index", "stash", "write", "read", "__weakref__")

    def __init__(self, step, index, stash, write):
        self.step, self.index, self.stash, self.write, self.read = step, index, stash, write, None


class _Kept:
    """A saved tensor kept in memory, with the version it was saved at."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        self.tensor, self.version = tensor, tensor._version


class _Step:
    """One forward pass's saved tensors, in pack order, and the read-ahead
    cursor of its backward."""

    def __init__(self, offloader, min_bytes, prefetch):
        self.off, self.min_bytes, self.prefetch = offloader, min_bytes, prefetch
        self.order = []                      # weakrefs to _Saved, in pack order
        self.writing = collections.deque()   # _Saved with a write in flight, oldest first
        self.seen = {}                       # id(tensor) -> (weakref(tensor), version, _Saved)
        self.ahead = None                    # next pack index to read ahead (going down)
        self.reads_ahead = 0                 # reads issued for tensors not yet unpacked
        self.written_bytes = self.kept_bytes = 0

    # ------------------------------------------------------------ forward
    def pack(self, t):
        if t.nbytes < self.min_bytes or _is_parameter(t) or not self._movable(t):
            self.kept_bytes += t.nbytes
            return _Kept(t)
        entry = self.seen.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version and entry[2].stash is not None:
            return entry[2]  # saved by another op already, unchanged since
        stash = self._snapshot(t)
        saved = _Saved(self, len(self.order), stash, None)
        self._make_room()
        saved.write = self.off.async_write(stash)
        self.written_bytes += stash.nbytes
        self.writing.append(saved)
        self.order.append(weakref.ref(saved))
        self.seen[id(t)] = (weakref.ref(t), t._version, saved)
        return saved

    def _movable(self, t) -> bool:
        if self.off.backend == "pinned":  # page-locked CPU memory: device tensors only
            return t.is_cuda or self.off.device is not None
        return t.is_cpu or t.is_cuda

    def _snapshot(self, t):
        """A copy of ``t`` that only the library holds, laid out like ``t``
        where ``t`` is dense (so backward's kernels see the same strides)."""
        source = t.detach()
        if t.is_cuda or self.off.device is not None:
            return source.clone(memory_format=torch.preserve_format)
        layout = TensorLayout(source if _is_dense(source) else torch.empty(t.shape, dtype=t.dtype, device="meta"))
        stash = torch.empty(0, dtype=t.dtype)
        attach_buffer(stash, buffer_pool().acquire(max(layout.nbytes, 1)), layout)
        stash.copy_(source)
        return stash

    def _make_room(self) -> None:
        """Keeps at most prefetch + 1 writes in flight; raises a failed one."""
        while self.writing and (self.writing[0].write.done() or len(self.writing) > self.prefetch):
            self._finish_write(self.writing.popleft())

    def _finish_write(self, saved) -> None:
        try:
            saved.write.wait()
        except OSError as error:
            saved.stash = None  # the copy has its bytes back: nothing to read; forget it
            raise error

    def end_forward(self) -> None:
        """Waits for the writes still in flight; raises the first failure."""
        first = None
        while self.writing:
            try:
                self._finish_write(self.writing.popleft())
            except OSError as error:
                first = first or error
        self.seen.clear()
        if first is not None:
            raise first

    # ----------------------------------------------------------- backward
    def unpack(self, saved):
        stash = saved.stash
        if stash is None:
            raise RuntimeError("this saved tensor's write failed in forward; run the forward pass again")
        if saved.read is None:
            saved.read = self.off.async_read(stash)  # not read ahead: issue it now
        elif saved.read is not True:
            self.reads_ahead -= 1
        self._read_ahead(saved.index)
        if saved.read is not True:
            handle, saved.read = saved.read, True
            try:
                handle.wait()
            except OSError:
                saved.read = None  # the file still holds it: a retry reads again
                self._abandon_reads_ahead()
                raise
        return stash

    def _abandon_reads_ahead(self) -> None:
        """Backward failed: the reads issued ahead land, and report nothing
        further. Those that failed are forgotten (the file still holds their
        tensors), so a retry (``retain_graph=True``) reads them again; the
        others stay for it."""
        for ref in self.order:
            saved = ref()
            if saved is not None and saved.read not in (None, True):
                try:
                    saved.read.wait()
                except OSError:
                    saved.read = None
                    self.reads_ahead -= 1

    def _read_ahead(self, index) -> None:
        if self.ahead is None or self.ahead >= index:
            self.ahead = index - 1
        while self.reads_ahead < self.prefetch and self.ahead >= 0:
            saved = self.order[self.ahead]()
            self.ahead -= 1
            if saved is not None and saved.read is None and saved.stash is not None:
                saved.read = self.off.async_read(saved.stash)
                self.reads_ahead += 1


def _is_parameter(t) -> bool:
    """Parameters (and views of them) are not activations: never copied."""
    base = t if t._base is None else t._base
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _unpack_kept(kept):
    if kept.tensor._version != kept.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: a {kept.tensor.dtype} tensor of shape {tuple(kept.tensor.shape)} is at version "
            f"{kept.tensor._version}; it was saved at version {kept.version} (kept in memory by "
            "offload_activations: it is below min_bytes, or a parameter)")
    return kept.tensor


class offload_activations:  # noqa: N801 (a context manager, named like torch's)
    """``with offload_activations(off):`` runs forward with its saved tensors
    going to ``off`` (``Offloader(dir)``: CPU and CUDA tensors to disk;
    ``Offloader(None)``: CUDA tensors to page-locked CPU memory), and the
    backward that follows reads them back ahead of use.

    Parameters
    ----------
    offloader : Offloader
    min_bytes : int
        Saved tensors smaller than this stay in memory.
    prefetch : int
        Saved tensors read ahead of backward (and writes in flight beyond one).

    Each ``with`` block is one step: its saved tensors are read ahead in
    reverse order of saving during the backward that uses them. Blocks may
    nest inside one another only if they belong to different steps. After
    the block, ``written_bytes`` and ``kept_bytes`` say how much of what
    autograd saved went to the Offloader and how much stayed in memory.
    """

    def __init__(self, offloader, min_bytes: int = 1 << 20, prefetch: int = 2):
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        self.offloader, self.min_bytes, self.prefetch = offloader, min_bytes, prefetch
        self._hooks = self._step = None
        self.written_bytes = self.kept_bytes = 0

    def __enter__(self):
        step = self._step = _Step(self.offloader, self.min_bytes, self.prefetch)

        def unpack(packed):
            return _unpack_kept(packed) if type(packed) is _Kept else packed.step.unpack(packed)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(step.pack, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._hooks.__exit__(exc_type, exc, tb)
        step, self._step, self._hooks = self._step, None, None
        self.written_bytes, self.kept_bytes = step.written_bytes, step.kept_bytes
        try:
            step.end_forward()
        except OSError:
            if exc_type is None:
                raise
            # else: the exception already propagating is the one to see
        return False
