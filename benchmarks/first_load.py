"""A fresh process's first checkpoint load: what loading a model costs.

    python benchmarks/first_load.py DIR [--total-mib 1792] [--rounds 5] [--warmup 1] [--tree NAME=PATH ...]
                                        [--others] [--dcp] [--saves] [--json F]

Saves the checkpoint benchmark's realistic state dict once (hundreds of
tensors, 4 KiB to 256 MiB), then each round: for every tree, drops the page
cache, waits --settle seconds (a VM may hand memory freed by the last process
back to its host), and times ``offload.load`` in a new process, whose pool
has nothing to recycle; then fio reads the same bytes (O_DIRECT, 4 MiB,
iodepth 32, huge-page buffers where root can have them). Trees rotate from
round to round, and run in reverse order every other round. Without --tree it loads the offload this script imports;
``--tree old=/path/to/checkout --tree new=.`` compares two (each PATH goes
first on the child's PYTHONPATH, and the child checks that it imported it).
--others adds safetensors' load_file and torch.load(mmap=True) of the same
tensors, each in a fresh process too. --dcp adds, for every tree, a load of
the same tensors saved as a torch.distributed.checkpoint by offload.dcp's
Writer (one process), read by its Reader into tensors torch allocated first,
as a model's are when a job resumes. Every loader reads a byte of every page
of what it returns before the clock stops (a mapped file is read then).
--saves adds, for every tree, a fresh process that makes the same state dict
(untimed) and times its first ``offload.save`` (durable), against fio's
durable write of a new file of the same size (``--end_fsync=1``) in the
same round. Figures: GB/s per round, medians, and each round's ratio to fio. --warmup
rounds run first, the same way, and are not counted: the first round
favoured whichever contender ran first in it.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402
from offload.benchmark import SETTLE, drop_page_cache, fio_run, hugepage_buffers, interleaved  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_benchmark import fio as checkpoint_fio, realistic_state_dict  # noqa: E402

MIB = 1 << 20
# Every fresh process starts so: argv[1] the file, argv[2] the tree whose
# offload it must have imported (or ""), checked.
FROM_TREE = ("import os, sys, time, torch, offload\n"
             "path, tree = sys.argv[1:3]\n"
             "if tree and not os.path.realpath(offload.__file__).startswith(os.path.realpath(tree) + os.sep):\n"
             "    sys.exit(f'imported {offload.__file__}, not the tree {tree}')\n")
# A fresh process loads the file and reads a byte of every page (so loaders
# that map the file pay for reading it), then prints GB/s.
LOAD = (FROM_TREE +
        "how = sys.argv[3]\n"
        "if how == 'safetensors':\n"
        "    import safetensors.torch\n"
        "    load = safetensors.torch.load_file\n"
        "elif how == 'torch.load(mmap)':\n"
        "    load = lambda p: torch.load(p, mmap=True, weights_only=True)\n"
        "elif how == 'offload.dcp':\n"
        "    import warnings\n"
        "    warnings.simplefilter('ignore')\n"
        "    import torch.distributed.checkpoint as dcp, offload.checkpoint, offload.dcp\n"
        "    twin = os.path.join(os.path.dirname(path), 'first-load.safetensors')\n"
        "    # a model's tensors, made before the clock\n"
        "    into = {e['name']: torch.zeros(e['shape'], dtype=getattr(torch, e['dtype']))\n"
        "            for e in offload.checkpoint.inspect(twin)['tensors']}\n"
        "    load = lambda p: dcp.load(into, storage_reader=offload.dcp.Reader(p)) or into\n"
        "else:\n"
        "    load = offload.load\n"
        "started = time.perf_counter()\n"
        "sd = load(path)\n"
        "for t in sd.values():\n"
        "    int(t.reshape(-1).view(torch.uint8)[::4096].sum())\n"
        "seconds = time.perf_counter() - started\n"
        "print(sum(t.numel() * t.element_size() for t in sd.values()) / seconds / 1e9)\n")


# A fresh process makes the state dict (untimed), saves it with offload.save
# (durable: fsynced, renamed, the directory fsynced), then prints GB/s.
SAVE = (FROM_TREE +
        "mib, here = int(sys.argv[3]), sys.argv[4]\n"
        "sys.path.insert(1, here)\n"
        "from checkpoint_benchmark import realistic_state_dict\n"
        "sd = realistic_state_dict(mib << 20)\n"
        "started = time.perf_counter()\n"
        "offload.save(sd, path, progress=False)\n"
        "seconds = time.perf_counter() - started\n"
        "print(sum(t.numel() * t.element_size() for t in sd.values()) / seconds / 1e9)\n")


def in_fresh_process(code, path, tree, *args):
    """Runs ``code`` (FROM_TREE and more) with argv ``path tree *args``, with
    ``tree`` first on its path; returns the last figure it printed."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, "-c", code, path, tree or "", *map(str, args)], capture_output=True,
                            text=True, env=env, cwd="/")
    if result.returncode:
        raise SystemExit(f"a fresh process failed:\n{result.stderr[-3000:]}")
    return float(result.stdout.split()[-1])


