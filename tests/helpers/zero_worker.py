"""One rank of the ZeRO test (tests/test_optim_distributed.py).

    python zero_worker.py RANK WORLD PORT OUT SCRATCH

WORLD=1 trains with plain AdamW (the reference); WORLD>1 with torch's
ZeroRedundancyOptimizer over gloo, each rank's shard in an OffloadedOptimizer
on its own directory. Every rank sees the same batches, so DDP's average of
identical gradients is exact and the results must match bit for bit.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_optim import make_model, train_steps  # noqa: E402

from offload import Offloader  # noqa: E402
from offload.optim import offloaded  # noqa: E402

STEPS = 8


def main(rank, world, port, out, scratch):
    torch.set_num_threads(1)  # same arithmetic in every process
    model = make_model()
    options = dict(lr=1e-2, weight_decay=0.1)
    if world == 1:
        net, opt = model, torch.optim.AdamW(model.parameters(), **options)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        directory = os.path.join(scratch, f"rank{rank}")
        os.makedirs(directory, exist_ok=True)
        net = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=offloaded(
            torch.optim.AdamW, lambda: Offloader(directory), prefetch=1), **options)
    train_steps(model, opt, None, STEPS, net=net)
    result = {"params": {k: v.clone() for k, v in model.state_dict().items()}}
    if world > 1:
        local = opt.optim
        result["local_params"] = sum(len(g["params"]) for g in local.param_groups)
        result["local_state_in_memory"] = sum(
            v.untyped_storage().nbytes() for s in local.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0)
        result["offloaded_bytes"] = local.offloader.file_bytes
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            result["optimizer"] = opt.state_dict()
        dist.barrier()
        torch.save(result, os.path.join(out, f"world{world}-rank{rank}.pt"))
        # No destroy_process_group: on torch 2.1 gloo's destructor, holding the
        # GIL, can join a worker thread that needs the GIL to free the tensors
        # of consolidate_state_dict's broadcasts (seen under py-spy: the rank
        # hangs for good). Teardown is not what this test checks.
        sys.stdout.flush()
        os._exit(0)
    result["optimizer"] = opt.state_dict()
    torch.save(result, os.path.join(out, f"world{world}-rank{rank}.pt"))


if __name__ == "__main__":
    rank, world, port = (int(v) for v in sys.argv[1:4])
    main(rank, world, port, sys.argv[4], sys.argv[5])
