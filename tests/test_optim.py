"""OffloadedOptimizer: exact results, bounded memory, atomic steps, state_dict."""
import copy
import errno
import io

import pytest
import torch
from torch import nn

from conftest import ENGINE_CONFIGS, engine_config_id, fused_adamw_on_cpu, same_bits
from offload import Offloader
from offload.optim import OffloadedOptimizer, offloaded


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True),
        nn.LayerNorm(32),
        nn.Linear(32, 8))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, 8, generator=g)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True,
                                                   weight_decay=1e-4),
    "adam-amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
}


if fused_adamw_on_cpu():  # the one-pass CPU kernel a ZeRO-Offload user picks (as DeepSpeed's CPU Adam)
    OPTIMIZERS["adamw-fused"] = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def train_steps(model, opt, scheduler, steps, first=0, net=None):
    """Steps with clipping; ``net`` (e.g. DistributedDataParallel(model)) runs the forward."""
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss((net or model)(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def assert_same_state(sd_a, sd_b):
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for index, entry in sd_a["state"].items():
        assert entry.keys() == sd_b["state"][index].keys()
        for key, value in entry.items():
            other = sd_b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (index, key)
            else:
                assert value == other


def assert_same_params(model_a, model_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name


def offloaded_pair(kind, off, prefetch=2, **options):
    """Unless told otherwise, whole parameters one at a time (chunk_size=0):
    the small test model would otherwise be updated as one group."""
    options.setdefault("chunk_size", 0)
    reference, model = make_model(), make_model()
    ref_opt = OPTIMIZERS[kind](reference.parameters())
    opt = OffloadedOptimizer(OPTIMIZERS[kind](model.parameters()), off, prefetch,
                             names=model.named_parameters(), **options)
    return reference, ref_opt, model, opt


def read_ahead_count(sizes, prefetch=2) -> int:
    """How many of the first pieces (of ``sizes`` elements, float32) a step
    reads ahead: those weighing at most prefetch x the largest together."""
    room, total = prefetch * max(sizes), 0
    for count, size in enumerate(sizes):
        total += size
        if total > room:
            return count
    return len(sizes)


def read_ahead_for_next_step(opt, model) -> int:
    """How many pieces (whole parameters) the step that just ended read ahead
    for the next one: the first read_ahead_count, but none from the first
    whose write it left running on (write_behind: the last pieces, in the
    test model up to 15 small ones)."""
    params = list(model.parameters())
    running = [i for w in opt._behind for i, p in enumerate(params) if p is w.units[0].param]
    return min([read_ahead_count([p.numel() for p in params])] + running)


def state_in_memory(opt) -> int:
    """Bytes of memory held by state tensors (a chunked parameter's entries are meta tensors)."""
    return sum(v.untyped_storage().nbytes() for state in opt.state.values()
               for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0 and not v.is_meta)


CHUNK_SIZES = ([0, 100, None], ["whole", "chunks-of-100", "default"])
CHUNKS = pytest.mark.parametrize("chunk_size", CHUNK_SIZES[0], ids=CHUNK_SIZES[1])


# Every optimizer and chunking on the default engine (uring, O_DIRECT); every
# other engine configuration with the case that keeps the most state.
STEP_CASES = [pytest.param(ENGINE_CONFIGS[0], kind, chunk, id=f"{engine_config_id(ENGINE_CONFIGS[0])}-{kind}-{name}")
              for kind in OPTIMIZERS for chunk, name in zip(*CHUNK_SIZES)]
STEP_CASES += [pytest.param(config, "adam-amsgrad", 100, id=f"{engine_config_id(config)}-adam-amsgrad-chunks-of-100")
               for config in ENGINE_CONFIGS[1:]]


@pytest.mark.parametrize("engine_config,kind,chunk_size", STEP_CASES, indirect=["engine_config"])
def test_twenty_steps_are_bit_identical_with_clipping_and_a_scheduler(offloader, kind, chunk_size):
    reference, ref_opt, model, opt = offloaded_pair(kind, offloader, chunk_size=chunk_size)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    for step in range(20):
        train_steps(reference, ref_opt, ref_sched, 1, step)
        train_steps(model, opt, sched, 1, step)
        assert state_in_memory(opt) == 0   # between steps, every state tensor is in the store
    assert_same_params(reference, model)
    assert_same_state(ref_opt.state_dict(), opt.state_dict())
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 4


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("atomic", [True, False])
def test_prefetch_depths_and_modes_give_the_same_result(tmp_path, prefetch, atomic):
    with Offloader(tmp_path) as off:
        reference, ref_opt, model, opt = offloaded_pair("adamw", off, prefetch, atomic=atomic)
        train_steps(reference, ref_opt, None, 5)
        train_steps(model, opt, None, 5)
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())


def test_chunks_bound_the_resident_state_of_large_parameters(tmp_path):
    """A parameter larger than chunk_size moves in chunks: the memory held
    during a step is (prefetch + 2) chunks' state, not the parameter's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))   # 65,536 + 2,048 weights
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters())
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), off, 2, chunk_size=4096)
        for step in range(3):
            for m, o in ((reference, ref_opt), (model, opt)):
                m(torch.randn(4, 256, generator=torch.Generator().manual_seed(step))).square().sum().backward()
                o.step()
                o.zero_grad()
        chunk_state = 2 * 4096 * 4
        assert 0 < opt.stats.peak_state_bytes <= 4 * chunk_state      # whole weight: 2 * 65,536 * 4
        assert opt.stats.state_bytes_read == opt.stats.state_bytes_written == 2 * 4 * (65_536 + 256 + 2_048 + 8)
        assert state_in_memory(opt) == 0
        weight = model[0].weight
        assert opt.state[weight]["exp_avg"].is_meta and opt.state[weight]["exp_avg"].shape == weight.shape
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())


def test_chunked_and_whole_state_dicts_are_interchangeable(tmp_path):
    with Offloader(tmp_path) as off:
        reference, ref_opt, model, opt = offloaded_pair("adamw", off, chunk_size=100)
        train_steps(reference, ref_opt, None, 2)
        train_steps(model, opt, None, 2)
        saved = opt.state_dict()
        assert_same_state(ref_opt.state_dict(), saved)
        whole_model = copy.deepcopy(model)
        whole = OffloadedOptimizer(torch.optim.AdamW(whole_model.parameters(), lr=1e-2, weight_decay=0.1),
                                   off, chunk_size=0)
        whole.load_state_dict(saved)
        rechunked = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                       off, chunk_size=64)
        rechunked.load_state_dict(whole.state_dict())
        assert state_in_memory(whole) == state_in_memory(rechunked) == 0
        train_steps(reference, ref_opt, None, 2, 2)
        train_steps(whole_model, whole, None, 2, 2)
        train_steps(model, rechunked, None, 2, 2)
        assert_same_params(reference, whole_model)
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), rechunked.state_dict())


def test_chunks_need_an_elementwise_optimizer(tmp_path):
    model = make_model()
    with Offloader(tmp_path) as off:
        with pytest.raises(ValueError, match="element by element"):
            OffloadedOptimizer(torch.optim.Rprop(model.parameters()), off, chunk_size=1024)

        class Custom(torch.optim.AdamW):  # a subclass may do anything in step(): whole parameters
            pass

        assert OffloadedOptimizer(Custom(model.parameters()), off).chunk_size == 0
        assert OffloadedOptimizer(torch.optim.AdamW(model.parameters()), off).chunk_size == 1 << 22
        # Chunks start where a fused kernel's vectors do (the fused case above fails on chunks of 100).
        assert OffloadedOptimizer(torch.optim.AdamW(model.parameters()), off, chunk_size=100).chunk_size == 128
        embedding = nn.Embedding(100, 8, sparse=True)
        opt = OffloadedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9), off, chunk_size=64)
        embedding(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(ValueError, match="sparse gradient.*chunk_size=0"):
            opt.step()
        whole = OffloadedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1), off, chunk_size=0)
        whole.step()                               # whole parameters take sparse gradients as SGD does


@pytest.mark.parametrize("overlap", [{}, {"write_behind": True, "read_ahead": True}], ids=["", "overlapped"])
@pytest.mark.parametrize("prefetch,write_depth", [(0, 2), (2, 2), (1, 4)])
def test_resident_state_stays_within_prefetch_plus_write_depth_parameters(tmp_path, prefetch, write_depth,
                                                                         overlap):
    """Observed from outside: during every per-parameter update, the state
    tensors holding memory and the pool's live bytes (every read buffer and
    write in flight) stay under (prefetch + write_depth) of the largest
    parameter's state."""
    from offload import buffer_pool
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])  # 16 parameters
    inner = torch.optim.AdamW(model.parameters())
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(inner, off, prefetch, atomic=False, chunk_size=0,  # one by one
                                 write_depth=write_depth, **overlap)
        largest = max(2 * p.numel() * 4 for p in model.parameters())
        total = sum(2 * p.numel() * 4 for p in model.parameters())
        def train(steps):
            for _ in range(steps):
                model(torch.randn(4, 128)).square().sum().backward()
                opt.step()
                opt.zero_grad()

        train(1)                                  # creates the state
        pool = buffer_pool()
        samples = []
        inner_step = inner.step

        def observed_step(*args, **kwargs):
            samples.append((state_in_memory(opt), pool.live_bytes - baseline))
            return inner_step(*args, **kwargs)

        inner.step = observed_step
        baseline = pool.live_bytes
        train(2)
        bound = (prefetch + write_depth) * largest
        assert len(samples) == 2 * 16
        assert max(s for s, _ in samples) <= bound
        assert max(p for _, p in samples) <= bound + 16 * 4096  # per-tensor rounding to 4 KiB
        assert 0 < opt.stats.peak_state_bytes <= bound
        # (The bound is the guarantee. With (1, 4) it is 5 of the 8 weights' state, more than half
        # the whole, so 4 weights and 4 biases resident at once, exactly half, are within it.)
        assert opt.stats.state_bytes_read == opt.stats.state_bytes_written == total


