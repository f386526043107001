"""The C++ core's own tests (csrc/tests/core_test.cpp), built twice and run:
with AddressSanitizer + UndefinedBehaviorSanitizer, and with ThreadSanitizer
(which also reports lock-order inversions between engines and the pool).
No Python, no torch: the engines and the buffer pool on a real file."""
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["tests/core_test.cpp", "buffer_pool.cpp", "device_copy.cpp", "engine.cpp", "thread_engine.cpp",
           "fault_injector.cpp", "unmap_listeners.cpp"]
URING_SOURCES = ["uring_engine.cpp", "fixed_buffers.cpp"]
SANITIZERS = {"asan+ubsan": ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
              "tsan": ["-fsanitize=thread"]}


def _uring_flags():
    """Compiler and linker flags for liburing, or None without it."""
    if shutil.which("pkg-config") is None:
        return None
    probe = subprocess.run(["pkg-config", "--cflags", "--libs", "liburing"], capture_output=True, text=True)
    return probe.stdout.split() if probe.returncode == 0 else None


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("core_test")
    uring = _uring_flags()
    sources = SOURCES + (URING_SOURCES if uring is not None else [])
    extra = ["-DOFFLOAD_HAVE_URING=1", *uring] if uring is not None else []

    def build(name):
        binary = out / name.replace("+", "_")
        cmd = [compiler, "-std=c++17", "-O0", "-g", "-Wall", "-Wextra", "-Werror", *SANITIZERS[name],
               *[os.path.join(ROOT, "csrc", s) for s in sources], "-o", str(binary), *extra, "-lpthread"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
        return name, binary

    with ThreadPoolExecutor(len(SANITIZERS)) as pool:  # the two builds in parallel
        return dict(pool.map(build, SANITIZERS))


def _collapses_here():
    """MADV_COLLAPSE (Linux 6.1) with 2 MiB transparent huge pages for advised memory."""
    from offload import _pool
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= (6, 1) and 2048 in _pool.advised_page_sizes()


@pytest.mark.parametrize("sanitizer", sorted(SANITIZERS))
def test_core_passes_under_sanitizer(binaries, sanitizer, tmp_path):
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1", TSAN_OPTIONS="halt_on_error=1")
    # A deadlock between an engine and the pool would hang: the timeout fails it instead.
    result = subprocess.run([str(binaries[sanitizer]), str(tmp_path)], capture_output=True, text=True,
                            timeout=180, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Sanitizer" not in result.stderr, result.stderr
    assert "0 failed checks" in result.stdout
    assert "collapse: " in result.stdout
    if _collapses_here():
        assert "collapse: 0 blocks" not in result.stdout, result.stdout
    assert "threads engine: done" in result.stdout
    if _uring_flags() is not None:
        assert "uring engine:" in result.stdout


if sys.platform != "linux":  # the core is Linux-only (io_uring, O_DIRECT, MADV_FREE)
    pytestmark = pytest.mark.skip("Linux only")
