"""ZeroRedundancyOptimizer over gloo with each rank's shard offloaded."""
import os
import socket
import subprocess
import sys

import torch

from conftest import popen_python

WORKER = os.path.join(os.path.dirname(__file__), "helpers", "zero_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(worker, world, *args):
    """Runs ``worker RANK WORLD PORT *args`` once per rank, at once; fails
    with a rank's output if it fails."""
    port = free_port()
    ranks = [popen_python([sys.executable, worker, str(rank), str(world), str(port), *map(str, args)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    for rank, process in enumerate(ranks):
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, f"rank {rank} of {world} failed:\n{output}"


def run_ranks(world, out, scratch):
    launch_ranks(WORKER, world, out, scratch)
    return [torch.load(out / f"world{world}-rank{rank}.pt", weights_only=True) for rank in range(world)]


def test_two_rank_zero_with_offloaded_shards_matches_one_process(tmp_path):
    (reference,) = run_ranks(1, tmp_path, tmp_path)
    ranks = run_ranks(2, tmp_path, tmp_path)
    for result in ranks:  # every rank ends with the single-process parameters, bit for bit
        assert result["params"].keys() == reference["params"].keys()
        for name, value in reference["params"].items():
            assert torch.equal(result["params"][name], value), name
    # Each rank kept only its shard, all of it on its own store.
    counts = [r["local_params"] for r in ranks]
    assert sum(counts) == len(reference["optimizer"]["state"]) and min(counts) > 0
    assert all(r["local_state_in_memory"] == 0 and r["offloaded_bytes"] > 0 for r in ranks)
    # The consolidated optimizer state equals the single-process one.
    merged, expected = ranks[0]["optimizer"]["state"], reference["optimizer"]["state"]
    assert merged.keys() == expected.keys()
    for index, entry in expected.items():
        for key, value in entry.items():
            assert torch.equal(merged[index][key], value), (index, key)
