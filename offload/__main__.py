"""python -m offload bench DIR: the benchmark (see offload/benchmark.py)."""
import sys


def main(argv):
    commands = {"bench": "offload.benchmark"}
    if not argv or argv[0] not in commands:
        print("usage: python -m offload bench [DIR] [options]   (--help after the command for more)")
        return 2
    import importlib
    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
