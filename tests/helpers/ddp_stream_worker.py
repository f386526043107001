"""One rank of the DDP weight-streaming test (tests/test_parameters_distributed.py).

    python ddp_stream_worker.py RANK WORLD PORT OUT SCRATCH MODE

Builds the same model on every rank, wraps it in DistributedDataParallel
over gloo, and trains it three SGD steps on a batch of its own per rank.
MODE "streamed" streams the wrapped model's weights through an Offloader on
a directory of its own (offload_parameters after the wrap: DDP reads every
weight when it is built), stepping with handle.step; "plain" keeps them in
memory. Writes the final parameters to OUT/MODE-rankRANK.pt.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from offload import Offloader
from offload.nn import offload_parameters


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)], nn.Linear(32, 4))


def main(rank, world, port, out, scratch, mode):
    torch.set_num_threads(1)  # same arithmetic in every process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    handle = None
    if mode == "streamed":
        directory = os.path.join(scratch, f"rank{rank}")
        os.makedirs(directory, exist_ok=True)
        handle = offload_parameters(model, Offloader(directory))
        assert handle.streamed_bytes == sum(p.nbytes for p in model.parameters())
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        nn.functional.mse_loss(ddp(x), y).backward()
        handle.step(opt) if handle is not None else opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.remove()
    torch.save({name: p.detach().clone() for name, p in model.named_parameters()},
               os.path.join(out, f"{mode}-rank{rank}.pt"))
    # No destroy_process_group: it can hang in gloo's destructor (see dcp_worker.py).


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    main(rank, world, port, *sys.argv[4:7])
    # Skip the interpreter's teardown, as dcp_worker.py does: gloo's threads
    # sometimes abort the process there ("terminate called without an active
    # exception"; seen once in the full suite, in the "plain" run, which
    # creates no Offloader), after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
