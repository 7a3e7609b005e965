"""The engine's optimizer: the in-place `optim.step_` against torch.optim and against the
out-of-place form it replaced (to the bit), and the optimizer state of step functions' rows
(`Engine.client_steps(optimized=...)`) against a hand-written loop with torch.optim.

`step_` equals `torch.optim.SGD` (foreach off: one tensor at a time) to the bit, with and
without momentum, weight decay and Nesterov. Its Adam is not torch's arithmetic (torch lerps
the first moment and divides by sqrt(bias correction)): it is checked to the bit against
`out_of_place_step` of scripts/bench_optim.py, the code `step_` had before it ran in place
(which that script times against it), and to float tolerance against torch.optim.Adam
(through the engine: below, and tests/test_engine.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import TinyFed
from fedbench.engine import Engine, OptimConfig, Optimized
from fedbench.engine.optim import Ranges, init_state, step_, trained_ranges
from fedbench.engine.spec import ModelSpec

pytestmark = pytest.mark.quick

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_optim.py"


def _bench():
    """scripts/bench_optim.py as a module: its `out_of_place_step` is the reference."""
    spec = importlib.util.spec_from_file_location("bench_optim", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


reference_step = _bench().out_of_place_step


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.int32)


SGD_CASES = [
    dict(),
    dict(weight_decay=1e-2),
    dict(momentum=0.9),
    dict(momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, weight_decay=1e-2, nesterov=True),
]


@pytest.mark.parametrize("consume", [False, True], ids=["keep_grad", "consume_grad"])
@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(kw) or "plain")
def test_sgd_step_is_torch_sgd_to_the_bit(kw, consume):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(257, generator=gen)
    grads = [torch.randn(257, generator=gen) for _ in range(5)]
    p = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=0.1, foreach=False, **kw)
    cfg = OptimConfig(name="sgd", lr=0.1, **kw)
    w, st = w0.clone(), init_state(cfg, w0)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        given = g.clone()
        step_(cfg, w, given, st, 0.1, consume_grad=consume)
        assert torch.equal(bits(w), bits(p.detach()))
        if not consume:
            assert torch.equal(given, g)  # the caller's gradient is left as it was
    if cfg.momentum:
        assert torch.equal(bits(st["buf"]), bits(opt.state[p]["momentum_buffer"]))


ALL_CASES = [dict(name="sgd", **kw) for kw in SGD_CASES] + [
    dict(name="adam"),
    dict(name="adam", weight_decay=1e-2),
    dict(name="adam", betas=(0.8, 0.99), eps=1e-6),
]


@pytest.mark.parametrize("consume", [False, True], ids=["keep_grad", "consume_grad"])
@pytest.mark.parametrize(
    "form", ["plain", "mask", "active", "mask_active", "lr_tensor", "ranges", "ranges_active_lr"]
)
@pytest.mark.parametrize("kw", ALL_CASES, ids=lambda kw: ",".join(f"{k}" for k in kw))
def test_in_place_step_is_the_out_of_place_step_to_the_bit(kw, form, consume):
    """Every optimizer setting, with frozen entries, inactive rows and a per-entry lr: the
    parameters and the state after 4 steps on stacked rows [3, P] equal the old form's bits."""
    gen = torch.Generator().manual_seed(1)
    C, P = 3, 129
    cfg = OptimConfig(lr=0.05, **kw)
    w0 = torch.randn(C, P, generator=gen)
    mask = (torch.rand(P, generator=gen) > 0.3).float() if "mask" in form else None
    given_mask = mask
    if "ranges" in form:  # whole frozen blocks (a frozen tensor's entries): stepped as ranges
        mask = torch.ones(P)
        mask[10:40] = 0
        mask[100:110] = 0
        given_mask = trained_ranges(mask)
        assert isinstance(given_mask, Ranges) and given_mask.mask is mask
        assert given_mask.ranges == ((0, 10), (40, 100), (110, P))
    lr = 0.05
    if form in ("lr_tensor", "ranges_active_lr"):
        lr = torch.where(torch.arange(P) < 20, 0.01, 0.05)
    w, st = w0.clone(), init_state(cfg, w0)
    w_ref, st_ref = w0.clone(), init_state(cfg, w0)
    for s in range(4):
        g = torch.randn(C, P, generator=gen)
        active = None
        if "active" in form:
            active = torch.tensor([[1.0], [1.0], [float(s < 2)]])
        given = g.clone()
        step_(cfg, w, given, st, lr, active=active, mask=given_mask, consume_grad=consume)
        reference_step(cfg, w_ref, g, st_ref, lr, active=active, mask=mask)
        assert torch.equal(bits(w), bits(w_ref))
        if not consume:
            assert torch.equal(given, g)
    assert st.keys() == st_ref.keys()
    for k in st:
        assert torch.equal(st[k], st_ref[k]), k


