"""What the Offloader does to a tensor's storage, and what it accepts."""
import contextlib
import threading

import torch

from . import _core, _signals

_signals.bookkeeping_module(__file__)

try:
    _storage_use_count = torch._C._storage_Use_Count
except AttributeError:  # private API; without it aliases are not detected
    _storage_use_count = None


class TensorLayout:
    """What must survive an offload: dtype, shape, strides and byte count."""

    __slots__ = ("dtype", "shape", "stride", "nbytes")

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self.shape = tuple(t.shape)  # a plain tuple of ints, which the cyclic GC stops tracking
        self.stride = t.stride()
        self.nbytes = t.nbytes

    def matches(self, t: torch.Tensor) -> bool:
        return t.dtype is self.dtype and t.shape == self.shape and t.stride() == self.stride

    def describe(self) -> str:
        return f"{self.dtype} tensor of shape {self.shape}"


_LAYOUTS_KEPT = 4096
_layouts = {}  # (dtype, shape, strides) -> TensorLayout


def layout_of(t: torch.Tensor) -> TensorLayout:
    """``TensorLayout(t)``, shared by every tensor of the same dtype, shape
    and strides (a layout is never changed once made): the records of many
    tensors of one shape hold one layout, not one each for the cyclic GC
    to track, and their first writes make none. At most _LAYOUTS_KEPT are
    kept here; the table starts over once it has that many (the layouts in
    use stay with their records)."""
    key = (t.dtype, t.shape, t.stride())
    layout = _layouts.get(key)
    if layout is None:
        if len(_layouts) >= _LAYOUTS_KEPT:
            _layouts.clear()
        layout = _layouts[key] = TensorLayout(t)
    return layout


def check_tensor(t) -> None:
    """Raises TypeError/ValueError for what the Offloader cannot move."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise ValueError(f"only dense (strided) tensors can be offloaded, got layout {t.layout}")
    if t.is_quantized:
        raise ValueError(f"quantized tensors ({t.dtype}) cannot be offloaded: their scale and zero point live "
                         "outside their memory. Offload t.int_repr() and the quantizer's parameters.")
    if t.is_nested:
        raise ValueError("nested tensors cannot be offloaded: offload their components (t.unbind())")
    if overrides_dispatch(t):
        raise ValueError(
            f"cannot offload a {type(t).__name__}: a tensor subclass that overrides __torch_dispatch__ "
            "(FakeTensor, DTensor, functional and wrapper tensors) has no memory of its own to move. "
            "Offload the plain tensor it wraps (a DTensor's to_local()).")


def overrides_dispatch(t: torch.Tensor) -> bool:
    """Whether ``t`` is a subclass that overrides ``__torch_dispatch__``
    (FakeTensor, DTensor, functional and wrapper tensors): its storage is
    not memory of its own. Subclasses that only add Python methods
    (nn.Parameter) inherit torch's."""
    return type(t).__torch_dispatch__ is not _plain_dispatch


def has_no_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has elements but its storage no memory: written to an
    Offloader and not read back (most uses of it raise where ``GUARDS``,
    and crash the process elsewhere)."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


_plain_dispatch = torch.Tensor.__torch_dispatch__

OFFLOADED = ("offload: this tensor is offloaded: its memory was released when it was written to disk, "
             "and it has not been read back. Read it back first (sync_read, async_read, await read); "
             "a model streamed by offload_parameters reads its weights back in its forward")


def _access_guards():
    """torch's private calls that make any access to a storage's data raise
    a RuntimeError with a message, and undo that (CUDA graph trees mark the
    outputs they free with them). Only builds with CUDA have them, both from
    torch 2.12 (the 2.7, 2.10 and 2.11 builds tried have the first alone);
    CPU-only wheels have neither. Checked on a probe: (forbid, allow), or
    (None, None)."""
    forbid = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)
    allow = getattr(torch._C, "_clear_storage_data_ptr_access_error_msg", None)
    if forbid is None or allow is None:
        return None, None
    probe = torch.UntypedStorage(0)
    try:
        forbid(probe._cdata, OFFLOADED)
        try:
            probe.data_ptr()
            return None, None
        except RuntimeError as error:
            if OFFLOADED not in str(error):
                return None, None
        allow(probe._cdata)
        probe.resize_(8)
        if probe.data_ptr() == 0:
            return None, None
    except (TypeError, RuntimeError):
        return None, None
    return forbid, allow


