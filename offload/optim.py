"""Optimizer state on an Offloader between steps, streamed through ``step()``.

    opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), Offloader("/nvme/opt"))

ZeRO-Infinity's pipelined optimizer swapper and ColossalAI's NVMeOptimizer
are the references; what this one adds is exactness (the wrapped optimizer's
own kernels run, so results are bit-identical) and atomic steps.
"""
import errno as errno_names
import os
import time

import torch

from ._tensors import TensorLayout, attach_buffer
from .offloader import buffer_pool

__all__ = ["OffloadedOptimizer", "StepStats", "offloaded"]


class StepStats:
    """What the last ``step()`` did. ``io_wait_seconds`` is the time it sat
    waiting for reads or writes (I/O not hidden behind the updates);
    ``peak_state_bytes`` the most optimizer-state bytes it held in memory at
    once (buffers of reads issued, states being updated, writes in flight)."""

    __slots__ = ("parameters", "seconds", "io_wait_seconds", "state_bytes_read",
                 "state_bytes_written", "peak_state_bytes")

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, 0)

    def __repr__(self):
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"StepStats({fields})"


class OffloadedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that between steps its per-parameter state
    (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``...) lives on
    ``offloader``, not in memory. Scalar (0-dim) state such as Adam's step
    count stays in memory.

    ``step()`` runs the wrapped optimizer one parameter at a time: while
    parameter i is updated, the state of parameters i+1..i+``prefetch`` is
    being read and the new state of i-1 is being written, so at most about
    ``prefetch`` + 2 parameters' state is in memory. It returns once every
    new state is in the store.

    Guarantees:

    - Bit-identical results: the wrapped optimizer's own code updates each
      parameter (``foreach`` and ``fused`` kernels work element by element,
      so running them per parameter changes no bit).
    - ``atomic=True`` (the default): if any I/O fails, ``step()`` raises an
      OSError naming the parameter (``errno`` set), and every parameter and
      state is exactly as before the step. The price: a copy of each
      parameter's old value, kept in memory up to ``backup_bytes`` per step
      (default 256 MiB) and written to the store beyond that (read back only
      on failure), and new state goes to fresh file space while the old stays
      until the step commits. With ``atomic=False`` a failure leaves the
      step partly applied (and says so).
    - ``param_groups``, ``state``, ``zero_grad``, ``add_param_group``, LR
      schedulers and step hooks behave as on the wrapped optimizer;
      ``state_dict()`` returns in-memory copies (the store is untouched) and
      ``load_state_dict()`` writes the loaded state to the store.

    ``names``: ``model.named_parameters()`` or a {parameter: name} mapping,
    for error messages. ``stats`` describes the last step (``StepStats``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, offloader, prefetch: int = 2, *,
                 names=None, atomic: bool = True, backup_bytes: int = 256 << 20):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OffloadedOptimizer):
            raise TypeError("OffloadedOptimizer wraps a torch.optim.Optimizer (not another OffloadedOptimizer)")
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.offloader = offloader
        self.prefetch = prefetch
        self.atomic = atomic
        self.backup_bytes = backup_bytes
        self.stats = StepStats()
        self._share()
        self._offloaded = {}   # parameter -> {state key: the tensor object on the offloader}
        self._names = {}
        if names is not None:
            pairs = names.items() if isinstance(names, dict) else names
            for first, second in pairs:
                name, param = (first, second) if isinstance(first, str) else (second, first)
                self._names[param] = name
        self._offload_resident_state()  # state the wrapped optimizer had already

    # ----------------------------------------------------------- optimizer API
    def add_param_group(self, param_group) -> None:
        if "optimizer" not in self.__dict__:
            super().add_param_group(param_group)  # Optimizer.__init__ re-adding the wrapped groups
            return
        self.optimizer.add_param_group(param_group)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        _Step(self, work).run()
        return loss

    def state_dict(self):
        """The wrapped optimizer's state_dict, with offloaded state read back
        into fresh in-memory tensors (the store keeps its copy)."""
        packed = self.optimizer.state_dict()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                stored = self._stored_tensors(p)
                if stored and index in packed["state"]:
                    self.offloader.sync_readv(list(stored.values()))
                    entry = dict(packed["state"][index])
                    for key, t in stored.items():
                        entry[key] = t.clone()
                        self.offloader.discard(t)
                    packed["state"][index] = entry
                index += 1
        return packed

    def load_state_dict(self, state_dict) -> None:
        """Loads through the wrapped optimizer, then writes the state to the
        store. Tensors of ``state_dict`` are never released or changed."""
        given = {id(v) for entry in state_dict.get("state", {}).values()
                 for v in entry.values() if isinstance(v, torch.Tensor)}
        self.optimizer.load_state_dict(state_dict)
        self._share()
        self._offloaded = {}  # the old tensors die with their file space
        for state in self.state.values():
            for key, value in state.items():
                if _offloadable(value) and id(value) in given:
                    state[key] = value.clone()
        self._offload_resident_state()

    def __repr__(self):
        return f"OffloadedOptimizer({self.optimizer!r}, prefetch={self.prefetch}, atomic={self.atomic})"

    # --------------------------------------------------------------- internals
    def _share(self) -> None:
        """One set of groups and state: the wrapped optimizer's."""
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def _stored_tensors(self, p) -> dict:
        """The state tensors of ``p`` that are on the offloader now."""
        stored = self._offloaded.get(p)
        if not stored:
            return {}
        state = self.state.get(p, {})
        return {key: t for key, t in stored.items() if state.get(key) is t}

    def _offload_resident_state(self) -> None:
        tensors = []
        for p, state in self.state.items():
            kept = {key: v for key, v in state.items() if _offloadable(v)}
            stored = self._stored_tensors(p)
            fresh = {key: v for key, v in kept.items() if stored.get(key) is not v}
            if fresh:
                self._offloaded[p] = {**stored, **fresh}
                tensors += fresh.values()
        if tensors:
            self.offloader.sync_writev(tensors)

    def _name(self, p) -> str:
        name = self._names.get(p)
        if name is not None:
            return name
        for g, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def _update(self, group, p) -> None:
        """Runs the wrapped optimizer's step on ``p`` alone."""
        inner = self.optimizer
        groups, params = inner.param_groups, group["params"]
        inner.param_groups, group["params"] = [group], [p]
        try:
            inner.step()
        finally:
            inner.param_groups, group["params"] = groups, params


