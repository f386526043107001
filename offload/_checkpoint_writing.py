"""Writing safetensors files (and DCP's data files) at disk speed: every
file of a save through one engine, in aligned 8 MiB O_DIRECT requests, its
bytes copied once into staging slots; each file new (``AtomicFile``) until
all are durable, then committed in turn."""
import bisect
import os
import threading
import warnings

import torch

from ._atomic_file import AtomicFile, HeldFrees
from ._completion_loop import CompletionLoop, QuietWatch
from ._direct_io import round_up
from ._engines import close_engine, open_engine
from ._errors import os_error
from ._pool import buffer_pool
from ._progress_bar import ProgressBar
from ._tensors import copy_bytes, flat_bytes
from .device_pipeline import CopyQueue, StagingRing, device_skip
from .devices import DeviceResolver

_CHUNK = 8 << 20      # bytes per request, and per staging slot
_SLOTS = 16           # staging slots in flight
_WAIT_MS = 50


def write_files_atomically(files, *, progress=None, backend="auto", direct=None, device=None,
                           committed=None) -> None:
    """Writes each file (path, header, named, entries: ``header`` then each
    tensor of ``named`` at its entry's ``begin`` after it) as a new file that
    replaces ``path`` atomically, all at once: one engine, one staging ring, the files' chunks interleaved so
    that every file has writes in flight. Once all are written, they are
    fsynced at once (a thread each), then each is committed in turn; a
    failure before that leaves every old file as it was. The files replaced
    are freed once the last is committed (``HeldFrees``). The paths
    committed are appended to ``committed`` as they are. Errors name the
    file. ``direct`` None: O_DIRECT where the file system accepts it, and one
    warning for each directory that refuses it (its files go through the page
    cache); False: the page cache, silently; True: O_DIRECT or an error."""
    targets, engine, writer = [], None, None
    try:
        for path, header, named, entries in files:
            targets.append(AtomicFile(path, direct))
        if direct is None:
            for directory in sorted({t.directory for t in targets if not t.direct}):
                warnings.warn(f"offload.save: the file system of {directory!r} refuses O_DIRECT; the files "
                              "saved there go through the page cache (direct=False says that is meant)",
                              RuntimeWarning, stacklevel=4)
        outputs = [_OutFile(target, header, named, entries)
                   for target, (_, header, named, entries) in zip(targets, files)]
        for out in outputs:
            # Allocating the whole file first: ENOSPC before any byte moves, and
            # the O_DIRECT writes land in allocated extents.
            try:
                if out.total:
                    os.posix_fallocate(out.target.fd, 0, out.total)
            except OSError as error:
                raise os_error(error.errno, out.target.path, "while allocating the new file") from None
        engine = open_engine(backend, 64, 4 << 20, 8)
        name = os.path.basename(targets[0].path) + (f" and {len(targets) - 1} more" if len(targets) > 1 else "")
        with ProgressBar(progress, sum(out.total for out in outputs), f"saving {name}") as bar:
            writer = _Writer(engine, outputs, device, bar)
            writer.run()
        for out in outputs:
            os.ftruncate(out.target.fd, out.total)
        if len(targets) > 1:  # files on several drives: their fsyncs overlap too
            _fsync_all(targets)
        held = HeldFrees()
        try:
            with held.holding():
                for target in targets:
                    try:
                        target.commit()
                    except OSError as error:
                        if error.filename is not None:
                            raise
                        raise os_error(error.errno, target.path, "while making the new file durable") from None
                    if committed is not None:
                        committed.append(target.path)
        finally:
            held.release()
    except BaseException:
        # The engine first: until it is closed, its writes may still read the
        # staging slots, and a thread engine's worker write to a file's
        # descriptor. Given up on, it keeps both (and they stay open).
        if engine is None:
            _abort(writer, targets)
        else:
            engine, closing = None, engine
            close_engine(closing, writer, targets, then=lambda: _abort(writer, targets))
        raise
    finally:
        if engine is not None:
            close_engine(engine, writer)


def _abort(writer, targets) -> None:
    if writer is not None:
        writer.close()
    for target in targets:
        target.abort()  # (nothing to undo for one already committed)


