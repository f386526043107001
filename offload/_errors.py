"""The one place where errno values become Python exceptions."""
import os

from . import _signals

_signals.bookkeeping_module(__file__)


def os_error(errno_value: int, path: str, what: str = "") -> OSError:
    """OSError(errno, strerror, path); Python picks the subclass from the errno
    (FileNotFoundError, PermissionError, ...). ``what`` is added as a note."""
    error = OSError(errno_value, os.strerror(errno_value), path)
    if what:
        add_note(error, what)
    return error


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (PEP 678). Python 3.9 and 3.10 have no
    add_note: the note goes into ``__notes__`` all the same (where code and
    3.11+ tracebacks read it), and into an OSError's message."""
    if hasattr(error, "add_note"):
        error.add_note(note)
        return
    notes = getattr(error, "__notes__", None)
    if notes is None:
        notes = error.__notes__ = []
    notes.append(note)
    if isinstance(error, OSError) and error.strerror is not None:
        error.strerror = f"{error.strerror} ({note})"


class OffloaderClosedError(RuntimeError):
    """The Offloader was closed; open a new one."""


class OffloaderForkedError(OffloaderClosedError):
    """The Offloader belongs to the process that created it, and this is a
    forked child: create a new Offloader here (or start workers with the
    "spawn" or "forkserver" method)."""
