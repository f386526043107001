"""The benchmark harness (the same as `python -m offload bench`); results go in BENCHMARKS.md.

    python benchmarks/run_benchmark.py DIR [--repeats 3] [--json results.json]
"""
import sys

from offload.benchmark import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
