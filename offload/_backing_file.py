"""The private file an Offloader keeps its tensors in."""
import errno
import fcntl
import os
import secrets
import warnings

from . import _signals
from ._direct_io import (BLOCK, create_exclusive, file_alignment, open_maybe_direct, probe_direct,
                         transfer_alignment)
from ._errors import os_error
from ._extents import ExtentAllocator

_signals.bookkeeping_module(__file__)

_GROWTH_STEP = 256 << 20  # preallocate in steps so extending writes stay rare
_NAME_PREFIX, _NAME_SUFFIX = ".offload-", ".swap"
try_tmpfile = True  # tests turn this off to exercise the named-file path


def remove_stale_files(directory: str) -> list:
    """Removes named backing files in ``directory`` whose owner is gone (a
    process killed with SIGKILL). The owner holds an exclusive flock on its
    file for as long as it lives, so a file whose lock can be taken is stale,
    whatever its pid says. Returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(_NAME_PREFIX) and name.endswith(_NAME_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue  # a symlink or gone: never follow, never touch
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # alive
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class ExtentSpace:
    """Space in a file handed out in aligned extents (``self.extents``), the
    file grown by ``grow_to(end)`` (preallocated) before an extent is used,
    so ENOSPC surfaces when space is claimed rather than mid-transfer."""

    def claim(self, nbytes: int):
        """(offset, capacity) of a fresh extent for ``nbytes`` bytes, the file
        grown to hold it. Raises OSError (ENOSPC...) naming the file that
        refused, and claims nothing."""
        capacity = self.extents.round_up(max(nbytes, 1))
        offset = self.extents.allocate(capacity)
        try:
            self.grow_to(offset + capacity)
        except OSError:
            self.extents.free(offset, capacity)
            raise
        return offset, capacity

    def reserve(self, nbytes: int) -> None:
        """Grows the file now to hold ``nbytes`` more past its last extent,
        so that the claims of a vector write that follow need no fallocate
        once its first transfers are running: ext4's fallocate waits for
        every O_DIRECT transfer in flight on the file (BENCHMARKS.md has what
        that cost a first write). Best effort: on a refusal
        each claim grows the file, and raises, as without it."""
        try:
            self.grow_to(self.extents.end + nbytes)
        except OSError:
            pass

    def release(self, offset: int, capacity: int) -> None:
        self.extents.free(offset, capacity)

    def grow_to(self, end: int) -> None:
        raise NotImplementedError


class BackingFile(ExtentSpace):
    """A file private to one Offloader, in the directory the user named.

    It is created with mode 0600 and O_EXCL (O_TMPFILE where the file system
    supports it, so that not even a SIGKILL can leave it behind; otherwise a
    named ``.offload-<pid>-<random>.swap`` opened with O_NOFOLLOW, locked with
    flock while in use, removed by close(), and removed by the next Offloader
    in the directory if its owner died). O_DIRECT is used when ``direct`` is True, or None and the
    file system accepts it (probed with a real aligned write and read); when
    it does not, buffered I/O is used and one warning says why. Space is
    handed out in aligned extents and preallocated with fallocate, so ENOSPC
    surfaces when space is claimed rather than in the middle of a transfer.
    """

    def __init__(self, directory: str, direct, pool):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            if os.path.exists(directory):
                raise NotADirectoryError(errno.ENOTDIR, "Offloader needs a directory, got a file", directory)
            raise FileNotFoundError(errno.ENOENT, "Offloader directory does not exist", directory)
        self.directory = directory
        self.fd = -1
        self.path = ""
        self._named = False
        _, self.direct = open_maybe_direct(lambda use_direct: self._create(use_direct, pool), direct, directory)
        if direct is None and not self.direct:
            warnings.warn(f"offload: the file system of {directory!r} refuses O_DIRECT; "
                          "using buffered I/O (data passes through the page cache)",
                          RuntimeWarning, stacklevel=4)
        self.alignment = file_alignment(self.fd)
        self.extents = ExtentAllocator(self.alignment)
        # What memory a write may go from as it is: its address, and its length.
        self.memory_alignment, self.length_alignment = transfer_alignment(self.fd, self.direct)
        self.size = 0

    def _create(self, use_direct: bool, pool) -> None:
        """Creates the file (and proves O_DIRECT works on it); on failure
        leaves nothing behind."""
        try:
            self._open(os.O_DIRECT if use_direct else 0)
            if use_direct:
                block = pool.acquire(BLOCK)
                probe_direct(self.fd, block)
                os.ftruncate(self.fd, 0)
        except BaseException:
            self.close()
            raise

    def _open(self, extra_flags: int) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_EXCL | extra_flags
        if try_tmpfile:
            try:
                self.fd = os.open(self.directory, flags | os.O_TMPFILE, 0o600)
                self.path = os.path.join(self.directory, "<offload backing file, unnamed>")
                self._named = False
                return
            except OSError as error:
                # No O_TMPFILE on this file system (or not with O_DIRECT): use a named file.
                if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                    raise
        remove_stale_files(self.directory)
        name = f"{_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}{_NAME_SUFFIX}"
        self.path = os.path.join(self.directory, name)
        self.fd = create_exclusive(self.path, flags, 0o600)
        self._named = True
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def grow_to(self, end: int) -> None:
        """Makes the file (preallocated) at least ``end`` bytes long: a step
        ahead when that fits, else just enough. Raises OSError naming it."""
        if end <= self.size:
            return
        target = max(end, min(self.size * 2, self.size + _GROWTH_STEP))
        for size in (target, end):  # when a generous step does not fit, claim just enough
            try:
                os.posix_fallocate(self.fd, self.size, size - self.size)
                self.size = size
                return
            except OSError as error:
                if error.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self.size = end  # no preallocation here: writes extend the file
                    return
                if error.errno != errno.ENOSPC or size == end:
                    raise os_error(error.errno, self.path, "while growing the backing file") from None

    def close(self) -> None:
        """Removes and closes the file. Idempotent."""
        if self._named:  # unlink while still holding the lock, so no cleaner races us
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._named = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