def _fsync_all(targets) -> None:
    """fsyncs every target's file, each on a thread of its own (fsync lets
    go of the GIL); raises the first error, naming its file."""
    errors = [None] * len(targets)

    def sync(i):
        try:
            os.fsync(targets[i].fd)
        except OSError as error:
            errors[i] = os_error(error.errno, targets[i].path, "while making the new file durable")
    threads = [threading.Thread(target=sync, args=(i,), name="offload-fsync") for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error


class _OutFile:
    """One file of a save: where it goes, its header, and its tensors at
    their offsets (after the header; gaps between them are zeros)."""

    __slots__ = ("target", "header", "tensors", "starts", "total")

    def __init__(self, target, header, named, entries):
        self.target, self.header = target, header
        self.tensors = [t for _, t in named]
        self.starts = [len(header) + e.begin for e in entries]
        self.total = len(header) + (entries[-1].end if entries else 0)


class _Writer:
    """Streams each file's header + tensors into it as aligned 8 MiB writes,
    the copy into one staging slot overlapping the writes of the others. A chunk
    goes to the disk as soon as its device copies have landed, by the same
    rule (``CopyQueue``) as the Offloader's pipeline: the device wakes the
    wait, and the writer blocks on a copy only when the disk is idle."""

    def __init__(self, engine, files, device, bar):
        self.engine, self.files, self.bar = engine, files, bar
        self.devices = DeviceResolver(device)
        self.after = {}   # device -> event on the caller's stream
        self.flat = {}    # (file, tensor index) -> its flat bytes, while being copied
        # The device whose page-locking the staging slots use (None: plain CPU).
        self.pin_device = device if device is not None else next(
            (self.devices.for_tensor(t) for out in files for t in out.tensors if t.is_cuda), None)
        self.slots = None
        self.completions = CompletionLoop(engine, None)  # driven here alone: no waits, no handles
        self.completions.owner = f"{files[0].target.path!r}" if files else "a save"
        self.quiet = QuietWatch(self.completions, "saving")
        self.error = None

    def run(self) -> None:
        # Round-robin over the files: chunk k of every file before chunk k + 1.
        counts = [-(-out.total // _CHUNK) for out in self.files]
        order = [(f, k) for k in range(max(counts, default=0)) for f, n in enumerate(counts) if k < n]
        self.slots = StagingRing(self.pin_device, min(_SLOTS, max(len(order), 1)), _CHUNK, buffer_pool())
        copying = CopyQueue(device_skip(self.pin_device))  # (file, chunk index, slot, length)
        try:
            next_chunk = 0
            while self.error is None and (next_chunk < len(order) or copying):
                # Fill every free slot (device copies queue back to back), handing
                # the disk each chunk as soon as its bytes are in its slot.
                while next_chunk < len(order) and self.slots.has_free() and self.error is None:
                    f, index = order[next_chunk]
                    slot = self.slots.take()
                    length, copies = self._fill(f, index, slot)
                    copying.add((f, index, slot, length), copies, self.engine.wake)
                    next_chunk += 1
                    self._submit_landed(copying)
                    self.completions.reap()
                self._submit_landed(copying)
                if self.completions.pending:
                    self._wait()
                self.completions.reap()
            self._drain()  # a failure may still come with the last completions
            if self.error is not None:
                raise self.error
        finally:
            copying.settle()  # never free a slot a device still copies into
        self.slots.close()  # nor one the kernel may still read: here none is in flight

    def close(self) -> None:
        """Frees the staging slots once the engine has no write in flight
        (it is closed): what ``run`` leaves when it raises. Idempotent."""
        if self.slots is not None:
            self.slots.close()

    def _wait(self) -> None:
        """One wait on the engine (a completion, or a device copy landing,
        wakes it), and the look that warns when nothing finishes."""
        self.engine.wait(_WAIT_MS)
        self.quiet.saw(len(self.completions.pending))

    def _drain(self) -> None:
        while self.completions.pending:
            self._wait()
            self.completions.reap()

    def _submit_landed(self, copying) -> None:
        """Writes every chunk whose bytes are in its slot; waits for a device
        copy only when the disk has nothing of ours to do meanwhile."""
        while (chunk := copying.pop_landed(busy=bool(self.completions.pending))) is not None:
            f, index, slot, length = chunk
            tag = self.completions.new_tag(self._written, chunk)
            self.engine.submit_write(tag, self.files[f].target.fd, self.slots.buffers[slot].address, length,
                                     index * _CHUNK)

    def _fill(self, f, index, slot):
        """Copies the bytes of chunk ``index`` of file ``f`` into ``slot``
        (zeros where no tensor is: padding); returns (padded length, [(device,
        its last copy's event)] for the device copies)."""
        out = self.files[f]
        lo = index * _CHUNK
        hi = min(lo + _CHUNK, out.total)
        view = self.slots.views[slot]
        last = {}  # device -> event of its last copy into the slot
        covered = lo  # bytes below this are filled
        if lo < len(out.header):
            n = min(hi, len(out.header)) - lo
            view[:n].copy_(torch.frombuffer(bytearray(out.header[lo:lo + n]), dtype=torch.uint8))
            covered = lo + n
        first = max(0, bisect.bisect_right(out.starts, lo) - 1)
        for i in range(first, len(out.tensors)):
            start = out.starts[i]
            if start >= hi:
                break
            t = out.tensors[i]
            end = start + t.numel() * t.element_size()
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            if a > covered:
                view[covered - lo:a - lo].zero_()
            covered = b
            src = self._flat(f, i)[a - start:b - start]
            dst = view[a - lo:b - lo]
            device = self.devices.for_tensor(t)
            if device is None:
                copy_bytes(dst, src)
                if b == end:
                    del self.flat[f, i]  # (a contiguous copy of a strided tensor goes now)
            else:  # device copies are asynchronous: their sources stay referenced until the end
                last[device] = device.copy(dst, src, self._caller_event(device))
        padded = round_up(hi - lo)
        if padded > covered - lo:
            view[covered - lo:padded].zero_()
        return padded, list(last.items())

    def _written(self, chunk, result) -> None:
        f, index, slot, length = chunk
        out = self.files[f]
        self.slots.give(slot)
        if result < 0 and self.error is None:
            self.error = os_error(-result, out.target.path, f"while saving (bytes {index * _CHUNK}+ "
                                                            "of the new file; the old one is untouched)")
        elif result >= 0:
            self.bar.update(min(length, out.total - index * _CHUNK))

    def _flat(self, f, i):
        flat = self.flat.get((f, i))
        if flat is None:
            flat = self.flat[f, i] = flat_bytes(self.files[f].tensors[i])
        return flat

    def _caller_event(self, device):
        """The caller's stream as of the save (one event per device): copies wait for it."""
        event = self.after.get(device)
        if event is None:
            event = self.after[device] = device.caller_event()
        return event
