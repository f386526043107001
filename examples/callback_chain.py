"""The read -> compute -> write chain with callbacks, as TensorNVMe users write it.

Layers' weights live on disk; each layer is read back, used, and offloaded again
from inside the read's callback, while the next read is already in flight.

    python examples/callback_chain.py [DIR] [--json FILE]
"""
import argparse
import json
import sys
import tempfile

import torch

from offload import Offloader


def main(directory, json_path=None):
    torch.manual_seed(0)
    weights = [torch.randn(512, 512) for _ in range(8)]
    x = torch.randn(64, 512)
    expected = x
    for w in weights:
        expected = torch.tanh(expected @ w)

    with Offloader(directory) as off:
        off.sync_writev(weights)                      # everything starts on disk
        activations = [x]

        def compute_then_offload(i):
            def callback():                           # runs on this thread, once w is back
                activations.append(torch.tanh(activations[-1] @ weights[i]))
                off.async_write(weights[i])           # back to disk, fire and forget
                if i + 1 < len(weights):
                    off.async_read(weights[i + 1], callback=compute_then_offload(i + 1))
            return callback

        off.async_read(weights[0], callback=compute_then_offload(0))
        off.async_read(weights[1])                    # prefetch: the chain's read of it is then a no-op
        off.synchronize()                             # runs the whole chain
        ok = torch.equal(activations[-1], expected)
        print(f"{len(weights)} layers computed from weights read back from {off.backend} "
              f"({'O_DIRECT' if off.direct else 'buffered'}); result identical to in-memory: {ok}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"layers": len(weights), "layers_computed": len(activations) - 1,
                       "identical_to_in_memory": ok}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--json", help="write the outcome here")
    args = parser.parse_args()
    sys.exit(main(args.dir, args.json))