@pytest.mark.parametrize("write_depth", [1, 3])
def test_the_update_of_a_piece_waits_for_the_write_write_depth_pieces_before(tmp_path, monkeypatch, write_depth):
    """With pieces of one size, the update of piece i first looks at the
    write of piece i - write_depth (``done()``, then ``wait()`` if it is
    still running), and at no later write: up to write_depth - 1 writes run
    on behind each update. Seen through the handles the Offloader returns,
    whatever the timing. Results stay bit-identical."""
    from offload.handle import Handle
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(8)])  # 8 pieces, one by one
    reference = copy.deepcopy(model)
    ref_opt, inner = torch.optim.AdamW(reference.parameters()), torch.optim.AdamW(model.parameters())
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(inner, off, 1, chunk_size=0, write_depth=write_depth)

        def train(step):
            for m, o in ((reference, ref_opt), (model, opt)):
                m(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).square().sum().backward()
                o.step()
                o.zero_grad()

        train(0)  # the state is made
        events, writes = [], {}  # id(handle) -> the piece it writes, in the order the step issues them
        async_writev, done, inner_step = off.async_writev, Handle.done, inner.step

        def recording_writev(tensors, callback=None):
            handle = async_writev(tensors, callback)
            writes[id(handle)] = len(writes)
            return handle

        def recording_done(handle):
            if id(handle) in writes:
                events.append(("checked", writes[id(handle)]))
            return done(handle)

        def recording_step(*args, **kwargs):
            events.append(("update", sum(e[0] == "update" for e in events)))
            return inner_step(*args, **kwargs)

        monkeypatch.setattr(off, "async_writev", recording_writev, raising=False)
        monkeypatch.setattr(Handle, "done", recording_done)
        inner.step = recording_step
        train(1)
        monkeypatch.undo()
        pieces = 8
        assert len(writes) == pieces
        first_check = {piece: events.index(("checked", piece)) for piece in range(pieces)}
        for i in range(pieces):
            update = events.index(("update", i))
            if i >= write_depth:
                assert first_check[i - write_depth] < update, (i, events)
            for later in range(max(0, i - write_depth + 1), pieces):
                assert first_check[later] > update, (i, later, events)
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())
        with pytest.raises(ValueError, match="write_depth"):
            OffloadedOptimizer(torch.optim.AdamW(model.parameters()), off, write_depth=0)


