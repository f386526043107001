"""The one place where errno values become Python exceptions."""
import os

from . import _signals

_signals.bookkeeping_module(__file__)


def os_error(errno_value: int, path: str, what: str = "") -> OSError:
    """OSError(errno, strerror, path); Python picks the subclass from the errno
    (FileNotFoundError, PermissionError, ...). ``what`` is added as a note."""
    error = OSError(errno_value, os.strerror(errno_value), path)
    if what and hasattr(error, "add_note"):
        error.add_note(what)
    return error


class OffloaderClosedError(RuntimeError):
    """The Offloader was closed; open a new one."""


class OffloaderForkedError(OffloaderClosedError):
    """The Offloader belongs to the process that created it, and this is a
    forked child: create a new Offloader here (or start workers with the
    "spawn" or "forkserver" method)."""
