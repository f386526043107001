"""An Offloader belongs to the process that created it.

fork() copies memory but not threads: a child inherits the Offloader's
records, its extent table and the descriptors of its ring and backing file,
but none of its engine's threads, and the ring and the file are still the
parent's. Right after a fork, in the child only, every live Offloader is
abandoned there: its calls raise ``OffloaderForkedError``, and nothing the
child does (closing it, garbage collection, atexit) touches the engine or
the file. The parent is not affected. The C++ core refuses the same way
(each engine records its fork generation), so an engine reached another way
is never driven nor freed in a child either.

fork() waits for every Offloader's lock: another thread (its progress
thread, reaping) may hold one, and a lock held across fork() would stay
taken in the child forever, hanging its first call instead of refusing it.
"""
import os
import weakref

_owned = weakref.WeakSet()


def track(offloader) -> None:
    """Registers an Offloader of this process, to be abandoned in children."""
    _owned.add(offloader)


_held = []  # the locks taken for a fork in progress


def _take_locks_before_fork() -> None:
    for offloader in list(_owned):
        lock = offloader._lock
        lock.acquire()
        _held.append(lock)


def _give_locks_back() -> None:
    while _held:
        _held.pop().release()


def _abandon_all_in_child() -> None:
    _give_locks_back()
    for offloader in list(_owned):
        offloader._abandon_in_child()
    _owned.clear()


os.register_at_fork(before=_take_locks_before_fork, after_in_parent=_give_locks_back,
                    after_in_child=_abandon_all_in_child)