# ---------------------------------------------------------------- step functions' rows


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def optimizer_step(st, batch):
    """A step function whose `w` rows the engine optimizes: the gradient, then `batch.step`."""
    assert set(st) == {"w"}  # the carried optimizer state is not the step's
    loss, g = batch.grad(st["w"])
    batch.step("w", g)
    return st, loss


def by_hand(fed: TinyFed, eng: Engine, clients, opt_cls, rounds: int, **okw) -> torch.Tensor:
    """Each client's loop with one torch.optim object over all its rounds' batches (its state
    kept across rounds, as `optim.persist_state`): the parameters [C, P] after `rounds`."""
    out = []
    for client in clients:
        model = mlp()
        opt = opt_cls(model.parameters(), foreach=False, **okw)
        for t in range(rounds):
            for x, y in eng.batches(client, 8, epochs=1, round=t):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["sequential", "vmap"])
@pytest.mark.parametrize(
    "name,okw,torch_cls",
    [
        ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-3), torch.optim.SGD),
        ("adam", dict(lr=1e-2, weight_decay=1e-4), torch.optim.Adam),
    ],
)
def test_optimized_rows_keep_their_state_as_torch_optim(backend, name, okw, torch_cls):
    """Two rounds of `client_steps` with the `w` rows optimized under a slot, state kept
    (`persist_state`): a torch.optim loop per client over both rounds; sequential: the bits
    of `Engine.train` with the same optimizer and slot semantics."""
    fed = TinyFed()
    eng = Engine(fed, mlp(), device="cpu", backend=backend)
    cfg = OptimConfig(name=name, persist_state=True, **okw)
    clients = [2, 0, 1]  # unequal step counts (50, 37, 20 samples in batches of 8)
    w = eng.initial_state().repeat(3, 1)
    for t in range(2):
        res = eng.client_steps(
            {"w": w},
            clients,
            optimizer_step,
            batch_size=8,
            epochs=1,
            round=t,
            optimized={"w": Optimized(cfg, okw["lr"], slot="x")},
        )
        assert set(res.states) == {"w"}
        w = res.states["w"]
    want = by_hand(fed, eng, clients, torch_cls, 2, **okw)
    torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)
    if name == "sgd":  # the kept momentum is torch's momentum buffer
        assert set(eng.optim_states.slots) == {"x"}
        kept = eng.optim_states.slots["x"]["buf"][torch.tensor(clients)]
        assert kept.abs().sum(1).gt(0).all()
    if backend == "sequential":
        ref = Engine(fed, mlp(), device="cpu", backend=backend)
        s = ref.initial_state().repeat(3, 1)
        for t in range(2):
            s = ref.train(s, clients, optim=cfg, lr=okw["lr"], batch_size=8, epochs=1, round=t)
            s = s.states
        assert torch.equal(w, s)


@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_optimized_rows_without_a_slot_start_fresh_every_call(backend):
    """No slot: each call starts from a fresh state and nothing is kept, whatever
    `persist_state` says: two calls from the same rows give the same rows."""
    eng = Engine(TinyFed(), mlp(), device="cpu", backend=backend)
    cfg = OptimConfig(lr=0.1, momentum=0.9, persist_state=True)
    w = eng.initial_state().repeat(3, 1)
    runs = [
        eng.client_steps(
            {"w": w},
            [0, 1, 2],
            optimizer_step,
            batch_size=8,
            epochs=1,
            optimized={"w": Optimized(cfg, 0.1)},
        ).states["w"]
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], w)
    assert not eng.optim_states.slots


