"""A save or load whose engine never finishes a request, interrupted twice.

    python stalled_engine.py save|load|dcp-load PATH BACKEND

Every request's completion is held back for 10 minutes (the engine's fault
injector, on the engine the operation opens), as a drive that stopped
answering would. SIGINT lands at 0.5 s (ending the operation's own wait)
and at 1.5 s (ending its engine's). Prints one line: ``interrupted SECONDS
ENGINES_GIVEN_UP WARNINGS``, or ``finished`` if it was not interrupted
(torch's DCP hands the interrupt on inside its CheckpointException).
"""
import importlib
import os
import signal
import sys
import threading
import time
import warnings

import torch

import offload

OPENER = {"save": "offload._checkpoint_writing", "load": "offload._checkpoint_reading",
          "dcp-load": "offload._dcp_reading"}


def stall_the_engines_of(module_name):
    module = importlib.import_module(module_name)
    opened = module.open_engine

    def stalled(*args, **options):
        engine = opened(*args, **options)
        engine.set_faults(delay_rate=1.0, delay_ms=600_000)
        return engine
    module.open_engine = stalled


def run(operation, path, backend):
    if operation == "save":
        offload.save({"v": torch.full((4 << 20,), 2.0)}, path, backend=backend)
    elif operation == "load":
        offload.load(path, backend=backend)
    else:
        import torch.distributed.checkpoint as dcp
        from offload.dcp import Reader
        dcp.load({"v": torch.zeros(4 << 20)}, storage_reader=Reader(path, backend=backend))


def main():
    operation, path, backend = sys.argv[1:]
    stall_the_engines_of(OPENER[operation])
    main_thread = threading.main_thread().ident
    for at in (0.5, 1.5):
        threading.Timer(at, signal.pthread_kill, (main_thread, signal.SIGINT)).start()
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            run(operation, path, backend)
            print("finished")
        except BaseException as error:  # DCP wraps the interrupt in its CheckpointException
            if not isinstance(error, KeyboardInterrupt) and "KeyboardInterrupt" not in str(error):
                raise
            print("interrupted", time.monotonic() - started, offload._core.abandoned_engines(),
                  sum("kept for the life of this process" in str(w.message) for w in warned))
    sys.stdout.flush()
    os._exit(0)  # (the engine given up keeps its threads)


if __name__ == "__main__":
    main()