class _Work:
    """One parameter's part of a step."""

    __slots__ = ("group", "param", "old", "read", "read_bytes", "updated", "new", "write", "backup",
                 "backup_write")

    def __init__(self, group, param):
        self.group, self.param = group, param
        self.old = None          # the state dict before the step (offloaded tensors, copies of scalars)
        self.read = None         # handle of the read of the old state, None when nothing to read
        self.read_bytes = 0
        self.updated = False
        self.new = {}            # state tensors written by this step
        self.write = None
        self.backup = None       # a copy of the parameter before its update, on the offloader
        self.backup_write = None


class _Step:
    """The pipeline of one step(), with its rollback."""

    def __init__(self, owner: OffloadedOptimizer, work):
        self.owner = owner
        self.off = owner.offloader
        self.work = [_Work(group, p) for group, p in work]
        self.stats = owner.stats = StepStats()
        self.stats.parameters = len(self.work)
        self.resident = 0
        self.backup_budget = owner.backup_bytes  # pre-step copies kept in memory, in bytes
        self.unrestored = []  # (work, error) of parameters a rollback could not restore

    def run(self) -> None:
        started = time.perf_counter()
        work, ahead = self.work, self.owner.prefetch
        try:
            for j in range(min(ahead, len(work))):
                self._start_read(work[j])
            for i, w in enumerate(work):
                if i >= 2:
                    self._wait(work[i - 2], "write", "writing the optimizer state of")
                if i + ahead < len(work):
                    self._start_read(work[i + ahead])
                if w.read is None:
                    self._start_read(w)
                self._wait(w, "read", "reading the optimizer state of")
                self._apply(w)
            for w in work:
                self._wait(w, "backup_write", "saving the pre-step value of")
                self._wait(w, "write", "writing the optimizer state of")
        except _IOFailure as failure:
            self._roll_back()
            raise self._error(failure) from failure.error
        except BaseException:  # the update itself raised (or an interrupt): undo, then let it through
            self._roll_back()
            raise
        self._commit()
        self.stats.seconds = time.perf_counter() - started

    # -------------------------------------------------------------- stages
    def _start_read(self, w) -> None:
        owner, p = self.owner, w.param
        stored = owner._stored_tensors(p)
        state = owner.state.get(p, {})
        w.old = {key: (v.clone() if isinstance(v, torch.Tensor) and key not in stored else v)
                 for key, v in state.items()}
        if stored:
            w.read_bytes = sum(_nbytes(t) for t in stored.values())
            self._hold(w.read_bytes)
            w.read = self.off.async_readv(list(stored.values()))
        else:
            w.read = _DONE

    def _apply(self, w) -> None:
        owner, p = self.owner, w.param
        if owner.atomic:
            nbytes = _nbytes(p)
            if nbytes <= self.backup_budget:
                self.backup_budget -= nbytes
                w.backup = _copy_of(p)  # a recycled pool buffer: no page faults step after step
            else:
                w.backup = _copy_of(p)
                w.backup_write = self.off.async_write(w.backup)
        state = owner.state[p]
        stored = owner._stored_tensors(p)
        if owner.atomic:  # the old state stays in the file until the step commits
            for key, old in stored.items():
                state[key] = _take_memory(old)
                self.off.discard(old)
        w.updated = True
        owner._update(w.group, p)
        w.new = {key: v for key, v in owner.state[p].items() if _offloadable(v)}
        written = sum(_nbytes(t) for t in w.new.values())
        self._hold(written - w.read_bytes)  # state created by this update
        self.stats.state_bytes_read += w.read_bytes
        self.stats.state_bytes_written += written
        w.write = self.off.async_writev(list(w.new.values()), callback=lambda: self._hold(-written))

    def _wait(self, w, attribute, what) -> None:
        handle = getattr(w, attribute)
        if handle is None or handle is _DONE:
            return
        if not handle.done():
            started = time.perf_counter()
            try:
                handle.wait()
            except OSError as error:
                raise _IOFailure(w, what, error) from error
            finally:
                self.stats.io_wait_seconds += time.perf_counter() - started
        elif handle.exception() is not None:
            raise _IOFailure(w, what, handle.exception())

    def _hold(self, nbytes) -> None:
        self.resident += nbytes
        self.stats.peak_state_bytes = max(self.stats.peak_state_bytes, self.resident)

    # ------------------------------------------------------ commit, rollback
    def _commit(self) -> None:
        owner = self.owner
        for w in self.work:
            if w.updated:
                owner._offloaded[w.param] = w.new
            w.old = w.backup = None  # old state tensors die here: their file space is freed

    def _roll_back(self) -> None:
        """Puts every parameter and state back as before the step (atomic),
        after everything in flight has landed."""
        owner, off = self.owner, self.off
        for w in self.work:
            for handle in (w.read, w.backup_write, w.write):
                if handle is not None and handle is not _DONE:
                    try:
                        handle.wait()
                    except OSError:
                        pass
        if not owner.atomic:
            return
        for w in self.work:
            if w.read is None:
                continue
            offloaded = owner._offloaded.get(w.param, {})
            for key, t in (w.old or {}).items():
                if offloaded.get(key) is t and t.untyped_storage().nbytes() > 0:
                    off.discard(t)  # read (prefetched or in use), not written: back to the store
            if w.updated:
                try:
                    if w.backup_write is not None:
                        off.sync_read(w.backup)
                    w.param.copy_(w.backup)
                except OSError as error:
                    self.unrestored.append((w, error))
                if w.old:
                    owner.state[w.param] = w.old
                else:
                    owner.state.pop(w.param, None)

    def _error(self, failure) -> OSError:
        owner = self.owner
        if not owner.atomic:
            consequence = ("the step is partly applied (atomic=False): parameters updated before "
                           "the failure keep their new values")
        elif self.unrestored:
            w, error = self.unrestored[0]
            consequence = (f"and restoring {owner._name(w.param)} failed too ({error}): that "
                           "parameter keeps its post-step value")
        else:
            consequence = "the step was rolled back: parameters and optimizer state are as before it"
        code = failure.error.errno or errno_names.EIO
        return OSError(code, f"{failure.what} {owner._name(failure.work.param)} failed "
                             f"({os.strerror(code)}); {consequence}")


