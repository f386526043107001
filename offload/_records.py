"""What an Offloader knows about each tensor it has seen (a record) and each
operation it admitted (an op); written only with its lock held, and read
with it held but for one field (``Record.awaiting_block``)."""
import weakref

from . import _signals
from ._tensors import released as _released, returned as _returned

_signals.bookkeeping_module(__file__)

READ, WRITE = 0, 1  # an op's kind


class Record(weakref.ref):
    """What this Offloader knows about one tensor it has seen, and a weak
    reference to it: ``record()`` is the tensor, None once it died (then
    ``on_death(record)`` runs). All an Offloader keeps for a tensor while
    it lives (its layout is shared with every tensor of that shape): each
    object kept is one more for every full collection of the cyclic GC to
    scan (BENCHMARKS.md)."""

    __slots__ = ("key", "layout", "offset", "capacity", "stored", "on_disk", "busy", "queue", "host",
                 "in_file", "version", "awaiting_block")

    def __new__(cls, tensor, on_death):
        return super().__new__(cls, tensor, on_death)

    def __init__(self, tensor, on_death):
        super().__init__(tensor, on_death)
        self.key = id(tensor)     # its key in the Offloader's records (its id, gone with it)
        self.layout = None
        self.offset = -1          # extent in the backing file, -1 when none
        self.capacity = 0
        self.stored = False       # the extent holds the data and the tensor's memory is released
        self.on_disk = False      # what `stored` will be once every queued operation has run
        self.busy = False         # an operation on this tensor is in the engine
        self.queue = None         # operations issued after the busy one, in order
        self.host = None          # Offloader(None): the page-locked buffer holding the data
        self.in_file = False      # the extent holds the bytes of the last successful write
        self.version = None       # the tensor's version counter when its memory went, until it is back
        # The write whose freed memory a block for the tensor's next read
        # replaces, until that read takes its block (or the tensor dies). The
        # releaser's thread reads it without the lock, to drop a request that
        # came too late: a block then would wait for a read that never comes.
        self.awaiting_block = None

    def released(self, t) -> None:
        """``t``'s memory just went (a write, a discard): autograd is told."""
        if self.version is None:
            self.version = _released(t)

    def returned(self, t) -> None:
        """``t`` holds again the bytes it had when its memory went: autograd
        sees it unchanged (bytes that come back are no change)."""
        version = self.version
        if version is not None:
            self.version = None
            _returned(t, version)


class Op:
    """One admitted read or write of one tensor, from issue to completion."""

    __slots__ = ("kind", "tensor", "record", "handle", "keep", "checked", "in_place", "tag", "frees")

    def __init__(self, kind, tensor, record, handle):
        self.kind = kind
        self.tensor = tensor    # strong references until the completion is reaped
        self.record = record
        self.handle = handle
        self.keep = None        # the memory the kernel reads from or writes into
        self.checked = False    # validated at issue, nothing ran in between
        self.in_place = False   # a read into the tensor's own storage, resized for it
        self.tag = 0            # its engine request's
        self.frees = 0          # a write from the tensor's own memory: the read block to provision when it lands
