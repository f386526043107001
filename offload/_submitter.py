"""Submits a vector call's batches beside their preparation.

A vector call hands the engine its requests 256 at a time, so the disk
starts on the first tensors while the rest are planned. Submitting a batch
of staged writes (torch's memory, which this disk's alignment refuses)
copies its bytes into staging blocks, a few microseconds a 64 KiB tensor,
which the calling thread would otherwise add to its Python planning of
each tensor (~19 us of its CPU a new 64 KiB tensor on the development VM,
~16 with the copies moved off). ``BatchSubmitter`` runs ``engine.submit``
(which releases the GIL) on a helper thread while the caller plans the
next batch (BENCHMARKS.md, "Small new tensors: batches submitted beside
their planning").

Guarantees:

- Batches reach the engine in the order they were handed over: ``hand``
  waits for the one before to be submitted first.
- ``collect`` returns once nothing handed over is still being submitted,
  with the batch the engine refused (None if none) and its OSError; any
  other exception from the submission is raised there, on the caller's
  thread. A refused batch started nothing, as when submitted inline.
- The helper only calls ``engine.submit``: it takes no Offloader lock and
  touches no Python state of the Offloader. It leaves once idle for
  ``IDLE_EXIT_S`` and is started again on demand; an Offloader's close or
  death needs nothing from it (nothing is handed over outside a call, and
  every call collects before it returns).
"""
import threading

from . import _signals

_signals.bookkeeping_module(__file__)

IDLE_EXIT_S = 1.0


class BatchSubmitter:
    def __init__(self, engine):
        self._engine = engine
        self._ready = threading.Condition()
        self._batch = None      # handed over, not yet submitted
        self._running = False   # a helper thread is alive (or starting)
        self._outcome = None    # (batch, exception) of a refused submission

    def hand(self, batch) -> None:
        """Submits ``batch`` on the helper, after any handed over before.
        Call ``collect`` before anything else of the engine's that must see
        these requests queued (a reap may run meanwhile: the engine is
        thread-safe, and what it returns was submitted)."""
        with self._ready:
            self._ready.wait_for(lambda: self._batch is None)
            self._batch = batch
            if self._running:
                self._ready.notify_all()
                return
            self._running = True
        try:
            threading.Thread(target=self._run, name="offload-submit", daemon=True).start()
        except RuntimeError:  # no thread to be had: submitted inline, as without one
            with self._ready:
                self._running, self._batch = False, None
            self._outcome = self._submitted(batch)

    def collect(self):
        """Waits until nothing handed over is being submitted; returns
        (refused batch, its OSError), or (None, None)."""
        with self._ready:
            self._ready.wait_for(lambda: self._batch is None)
            outcome, self._outcome = self._outcome, None
        if outcome is None:
            return None, None
        batch, error = outcome
        if not isinstance(error, OSError):
            raise error
        return batch, error

    def _run(self) -> None:
        while True:
            with self._ready:
                if not self._ready.wait_for(lambda: self._batch is not None, IDLE_EXIT_S):
                    self._running = False
                    return
                batch = self._batch
            outcome = self._submitted(batch)
            with self._ready:
                if outcome is not None and self._outcome is None:
                    self._outcome = outcome
                self._batch = None
                self._ready.notify_all()

    def _submitted(self, batch):
        """Submits ``batch``; None, or (batch, exception) for collect()."""
        try:
            self._engine.submit(batch)
        except BaseException as error:
            return batch, error
        return None
