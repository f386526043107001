"""One rank of the DCP tests (tests/test_dcp.py).

    python dcp_worker.py save|load|save-fails STORAGE PATH RANK WORLD PORT [OUT]

STORAGE is "offload" (offload.dcp), "offload-buffered" (its Reader without
O_DIRECT: large records go straight into any memory; each rank prints its
ReadStats) or "torch" (DCP's FileSystemWriter/Reader).
WORLD > 1 runs over gloo with every tensor a DTensor sharded on dim 0 across
the ranks; WORLD 1 uses plain tensors and no process group. ``load`` writes
the full tensors it loaded to OUT (rank 0) for the test to compare.
``save-fails`` makes rank 1's data file allocation fail with ENOSPC.
"""
import errno
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import offload.dcp  # noqa: E402


def full_state():
    g = torch.Generator().manual_seed(0)
    return {"layer": {"weight": torch.randn(64, 32, generator=g), "bias": torch.randn(64, generator=g)},
            "embed": torch.randn(1000, 16, generator=g).to(torch.bfloat16),
            "counts": torch.arange(48, dtype=torch.int64), "step": 7,
            "big": torch.randn(1 << 17, 4, generator=g)}  # 2 MiB: 1 MiB shards, read without a copy


def sharded(state, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor
    if mesh is None:
        return state
    return {k: sharded(v, mesh) if isinstance(v, dict) else
            distribute_tensor(v, mesh, [Shard(0)]) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def zeroed(state):
    return {k: zeroed(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
            for k, v in state.items()}


def full(state):
    return {k: full(v) if isinstance(v, dict) else
            v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def main(command, storage, path, rank, world, port, out=None):
    torch.set_num_threads(1)
    mesh = None
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    writer = offload.dcp.Writer if storage.startswith("offload") else dcp.FileSystemWriter
    reader = {"offload": offload.dcp.Reader, "torch": dcp.FileSystemReader,
              "offload-buffered": lambda path: offload.dcp.Reader(path, direct=False)}[storage](path)
    if command.startswith("save"):
        if command == "save-fails" and rank == 1:
            def full_disk(*args):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.posix_fallocate = full_disk
        dcp.save(sharded(full_state(), mesh), storage_writer=writer(path))
    else:
        state = zeroed(sharded(full_state(), mesh))
        dcp.load(state, storage_reader=reader)
        loaded = full(state)
        if rank == 0:
            torch.save(loaded, out)
        print(getattr(reader, "stats", ""))
    # No destroy_process_group: gloo's destructor, holding the GIL, can join
    # a worker thread that needs the GIL to free a broadcast's tensors, and
    # the rank hangs for good (on torch 2.5, half the 2-rank saves, with
    # DCP's own FileSystemWriter as with offload's: seen under py-spy;
    # zero_worker.py saw it on 2.1). Teardown is not what these tests check.


if __name__ == "__main__":
    args = sys.argv[1:]
    code = 0
    try:
        main(args[0], args[1], args[2], int(args[3]), int(args[4]), int(args[5]), *args[6:])
    except BaseException:
        traceback.print_exc()
        code = 1
    # Skip the interpreter's teardown: gloo's threads sometimes abort the
    # process there ("terminate called without an active exception", with
    # DCP's own reader as with offload's), after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
