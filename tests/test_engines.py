"""Engine choice: io_uring blocked for real (seccomp), fallback with a warning."""
import errno
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
from conftest import run_python

BLOCKED = textwrap.dedent("""
    import ctypes, json, sys, warnings
    code = int(sys.argv[2])
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    ctx = ctypes.c_void_p(lib.seccomp_init(ctypes.c_uint32(0x7FFF0000)))       # allow by default
    nr = lib.seccomp_syscall_resolve_name(b"io_uring_setup")
    assert lib.seccomp_rule_add(ctx, ctypes.c_uint32(0x00050000 | code), nr, 0) == 0  # ...but not this
    assert lib.seccomp_load(ctx) == 0
    import torch
    from offload import Offloader
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Offloader(sys.argv[1], backend="auto") as off:
            t = torch.arange(1000.0)
            off.sync_write(t); off.sync_read(t)
            out["backend"], out["ok"] = off.backend, bool(torch.equal(t, torch.arange(1000.0)))
        with Offloader(sys.argv[1], backend="auto") as off:
            pass
    out["warnings"] = [str(w.message) for w in caught]
    try:
        Offloader(sys.argv[1], backend="uring")
    except OSError as error:
        out["uring_errno"], out["uring_error"] = error.errno, str(error)
    print(json.dumps(out))
""")


def _have_libseccomp():
    import ctypes.util
    return ctypes.util.find_library("seccomp") is not None


@pytest.mark.skipif(not _have_libseccomp(), reason="libseccomp is not installed")
@pytest.mark.parametrize("code, words", [(errno.EPERM, "EPERM"), (errno.ENOSYS, "ENOSYS")])
def test_blocked_io_uring_falls_back_to_threads_with_one_warning(tmp_path, code, words):
    result = run_python([sys.executable, "-c", BLOCKED, str(tmp_path), str(code)],
                        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["backend"] == "threads" and out["ok"]
    assert len(out["warnings"]) == 1                 # probed once per process
    assert words in out["warnings"][0] and "threads" in out["warnings"][0]
    assert out["uring_errno"] == code and words in out["uring_error"]


LOW_MEMLOCK = textwrap.dedent("""
    import sys, warnings, torch
    from offload import Offloader
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Offloader(sys.argv[1], backend="uring") as off:
            ts = [torch.randn(1 << 20) for _ in range(4)]
            expected = [t.clone() for t in ts]
            off.sync_writev(ts); off.sync_readv(ts); off.sync_writev(ts); off.sync_readv(ts)
            ok = all(torch.equal(a, b) for a, b in zip(ts, expected))
            registered = off.registered_buffers
    print(json.dumps({"ok": ok, "registered": registered, "warnings": [str(w.message) for w in caught]}))
""").replace("import sys,", "import json, sys,")


def test_rlimit_memlock_too_low_for_fixed_buffers_is_not_an_error(tmp_path):
    import os
    import shutil
    from conftest import uring_refusal
    if uring_refusal():
        pytest.skip(uring_refusal())
    if os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("prlimit")):
        pytest.skip("needs root, setpriv and prlimit to drop CAP_IPC_LOCK and lower RLIMIT_MEMLOCK")
    command = ["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock",
               "prlimit", "--memlock=65536", sys.executable, "-c", LOW_MEMLOCK, str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["registered"] == 0
    assert len(out["warnings"]) == 1 and "RLIMIT_MEMLOCK" in out["warnings"][0]


def test_a_build_without_io_uring_warns_at_import_once():
    from offload._engines import warn_if_built_without_uring
    with pytest.warns(RuntimeWarning, match="this build has no io_uring .* Install liburing-dev"):
        warn_if_built_without_uring(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_built_without_uring(True)    # a build with io_uring says nothing
