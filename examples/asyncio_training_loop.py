"""`await off.read(t)` inside an asyncio training loop, with prefetching.

A toy model whose layer weights live on disk between uses: while layer i is
updated, layer i+1 is already being read. The loop keeps serving other tasks
(a heartbeat here) while the I/O is in flight.

    python examples/asyncio_training_loop.py [DIR] [--json FILE]
"""
import argparse
import asyncio
import json
import sys
import tempfile

import torch

from offload import Offloader


async def train(off, weights, steps=3):
    beats = 0

    async def heartbeat():
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(heartbeat())
    reference = [w.clone() for w in weights]
    await off.write(weights)                           # all layers start on disk
    for step in range(steps):
        pending = off.read(weights[0])
        for i, w in enumerate(weights):
            await pending                              # layer i is back
            if i + 1 < len(weights):
                pending = off.read(weights[i + 1])     # prefetch the next one
            w.mul_(0.99).add_(0.01)                    # the "update"
            reference[i].mul_(0.99).add_(0.01)
            off.write(w)                               # offload it again, don't wait
        await off.read(weights)                        # a step's end: all back (ordered after the writes)
        await off.write(weights)
    await off.read(weights)
    task.cancel()
    return all(torch.equal(a, b) for a, b in zip(weights, reference)), beats


def main(directory, json_path=None):
    weights = [torch.randn(256, 256) for _ in range(6)]
    with Offloader(directory) as off:
        ok, beats = asyncio.run(train(off, weights))
        print(f"3 steps over {len(weights)} offloaded layers on {off.backend}: weights exact: {ok}; "
              f"the event loop ran {beats} other task turns meanwhile")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"layers": len(weights), "weights_exact": ok, "other_task_turns": beats}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--json", help="write the outcome here")
    args = parser.parse_args()
    sys.exit(main(args.dir, args.json))
