"""A Python process that has imported torch and forks, for each command line
the suite sends it, a child that runs that command as a fresh interpreter
would (``python -c CODE ARGS``, ``python -m MODULE ARGS``, ``python SCRIPT
ARGS``). A child starts in milliseconds instead of the ~3 s of CPU an
``import torch`` costs on the development machines, which most of the
suite's child processes spent before doing anything else.

What a child gets: its own pid and memory (a fork of this process, which
imported torch and nothing of offload), the working directory and
environment asked for, stdin from /dev/null, stdout and stderr into the
files named, ``sys.argv`` and ``sys.path[0]`` as the interpreter would set
them, and a ``__main__`` module of its own. It ends as a script does: an
exception it does not catch (SystemExit, KeyboardInterrupt) leaves through
the interpreter's own exit path, atexit handlers and thread joins included.
What it does not get: a fresh ``import torch`` (state torch fixes at import
comes from the environment this process started with: the client sends
only commands whose environment differs from that one in OFFLOAD_ and
PYTEST_ variables alone).

Protocol, on stdin and stdout: one JSON line a request
(``{"argv", "cwd", "env", "stdout", "stderr"}``), answered by
``{"pid": N}`` once the child runs and ``{"status": S}`` (a wait status)
once it has ended. End of stdin ends this process.
"""
import atexit
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

import torch  # noqa: F401  (what every child is spared)

# Variables a child may have that the preloaded process did not: nothing it
# imported reads them (offload is imported by the child itself).
CHILD_ONLY = ("OFFLOAD_", "PYTEST_")


def _requests():
    """Requests read from fd 0 unbuffered, so that nothing meant for this
    process sits in a buffer a child inherits."""
    pending = b""
    while True:
        while b"\n" not in pending:
            data = os.read(0, 1 << 16)
            if not data:
                return
            pending += data
        line, pending = pending.split(b"\n", 1)
        yield json.loads(line)


def _answer(**fields):
    os.write(1, (json.dumps(fields) + "\n").encode())


def _become(request):
    """In the child: take the place of ``python ARGV`` and run it."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    flag, *rest = request["argv"]
    if flag == "-m":
        import runpy
        sys.argv, sys.path[0] = [rest[0], *rest[1:]], os.getcwd()
        runpy._run_module_as_main(rest[0])
        return
    main = types.ModuleType("__main__")
    main.__spec__ = None
    if flag == "-c":
        sys.argv, sys.path[0] = ["-c", *rest[1:]], ""
        source, filename = rest[0], "<string>"
    else:
        sys.argv = [flag, *rest]
        filename = main.__file__ = os.path.abspath(flag)
        sys.path[0] = os.path.dirname(filename)
        with open(filename, "rb") as f:
            source = f.read()
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec"), main.__dict__)


def _run_and_exit(request):
    """Runs the command and ends the child as the interpreter ends a script
    (the traceback of what it did not catch, or SystemExit's status;
    non-daemon threads joined, atexit handlers run, output flushed), but
    without tearing down the modules: with torch loaded that took ~1 s of
    CPU, most of what a child would otherwise cost."""
    status, interrupted = 0, False
    try:
        _become(request)
    except SystemExit as stop:
        status = stop.code if stop.code is None or isinstance(stop.code, int) else 1
        if not (stop.code is None or isinstance(stop.code, int)):
            print(stop.code, file=sys.stderr)
    except BaseException as error:
        interrupted = isinstance(error, KeyboardInterrupt)
        sys.excepthook(type(error), error, error.__traceback__)
        status = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if interrupted:  # as the interpreter leaves on an uncaught KeyboardInterrupt: killed by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit((status or 0) & 0xFF)


def serve():
    for request in _requests():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_and_exit(request)
        _answer(pid=pid)
        _, status = os.waitpid(pid, 0)
        _answer(status=status)


class PreloadedPython:
    """The test side: ``run`` takes what ``subprocess.run`` takes for a
    Python command line and returns what it returns, running the command in
    a child of the preloaded process where it can, and in a new interpreter
    where it cannot (another program, interpreter flags, no output capture,
    an environment that differs in more than CHILD_ONLY variables, or
    OFFLOAD_TEST_FRESH_PROCESSES=1 in the suite's environment)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process = self._environment = None
        self._pending = b""

    def run(self, args, *, capture_output=False, text=False, timeout=None, cwd=None, env=None, check=False):
        args = [os.fspath(a) for a in args]
        env = dict(os.environ if env is None else env)
        if not self._takes(args, capture_output, env):
            return subprocess.run(args, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd,
                                  env=env, check=check)
        with self._lock, tempfile.TemporaryDirectory(prefix="preloaded-") as scratch:
            out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
            for path in (out, err):
                open(path, "wb").close()
            status, timed_out = self._run_child(args[1:], os.path.abspath(cwd or os.getcwd()), env, out, err,
                                                timeout)
            stdout, stderr = (self._output(path, text) for path in (out, err))
        if timed_out:
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
        result = subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), stdout, stderr)
        if check:
            result.check_returncode()
        return result

    def close(self) -> None:
        """Ends the preloaded process (its stdin closed: it leaves its loop)."""
        with self._lock:
            if self._process is not None:
                self._process.stdin.close()
                self._process.wait()
                self._process.stdout.close()
                self._process = None

    def _takes(self, args, capture_output, env) -> bool:
        if os.environ.get("OFFLOAD_TEST_FRESH_PROCESSES") == "1" or not capture_output or len(args) < 2:
            return False
        if args[0] != sys.executable or (args[1].startswith("-") and args[1] not in ("-c", "-m")):
            return False
        if args[1] in ("-c", "-m") and len(args) < 3:
            return False
        reference = self._environment if self._process is not None else os.environ
        keys = set(env) | set(reference)
        return all(k.startswith(CHILD_ONLY) for k in keys if env.get(k) != reference.get(k))

    def _run_child(self, argv, cwd, env, out, err, timeout):
        """(wait status, whether it was killed at ``timeout``)."""
        if self._process is None or self._process.poll() is not None:
            self._environment = dict(os.environ)
            self._process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, env=self._environment)
            self._pending = b""
        pid = None
        try:
            request = {"argv": argv, "cwd": cwd, "env": env, "stdout": out, "stderr": err}
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
            pid = self._answer(None)["pid"]
            answer = self._answer(None if timeout is None else time.monotonic() + timeout)
            if answer is not None:
                return answer["status"], False
            os.kill(pid, signal.SIGKILL)
            return self._answer(None)["status"], True
        except BaseException:  # (pytest-timeout's alarm, a broken pipe): start over next time
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._process.kill()
            self._process.wait()
            self._process.stdin.close()
            self._process.stdout.close()
            self._process = None
            raise

    def _answer(self, deadline):
        """The next JSON line from the preloaded process, or None at ``deadline``."""
        fd = self._process.stdout.fileno()
        while b"\n" not in self._pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            data = os.read(fd, 1 << 16)
            if not data:
                raise RuntimeError(f"the preloaded interpreter exited ({self._process.wait()})")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    @staticmethod
    def _output(path, text):
        with open(path, "rb") as f:
            data = f.read()
        if not text:
            return data
        return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    if "offload" in sys.modules:  # children import offload themselves, under their own environment
        raise SystemExit("preloaded_python: importing torch imported offload")
    serve()