def test_a_run_of_small_pieces_does_not_hold_back_the_reads_after_it(tmp_path):
    """The read window counts bytes, not pieces: with prefetch 2, the three
    pieces after the first (3,072, 64 and 4,032 elements) weigh less than
    two of the largest (4,096), so the read of the last one starts before
    the first update, as a count of two pieces would not let it. The state
    in memory stays within (prefetch + write_depth) x the largest piece's."""
    sizes = [4096, 3072, 64, 4032]
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in sizes]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    ref_opt, inner = torch.optim.AdamW(reference), torch.optim.AdamW(params)
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(inner, off, 2, chunk_size=0)

        def train(step):
            for ps, o in ((reference, ref_opt), (params, opt)):
                g = torch.Generator().manual_seed(step)
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=g)
                o.step()

        train(0)  # the state is made
        events, async_readv, inner_step = [], off.async_readv, inner.step

        def recording_readv(tensors, callback=None):
            events.append(("read", sizes.index(tensors[0].numel())))
            return async_readv(tensors, callback)

        def recording_step(*args, **kwargs):
            events.append(("update",))
            return inner_step(*args, **kwargs)

        off.async_readv, inner.step = recording_readv, recording_step
        train(1)
        del off.async_readv
        inner.step = inner_step
        assert events[:5] == [("read", 0), ("read", 1), ("read", 2), ("read", 3), ("update",)], events
        assert 0 < opt.stats.peak_state_bytes <= (2 + 2) * 2 * 4 * max(sizes)
        for a, b in zip(reference, params):
            assert torch.equal(a, b)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())


def updates_per_step(model) -> int:
    return len(list(model.parameters()))  # chunk_size=0: one update per parameter


DIRECT_ENGINES = [pytest.param(c, id=engine_config_id(c)) for c in ENGINE_CONFIGS if c[1]]


@pytest.mark.parametrize("engine_config", DIRECT_ENGINES, indirect=True)
@pytest.mark.parametrize("write_behind", [False, True])
def test_write_behind_returns_before_the_last_writes_land_and_gives_the_same_bits(offloader, write_behind):
    """From the last update of step 4 on, every completion is held back 1 s:
    a step that waits for its writes cannot return before they land."""
    off = offloader
    reference, ref_opt, model, opt = offloaded_pair("adamw", off, write_behind=write_behind)
    train_steps(reference, ref_opt, None, 8)
    train_steps(model, opt, None, 3)
    fail_after(opt, updates_per_step(model), lambda: off.inject_faults(delay_rate=1.0, delay_ms=1000))
    train_steps(model, opt, None, 1, 3)
    left = opt.stats.writes_left_in_flight
    behind = [w.weight for w in opt._behind]  # the pieces whose writes the next step waits for
    opt.synchronize()
    # Delays are injected as completions are taken: a write the step left
    # running is delayed when synchronize() takes it, not before.
    assert off.faults_injected > 0
    off.inject_faults()
    if write_behind:  # the last pieces' writes, weighing at most write_depth (2) x the largest
        largest = max(4 * p.numel() for p in model.parameters())
        assert 1 <= left == len(behind) and sum(behind) <= 2 * largest, (left, behind)
    else:
        assert left == 0
    train_steps(model, opt, None, 4, 4)
    assert_same_params(reference, model)
    assert_same_state(ref_opt.state_dict(), opt.state_dict())
    assert state_in_memory(opt) == 0


