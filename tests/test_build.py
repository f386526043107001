"""CMakeLists.txt builds the same extension setup.py does (skipped without cmake)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cmake_works():
    if shutil.which("cmake") is None:
        return False
    return subprocess.run(["cmake", "--version"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _cmake_works(), reason="cmake is not installed")
def test_cmake_builds_a_working_extension(tmp_path):
    import pybind11
    build = tmp_path / "build"
    # Debug (-O0): the sources, definitions and liburing link are what is
    # tested, and bindings.cpp compiles in 14 s at -O0 against 23 at -O3.
    configure = subprocess.run(["cmake", "-S", ROOT, "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
                                f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", "-DCMAKE_BUILD_TYPE=Debug"],
                               capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", str(build), "-j2"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    (library,) = [p for p in os.listdir(build) if p.startswith("_core") and p.endswith(".so")]
    package = tmp_path / "pkg" / "offload"
    shutil.copytree(os.path.join(ROOT, "offload"), package,
                    ignore=shutil.ignore_patterns("_core*.so", "__pycache__"))
    shutil.copy(build / library, package / library)
    check = ("import tempfile, torch, offload\n"
             "off = offload.Offloader(tempfile.mkdtemp(dir=%r)); t = torch.randn(4097); e = t.clone()\n"
             "off.sync_write(t); off.sync_read(t); assert torch.equal(t, e)\n"
             "print(offload.__file__, offload._core.HAVE_URING, offload._core.URING_LINK)" % str(tmp_path))
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path / "pkg", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert str(package) in result.stdout
    from offload import _core
    assert result.stdout.split()[1:] == [str(_core.HAVE_URING), _core.URING_LINK]  # as setup.py built it


def _hidden_liburing_prefix():
    """A command prefix that runs its command where liburing's shared library
    cannot be loaded (bind-mounted over with /dev/null in a private mount
    namespace), or None when that needs what this machine lacks."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ldconfig") is None:
        return None
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    libraries = sorted({os.path.realpath(line.split("=>")[-1].strip())
                        for line in cache.splitlines() if "liburing.so" in line})
    hide = " && ".join(f"mount --bind /dev/null {path}" for path in libraries) or "true"
    return ["unshare", "--mount", "sh", "-c", f'{hide} && exec "$0" "$@"']


@pytest.mark.slow
def test_the_wheel_carries_io_uring_to_a_machine_without_liburing(tmp_path):
    """pip wheel, install into a clean venv, and an io_uring round trip where
    liburing's shared library cannot be loaded; auditwheel names the policy."""
    from offload import _core
    if not _core.HAVE_URING or _core.URING_LINK != "static":
        pytest.skip("this build links liburing dynamically or not at all (no liburing.a at build time)")
    prefix = _hidden_liburing_prefix()
    if prefix is None:
        pytest.skip("hiding liburing needs root and unshare")
    dist, venv = tmp_path / "dist", tmp_path / "venv"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), ROOT],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("offload-*.whl")
    import zipfile
    with zipfile.ZipFile(wheel) as z:  # type information travels with the module
        assert {"offload/_core.pyi", "offload/py.typed"} <= set(z.namelist())
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                                "-q", "--no-deps", str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    # The clean venv borrows torch and its dependencies from this one, through
    # a path file to a folder of links that leaves out every trace of offload.
    import torch
    (site,) = venv.glob("lib/python*/site-packages")
    ours = os.path.dirname(os.path.dirname(torch.__file__))
    borrowed = tmp_path / "borrowed"
    borrowed.mkdir()
    for name in os.listdir(ours):
        if not name.lower().startswith(("offload", "__editable__", "_offload")) and not name.endswith(".pth"):
            os.symlink(os.path.join(ours, name), borrowed / name)
    (site / "borrowed.pth").write_text(str(borrowed) + "\n")
    check = ("import ctypes, tempfile, torch, offload\n"
             "try:\n    ctypes.CDLL('liburing.so.2'); hidden = False\n"
             "except OSError:\n    hidden = True\n"
             "off = offload.Offloader(tempfile.mkdtemp(dir=%r), backend='uring'); t = torch.randn(1 << 20)\n"
             "e = t.clone(); off.sync_write(t); off.sync_read(t); off.close()\n"
             "print(offload.__file__, off.backend, torch.equal(t, e), hidden)" % str(tmp_path))
    result = subprocess.run([*prefix, str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    where, backend, same, hidden = result.stdout.split()
    assert where.startswith(str(site)) and backend == "uring" and same == "True" and hidden == "True"
    audit = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True)
    assert audit.returncode == 0, audit.stderr
    assert "manylinux_" in audit.stdout and "liburing" not in audit.stdout


def test_the_core_stub_lists_what_the_module_has():
    """offload/_core.pyi (for type checkers and readers) names exactly the
    module's public functions, constants and classes, and each class's
    public members."""
    import ast
    from offload import _core
    with open(os.path.join(ROOT, "offload", "_core.pyi")) as f:
        tree = ast.parse(f.read())
    stub, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stub.add(node.name)
        if isinstance(node, ast.AnnAssign):
            stub.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)
                                  and (not n.name.startswith("_") or n.name == "__init__")}
    public = {name for name in dir(_core) if not name.startswith("_")}
    assert stub == public
    for cls, names in members.items():
        actual = {name for name in vars(getattr(_core, cls)) if not name.startswith("_")}
        assert names - {"__init__"} == actual, cls
