"""Checkpoint save and load: offload beside torch.save/load, safetensors and fio.

    python benchmarks/checkpoint_benchmark.py DIR [--total-mib 2048] [--repeats 3] [--warmup 1] [--json out.json]

A state dict of about --total-mib with a realistic mix (hundreds of tensors,
4 KiB to 256 MiB, float32 and bfloat16). Saves are durable when timed (fsync
for the buffered writers; offload.save fsyncs itself). The page cache is
dropped before every load, and every load touches each page of every tensor
(mmap loads included); offload's load is also shown timed to its return, as
fio's reads are (its tensors are resident by then). After each load's touch
the benchmark touches its own source tensors too, untimed, as a control:
memory nobody wrote since it was made, so a slow touch there is the
machine's (on a VM, the host remapping the guest's memory), not the
loader's. Each of --repeats rounds runs every save, then every
load (fio's runs among them), in an order that rotates from round to round and
runs backwards every other round (no contender always follows the same one);
medians with min and max, after --warmup untimed rounds (default 1: each
process's first save and load, fio's first write and read; the first load
is reported apart). Each contender runs in a process of its own, started
once and kept for every round: its steady state, and none of the others'
memory in its own (another loader making and freeing 2 GiB in the same
process slowed the touch after offload's next load to as much as 0.57 s
against 0.01-0.03; BENCHMARKS.md). The device limit is fio's sequential 4
MiB, iodepth 32 throughput on the same directory, O_DIRECT on huge-page buffers where root can
have them (on 4 KiB pages a virtio disk splits large O_DIRECT requests: that
figure is shown beside, not used) and buffered (end_fsync), the faster of the
two; every figure is also a ratio to it, from the same run. Among the reads,
fio also reads the checkpoint file offload saved that round (same job): a
file's place on the disk moves its read rate by a few percent
(benchmarks/file_placement.py), and "load, to return, x fio on its file"
(the median of each round's ratio) leaves that out.

offload's loads fault new buffers in on 4 KiB pages, and once idle its pool
collapses them back onto huge pages on a helper thread (MADV_COLLAPSE), which
later loads read into. So that this never runs beside another contender, the
benchmark collapses them itself right after each offload load, untimed, and
reports the seconds that took.
"""
import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402
from offload._atomic_file import wait_for_frees  # noqa: E402
from offload._pool import collapse_now  # noqa: E402
from offload.benchmark import (Progress, drop_page_cache, fio_job, hugepage_buffers, interleaved,  # noqa: E402
                               median_ratio)

MIB = 1 << 20


