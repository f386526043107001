"""O_DIRECT in one place: opening a file with it where the file system allows
(and falling back where the caller allows), proving it works, the block every
offset and length is rounded to, and what a file demands beyond it."""
import errno
import os

from . import _core, _signals

# Pure arithmetic, but called from the Offloader's bookkeeping: an innermost
# frame here must hold a signal as the caller's would (offload/_signals.py).
_signals.bookkeeping_module(__file__)

BLOCK = 4096  # a page; O_DIRECT transfers start and end on it (more where a file asks)


def round_up(n: int, alignment: int = BLOCK) -> int:
    """The smallest multiple of ``alignment`` at or above ``n``."""
    return -(-n // alignment) * alignment


def round_down(n: int, alignment: int = BLOCK) -> int:
    """The largest multiple of ``alignment`` at or below ``n``."""
    return n // alignment * alignment


def file_alignment(fd: int) -> int:
    """What transfers on ``fd`` are aligned to: at least a block, more when
    the file's DIO memory or offset alignment (statx) asks for more."""
    memory, offset = _core.dio_alignment(fd)
    return max(BLOCK, memory, offset)


def transfer_alignment(fd: int, direct: bool):
    """(memory, length): what a transfer's address and length must be
    multiples of on ``fd``. With O_DIRECT, the file's statx DIO alignment (a
    block where the file system does not say); without it, anything goes."""
    if not direct:
        return 1, 1
    memory, offset = _core.dio_alignment(fd)
    return memory or BLOCK, offset or BLOCK


def open_maybe_direct(attempt, direct, where):
    """Opens with O_DIRECT where the caller and the file system allow it.
    ``attempt(use_direct)`` opens (and probes, if it must) and returns what
    it opened; when it raises, it has cleaned up after itself. ``direct``:
    False never tries O_DIRECT; True requires it (EINVAL, the file system's
    refusal, is raised naming ``where``); None tries it and falls back to
    buffered I/O on EINVAL. Any other error is raised as it is. Returns
    (what ``attempt`` returned, whether O_DIRECT is in use)."""
    if direct is not False:
        try:
            return attempt(True), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            if direct:
                raise OSError(errno.EINVAL, "O_DIRECT is not supported here (direct=True was asked)",
                              os.fspath(where)) from error
    return attempt(False), False


def open_data_for_reading(path, buffered_fd: int, direct) -> int:
    """The descriptor to read ``path``'s data through: a new one opened with
    O_DIRECT where ``direct`` and the file system allow (open_maybe_direct's
    rules), else ``buffered_fd``, the caller's own, opened without it."""
    fd, _ = open_maybe_direct(
        lambda use_direct: os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT) if use_direct else buffered_fd,
        direct, path)
    return fd


def create_exclusive(path: str, flags: int, mode: int) -> int:
    """``os.open(path, flags | O_CREAT | O_EXCL | O_NOFOLLOW, mode)``, leaving
    no file behind when it fails: Linux creates the file before it checks
    O_DIRECT, so a file system that refuses O_DIRECT (tmpfs, ramfs) fails the
    open with EINVAL and keeps the new, empty file."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except OSError as error:
        if error.errno != errno.EEXIST:  # (O_EXCL: a file there now is the one this call made)
            try:
                os.unlink(path)
            except OSError:
                pass
        raise


def probe_direct(fd: int, buffer) -> None:
    """Writes and reads back one aligned block at offset 0 of ``fd`` (open
    with O_DIRECT), from ``buffer`` (a pool Buffer): some file systems accept
    the open and refuse the I/O (EINVAL). Leaves a block of zeros in the file."""
    view = memoryview(buffer)[:BLOCK]
    try:
        view[:] = bytes(BLOCK)
        os.pwritev(fd, [view], 0)
        os.preadv(fd, [view], 0)
    finally:
        view.release()
