"""Builds offload._core. io_uring support needs liburing (pkg-config); without
it the extension is built with the thread-pool engine only, says so, and the
package warns at import. liburing's static library is linked in when it is
there (Debian's liburing-dev ships it), so a built wheel carries io_uring and
needs no liburing on the machine it is installed on; OFFLOAD_URING_SHARED=1
links the shared library instead."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

SOURCES = ["bindings.cpp", "buffer_pool.cpp", "device_copy.cpp", "dio_alignment.cpp", "engine.cpp",
           "fault_injector.cpp", "fork_guard.cpp", "thread_engine.cpp", "unmap_listeners.cpp"]


def pkg_config(*args):
    if shutil.which("pkg-config") is None:
        return None
    result = subprocess.run(["pkg-config", *args, "liburing"], capture_output=True, text=True)
    return result.stdout.split() if result.returncode == 0 else None


def static_liburing():
    """liburing.a beside the shared library pkg-config names, or None."""
    if os.environ.get("OFFLOAD_URING_SHARED") == "1":
        return None
    libdir = pkg_config("--variable=libdir")
    archive = Path(libdir[0]) / "liburing.a" if libdir else None
    return str(archive) if archive is not None and archive.exists() else None


def core_extension():
    sources = [f"csrc/{name}" for name in SOURCES]
    macros, cflags, libs = [], [], []
    uring_cflags, uring_libs = pkg_config("--cflags"), pkg_config("--libs")
    if uring_libs is not None:
        sources += ["csrc/uring_engine.cpp", "csrc/fixed_buffers.cpp"]
        cflags += uring_cflags or []
        archive = static_liburing()
        libs += [archive] if archive else uring_libs
        macros += [("OFFLOAD_HAVE_URING", "1"), ("OFFLOAD_URING_LINK", '"static"' if archive else '"shared"')]
    else:
        print("offload: liburing not found (pkg-config liburing); building the 'threads' "
              "engine only. Install liburing-dev for io_uring.", file=sys.stderr)
    return Pybind11Extension(
        "offload._core", sources, cxx_std=17, define_macros=macros,
        extra_compile_args=["-O2", "-Wall", "-Wextra", *cflags],
        extra_link_args=libs + ["-pthread"], depends=[str(p) for p in Path("csrc").glob("*.h")])


# The sources compile in parallel, one job per CPU (OFFLOAD_BUILD_JOBS=N to choose).
ParallelCompile("OFFLOAD_BUILD_JOBS", default=0).install()
setup(ext_modules=[core_extension()], cmdclass={"build_ext": build_ext})
