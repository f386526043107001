"""Mutation probes: break one promise of the code at a time, and check that
the test suite notices.

    .venv/bin/python tests/helpers/mutation_probes.py [NAME ...] [--work DIR] [--list]

Each probe replaces one exact piece of the source (found once, or the probe
is reported stale) in a scratch clone of HEAD (commit first: changes not
committed are not in it), rebuilds the extension when
the piece is in csrc/, and runs the test files it names: CAUGHT when a test
fails, SURVIVED when none does. Every probe here was caught when it was
added; most of them survived the suite before the test that catches them
was written. A SURVIVED is a promise no test holds any more. Not part of
`make test`: 7-13 minutes on 2 cores, much of it rebuilding for the
csrc/ probes.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Probe(NamedTuple):
    name: str
    promise: str   # what the mutation breaks
    file: str
    old: str
    new: str
    tests: tuple


PROBES = [
    Probe("engine-no-short-resume", "a short transfer is resumed where it stopped",
          "csrc/engine.cpp", "    if (c->remaining() > 0) {  // short transfer",
          "    if (false) {  // short transfer", ("tests/test_engine.py",)),
    Probe("engine-no-short-write-resume", "a short write is resumed (its unreported bytes hold a pattern)",
          "csrc/engine.cpp", "    if (c->remaining() > 0) {  // short transfer",
          "    if (c->remaining() > 0 && r->io.kind == IoKind::kRead) {  // short transfer",
          ("tests/test_engine.py",)),
    Probe("engine-merged-failure-dropped", "a failed shared I/O fails every request merged into it",
          "csrc/engine.cpp", "  for (Chunk* part : c->merged) fail(part->request, error, c->fd);\n", "",
          ("tests/test_engine.py",)),
    Probe("engine-no-zero-fill", "a staged chunk is zero-filled past its source",
          "csrc/engine.cpp", "    std::memset(to + copy, 0, part->length - copy);\n", "",
          ("tests/test_engine.py", "tests/test_conformance.py")),
    Probe("engine-merge-noncontiguous", "only requests side by side in the file share an I/O",
          "csrc/engine.cpp", "        next->file_offset() != end || next->request->error != 0",
          "        next->request->error != 0", ("tests/test_engine.py",)),
    Probe("engine-no-retry", "EAGAIN and EINTR are retried",
          "csrc/engine.cpp", "    if (++c->retries < kMaxRetries) {", "    if (false) {", ("tests/test_engine.py",)),
    Probe("fixed-buffer-stale-length", "a registered region is not used for a longer one at its address",
          "csrc/fixed_buffers.cpp",
          "return it->second.first >= region_length ? static_cast<int>(it->second.second) : -1;",
          "return static_cast<int>(it->second.second);", ("tests/test_core_cpp.py",)),
    Probe("pool-no-lazy-free", "idle blocks beyond the limit are given back (MADV_FREE)",
          "csrc/buffer_pool.cpp", "madvise(r.block, r.capacity, MADV_FREE) == 0",
          "madvise(r.block, r.capacity, MADV_NORMAL) == 0", ("tests/test_buffer_pool.py",)),
    Probe("pool-big-block-flushes-cache", "a block larger than the idle limit evicts nothing",
          "csrc/buffer_pool.cpp", "    if (capacity > idle_limit_) {\n      retire_locked",
          "    if (false) {\n      retire_locked", ("tests/test_buffer_pool.py",)),
    Probe("pool-lazy-reuse-untouched", "a reused lazily freed block is written to, so the kernel keeps what is read",
          "csrc/buffer_pool.cpp", "    for (size_t i = 0; i < capacity; i += kPage) p[i] = p[i];\n", "",
          ("tests/test_first_touch.py", "tests/test_buffer_pool.py")),
    Probe("pool-slab-never-unmapped", "a slab whose small blocks are all freed is unmapped",
          "csrc/buffer_pool.cpp", "  if (--slab->second.in_use > 0) return;",
          "  --slab->second.in_use;\n  return;", ("tests/test_buffer_pool.py",)),
    Probe("callbacks-interrupt-drops-rest", "a KeyboardInterrupt from a callback leaves the others due",
          "offload/_completion_loop.py", "                        self.due[:0] = due[i + 1:]",
          "                        pass", ("tests/test_errors.py",)),
    Probe("callbacks-error-drops-rest", "a callback's error lets the others run",
          "offload/_completion_loop.py",
          "                except Exception as error:  # run the others, then raise the first\n"
          "                    if first_error is None:\n                        first_error = error",
          "                except Exception as error:  # run the others, then raise the first\n"
          "                    raise", ("tests/test_errors.py",)),
    Probe("reap-handler-error-drops-rest", "a completion handler that raises lets the rest of its reap finish",
          "offload/_completion_loop.py",
          "                except Exception as error:  # the rest were taken from the engine: handle them first\n"
          "                    if first_error is None:\n                        first_error = error",
          "                except Exception as error:  # the rest were taken from the engine: handle them first\n"
          "                    raise", ("tests/test_errors.py",)),
    Probe("close-stops-at-first-error", "close() runs every due callback when one raises",
          "offload/_completion_loop.py",
          "                except Exception as error:\n                    if first_error is None:\n"
          "                        first_error = error\n                with self.lock:",
          "                except Exception as error:\n                    return error\n"
          "                with self.lock:",
          ("tests/test_errors.py",)),
    Probe("wait-timeout-ignored", "wait(timeout) raises TimeoutError and leaves the operation running",
          "offload/_completion_loop.py",
          "                    if left <= 0:\n                        raise TimeoutError",
          "                    if False:\n                        raise TimeoutError", ("tests/test_errors.py",)),
    Probe("unreported-count-dropped", "the error no handle reported says how many others failed",
          "offload/_completion_loop.py",
          "            if len(unreported) > 1:\n                add_note(",
          "            if False:\n                add_note(", ("tests/test_errors.py",)),
    Probe("interrupted-close-leaves-awaits", "an await pending when close() is interrupted gets the refusal",
          "offload/_completion_loop.py",
          "            handle._error = handle._error or self.refusal()\n            handle._remaining = 0\n"
          "            handle._wake_futures()", "            pass", ("tests/test_lifecycle.py",)),
    Probe("discard-ignores-layout", "discard refuses a tensor whose layout changed",
          "offload/offloader.py",
          "            if not record.layout.matches(t):\n                raise ValueError(f\"the tensor changed since "
          "it was written: it was a \"\n                                 f\"{record.layout.describe()}, now",
          "            if False:\n                raise ValueError(f\"the tensor changed since "
          "it was written: it was a \"\n                                 f\"{record.layout.describe()}, now",
          ("tests/test_errors.py",)),
    Probe("rewrite-ignores-live-views", "a tensor read back and then given a view is refused on its next write",
          "offload/_tensors.py",
          "    return _storage_use_count is None or _storage_use_count(storage._cdata) <= (2 if t._base is None "
          "else 3)", "    return True", ("tests/test_conformance.py",)),
    Probe("grow-no-smaller-step", "a backing file without room for its growth step grows by what is needed",
          "offload/_backing_file.py", "                if error.errno != errno.ENOSPC or size == end:",
          "                if True:", ("tests/test_errors.py",)),
    Probe("pinned-host-buffer-too-small", "a tensor grown between round trips gets a host buffer of its new size",
          "offload/pinned_store.py", "        if host is None or host.capacity < nbytes:",
          "        if host is None:", ("tests/test_pinned_store.py",)),
    Probe("extent-not-regrown", "a tensor grown between round trips gets room of its new size in the file",
          "offload/_disk_transfers.py", "        if record.offset < 0 or record.capacity < padded:",
          "        if record.offset < 0:", ("tests/test_conformance.py",)),
    Probe("regrown-extent-leaked", "the extent a grown tensor left is given back",
          "offload/_disk_transfers.py",
          "            if record.offset >= 0:\n                self._file.release(record.offset, record.capacity)\n",
          "            if record.offset >= 0:\n", ("tests/test_conformance.py",)),
    Probe("write-no-snapshot", "memory torch does not own is written as it was at the call",
          "offload/_disk_transfers.py", "            if not resizable(storage):\n                storage = snapshot",
          "            if False:\n                storage = snapshot", ("tests/test_offloader.py",)),
    Probe("extents-worst-fit", "the smallest free range that fits is split first",
          "offload/_extents.py", "            have = self._sizes[i]", "            have = self._sizes[-1]",
          ("tests/test_extents.py",)),
    Probe("shards-in-name-order", "a sharded save places tensors largest first",
          "offload/_sharding.py", "key=lambda i: -nbytes[i]", "key=lambda i: i", ("tests/test_sharding.py",)),
    Probe("save-fsync-error-dropped", "a failed fsync fails a save of several files",
          "offload/_checkpoint_writing.py",
          "            errors[i] = os_error(error.errno, targets[i].path, \"while making the new file durable\")",
          "            pass", ("tests/test_checkpoint.py",)),
    Probe("save-no-directory-fsync", "a save fsyncs the directory after the rename",
          "offload/_atomic_file.py", "            os.fsync(directory)", "            pass",
          ("tests/test_checkpoint.py",)),
    Probe("load-shrink-unchecked", "a file cut while it loads is refused",
          "offload/_checkpoint_reading.py", "        if got != hi - aligned_hi:", "        if False:",
          ("tests/test_checkpoint.py",)),
    Probe("dcp-raw-bytes-into-another-dtype", "a DCP record loaded into another dtype is converted",
          "offload/_dcp_reading.py", "not target.is_contiguous() or tensor.dtype != target.dtype\n",
          "not target.is_contiguous()\n", ("tests/test_dcp.py",)),
    Probe("optim-rollback-keeps-state-resident", "a rolled-back step returns the state it read to the store",
          "offload/optim.py", "                        off.discard(t)  # read", "                        pass  # read",
          ("tests/test_optim.py",)),
    Probe("optim-read-ahead-kept-resident", "state read ahead for a piece the next step skips goes back",
          "offload/optim.py",
          "        for t in ahead.tensors:\n            if t.untyped_storage().nbytes() > 0:\n"
          "                self.offloader.discard(t)", "        pass", ("tests/test_optim.py",)),
    Probe("activations-dedupe-ignores-version", "a tensor changed in place between two saves is saved again",
          "offload/nn/activations.py", "entry[0]() is t and entry[1] == t._version and", "entry[0]() is t and",
          ("tests/test_activations.py",)),
    Probe("activations-writes-unbounded", "forward keeps at most prefetch + 1 writes in flight",
          "offload/nn/activations.py", "(self.writing[0].write.done() or len(self.writing) > self.prefetch)",
          "(self.writing[0].write.done())", ("tests/test_activations.py",)),
    Probe("activations-no-read-ahead", "backward reads prefetch saved tensors ahead",
          "offload/nn/activations.py", "        while self.reads_ahead < self.prefetch and self.ahead >= 0:",
          "        while False:", ("tests/test_activations.py",)),
    Probe("activations-failed-read-ahead-kept", "a retried backward reads again what failed",
          "offload/nn/activations.py", "                except OSError:\n                    saved.read = None\n"
          "                    self.reads_ahead -= 1", "                except OSError:\n                    pass",
          ("tests/test_activations.py",)),
    Probe("parameters-failed-read-counted", "a weight whose read failed does not count as resident",
          "offload/nn/parameters.py",
          "            self._streamed_resident -= entry.param.nbytes\n            p = entry.param",
          "            p = entry.param", ("tests/test_parameters.py",)),
    Probe("quiet-wait-counts-in-flight", "a wait is quiet when no request finishes, not when the count stays",
          "offload/_completion_loop.py", "if left == 0 or self.loop.completed != self.completed:",
          "if left == 0:", ("tests/test_errors.py",)),
    Probe("await-unwatched", "a quiet await warns, from its event loop",
          "offload/_completion_loop.py",
          "            self._check_awaits(loop, entry, QuietWatch(self, self.awaiting))", "            pass",
          ("tests/test_errors.py",)),
    Probe("save-unwatched", "a save whose writes stop finishing warns",
          "offload/_checkpoint_writing.py", "        self.quiet.saw(len(self.completions.pending))\n", "",
          ("tests/test_checkpoint.py",)),
    Probe("dcp-load-unwatched", "a DCP load whose reads stop finishing warns",
          "offload/_dcp_reading.py", "        self.quiet.saw(len(self.completions.pending))\n", "",
          ("tests/test_dcp.py",)),
    Probe("bench-sigterm-leaves-mounts", "a SIGTERM'd benchmark gives back its mounts and huge pages",
          "offload/benchmark.py", "        signal.signal(signal.SIGTERM, _undo_then_die)", "        pass",
          ("tests/test_benchmarks.py::test_sigterm_gives_back_the_mounts_and_huge_pages",)),
]


def run_probe(work: str, probe: Probe) -> str:
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=work, check=True)
    path = os.path.join(work, probe.file)
    with open(path) as f:
        source = f.read()
    if source.count(probe.old) != 1:
        return f"STALE (the piece occurs {source.count(probe.old)} times)"
    with open(path, "w") as f:
        f.write(source.replace(probe.old, probe.new))
    try:
        if probe.file.startswith("csrc/") and not build(work):
            return "BUILD FAILED"
        # The clone's package first, in the test processes and in the children they start (which
        # would otherwise import the checkout the virtual environment has installed, unchanged).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [work, os.environ.get("PYTHONPATH")])))
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *probe.tests],
                             cwd=work, capture_output=True, text=True, env=env)
        summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "no output"
        return ("CAUGHT" if run.returncode else "SURVIVED") + f" | {summary}"
    finally:
        if probe.file.startswith("csrc/"):
            subprocess.run(["git", "checkout", "-q", "--", "."], cwd=work, check=True)
            build(work)


def build(work: str) -> bool:
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=work,
                          capture_output=True).returncode == 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="probes to run (default: all)")
    parser.add_argument("--work", help="scratch clone to use (default: a temporary directory)")
    parser.add_argument("--list", action="store_true", help="list the probes and what each breaks")
    args = parser.parse_args(argv)
    probes = [p for p in PROBES if not args.names or p.name in args.names]
    if args.list:
        for p in probes:
            print(f"{p.name:40} {p.promise}")
        return 0
    work = args.work or tempfile.mkdtemp(prefix="offload-probes-")
    if not os.path.isdir(os.path.join(work, ".git")):
        subprocess.run(["git", "clone", "-q", ROOT, work], check=True)
    if not build(work):
        print("the unmodified tree does not build", file=sys.stderr)
        return 2
    survived = 0
    for probe in probes:
        outcome = run_probe(work, probe)
        survived += not outcome.startswith("CAUGHT")
        print(f"{probe.name:40} {outcome}", flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(probes) - survived} of {len(probes)} caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
