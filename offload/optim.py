"""Optimizer state on an Offloader between steps, streamed through ``step()``.

    opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), Offloader("/nvme/opt"))

ZeRO-Infinity's pipelined optimizer swapper and ColossalAI's NVMeOptimizer
are the references; what this one adds is exactness (the wrapped optimizer's
own kernels run, so results are bit-identical) and atomic steps.
"""
import errno as errno_names
import inspect
import os
import time

import torch

from ._tensors import TensorLayout, attach_buffer, has_no_data
from ._pool import buffer_pool

__all__ = ["OffloadedOptimizer", "StepStats", "offloaded"]

# Optimizers whose step updates each element from that element's own state
# (and per-parameter scalars) alone, so a chunk of a parameter can be updated
# by itself with the same bits. Exact types: a subclass may change that.
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)
DEFAULT_CHUNK_SIZE = 1 << 22  # elements: 16 MiB per fp32 state tensor
# Chunks start at multiples of this many elements. torch's fused CPU kernels
# run whole vectors of a tensor through SIMD code and its last few elements
# through scalar code, whose float rounding differs: a chunk boundary inside
# a vector would put elements on the other path than in the whole parameter.
CHUNK_ALIGNMENT = 64


def _needs_closure(optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS): one that
    re-evaluates the loss within the step, over all parameters together."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: assume the usual optional closure
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


