"""Weight streaming: a model's parameters live in an Offloader and come into
memory a block at a time, read ahead of the forward and backward passes
that use them.

``offload_parameters(model, off)`` writes the weights of the model's blocks
to ``off`` (their memory is released) and installs hooks:

- Forward: entering a block makes its weights resident (reads issued ahead
  of time, waited for here) and starts reading the next ``prefetch`` blocks
  in the order recorded on the previous pass (module order before the first
  pass). Leaving it releases them: ``Offloader.discard`` when they are
  unchanged (nothing is written), a write when something changed them while
  resident (the change is kept). A pass that runs blocks in another order
  (conditional or reused modules) is correct, only slower: reads ahead that
  were not needed are released, blocks not read ahead are read on entry.
- Backward (grad mode): the tensors autograd saves that are a block's
  weights (or views of them) are saved as references, not copies; the
  backward reads the weights back ahead of use, in reverse forward order,
  and a reference is rebuilt from the weight when autograd needs it, read
  synchronously if it was released. Nothing is kept alive by autograd.
  Activation checkpointing: a block recomputed whole runs its hooks again;
  a part of a block's forward checkpointed from inside it runs its
  submodules in backward without the block's forward around them, and each
  submodule's hook makes the block's weights resident for the backward
  (weights the block uses directly, not through a submodule, are not seen).
- Memory: weights resident at once stay within the blocks in use plus
  ``prefetch`` read ahead plus one behind in backward, and the budget's
  blocks. Reads land in the process-wide buffer pool, which recycles the
  memory released by earlier blocks. Setup faults in a buffer for every
  weight a window of ``prefetch + 2`` blocks can hold, size by size: no
  pass, the first included, allocates new memory while the pool's idle
  limit holds the window.
- ``apply(fn)`` and ``load_state_dict`` (on the model, a block or a module
  in one) run a block at a time with its weights resident, and what they
  change is written back. Conversions (``.to()``...), deepcopy and pickling
  are refused until ``remove()``.

Parameters outside the blocks (of the modules on the path from the model to
its blocks) and every buffer stay in memory. Tied parameters are streamed
once and are resident while any block using them is. A parameter used
outside its block's ``forward`` (a tied weight read by a parent module)
is not resident there: torch raises on its empty storage.
"""
import os
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn

from .._checkpoint_reading import load_file
from ..checkpoint import CheckpointError, _shards
from ..optim import _needs_closure
from .._core import BufferPool
from .._safetensors import read_header
from .._tensors import check_tensor, check_whole_storage, has_no_data

try:  # torch >= 2.2: the saved-tensor hooks in force, to delegate to
    _top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
except AttributeError:  # pragma: no cover (older torch: an outer context is shadowed)
    _top_hooks = None


def offload_parameters(module, offloader, *, prefetch: int = 2, device=None, budget_bytes: int = 0,
                       blocks=None, checkpoint=None) -> "OffloadedParameters":
    """Streams ``module``'s weights through ``offloader``; see the module
    docstring. Returns the handle whose ``remove()`` brings every weight
    back into memory and removes the hooks.

    Parameters
    ----------
    prefetch : int
        Blocks read ahead of the one running.
    device : str, torch.device or None
        Where the weights are used: None keeps them on their device; "cuda"
        moves each block's weights there before it is written, so they
        stream NVMe -> GPU through the Offloader's staging. Buffers move too.
    budget_bytes : int
        Blocks that fit in this many bytes, in module order, stay resident
        and are never streamed (memory first, NVMe behind it).
    blocks : list of modules or None
        The unit that comes and goes. None: the children of the model's
        largest ``ModuleList``/``Sequential`` (by parameter count), and every
        other subtree with parameters off the path from the model to it; with
        no such list, every module that owns parameters directly.
    checkpoint : str or os.PathLike or None
        A safetensors file (or sharded ``.index.json``) to fill parameters on
        the meta device from, a block at a time, names as in
        ``module.named_parameters()``: a model bigger than memory never has
        all of its weights in memory.
    """
    return OffloadedParameters(module, offloader, prefetch, device, budget_bytes, blocks, checkpoint)


