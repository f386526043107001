"""offload.nn.offload_activations: saved tensors to an Offloader and back,
compared with training without it, bit for bit."""
import contextlib
import errno

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import Offloader
from offload.devices import LateCopyDevice
from offload.nn import offload_activations

# torch 2.4's own non-reentrant checkpoint calls its deprecated
# torch.cpu.amp.autocast when it recomputes (fixed in 2.5).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.cpu.amp.autocast:FutureWarning")


def tiny_transformer(seed=0, layers=3, d_model=64):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def gradients(model, x, context, backward=lambda loss: loss.backward()):
    model.zero_grad(set_to_none=True)
    with context:
        loss = model(x).square().mean()
    backward(loss)
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


class WriteCounter:
    """Counts the Offloader's writes (and what they were of)."""

    def __init__(self, off, monkeypatch):
        self.shapes = []
        real = off.async_write

        def counting(t, callback=None):
            self.shapes.append(tuple(t.shape))
            return real(t, callback)
        monkeypatch.setattr(off, "async_write", counting)


def test_gradients_are_bit_identical_through_the_disk(disk):
    model, x = tiny_transformer(), torch.randn(4, 32, 64)
    loss0, plain = gradients(model, x, contextlib.nullcontext())
    loss1, offloaded = gradients(model, x, offload_activations(disk, min_bytes=16 << 10))
    assert torch.equal(loss0, loss1) and same(plain, offloaded)


@pytest.mark.parametrize("tier", ["pinned", "disk"])
def test_device_tensors_through_the_test_device(tmp_path, tier):
    """The GPU path (Offloader(None): page-locked memory; Offloader(dir): the
    staging pipeline to disk), on the test device whose copies land late."""
    model, x = tiny_transformer(), torch.randn(4, 32, 64)
    _, plain = gradients(model, x, contextlib.nullcontext())
    with Offloader(None if tier == "pinned" else tmp_path, device=LateCopyDevice(seed=2)) as off:
        _, offloaded = gradients(model, x, offload_activations(off, min_bytes=16 << 10))
    assert same(plain, offloaded)


def test_small_tensors_and_parameters_stay_put_and_shared_tensors_go_once(disk, monkeypatch):
    writes = WriteCounter(disk, monkeypatch)
    linear = nn.Linear(512, 512)                      # a 1 MiB weight, saved (as a view) by the matmul
    x = torch.randn(2, 512, requires_grad=True)       # 4 KiB: below min_bytes
    with offload_activations(disk, min_bytes=64 << 10):
        y = linear(x)
    y.sum().backward()
    assert writes.shapes == []                        # neither the parameter nor the small input moved

    a = torch.randn(256, 256, requires_grad=True)
    with offload_activations(disk, min_bytes=64 << 10):
        b = a * 1.5
        c = b * b                                     # b saved twice by one op...
        d = (b.sin() * c).sum()                       # ... and by two more: written once
    d.backward()
    assert writes.shapes.count((256, 256)) == 3       # b once, c once (by the final mul), sin's input is b
    expected = a.detach() * 1.5
    want = ((expected.cos() * expected * expected) + expected.sin() * 2 * expected) * 1.5
    assert torch.allclose(a.grad, want, rtol=1e-5, atol=1e-5)


def test_a_saved_tensor_changed_in_place_is_seen_as_it_was_saved(disk):
    a = torch.randn(256, 256, requires_grad=True)
    with offload_activations(disk, min_bytes=64 << 10):
        b = a * 1
        c = (b * b).sum()
    b_at_save = b.detach().clone()
    with torch.no_grad():
        b.add_(1)                                     # autograd would refuse this without hooks
    c.backward()
    assert torch.equal(a.grad, 2 * b_at_save)         # the snapshot, as save_on_cpu gives


def test_a_tensor_saved_again_after_an_in_place_change_is_saved_again(disk):
    """Two ops save the same tensor, changed in place between them: each
    backward sees the value its own op saved, as if nothing were offloaded
    (the reference computes the same ops out of place)."""
    a = torch.randn(256, 256, requires_grad=True)
    with offload_activations(disk, min_bytes=64 << 10):
        h = a * 1
        s = h.sin()                                   # saves h
        h.mul_(2)
        c = h.cos()                                   # saves h again, changed
        (s + c).sum().backward()
    got, a.grad = a.grad, None
    h = a * 1
    (h.sin() + (h * 2).cos()).sum().backward()
    assert torch.equal(got, a.grad)


def test_a_kept_tensor_changed_in_place_is_refused_like_autograd_does(disk):
    a = torch.randn(16, requires_grad=True)
    with offload_activations(disk, min_bytes=1 << 20):
        b = a * 1
        c = (b * b).sum()
    with torch.no_grad():
        b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.backward()


def test_activation_checkpointing_non_reentrant(disk):
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)) for _ in range(3))
    x = torch.randn(64, 128)

    def run(context):
        blocks.zero_grad(set_to_none=True)
        with context:
            h = x
            for i, block in enumerate(blocks):
                h = checkpoint(block, h, use_reentrant=False) if i % 2 else block(h)
            loss = h.square().mean()
        loss.backward()
        return [p.grad.clone() for p in blocks.parameters()]

    assert same(run(contextlib.nullcontext()), run(offload_activations(disk, min_bytes=16 << 10)))


