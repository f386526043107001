"""Space in a backing file: aligned extents, reused and coalesced."""
from bisect import bisect_left, insort

from . import _signals
from ._direct_io import round_up

_signals.bookkeeping_module(__file__)


class ExtentAllocator:
    """Hands out [offset, offset + size) ranges of a file, ``size`` a multiple of
    ``alignment``. Freed ranges merge with free neighbours and are handed out
    again (exact size first, then the smallest that fits), so a workload that
    writes the same tensors over and over keeps a bounded file. Not thread-safe.
    """

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.end = 0                      # every byte past this is free
        self._by_start: dict[int, int] = {}      # free start -> size
        self._by_end: dict[int, int] = {}        # free end -> start
        self._by_size: dict[int, dict[int, None]] = {}  # size -> free starts (ordered set)
        self._sizes: list[int] = []               # sorted keys of _by_size

    def round_up(self, size: int) -> int:
        return round_up(size, self.alignment)

    @property
    def free_bytes(self) -> int:
        return sum(self._by_start.values())

    def allocate(self, size: int) -> int:
        """The offset of a free range of ``size`` bytes (already rounded)."""
        starts = self._by_size.get(size)
        if starts:
            start = next(reversed(starts))
            self._remove(start, size)
            return start
        i = bisect_left(self._sizes, size)
        if i < len(self._sizes):
            have = self._sizes[i]
            start = next(reversed(self._by_size[have]))
            self._remove(start, have)
            self._insert(start + size, have - size)
            return start
        start = self.end
        self.end += size
        return start

    def free(self, start: int, size: int) -> None:
        """Returns a range from allocate()."""
        if size == 0:
            return
        before = self._by_end.get(start)
        if before is not None:
            before_size = start - before
            self._remove(before, before_size)
            start, size = before, size + before_size
        after_size = self._by_start.get(start + size)
        if after_size is not None:
            self._remove(start + size, after_size)
            size += after_size
        if start + size == self.end:
            self.end = start
        else:
            self._insert(start, size)

    def _insert(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        starts = self._by_size.get(size)
        if starts is None:
            self._by_size[size] = {start: None}
            insort(self._sizes, size)
        else:
            starts[start] = None

    def _remove(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        starts = self._by_size[size]
        del starts[start]
        if not starts:
            del self._by_size[size]
            self._sizes.pop(bisect_left(self._sizes, size))
