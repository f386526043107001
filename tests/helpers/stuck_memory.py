"""Memory whose first touch blocks until the test lets it go: a request that
reads into it is stuck in the kernel (its copy or its page pinning waits on
the fault) as one on a hung drive is, for any engine.

Built on userfaultfd: the pages are registered for missing-page faults and
nobody answers them; ``release()`` closes the userfaultfd, after which the
waiting faults resolve as plain anonymous memory and the stuck I/O goes on.
The mapping lives as long as the object: keep it while an engine given up
on may still finish its I/O into it.
"""
import ctypes
import fcntl
import mmap
import os
import platform
import struct

_NR_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
_UFFD_API = 0xAA
_UFFDIO_REGISTER_MODE_MISSING = 1


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


_UFFDIO_API = _iowr(0x3F, 24)       # struct uffdio_api {api, features, ioctls}
_UFFDIO_REGISTER = _iowr(0x00, 32)  # struct uffdio_register {start, len, mode, ioctls}


def refusal():
    """Why this machine cannot make stuck memory (None if it can)."""
    if _NR_USERFAULTFD is None:
        return f"no userfaultfd syscall number known for {platform.machine()}"
    try:
        StuckMemory(4096).release()
    except OSError as error:
        return f"userfaultfd: {error}"
    return None


class StuckMemory:
    def __init__(self, length: int):
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(_NR_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._fd = fd
        try:
            fcntl.ioctl(fd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, 0, 0)))
            self.map = mmap.mmap(-1, length)
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
            self.length = length
            fcntl.ioctl(fd, _UFFDIO_REGISTER,
                        bytearray(struct.pack("QQQQ", self.address, length, _UFFDIO_REGISTER_MODE_MISSING, 0)))
        except BaseException:
            os.close(fd)
            raise

    def release(self) -> None:
        """Lets every fault on the memory resolve (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self, n: int) -> bytes:
        """The first ``n`` bytes (call after release(): touching blocks before)."""
        return bytes(self.map[:n])