_forbid, _allow = _access_guards()
GUARDS = _forbid is not None
"""Whether this torch turns a use of an offloaded tensor into an error."""


def forbid_access(storage) -> None:
    """Marks ``storage``, emptied by an offload, so that any access to its
    data (a kernel, ``print``, ``data_ptr()``, ``copy.deepcopy``, a resize)
    raises a RuntimeError saying so, where torch can (``GUARDS``); without
    it torch reads address 0 and the process crashes. ``allow_access``
    undoes it; a storage replaced on the tensor needs no undoing."""
    if _forbid is not None:
        _forbid(storage._cdata, OFFLOADED)


def allow_access(storage) -> None:
    """Undoes ``forbid_access`` (and does nothing to a storage without the
    mark), before the storage is given memory again."""
    if _allow is not None:
        _allow(storage._cdata)


def empty_storage(storage) -> None:
    """Frees the memory of an offloaded tensor's ``storage`` in place
    (resized to 0 bytes) and marks it (``forbid_access``)."""
    storage.resize_(0)
    forbid_access(storage)


def refill_storage(storage, nbytes: int) -> None:
    """Gives an emptied ``storage`` ``nbytes`` of new memory (contents
    undefined) and takes its mark away."""
    allow_access(storage)
    storage.resize_(nbytes)