@pytest.mark.parametrize("engine_config", DIRECT_ENGINES, indirect=True)
@pytest.mark.parametrize("raised_by", ["step", "synchronize", "step-after-state_dict"])
def test_a_write_behind_failure_surfaces_next_and_loses_nothing(offloader, raised_by):
    """The writes step 4 leaves running fail (ENOSPC, held back 0.3 s so that
    they are still running when it returns). The next step() or synchronize()
    raises, before anything changes (state_dict() in between does not); the
    state is whole, in memory where its write failed; training goes on
    bit-identical to the wrapped optimizer."""
    off = offloader
    reference, ref_opt, model, opt = offloaded_pair("adamw", off, write_behind=True)
    train_steps(reference, ref_opt, None, 4)
    train_steps(model, opt, None, 3)
    fail_after(opt, updates_per_step(model),
               lambda: off.inject_faults(error_rate=1.0, errnos=[errno.ENOSPC], delay_rate=1.0, delay_ms=300))
    train_steps(model, opt, None, 1, 3)  # returns: its last writes are still running
    assert opt.stats.writes_left_in_flight >= 1
    if raised_by == "step-after-state_dict":
        with pytest.raises(OSError):
            off.synchronize()  # the writes land (and fail) while faults are on
        off.inject_faults()
        assert_same_state(ref_opt.state_dict(), opt.state_dict())  # leaves the error to step()
    if raised_by == "synchronize":
        with pytest.raises(OSError) as raised:
            opt.synchronize()
        opt.synchronize()  # raised once
    else:
        with pytest.raises(OSError) as raised:
            train_steps(model, opt, None, 1, 4)
    off.inject_faults()
    assert raised.value.errno == errno.ENOSPC
    message = str(raised.value)
    assert "nothing is lost" in message and any(name in message for name, _ in model.named_parameters())
    assert_same_params(reference, model)  # the raising step changed nothing
    assert_same_state(ref_opt.state_dict(), opt.state_dict())
    assert state_in_memory(opt) > 0  # the state whose write failed
    train_steps(reference, ref_opt, None, 3, 4)
    train_steps(model, opt, None, 3, 4)
    assert_same_params(reference, model)
    assert_same_state(ref_opt.state_dict(), opt.state_dict())
    assert state_in_memory(opt) == 0  # written again


@pytest.mark.parametrize("engine_config", DIRECT_ENGINES, indirect=True)
@pytest.mark.parametrize("write_behind", [False, True])
def test_read_ahead_starts_the_next_steps_reads_and_gives_the_same_bits(offloader, write_behind):
    off = offloader
    reference, ref_opt, model, opt = offloaded_pair("adamw", off, write_behind=write_behind, read_ahead=True)
    train_steps(reference, ref_opt, None, 8)
    train_steps(model, opt, None, 1)  # creates the state: nothing to read ahead for
    assert opt.stats.pieces_read_ahead == 0
    sizes = [p.numel() for p in model.parameters()]
    assert read_ahead_count(sizes) == 6  # of the 18: 512, 32, 3072, 96, 1024 and 32 elements
    for step in range(1, 4):
        read = read_ahead_for_next_step(opt, model)
        off.synchronize()
        assert state_in_memory(opt) == sum(4 * n * 2 for n in sizes[:read])  # read ahead, between steps
        train_steps(model, opt, None, 1, step)
        assert opt.stats.pieces_read_ahead == read
    assert_same_state(copy.deepcopy(opt.state_dict()), opt.state_dict())  # returns them to the store
    assert state_in_memory(opt) == 0
    train_steps(model, opt, None, 4, 4)
    assert_same_params(reference, model)
    assert_same_state(ref_opt.state_dict(), opt.state_dict())


def test_state_read_ahead_for_a_piece_the_next_step_skips_goes_back_to_the_store(tmp_path):
    with Offloader(tmp_path) as off:
        reference, ref_opt, model, opt = offloaded_pair("adamw", off, read_ahead=True)
        first = next(model.parameters())
        sizes = [p.numel() for p in model.parameters()]
        every, skipping = read_ahead_count(sizes), read_ahead_count(sizes[1:])
        assert skipping < every  # the first parameter skipped, its state goes back
        expected = [0, every, skipping, skipping, every]  # step 3 reads the first parameter itself
        for step in range(5):
            for net, optimizer in ((reference, ref_opt), (model, opt)):
                x, y = batch(step)
                optimizer.zero_grad()
                nn.functional.mse_loss(net(x), y).backward()
                if step == 2:  # no update of the first parameter: its state read ahead goes back
                    next(net.parameters()).grad = None
                optimizer.step()
            assert opt.stats.pieces_read_ahead == expected[step], step
            if step == 2:  # checked before state_dict(), which would release it anyway
                assert first.numel() and sum(v.untyped_storage().nbytes() for v in opt.state[first].values()
                                             if isinstance(v, torch.Tensor) and v.dim() > 0) == 0
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())
        assert state_in_memory(opt) == 0