def test_double_backward_and_a_retained_graph(disk):
    a = torch.randn(128, 128, requires_grad=True)

    def second_order(context):
        with context:
            y = (a.sin() * a).sum()
        (g,) = torch.autograd.grad(y, a, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), a)
        return g.detach(), gg

    g0, gg0 = second_order(contextlib.nullcontext())
    g1, gg1 = second_order(offload_activations(disk, min_bytes=16 << 10))
    assert torch.equal(g0, g1) and torch.equal(gg0, gg1)

    with offload_activations(disk, min_bytes=16 << 10):
        y = (a.exp() * a).sum()
    first = torch.autograd.grad(y, a, retain_graph=True)[0]
    again = torch.autograd.grad(y, a)[0]              # the saved tensors are read back once, kept
    assert torch.equal(first, again)


def test_backward_on_a_freed_graph_is_autograd_own_error(disk):
    a = torch.randn(128, 128, requires_grad=True)
    with offload_activations(disk, min_bytes=16 << 10):
        y = (a.exp() * a).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


def test_a_failed_write_raises_in_forward_and_the_next_step_works(disk):
    model, x = tiny_transformer(), torch.randn(4, 32, 64)
    _, plain = gradients(model, x, contextlib.nullcontext())
    disk.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError) as raised:
        with offload_activations(disk, min_bytes=16 << 10):
            model(x).square().mean()
    assert raised.value.errno == errno.EIO
    assert "shape" in " ".join(getattr(raised.value, "__notes__", []))
    disk.inject_faults()
    _, again = gradients(model, x, offload_activations(disk, min_bytes=16 << 10))
    assert same(plain, again)


@pytest.mark.parametrize("then", ["next-step", "retry"])
def test_a_failed_read_raises_in_backward_and_the_next_step_or_a_retry_works(disk, then):
    """A retry is a backward on the same graph (``retain_graph=True``): the
    reads that failed, the one backward waited for and those issued ahead,
    are read again."""
    model, x = tiny_transformer(), torch.randn(4, 32, 64)
    _, plain = gradients(model, x, contextlib.nullcontext())
    model.zero_grad(set_to_none=True)
    with offload_activations(disk, min_bytes=16 << 10):
        loss = model(x).square().mean()
    disk.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError) as raised:
        loss.backward(retain_graph=then == "retry")
    assert raised.value.errno == errno.EIO
    disk.inject_faults()
    if then == "retry":
        model.zero_grad(set_to_none=True)
        loss.backward()
        again = [p.grad for p in model.parameters()]
    else:
        del loss
        _, again = gradients(model, x, offload_activations(disk, min_bytes=16 << 10))
    assert same(plain, again)


@pytest.mark.parametrize("delay_ms", [0, 20], ids=["disk", "slow-disk"])
def test_memory_held_stays_within_prefetch_plus_two_saved_tensors(disk, delay_ms):
    """Sampled at every layer boundary of forward and backward: the pool
    memory the saved tensors hold. On a slow disk (every I/O held back
    ``delay_ms``) writes pile up unless forward waits for them."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(12)])
    x = torch.randn(1024, 256, requires_grad=True)   # 1 MiB activations (x itself is kept: a leaf)
    pool, samples = offload.buffer_pool(), []

    def sample(*_):
        samples.append(pool.live_bytes)
    for layer in layers:
        layer.register_forward_hook(sample)
        layer.register_full_backward_hook(sample)
    before = pool.live_bytes
    prefetch = 2
    disk.inject_faults(delay_rate=1.0, delay_ms=delay_ms)
    with offload_activations(disk, min_bytes=512 << 10, prefetch=prefetch):
        loss = layers(x).square().mean()
    loss.backward()
    disk.inject_faults()
    largest = 1 << 20
    assert len(samples) == 24
    assert max(samples) - before <= (prefetch + 2) * pool.capacity_for(largest)
    total_saved = 12 * 2 * largest                    # each layer saves its input and tanh's output
    assert max(samples) - before < total_saved // 3


@pytest.mark.parametrize("prefetch", [1, 3])
def test_backward_keeps_prefetch_reads_ahead_of_the_tensor_it_needs(disk, prefetch, monkeypatch):
    """A chain of tanh, each saving its output: when backward reaches the
    k-th saved tensor from the end, it has asked for k + prefetch of them
    (all there are, at most), sampled by gradient hooks that leave the
    graph as it is."""
    n, reads, samples = 12, [], []
    real = disk.async_read

    def counting(t, callback=None):
        reads.append(t)
        return real(t, callback)
    monkeypatch.setattr(disk, "async_read", counting)
    h = torch.randn(1024, 256, requires_grad=True)  # a leaf: kept
    with offload_activations(disk, min_bytes=512 << 10, prefetch=prefetch):
        for _ in range(n):
            h = h.tanh()
            h.register_hook(lambda grad: samples.append(len(reads)))
        loss = h.sum()
    loss.backward()
    assert samples == [0] + [min(k + prefetch, n) for k in range(1, n)]


def test_nothing_of_a_step_remains_after_1000_steps(disk):
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(256, 64)                          # 64 KiB activations
    pool = offload.buffer_pool()
    sizes = []
    for step in range(1000):
        with offload_activations(disk, min_bytes=32 << 10):
            loss = layers(x).square().mean()
        loss.backward()
        if step in (10, 999):
            disk.synchronize()
            sizes.append((disk.file_bytes, pool.live_bytes))
    assert sizes[1][0] <= sizes[0][0]                 # file space reused, not grown
    assert sizes[1][1] <= sizes[0][1]                 # no pool memory held over