def _is_dense(t: torch.Tensor) -> bool:
    """True when the elements tile a block with no gaps or overlaps, in any
    dimension order (contiguous, transposed, channels-last...)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def check_whole_storage(t: torch.Tensor, storage) -> None:
    """A tensor is written as its raw storage bytes, so it must cover exactly
    its storage (any dense layout: contiguous, transposed, channels-last) and
    be the only tensor using it; anything else could read or release bytes
    outside the view."""
    nbytes, have = t.nbytes, storage.nbytes()
    if have == 0 and nbytes > 0:
        raise ValueError(
            f"this {t.dtype} tensor of shape {tuple(t.shape)} has no data: its memory was released "
            "(it is offloaded, perhaps to another Offloader or one that was closed)")
    if have != nbytes or t.storage_offset() != 0 or not (t.is_contiguous() or _is_dense(t)):
        raise ValueError(
            f"cannot offload a view: this {t.dtype} tensor of shape {tuple(t.shape)} covers "
            f"{nbytes} of its storage's {storage.nbytes()} bytes (offset {t.storage_offset()}, "
            f"strides {t.stride()}). Offload the tensor that owns the storage, or t.clone() "
            "(tensors from offload.load share a buffer with their neighbours in the file: clone them).")
    # Holders of the storage: t, the wrapper passed in, and t's view base if any.
    expected = 3 if t._base is not None else 2
    if _storage_use_count is not None and _storage_use_count(storage._cdata) > expected:
        raise ValueError(
            "cannot offload a tensor whose storage other tensors share (views of it, .data or "
            ".detach() aliases, or the copy autograd keeps of an output it saved for backward, "
            "as relu's or exp's): releasing it would leave them dangling. Drop them first (an "
            "output saved for backward: after the backward; or offload it with "
            "offload.nn.offload_activations), or offload t.clone().")


def still_whole(t: torch.Tensor, storage, layout: "TensorLayout") -> bool:
    """check_whole_storage's answer, cheaply, for a tensor that matches
    ``layout`` (the dense one it had when written): True when it still
    covers its storage from offset 0 and no other tensor shares it."""
    if storage.nbytes() != layout.nbytes or t.storage_offset():
        return False
    return _storage_use_count is None or _storage_use_count(storage._cdata) <= (2 if t._base is None else 3)


def unshared(storage) -> bool:
    """Whether ``storage`` is held by its Python object alone (no tensor,
    such as a view's base, holds it too). False where torch cannot say."""
    return _storage_use_count is not None and _storage_use_count(storage._cdata) == 1


if hasattr(torch.UntypedStorage, "resizable"):
    resizable = torch.UntypedStorage.resizable
    """Whether torch may resize (and so free in place) this storage: it
    allocated the memory, rather than wrapping a buffer, numpy's or a file's."""
else:
    def resizable(storage) -> bool:
        """torch without ``UntypedStorage.resizable()`` (2.2 and older) cannot
        say without resizing, which reallocates. CPU storages are taken as
        not resizable: writes then snapshot the bytes (one more copy) and
        small tensors skip the in-place path, so any memory stays correct.
        Device storages are torch's own allocations, as before."""
        return storage.device.type != "cpu"


def must_be_resizable(storage) -> bool:
    """``resizable(storage)``, asked the hard way where torch has no
    ``resizable()``: a same-size resize, which reallocates and copies (for
    paths that resize the storage anyway, never the disk's hot path)."""
    if hasattr(storage, "resizable") or storage.device.type != "cpu":
        return resizable(storage)
    try:
        storage.resize_(storage.nbytes())
    except RuntimeError:
        return False
    return True


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes. A one-element
    tensor counts as contiguous whatever the strides of its size-1 dims
    (``x[::2]`` of two elements), and ``reshape(-1)`` keeps such a stride,
    which ``view(torch.uint8)`` refuses: any stride reads that one element."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def snapshot_storage(storage, nbytes: int):
    """A copy of the first ``nbytes`` of ``storage`` in memory torch owns."""
    source = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    return source.clone().untyped_storage()


def detach_storage(t: torch.Tensor, layout: TensorLayout) -> None:
    """Points ``t`` at a new, empty storage, keeping dtype, shape and strides,
    marked by ``forbid_access``. Whatever held the old storage (the
    Offloader, during a write) keeps it."""
    fresh = torch.UntypedStorage(layout.nbytes)  # untouched memory: costs no page faults
    attach_storage(t, fresh, layout)
    empty_storage(fresh)


def attach_buffer(t: torch.Tensor, buffer, layout: TensorLayout) -> None:
    """Makes ``buffer`` (an offload._core.Buffer) ``t``'s storage. The buffer
    returns to its pool when the storage is freed."""
    if layout.nbytes == 0:
        storage = torch.UntypedStorage(0)
    else:
        storage = torch.frombuffer(buffer, dtype=torch.uint8, count=layout.nbytes).untyped_storage()
    attach_storage(t, storage, layout)


def attach_storage(t: torch.Tensor, storage, layout: TensorLayout) -> None:
    """Makes ``storage`` t's storage, with the layout t had when written.
    Below autograd: t's version counter does not move (``released`` and
    ``returned`` say what autograd sees) and a leaf keeps its gradient
    accumulator, so a weight used before and after an offload accumulates
    its gradient once, as if it had never left. A view's base that shares
    the storage t leaves (the write paths admit a view covering its storage
    beside its base alone) moves with t, keeping its own layout: left
    behind, it would hold the memory a write frees and never get the bytes
    a read brings back."""
    base, old = t._base, t.untyped_storage()
    follows = base is not None and base.untyped_storage()._cdata == old._cdata
    allow_access(old)  # set_ compares the old storage's data pointer with the new one's
    _set_storage(t, storage, 0, layout.shape, layout.stride)
    if follows:
        _set_storage(base, storage, base.storage_offset(), base.shape, base.stride())


def _set_storage(t: torch.Tensor, storage, offset: int, shape, stride) -> None:
    if _below_autograd is not None:
        if _swaps.batched:  # (storage_swaps: below autograd already)
            t.set_(storage, offset, shape, stride)
            return
        with _below_autograd():
            t.set_(storage, offset, shape, stride)
    elif t.requires_grad:  # autograd refuses set_ on leaves that require grad, unless told
        with torch.no_grad():
            t.set_(storage, offset, shape, stride)
    else:
        t.set_(storage, offset, shape, stride)


class _SwapState(threading.local):
    batched = False  # this thread is inside storage_swaps


_swaps = _SwapState()
_SWAPS_BATCH_FROM = 16  # swaps in one call that enter the mode once


def storage_swaps(count: int):
    """A context for a run of ``count`` storage swaps on this thread
    (attach_storage, detach_storage, attach_buffer: a vector call's
    planning, a reap's completions): below autograd once for the run, where
    there are many. Entering the mode costs about 1 us, as much as a swap
    below it; each swap otherwise enters it for itself. Whatever else runs
    inside is the Offloader's own bookkeeping, none of it recorded by
    autograd either way (version counters are moved by hand: ``released``,
    ``returned``). A do-nothing context for few swaps, or nested in one."""
    if count < _SWAPS_BATCH_FROM or _below_autograd is None or _swaps.batched:
        return contextlib.nullcontext()
    return _batched_swaps()


@contextlib.contextmanager
def _batched_swaps():
    with _below_autograd():
        _swaps.batched = True
        try:
            yield
        finally:
            _swaps.batched = False


def released(t: torch.Tensor):
    """Tells autograd that ``t``'s memory just went: its version counter is
    bumped, so a backward that saved ``t`` raises (autograd's "modified by an
    inplace operation") instead of reading memory that is gone. Returns the
    version ``t`` had, for ``returned``; None, bumping nothing, where no
    backward can have saved ``t`` or what shares its counter: nothing but its
    Python object holds it, it is no view, and torch can count the holders
    of its storage (the write paths refuse a storage other tensors share).
    That is the common case off autograd, and it costs a call where a bump
    and its undoing cost a tenth of a 4 KiB write+read pair. None too where
    ``t`` has no counter (made in inference mode) or torch offers no way to
    bump it."""
    if _bump_versions is None or (_holders is not None and _holders(t) == 1 and t._base is None):
        return None
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: no version counter
        return None
    _bump_versions((t,))
    return version


def returned(t: torch.Tensor, version) -> None:
    """``t`` holds again the bytes it held when ``released`` returned
    ``version``: its version counter goes back to it, so autograd takes a
    saved ``t`` as unchanged, unless something else changed it meanwhile."""
    if version is not None and t._version == version + 1 and _set_versions is not None:
        _set_versions((t,), (version,))


def _version_counter_calls():
    """torch's private calls that bump and set version counters, taking
    sequences (of tensors; of tensors and versions) whichever form this torch
    has (sequences; one tensor in older ones), each checked on a probe, or
    None where it has none that works."""
    bump_any = getattr(torch._C, "_increment_version", None)
    set_any = getattr(getattr(torch._C, "_autograd", None), "_unsafe_set_version_counter", None)
    probe = torch.zeros(1)

    def working(forms, check):
        for form in forms:
            try:
                if check(form):
                    return form
            except (TypeError, RuntimeError):
                pass
        return None

    def bumps(bump):
        before = probe._version
        bump((probe,))
        return probe._version == before + 1

    def sets(set_to):
        set_to((probe,), (41,))
        return probe._version == 41

    # Both normalized to the sequence form (torch's own where it takes one).
    bump = working([bump_any, lambda ts: bump_any(ts[0])], bumps) if bump_any is not None else None
    set_to = working([set_any, lambda ts, vs: set_any(ts[0], vs[0])], sets) if set_any is not None else None
    return bump, set_to


def _below_autograd_guard():
    """A guard under which ``set_`` moves no version counter and creates no
    gradient accumulator: torch's own where it has one, or (torch 2.1) the
    same two dispatch keys excluded by hand, checked on a probe; None where
    neither works."""
    own = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
    if own is not None:
        return own
    try:
        below, exclude = torch._C._AutoDispatchBelowAutograd, torch._C._ExcludeDispatchKeyGuard
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    except AttributeError:
        return None

    @contextlib.contextmanager
    def guard():
        with below(), exclude(keys):
            yield

    probe = torch.zeros(1, requires_grad=True)
    try:
        with guard():
            probe.set_(torch.zeros(1).untyped_storage(), 0, (1,), (1,))
    except RuntimeError:
        return None
    return guard if probe._version == 0 else None


_below_autograd = _below_autograd_guard()
_bump_versions, _set_versions = _version_counter_calls()
# How many hold a tensor: its Python object, and any SavedVariable, gradient
# accumulator or C++ container; None where torch cannot say (or cannot count
# a storage's holders either, which the skip in ``released`` relies on).
_holders = torch.Tensor._use_count if hasattr(torch.Tensor, "_use_count") and _storage_use_count is not None else None


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, on the calling thread alone and without the GIL
    where both are contiguous CPU tensors of one dtype and size (they must
    not overlap). torch spreads a large copy over every core, the one the
    I/O path needs included: on two cores that cost a save a tenth of its
    rate (BENCHMARKS.md, "Checkpoints"). Anything else goes to copy_."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()):
        if dst.numel():
            _core.copy_memory(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
    else:
        dst.copy_(src)


def flat_bytes(t) -> torch.Tensor:
    """A flat uint8 view of ``t``'s bytes in row-major order (a copy if t is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t) if t.numel() else torch.empty(0, dtype=torch.uint8)
