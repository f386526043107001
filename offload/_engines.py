"""Choosing an engine: io_uring when the machine allows it, threads otherwise."""
import errno
import warnings

from . import _core, _signals

_signals.bookkeeping_module(__file__)

BACKENDS = ("auto", "uring", "threads")
_uring_refusal = None  # why io_uring failed in this process, once probed


def _io_uring_disabled_sysctl() -> str:
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            return f.read().strip()
    except OSError:
        return "absent"


def explain_uring_error(error: OSError) -> str:
    """Why io_uring could not be set up, in words a user can act on."""
    code = error.errno
    if not _core.HAVE_URING:
        return "offload was built without liburing (install liburing-dev and reinstall)"
    if code == errno.EPERM:
        return (f"io_uring_setup failed with EPERM: kernel.io_uring_disabled={_io_uring_disabled_sysctl()} "
                "(1 or 2 forbids it) or a seccomp profile such as Docker's default blocks it")
    if code == errno.ENOSYS:
        return "io_uring_setup failed with ENOSYS: the kernel or a seccomp filter does not offer io_uring"
    if code == errno.ENOMEM:
        return "io_uring_setup failed with ENOMEM: RLIMIT_MEMLOCK is too low for the ring (try fewer n_entries)"
    return f"io_uring_setup failed: {error}"


def warn_if_built_without_uring(have_uring: bool) -> None:
    """Says at import, once, what a build without liburing means: the build
    log is where it was said before, and nobody reads it."""
    if not have_uring:
        warnings.warn("offload: this build has no io_uring (liburing-dev was missing when it was built): "
                      "only the 'threads' engine is available. Install liburing-dev (and pkg-config) and "
                      "reinstall offload for io_uring", RuntimeWarning, stacklevel=2)


warn_if_built_without_uring(_core.HAVE_URING)


_kept_for_good = []  # what the I/O of engines given up on may still use


def close_engine(engine, *in_use, then=None) -> None:
    """``engine.close()``: waits for the I/O in flight, then frees the engine,
    then calls ``then()`` (which frees what ``in_use`` holds). An interrupt
    (a signal handler that raises) ends the wait; if I/O is still in flight
    after the engine's cancel, the engine is kept for good (see ``_core``),
    and so is ``in_use``: what that I/O's memory and files belong to
    (buffers, tensors, the file a worker may still be writing), so the
    kernel never reads or writes memory that went back to the system; then
    ``then`` is not called. The interrupt propagates either way (after
    ``then`` when the cancel emptied the engine); the engine is closed."""
    abandoned = _core.abandoned_engines()
    try:
        engine.close()
    except BaseException:
        if _core.abandoned_engines() != abandoned:
            _kept_for_good.append(in_use)
            warnings.warn("offload: an interrupt ended the wait for I/O that does not finish (a hung drive, a "
                          "stuck mount, a lost completion): its engine, and the memory and files of what it "
                          "had in flight, are kept for the life of this process, never freed",
                          RuntimeWarning, stacklevel=2)
        elif then is not None:
            then()
        raise
    if then is not None:
        then()


def pairs(reaped: list):
    """(tag, result) pairs of an engine's ``reap()`` (a flat list of ints)."""
    it = iter(reaped)
    return zip(it, it)


def open_engine(backend: str, n_entries: int, chunk_bytes: int, threads: int,
                max_in_flight_bytes: int = 128 << 20):
    """An engine for ``backend``. ``auto`` probes io_uring once per process and
    falls back to threads with one RuntimeWarning naming the reason; ``uring``
    raises OSError instead of falling back."""
    global _uring_refusal
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "uring" or (backend == "auto" and _uring_refusal is None):
        try:
            return _core.make_uring_engine(n_entries, chunk_bytes, n_entries, max_in_flight_bytes)
        except OSError as error:
            reason = explain_uring_error(error)
            if backend == "uring":
                raise OSError(error.errno, reason) from None
            if error.errno in (errno.EPERM, errno.ENOSYS):  # the machine's answer: ask once
                _uring_refusal = reason
            warnings.warn(f"offload: io_uring unavailable, using the 'threads' engine: {reason}",
                          RuntimeWarning, stacklevel=3)
    return _core.make_thread_engine(threads, chunk_bytes, n_entries, max_in_flight_bytes)