class _IOFailure(Exception):
    def __init__(self, work, what, error):
        super().__init__(what)
        self.work, self.what, self.error = work, what, error


class _Done:
    """Stands for the read of a parameter whose state was all in memory."""

    def done(self) -> bool:
        return True

    def exception(self):
        return None


_DONE = _Done()


def _offloadable(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _take_memory(t) -> torch.Tensor:
    """A new tensor object holding ``t``'s data (t is then discarded, so the
    store keeps the old bytes under the old object). On the CPU the memory
    itself moves; a device tensor is copied, since discarding frees it."""
    if not t.is_cpu:
        return t.clone()
    moved = torch.empty(0, dtype=t.dtype)
    return moved.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _copy_of(p) -> torch.Tensor:
    """A copy of a parameter's data to back it up. On the CPU it goes into a
    pooled, aligned buffer, which the Offloader writes in place (one copy)."""
    if not p.is_cpu:
        return p.detach().clone()
    if not p.is_contiguous():
        return p.detach().clone()
    layout = TensorLayout(p.detach())
    copy = torch.empty(0, dtype=p.dtype)
    attach_buffer(copy, buffer_pool().acquire(layout.nbytes), layout)  # rounded to whole pages
    copy.copy_(p.detach())
    return copy


def offloaded(optimizer_class, offloader, prefetch: int = 2, *, atomic: bool = True):
    """A constructor ``(params, **defaults) -> OffloadedOptimizer`` wrapping
    ``optimizer_class``, for code that builds the optimizer itself, such as
    ``ZeroRedundancyOptimizer(params, optimizer_class=offloaded(torch.optim.AdamW,
    lambda: Offloader(f"/nvme/rank{rank}")), lr=1e-3)``. ``offloader`` is an
    Offloader or a function returning one (called once per optimizer)."""
    def construct(params, **defaults):
        store = offloader if hasattr(offloader, "async_readv") else offloader()
        return OffloadedOptimizer(optimizer_class(params, **defaults), store, prefetch, atomic=atomic)
    construct.__name__ = f"offloaded_{getattr(optimizer_class, '__name__', 'optimizer')}"
    return construct
