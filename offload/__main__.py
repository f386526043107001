"""python -m offload COMMAND: bench (offload/benchmark.py), inspect and doctor."""
import sys

COMMANDS = {
    "bench": ("offload.benchmark", "the benchmark: GB/s beside fio and the alternatives"),
    "inspect": ("offload.checkpoint", "a safetensors file's tensors: names, dtypes, shapes, sizes"),
    "doctor": ("offload.doctor", "what works on this machine for a directory, and why not"),
}


def main(argv):
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m offload COMMAND [args]   (--help after the command for more)")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:8} {what}")
        return 2
    import importlib
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
