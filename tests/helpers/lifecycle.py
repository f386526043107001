"""Lifecycle scenarios, each run in its own process by tests/test_lifecycle.py
(under a deadline, so that a hang fails instead of stalling the suite).
Each prints one JSON line with what it saw.

    python lifecycle.py close-race DIR BACKEND THREADS MODE   (MODE: async, flood, sync, asyncio, pinned, device)
    python lifecycle.py close-interrupted DIR BACKEND
    python lifecycle.py fork DIR BACKEND NAMED IN_FLIGHT
    python lifecycle.py dataloader DIR BACKEND START_METHOD
    python lifecycle.py interrupts DIR BACKEND HOW COUNT      (HOW: timer, trace, trace-async,
                                                               trace-unprotected, trace-device)
"""
import asyncio
import gc
import json
import os
import signal
import sys
import threading
import time
import warnings

import torch

import offload
import offload._engines
from offload import Offloader, OffloaderClosedError, OffloaderForkedError


def report(**fields):
    print(json.dumps(fields), flush=True)


def pattern(i, n):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ------------------------------------------------------------------ close
def close_race(directory, backend, threads, mode):
    """``threads`` threads keep issuing on one Offloader; the main thread
    closes it. Every thread must end with OffloaderClosedError, close() must
    return, and no other error may appear."""
    if mode == "pinned":
        from offload.devices import LateCopyDevice
        off = Offloader(None, device=LateCopyDevice(seed=3, max_delay=0.0005))
    elif mode == "device":  # the GPU tier's staging pipeline, on the test device
        from offload.devices import LateCopyDevice
        off = Offloader(directory, backend=backend, device=LateCopyDevice(seed=3, max_delay=0.0005))
    else:
        off = Offloader(directory, backend=backend)
    started = threading.Barrier(threads + 1)
    outcomes, operations = [], [0] * threads

    def run_sync(k, ts):
        while True:
            for t in ts:
                off.sync_write(t)
                off.sync_read(t)
                operations[k] += 2

    def run_async(k, ts):
        while True:
            handles = []
            for t in ts:
                handles.append(off.async_write(t, callback=lambda: None))
                handles.append(off.async_read(t))
                operations[k] += 2
            handles[-1].wait()

    def run_asyncio(k, ts):
        async def loop():
            while True:
                for t in ts:
                    await off.write(t)
                    await off.read(t)
                    operations[k] += 2
        asyncio.run(loop())

    def run_flood(k, ts):  # fire and forget, never waiting
        while True:
            for t in ts:
                off.async_write(t)
                off.async_read(t)
                operations[k] += 2

    body = {"sync": run_sync, "async": run_async, "asyncio": run_asyncio, "pinned": run_async,
            "device": run_async, "flood": run_flood}[mode]

    def worker(k):
        ts = [pattern(k * 10 + j, 256 << 10).view(torch.float32).clone() for j in range(3)]
        started.wait()
        try:
            body(k, ts)
        except OffloaderClosedError:
            outcomes.append("closed")
        except BaseException as error:  # anything else is a defect
            outcomes.append(f"{type(error).__name__}: {error}")

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    started.wait()
    time.sleep(0.3)
    begin = time.monotonic()
    off.close()
    close_s = time.monotonic() - begin
    for w in workers:
        w.join(30)
    try:
        off.async_write(torch.ones(4))
        after = "admitted"
    except OffloaderClosedError as error:
        after = str(error)
    report(close_s=close_s, outcomes=outcomes, alive=sum(w.is_alive() for w in workers),
           operations=sum(operations), after_close=after, files=sorted(os.listdir(directory)))


def await_write_on_a_thread(off, t):
    """Starts awaiting ``off.write(t)`` on another thread's event loop and
    returns once the await is registered: the thread, and a list that gets
    what the await saw ("written", or "refused": OffloaderClosedError)."""
    outcome, registered = [], threading.Event()

    def awaiting():
        async def write():
            try:
                await off.write(t)
                outcome.append("written")
            except OffloaderClosedError:
                outcome.append("refused")

        async def main():
            task = asyncio.ensure_future(write())
            await asyncio.sleep(0)  # the task has run up to its await of the handle
            registered.set()
            await task
        asyncio.run(main())

    thread = threading.Thread(target=awaiting)
    thread.start()
    registered.wait(10)
    return thread, outcome


