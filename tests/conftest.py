import errno
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from offload import Offloader, _core

ENGINES = ["uring", "threads"]


def uring_refusal():
    """Why io_uring cannot run in this process, or None if it can."""
    try:
        _core.make_uring_engine(8, 1 << 20, 8).close()
    except OSError as error:
        return f"io_uring unavailable here: {errno.errorcode.get(error.errno, error.errno)}"
    return None


def direct_refusal(directory):
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as error:
        return f"no O_DIRECT in {directory}: {error}"
    return None


@pytest.fixture(params=ENGINES)
def disk(request, tmp_path):
    """An Offloader on a directory of its own, once per engine."""
    if request.param == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    with Offloader(tmp_path, backend=request.param) as off:
        yield off


@pytest.fixture(params=[(e, d) for e in ENGINES for d in (True, False)],
                ids=lambda p: f"{p[0]}-{'direct' if p[1] else 'buffered'}")
def engine_config(request, tmp_path):
    backend, direct = request.param
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    if direct and direct_refusal(str(tmp_path)):
        pytest.skip(direct_refusal(str(tmp_path)))
    return {"backend": backend, "direct": direct}


@pytest.fixture
def offloader(engine_config, tmp_path):
    off = Offloader(tmp_path, **engine_config)
    assert off.backend == engine_config["backend"]
    assert off.direct == engine_config["direct"]
    yield off
    off.close()


def random_tensor(shape, dtype, generator=None):
    """Random bits of any dtype (every bit pattern, NaNs included)."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def same_bits(a, b):
    """Bit-for-bit equality (NaN payloads included), shape and dtype too."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)) \
        if a.numel() else True


class OtherThreadTicks:
    """Counts how often another Python thread gets to run while the block runs:
    a call that holds the GIL leaves it near zero."""

    def __enter__(self):
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin)
        self._thread.start()
        time.sleep(0.05)
        self._before = self.ticks
        return self

    def _spin(self):
        while not self._stop.is_set():
            self.ticks += 1
            time.sleep(0)

    def __exit__(self, *exc):
        self.during = self.ticks - self._before
        self._stop.set()
        self._thread.join()


class LoopTicks:
    """``async with LoopTicks() as ticks``: counts the turns other tasks of the
    event loop got while the block ran (``ticks.count``)."""

    async def __aenter__(self):
        import asyncio
        self.count = 0

        async def spin():
            while True:
                self.count += 1
                await asyncio.sleep(0)

        self._task = asyncio.get_running_loop().create_task(spin())
        return self

    async def __aexit__(self, *exc):
        self._task.cancel()


@pytest.fixture
def tiny_fs(tmp_path):
    """A 16 MiB ext4 file system on a loop device."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 for a loop mount")
    image, mount = tmp_path / "fs.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    result = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"loop mount not possible here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
