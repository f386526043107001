"""Handles: what async_read/async_write return."""
import asyncio
import collections.abc

from . import _signals

_signals.bookkeeping_module(__file__)


class Handle(collections.abc.Coroutine):
    """The outcome of one async call (one tensor, or a group for the vector
    forms). ``done()`` says whether it finished, ``wait()`` blocks until it
    has and raises its error, and ``await handle`` does the same inside
    asyncio without blocking the loop. A Handle is also a coroutine object,
    so ``asyncio.create_task(off.read(t))`` and ``TaskGroup.create_task``
    take it as they are (the I/O started at the call, not when the task
    first runs; one task per handle). Every operation finishes exactly once.
    The callback given to the call runs once, only if every operation
    succeeded, on the thread of the first Offloader call (or ``done()``,
    ``wait()``, ``await``) after the completion: it has run by the time
    ``done()`` says True or ``wait()`` / ``await`` return. The handle drops
    its reference to the callback once the call has finished, so a callback
    that refers to whatever holds the handle makes no lasting cycle.
    """

    __slots__ = ("_loop", "_owner", "_remaining", "_error", "_callback", "_futures", "_observed", "_task_steps")

    def __init__(self, loop, count: int, callback, owner=None):
        self._loop = loop  # the CompletionLoop that finishes it
        self._owner = owner  # kept alive while the handle is (an Offloader closes when collected)
        self._remaining = count
        self._error = None
        self._callback = callback
        self._futures = None
        self._observed = False
        self._task_steps = None  # the __await__ iterator a task drives through send()/throw()

    def done(self) -> bool:
        """True once every operation of this call finished (reaps first).
        Raises the Offloader's refusal when it can never finish (a forked
        child's copy of a pending handle)."""
        loop = self._loop
        loop.poll()
        if self._remaining and loop.closed:
            raise loop.refusal()
        return self._remaining == 0

    @_signals.interruptible
    def wait(self, timeout: float = None) -> None:
        """Blocks until done; raises the first error (OSError with errno and
        path). With ``timeout`` (seconds), raises TimeoutError if not done by
        then; the operations go on."""
        if self._remaining:
            self._loop.wait_for(self, timeout)
        else:  # finished already: its callback (or an error met meanwhile) may still be due
            self._loop.catch_up()
        self._raise_error()

    def exception(self):
        """The error this call ended with (None if it succeeded or is not done)."""
        self._observed = True
        return self._error

    def _raise_error(self):
        self._observed = True
        if self._error is not None:
            raise self._error

    def __await__(self):
        if self._remaining:
            completions = self._loop
            loop = asyncio.get_running_loop()
            future = None
            with completions.lock:  # another thread may be finishing (or closing) this handle
                if self._remaining:
                    if completions.closed:
                        raise completions.refusal()
                    future = loop.create_future()
                    if self._futures is None:
                        self._futures = []
                    self._futures.append(future)
                    completions.awaited.add(self)
                    completions.watch(loop)  # under the lock: close() cannot free the eventfd meanwhile
            if future is not None:
                try:
                    yield from future.__await__()
                finally:
                    # Cancellation leaves the operation running: its buffers stay
                    # referenced until the kernel is done with them.
                    with completions.lock:
                        if self._futures and future in self._futures:  # cancelled: forget it
                            self._futures.remove(future)
                        if not self._futures:
                            completions.awaited.discard(self)
                    completions.unwatch(loop)
        self._loop.catch_up()  # callbacks that finished meanwhile; an error the event loop's reaps met
        self._raise_error()

    # The coroutine protocol, for asyncio.create_task (await uses __await__).
    def send(self, value):
        return self._steps().send(value)

    def throw(self, *exc_info):
        return self._steps().throw(*exc_info)

    def _steps(self):
        if self._task_steps is None:
            self._task_steps = self.__await__()
        return self._task_steps

    def close(self):
        if self._task_steps is not None:
            self._task_steps.close()

    # Called by the completion loop's owner with the loop's lock held.
    def _operation_finished(self, error) -> bool:
        """Counts one operation; returns True when the whole call is done."""
        if error is not None and self._error is None:
            self._error = error
        self._remaining -= 1
        return self._remaining == 0

    def _wake_futures(self) -> None:
        futures, self._futures = self._futures, None
        if not futures:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for future in futures:
            loop = future.get_loop()
            if loop is running:
                _resolve(future)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    def __repr__(self):
        state = "pending" if self._remaining else ("failed" if self._error else "done")
        return f"<offload.Handle {state}>"


def _resolve(future) -> None:
    if not future.done():
        future.set_result(None)