def close_interrupted(directory, backend):
    """An await is pending when close() starts, and close() is interrupted
    (SIGINT) before its drain ends: close() raises the KeyboardInterrupt, and
    the await gets OffloaderClosedError instead of hanging."""
    off = Offloader(directory, backend=backend)
    off.inject_faults(delay_rate=1.0, delay_ms=3000)  # the write stays in flight through close()
    thread, outcome = await_write_on_a_thread(off, torch.randn(1 << 16))
    threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    interrupted = False
    try:
        off.close()
    except KeyboardInterrupt:
        interrupted = True
    thread.join(10)
    report(interrupted=interrupted, outcome=outcome, hung=thread.is_alive())
    os._exit(0)  # a hung await's thread would keep the process alive


def close_given_up(directory, backend):
    """A write whose completion never comes (held back for 10 minutes) and
    two interrupts: the first ends close()'s drain, the second the engine's
    own wait. close() raises within seconds, the engine is given up with the
    write's memory kept, the Offloader is closed, a second close() returns,
    and the await is refused, not hung."""
    off = Offloader(directory, backend=backend)
    off.inject_faults(delay_rate=1.0, delay_ms=600_000)
    t = torch.randn(1 << 16)
    thread, outcome = await_write_on_a_thread(off, t)
    main = threading.main_thread().ident
    for at in (0.3, 1.0):
        threading.Timer(at, signal.pthread_kill, (main, signal.SIGINT)).start()
    given_up, started, interrupted = offload._core.abandoned_engines(), time.monotonic(), False
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            off.close()
        except KeyboardInterrupt:
            interrupted = True
    took = time.monotonic() - started
    kept = [entry for entry in offload._engines._kept_for_good]
    again = time.monotonic()
    off.close()
    thread.join(10)
    report(interrupted=interrupted, took=took, given_up=offload._core.abandoned_engines() - given_up,
           kept=len(kept), kept_the_write=[len(pending) for _, pending, _ in kept] == [1],
           closed=off.closed, second_close=time.monotonic() - again, outcome=outcome, hung=thread.is_alive(),
           emptied=t.untyped_storage().nbytes() == 0, warned=[str(w.message) for w in warned])
    os._exit(0)


# ------------------------------------------------------------------- fork
def fork(directory, backend, named, in_flight):
    """Data written before a fork, the child tries the inherited Offloader
    (and the raw engine) and exits normally; the parent must keep working
    with all of its data."""
    if named:
        import offload._backing_file as backing_file
        backing_file.try_tmpfile = False
    off = Offloader(directory, backend=backend)
    tensors = [pattern(i, (1 << 20) + 4096 * i).view(torch.uint8).clone() for i in range(8)]
    expected = [t.clone() for t in tensors]
    off.sync_writev(tensors[:4])
    if in_flight:  # writes and reads in flight at the fork
        off.async_writev(tensors[4:])
        off.async_readv(tensors[:4])
    engine = offload._core.make_thread_engine(2, 1 << 20, 8)
    off.inject_faults(delay_rate=1.0, delay_ms=300)  # a handle still pending at the fork
    pending = off.async_write(torch.ones(1 << 16))
    pending.done()                                    # reaped by the engine, held back
    off.inject_faults()
    pid = os.fork()
    if pid == 0:
        seen = {}
        for name, call in [("sync_read", lambda: off.sync_read(tensors[0])),
                           ("async_write", lambda: off.async_write(torch.ones(1024))),
                           ("synchronize", off.synchronize),
                           ("pending handle done", pending.done),
                           ("raw engine reap", engine.reap)]:
            try:
                call()
                seen[name] = "worked"
            except OffloaderForkedError as error:
                seen[name] = "forked: " + str(error)
            except RuntimeError as error:
                seen[name] = "refused: " + str(error)
        off.close()        # a no-op in the child
        engine.close()     # leaked, never drained: its threads are the parent's
        del off, engine
        gc.collect()
        with open(os.path.join(directory, "child.json"), "w") as f:
            json.dump(seen, f)
        sys.exit(0)        # a normal exit: atexit handlers and finalizers run
    _, status = os.waitpid(pid, 0)
    off.synchronize()
    pending_done = pending.done()
    off.sync_readv([t for t in tensors if t.untyped_storage().nbytes() == 0])
    intact = all(torch.equal(t, e) for t, e in zip(tensors, expected))
    off.sync_writev(tensors)  # the parent's ring and file keep working
    off.sync_readv(tensors)
    intact_after = all(torch.equal(t, e) for t, e in zip(tensors, expected))
    engine.close()
    files_open = len([n for n in os.listdir(directory) if n.endswith(".swap")])
    off.close()
    with open(os.path.join(directory, "child.json")) as f:
        child = json.load(f)
    report(child_status=status, child=child, intact=intact, intact_after=intact_after, pending_done=pending_done,
           named_files_while_open=files_open, files_after=sorted(n for n in os.listdir(directory)
                                                                 if n != "child.json"))


