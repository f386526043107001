"""The suite's preloaded interpreter (tests/helpers/preloaded_python.py)
runs a command line as a new interpreter does: the same program, run both
ways, gives the same exit status, output and last line of errors."""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import popen_python, run_python

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys

    def double(x):
        return 2 * x

    if __name__ == "__main__":
        print(os.path.basename(__file__), sys.argv[1:], sys.path[0] == os.path.dirname(__file__))
        with multiprocessing.get_context("spawn").Pool(1) as pool:   # re-imports this file as __mp_main__
            print(pool.map(double, [1, 2]))
""")

PROGRAMS = {
    "argv, path, cwd, environment": ("-c", "import os, sys; print(sys.argv, repr(sys.path[0]), os.getcwd(), "
                                     "__name__, os.environ.get('OFFLOAD_PROBE')); sys.exit(3)", "a", "b"),
    "a module": ("-m", "offload"),
    "an uncaught error": ("-c", "raise ValueError('boom')"),
    "an uncaught KeyboardInterrupt": ("-c", "raise KeyboardInterrupt"),
    "exit with a message": ("-c", "import sys; sys.exit('no good')"),
    "os._exit": ("-c", "import os; print('x', flush=True); os._exit(7)"),
    "threads joined, then atexit": ("-c", "import atexit, threading, time; atexit.register(print, 'atexit'); "
                                    "threading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()"),
}


def _both_ways(args, **options):
    fresh = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **options)
    preloaded = run_python([sys.executable, *args], capture_output=True, text=True, timeout=120, **options)
    return fresh, preloaded


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_command_runs_as_in_a_new_interpreter(tmp_path, name):
    fresh, preloaded = _both_ways(PROGRAMS[name], cwd=tmp_path, env=dict(os.environ, OFFLOAD_PROBE="seen"))
    assert preloaded.returncode == fresh.returncode
    assert preloaded.stdout == fresh.stdout
    assert preloaded.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]


def test_a_script_runs_as_main_and_spawns_children_that_import_it(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    fresh, preloaded = _both_ways([str(script), "x"])
    assert fresh.returncode == preloaded.returncode == 0, preloaded.stderr
    assert preloaded.stdout == fresh.stdout == "script.py ['x'] True\n[2, 4]\n"


def test_a_command_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([sys.executable, "-c", "import time; time.sleep(60)"], capture_output=True, timeout=1)
    done = run_python([sys.executable, "-c", "print('next')"], capture_output=True, text=True, timeout=60)
    assert done.stdout == "next\n"


@pytest.mark.skipif(os.environ.get("OFFLOAD_TEST_FRESH_PROCESSES") == "1",
                    reason="OFFLOAD_TEST_FRESH_PROCESSES=1: every command gets a new interpreter")
def test_torch_is_preloaded_only_where_the_environment_allows():
    probe = [sys.executable, "-c", "import sys; print('torch' in sys.modules)"]
    same = run_python(probe, capture_output=True, text=True, timeout=120,
                      env=dict(os.environ, OFFLOAD_HUGE_PAGES="all"))
    other = run_python(probe, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))   # read by what torch loads, at load
    assert (same.stdout, other.stdout) == ("True\n", "False\n")


def test_children_run_at_once(tmp_path):
    """Two children that each wait for the other's file: run one after the
    other, the first would time out."""
    meet = ("import os, sys, time\n"
            "open(os.path.join(sys.argv[1], sys.argv[2]), 'w').close()\n"
            "deadline = time.monotonic() + 30\n"
            "while not os.path.exists(os.path.join(sys.argv[1], sys.argv[3])):\n"
            "    assert time.monotonic() < deadline, 'alone'\n"
            "    time.sleep(0.01)\n"
            "print('met', sys.argv[2])")
    children = [popen_python([sys.executable, "-c", meet, str(tmp_path), mine, other], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for mine, other in (("a", "b"), ("b", "a"))]
    assert [child.communicate(timeout=60) for child in reversed(children)] == [("met b\n", None), ("met a\n", None)]
    assert [child.returncode for child in children] == [0, 0]
