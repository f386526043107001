"""One engine's completion loop: tags to completions, reaping, waiting in
slices, the callbacks of finished handles, and the asyncio hook-up.

Guarantees:

- Every request submitted under a tag from ``new_tag`` completes exactly once,
  on the thread that reaps it (a caller, or the owner's progress thread
  between calls), with the loop's lock held: ``handler(entry,
  result)`` runs, then the ``tend`` hook the owner gave (device copies that
  landed go to the disk there). A handler that raises does not cost the
  other completions of the same reap: they are handled, then the first
  error is raised. An error met while reaping for nobody's call (on the
  owner's progress thread, or in an asyncio loop's reader: a callback's or a
  handler's) is kept and raised by the next ``poll`` on a caller's thread:
  a call into the owner, a wait, or an ``await`` as it returns.
- The callbacks of finished handles are only queued while the lock is held,
  and run by ``poll`` (or a wait) on the calling thread, outside the lock, in
  the order their handles finished. An exception from one is raised after
  the rest ran; an interrupt leaves the rest due, none lost.
- Each asyncio loop that awaits a handle watches its own duplicate of the
  engine's eventfd: added by its first await and removed by its last, on
  that loop's thread, so ``close`` (from any thread) never leaves a loop
  holding a stale descriptor.
- Once ``close`` ran, nothing is reaped again; handles an ``await`` is still
  waiting on get the owner's refusal instead of a hang.
"""
import contextlib
import gc
import os
import sys
import threading
import time
import warnings

from . import _signals
from ._engines import pairs
from ._errors import add_note

_signals.bookkeeping_module(__file__)

WAIT_SLICE_MS = 50  # longest sleep before re-checking (another thread may reap for us)
# A wait that sees no request finish for this long warns once, and waits on.
QUIET_WAIT_WARNING_S = 60.0
_GC_PAUSE_FROM = 64  # tensors in one vector call (or completions in one reap)


def gc_paused(count: int):
    """Pauses Python's cyclic garbage collector while ``count`` tensors are
    planned or completed, when there are many. Each tensor makes and drops a
    few objects, so thousands of them set off collections that scan every live
    object of the program (about a fifth of the time of a 32768 x 64 KiB write
    in the A/B of BENCHMARKS.md). Garbage made meanwhile is collected as usual
    afterwards; a collector already disabled stays disabled. Few tensors get a
    shared do-nothing context (small calls are per-microsecond work)."""
    if count < _GC_PAUSE_FROM or not gc.isenabled():
        return _NOTHING_TO_PAUSE
    return _paused_gc()


_NOTHING_TO_PAUSE = contextlib.nullcontext()


@contextlib.contextmanager
def _paused_gc():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _Waiter:
    """Counts a thread inside one of the loop's waits: the owner's progress
    thread leaves the reaping to it meanwhile, and looks again when the
    last waiter leaves. (Bookkeeping: a signal never lands between the count and
    the wait.)"""

    __slots__ = ("loop",)

    def __init__(self, loop):
        self.loop = loop

    def __enter__(self):
        with self.loop.lock:
            self.loop.waiters += 1

    def __exit__(self, *exc_info):
        loop = self.loop
        with loop.lock:
            loop.waiters -= 1
            if not loop.waiters and loop.progress is not None:
                loop.progress.wake()


class QuietWatch:
    """One wait's watch on ``loop``'s requests in flight: warns once when
    none has finished for QUIET_WAIT_WARNING_S (a hung device, a stuck
    network mount, a lost completion), naming ``what`` and the loop's
    owner, at the first line outside offload that waits. The clock is the
    quiet time, not the wait's: a long wait whose requests keep finishing
    never warns. Owners that drive the engine themselves (saves, DCP loads)
    call ``saw`` after each of their waits."""

    __slots__ = ("loop", "what", "completed", "since", "warned")

    def __init__(self, loop, what):
        self.loop, self.what, self.warned = loop, what, False
        self.completed, self.since = loop.completed, time.monotonic()

    def saw(self, left: int) -> None:
        """``left`` requests are in flight now."""
        now = time.monotonic()
        if left == 0 or self.loop.completed != self.completed:
            self.completed, self.since = self.loop.completed, now
        elif not self.warned and now - self.since >= QUIET_WAIT_WARNING_S:
            self.warned = True
            warnings.warn(f"offload: {self.what} {self.loop.owner} has waited {now - self.since:.1f} s with "
                          f"{left} request(s) in flight and none finishing: the device may be hung (a stuck "
                          "network mount, a failing drive) or a completion was lost. Still waiting; an "
                          "interrupt (Ctrl-C) stops the wait.", RuntimeWarning,
                          stacklevel=_stacklevel_outside_offload())