def disk_offload(model, offload_dir, execution_device=None, offload_buffers: bool = False,
                 preload_module_classes=None) -> "OffloadedParameters":
    """accelerate's ``disk_offload(model, offload_dir)``, spelled the same:
    the model's weights stream through a new ``Offloader(offload_dir)``
    (prefetch 2), used on ``execution_device`` (None: where they are).
    Returns the handle; its ``remove()`` also closes that Offloader.
    ``offload_buffers=True`` is refused (buffers stay in memory here).
    ``preload_module_classes``: offload's blocks already hold every weight
    under them while they run, which is what accelerate's option asks for;
    a module of such a class outside every block is refused."""
    from ..offloader import Offloader
    if offload_buffers:
        raise ValueError("offload_buffers=True: offload keeps buffers in memory (they are small and "
                         "change during forward); pass offload_buffers=False")
    os.makedirs(offload_dir, exist_ok=True)
    off = Offloader(offload_dir)
    try:
        blocks = _default_blocks(model)
        if preload_module_classes:
            inside = {id(m) for b in blocks for m in b.modules()}
            for name, m in model.named_modules():
                if type(m).__name__ in preload_module_classes and id(m) not in inside and _has_parameters(m):
                    raise ValueError(f"{name} ({type(m).__name__}) is in preload_module_classes but outside "
                                     "every block: use offload_parameters(..., blocks=[...]) to make it one")
        handle = OffloadedParameters(model, off, 2, execution_device, 0, blocks, None)
    except BaseException:
        off.close()
        raise
    handle._owned_offloader = off
    return handle


class _Entry:
    """One parameter (tied ones once): where it is and who holds it."""

    __slots__ = ("param", "name", "holds", "read", "version", "streamed")

    def __init__(self, param, name):
        self.param, self.name = param, name
        self.holds = 0         # blocks in the window that use it
        self.read = None       # Handle of a read in flight
        self.version = None    # _version_of(param) when it last matched the file; None: released
        self.streamed = False  # lives in the Offloader (False: always resident)


class _Block:
    __slots__ = ("index", "module", "name", "entries", "inner", "nbytes", "streamed", "holds", "hooks")

    def __init__(self, index, module, name):
        self.index, self.module, self.name = index, module, name
        self.entries = []
        self.inner = []       # the modules under it whose weights are its own (not those of blocks nested in it)
        self.nbytes = 0
        self.streamed = True
        self.holds = 0        # reasons to be resident: in use, read ahead, behind in backward
        self.hooks = []