# ------------------------------------------------------------- dataloader
class WorkerOwnDataset(torch.utils.data.Dataset):
    """Each worker process makes its own Offloader, lazily."""

    def __init__(self, directory, backend):
        self.directory, self.backend, self.off, self.pid = directory, backend, None, None

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if self.off is None or self.pid != os.getpid():
            self.off, self.pid = Offloader(self.directory, backend=self.backend), os.getpid()
        t = pattern(i, 64 << 10)
        expected = int(t.sum())
        self.off.sync_write(t)
        self.off.sync_read(t)
        return torch.tensor([int(t.sum()), expected])


class ParentsOffloaderDataset(torch.utils.data.Dataset):
    """Uses the parent's Offloader: refused in any worker."""

    def __init__(self, off):
        self.off = off

    def __len__(self):
        return 2

    def __getitem__(self, i):
        t = torch.ones(1024)
        self.off.sync_write(t)
        return t


def dataloader(directory, backend, method):
    off = Offloader(directory, backend=backend)
    kept = [pattern(50 + i, 1 << 20) for i in range(4)]
    expected = [t.clone() for t in kept]
    off.sync_writev(kept)
    loader = torch.utils.data.DataLoader(WorkerOwnDataset(directory, backend), batch_size=2, num_workers=2,
                                         multiprocessing_context=method)
    batches = [b.tolist() for b in loader]
    sums_match = all(got == want for batch in batches for got, want in batch)
    try:
        list(torch.utils.data.DataLoader(ParentsOffloaderDataset(off), num_workers=1,
                                         multiprocessing_context=method))
        parents = "worked"
    except Exception as error:
        parents = f"{type(error).__name__}: {error}"
    context = torch.multiprocessing.get_context(method)
    results = context.Queue()
    own = context.Process(target=own_offloader_process, args=(directory, backend, results))
    own.start()
    own.join(120)
    process_own = results.get(timeout=10) if own.exitcode == 0 else f"exit {own.exitcode}"
    try:
        given = context.Process(target=parents_offloader_process, args=(off, results))
        given.start()
        given.join(120)
        process_parents = results.get(timeout=10) if given.exitcode == 0 else f"exit {given.exitcode}"
    except Exception as error:
        process_parents = f"{type(error).__name__}: {error}"
    off.sync_readv(kept)
    intact = all(torch.equal(t, e) for t, e in zip(kept, expected))
    off.close()
    report(items=sum(len(b) for b in batches), sums_match=sums_match, parents=parents, intact=intact,
           process_own=process_own, process_parents=process_parents)


def own_offloader_process(directory, backend, results):
    """A torch.multiprocessing process that makes its own Offloader."""
    # torch's OpenMP pool does not survive fork: a forked child must use one
    # thread, as DataLoader workers do (a parallel clone hangs otherwise).
    torch.set_num_threads(1)
    with Offloader(directory, backend=backend) as off:
        t = pattern(7, 1 << 20)
        e = t.clone()
        off.sync_write(t)
        off.sync_read(t)
        results.put("round trip ok" if torch.equal(t, e) else "wrong bytes")


def parents_offloader_process(off, results):
    """A torch.multiprocessing process handed the parent's Offloader."""
    try:
        off.sync_write(torch.ones(1024))
        results.put("worked")
    except Exception as error:
        results.put(f"{type(error).__name__}: {error}")


# ------------------------------------------------------------- interrupts
def settle_held_signals():
    """Lets a signal that offload held (it is sent again from a timer thread,
    a millisecond later) land here, inside the trial, even when the machine is
    busy and the timer thread runs late."""
    from offload import _signals
    time.sleep(0.005)
    deadline = time.monotonic() + 2
    while _signals._redelivering and time.monotonic() < deadline:
        time.sleep(0.005)
    if _signals._held_since:
        time.sleep(0.05)  # sent again just now: give the handler its turn