@pytest.mark.parametrize("engine_config", DIRECT_ENGINES, indirect=True)
def test_a_failed_read_ahead_fails_the_step_that_needs_it_rolled_back(offloader):
    """From the last update of step 3 on, completions are held back 0.3 s;
    once it has returned, they fail (EIO): the reads it started for step 4.
    Faults are off again before step 4, whose own reads succeed."""
    off = offloader
    reference, ref_opt, model, opt = offloaded_pair("adamw", off, read_ahead=True)
    train_steps(reference, ref_opt, None, 3)
    train_steps(model, opt, None, 2)
    fail_after(opt, updates_per_step(model), lambda: off.inject_faults(delay_rate=1.0, delay_ms=300))
    train_steps(model, opt, None, 1, 2)
    off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
    with pytest.raises(OSError):
        off.synchronize()  # the reads ahead land, failed
    off.inject_faults()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OSError) as raised:
        train_steps(model, opt, None, 1, 3)
    assert raised.value.errno == errno.EIO
    assert "reading the optimizer state of" in str(raised.value) and "rolled back" in str(raised.value)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert_same_state(ref_opt.state_dict(), opt.state_dict())
    train_steps(reference, ref_opt, None, 3, 3)
    train_steps(model, opt, None, 3, 3)
    assert_same_params(reference, model)
    assert_same_state(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("atomic", [True, False])
def test_the_file_stays_at_its_size_step_after_step_with_the_gc_off(tmp_path, atomic):
    """An atomic step writes new state beside the old and frees the old when
    it commits, so the file holds at most two copies of the state, whether or
    not the cyclic GC runs in between (it did not free the old state until
    it ran: the file grew by the whole state every other step)."""
    import gc
    reference, ref_opt, model, opt = offloaded_pair("adamw", Offloader(tmp_path), atomic=atomic)
    off = opt.offloader
    state_bytes = sum(2 * 4096 * -(-p.numel() * 4 // 4096) for p in model.parameters())
    gc.disable()
    try:
        sizes = []
        for step in range(8):
            train_steps(reference, ref_opt, None, 1, step)
            train_steps(model, opt, None, 1, step)
            sizes.append(off.file_bytes)
    finally:
        gc.enable()
        off.close()
    assert_same_params(reference, model)
    copies = 2 if atomic else 1
    assert max(sizes) <= copies * state_bytes, (sizes, state_bytes)
    assert sizes[2:] == [sizes[2]] * 6, sizes


def test_state_dict_round_trips_through_torch_save(tmp_path):
    with Offloader(tmp_path) as off:
        reference, ref_opt, model, opt = offloaded_pair("adamw", off)
        train_steps(reference, ref_opt, None, 3)
        train_steps(model, opt, None, 3)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        assert state_in_memory(opt) == 0           # state_dict leaves the store as it was
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        kept = copy.deepcopy(saved)
        resumed = copy.deepcopy(model)
        opt2 = OffloadedOptimizer(torch.optim.AdamW(resumed.parameters(), lr=1.0), off)
        opt2.load_state_dict(saved)
        assert_same_state(saved, kept)            # the caller's tensors are neither released nor changed
        assert state_in_memory(opt2) == 0
        train_steps(reference, ref_opt, None, 3, 3)
        train_steps(resumed, opt2, None, 3, 3)
        assert_same_params(reference, resumed)
        assert_same_state(ref_opt.state_dict(), opt2.state_dict())
        assert_same_state(saved, kept)            # not even the step counts, after steps


def test_pickling_or_deep_copying_the_optimizer_is_refused_and_its_state_dict_is_the_way(tmp_path):
    """torch pickles an optimizer's state as it is: offloaded tensors have
    empty storages, and copy.deepcopy turned them into uninitialized memory
    of the right size, silently. Refused; state_dict() reads the state."""
    with Offloader(tmp_path) as off:
        reference, ref_opt, model, opt = offloaded_pair("adamw", off)
        train_steps(reference, ref_opt, None, 2)
        train_steps(model, opt, None, 2)
        for copy_it in (copy.deepcopy, lambda o: torch.save(o, io.BytesIO())):
            with pytest.raises(TypeError, match="state_dict"):
                copy_it(opt)
        assert state_in_memory(opt) == 0
        assert_same_state(ref_opt.state_dict(), copy.deepcopy(opt.state_dict()))


def test_wrapping_on_a_full_disk_fails_and_the_wrapped_optimizer_keeps_its_state(tiny_fs):
    """The wrapped optimizer's state (32 MiB) does not fit a 16 MiB file
    system: the OSError reaches the caller, and the wrapped optimizer, which
    it still has, holds every state tensor as it was (those written before
    the disk filled are read back)."""
    params = [nn.Parameter(torch.randn(1 << 20)) for _ in range(4)]
    inner = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    inner.step()
    expected = {id(p): {key: v.clone() for key, v in inner.state[p].items()} for p in params}
    with Offloader(tiny_fs) as off:
        with pytest.raises(OSError) as failure:
            OffloadedOptimizer(inner, off)
        assert failure.value.errno == errno.ENOSPC
        for p in params:
            assert inner.state[p].keys() == expected[id(p)].keys()
            assert all(v.untyped_storage().nbytes() == v.nbytes and same_bits(v, expected[id(p)][key])
                       for key, v in inner.state[p].items())


@pytest.mark.parametrize("chunk_size", [0, 1 << 16], ids=["whole", "chunked"])
def test_a_load_state_dict_whose_writes_fail_leaves_an_optimizer_that_steps_on(tmp_path, chunk_size):
    """Some writes of the loaded state fail: load_state_dict raises, the
    state that could not be written stays in memory, and the next step
    (the disk healthy again) is bit-identical to the plain optimizer's.
    Before, it raised "cannot discard ... the store does not hold its
    bytes" on every step."""
    params = [nn.Parameter(torch.randn(1 << 18)) for _ in range(8)]
    mirror = [nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.AdamW(mirror)
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(torch.optim.AdamW(params), off, chunk_size=chunk_size)
        for seed in range(20):  # a fault pattern where some of the writes fail and some do not
            for p, q in zip(params, mirror):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            plain.step()
            off.inject_faults(error_rate=0.2, errnos=[errno.ENOSPC], seed=seed)
            try:
                opt.load_state_dict(plain.state_dict())
                failed = False
            except OSError as error:
                assert error.errno == errno.ENOSPC
                failed = True
            off.inject_faults()
            if not failed:
                opt.step()
                plain.step()
                continue
            with torch.no_grad():
                for p, q in zip(params, mirror):
                    p.copy_(q)
            for p, q in zip(params, mirror):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            opt.step()
            plain.step()
            assert all(same_bits(p, q) for p, q in zip(params, mirror))
            break
        else:
            pytest.fail("no fault pattern failed the load")


def test_wrapping_an_optimizer_that_has_state_offloads_it(tmp_path):
    reference, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(reference.parameters())
    inner = torch.optim.AdamW(model.parameters())
    train_steps(reference, ref_opt, None, 2)
    train_steps(model, inner, None, 2)
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(inner, off)
        assert state_in_memory(opt) == 0
        train_steps(reference, ref_opt, None, 2, 2)
        train_steps(model, opt, None, 2, 2)
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())


def test_behaves_as_an_optimizer(tmp_path):
    model = make_model()
    extra = nn.Parameter(torch.randn(5))
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), off)
        assert isinstance(opt, torch.optim.Optimizer)
        opt.add_param_group({"params": [extra], "lr": 0.5})
        assert len(opt.param_groups) == 2 and opt.optimizer.param_groups is opt.param_groups
        calls = []
        opt.register_step_post_hook(lambda o, a, k: calls.append(o))
        opt.optimizer.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o)))
        opt.optimizer.register_step_post_hook(lambda o, a, k: calls.append(("post", o)))
        loss = opt.step(closure=lambda: (model(batch(0)[0]).sum() + extra.sum()).backward() or 1.5)
        # hooks run once per step, not per parameter; the wrapped optimizer's too
        assert loss == 1.5 and calls == [("pre", opt.optimizer), ("post", opt.optimizer), opt]
        assert extra.grad is not None and "momentum_buffer" in opt.state[extra]
        opt.zero_grad()
        assert all(p.grad is None for group in opt.param_groups for p in group["params"])
        with pytest.raises(TypeError):
            OffloadedOptimizer(model, off)