class _Ref:
    """What autograd saves instead of a block's weight (or a view of it)."""

    __slots__ = ("entry", "block", "size", "stride", "offset")

    def __init__(self, entry, block, t):
        self.entry, self.block = entry, block
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class OffloadedParameters:
    """The hooks and state of one ``offload_parameters`` call.

    ``step(optimizer)`` runs a torch optimizer over the streamed weights a
    block at a time (read ahead, updated, written back). Statistics:
    ``streamed_bytes`` (weights living in the Offloader), ``resident_bytes``
    (in memory now, streamed and not), ``peak_streamed_bytes`` (most
    streamed weight bytes resident at once), ``bytes_read``, ``ahead``
    (the blocks held as read ahead of the one running now).
    """

    def __init__(self, module, offloader, prefetch, device, budget_bytes, blocks, checkpoint):
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        self.module, self.off, self.prefetch = module, offloader, prefetch
        self.bytes_read = 0
        self.peak_streamed_bytes = self._streamed_resident = 0
        self._removed = False
        self._guarded = []          # modules whose _apply refuses to convert streamed weights
        self._owned_offloader = None  # disk_offload's: closed by remove()
        self._order = []            # block indices of the last complete forward, in order
        self._pass = None           # block indices entered in the forward under way
        self._cursor = 0
        self._ahead = []            # blocks held as read ahead
        self._trail = []            # blocks left in a forward with grad, still held for backward
        self._entered = []          # (block, saved-tensor hooks) of the blocks running
        self._failed = False        # a block's weights could not be read in this pass
        self._stepping = False      # inside step(): the optimizer runs on resident weights
        self._backward = None       # (order, cursor, current, previous) of the backward under way
        self._grad_order = []       # the order of the last forward run with grad
        names = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        self._entries = {id(p): _Entry(p, names[id(p)]) for p in module.parameters()}
        self.blocks = self._make_blocks(module, blocks)
        self._choose_budget(budget_bytes)
        self._move_buffers(module, device)
        self._check_streamable()
        try:
            self._offload(device, checkpoint)
        except BaseException:
            self._bring_back()  # a failure midway leaves no weight offloaded with no handle to return it
            raise
        self._install()

    @property
    def ahead(self) -> list:
        """The blocks whose weights are held (read, or being read) ahead of
        their use now, oldest first."""
        return [self.blocks[index] for index in self._ahead]

    # ------------------------------------------------------------ setup
    def _make_blocks(self, module, chosen):
        if chosen is None:
            chosen = _default_blocks(module)
        chosen = list(chosen)
        if not chosen:
            raise ValueError("no blocks: the module has no parameters to stream")
        paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        blocks = []
        for index, m in enumerate(chosen):
            if id(m) not in paths:
                raise ValueError(f"block {index} ({type(m).__name__}) is not a submodule of the model")
            if m is module:
                raise ValueError("the model itself cannot be a block: name its submodules")
            blocks.append(_Block(index, m, paths[id(m)] or type(m).__name__))
        # A block's weights: those of the modules under it, down to (not
        # into) the blocks nested in it; shared modules and tied weights
        # belong to every block that reaches them.
        block_modules = {id(b.module) for b in blocks}

        def collect(m, block, seen):
            if id(m) in seen:
                return
            seen.add(id(m))
            if m is not block.module:
                block.inner.append(m)
            for p in m.parameters(recurse=False):
                entry = self._entries[id(p)]
                if all(e is not entry for e in block.entries):
                    block.entries.append(entry)
            for child in m.children():
                if id(child) not in block_modules:
                    collect(child, block, seen)
        for block in blocks:
            collect(block.module, block, set())
        for block in blocks:
            block.nbytes = sum(e.param.nbytes for e in block.entries)
        return blocks

    def _choose_budget(self, budget_bytes):
        used = 0
        in_budget = set()
        for block in self.blocks:
            new = [e for e in block.entries if id(e) not in in_budget]
            nbytes = sum(e.param.nbytes for e in new)
            if budget_bytes and used + nbytes <= budget_bytes:
                used += nbytes
                in_budget.update(id(e) for e in new)
        for block in self.blocks:
            for entry in block.entries:
                entry.streamed = entry.streamed or id(entry) not in in_budget
        for block in self.blocks:  # a block sharing a streamed weight streams
            block.streamed = any(e.streamed for e in block.entries)
        self.budget_used_bytes = used

    @staticmethod
    def _move_buffers(module, device):
        if device is None:
            return
        for m in module.modules():
            for name, buf in m._buffers.items():
                if buf is not None and not buf.is_meta:
                    m._buffers[name] = buf.to(device)

    def _check_streamable(self) -> None:
        """Refuses, naming the parameter and before any is written, a weight
        the Offloader would refuse (a view of a larger tensor, memory other
        tensors share...). Meta weights are checked once filled."""
        for entry in self._entries.values():
            if entry.streamed and not entry.param.is_meta:
                try:
                    check_tensor(entry.param)
                    check_whole_storage(entry.param, entry.param.untyped_storage())
                except (TypeError, ValueError) as error:
                    raise type(error)(f"parameter {entry.name!r}: {error}") from None
        untracked = [e.name for e in self._entries.values()
                     if e.streamed and not e.param.is_meta and e.param.is_inference()]
        if untracked:
            warnings.warn(
                f"{len(untracked)} streamed weights (the first {untracked[0]!r}) were made in inference mode: "
                "torch keeps no version counter for them, so a block cannot tell whether they changed while "
                "resident, and each release writes them back (as much writing as reading). Build or load the "
                "model outside torch.inference_mode() (torch.no_grad() makes plain tensors) to have unchanged "
                "weights discarded.", RuntimeWarning, stacklevel=4)

    def _bring_back(self) -> None:
        """Reads back every weight ``_offload`` wrote before it failed."""
        written = [e.param for e in self._entries.values()
                   if e.streamed and not e.param.is_meta and has_no_data(e.param)]
        for p in written:
            try:
                self.off.sync_read(p)
            except (OSError, RuntimeError):
                pass  # never written (empty for another reason), or unreadable: nothing more to do

    def _offload(self, device, checkpoint):
        meta = [e for e in self._entries.values() if e.param.is_meta]
        if meta and checkpoint is None:
            raise ValueError(f"parameter {meta[0].name!r} is on the meta device ({len(meta)} are): "
                             "pass checkpoint= to fill them, or materialize the model first")
        files = _CheckpointFiles(checkpoint) if checkpoint is not None else None
        done = set()
        for block in self.blocks + [None]:  # None: parameters outside every block
            entries = block.entries if block is not None else \
                [e for e in self._entries.values() if id(e) not in done]
            todo = [e for e in entries if id(e) not in done]
            done.update(id(e) for e in todo)
            if files is not None:
                files.fill([e for e in todo if e.param.is_meta], self.module)
            for entry in todo:
                if device is not None and entry.param.device != torch.device(device):
                    entry.param.data = entry.param.data.to(device)
            streamed = [e for e in todo if e.streamed]
            if streamed:
                self.off.async_writev([e.param for e in streamed]).wait()
        self.streamed_bytes = sum(e.param.nbytes for e in self._entries.values() if e.streamed)
        _give_back_freed_heap()
        # The window's memory, faulted in now: the first pass reads at disk
        # speed instead of faulting in fresh memory inside its reads.
        self.off.warm(self._window())

    def _window(self) -> list:
        """Streamed CPU weights whose sizes are the buffers a pass can hold at
        once: for each buffer size, the weights of that size in the
        ``prefetch + 2`` blocks with the most of them. The pool recycles
        buffers by size, so the largest blocks alone would leave the other
        sizes (an embedding, a head) to memory faulted in inside the reads."""
        by_size = {}  # buffer size -> one list of weights per block
        for block in self.blocks:
            sizes = {}
            for entry in block.entries:
                if entry.streamed and entry.param.is_cpu and entry.param.nbytes:
                    sizes.setdefault(BufferPool.capacity_for(entry.param.nbytes), []).append(entry.param)
            for size, params in sizes.items():
                by_size.setdefault(size, []).append(params)
        window = []
        for per_block in by_size.values():
            for params in sorted(per_block, key=len, reverse=True)[:self.prefetch + 2]:
                window += params
        return window

    def _install(self):
        for block in self.blocks:
            if block.streamed:
                block.hooks = [
                    block.module.register_forward_pre_hook(lambda m, a, b=block: self._enter(b)),
                    block.module.register_forward_hook(lambda m, a, r, b=block: self._leave(b),
                                                       always_call=True)]
                block.hooks += [m.register_forward_pre_hook(lambda m, a, b=block: self._recomputing(b))
                                for m in block.inner]
                # load_state_dict, entered at the model, the block or a module in it:
                # the block's weights resident while its modules load (copied in
                # place, then written back by the release's version check).
                for m in [block.module] + block.inner:
                    block.hooks += [
                        m._register_load_state_dict_pre_hook(
                            lambda m, sd, prefix, meta, *rest, b=block: self._hold_for_load(b, meta),
                            with_module=True),
                        m.register_load_state_dict_post_hook(lambda m, keys, b=block: self._unhold(b))]
        this = weakref.ref(self)  # the hook is global: it must not keep the handle alive

        def step_guard(optimizer, args, kwargs):
            handle = this()
            if handle is not None:
                handle._check_step(optimizer)
            return None  # anything else is taken for new arguments (or refused) by torch
        self._step_guard = register_optimizer_step_pre_hook(step_guard)
        weakref.finalize(self, self._step_guard.remove)  # a handle dropped without remove()
        self._root_hooks = [
            self.module.register_forward_pre_hook(lambda m, a: self._begin_pass()),
            self.module.register_forward_hook(lambda m, a, r: self._end_pass(), always_call=True),
            self.module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: self._check_state_dict())]
        # model.to() / .half() / .cuda() convert every parameter through
        # Module._apply, and copy.deepcopy / pickle (torch.save(model)) read
        # every one too: the model and each module that owns streamed weights
        # refuse them until remove() (see _check_apply). model.apply(fn)
        # (weight init) runs with each block's weights resident (_apply_resident).
        self._guarded = [m for m in {id(m): m for m in self._apply_owners()}.values()
                         if not _GUARDED.intersection(vars(m))]
        for m in self._guarded:
            m._apply = _guarded_apply(this, m)
            m.apply = _resident_apply(this, m)
            m.__deepcopy__ = m.__reduce_ex__ = _refuse_copy

    # ------------------------------------------------------------ holding
    def _hold(self, block) -> None:
        block.holds += 1
        if block.holds > 1:
            return
        for entry in block.entries:
            entry.holds += 1
            if entry.streamed and entry.version is None and entry.read is None:
                entry.read = self.off.async_read(entry.param)
                self.bytes_read += entry.param.nbytes
                self._streamed_resident += entry.param.nbytes
        self.peak_streamed_bytes = max(self.peak_streamed_bytes, self._streamed_resident)

    def _unhold(self, block) -> None:
        block.holds -= 1
        if block.holds:
            return
        for entry in block.entries:
            entry.holds -= 1
            if entry.holds == 0 and entry.streamed:
                self._release(entry)

    def _release(self, entry) -> None:
        if entry.read is not None:  # a read nobody waited for: let it land first
            try:
                self._finish_read(entry)
            except OSError:
                return  # it stayed offloaded
        if entry.version is None:
            return
        changed = entry.version == _UNTRACKED or entry.param._version != entry.version
        entry.version = None
        self._streamed_resident -= entry.param.nbytes
        if changed:
            self.off.async_write(entry.param)  # ordered before the next read of it
        else:
            self.off.discard(entry.param)

    def _finish_read(self, entry) -> None:
        handle, entry.read = entry.read, None
        try:
            handle.wait()
        except OSError as error:
            self._streamed_resident -= entry.param.nbytes
            p = entry.param
            raise OSError(error.errno, f"reading parameter {entry.name!r} ({p.dtype} {tuple(p.shape)}) "
                                       f"from {self.off.path}: {error.strerror}") from error
        entry.version = _version_of(entry.param)

    def _wait(self, block) -> None:
        for entry in block.entries:
            if entry.read is not None:
                self._finish_read(entry)

    def _read_ahead(self, order, position, current) -> None:
        """Holds the ``prefetch`` blocks after ``position`` in ``order`` as
        read ahead, lets go of those held ahead that are not among them, and
        keeps of the blocks just left (the trail) only what fits beside them."""
        wanted = []
        if position is not None:
            for index in order[position + 1:]:
                if len(wanted) == self.prefetch:
                    break
                if index != current.index and index not in wanted and self.blocks[index].streamed:
                    wanted.append(index)
        for index in list(self._ahead):
            if index not in wanted:
                self._ahead.remove(index)
                self._unhold(self.blocks[index])
        for index in wanted:
            if index in self._trail:  # still held: it changes role, no read
                self._trail.remove(index)
                self._ahead.append(index)
        self._trim_trail(self.prefetch - len(wanted))
        for index in wanted:
            if index not in self._ahead:
                self._ahead.append(index)
                self._hold(self.blocks[index])

    def _trim_trail(self, room) -> None:
        while len(self._trail) > max(room, 0):
            self._unhold(self.blocks[self._trail.pop(0)])

    def _let_go(self) -> None:
        """Releases every block held ahead or in the trail."""
        self._trim_trail(0)
        while self._ahead:
            self._unhold(self.blocks[self._ahead.pop()])

    # ------------------------------------------------------------ forward
    def _begin_pass(self) -> None:
        if _in_backward():
            return  # a recomputation inside backward (activation checkpointing)
        if self._backward is not None:  # the last backward failed, or never ended
            self._abort_backward()
        self._pass, self._cursor = [], 0

    def _end_pass(self) -> None:
        recorded, self._pass = self._pass, None
        if recorded is None:
            if self._failed:
                self._failed = False
                self._let_go()
            return
        self._order = recorded
        if torch.is_grad_enabled():  # the backward comes next: its first blocks are the trail
            self._grad_order = recorded
            self._read_ahead(recorded[::-1], -1, _NO_BLOCK)
        else:
            self._read_ahead(recorded, -1, _NO_BLOCK)
        self._trim_trail(0)

    def _enter(self, block) -> None:
        in_pass = self._pass is not None
        position = None
        if in_pass:
            self._pass.append(block.index)
            order = self._order or [b.index for b in self.blocks]
            position = _locate(order, block.index, self._cursor)
            if position is not None:
                self._cursor = position + 1
            if block.index in self._trail:
                self._trail.remove(block.index)
                self._unhold(block)
        self._hold(block)
        try:
            if in_pass:
                self._read_ahead(order, position, block)
            self._wait(block)
        except BaseException:
            self._unhold(block)
            if in_pass:
                self._pass, self._failed = None, True  # this pass teaches nothing about the order
            raise
        saved = self._push_saved_hooks(block) if torch.is_grad_enabled() else None
        self._entered.append((block, saved))

    def _leave(self, block) -> None:
        if not self._entered or self._entered[-1][0] is not block:
            return  # its _enter raised: nothing is held for it
        _, saved = self._entered.pop()
        if saved is not None:
            saved.__exit__(None, None, None)
        if self._pass is not None and torch.is_grad_enabled():
            self._trail.append(block.index)  # keeps its hold: backward may start with it
            self._trim_trail(self.prefetch - len(self._ahead))
        else:
            self._unhold(block)

    # ------------------------------------------------------------ backward
    def _push_saved_hooks(self, block):
        """Saved-tensor hooks for ``block``'s forward: its streamed weights
        (and views of them) are saved as references; everything else goes
        to the hooks in force outside (activation offloading), if any."""
        outer = _top_hooks(True) if _top_hooks is not None else None
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        by_storage = {e.param.untyped_storage().data_ptr(): e for e in block.entries
                      if e.streamed and e.param.nbytes}

        def pack(t):
            entry = by_storage.get(t.untyped_storage().data_ptr())
            if entry is not None and t.dtype == entry.param.dtype and t.device == entry.param.device:
                return _Ref(entry, block, t)
            return outer_pack(t) if outer_pack is not None else t

        def unpack(packed):
            if type(packed) is _Ref:
                return self._rebuild(packed)
            return outer_unpack(packed) if outer_unpack is not None else packed

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        return hooks

    def _rebuild(self, ref):
        """The weight (view) a _Ref stands for, resident again."""
        try:
            return self._resident_view(ref)
        except BaseException:
            self._abort_backward()  # the backward fails: hold nothing for it
            raise

    def _resident_view(self, ref):
        block, entry = ref.block, ref.entry
        self._needed_by_backward(block)
        if entry.version is None and entry.read is None:  # released and not held: read it now
            self._hold(block)
            try:
                self._wait(block)
                return entry.param.detach().as_strided(ref.size, ref.stride, ref.offset)
            finally:
                self._unhold(block)
        if entry.read is not None:
            self._finish_read(entry)
        return entry.param.detach().as_strided(ref.size, ref.stride, ref.offset)

    def _recomputing(self, block) -> None:
        """A module inside ``block`` runs within a backward, outside the
        block's own forward: activation checkpointing inside the block
        recomputes part of it, reading the weights directly. They are made
        resident and kept, as a saved weight is, until the backward moves
        on."""
        if not _in_backward() or any(entered is block for entered, _ in self._entered):
            return  # a forward, or a recomputation of the whole block (its own hooks hold it)
        try:
            self._needed_by_backward(block)
            self._wait(block)
        except BaseException:
            self._abort_backward()  # the backward fails: hold nothing for it
            raise

    def _needed_by_backward(self, block) -> None:
        """Makes ``block`` the one the backward under way works on: held, with
        the one before it, until the backward moves on; the next ``prefetch``
        of the backward's order read ahead."""
        state = self._backward
        if state is None and self._start_backward():
            state = self._backward
        if state is not None and state["current"] is not block:
            position = _locate(state["order"], block.index, state["cursor"])
            if position is not None:
                state["cursor"] = position + 1
            if state["previous"] is not None:  # released before anything new is read
                self._unhold(state["previous"])
            if block.index in self._ahead:  # read ahead: becomes the current block
                self._ahead.remove(block.index)
            else:
                self._hold(block)
            state["previous"], state["current"] = state["current"], block
            self._read_ahead(state["order"], position, block)

    def _start_backward(self) -> bool:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        except RuntimeError:
            return False  # unpacked outside a backward: no read-ahead
        self._backward = {"order": self._grad_order[::-1], "cursor": 0, "current": None, "previous": None}
        return True

    def _end_backward(self) -> None:
        self._release_backward()
        self._read_ahead(self._order, -1, _NO_BLOCK)

    def _release_backward(self) -> None:
        state, self._backward = self._backward, None
        if state is not None:
            for block in (state["current"], state["previous"]):
                if block is not None:
                    self._unhold(block)

    def _abort_backward(self) -> None:
        self._release_backward()
        self._let_go()

    # ------------------------------------------------------------ optimizer
    def step(self, optimizer) -> None:
        """``optimizer.step()`` with the streamed weights read a block at a
        time (the next ``prefetch`` read ahead), updated and written back;
        then the C heap's free pages go back to the kernel (what the step
        allocated and freed would otherwise stay resident).
        Weights without a ``.grad`` are left as they are, as torch's
        optimizers do. Results are those of one ``optimizer.step()`` over the
        whole model for optimizers whose update of a parameter depends only
        on that parameter (Adam, AdamW, SGD and the like); one whose step
        needs a closure (LBFGS) is refused."""
        if _needs_closure(optimizer):
            raise TypeError(f"{type(optimizer).__name__}.step needs a closure: it evaluates the loss several "
                            "times over every parameter at once, so it cannot step the weights a block at a "
                            "time. Step it yourself over resident weights (handle.remove() first).")
        self._let_go()
        self._stepping = True
        groups = optimizer.param_groups
        saved = [g["params"] for g in groups]
        resident = {id(e.param) for e in self._entries.values() if not e.streamed}
        order = [b.index for b in self.blocks if b.streamed]
        try:
            _step_only(optimizer, groups, saved, resident)
            done = set(resident)
            for position, index in enumerate(order):
                block = self.blocks[index]
                self._hold(block)
                try:
                    self._read_ahead(order, position, block)
                    self._wait(block)
                    params = {id(e.param) for e in block.entries if id(e.param) not in done}
                    done.update(params)
                    _step_only(optimizer, groups, saved, params)
                finally:
                    self._unhold(block)
            self._let_go()
        finally:
            self._stepping = False
            for g, params in zip(groups, saved):
                g["params"] = params
        _give_back_freed_heap()  # the state and copies the step made and freed (1.5 GB model: 7.0 -> 3.9 GB)
        self._read_ahead(self._order, -1, _NO_BLOCK)

    def _check_step(self, optimizer) -> None:
        """Refuses ``optimizer.step()`` over weights that are offloaded
        (their storage is empty: torch would crash, not raise)."""
        if self._stepping or self._removed:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                entry = self._entries.get(id(p))
                if entry is not None and entry.param is p and entry.streamed and entry.version is None:
                    raise RuntimeError(
                        f"parameter {entry.name!r} is offloaded by offload_parameters: call "
                        "handle.step(optimizer) instead of optimizer.step(), or handle.remove() first")

    def _apply_owners(self):
        """The model, every streamed block and the modules under it (they
        carry the hooks), and every module that owns a streamed weight."""
        yield self.module
        for block in self.blocks:
            if block.streamed:
                yield block.module
                yield from block.inner
        for module in self.module.modules():
            if any(id(p) in self._entries and self._entries[id(p)].streamed
                   for p in module.parameters(recurse=False)):
                yield module

    def _check_apply(self) -> None:
        """Refuses converting the model's weights while they stream: an
        offloaded one's storage is empty (torch would crash, not raise), and
        a resident one converted would no longer be what the Offloader
        holds."""
        if not self._removed and any(e.streamed for e in self._entries.values()):
            raise RuntimeError("the model's weights are streamed by offload_parameters: converting them "
                               "(.to(), .half(), .cuda()...) would read offloaded ones' empty tensors. Convert "
                               "the model first (or pass device= to offload_parameters), or call "
                               "handle.remove()")

    def _hold_resident(self, block) -> None:
        """Holds ``block`` and waits for its weights (let go again if a read fails)."""
        self._hold(block)
        try:
            self._wait(block)
        except BaseException:
            self._unhold(block)
            raise

    def _hold_for_load(self, block, metadata) -> None:
        if metadata.get("assign_to_params_buffers"):
            raise RuntimeError("load_state_dict(assign=True) would replace streamed weights with tensors the "
                               "Offloader does not hold: load without assign=, or call handle.remove() first")
        self._hold_resident(block)

    def _apply_resident(self, module, fn) -> None:
        """``module.apply(fn)`` (``fn`` on every module under it, children
        first) with the weights of each streamed block resident while ``fn``
        visits the modules in it: a block at a time, read on entry, released
        on exit, so a weight ``fn`` changed in place is written back."""
        blocks = {id(b.module): b for b in self.blocks if b.streamed}
        around = [b for b in self.blocks if b.streamed and any(m is module for m in b.inner)]

        def visit(m):
            block = blocks.get(id(m))
            if block is not None:
                self._hold_resident(block)
            try:
                for child in m.children():
                    visit(child)
                fn(m)
            finally:
                if block is not None:
                    self._unhold(block)
        held = []  # ``module`` lies inside these blocks: theirs, for the whole call
        try:
            for block in around:
                self._hold_resident(block)
                held.append(block)
            visit(module)
        finally:
            for block in held:
                self._unhold(block)

    def _check_state_dict(self) -> None:
        if any(e.streamed and e.version is None for e in self._entries.values()):
            raise RuntimeError("the model's weights are offloaded by offload_parameters: its state_dict "
                               "would hold empty tensors. Call handle.remove() first")

    # ------------------------------------------------------------ teardown
    @property
    def resident_bytes(self) -> int:
        return sum(e.param.nbytes for e in self._entries.values()
                   if not e.streamed or e.version is not None or e.read is not None)

    def remove(self) -> None:
        """Reads every streamed weight back into memory and removes the
        hooks: the model is as it was (its weights hold their latest values)."""
        if self._removed:
            return
        self._removed = True
        for h in self._root_hooks + [self._step_guard]:
            h.remove()
        for block in self.blocks:
            for h in block.hooks:
                h.remove()
        for m in self._guarded:
            for name in _GUARDED:
                vars(m).pop(name, None)
        self._let_go()
        streamed = [e for e in self._entries.values() if e.streamed]
        for entry in streamed:
            if entry.read is not None:
                self._finish_read(entry)
        self.off.async_readv([e.param for e in streamed if e.version is None]).wait()
        for entry in streamed:
            entry.streamed, entry.version = False, _version_of(entry.param)
        if self._owned_offloader is not None:
            self._owned_offloader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


