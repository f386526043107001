"""torch.distributed.checkpoint over 2 ranks: offload.dcp against DCP's own
FileSystemWriter/Reader, the device's limits (fio) and offload's
single-process save/load of the same bytes.

    python benchmarks/dcp_benchmark.py DIR [--total-mib 2048] [--rounds 3] [--json out.json]

Two gloo ranks on this machine hold a state dict of --total-mib (16 fp32
tensors sharded on dim 0, half on each rank). Each round, in an order that
rotates from round to round: a durable save by each writer (DCP's with its
fsync on), then a load by each reader after the page cache is dropped
(root), each timed from a barrier before to a barrier after; then, on rank 0
alone, fio writing a new file of the same size durably (``--end_fsync=1``)
and reading it back (O_DIRECT, 4 MiB, iodepth 32, huge-page buffers where
root can have them), and ``offload.save`` / ``offload.load`` of the full
tensors. Medians over the rounds, as GB/s and as ratios.
"""
import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def page_aligned_zeros(like):
    """Zeros shaped like ``like`` in memory that starts on a page (torch's own
    allocations start 64 bytes past one, off O_DIRECT's alignment here)."""
    nbytes = like.numel() * like.element_size()
    raw = torch.zeros(nbytes + 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    return raw[start:start + nbytes].view(like.dtype).view(like.shape)


def worker(rank, world, port, directory, total, rounds, out):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    import offload
    import offload.dcp
    from offload.benchmark import drop_page_cache, fio_job, hugepage_buffers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh("cpu", (world,))
    count = 16
    rows = total // count // 4 // 1024
    g = torch.Generator().manual_seed(0)
    full = {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(count)}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    targets = {"torch": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()},
               "page-aligned": {k: DTensor.from_local(page_aligned_zeros(sd[k].to_local()), mesh, [Shard(0)])
                                for k in full}}
    if rank != 0:
        full = None
    nbytes = total
    # name: (writer, reader, the destination's memory)
    storage = {"offload.dcp": (offload.dcp.Writer, offload.dcp.Reader, "torch"),
               "offload.dcp, 2 files a rank, page-aligned destinations":
                   (lambda p: offload.dcp.Writer(p, files_per_rank=2), offload.dcp.Reader, "page-aligned"),
               "DCP FileSystem": (lambda p: dcp.FileSystemWriter(p, sync_files=True), dcp.FileSystemReader, "torch")}
    times, ways = {}, {}

    def record(key, seconds):
        times.setdefault(key, []).append(seconds)

    def timed_collective(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    mem, note = (hugepage_buffers((4 << 20) * 32) if rank == 0 else (None, None))
    identical = True
    for round_ in range(rounds):
        names = list(storage)
        if round_ % 2:
            names.reverse()
        for name in names:
            path = os.path.join(directory, name.replace(" ", "-").replace(",", ""))
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            record(f"save {name}", timed_collective(lambda: dcp.save(sd, storage_writer=storage[name][0](path))))
        for name in names:
            path = os.path.join(directory, name.replace(" ", "-").replace(",", ""))
            target = targets[storage[name][2]]
            for t in target.values():
                t.to_local().zero_()
            if rank == 0:
                drop_page_cache()
            reader = storage[name][1](path)
            record(f"load {name}", timed_collective(lambda: dcp.load(target, storage_reader=reader)))
            if hasattr(reader, "stats"):
                ways[name] = dataclasses.asdict(reader.stats)
            identical &= all(torch.equal(target[k].to_local(), sd[k].to_local()) for k in sd)
        if rank == 0:
            extra = (mem,) if mem else ()
            fio_file = os.path.join(directory, "dcp-fio.bin")
            if os.path.exists(fio_file):
                os.unlink(fio_file)
            job = fio_job(directory, "write", "4M", nbytes, filename="dcp-fio.bin", extra=extra + ("--end_fsync=1",))
            if job is not None:
                record("fio write (end_fsync)", nbytes / job["bw_bytes"])
                drop_page_cache()
                job = fio_job(directory, "read", "4M", nbytes, filename="dcp-fio.bin", extra=extra)
                record("fio read", nbytes / job["bw_bytes"])
                os.unlink(fio_file)
            single = os.path.join(directory, "single.safetensors")
            start = time.perf_counter()
            offload.save(full, single)
            record("offload.save, 1 process", time.perf_counter() - start)
            drop_page_cache()
            start = time.perf_counter()
            loaded = offload.load(single)
            record("offload.load, 1 process", time.perf_counter() - start)
            identical &= all(torch.equal(loaded[k], full[k]) for k in full)
            del loaded
            os.unlink(single)
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "bytes": nbytes, "identical": identical, "fio_buffers": note,
                       "rank0_bytes_by_way": ways}, f)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    total = args.total_mib << 20
    if args.rank is not None:
        import warnings
        warnings.filterwarnings("ignore")
        worker(args.rank, 2, args.port, args.directory, total, args.rounds, args.out)
        from offload.benchmark import release_hugepage_buffers
        release_hugepage_buffers()  # os._exit below skips the atexit that would
        sys.stdout.flush()
        os._exit(0)  # gloo's threads sometimes abort the interpreter's teardown; the work is done
    directory = os.path.join(args.directory, "dcp-bench")
    os.makedirs(directory, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(directory, "result.json")
    ranks = [subprocess.Popen([sys.executable, __file__, directory, "--total-mib", str(args.total_mib),
                               "--rounds", str(args.rounds), "--rank", str(r), "--port", str(port), "--out", out])
             for r in range(2)]
    codes = [p.wait() for p in ranks]
    if any(codes):
        print(f"a rank failed: exit codes {codes}", file=sys.stderr)
        return 1
    with open(out) as f:
        result = json.load(f)
    shutil.rmtree(directory, ignore_errors=True)
    nbytes = result["bytes"]
    medians = {k: statistics.median(v) for k, v in result["times"].items()}
    gbps = {k: nbytes / v / 1e9 for k, v in medians.items()}
    print(f"{nbytes / 1e9:.2f} GB over 2 ranks, {args.rounds} rounds, medians (GB/s); fio buffers: "
          f"{result['fio_buffers']}; data bit-identical after every load: {result['identical']}")
    for key in sorted(gbps):
        rounds = ', '.join(f'{nbytes / t / 1e9:.2f}' for t in result['times'][key])
        line = f"  {key:32s} {gbps[key]:6.2f} GB/s  ({rounds})"
        rw = "write (end_fsync)" if key.startswith("save") or "save" in key else "read"
        limit = gbps.get(f"fio {rw}")
        if limit and not key.startswith("fio"):
            line += f"  {gbps[key] / limit:.2f}x fio"
        print(line)
    for name, ways in result["rank0_bytes_by_way"].items():
        print(f"  {name}, load on rank 0, bytes by way: {ways}")
    for kind in ("save", "load"):
        ours, theirs = gbps.get(f"{kind} offload.dcp"), gbps.get(f"{kind} DCP FileSystem")
        if ours and theirs:
            theirs_name = "FileSystemWriter" if kind == "save" else "FileSystemReader"
            print(f"  {kind}: offload.dcp is {ours / theirs:.2f}x DCP's {theirs_name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"medians_gbps": gbps, **result}, f, indent=2)
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