class StepStats:
    """What the last ``step()`` did. ``io_wait_seconds`` is the time it sat
    waiting for reads or writes (I/O not hidden behind the updates);
    ``peak_state_bytes`` the most optimizer-state bytes it held in memory at
    once (buffers of reads issued, states being updated, writes in flight);
    ``writes_left_in_flight`` the pieces whose writes were still running when
    it returned (``write_behind`` only); ``pieces_read_ahead`` the pieces
    whose reads the step before it had started (``read_ahead`` only)."""

    __slots__ = ("parameters", "seconds", "io_wait_seconds", "state_bytes_read",
                 "state_bytes_written", "peak_state_bytes", "writes_left_in_flight", "pieces_read_ahead")

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

    ``step()`` runs the wrapped optimizer piece by piece (a piece: a chunk of
    a large parameter, or one or more whole parameters; see ``chunk_size``):
    while piece i is updated, the state of the pieces after it is being read
    and the new state of the pieces before it is being written. Pieces are
    weighed by their parameters' bytes, against the largest piece (W): the
    reads run ahead over the next pieces that weigh at most ``prefetch`` x W
    together, and the update of i waits for the oldest writes until the
    pieces since them, i included, weigh at most ``write_depth`` x W. So at
    most (``prefetch`` + ``write_depth``) x the largest piece's state is in
    memory (state in proportion to the parameters' bytes, as that of every
    optimizer that can be chunked); with pieces of one size that is
    ``prefetch`` pieces read ahead and ``write_depth`` - 1 written behind,
    and a run of small parameters does not hold back the reads of the large
    ones after it. It returns once every new state is in the store.
    Deeper reads and writes (``prefetch=8, write_depth=8``) keep the disk
    busier for the price of that memory; with pieces of a few MiB they came
    closer to the disk's rate (BENCHMARKS.md, "Optimizer-state offloading").

    Guarantees:

    - Bit-identical results: the wrapped optimizer's own code updates each
      parameter (``foreach`` and ``fused`` kernels work element by element,
      so running them per parameter changes no bit; chunks start at
      multiples of 64 elements, where a fused kernel's vectors do).
    - ``atomic=True`` (the default): if any I/O fails, ``step()`` raises an
      OSError naming the parameter (``errno`` set), and every parameter and
      state is exactly as before the step. The price: a copy of each
      parameter's old value, kept in memory up to ``backup_bytes`` per step
      (default 256 MiB) and written to the store beyond that (read back only
      on failure), and new state goes to fresh file space while the old stays
      until the step commits. With ``atomic=False`` a failure leaves the
      step partly applied (and says so).
    - ``write_behind=True``: ``step()`` returns once the last update is done,
      and the writes still running then (the last pieces' new state, at most
      ``write_depth`` x W) finish while the next forward and backward pass
      run. The next ``step()`` (or ``synchronize()``) waits for them first.
      A failure among them is not rolled back (the step is over, its
      parameters in use): the next ``step()`` or ``synchronize()`` raises it
      as an OSError naming the parameter (``errno`` set) before changing
      anything, and nothing is lost: the state whose write failed stays in
      memory (``state_dict()`` includes it) and the next ``step()`` writes it
      again. Results are the same bits as without. Writes beyond the
      engine's in-flight window go on at the next call into the Offloader.
    - ``read_ahead=True``: as ``step()`` ends, the reads of the next step's
      first pieces start (those of this step, in its order, within the
      ``prefetch`` x W the step reads ahead), so they run beside the next
      forward and backward pass; between steps their state is in memory,
      within the same bound. A next step that updates other pieces first
      (gradients set to None) returns them to the store unread;
      ``state_dict()`` and ``load_state_dict()`` do too. A read that fails
      fails the step that needs it, rolled back as any other.
    - ``param_groups``, ``state``, ``zero_grad``, ``add_param_group``, LR
      schedulers and step hooks behave as on the wrapped optimizer (hooks
      on this optimizer and on the wrapped one run once per ``step()``; a
      pre-hook's returned arguments are not used);
      ``state_dict()`` returns in-memory copies (the store is untouched) and
      ``load_state_dict()`` writes the loaded state to the store.

    ``chunk_size`` (elements, rounded up to a multiple of 64; DeepSpeed's
    ``sub_group_size``): a parameter larger than this moves and updates in
    chunks of at most ``chunk_size`` elements, so the resident state is
    bounded by (prefetch + write_depth) chunks even for a huge embedding;
    consecutive smaller parameters of a group move together, up to
    ``chunk_size`` elements. Only for optimizers whose update is element by
    element (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam: the
    default there is 2**22); for others it must be None or 0 (whole
    parameters, one at a time). A chunked parameter's ``state`` entries
    between steps are ``meta`` tensors of the full shape (use
    ``state_dict()`` for values).

    ``names``: ``model.named_parameters()`` or a {parameter: name} mapping,
    for error messages. ``stats`` describes the last step (``StepStats``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, offloader, prefetch: int = 2, *,
                 names=None, atomic: bool = True, backup_bytes: int = 256 << 20, chunk_size=None,
                 write_behind: bool = False, read_ahead: bool = False, write_depth: int = 2):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OffloadedOptimizer):
            raise TypeError("OffloadedOptimizer wraps a torch.optim.Optimizer (not another OffloadedOptimizer)")
        if _needs_closure(optimizer):
            raise TypeError(
                f"{type(optimizer).__name__}.step needs a closure: it evaluates the loss several times "
                "within one step over every parameter at once, so it cannot be stepped a parameter at a "
                "time with the rest of its state on disk. Keep its state in memory.")
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        if write_depth < 1:
            raise ValueError("write_depth must be >= 1 (the update of a piece waits for the oldest "
                             "writes until the pieces since them, it included, weigh at most "
                             "write_depth x the largest)")
        elementwise = type(optimizer) in _ELEMENTWISE
        if chunk_size is None:
            chunk_size = DEFAULT_CHUNK_SIZE if elementwise else 0
        elif chunk_size < 0 or (chunk_size and not elementwise):
            raise ValueError(f"chunk_size needs an optimizer that updates element by element "
                             f"({', '.join(c.__name__ for c in _ELEMENTWISE)}), not "
                             f"{type(optimizer).__name__}, and must be > 0 (or 0/None: whole parameters)")
        chunk_size = -(-chunk_size // CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.offloader = offloader
        self.prefetch = prefetch
        self.write_depth = write_depth
        self.atomic = atomic
        self.backup_bytes = backup_bytes
        self.chunk_size = chunk_size
        self.write_behind = write_behind
        self.read_ahead = read_ahead
        self.stats = StepStats()
        self._behind = []            # pieces whose writes were running when the last step() returned
        self._behind_error = None    # the OSError of one that failed, until step() or synchronize() raises it
        self._ahead = {}             # reads the last step started for the next: units' ids -> _ReadAhead
        self._share()
        self._units = {}       # parameter -> its _Units (the whole parameter, or its chunks)
        self._names = {}
        if names is not None:
            pairs = names.items() if isinstance(names, dict) else names
            for first, second in pairs:
                name, param = (first, second) if isinstance(first, str) else (second, first)
                self._names[param] = name
        original = {p: dict(state) for p, state in self.optimizer.state.items()}
        try:
            self._offload_resident_state()  # state the wrapped optimizer had already
        except BaseException:
            # No wrapper comes back: the wrapped optimizer gets its state back
            # whole (what was written is read back; chunked state never left).
            self.offloader.sync_readv([t for state in original.values() for t in state.values()
                                       if isinstance(t, torch.Tensor) and has_no_data(t)])
            for p, state in original.items():
                self.optimizer.state[p] = state
            raise

    # ----------------------------------------------------------- optimizer API
    def add_param_group(self, param_group) -> None:
        if "optimizer" not in self.__dict__:
            super().add_param_group(param_group)  # Optimizer.__init__ re-adding the wrapped groups
            return
        self.optimizer.add_param_group(param_group)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        self._settle()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.optimizer
        for hook in list(getattr(inner, "_optimizer_step_pre_hooks", {}).values()):
            hook(inner, (), {})
        _Step(self, self._work()).run()
        for hook in list(getattr(inner, "_optimizer_step_post_hooks", {}).values()):
            hook(inner, (), {})
        return loss

    def synchronize(self) -> None:
        """Waits for the writes a ``write_behind`` step left running. Raises
        the OSError of one that failed (once: then it is handled, and its state
        is in memory, to be written by the next step)."""
        self._settle()

    def state_dict(self):
        """The wrapped optimizer's state_dict, with offloaded state read back
        into fresh in-memory tensors (the store keeps its copy). Waits for a
        ``write_behind`` step's writes first; a failure among them is left
        for ``step()`` or ``synchronize()`` to raise."""
        self._settle(raise_error=False)
        self._return_reads_ahead()
        packed = self.optimizer.state_dict()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                units = self._units.get(p, ())
                stored = [t for unit in units for t in unit.stored_tensors().values()]
                if stored and index in packed["state"]:
                    self.offloader.sync_readv(stored)
                    entry = dict(packed["state"][index])
                    entry.update(_gathered(p, units))
                    for t in stored:
                        self.offloader.discard(t)
                    packed["state"][index] = entry
                index += 1
        return packed

    def load_state_dict(self, state_dict) -> None:
        """Loads through the wrapped optimizer, then writes the state to the
        store. Tensors of ``state_dict`` are never released or changed."""
        self._settle(raise_error=False)
        self._behind_error = None  # the state it concerned is replaced
        self._return_reads_ahead()
        given = {id(v) for entry in state_dict.get("state", {}).values()
                 for v in entry.values() if isinstance(v, torch.Tensor)}
        self.optimizer.load_state_dict(state_dict)
        self._share()
        self._units = {}  # the old tensors die with their file space
        for state in self.state.values():  # scalars too: a step would count up the caller's
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and id(value) in given:
                    state[key] = value.clone()
        self._offload_resident_state()

    def __getstate__(self):
        """Refused: the state lives in the Offloader, so torch's pickling
        (and ``copy.deepcopy``) would copy empty tensors, or whatever bytes
        their allocation held. ``state_dict()`` reads it back."""
        raise TypeError("an OffloadedOptimizer cannot be pickled or deep-copied: its state lives in the "
                        "Offloader. Save or copy opt.state_dict(), which reads it back, and load it into "
                        "a new OffloadedOptimizer")

    def __repr__(self):
        return (f"OffloadedOptimizer({self.optimizer!r}, prefetch={self.prefetch}, "
                f"write_depth={self.write_depth}, atomic={self.atomic}, "
                f"chunk_size={self.chunk_size}, write_behind={self.write_behind}, read_ahead={self.read_ahead})")

    # --------------------------------------------------------------- internals
    def _settle(self, raise_error: bool = True) -> None:
        """Waits for the writes the last step left running. A piece whose
        write failed has its state back in memory (the Offloader returns a
        failed write's data): it stays there, no longer stored, and the next
        step writes it with the rest."""
        while self._behind:  # an interrupt leaves the rest to the next call
            w = self._behind[0]
            try:
                w.write.wait()
            except OSError as error:
                for unit in w.units:
                    unit.stored = _on_store(unit.stored)
                if self._behind_error is None:
                    code = error.errno or errno_names.EIO
                    self._behind_error = OSError(
                        code, f"writing the optimizer state of {w.describe()} failed ({os.strerror(code)}) "
                              "after step() had returned (write_behind); nothing is lost: that state is "
                              "in memory, and the next step() writes it again")
                    self._behind_error.__cause__ = error
            del self._behind[0]
        if raise_error and self._behind_error is not None:
            error, self._behind_error = self._behind_error, None
            raise error

    def _return_reads_ahead(self, keep=()) -> None:
        """Returns the state read ahead for pieces other than ``keep`` (keys)
        to the store, once their reads have landed (a failed read left it
        there)."""
        for key in [key for key in self._ahead if key not in keep]:
            self._return_read_ahead(self._ahead.pop(key))

    def _return_read_ahead(self, ahead) -> None:
        try:
            ahead.handle.wait()
        except OSError:
            pass
        for t in ahead.tensors:
            if t.untyped_storage().nbytes() > 0:
                self.offloader.discard(t)

    def _start_reads_ahead(self, work) -> None:
        """Starts reading the state of the first pieces of ``work`` that a
        step reads ahead (whose writes have landed), for the next step."""
        for w in work[:_read_first(work, self.prefetch)]:
            if w in self._behind:
                break
            tensors = [t for unit in w.units for t in unit.stored_tensors().values()]
            if tensors:
                self._ahead[_key(w.units)] = _ReadAhead(self.offloader.async_readv(tensors), tensors)

    def _share(self) -> None:
        """One set of groups and state: the wrapped optimizer's."""
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def _units_of(self, p) -> list:
        units = self._units.get(p)
        if units is None:
            n, size = p.numel(), self.chunk_size
            if size and n > size and p.is_contiguous():
                units = [_Unit(self, p, start, min(start + size, n)) for start in range(0, n, size)]
            else:
                units = [_Unit(self, p)]
            self._units[p] = units
        return units

    def _work(self) -> list:
        """(group, units) in update order: each chunk of a large parameter
        alone; consecutive whole parameters of a group together, up to
        chunk_size elements (fewer, larger reads and writes, and one call
        of the wrapped optimizer for them)."""
        work = []
        for group in self.param_groups:
            bundle, size = [], 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                units = self._units_of(p)
                if units[0].chunked and p.grad.is_sparse:
                    raise ValueError(f"{self._name(p)} has a sparse gradient, which cannot be split into "
                                     "chunks: build the OffloadedOptimizer with chunk_size=0")
                for unit in units:
                    n = unit.param.numel() if not unit.chunked else 0
                    if bundle and (unit.chunked or size + n > self.chunk_size):
                        work.append((group, bundle))
                        bundle, size = [], 0
                    if unit.chunked:
                        work.append((group, [unit]))
                    else:
                        bundle.append(unit)
                        size += n
            if bundle:
                work.append((group, bundle))
        return work

    def _offload_resident_state(self) -> None:
        """Writes state held in memory (the wrapped optimizer's, or loaded) to the store."""
        tensors = []
        for p, state in list(self.state.items()):
            units = self._units_of(p)
            if units[0].chunked:
                full = {key: v for key, v in state.items() if _offloadable(v) and v.device.type != "meta"}
                if not full:
                    continue
                for unit in units:
                    unit.state = {key: v.reshape(-1)[unit.start:unit.stop].clone() if key in full else _copied(v)
                                  for key, v in state.items()}
                    unit.stored = {key: unit.state[key] for key in full}
                    tensors += unit.stored.values()
                _mirror(p, units)
            else:
                unit = units[0]
                kept = {key: v for key, v in state.items() if _offloadable(v)}
                stored = unit.stored_tensors()
                fresh = {key: v for key, v in kept.items() if stored.get(key) is not v}
                if fresh:
                    unit.stored = {**stored, **fresh}
                    tensors += fresh.values()
        if tensors:
            try:
                self.offloader.sync_writev(tensors)
            except OSError:
                # Those whose write failed have their data back: they stay in
                # memory, and only those written count as stored.
                for units in self._units.values():
                    for unit in units:
                        if unit.stored:
                            unit.stored = _on_store(unit.stored)
                raise

    def _name(self, p) -> str:
        name = self._names.get(p)
        if name is not None:
            return name
        for g, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def _update(self, group, params) -> None:
        """Runs the wrapped optimizer's step on ``params`` (of ``group``) alone,
        without the hooks and profiler record torch wraps around ``step``:
        those run once per ``step()`` (see there), not once per piece."""
        inner = self.optimizer
        groups, all_params = inner.param_groups, group["params"]
        inner.param_groups, group["params"] = [group], params
        try:
            _unhooked_step(inner)
        finally:
            inner.param_groups, group["params"] = groups, all_params


class _Unit:
    """What moves and updates as one: a whole parameter, whose state is the
    wrapped optimizer's ``state[param]``, or the elements [start, stop) of
    one, with a state of its own (chunk-shaped tensors, its own scalars)."""

    __slots__ = ("owner", "param", "start", "stop", "chunked", "state", "stored")

    def __init__(self, owner, param, start=None, stop=None):
        self.owner, self.param, self.start, self.stop = owner, param, start, stop
        self.chunked = start is not None
        self.state = {}   # a chunk's state (whole parameters use the optimizer's)
        self.stored = {}  # state key -> the tensor object on the offloader

    def get_state(self) -> dict:
        return self.state if self.chunked else self.owner.state.get(self.param, {})

    def set_state(self, state) -> None:
        if self.chunked:
            self.state = state or {}
        elif state:
            self.owner.state[self.param] = state
        else:
            self.owner.state.pop(self.param, None)

    def stored_tensors(self) -> dict:
        """The state tensors of this unit that are on the offloader now."""
        if not self.stored:
            return {}
        state = self.get_state()
        return {key: t for key, t in self.stored.items() if state.get(key) is t}

    def nbytes(self) -> int:
        """The bytes of the parameter's elements this unit updates."""
        count = self.stop - self.start if self.chunked else self.param.numel()
        return count * self.param.element_size()

    def data(self) -> torch.Tensor:
        """The parameter's elements this unit updates (a view of its memory)."""
        p = self.param.detach()
        return p.view(-1)[self.start:self.stop] if self.chunked else p

    def update(self, group) -> None:
        """The wrapped optimizer's step on this unit's elements."""
        owner = self.owner
        if not self.chunked:
            owner._update(group, [self.param])
            return
        view, grad = self.data(), self.param.grad
        view.grad = (grad.view(-1) if grad.is_contiguous() else grad.reshape(-1))[self.start:self.stop]
        inner = owner.optimizer
        inner.state[view] = self.state
        try:
            owner._update(group, [view])
        finally:
            self.state = inner.state.pop(view, self.state)
            view.grad = None

    def describe(self) -> str:
        name = self.owner._name(self.param)
        return f"{name} (elements {self.start}-{self.stop})" if self.chunked else name


def _mirror(p, units) -> None:
    """The wrapped optimizer's state[p] for a chunked parameter: its scalars
    (copies of the first chunk's, all equal) and, for each chunk-wise tensor,
    a ``meta`` tensor of the full shape (the data is in the chunks)."""
    owner = units[0].owner
    mirror = {}
    for key, value in units[0].state.items():
        if _offloadable(value):
            mirror[key] = torch.empty(p.shape, dtype=value.dtype, device="meta")
        else:
            mirror[key] = _copied(value)
    owner.state[p] = mirror


def _gathered(p, units) -> dict:
    """Copies of the unit states of ``p`` (read into memory), as whole tensors."""
    if not units[0].chunked:
        return {key: t.clone() for key, t in units[0].stored_tensors().items()}
    whole = {}
    for key, value in units[0].state.items():
        if _offloadable(value):
            full = torch.empty(p.shape, dtype=value.dtype, device=value.device)
            for unit in units:
                full.view(-1)[unit.start:unit.stop].copy_(unit.state[key])
            whole[key] = full
        else:
            whole[key] = _copied(value)
    return whole


class _Work:
    """One piece of a step: a chunk of a parameter, or whole parameters of one
    group (consecutive small ones go together: one read, one update, one write)."""

    __slots__ = ("group", "units", "weight", "old", "read", "read_bytes", "updated", "new", "write",
                 "backups", "backup_write")

    def __init__(self, group, units):
        self.group, self.units = group, units
        self.weight = sum(unit.nbytes() for unit in units)  # what the read and write windows count
        self.old = None          # per unit: its state before the step (offloaded tensors, copies of scalars)
        self.read = None         # handle of the read of the old state, None when nothing to read
        self.read_bytes = 0
        self.updated = False
        self.new = [{} for _ in units]  # per unit: state tensors written by this step
        self.write = None
        self.backups = []        # per unit: a copy of its elements before the update
        self.backup_write = None

    def describe(self) -> str:
        first = self.units[0].describe()
        return first if len(self.units) == 1 else f"{first} (or one of the {len(self.units) - 1} updated with it)"


class _Step:
    """The pipeline of one step(), with its rollback."""

    def __init__(self, owner: OffloadedOptimizer, work):
        self.owner = owner
        self.off = owner.offloader
        self.work = [_Work(group, units) for group, units in work]
        self.stats = owner.stats = StepStats()
        self.stats.parameters = len({id(u.param) for w in self.work for u in w.units})
        self.resident = 0
        self.backup_budget = owner.backup_bytes  # pre-step copies kept in memory, in bytes
        self.unrestored = []  # (unit, error) of units a rollback could not restore

    def run(self) -> None:
        started = time.perf_counter()
        work = self.work
        weights = [w.weight for w in work]
        largest = max(weights, default=0)
        read_room, write_room = self.owner.prefetch * largest, self.owner.write_depth * largest
        read_first = work[:_read_first(work, self.owner.prefetch)]
        self.owner._return_reads_ahead(keep={_key(w.units) for w in read_first})
        try:
            next_read = reading = 0  # the first piece not read yet; the weight of those read ahead of i
            oldest = writing = 0     # the oldest piece whose write was not waited for; the weight since it
            for i, w in enumerate(work):
                while oldest < i and writing + weights[i] > write_room:
                    self._wait(work[oldest], "write", "writing the optimizer state of")
                    writing -= weights[oldest]
                    oldest += 1
                if next_read > i:
                    reading -= weights[i]
                else:  # not read ahead (prefetch 0, or the step's first piece)
                    self._start_read(w)
                    next_read = i + 1
                while next_read < len(work) and reading + weights[next_read] <= read_room:
                    self._start_read(work[next_read])
                    reading += weights[next_read]
                    next_read += 1
                self._wait(w, "read", "reading the optimizer state of")
                self._apply(w)
                writing += weights[i]
            behind = []  # write_behind: pieces whose writes the next step() waits for
            for w in work:
                self._wait(w, "backup_write", "saving the pre-step value of")
                if self.owner.write_behind and _running(w.write):
                    behind.append(w)
                else:
                    self._wait(w, "write", "writing the optimizer state of")
        except _IOFailure as failure:
            self._roll_back()
            raise self._error(failure) from failure.error
        except BaseException:  # the update itself raised (or an interrupt): undo, then let it through
            self._roll_back()
            raise
        self._commit()
        self.owner._behind = behind
        self.stats.writes_left_in_flight = len(behind)
        if self.owner.read_ahead:
            self.owner._start_reads_ahead(work)
        self.stats.seconds = time.perf_counter() - started

    # -------------------------------------------------------------- stages
    def _start_read(self, w) -> None:
        w.old, tensors = [], []
        for unit in w.units:
            stored = unit.stored_tensors()
            w.old.append({key: (v.clone() if isinstance(v, torch.Tensor) and key not in stored else v)
                          for key, v in unit.get_state().items()})
            tensors += stored.values()
        ahead = self.owner._ahead.pop(_key(w.units), None)
        if ahead is not None and [id(t) for t in ahead.tensors] != [id(t) for t in tensors]:
            self.owner._return_read_ahead(ahead)  # not this state any more
            ahead = None
        if tensors:
            w.read_bytes = sum(_nbytes(t) for t in tensors)
            self._hold(w.read_bytes)
            if ahead is not None:
                w.read = ahead.handle
                self.stats.pieces_read_ahead += 1
            else:
                w.read = self.off.async_readv(tensors)
        else:
            w.read = _DONE

    def _apply(self, w) -> None:
        owner, off = self.owner, self.off
        if owner.atomic:
            to_store = []
            for unit in w.units:
                data = unit.data()
                w.backups.append(_copy_of(data))  # a recycled pool buffer: no page faults step after step
                if _nbytes(data) <= self.backup_budget:
                    self.backup_budget -= _nbytes(data)
                else:
                    to_store.append(w.backups[-1])
            if to_store:
                w.backup_write = off.async_writev(to_store)
            for unit in w.units:  # the old state stays in the file until the step commits
                state = unit.get_state()
                for key, old in unit.stored_tensors().items():
                    state[key] = _take_memory(old)
                    off.discard(old)
        w.updated = True
        if len(w.units) == 1:
            w.units[0].update(w.group)
        else:
            owner._update(w.group, [unit.param for unit in w.units])
        w.new = [{key: v for key, v in unit.get_state().items() if _offloadable(v)} for unit in w.units]
        tensors = [t for new in w.new for t in new.values()]
        written = sum(_nbytes(t) for t in tensors)
        self._hold(written - w.read_bytes)  # state created by this update
        self.stats.state_bytes_read += w.read_bytes
        self.stats.state_bytes_written += written
        w.write = off.async_writev(tensors, callback=lambda: self._hold(-written))

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
    def _updated_units(self):
        return [(w, i, unit) for w in self.work if w.updated for i, unit in enumerate(w.units)]

    def _mirror_chunked(self, updated) -> None:
        for p in {id(unit.param): unit.param for _, _, unit in updated if unit.chunked}.values():
            _mirror(p, self.owner._units[p])

    def _commit(self) -> None:
        updated = self._updated_units()
        for w, i, unit in updated:
            unit.stored = w.new[i]
        for w in self.work:
            w.old = w.backups = None  # old state tensors die here: their file space is freed
        self._mirror_chunked(updated)

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
        for w in self.work:
            for i, unit in enumerate(w.units if w.old else ()):
                for key, t in w.old[i].items():
                    if unit.stored.get(key) is t and t.untyped_storage().nbytes() > 0 and w.new[i].get(key) is not t:
                        off.discard(t)  # read (prefetched or in use), not written: back to the store
        updated = self._updated_units()
        if not owner.atomic:  # the step stays partly applied: keep track of what was written
            for w, i, unit in updated:
                unit.stored = _on_store(w.new[i])
            self._mirror_chunked(updated)
            return
        for w, i, unit in updated:
            try:
                if w.backup_write is not None and w.backups[i].untyped_storage().nbytes() == 0:
                    off.sync_read(w.backups[i])
                unit.data().copy_(w.backups[i])
            except OSError as error:
                self.unrestored.append((unit, error))
            unit.set_state(w.old[i])

    def _error(self, failure) -> OSError:
        owner = self.owner
        if not owner.atomic:
            consequence = ("the step is partly applied (atomic=False): parameters updated before "
                           "the failure keep their new values")
        elif self.unrestored:
            unit, error = self.unrestored[0]
            consequence = (f"and restoring {unit.describe()} failed too ({error}): that "
                           "parameter keeps its post-step value")
        else:
            consequence = "the step was rolled back: parameters and optimizer state are as before it"
        code = failure.error.errno or errno_names.EIO
        return OSError(code, f"{failure.what} {failure.work.describe()} failed "
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


class _ReadAhead:
    """A read a step started for the next one: its handle, its tensors."""

    __slots__ = ("handle", "tensors")

    def __init__(self, handle, tensors):
        self.handle, self.tensors = handle, tensors


def _key(units) -> tuple:
    return tuple(id(unit) for unit in units)


def _read_first(work, prefetch) -> int:
    """How many of the first pieces of ``work`` a step reads ahead: those
    that weigh at most ``prefetch`` x the largest piece together."""
    room = prefetch * max((w.weight for w in work), default=0)
    count = total = 0
    for w in work:
        total += w.weight
        if total > room:
            break
        count += 1
    return count


def _on_store(tensors: dict) -> dict:
    """The entries whose bytes are on the store (memory released); a tensor
    whose write failed, or was never started, holds its data in memory."""
    return {key: t for key, t in tensors.items() if t.untyped_storage().nbytes() == 0}


def _running(handle) -> bool:
    return handle is not None and handle is not _DONE and not handle.done()


def _unhooked_step(optimizer) -> None:
    """``optimizer.step()`` minus the wrapper torch's Optimizer puts around
    every subclass's step (hooks, a profiler record: ~0.1 ms a call). A step
    set on the instance itself (a patch, as some frameworks do) runs as is."""
    if "step" in vars(optimizer):
        optimizer.step()
        return
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    step(optimizer)


def _offloadable(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0


def _copied(value):
    """A state entry of its own: tensors (scalars such as ``step``) cloned, other values as they are."""
    return value.clone() if isinstance(value, torch.Tensor) else value


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


def offloaded(optimizer_class, offloader, prefetch: int = 2, **options):
    """A constructor ``(params, **defaults) -> OffloadedOptimizer`` wrapping
    ``optimizer_class``, for code that builds the optimizer itself, such as
    ``ZeroRedundancyOptimizer(params, optimizer_class=offloaded(torch.optim.AdamW,
    lambda: Offloader(f"/nvme/rank{rank}")), lr=1e-3)``. ``offloader`` is an
    Offloader or a function returning one (called once per optimizer);
    ``options`` go to OffloadedOptimizer (``atomic``, ``chunk_size``,
    ``write_behind``...)."""
    def construct(params, **defaults):
        store = offloader if hasattr(offloader, "async_readv") else offloader()
        return OffloadedOptimizer(optimizer_class(params, **defaults), store, prefetch, **options)
    construct.__name__ = f"offloaded_{getattr(optimizer_class, '__name__', 'optimizer')}"
    return construct