_GUARDED = {"_apply", "apply", "__deepcopy__", "__reduce_ex__"}  # what a streamed model's modules override


_UNTRACKED = -1  # the version of a weight made in inference mode: no counter, so taken as changed


def _version_of(p) -> int:
    """``p._version``, or ``_UNTRACKED`` for an inference tensor (which has none)."""
    return _UNTRACKED if p.is_inference() else p._version


def _refuse_copy(*args):
    raise RuntimeError("the model's weights are streamed by offload_parameters: copying or pickling it "
                       "would read offloaded ones' empty tensors (and take the streaming hooks along). "
                       "Call handle.remove() first")


def _guarded_apply(handle_ref, module):
    """``module._apply`` that first asks the handle whether converting its
    weights is safe now. Holds the module weakly: no reference cycle."""
    module_ref, convert = weakref.ref(module), type(module)._apply

    def _apply(*args, **kwargs):
        handle = handle_ref()
        if handle is not None:
            handle._check_apply()
        return convert(module_ref(), *args, **kwargs)
    return _apply


def _resident_apply(handle_ref, module):
    """``module.apply`` that runs ``fn`` with the streamed weights resident
    (see _apply_resident). Holds the module weakly: no reference cycle."""
    module_ref, plain = weakref.ref(module), type(module).apply

    def apply(fn):
        handle, m = handle_ref(), module_ref()
        if handle is None or handle._removed:
            return plain(m, fn)
        handle._apply_resident(m, fn)
        return m
    return apply


