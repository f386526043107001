"""One backing file per directory, used as one striped file (RAID-0)."""
from . import _signals
from ._backing_file import BackingFile, ExtentSpace
from ._extents import ExtentAllocator

_signals.bookkeeping_module(__file__)


class StripedFile(ExtentSpace):
    """The backing files of several directories (usually one per NVMe drive)
    as one: byte ``v`` of the striped file is in the file of directory
    ``(v // unit) % n``, so a tensor's chunks spread over every directory
    and the engine keeps all of them in flight at once.

    Each directory gets a ``BackingFile`` of its own, with its own O_DIRECT
    probe (and fallback and warning). Space is handed out in one extent
    space, aligned to the largest alignment any file needs; claiming it grows
    every file by its share, so ENOSPC on one directory surfaces at the claim,
    naming that directory's file, and nothing is lost."""

    def __init__(self, directories, direct, pool, engine, unit: int):
        self.files = []
        try:
            for directory in directories:
                self.files.append(BackingFile(directory, direct, pool))
        except BaseException:
            self.close()
            raise
        self.unit = unit
        # O_DIRECT in use on any file: memory handed to the engine must then
        # suit O_DIRECT (a small tensor's own storage may not).
        self.direct = any(f.direct for f in self.files)
        self.alignment = max(f.alignment for f in self.files)
        self.memory_alignment = max(f.memory_alignment for f in self.files)
        self.length_alignment = max(f.length_alignment for f in self.files)
        self.extents = ExtentAllocator(self.alignment)
        self.fd = engine.add_stripes([f.fd for f in self.files], unit)
        self.path = " + ".join(f.path for f in self.files)

    def path_of(self, fd: int) -> str:
        """The path of the member file open as ``fd`` (the whole set if none)."""
        for f in self.files:
            if f.fd == fd:
                return f.path
        return self.path

    def grow_to(self, end: int) -> None:
        """Grows every file by its share of ``end`` bytes of the striped file."""
        units, count = -(-end // self.unit), len(self.files)
        for i, f in enumerate(self.files):  # file i holds units i, i + n, i + 2n, ...
            f.grow_to(max(0, -(-(units - i) // count)) * self.unit)

    def close(self) -> None:
        """Removes and closes every file. Idempotent."""
        for f in self.files:
            f.close()