def test_optimized_rows_are_checked():
    eng = Engine(TinyFed(), mlp(), device="cpu", backend="sequential")
    cfg = OptimConfig(lr=0.1)
    w = eng.initial_state().repeat(3, 1)
    kw = dict(batch_size=8, epochs=1)
    with pytest.raises(ValueError, match="not a state of rows"):
        eng.client_steps(
            {"w": w}, [0, 1, 2], optimizer_step, optimized={"v": Optimized(cfg, 0.1)}, **kw
        )
    with pytest.raises(ValueError, match="share a slot"):
        opt = {"w": Optimized(cfg, 0.1, "a"), "v": Optimized(cfg, 0.1, "a")}
        eng.client_steps({"w": w, "v": w}, [0, 1, 2], optimizer_step, optimized=opt, **kw)


def test_trained_ranges_are_the_masks_runs_of_ones():
    P = 20
    assert trained_ranges(None) is None
    assert trained_ranges(torch.ones(P)).ranges == ((0, P),)
    assert trained_ranges(torch.zeros(P)).ranges == ()
    head = torch.zeros(P, dtype=torch.bool)
    head[15:] = True
    assert trained_ranges(head).ranges == ((15, P),)
    assert trained_ranges(~head).ranges == ((0, 15),)
    alternating = (torch.arange(P) % 2).float()  # 10 runs: over MAX_RANGES, kept a product
    assert trained_ranges(alternating) is alternating


@pytest.mark.parametrize("kw", [kw for kw in ALL_CASES if kw["name"] == "sgd"], ids=str)
def test_a_gradient_per_trained_range_steps_as_the_whole_gradient(kw):
    """`Ranges` with the gradient given per trained range (what the vmap backend's backward
    over those ranges alone returns) steps to the bits of the whole [C, P] gradient; Adam,
    which takes the product form, refuses it."""
    gen = torch.Generator().manual_seed(2)
    C, P = 3, 129
    cfg = OptimConfig(lr=0.05, **kw)
    mask = torch.ones(P)
    mask[10:40] = 0
    ranges = trained_ranges(mask)
    w0 = torch.randn(C, P, generator=gen)
    w, st = w0.clone(), init_state(cfg, w0)
    w_ref, st_ref = w0.clone(), init_state(cfg, w0)
    for _ in range(3):
        g = torch.randn(C, P, generator=gen)
        pieces = tuple(g[:, a:b].clone() for a, b in ranges.ranges)
        step_(cfg, w, pieces, st, 0.05, mask=ranges, consume_grad=True)
        step_(cfg, w_ref, g.clone(), st_ref, 0.05, mask=ranges, consume_grad=True)
        assert torch.equal(bits(w), bits(w_ref))
    assert all(torch.equal(st[k], st_ref[k]) for k in st)
    adam = OptimConfig(name="adam", lr=1e-3)
    with pytest.raises(ValueError, match="per trained range"):
        step_(adam, w, pieces, init_state(adam, w), 1e-3, mask=ranges)


def test_range_of_names_the_range_holding_each_parameter_whole():
    spec = ModelSpec(mlp())  # 6x8 weight [0, 48), bias [48, 56), 8x3 [56, 80), bias [80, 83)
    assert spec.range_of(((56, 83),)) == [None, None, 0, 0]
    assert spec.range_of(((0, 56), (80, 83))) == [0, 0, None, 1]
    assert spec.range_of(((50, 83),)) is None  # cuts through the first bias


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_vmap_head_training_by_range_equals_the_whole_gradient(monkeypatch, momentum):
    """The vmap backend trains a head-only mask through the gradient of the head's range
    alone; forcing the whole [C, P] gradient instead (`range_of` None) gives the same bits."""
    fed = TinyFed()
    cfg = OptimConfig(lr=0.1, momentum=momentum, weight_decay=1e-3)

    def run() -> torch.Tensor:
        eng = Engine(fed, mlp(), device="cpu", backend="vmap")
        head = eng.spec.mask(["2.weight", "2.bias"])
        s = eng.initial_state().repeat(3, 1)
        for t in range(2):
            s = eng.train(
                s, [2, 0, 1], optim=cfg, lr=0.1, batch_size=8, epochs=1, round=t, trainable=head
            ).states
        return s

    seen = []
    range_of = ModelSpec.range_of
    monkeypatch.setattr(ModelSpec, "range_of", lambda *a: seen.append(range_of(*a)) or seen[-1])
    fast = run()
    assert seen and all(w == [None, None, 0, 0] for w in seen)  # the head's range was used
    monkeypatch.setattr(ModelSpec, "range_of", lambda self, ranges: None)
    assert torch.equal(bits(fast), bits(run()))