class _NoBlock:
    index = -1


_NO_BLOCK = _NoBlock()


def _give_back_freed_heap() -> None:
    """The weights' memory was freed, but glibc keeps freed blocks below its
    mmap threshold (which grows to 32 MiB as large blocks are freed) in its
    heap, still resident: a model's worth of memory the process would keep.
    malloc_trim(0) returns free heap pages to the kernel. Elsewhere a no-op."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = lambda pad: 0  # noqa: E731 (not glibc: nothing to trim)
    _malloc_trim(0)


_malloc_trim = None


def _in_backward() -> bool:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _locate(order, index, cursor):
    """Where block ``index`` is in ``order``, looking from ``cursor`` on
    first (a block can run more than once a pass); None if absent."""
    for start, stop in ((cursor, len(order)), (0, cursor)):
        for position in range(start, stop):
            if order[position] == index:
                return position
    return None


def _step_only(optimizer, groups, saved, ids) -> None:
    if not ids:
        return
    for g, params in zip(groups, saved):
        g["params"] = [p for p in params if id(p) in ids]
    optimizer.step()


def _has_parameters(m) -> bool:
    return next(m.parameters(), None) is not None


def _default_blocks(model) -> list:
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    if not lists:
        return [m for m in model.modules() if m is not model and next(m.parameters(recurse=False), None) is not None]
    main = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    path = set()
    _path_to(model, main, path)
    blocks = []

    def visit(m):
        if m is main:
            blocks.extend(c for c in m.children() if _has_parameters(c))
            return
        for child in m.children():
            if child is main or id(child) in path:
                visit(child)
            elif _has_parameters(child):
                blocks.append(child)
    visit(model)
    return blocks


def _path_to(m, target, path) -> bool:
    if m is target:
        return True
    for child in m.children():
        if _path_to(child, target, path):
            path.add(id(child))
            return True
    return False


class _CheckpointFiles:
    """Reads named tensors out of a safetensors file or a sharded index."""

    def __init__(self, path):
        self.where = {}
        for shard, names in _shards(path):
            fd = os.open(shard, os.O_RDONLY | os.O_CLOEXEC)
            try:
                header = read_header(fd, shard)
            finally:
                os.close(fd)
            for entry in header.entries:
                if names is None or entry.name in names:
                    self.where[entry.name] = shard

    def fill(self, entries, model) -> None:
        """Replaces each meta parameter in ``entries`` with a CPU one holding
        the checkpoint's values, in every module that registers it."""
        if not entries:
            return
        aliases = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        wanted = {}
        for entry in entries:
            name = next((n for n in aliases[id(entry.param)] if n in self.where), None)
            if name is None:
                raise CheckpointError(f"parameter {entry.name!r} is not in the checkpoint")
            wanted.setdefault(self.where[name], {})[name] = entry
        for shard, by_name in wanted.items():
            loaded, _ = load_file(shard, "cpu", False, "auto", None, set(by_name))
            for name, entry in by_name.items():
                source = loaded.pop(name)
                old = entry.param
                if source.shape != old.shape:
                    raise CheckpointError(f"parameter {name!r}: the checkpoint holds shape "
                                          f"{tuple(source.shape)}, the model {tuple(old.shape)}")
                new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype), requires_grad=old.requires_grad)
                with torch.no_grad():
                    new.copy_(source)
                _replace_parameter(model, old, new)
                entry.param = new
            del loaded


def _replace_parameter(model, old, new) -> None:
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is old:
                m._parameters[name] = new
