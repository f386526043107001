"""Drop-in habits: TensorNVMe's names and README examples, our README's
quick start, and every asyncio entry point users reach for."""
import asyncio
import os
import sys
import time

import pytest
import torch

import offload
from offload import DiskOffloader, Offloader
from offload.devices import LateCopyDevice
from conftest import backing_fds, same_bits


def test_tensornvme_readme_synchronous_example_runs_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # TensorNVMe's README, "synchronize API", with only the import changed:
    x = torch.rand(2, 2)
    y = torch.rand(4, 4, 4)
    x_, y_ = x.clone(), y.clone()
    offloader = DiskOffloader('./offload')
    offloader.sync_write(x)
    # x is saved to a file on disk (in ./offload folder) and the memory of x is freed
    offloader.sync_read(x)
    # x is restored
    offloader.sync_writev([x, y])
    # x and y are offloaded
    offloader.sync_readv([x, y])
    # x and y are restored.
    assert torch.equal(x, x_) and torch.equal(y, y_)
    assert (tmp_path / "offload").is_dir()            # created, as TensorNVMe does
    offloader.close()


def test_our_readme_quick_start_runs_as_written(tmp_path):
    """README.md's first Python block, with its directory pointed here: it
    runs, the callback's write leaves t released, and its asyncio ``step``
    reads, adds and writes back."""
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        code = f.read().split("```python\n", 1)[1].split("```", 1)[0]
    assert '"/nvme/scratch"' in code
    scope = {}
    exec(compile(code.replace('"/nvme/scratch"', repr(str(tmp_path))), "README.md", "exec"), scope)
    assert scope["t"].shape == (4096, 4096) and scope["t"].untyped_storage().nbytes() == 0
    with Offloader(tmp_path) as off:
        x = torch.randn(1000)
        expected = x + 1
        off.sync_write(x)
        asyncio.run(scope["step"](off, x))
        assert x.untyped_storage().nbytes() == 0   # written back by the step
        off.sync_read(x)
        assert same_bits(x, expected)


def test_tensornvme_readme_asynchronous_example_runs_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x = torch.rand(2, 2)
    y = torch.rand(4, 4, 4)
    x_, y_ = x.clone(), y.clone()
    offloader = DiskOffloader('./offload')
    offloader.async_write(x)
    # x is being offloaded in the background
    offloader.sync_write_events()
    # x is offloaded and the memory of x is freed
    assert x.untyped_storage().nbytes() == 0
    offloader.async_read(x)
    # x is being restored in the background
    offloader.sync_read_events()
    # x is restored
    assert torch.equal(x, x_)
    offloader.async_writev([x, y])
    # x and y are being offloaded in the background
    offloader.synchronize()
    # synchronize() will synchronize both write and read events.
    offloader.async_readv([x, y])
    offloader.synchronize()
    # x and y are restored.
    assert torch.equal(x, x_) and torch.equal(y, y_)
    offloader.close()


@pytest.mark.parametrize("device", [None, "late-copy"])
def test_sync_write_events_waits_for_writes_only_when_reads_are_slow(tmp_path, device):
    """Writes finished, a read still in flight: sync_write_events returns,
    sync_read_events waits for the read."""
    off = Offloader(tmp_path, device=LateCopyDevice(seed=1) if device else None)
    a, b = torch.randn(1 << 20), torch.randn(1 << 20)
    a_ = a.clone()
    off.sync_write(a)
    off.inject_faults(delay_rate=1.0, delay_ms=1500)  # the read finishes on disk, then is held back
    read = off.async_read(a)
    time.sleep(0.2)
    assert not read.done()                            # reaped by the engine, and held back
    off.inject_faults()                               # from now on nothing is held back
    off.async_write(b)
    off.sync_write_events()
    assert b.untyped_storage().nbytes() == 0          # the write is done...
    assert not read.done()                            # ...and the slow read was not waited for
    off.sync_read_events()
    assert read.done() and torch.equal(a, a_)
    off.close()


def test_diskoffloader_backend_names_map_onto_engines(tmp_path):
    with DiskOffloader(tmp_path / "a", backend="pthread") as off:
        assert off.backend == "threads"
    with pytest.raises(ValueError, match="GPUDirect"):
        DiskOffloader(tmp_path / "b", backend="gds")


def test_every_asyncio_entry_point(tmp_path):
    t = torch.randn(1 << 20)
    expected = t.clone()
    off = Offloader(tmp_path)

    async def main():
        await off.write(t)                                          # await
        await asyncio.gather(off.read(t))                           # gather
        await asyncio.create_task(off.write(t))                     # create_task
        await asyncio.ensure_future(off.read(t))                    # ensure_future
        await asyncio.wait_for(off.write(t), timeout=30)            # wait_for
        done, _ = await asyncio.wait([asyncio.create_task(off.read(t))])
        assert len(done) == 1
        if sys.version_info >= (3, 11):
            async with asyncio.TaskGroup() as group:               # TaskGroup.create_task
                group.create_task(off.write(t))
            async with asyncio.TaskGroup() as group:
                group.create_task(off.read(t))
        assert torch.equal(t, expected)
        failing = off.read(torch.randn(4))                          # never written: refused at the call
        return failing

    with pytest.raises(RuntimeError, match="never written"):
        asyncio.run(main())
    assert torch.equal(t, expected)
    off.close()


def test_a_failed_operation_raises_from_its_task(tmp_path):
    import errno
    t = torch.randn(1 << 20)
    off = Offloader(tmp_path)
    off.inject_faults(error_rate=1.0, errnos=[errno.EIO])

    async def main():
        with pytest.raises(OSError) as raised:
            await asyncio.create_task(off.write(t))
        return raised.value.errno

    assert asyncio.run(main()) == errno.EIO
    off.inject_faults()
    off.close()
    assert isinstance(off, offload.Offloader)


def test_accelerate_disk_offload_spelling(tmp_path):
    """accelerate users' call, unchanged but for the import."""
    import torch
    from torch import nn
    from offload.nn import disk_offload

    def net():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)])
    ref, model, x = net(), net(), torch.randn(2, 16)
    handle = disk_offload(model, tmp_path / "offload", execution_device="cpu")
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert len(backing_fds(tmp_path / "offload")) == 1  # the Offloader disk_offload made for it
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    handle.remove()
    assert backing_fds(tmp_path / "offload") == []      # closed with it
    with pytest.raises(ValueError, match="offload_buffers"):
        disk_offload(net(), tmp_path / "b", offload_buffers=True)
    with pytest.raises(ValueError, match="outside every block"):
        disk_offload(net(), tmp_path / "c", preload_module_classes=["Sequential"])
    disk_offload(net(), tmp_path / "d", preload_module_classes=["Linear"]).remove()
