"""Weight streaming under DistributedDataParallel: two gloo ranks, each
streaming its replica, against the same training with weights in memory."""
import os
import sys

import torch

from test_optim_distributed import launch_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
from ddp_stream_worker import make_model  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "helpers", "ddp_stream_worker.py")


def run_ranks(mode, out, world=2):
    launch_ranks(WORKER, world, out, out, mode)
    return [torch.load(out / f"{mode}-rank{rank}.pt", weights_only=True) for rank in range(world)]


def test_ddp_wrapped_then_streamed_trains_bit_identical_to_ddp_in_memory(tmp_path):
    plain, streamed = run_ranks("plain", tmp_path), run_ranks("streamed", tmp_path)
    reference = plain[0]
    initial = dict(make_model().named_parameters())
    assert all(not torch.equal(value, initial[name]) for name, value in reference.items())  # it trained
    for result in plain[1:] + streamed:  # every rank of both runs ends with the same weights, bit for bit
        assert result.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(result[name], value), name