# torch 2.8's LBFGS.step takes float() of the closure's loss, which still requires grad.
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning")
def test_an_optimizer_whose_step_needs_a_closure_is_refused_by_name(tmp_path):
    # LBFGS re-evaluates the loss within its step, over every parameter at once.
    model = make_model()
    inner = torch.optim.LBFGS(model.parameters())
    with Offloader(tmp_path) as off:
        with pytest.raises(TypeError, match="LBFGS.step needs a closure"):
            OffloadedOptimizer(inner, off)
    # ... and left as it was: it still steps in memory.
    x, y = batch(0)

    def closure():
        inner.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    assert torch.isfinite(inner.step(closure))


def snapshot(model, opt, off):
    params = [p.detach().clone() for p in model.parameters()]
    return params, copy.deepcopy(opt.state_dict())  # like torch, state_dict shares scalar state


def assert_unchanged(model, opt, before):
    params, sd = before
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    assert_same_state(opt.state_dict(), sd)
    assert state_in_memory(opt) == 0


def fail_once_mid_step(tmp_path, seed, backup_bytes, chunk_size=0):
    """Trains until a random injected EIO fails a step; checks that the step
    was rolled back exactly and that redoing it matches the reference.
    Returns (what failed, per-parameter updates the rollback undid)."""
    with Offloader(tmp_path) as off:
        reference, ref_opt, model, opt = offloaded_pair("adamw", off, backup_bytes=backup_bytes,
                                                        chunk_size=chunk_size)
        train_steps(reference, ref_opt, None, 3)
        train_steps(model, opt, None, 3)
        before = snapshot(model, opt, off)
        updates = []
        fail_after(opt, 0, None, updates)
        read_backup = off.sync_read

        def faults_stop_for_the_rollback(t):  # (a failing rollback: the test below)
            off.inject_faults()
            read_backup(t)

        off.sync_read = faults_stop_for_the_rollback
        with pytest.raises(OSError) as raised:
            for attempt in range(20):  # until a fault lands
                updates.clear()
                off.inject_faults(error_rate=0.02, errnos=[errno.EIO], seed=100 * seed + attempt)
                train_steps(model, opt, None, 1, 3)
                off.inject_faults()
                train_steps(reference, ref_opt, None, 1, 3)
                before = snapshot(model, opt, off)
        off.inject_faults()
        assert state_in_memory(opt) == 0  # what the step had read went back to the store (state_dict() would hide it)
        undone = len(updates)
        assert raised.value.errno == errno.EIO
        message = raised.value.strerror
        assert "rolled back" in message and any(name in message for name, _ in model.named_parameters())
        assert_unchanged(model, opt, before)
        steps_done = int(opt.state_dict()["state"][0]["step"].item())
        train_steps(reference, ref_opt, None, 2, steps_done)
        train_steps(model, opt, None, 2, steps_done)  # the failed step, done again, matches
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())
        return message.split(" the optimizer state")[0], undone


