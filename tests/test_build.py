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
    configure = subprocess.run(["cmake", "-S", ROOT, "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
                                f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"], capture_output=True, text=True)
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
             "print(offload.__file__, offload._core.HAVE_URING)" % str(tmp_path))
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path / "pkg", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert str(package) in result.stdout
