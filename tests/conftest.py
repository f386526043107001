import asyncio
import contextlib
import errno
import fcntl
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from helpers.preloaded_python import PreloadedPython
from offload import Offloader, _core
from offload._atomic_file import wait_for_frees

ENGINES = ["uring", "threads"]

# A shell that starts the suite in the background (`make test &` in a script)
# leaves SIGINT ignored, and Python then installs no KeyboardInterrupt
# handler, here or in the interpreters the tests start: the Ctrl-C tests
# (test_lifecycle.py) could not interrupt anything. Python's handler goes back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


_PRELOADED = PreloadedPython()
run_python, popen_python = _PRELOADED.run, _PRELOADED.popen
"""``subprocess.run`` and ``subprocess.Popen`` for ``[sys.executable, ...]`` command lines, run in a
child of an interpreter that imported torch already (tests/helpers/
preloaded_python.py): most of the suite's child processes spent ~3 s of CPU
on ``import torch`` alone. Tests whose subject is a new interpreter's own
start or exit use ``subprocess.run``. OFFLOAD_TEST_FRESH_PROCESSES=1 gives
every command a new interpreter."""


@pytest.fixture(scope="session", autouse=True)
def preloaded_python():
    yield
    _PRELOADED.close()


def fused_adamw_on_cpu() -> bool:
    """Whether this torch has a fused AdamW kernel for CPU tensors (2.4 and later)."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, ValueError):  # earlier torch: fused kernels for GPUs only
        return False


@pytest.fixture(scope="session", autouse=True)
def main_thread_event_loop():
    """Python 3.9 only: an event loop set for the main thread for the whole
    session, and closed at its end. pytest-asyncio 1.2 (the last for 3.9)
    asks for the current loop around each asyncio test, which makes one
    implicitly when none was ever set; the next ``asyncio.run()`` drops that
    loop unclosed, and its garbage collection (ResourceWarning) failed
    whichever test was running."""
    if sys.version_info >= (3, 10):
        yield
        return
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    loop.close()


@contextlib.contextmanager
def _huge_pages_lock():
    with open(os.path.join(tempfile.gettempdir(), "offload-tests-huge-pages.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
def machine_huge_pages():
    """Held for the whole of a test that reserves huge pages or runs fio on
    them: vm.nr_hugepages is the machine's, and ``make test`` runs two
    pytest processes at once. One such test at a time, machine-wide."""
    with _huge_pages_lock():
        yield


@pytest.fixture(scope="module")
def module_huge_pages():
    """machine_huge_pages held once for a whole module of short tests: each
    test taking it in turn waited behind the other process's benchmark
    tests, a minute in all on a slow machine."""
    with _huge_pages_lock():
        yield


def uring_refusal():
    """Why io_uring cannot run in this process, or None if it can."""
    try:
        _core.make_uring_engine(8, 1 << 20, 8).close()
    except OSError as error:
        return f"io_uring unavailable here: {errno.errorcode.get(error.errno, error.errno)}"
    return None


def dcp_refusal():
    """Why offload.dcp cannot run with this torch (its own refusal at
    import), or None if it can."""
    try:
        importlib.import_module("offload.dcp")
    except ImportError as error:
        return str(error)
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


ENGINE_CONFIGS = [(e, d, 1) for e in ENGINES for d in (True, False)] + [("uring", True, 3)]


def engine_config_id(config):
    backend, direct, stripes = config
    return f"{backend}-{'direct' if direct else 'buffered'}" + (f"-striped{stripes}" if stripes > 1 else "")


@pytest.fixture(params=ENGINE_CONFIGS, ids=engine_config_id)
def engine_config(request, tmp_path):
    """Each engine, O_DIRECT and buffered, and a striped Offloader: three
    directories, 64 KiB units (small, so that small tensors cross them)."""
    backend, direct, stripes = request.param
    if backend == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    if direct and direct_refusal(str(tmp_path)):
        pytest.skip(direct_refusal(str(tmp_path)))
    config = {"backend": backend, "direct": direct}
    if stripes > 1:
        config["stripes"] = stripes
    return config


def offloader_for(config, tmp_path):
    """An Offloader as ``engine_config`` describes it, in ``tmp_path``."""
    config = dict(config)
    stripes = config.pop("stripes", 1)
    if stripes == 1:
        return Offloader(tmp_path, **config)
    directories = [tmp_path / f"stripe{i}" for i in range(stripes)]
    for d in directories:
        d.mkdir(exist_ok=True)
    return Offloader(directories, chunk_bytes=64 << 10, **config)


@pytest.fixture
def offloader(engine_config, tmp_path):
    off = offloader_for(engine_config, tmp_path)
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


def backing_fds(directory):
    """The descriptors this process holds on files in ``directory``, found
    through /proc (an Offloader's backing file has no name there: O_TMPFILE)."""
    directory = os.path.realpath(directory)
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if os.path.dirname(target) == directory:
            found.append(int(name))
    return found


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
def loop_fs(tmp_path):
    """loop_fs(mib): a new ext4 file system of ``mib`` MiB on a loop device,
    mounted for this test (all unmounted afterwards)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 for a loop mount")
    mounts = []

    def make(mib):
        image, mount = tmp_path / f"fs{len(mounts)}.img", tmp_path / f"mnt{len(mounts)}"
        mount.mkdir()
        with open(image, "wb") as f:
            f.truncate(mib << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        result = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"loop mount not possible here: {result.stderr.strip()}")
        mounts.append(mount)
        return mount
    yield make
    wait_for_frees()  # a save's old files, freed on a helper thread, would hold the mount busy
    for mount in mounts:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def tiny_fs(loop_fs):
    """A 16 MiB ext4 file system on a loop device."""
    return loop_fs(16)


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mount: a file system that refuses O_DIRECT."""
    if os.geteuid() != 0:
        pytest.skip("mounting ramfs needs root")
    mount = tmp_path / "ramfs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "ramfs", "none", str(mount)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount ramfs: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def train_twice(store, round_trip, numel):
    """Two backward passes over a leaf ``w`` and a tensor ``x`` that autograd
    saves, with ``round_trip(store, [w, x])`` between each forward and its
    backward (nothing, with ``store`` None). Returns w's gradient and how
    many times it was accumulated."""
    w0, x0, y = (torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(3))
    w, x = w0.clone().requires_grad_(), x0.clone()
    accumulated = []
    w.register_post_accumulate_grad_hook(lambda p: accumulated.append(1))
    for _ in range(2):
        z = (w * w).sum() + (w * x).sum()  # saves w and x
        if store is not None:
            versions = (w._version, x._version)
            round_trip(store, [w, x])
            assert (w._version, x._version) == versions  # bytes that came back are no change
        (z + (w * y).sum()).backward()        # w used again after its round trip: one accumulation
    return w.grad, len(accumulated)


def _each_alone(store, ts):
    for t in ts:
        store.sync_write(t)
        store.sync_read(t)


def _queued(store, ts):
    for t in ts:
        store.async_write(t)
        store.async_read(t)  # queued behind the write
    store.synchronize()


def _vector(store, ts):
    store.sync_writev(ts)
    store.sync_readv(ts)


def _vector_batched(store, ts):
    """``_vector`` in a call long enough for its storage swaps to run in one
    below-autograd batch (offload._tensors.storage_swaps)."""
    from offload._tensors import _SWAPS_BATCH_FROM
    _vector(store, ts + [torch.randn(256) for _ in range(_SWAPS_BATCH_FROM)])


def _discarded(store, ts):
    _vector(store, ts)
    for t in ts:
        store.discard(t)
    store.sync_readv(ts)


AUTOGRAD_ROUND_TRIPS = {"each-alone": _each_alone, "queued": _queued, "vector": _vector, "vector-batched": _vector_batched,
                        "discarded": _discarded}


def assert_no_change_to_autograd(store, round_trip, numel):
    """``train_twice`` with ``AUTOGRAD_ROUND_TRIPS[round_trip]`` through
    ``store`` gives, bit for bit, the gradient of a run that never offloaded,
    accumulated once per backward."""
    expected, expected_count = train_twice(None, None, numel)
    grad, count = train_twice(store, AUTOGRAD_ROUND_TRIPS[round_trip], numel)
    assert count == expected_count == 2
    assert same_bits(grad, expected)


def assert_the_base_goes_and_returns_with_its_view(store, round_trip, numel):
    """A view covering its whole storage, written through ``store`` while its
    base lives on (autograd saved the base): the base has no memory while
    the view is away, so a backward that saved it raises; once the view is
    back (then through ``AUTOGRAD_ROUND_TRIPS[round_trip]`` too) the base
    holds the same bytes, in the view's memory, and the backward runs."""
    w = torch.randn(numel, requires_grad=True)
    base = torch.randn(2, numel // 2)
    expected = base.clone()
    z = (w.view(2, -1) * base).sum()  # saves base itself
    t = base.view(-1)
    assert t._base is base
    store.sync_write(t)
    assert base.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward(retain_graph=True)
    store.sync_read(t)
    AUTOGRAD_ROUND_TRIPS[round_trip](store, [t])
    assert same_bits(base, expected) and same_bits(t, expected.view(-1))
    assert base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    z.backward()
    assert same_bits(w.grad, expected.view(-1))