@pytest.mark.parametrize("backup_bytes", [0, 1 << 30], ids=["backups-in-store", "backups-in-memory"])
def test_an_io_error_anywhere_in_a_step_rolls_the_whole_step_back(tmp_path, backup_bytes):
    outcomes = [fail_once_mid_step(tmp_path, seed, backup_bytes) for seed in range(8)]
    # The random faults hit both reads and writes, after several parameters were updated.
    assert {"reading", "writing"} <= {what for what, _ in outcomes}, outcomes
    assert max(updated for _, updated in outcomes) >= 5, outcomes


def test_a_failed_step_over_chunks_rolls_back_every_chunk(tmp_path):
    outcomes = [fail_once_mid_step(tmp_path, seed, 1 << 30, chunk_size=100) for seed in range(4)]
    assert max(updated for _, updated in outcomes) >= 5, outcomes


@CHUNKS
def test_a_failing_first_step_leaves_no_state(tmp_path, chunk_size):
    with Offloader(tmp_path) as off:
        _, _, model, opt = offloaded_pair("sgd-momentum", off, chunk_size=chunk_size)
        params = [p.detach().clone() for p in model.parameters()]
        off.inject_faults(error_rate=1.0, errnos=[errno.ENOSPC])
        with pytest.raises(OSError) as raised:
            train_steps(model, opt, None, 1)
        off.inject_faults()
        assert raised.value.errno == errno.ENOSPC and "rolled back" in str(raised.value)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        assert len(opt.state) == 0


def fail_after(opt, updates, action, log=None):
    """Makes ``action()`` happen just before the wrapped optimizer's
    ``updates``-th per-parameter update; ``log`` collects every update."""
    inner_step, count = opt.optimizer.step, [0]

    def step(*args, **kwargs):
        count[0] += 1
        if log is not None:
            log.append(count[0])
        if count[0] == updates:
            action()
        return inner_step(*args, **kwargs)

    opt.optimizer.step = step


def test_an_interrupt_in_the_middle_of_a_step_rolls_back_too(tmp_path):
    with Offloader(tmp_path) as off:
        _, _, model, opt = offloaded_pair("adamw", off)
        train_steps(model, opt, None, 2)
        before = snapshot(model, opt, off)

        def interrupt():
            raise KeyboardInterrupt

        fail_after(opt, 7, interrupt)
        with pytest.raises(KeyboardInterrupt):
            train_steps(model, opt, None, 1, 2)
        assert_unchanged(model, opt, before)


def test_when_the_rollback_fails_too_the_error_names_the_damage(tmp_path):
    with Offloader(tmp_path) as off:
        _, _, model, opt = offloaded_pair("adamw", off, backup_bytes=0)  # backups in the store
        train_steps(model, opt, None, 1)
        def fail_from_here():
            # The backups of the pieces updated so far land in the store first:
            # one whose write were still running would fail with the rest and
            # stay in memory, and the rollback would then need no disk.
            off.synchronize()
            off.inject_faults(error_rate=1.0, errnos=[errno.EIO])

        fail_after(opt, 5, fail_from_here)
        with pytest.raises(OSError, match="restoring .* failed too.*keeps its post-step value"):
            train_steps(model, opt, None, 1, 1)
        off.inject_faults()


@pytest.mark.parametrize("chunk_size", [0, 100], ids=["whole", "chunks-of-100"])  # several updates a step
def test_without_atomic_a_failure_says_the_step_is_partly_applied(tmp_path, chunk_size):
    with Offloader(tmp_path) as off:
        _, _, model, opt = offloaded_pair("adamw", off, atomic=False, chunk_size=chunk_size)
        train_steps(model, opt, None, 1)
        off.inject_faults(error_rate=1.0, errnos=[errno.EIO])
        with pytest.raises(OSError, match="partly applied"):
            train_steps(model, opt, None, 1, 1)
        off.inject_faults()
        # Mid-step this time: some pieces updated and written, others read ahead and left.
        fail_after(opt, 3, lambda: off.inject_faults(error_rate=1.0, errnos=[errno.EIO]))
        with pytest.raises(OSError, match="partly applied"):
            train_steps(model, opt, None, 1, 1)
        off.inject_faults()
        opt.optimizer.step = type(opt.optimizer).step.__get__(opt.optimizer)
        train_steps(model, opt, None, 2, 2)        # the optimizer carries on from what it has
        assert state_in_memory(opt) == 0
        assert all(torch.isfinite(t).all() for entry in opt.state_dict()["state"].values()
                   for t in entry.values())


