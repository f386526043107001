"""Signals that land in the middle of the Offloader's bookkeeping are held
until it is whole.

Python runs a signal handler between any two bytecodes of the main thread,
so a ``KeyboardInterrupt`` could otherwise land between taking a completion
off the engine and recording it, or between submitting a write and
releasing the tensor's memory, and leave a tensor neither resident nor
offloaded. While the main thread is inside the bookkeeping of
``offload``'s core modules, a signal is held and delivered again 1 ms later,
until it lands outside (or has been held for a second: a signal is never
swallowed). Waiting for I/O (``Handle.wait``, ``synchronize``,
``close``) and running user callbacks are not bookkeeping: Ctrl-C reaches
them at once, as anywhere else.

The handlers wrapped are those installed when an Offloader is created on
the main thread (SIGINT's default one included). A handler installed later
runs unwrapped until the next Offloader is created. asyncio.run's own SIGINT
handler is left alone: it cancels the main task, which lands at an await,
never inside bookkeeping (and asyncio restores the default handler only if
it finds its own still installed).

No cost on the I/O path: the check runs only when a signal arrives (it looks
at the interrupted frames).
"""
import os
import signal
import sys
import threading
import time

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR1",
                                                      "SIGUSR2") if hasattr(signal, name))
_THIS_FILE = __file__
_PACKAGE = os.path.dirname(__file__) + os.sep
_REDELIVER_S = 0.001
_HOLD_AT_MOST_S = 1.0

# Modules whose frames are bookkeeping (file names), and the functions in them
# that wait or call user code, where a signal is delivered at once.
_bookkeeping_files = set()
_interruptible_codes = set()
_calls_user_code = set()  # interruptible unless they are the innermost frame
_lock = threading.Lock()
_redelivering = set()     # signals with a re-delivery scheduled
_held_since = {}          # signal -> when it was first held
held_count = 0            # signals held so far (for tests and diagnostics)


def bookkeeping_module(module_file: str) -> None:
    """Declares a module's functions bookkeeping (unless marked below)."""
    _bookkeeping_files.add(module_file)


def interruptible(function):
    """Marks a function of a bookkeeping module where signals land at once:
    it only waits, or its state is whole between any two of its bytecodes."""
    _interruptible_codes.add(function.__code__)
    return function


def calls_user_code(function):
    """Marks a function that calls user callbacks: a signal landing in the
    callback (a frame above it) is delivered at once; one landing in the
    function itself is held."""
    _calls_user_code.add(function.__code__)
    return function


def _held(frame) -> bool:
    """True when the innermost frame of offload's own code is bookkeeping.
    Frames of this module (a second signal landing in this handler) and of
    a trace or profile function (a debugger, coverage) are looked through."""
    hooks = {f.__code__ for f in (sys.gettrace(), sys.getprofile()) if hasattr(f, "__code__")}
    above_ours = False  # a frame of other code (torch, a callback) was seen first
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _THIS_FILE or code in hooks:
            frame = frame.f_back
            continue
        if code.co_filename.startswith(_PACKAGE):
            if code.co_filename not in _bookkeeping_files or code in _interruptible_codes:
                return False
            if code in _calls_user_code and above_ours:
                return False
            return True
        above_ours = True
        frame = frame.f_back
    return False


class _Deferring:
    """A signal handler that runs ``previous`` unless the main thread is in
    bookkeeping, in which case the signal is sent again shortly."""

    __slots__ = ("previous",)

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, signum, frame):
        if _held(frame):
            global held_count
            held_count += 1
            first = _held_since.setdefault(signum, time.monotonic())
            if time.monotonic() - first < _HOLD_AT_MOST_S:
                _redeliver_later(signum)
                return None
        _held_since.pop(signum, None)
        return self.previous(signum, frame)


def _redeliver_later(signum) -> None:
    with _lock:
        if signum in _redelivering:
            return  # one is on its way; the OS coalesces repeats the same way
        _redelivering.add(signum)
    main = threading.main_thread().ident

    def send():
        with _lock:
            _redelivering.discard(signum)
        try:
            signal.pthread_kill(main, signum)
        except (OSError, ProcessLookupError):
            pass  # the main thread is gone: nothing left to interrupt

    timer = threading.Timer(_REDELIVER_S, send)
    timer.daemon = True
    timer.start()


def install() -> None:
    """Wraps the Python-level handlers installed now, on the main thread
    only (where signal.signal may be called). Idempotent."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _SIGNALS:
        try:
            current = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if callable(current) and not isinstance(current, _Deferring) and not _is_asyncio_runner(current):
            try:
                signal.signal(signum, _Deferring(current))
            except (ValueError, OSError):
                pass


def _is_asyncio_runner(handler) -> bool:
    """asyncio.Runner's SIGINT handler (a partial of Runner._on_sigint)."""
    function = getattr(handler, "func", None)
    return getattr(function, "__qualname__", "") == "Runner._on_sigint"
