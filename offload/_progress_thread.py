"""An Offloader's progress thread: moves its transfers along between calls.

The engine keeps at most its in-flight window (128 MiB) on the disk; the
rest of a larger call starts only as earlier chunks finish and someone reaps.
A device transfer likewise needs each landed copy handed to the disk and each
freed staging slot refilled. Callers reap on every call and while they wait,
but between calls (``async_write`` of a large state, then a second of
compute) nobody would: the transfer would stop at the window and finish only
inside the next wait, with no overlap at all.

Guarantees:

- The thread reaps and tends with the completion loop's lock held, as a
  caller does; it never runs a callback. Callbacks stay due for the
  caller's thread: its next call into the Offloader, a wait, or an await.
- It starts working when ``needs_progress()`` (called with the lock held)
  says that something would stall, and goes on until nothing is in flight,
  so the handles of what it moved finish too (an ``await`` on one resumes at
  once). It pauses while a thread is inside a wait (a waiter reaps for
  itself), and otherwise sleeps on a condition and costs nothing. Calls that
  fit in the window never wake it.
- A thread that starts waiting while this one reaps is woken
  (``engine.wake()``), so no waiter sleeps through a completion taken from
  under it.
- ``stop()`` ends it; it never outlives the Offloader's close, nor the
  Offloader (``needs_progress()`` returns None once its owner is gone).
- An exception from a reap or a tend ends it too, and is handed to the loop
  (``defer``): the caller's next call or wait raises it, as it would
  have raised had the caller reaped. Callers then reap for themselves, as
  they always may; nothing in flight is lost.
"""
import threading

from . import _signals
from ._completion_loop import WAIT_SLICE_MS
from ._errors import add_note

_signals.bookkeeping_module(__file__)

_RECHECK_S = 1.0  # a parked thread looks again this often (its owner may be gone)


class ProgressThread:
    def __init__(self, loop, needs_progress, name: str):
        self._loop = loop
        self._needs_progress = needs_progress
        self._condition = threading.Condition(loop.lock)
        self._name = name
        self._thread = None
        self._stopped = False
        self.rounds = 0  # reaps it has done (for tests and diagnostics)

    def resume(self) -> None:
        """Something may need moving (the loop's lock held): start or wake the thread."""
        if self._stopped:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self.wake()

    def wake(self) -> None:
        """Has a started thread look again (the loop's lock held); starts none."""
        if self._thread is not None:
            self._condition.notify()

    def stop(self) -> None:
        """Ends the thread (the loop's lock held); ``join()`` after releasing it."""
        self._stopped = True
        self._condition.notify()

    def join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        loop = self._loop
        active = False  # once woken, it reaps until nothing is in flight
        while True:
            with self._condition:
                while True:
                    needed = None if self._stopped or loop.closed else self._needs_progress()
                    if needed is None:
                        return
                    active = needed or (active and bool(loop.pending))
                    if active and not loop.waiters:
                        break
                    self._condition.wait(_RECHECK_S)
            loop.engine.wait(WAIT_SLICE_MS)  # without the GIL
            with self._condition:
                if self._stopped or loop.closed or self._needs_progress() is None:
                    return
                try:
                    loop.reap()
                    loop.tend()
                except Exception as error:
                    add_note(error, "raised on the Offloader's progress thread, which has stopped: "
                                    "transfers now move only within calls")
                    loop.defer(error)
                    self._stopped = True
                    loop.engine.wake()
                    return
                self.rounds += 1
                if loop.waiters:
                    loop.engine.wake()