def test_offloaded_builds_optimizers_for_code_that_constructs_them(tmp_path):
    made = []

    def store():
        made.append(Offloader(tmp_path))
        return made[-1]

    model = make_model()
    opt = offloaded(torch.optim.AdamW, store, prefetch=1)(model.parameters(), lr=1e-3)
    assert isinstance(opt, OffloadedOptimizer) and opt.offloader is made[0] and opt.prefetch == 1
    assert opt.param_groups[0]["lr"] == 1e-3
    train_steps(model, opt, None, 2)
    assert state_in_memory(opt) == 0
    made[0].close()


@pytest.mark.parametrize("options", [{"atomic": True}, {"atomic": False},
                                     {"atomic": True, "write_behind": True, "read_ahead": True}],
                         ids=["atomic", "not-atomic", "overlapped"])
def test_state_through_the_gpu_pipeline_on_the_late_copy_device(tmp_path, options):
    """The GPU path (staging ring, copy stream, events) on the test device whose
    copies land late on another thread: state read too early or a staging
    buffer reused too soon would change the bits."""
    from offload.devices import LateCopyDevice
    device = LateCopyDevice(seed=3, max_delay=0.002)
    with Offloader(tmp_path, device=device, staging_buffers=2, staging_buffer_bytes=64 << 10) as off:
        reference, ref_opt, model, opt = offloaded_pair("adamw", off, **options)
        train_steps(reference, ref_opt, None, 4)
        train_steps(model, opt, None, 3)
        read = read_ahead_for_next_step(opt, model)
        train_steps(model, opt, None, 1, 3)
        assert device.copies > 0
        assert opt.stats.pieces_read_ahead == (read if options.get("read_ahead") else 0)
        assert_same_params(reference, model)
        assert_same_state(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlapped", [False, True])
def test_real_cuda_optimizer_state(tmp_path, overlapped):
    reference, model = make_model().cuda(), make_model().cuda()
    ref_opt = torch.optim.AdamW(reference.parameters())
    with Offloader(tmp_path) as off:
        opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), off,  # overlapped: one piece a parameter
                                 chunk_size=0 if overlapped else None, write_behind=overlapped, read_ahead=overlapped)
        for step in range(3):
            for m, o in ((reference, ref_opt), (model, opt)):
                x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(step)).cuda()
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
        assert_same_params(reference, model)


_RANDOM_OPTIMIZERS = {
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-3),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-3),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-3),
}
if fused_adamw_on_cpu():
    _RANDOM_OPTIMIZERS["adamw-fused"] = lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)


@pytest.mark.parametrize("seed", range(8))
def test_random_options_and_steps_against_the_wrapped_optimizer_in_memory(tmp_path, seed):
    """Random parameter shapes, optimizers and options (chunks of 64 to 4096
    elements, prefetch and write depths, write-behind, read-ahead, backups in
    memory or in the store), then random steps: gradients missing for some
    parameters, learning rates changed, state_dict round trips, and steps
    with I/O faults injected. After every step each parameter is bit for bit
    that of the same optimizer in memory, which does not step where ours
    rolled back; a step whose rollback could not restore a parameter (it
    says so) ends the comparison, as documented."""
    import random
    rng = random.Random(seed)
    shapes = [tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
    start = [torch.randn(s, generator=torch.Generator().manual_seed(seed * 10 + i)) for i, s in enumerate(shapes)]
    make = _RANDOM_OPTIMIZERS[rng.choice(sorted(_RANDOM_OPTIMIZERS))]
    options = dict(prefetch=rng.randint(0, 3), chunk_size=rng.choice([None, 64, 1000, 4096]),
                   write_behind=rng.random() < 0.4, read_ahead=rng.random() < 0.4, write_depth=rng.randint(1, 3),
                   backup_bytes=rng.choice([256 << 20, 0, 4096]))
    ref_params = [t.clone().requires_grad_() for t in start]
    our_params = [t.clone().requires_grad_() for t in start]
    ref = make(ref_params)
    with Offloader(tmp_path, direct=rng.choice([None, False])) as off:
        ours = OffloadedOptimizer(make(our_params), off, **options)
        rolled_back = 0
        for step in range(12):
            what = rng.choice(["step", "step", "lr", "state_dict", "faults"])
            generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
            grads = [torch.randn(s, generator=generator) if rng.random() < 0.8 else None for s in shapes]
            for params in (ref_params, our_params):
                for p, g in zip(params, grads):
                    p.grad = None if g is None else g.clone()
            if what == "lr":
                for group in ref.param_groups + ours.param_groups:
                    group["lr"] *= 0.5
            if what == "state_dict":
                ours.load_state_dict(ours.state_dict())
            if what == "faults":
                off.inject_faults(error_rate=0.05, errnos=[errno.EIO], seed=step)
            try:
                ours.step()
                stepped = True
            except OSError as error:  # this step, or a read ahead or write behind the last one left
                if "failed too" in str(error):
                    return
                assert "rolled back" in str(error) or "(write_behind)" in str(error), str(error)
                stepped, rolled_back = False, rolled_back + 1
            finally:
                off.inject_faults()
            if stepped:
                ref.step()
            for i, (a, b) in enumerate(zip(ref_params, our_params)):
                assert same_bits(a.detach(), b.detach()), f"step {step} ({what}): parameter {i}"
        ours.synchronize()
        assert_same_state(ref.state_dict(), ours.state_dict())
