"""A fresh process's first checkpoint load: what loading a model costs.

    python benchmarks/first_load.py DIR [--total-mib 1792] [--rounds 5] [--tree NAME=PATH ...] [--json F]

Saves the checkpoint benchmark's realistic state dict once (hundreds of
tensors, 4 KiB to 256 MiB), then each round: for every tree, drops the page
cache, waits --settle seconds (a VM may hand memory freed by the last process
back to its host), and times ``offload.load`` in a new process, whose pool
has nothing to recycle; then fio reads the same bytes (O_DIRECT, 4 MiB,
iodepth 32, huge-page buffers where root can have them). Trees rotate from
round to round. Without --tree it loads the offload this script imports;
``--tree old=/path/to/checkout --tree new=.`` compares two (each PATH goes
first on the child's PYTHONPATH, and the child checks that it imported it).
Figures: GB/s per round, medians, and each round's ratio to fio.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402
from offload.benchmark import drop_page_cache, fio_run, hugepage_buffers  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_benchmark import realistic_state_dict  # noqa: E402

MIB = 1 << 20
LOAD = ("import os, sys, time, offload\n"
        "tree = sys.argv[2]\n"
        "if tree and not os.path.realpath(offload.__file__).startswith(os.path.realpath(tree) + os.sep):\n"
        "    sys.exit(f'imported {offload.__file__}, not the tree {tree}')\n"
        "started = time.perf_counter()\n"
        "sd = offload.load(sys.argv[1])\n"
        "seconds = time.perf_counter() - started\n"
        "print(sum(t.numel() * t.element_size() for t in sd.values()) / seconds / 1e9)\n")


def load_in_fresh_process(path, tree):
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, "-c", LOAD, path, tree or ""], capture_output=True, text=True,
                            env=env, cwd="/")
    if result.returncode:
        raise SystemExit(f"the load in a fresh process failed:\n{result.stderr[-3000:]}")
    return float(result.stdout.split()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--total-mib", type=int, default=1792)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.dir)
    trees = dict(t.split("=", 1) for t in args.tree) or {"offload": ""}
    trees = {name: os.path.abspath(path) if path else "" for name, path in trees.items()}
    path = os.path.join(directory, "first-load.safetensors")
    offload.save(realistic_state_dict(args.total_mib * MIB), path)
    size = os.path.getsize(path)
    fio_buffers = hugepage_buffers(4 * MIB * 32)[0]
    runs = {name: [] for name in trees}
    runs["fio"] = []
    try:
        for round_ in range(args.rounds):
            names = list(trees)
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                drop_page_cache()
                time.sleep(args.settle)
                runs[name].append(load_in_fresh_process(path, trees[name]))
            drop_page_cache()
            gbps = fio_run(directory, "read", "4M", size, extra=(fio_buffers,) if fio_buffers else ())
            runs["fio"].append(gbps)
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items() if v[-1]),
                  file=sys.stderr)
    finally:
        os.unlink(path)
    report = {"bytes": size, "fio_buffers": "huge-page" if fio_buffers else "4 KiB pages", "runs": runs,
              "medians": {k: statistics.median(v) for k, v in runs.items() if all(v)}}
    if all(runs["fio"]):
        report["x_fio"] = {name: [a / f for a, f in zip(runs[name], runs["fio"])] for name in trees}
    print(f"\nfresh-process load of {size / 2**30:.2f} GiB, {args.rounds} rounds (fio: {report['fio_buffers']})")
    for name, values in runs.items():
        ratios = report.get("x_fio", {}).get(name)
        tail = f"  x fio {statistics.median(ratios):.2f} (per round {' '.join(f'{r:.2f}' for r in ratios)})" \
            if ratios else ""
        print(f"  {name:12} {statistics.median(values):6.2f} GB/s{tail}" if all(values) else f"  {name}: no fio")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
