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
them, and a ``__main__`` module of its own. It ends as a script ends
(_run_and_exit), except that its modules are not torn down. Several run at
once. What it does not get: a fresh ``import torch`` (state torch fixes at import
comes from the environment this process started with: the client sends
only commands whose environment differs from that one in OFFLOAD_ and
PYTEST_ variables alone).

Protocol, on stdin and stdout: one JSON line a request
(``{"argv", "cwd", "env", "stdout", "stderr"}``), answered by
``{"pid": N}`` once its child runs; ``{"pid": N, "status": S}`` (a wait
status) comes when that child ends, whatever ran meanwhile. End of stdin
ends this process.
"""
import atexit
import json
import locale
import os
import select
import shutil
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


def _report(**fields):
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
        sys.argv, sys.path[0] = list(rest), os.getcwd()  # (runpy puts the module's path in argv[0])
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
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:  # sys.exit("message"): printed, status 1
            print(stop.code, file=sys.stderr)
            status = 1
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
        os._exit(status & 0xFF)


def serve():
    """Forks a child for each request as it comes; reports each child's end
    as it happens (SIGCHLD wakes the loop), so that children run at once."""
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    pending, running = b"", set()
    while True:
        ready = select.select([0, wake_read], [], [])[0]
        if wake_read in ready:
            os.read(wake_read, 1 << 12)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            _report(pid=pid, status=status)
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)  # unbuffered: nothing meant for this process sits where a child inherits it
        if not data:
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                _run_and_exit(json.loads(line))
            running.add(pid)
            _report(pid=pid)


class PreloadedPython:
    """The test side: ``run`` and ``popen`` take what ``subprocess.run`` and
    ``subprocess.Popen`` take for a Python command line (the options the
    suite uses) and return what they return, running the command in a child
    of the preloaded process where they can, and in a new interpreter where
    they cannot (another program, interpreter flags, output not captured, an
    environment that differs in more than CHILD_ONLY variables, or
    OFFLOAD_TEST_FRESH_PROCESSES=1 in the suite's environment)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process = self._environment = None
        self._pending = b""
        self._ended = {}  # pid -> wait status, read while waiting for another child

    def run(self, args, *, capture_output=False, text=False, timeout=None, cwd=None, env=None, check=False):
        args = [os.fspath(a) for a in args]
        env = dict(os.environ if env is None else env)
        if not self._takes(args, capture_output, env):
            return subprocess.run(args, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd,
                                  env=env, check=check)
        child = _Child(self, args, cwd, env, text, merged=False)
        try:
            stdout, stderr = child.communicate(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, stderr = child.communicate(None)
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr) from None
        result = subprocess.CompletedProcess(args, child.returncode, stdout, stderr)
        if check:
            result.check_returncode()
        return result

    def popen(self, args, *, stdout=None, stderr=None, text=False, cwd=None, env=None):
        """A started child with ``communicate(timeout)``, ``wait(timeout)``,
        ``kill()`` and ``returncode``, as ``subprocess.Popen`` has them;
        for ``stdout=PIPE`` with ``stderr=PIPE`` or ``STDOUT``."""
        args = [os.fspath(a) for a in args]
        env = dict(os.environ if env is None else env)
        captured = stdout == subprocess.PIPE and stderr in (subprocess.PIPE, subprocess.STDOUT)
        if not self._takes(args, captured, env):
            return subprocess.Popen(args, stdout=stdout, stderr=stderr, text=text, cwd=cwd, env=env)
        return _Child(self, args, cwd, env, text, merged=stderr == subprocess.STDOUT)

    def close(self) -> None:
        """Ends the preloaded process (its stdin closed: it leaves its loop)."""
        with self._lock:
            if self._process is not None:
                self._end(kill=False)

    def _takes(self, args, captured, env) -> bool:
        if os.environ.get("OFFLOAD_TEST_FRESH_PROCESSES") == "1" or not captured or len(args) < 2:
            return False
        if args[0] != sys.executable or (args[1].startswith("-") and args[1] not in ("-c", "-m")):
            return False
        if args[1] in ("-c", "-m") and len(args) < 3:
            return False
        reference = self._environment if self._process is not None else os.environ
        keys = set(env) | set(reference)
        return all(k.startswith(CHILD_ONLY) for k in keys if env.get(k) != reference.get(k))

    def _start(self, request) -> int:
        """Sends ``request``; returns its child's pid."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._environment = dict(os.environ)
                self._process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, env=self._environment)
                self._pending, self._ended = b"", {}
            try:
                self._process.stdin.write((json.dumps(request) + "\n").encode())
                self._process.stdin.flush()
                while True:
                    answer = self._answer(None)
                    if "status" not in answer:
                        return answer["pid"]
                    self._ended[answer["pid"]] = answer["status"]
            except BaseException:
                self._end(kill=True)
                raise

    def _wait(self, pid, deadline):
        """``pid``'s wait status, or None at ``deadline``."""
        with self._lock:
            try:
                while pid not in self._ended:
                    answer = self._answer(deadline)
                    if answer is None:
                        return None
                    if "status" in answer:
                        self._ended[answer["pid"]] = answer["status"]
                return self._ended.pop(pid)
            except BaseException:  # (pytest-timeout's alarm, a broken pipe): start over next time
                self._end(kill=True)
                raise

    def _end(self, kill) -> None:
        """Ends the preloaded process: killed when its answers can no longer
        be matched to requests, else by closing its stdin."""
        if kill:
            self._process.kill()
        self._process.stdin.close()
        self._process.wait()
        self._process.stdout.close()
        self._process = None

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


class _Child:
    """One command running in a child of the preloaded process; its output
    goes to files in a scratch directory, read once it has ended."""

    def __init__(self, server, args, cwd, env, text, merged):
        self.args, self.returncode, self._server, self._text = args, None, server, text
        self._scratch = tempfile.mkdtemp(prefix="preloaded-")
        self._out = os.path.join(self._scratch, "stdout")
        self._err = self._out if merged else os.path.join(self._scratch, "stderr")
        for path in {self._out, self._err}:
            open(path, "wb").close()
        self.pid = server._start({"argv": args[1:], "cwd": os.path.abspath(cwd or os.getcwd()), "env": env,
                                  "stdout": self._out, "stderr": self._err})

    def wait(self, timeout=None):
        if self.returncode is None:
            status = self._server._wait(self.pid, None if timeout is None else time.monotonic() + timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) once the child has ended; stderr None when merged."""
        self.wait(timeout)
        stdout = self._read(self._out)
        stderr = None if self._err == self._out else self._read(self._err)
        shutil.rmtree(self._scratch, ignore_errors=True)
        return stdout, stderr

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _read(self, path):
        with open(path, "rb") as f:
            data = f.read()
        if not self._text:
            return data
        return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    if "offload" in sys.modules:  # children import offload themselves, under their own environment
        raise SystemExit("preloaded_python: importing torch imported offload")
    serve()