def hung(trial, phase, phases, bad):
    """Called when a trial's check has not finished in 10 s: an operation was
    lost. Reports it (with where every thread is) and ends the process."""
    import faulthandler
    faulthandler.dump_traceback(sys.stderr)
    report(hung=f"trial {trial} ({phase}): synchronize or a read never returned", phases=phases,
           bad=bad[:20], bad_count=len(bad) + 1)
    os._exit(3)


def interrupts(directory, backend, how, count):
    """Interrupts land in sync_writev / sync_readv / synchronize; afterwards
    every tensor must be resident and writable, or released and readable,
    with its bytes. ``timer``: SIGINT from another thread after a swept delay.
    ``trace``: SIGINT raised at the n-th line executed inside offload, for
    every n (sweeping each bookkeeping step). ``trace-unprotected`` does the
    same with the protection turned off, to show the check catches the
    defect it guards against. ``trace-device``: ``trace`` through the GPU
    tier's staging pipeline on the test device. ``trace-async``: ``trace``
    over async_writev + async_readv + synchronize(), so that most of the
    round (and of the interrupts) is inside synchronize()."""
    from offload import _signals
    if how == "trace-device":  # the GPU tier's staging pipeline, on the test device
        from offload.devices import LateCopyDevice
        off = Offloader(directory, backend=backend, device=LateCopyDevice(seed=5, max_delay=0.0005))
    else:
        off = Offloader(directory, backend=backend)
    # Unequal sizes past the in-place limit. The line sweeps move 256 KiB
    # tensors: they run the same lines as larger ones, in less I/O time. The
    # GPU pipeline keeps 1 MiB: with less, its held signals land after the call.
    # The timer needs rounds long enough to land in: 4 MiB.
    size = {"timer": 4 << 20, "trace-device": 1 << 20}.get(how, 256 << 10)
    sizes = [size if how == "timer" else size + 4096 * (i % 3) for i in range(24)]
    tensors = [pattern(i, n) for i, n in enumerate(sizes)]
    expected = [t.clone() for t in tensors]
    if how == "trace-unprotected":
        _signals._held = lambda frame: False
    main = threading.main_thread().ident
    phases = {"writev": 0, "readv": 0, "synchronize": 0, "none": 0}
    bad = []
    package = os.path.dirname(offload.__file__)
    # Lines executed inside offload are counted per phase of the round, and an
    # interrupt targets (phase, n): the n-th line run inside that phase. How
    # many lines a phase runs varies with timing (waits poll), so a target
    # counted from the round's start drifted across phases on a busy machine.
    current = ["none"]
    lines = dict.fromkeys(phases, 0)
    target = [None, 0]
    raised = dict.fromkeys(phases, 0)  # interrupts raised, by the phase they were raised in
    where = []  # where the last interrupt was raised and where it landed

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package):
            return None
        if event == "line":
            lines[current[0]] += 1
            if current[0] == target[0] and lines[current[0]] == target[1]:
                where[:] = [f"raised at {frame.f_code.co_name}:{frame.f_lineno}"]
                raised[current[0]] += 1
                signal.raise_signal(signal.SIGINT)
        return tracer

    issue_then_wait = how == "trace-async"  # the round's work all happens inside synchronize()

    def one_round():
        current[0] = "writev"
        off.async_writev(tensors) if issue_then_wait else off.sync_writev(tensors)
        current[0] = "readv"
        off.async_readv(tensors) if issue_then_wait else off.sync_readv(tensors)
        current[0] = "synchronize"
        off.synchronize()
        current[0] = "none"

    # Measure whole rounds (their seconds, each phase's lines inside offload;
    # the fewest of three warm rounds, so that targets land inside their
    # phase), then spread the interrupts evenly over the phases' lines.
    begin = time.monotonic()
    sys.settrace(tracer)
    one_round()
    round_s = time.monotonic() - begin
    phase_lines = None
    for _ in range(3):
        lines.update(dict.fromkeys(phases, 0))
        one_round()
        phase_lines = {p: min(n, phase_lines[p]) if phase_lines else n for p, n in lines.items()}
    sys.settrace(None)
    round_lines = sum(phase_lines.values())
    order = [p for p in ("writev", "readv", "synchronize") if phase_lines[p] > 0]

    def line_target(trial):
        """The trial's point of the round, as (phase, n-th line in it)."""
        n = 1 + (trial * round_lines) // count
        for p in order:
            if n <= phase_lines[p]:
                return p, n
            n -= phase_lines[p]
        return order[-1], phase_lines[order[-1]]
    trials = count
    if how == "timer":
        # The fastest of three rounds: a trial that runs faster than the round
        # measured lets its interrupt land after the round. Those count for
        # nothing, so trials go on (three sweeps at most) until ``count``
        # interrupts landed inside a call: a busy machine varies that much.
        rounds = []
        for _ in range(3):
            begin = time.monotonic()
            one_round()
            rounds.append(time.monotonic() - begin)
        round_s, trials = min(rounds), 3 * count

    ran = 0
    for trial in range(trials):
        if how == "timer" and phases["writev"] + phases["readv"] + phases["synchronize"] >= count:
            break
        ran += 1
        phase, sender = "none", None
        try:
            try:
                if how == "timer":
                    # Inside the try: an interval shorter than a thread takes
                    # to start lands the signal in start() itself (more so
                    # beside another Python thread, such as the pool's
                    # provisioner, holding the GIL a moment): phase "none".
                    sender = threading.Timer(round_s * (trial % count + 0.5) / count, signal.pthread_kill,
                                             (main, signal.SIGINT))
                    sender.start()
                else:
                    lines.update(dict.fromkeys(phases, 0))  # trace, trace-*
                    target[:] = line_target(trial)
                    sys.settrace(tracer)
                phase = current[0] = "writev"
                off.async_writev(tensors) if issue_then_wait else off.sync_writev(tensors)
                phase = current[0] = "readv"
                off.async_readv(tensors) if issue_then_wait else off.sync_readv(tensors)
                phase = current[0] = "synchronize"
                off.synchronize()
                phase = current[0] = "none"
                if sender is not None:
                    sender.join()
                settle_held_signals()  # a signal held until the round's last step lands here
            finally:
                sys.settrace(None)
                current[0] = "none"
        except KeyboardInterrupt as interrupt:
            tb = interrupt.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            where.append(f"landed at {tb.tb_frame.f_code.co_name}:{tb.tb_lineno}")
            if sender is not None:
                sender.join()
        except Exception as error:  # only the unprotected run may get here
            bad.append(f"trial {trial} ({phase}): the call raised {type(error).__name__}: {error}")
        phases[phase] += 1
        watchdog = threading.Timer(10, hung, (trial, f"{phase}, {' '.join(where)}", phases, bad))
        watchdog.start()
        try:
            off.synchronize()
        except Exception as error:
            bad.append(f"trial {trial}: synchronize raised {type(error).__name__}: {error}")
        for i, (t, e) in enumerate(zip(tensors, expected)):
            try:
                if t.untyped_storage().nbytes() == 0:
                    off.sync_read(t)  # released: readable, with its bytes
                    ok = torch.equal(t, e)
                else:
                    ok = torch.equal(t, e)
                    off.sync_write(t)  # resident: writable
                    off.sync_read(t)
                    ok = ok and torch.equal(t, e)
            except Exception as error:
                bad.append(f"trial {trial} ({phase}) tensor {i}: {type(error).__name__}: {error}")
                tensors[i] = e.clone()  # carry on with a fresh tensor
                continue
            if not ok:
                bad.append(f"trial {trial} ({phase}) tensor {i}: wrong bytes")
        watchdog.cancel()
        if how == "trace-unprotected" and bad:
            break  # the check has caught the defect: that is all this run must show
    off.close()
    report(trials=ran, round_lines=round_lines, phases=phases, raised=raised, bad=bad[:20], bad_count=len(bad),
           held=_signals.held_count)


if __name__ == "__main__":
    command, directory, backend, *rest = sys.argv[1:]
    if command == "close-race":
        close_race(directory, backend, int(rest[0]), rest[1])
    elif command == "close-interrupted":
        close_interrupted(directory, backend)
    elif command == "close-given-up":
        close_given_up(directory, backend)
    elif command == "fork":
        fork(directory, backend, rest[0] == "named", rest[1] == "in-flight")
    elif command == "dataloader":
        dataloader(directory, backend, rest[0])
    elif command == "interrupts":
        interrupts(directory, backend, rest[0], int(rest[1]))
    else:
        raise SystemExit(f"unknown scenario {command}")