def _stacklevel_outside_offload() -> int:
    """warnings.warn's stacklevel, called from the function that calls
    this, for the innermost frame whose code is not offload's own."""
    package = os.path.dirname(__file__) + os.sep
    frame, level = sys._getframe(1), 1  # level 1: the frame that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class CompletionLoop:
    """Reaps ``engine``'s completions and finishes handles. ``refusal()``
    makes the error for waits that can never finish (a closed or forked
    owner); ``tend()``, if given, runs under the lock after every reap;
    ``batch(count)``, if given, is a context each reap of ``count``
    completions runs its handlers in (beside ``gc_paused``)."""

    def __init__(self, engine, refusal, tend=None, batch=None):
        self.engine = engine
        self.lock = threading.RLock()
        self.closed = False
        self.pending = {}     # tag -> (handler, entry) of requests in the engine
        self.due = []         # callbacks of finished handles, to run on a caller's thread
        self.awaited = set()  # handles an await waits on (failed by close() if left unfinished)
        self.refusal = refusal
        self._tend = tend
        self._batch = batch
        self._next_tag = 1
        self._failed = []     # handles that ended with an error, until a wait raises it
        self._watchers = {}   # asyncio loop -> [awaits watching, its duplicate of the eventfd, quiet check]
        self.waiters = 0      # threads inside a wait below (each reaps for itself)
        self.progress = None  # the owner's ProgressThread, woken when the last waiter leaves
        self.deferred_error = None  # raised reaping for nobody's call, for the next poll to raise
        self.owner = "the owner"    # what the warnings of a quiet wait name
        self.waiting = "waiting on an operation of"  # ... a handle's wait, and an await's:
        self.awaiting = "awaiting an operation of"
        self.completed = 0          # requests reaped so far (how a wait tells progress)

    # ------------------------------------------------------------ tags
    def take_tag(self) -> int:
        """A tag no request of this engine has had."""
        tag = self._next_tag
        self._next_tag = tag + 1
        return tag

    def new_tag(self, handler, entry) -> int:
        """A tag whose completion calls ``handler(entry, result)``."""
        tag = self._next_tag
        self._next_tag = tag + 1
        self.pending[tag] = (handler, entry)
        return tag

    # ------------------------------------------------------- completing
    def reap(self) -> None:
        """Completes what the engine finished (the lock held)."""
        reaped = self.engine.reap()
        if not reaped:
            return
        self.completed += len(reaped) // 2
        pending = self.pending
        first_error = None
        count = len(reaped) // 2
        with gc_paused(count), (self._batch(count) if self._batch is not None else _NOTHING_TO_PAUSE):
            for tag, result in pairs(reaped):
                handler, entry = pending.pop(tag)
                try:
                    handler(entry, result)
                except Exception as error:  # the rest were taken from the engine: handle them first
                    if first_error is None:
                        first_error = error
        if first_error is not None:
            raise first_error

    def complete(self, tag, result) -> None:
        """Completes one request by hand (one the engine refused)."""
        self.completed += 1
        handler, entry = self.pending.pop(tag)
        handler(entry, result)

    def poll(self, caller: bool = True) -> None:
        """Reaps, tends, then runs due callbacks (outside the lock). A
        caller's poll raises the deferred error first, if there is one (the
        callbacks then stay due for the next poll)."""
        with self.lock:
            if self.closed:
                return
            self.reap()
            self.tend()
        if caller:
            self.catch_up()
        elif self.due:
            self.run_due()

    def catch_up(self) -> None:
        """What a caller still owes after a reap, or once its handle has
        finished: raises the deferred error if there is one (the callbacks
        then stay due), else runs due callbacks."""
        if self.deferred_error is not None:
            with self.lock:
                deferred, self.deferred_error = self.deferred_error, None
            if deferred is not None:
                raise deferred
        if self.due:
            self.run_due()

    def defer(self, error) -> None:
        """Keeps ``error``, met reaping for nobody's call, for the next poll
        to raise (the lock held). A second one joins the first as a note."""
        if self.deferred_error is None:
            self.deferred_error = error
        else:
            add_note(self.deferred_error, f"and after it: {type(error).__name__}: {error}")

    def tend(self) -> None:
        """The owner's ``tend`` hook (the lock held)."""
        if self._tend is not None:
            self._tend()

    def finish(self, handle) -> None:
        """``handle``'s last operation ended (the lock held): queue its
        callback or its error, and wake its awaits. The handle lets go of
        its callback here: a callback that refers back to whoever holds the
        handle must not make a cycle that only the cyclic GC frees."""
        callback, handle._callback = handle._callback, None
        if handle._error is not None:
            self._failed.append(handle)
        elif callback is not None:
            self.due.append(callback)
        if handle._futures:
            handle._wake_futures()

    @_signals.calls_user_code
    def run_due(self) -> None:
        first_error = None
        while True:
            with self.lock:
                due, self.due = self.due, []
            if not due:
                break
            for i, callback in enumerate(due):
                try:
                    callback()
                except Exception as error:  # run the others, then raise the first
                    if first_error is None:
                        first_error = error
                except BaseException:  # an interrupt: the rest stay due, none is lost
                    with self.lock:
                        self.due[:0] = due[i + 1:]
                    raise
        if first_error is not None:
            raise first_error

    # ----------------------------------------------------------- waiting
    @_signals.interruptible
    def wait_for(self, handle, timeout) -> None:
        """Until ``handle`` is done, or TimeoutError after ``timeout`` seconds;
        warns once if nothing finishes for a while (``QuietWatch``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = QuietWatch(self, self.waiting)
        with _Waiter(self):
            while True:
                self.poll()
                if not handle._remaining:
                    return
                if self.closed:
                    raise self.refusal()
                watch.saw(len(self.pending))
                slice_ms = WAIT_SLICE_MS
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("the operation did not finish within the timeout")
                    slice_ms = max(1, min(slice_ms, int(left * 1000)))
                self.engine.wait(slice_ms)

    @_signals.interruptible
    def wait_until(self, quiet, what="a wait") -> None:
        """Until ``quiet()`` (called with the lock held) and no callback is
        due; ``what`` (the owner's call) is named if nothing finishes for a
        while (``QuietWatch``)."""
        watch = QuietWatch(self, what + " on")
        with _Waiter(self):
            while True:
                self.poll()
                with self.lock:
                    if not self.due and quiet():
                        break
                    left = len(self.pending)
                watch.saw(left)
                self.engine.wait(WAIT_SLICE_MS)

    @_signals.interruptible
    def drain(self, refused):
        """Until nothing is in the engine and no callback is due, running
        every callback whatever they raise (``refused``, the error of calls
        the owner no longer admits, is expected and dropped). Returns the
        first other exception a callback raised, or None. Warns once if
        nothing finishes for a while (``QuietWatch``), and waits on."""
        first_error = None
        watch = QuietWatch(self, "closing")
        with _Waiter(self):
            while True:
                try:
                    self.poll()
                except refused:
                    pass
                except Exception as error:
                    if first_error is None:
                        first_error = error
                with self.lock:
                    if not self.pending and not self.due:
                        break
                    left = len(self.pending)
                watch.saw(left)
                self.engine.wait(WAIT_SLICE_MS)
        return first_error

    def raise_unreported(self) -> None:
        """Raises the first error of a handle nobody asked for its outcome."""
        with self.lock:
            failed, self._failed = self._failed, []
        unreported = [h for h in failed if not h._observed]
        if unreported:
            unreported[0]._observed = True
            error = unreported[0]._error
            if len(unreported) > 1:
                add_note(error, f"{len(unreported) - 1} more operation(s) failed too")
            raise error

    def close(self) -> None:
        """Stops reaping for good; awaits still waiting get the refusal. Call
        with the lock held, once the engine is closed (the requests dropped
        here hold the memory the kernel used)."""
        self.closed = True
        unfinished = [h for h in self.awaited if h._remaining]
        self.awaited.clear()
        for handle in unfinished:  # only if the drain was interrupted
            handle._error = handle._error or self.refusal()
            handle._remaining = 0
            handle._wake_futures()
        self.pending.clear()

    # ----------------------------------------------------------- asyncio
    def watch(self, loop) -> None:
        """Has ``loop`` reap when the engine signals (the lock held, the
        loop not closed)."""
        with self.lock:
            entry = self._watchers.get(loop)
            if entry is None:
                entry = self._watchers[loop] = [0, os.dup(self.engine.event_fd), None]
            entry[0] += 1
            new = entry[0] == 1
        if new:
            loop.add_reader(entry[1], self._on_event, entry[1])
            self._check_awaits(loop, entry, QuietWatch(self, self.awaiting))

    def _check_awaits(self, loop, entry, watch) -> None:
        """The awaits' QuietWatch, four times every QUIET_WAIT_WARNING_S
        while an await on ``loop`` waits (its warning comes from the loop's
        callback, not from an await's line)."""
        if entry[2] is not None:
            with self.lock:
                if self.closed or self._watchers.get(loop) is not entry:
                    return
                left = len(self.pending)
            watch.saw(left)
        entry[2] = loop.call_later(QUIET_WAIT_WARNING_S / 4, self._check_awaits, loop, entry, watch)

    def unwatch(self, loop) -> None:
        with self.lock:
            entry = self._watchers[loop]
            entry[0] -= 1
            if entry[0] > 0:
                return
            del self._watchers[loop]
        if not loop.is_closed():
            loop.remove_reader(entry[1])
            if entry[2] is not None:
                entry[2].cancel()
        os.close(entry[1])

    def _on_event(self, fd) -> None:
        if self.closed:  # nobody reaps any more: quiet the fd until the last await leaves
            try:
                os.read(fd, 8)
            except OSError:
                pass
            return
        try:
            self.poll(caller=False)
        except Exception as error:  # nobody's call: the next poll on a caller raises it
            with self.lock:
                self.defer(error)