def load_in_fresh_process(path, tree, how="offload"):
    return in_fresh_process(LOAD, path, tree, how)


def save_in_fresh_process(path, tree, mib):
    try:
        return in_fresh_process(SAVE, path, tree, mib, os.path.dirname(os.path.abspath(__file__)))
    finally:
        if os.path.exists(path):
            os.unlink(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--total-mib", type=int, default=1792)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settle", type=float, default=SETTLE,
                        help="seconds before each load (default %(default)s: a machine idle that long)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--others", action="store_true",
                        help="also safetensors.torch.load_file and torch.load(mmap=True), each in a fresh process")
    parser.add_argument("--dcp", action="store_true",
                        help="also each tree's offload.dcp Reader, loading a DCP checkpoint of the same tensors")
    parser.add_argument("--saves", action="store_true",
                        help="also each tree's offload.save of the same state dict (durable), each in a fresh "
                             "process, beside fio's durable write of a new file")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.dir)
    trees = dict(t.split("=", 1) for t in args.tree) or {"offload": ""}
    trees = {name: os.path.abspath(path) if path else "" for name, path in trees.items()}
    path = os.path.join(directory, "first-load.safetensors")
    sd = realistic_state_dict(args.total_mib * MIB)
    offload.save(sd, path)
    size = os.path.getsize(path)
    contenders = {name: (path, tree, "offload") for name, tree in trees.items()}
    if args.others:
        torch_path = os.path.join(directory, "first-load.pt")
        torch.save(sd, torch_path)
        contenders["safetensors"] = (path, "", "safetensors")
        contenders["torch.load(mmap)"] = (torch_path, "", "torch.load(mmap)")
    dcp_path = os.path.join(directory, "first-load.dcp")
    if args.dcp:
        import warnings
        import torch.distributed.checkpoint as dcp
        from offload.dcp import Writer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
            dcp.save(sd, storage_writer=Writer(dcp_path))
        contenders.update({f"{name} dcp": (dcp_path, tree, "offload.dcp") for name, tree in trees.items()})
    del sd
    saves = {f"{name} save": (os.path.join(directory, "first-save.safetensors"), tree, args.total_mib)
             for name, tree in trees.items()} if args.saves else {}
    fio_buffers = hugepage_buffers(4 * MIB * 32)[0]
    runs = {name: [] for name in [*contenders, *saves]}
    runs["fio"] = []
    if saves:
        runs["fio write"] = []
    try:
        for round_ in range(-args.warmup, args.rounds):
            this = {}
            for name in interleaved([*contenders, *saves], round_):
                drop_page_cache()
                time.sleep(args.settle)
                this[name] = load_in_fresh_process(*contenders[name]) if name in contenders else \
                    save_in_fresh_process(*saves[name])
            drop_page_cache()
            this["fio"] = fio_run(directory, "read", "4M", size, extra=(fio_buffers,) if fio_buffers else ())
            if saves:
                time.sleep(args.settle)
                # a new file, fsynced at the end (--end_fsync=1): a durable save's limit
                this["fio write"] = checkpoint_fio(directory, "write", size, direct=True)
            label = f"round {round_ + 1}" if round_ >= 0 else "warm-up, not counted"
            print(f"{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in this.items() if v), file=sys.stderr)
            if round_ >= 0:
                for name, gbps in this.items():
                    runs[name].append(gbps)
    finally:
        for name in ("first-load.safetensors", "first-load.pt", "ckpt-fio.bin"):
            if os.path.exists(os.path.join(directory, name)):
                os.unlink(os.path.join(directory, name))
        shutil.rmtree(dcp_path, ignore_errors=True)
    report = {"bytes": size, "fio_buffers": "huge-page" if fio_buffers else "4 KiB pages", "runs": runs,
              "medians": {k: statistics.median(v) for k, v in runs.items() if all(v)}}
    if all(runs["fio"]):
        report["x_fio"] = {name: [a / f for a, f in zip(runs[name], runs["fio"])] for name in contenders}
    if saves and all(runs["fio write"]):  # to fio's durable write of a new file
        report["x_fio"] = {**report.get("x_fio", {}),
                           **{name: [a / f for a, f in zip(runs[name], runs["fio write"])] for name in saves}}
    print(f"\nfresh-process load{' and save' if saves else ''} of {size / 2**30:.2f} GiB, {args.rounds} rounds "
          f"(fio: {report['fio_buffers']}{'; saves against its durable write of a new file' if saves else ''})")
    for name, values in runs.items():
        ratios = report.get("x_fio", {}).get(name)
        tail = f"  x fio {statistics.median(ratios):.2f} (per round {' '.join(f'{r:.2f}' for r in ratios)})" \
            if ratios else ""
        print(f"  {name:18} {statistics.median(values):6.2f} GB/s{tail}" if all(values) else f"  {name}: no fio")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