def realistic_state_dict(total_bytes, seed=0):
    """Buckets of equal total size from 256 MiB tensors down to 4 KiB ones,
    scaled to total_bytes; random data (one random block, repeated)."""
    g = torch.Generator().manual_seed(seed)
    scale = total_bytes / (2048 * MIB)
    buckets = [(256 * MIB, 1), (128 * MIB, 2), (64 * MIB, 4), (32 * MIB, 8), (16 * MIB, 16),
               (8 * MIB, 32), (4 * MIB, 64), (MIB, 128), (MIB // 2, 128), (64 << 10, 128), (4 << 10, 128)]
    block = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8, generator=g)
    sd, i = {}, 0
    for size, count in buckets:
        size = max(4096, int(size * scale) // 4096 * 4096)
        for _ in range(count):
            dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
            numel = size // (2 if dtype == torch.bfloat16 else 4)
            cols = 1024 if numel % 1024 == 0 else 1
            t = torch.empty(numel // cols, cols, dtype=dtype)
            flat = t.view(-1).view(torch.uint8)
            for start in range(0, flat.numel(), block.numel()):
                n = min(block.numel(), flat.numel() - start)
                flat[start:start + n].copy_(block[:n])
            sd[f"layers.{i}.weight"] = t
            i += 1
    return sd


def touch(sd) -> int:
    """Reads one byte of every page of every tensor (faults in mmap'ed data)."""
    total = 0
    for t in sd.values():
        flat = t.reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum())
    return total


def fsynced(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fio(directory, rw, total, direct, fsync=True, huge_pages=True, filename="ckpt-fio.bin"):
    if shutil.which("fio") is None:
        return None
    mem = hugepage_buffers(4 * MIB * 32)[0] if direct and huge_pages else None
    extra = (mem,) if mem else ()
    if rw == "write":
        try:  # a new file each time, as a checkpoint save makes
            os.unlink(os.path.join(directory, "ckpt-fio.bin"))
        except FileNotFoundError:
            pass
        if fsync:  # durable, as the saves are when timed
            extra += ("--end_fsync=1",)
    if rw == "read":
        drop_page_cache()
    job = fio_job(directory, rw, "4M", total, direct=direct, filename=filename, extra=extra)
    return job["bw_bytes"] / 1e9


def contenders(directory, sd):
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    import safetensors.torch as st
    return {
        "offload": (lambda: offload.save(sd, path("bench-offload.safetensors")),
                    lambda: offload.load(path("bench-offload.safetensors"))),
        "safetensors": (lambda: _safetensors_save(st, sd, path("bench-st.safetensors")),
                        lambda: st.load_file(path("bench-st.safetensors"))),
        "torch.save": (lambda: fsynced(path("bench-torch.pt"), lambda f: torch.save(sd, f)),
                       lambda: torch.load(path("bench-torch.pt"), weights_only=True)),
        "torch.load(mmap)": (None, lambda: torch.load(path("bench-torch.pt"), mmap=True, weights_only=True)),
    }


def _safetensors_save(st, sd, file):
    st.save_file(sd, file)
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Contender:
    """One contender's process: it makes the state dict itself (the same
    bytes in every process: one seed) and runs its save and load when asked,
    timing them inside. ``name`` is a key of ``contenders``; ``saves``
    whether it has a save of its own."""

    def __init__(self, name, directory, total_bytes, saves):
        self.name, self.saves = name, saves
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._process = spawn.Process(
            target=_contender_main, args=(child, name, directory, total_bytes), name=f"bench {name}")
        self._process.start()
        child.close()

    def wait_ready(self) -> None:
        """Waits until the process has made its state dict."""
        self.nbytes, self.tensors, self.expected, self.pid = self._reply()

    def _reply(self):
        kind, value = self._conn.recv()
        if kind == "error":
            raise SystemExit(f"{self.name}: {value}")
        return value

    def save(self) -> float:
        self._conn.send("save")
        return self._reply()

    def load(self) -> dict:
        self._conn.send("load")
        return self._reply()

    def close(self) -> None:
        try:
            self._conn.send("quit")
        except (BrokenPipeError, OSError):
            pass
        self._process.join(60)


def _contender_main(conn, name, directory, total_bytes):
    try:
        sd = realistic_state_dict(total_bytes)
        expected = touch(sd)
        save, load = contenders(directory, sd)[name]
        conn.send(("ok", (sum(t.numel() * t.element_size() for t in sd.values()), len(sd), expected, os.getpid())))
        while (command := conn.recv()) != "quit":
            if command == "save":
                started = time.perf_counter()
                save()
                seconds = time.perf_counter() - started
                wait_for_frees()  # offload frees the file it replaced after returning: not in the next one's time
                conn.send(("ok", seconds))
                continue
            started = time.perf_counter()
            loaded = load()
            returned = time.perf_counter()
            if touch(loaded) != expected:
                raise RuntimeError(f"{name} loaded different bytes")
            touched = time.perf_counter()
            touch(sd)
            result = {"to return": returned - started, "touched": touched - started, "touch": touched - returned,
                      "control": time.perf_counter() - touched}
            del loaded
            if name == "offload":
                started = time.perf_counter()
                result["collapse"] = {"bytes": collapse_now(), "seconds": time.perf_counter() - started}
            conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds first, fio's included: each process's first save and load "
                             "(reported apart as the first load of the process)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.dir)
    plan = {name: Contender(name, directory, args.total_mib * MIB, saves=save is not None)
            for name, (save, _) in contenders(directory, {}).items()}
    try:
        for contender in plan.values():  # (started together: they import torch and make their state dicts at once)
            contender.wait_ready()
        return _run(args, directory, plan)
    finally:
        for contender in plan.values():
            contender.close()


def _run(args, directory, plan):
    nbytes = plan["offload"].nbytes
    if len({(c.nbytes, c.expected) for c in plan.values()}) != 1:
        raise SystemExit("the contenders' processes made different state dicts")
    print(f"state dict: {plan['offload'].tensors} tensors, {nbytes / 2**30:.2f} GiB; one process per contender",
          file=sys.stderr)
    runs = {}
    collapses = []  # after each offload load: its buffers put back on huge pages, untimed
    touches = {}    # loader -> seconds of each load's timed touch (a byte of every page, after it returned)
    controls = {}   # loader -> seconds of the untimed touch of the source tensors right after that
    plan_file = os.path.join(directory, "bench-offload.safetensors")

    def record(key, seconds):
        runs.setdefault(key, []).append(nbytes / seconds / 1e9)

    def timed_save(name, contender):
        def run():
            record(f"save {name}", contender.save())
        return f"save {name}", run

    def timed_load(name, contender):
        def run():
            drop_page_cache()
            result = contender.load()
            record(f"load {name}", result["touched"])
            touches.setdefault(name, []).append(result["touch"])
            controls.setdefault(name, []).append(result["control"])
            if name == "offload":
                record("load offload, to return", result["to return"])
                collapses.append(result["collapse"])
        return f"load {name}", run

    def timed_fio(rw, direct, fsync=True, huge_pages=True):
        key = f"fio {rw} {'direct' if direct else 'buffered'}" + ("" if fsync else " no-fsync")
        key += "" if huge_pages or not direct else " 4KiB-pages"

        def run():
            gbps = fio(directory, rw, nbytes, direct, fsync, huge_pages)
            if gbps is not None:
                runs.setdefault(key, []).append(gbps)
        return key, run

    # Every write first, then every read: a load right after its own save ran
    # slower when that save was fast (the disk still busy with it), which
    # would charge the fastest saver on its load. Within each phase the
    # order rotates from round to round, fio included, and runs backwards
    # every other round: a load ran faster after some contenders than after
    # others, so none may always follow the same one.
    writes = [timed_save(name, c) for name, c in plan.items() if c.saves]
    writes += [timed_fio("write", True), timed_fio("write", False), timed_fio("write", True, fsync=False)]
    reads = [timed_load(name, c) for name, c in plan.items()]
    reads += [timed_fio("read", True), timed_fio("read", False), timed_fio("read", True, huge_pages=False)]

    def fio_on_offloads_file():
        # The file offload.save wrote this round, read by fio's job: a file's place
        # on the disk moves its read rate (benchmarks/file_placement.py).
        size = os.path.getsize(plan_file) // (4 * MIB) * (4 * MIB)
        gbps = fio(directory, "read", size, True, filename=os.path.basename(plan_file))
        if gbps is not None:
            runs.setdefault("fio read direct, offload's file", []).append(gbps)
    reads.append(("fio read direct, offload's file", fio_on_offloads_file))
    buffers = hugepage_buffers(4 * MIB * 32)[1]
    print(f"fio O_DIRECT buffers: {buffers}", file=sys.stderr)
    progress = Progress((args.warmup + args.repeats) * (len(writes) + len(reads)))
    for round_ in range(args.warmup + args.repeats):
        for phase in (writes, reads):
            for label, run in interleaved(phase, round_):
                run()
                progress.step(label)
    progress.close()
    for name in os.listdir(directory):
        if name.startswith("bench-") or name == "ckpt-fio.bin":
            os.unlink(os.path.join(directory, name))
    # The warm-up rounds (every contender's, fio's too) are kept apart.
    warm = args.warmup
    warmup_runs = {key: values[:warm] for key, values in runs.items()}
    runs, touches, controls = ({key: values[warm:] for key, values in series.items()}
                               for series in (runs, touches, controls))
    first_load = (warmup_runs if warm else runs)["load offload, to return"][0]
    collapses = collapses[warm:]
    medians = {key: statistics.median(values) for key, values in runs.items()}
    # fsynced writes only, huge-page buffers where root could have them: the
    # "no-fsync" and "4KiB-pages" rows are shown, not used.
    limit = {rw: max([medians.get(f"fio {rw} direct", 0), medians.get(f"fio {rw} buffered", 0)]) or None
             for rw in ("write", "read")}
    print(f"\n{'':26} {'GB/s median':>12} {'min':>7} {'max':>7} {'/limit':>7}")
    for key, values in runs.items():
        rw = "write" if key.startswith(("save", "fio write")) else "read"
        ratio = f"{medians[key] / limit[rw]:.2f}" if limit[rw] else "-"
        print(f"{key:26} {medians[key]:12.2f} {min(values):7.2f} {max(values):7.2f} {ratio:>7}")
    checks = {}
    if limit["read"]:
        others = max(v for k, v in medians.items()
                     if k.startswith("load ") and not k.startswith("load offload"))
        checks["load, to return, >= 0.95 of the limit"] = medians["load offload, to return"] / limit["read"]
        checks["load, touched, >= 0.95 of the limit"] = medians["load offload"] / limit["read"]
        checks["first load of the process, to return"] = first_load / limit["read"]
        checks["load, touched, >= the fastest other"] = medians["load offload"] / others
    same_file = runs.get("fio read direct, offload's file")
    if same_file:  # each round's load over fio's read of that very file in the same round
        checks["load, to return, x fio on its file"] = median_ratio(runs["load offload, to return"], same_file)
    if limit["write"]:
        checks["save >= 0.8 of fio's write"] = medians["save offload"] / limit["write"]
    checks["save >= 1.5x safetensors + fsync"] = medians["save offload"] / medians["save safetensors"]
    print()
    for what, value in checks.items():
        print(f"{what:36} {value:.2f}")
    print("of each load's time, the touch after it returned (median s): "
          + ", ".join(f"{name} {statistics.median(values):.3f}" for name, values in touches.items()))
    print("the control right after, the source tensors' touch (median, max s): "
          + ", ".join(f"{name} {statistics.median(values):.3f} {max(values):.3f}" for name, values in controls.items()))
    print("after each offload load, untimed, its new buffers collapsed onto huge pages: "
          + ", ".join(f"{c['bytes'] / 2**30:.2f} GiB in {c['seconds']:.2f} s" for c in collapses))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "tensors": plan["offload"].tensors, "pid": os.getpid(),
                       "contender_pids": {name: c.pid for name, c in plan.items()},
                       "fio_buffers": buffers, "runs": runs, "warmup_runs": warmup_runs,
                       "medians": medians,
                       "limit": limit, "checks": checks, "collapses": collapses,
                       "touch_seconds": touches, "control_touch_seconds": controls}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
