"""Replacing a file atomically: a crash at any moment leaves the old file or
the new one, never a torn one."""
import contextlib
import errno
import os
import secrets
import threading

from ._direct_io import create_exclusive, open_maybe_direct


class AtomicFile:
    """A new file that becomes ``path`` only through ``commit()``.

    The data goes to an unnamed O_TMPFILE in the target's directory (a crash
    leaves nothing behind), or where the file system lacks O_TMPFILE, to a
    named ``.<name>.tmp-<random>`` (a crash can leave that one; never the
    target). ``commit()`` fsyncs the data, links it under a temporary name,
    renames that over ``path`` and fsyncs the directory. ``abort()`` removes
    everything. O_DIRECT is used when ``direct`` is True, or None and the file
    system accepts it; ``direct`` afterwards says which."""

    def __init__(self, path, direct=None, mode: int = 0o644):
        self.path = os.fspath(path)
        self.directory = os.path.dirname(os.path.abspath(self.path)) or "."
        self.fd, self.temp_name, self.direct = -1, None, False
        try:
            _, self.direct = open_maybe_direct(lambda use_direct: self._create(use_direct, mode), direct,
                                               self.directory)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            raise OSError(error.errno, f"cannot create a file in {self.directory} "
                                       f"{'with' if direct else 'without'} O_DIRECT: {error.strerror}") from error

    def _create(self, use_direct: bool, mode: int) -> None:
        """An unnamed file (O_TMPFILE) in the target's directory, or a hidden
        named one where the file system has no O_TMPFILE."""
        flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_DIRECT if use_direct else 0)
        try:
            if not os.path.isdir("/proc/self/fd"):  # needed to give the O_TMPFILE a name
                raise OSError(errno.EOPNOTSUPP, "no /proc/self/fd")
            self.fd = os.open(self.directory, flags | os.O_TMPFILE, mode)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            name = os.path.join(self.directory, f".{os.path.basename(self.path)}.tmp-{secrets.token_hex(6)}")
            self.fd = create_exclusive(name, flags, mode)
            self.temp_name = name

    def commit(self) -> None:
        """fsync, then make the file ``path`` (atomically), then fsync the directory.
        The file replaced is freed afterwards, off the caller's path: freeing a
        large file's blocks took 0.3 s per 2 GiB here, inside the rename."""
        os.fsync(self.fd)
        directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            old = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            old = -1  # nothing to replace (or not a regular file we may open): rename decides
        try:
            if self.temp_name is None:
                name = f".{os.path.basename(self.path)}.tmp-{secrets.token_hex(6)}"
                # linkat(AT_SYMLINK_FOLLOW) through /proc names an O_TMPFILE without privileges
                # (a dir fd makes Python call linkat rather than link, which would not follow).
                os.link(f"/proc/self/fd/{self.fd}", name, dst_dir_fd=directory, follow_symlinks=True)
                self.temp_name = os.path.join(self.directory, name)
            os.rename(self.temp_name, self.path)
            self.temp_name = None
            os.close(self.fd)
            self.fd = -1
            os.fsync(directory)
        finally:
            os.close(directory)
            if old >= 0:
                _close_on_helper(old)

    def abort(self) -> None:
        if self.temp_name is not None:
            try:
                os.unlink(self.temp_name)
            except OSError:
                pass
            self.temp_name = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unlink_later(path: str) -> None:
    """Unlinks ``path`` (best effort) and frees its blocks on a helper thread,
    as ``commit`` frees the file it replaces: freeing a large file's blocks
    took 0.3 s per 2 GiB here, inside the unlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = -1  # a symlink, or gone: unlinking it frees nothing much
    try:
        os.unlink(path)
    except OSError:
        pass
    if fd >= 0:
        _close_on_helper(fd)


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _close_on_helper(fd: int) -> None:
    """Closes ``fd``, the last reference to a file already unlinked or
    replaced, on a helper thread: the close frees the file's blocks. Inside
    ``HeldFrees.holding()`` on this thread, the fd waits for the holder."""
    holder = getattr(_holding, "frees", None)
    if holder is not None:
        holder.fds.append(fd)
    else:
        _free_on_helper([fd])


def _free_on_helper(fds) -> None:
    thread = threading.Thread(target=_close_all, args=(fds,), name="offload-free-old", daemon=True)
    with _freeing_lock:
        _freeing.add(thread)
    thread.start()


def _close_all(fds) -> None:
    try:
        for fd in fds:
            os.close(fd)
    finally:
        with _freeing_lock:
            _freeing.discard(threading.current_thread())


def wait_for_frees() -> None:
    """Returns once every old file handed to a helper thread so far is
    freed (for benchmarks: a save's background frees must not land in the
    next contender's time)."""
    with _freeing_lock:
        threads = list(_freeing)
    for thread in threads:
        thread.join()


_holding = threading.local()          # .frees: the HeldFrees active on this thread
_freeing, _freeing_lock = set(), threading.Lock()  # the helper threads freeing old files


class HeldFrees:
    """The files an operation replaces or unlinks, freed when it is over.

    Freeing a large file's blocks is journal work; run beside the rest of a
    save it stalled the save's later fsyncs and renames (a DCP save of two
    files, 1 GiB: its metadata's commit 34-64 ms with the old files being
    freed, 1 ms after). Inside ``holding()`` the old files are unlinked as
    before but kept open here; ``release()`` closes them on a helper thread,
    which frees their blocks. So does garbage collection: disk space is never
    kept for good."""

    def __init__(self):
        self.fds = []

    @contextlib.contextmanager
    def holding(self):
        """Holds the frees this thread makes inside the block (those of a
        holder already active on this thread stay with that one)."""
        if getattr(_holding, "frees", None) is not None:
            yield
            return
        _holding.frees = self
        try:
            yield
        finally:
            _holding.frees = None

    def release(self) -> None:
        fds, self.fds = self.fds, []
        if fds:
            _free_on_helper(fds)

    def __reduce__(self):  # a copy, or a pickle, holds nothing: each fd is closed once
        return HeldFrees, ()

    def __del__(self):
        for fd in self.fds:  # here, not on a helper: (no threads at interpreter exit)
            os.close(fd)
        self.fds = []
