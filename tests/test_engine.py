"""The engine against torch.optim and hand-computed values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedbench.engine import SAM, Engine, OptimConfig, Proximal
from fedbench.engine.optim import init_state, step_

pytestmark = pytest.mark.quick


def mlp(dim=6, classes=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 8), nn.ReLU(), nn.Linear(8, classes))


def reference_loop(model, fed, client, engine, opt_cls, epochs, bs, extra=None, **okw):
    """A plain PyTorch loop over the engine's own schedule: what the engine must equal."""
    opt = opt_cls(model.parameters(), **okw)
    idx, lens = engine.schedule(client, bs, epochs=epochs)
    for s, ln in enumerate(lens):
        x, y = fed.batch(idx[s, :ln])
        loss = nn.functional.cross_entropy(model(x), y)
        if extra is not None:
            loss = loss + extra(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "name,okw,torch_cls",
    [
        ("sgd", dict(lr=0.1), torch.optim.SGD),
        ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-3), torch.optim.SGD),
        ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True), torch.optim.SGD),
        ("adam", dict(lr=1e-2, weight_decay=1e-4), torch.optim.Adam),
    ],
)
def test_train_matches_torch_optim(tiny_fed, name, okw, torch_cls):
    model = mlp()
    eng = Engine(tiny_fed, model, device="cpu")
    w0 = eng.initial_state()
    cfg = OptimConfig(name=name, **okw)
    res = eng.train(w0, [0, 2], optim=cfg, lr=okw["lr"], batch_size=8, epochs=2)
    for c, client in enumerate([0, 2]):
        ref = reference_loop(mlp(), tiny_fed, client, eng, torch_cls, 2, 8, **okw)
        torch.testing.assert_close(res.states[c], ref, rtol=1e-5, atol=1e-6)
    # 37 samples / batch 8 -> 5 batches per epoch; 50 -> 7
    assert res.steps == [10, 14]


def test_proximal_term_matches_autograd(tiny_fed):
    model = mlp()
    eng = Engine(tiny_fed, model, device="cpu")
    w0 = eng.initial_state()
    ref_point = w0 + 0.3
    cfg = OptimConfig(name="sgd", lr=0.1)
    res = eng.train(
        w0, [1], optim=cfg, lr=0.1, batch_size=8, epochs=1, terms=[Proximal(ref_point, 0.5)]
    )
    m = mlp()
    flat_ref = ref_point.clone()

    def prox(mod):
        w = torch.cat([p.reshape(-1) for p in mod.parameters()])
        return 0.25 * ((w - flat_ref) ** 2).sum()

    expect = reference_loop(m, tiny_fed, 1, eng, torch.optim.SGD, 1, 8, extra=prox, lr=0.1)
    torch.testing.assert_close(res.states[0], expect, rtol=1e-5, atol=1e-6)


def test_frozen_mask_leaves_frozen_entries(tiny_fed):
    model = mlp()
    eng = Engine(tiny_fed, model, device="cpu")
    w0 = eng.initial_state()
    mask = eng.spec.mask(["2.weight", "2.bias"])  # train only the last layer
    cfg = OptimConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    res = eng.train(w0, [0], optim=cfg, lr=0.1, batch_size=8, epochs=1, trainable=mask)
    changed = res.states[0] != w0
    assert not changed[~mask].any()
    assert changed[mask].any()


def test_sam_step_hand_computed():
    """One SAM step on a linear least-squares-like problem, against explicit formulas."""

    class OneFed:
        num_clients = 1
        x = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
        y = torch.tensor([0, 1])
        train_idx = [torch.tensor([0, 1])]

        def batch(self, idx, train=True):
            return self.x[idx], self.y[idx]

    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    eng = Engine(OneFed(), model, device="cpu")
    w0 = eng.initial_state()
    rho, lr = 0.05, 0.1
    res = eng.train(w0, [0], optim=OptimConfig(lr=lr), lr=lr, batch_size=2, epochs=1, sam=SAM(rho))

    def loss_at(flat):
        Wt, b = flat[:4].view(2, 2), flat[4:]
        return nn.functional.cross_entropy(OneFed.x @ Wt.T + b, OneFed.y)

    w = w0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_at(w), w)
    eps = rho * g / g.norm()
    wp = (w0 + eps).requires_grad_(True)
    (g2,) = torch.autograd.grad(loss_at(wp), wp)
    torch.testing.assert_close(res.states[0], w0 - lr * g2)


def test_sam_layer_scale_scales_perturbation():
    g = torch.tensor([3.0, 4.0, 0.0])
    scale = torch.tensor([2.0, 0.0, 1.0])
    e = SAM(0.1).perturbation(g, scale)
    torch.testing.assert_close(e, torch.tensor([0.1 * 3 / 5 * 2, 0.0, 0.0]))


def test_schedule_deterministic_and_covers(tiny_fed):
    eng = Engine(tiny_fed, mlp(), device="cpu", seed=3)
    a, la = eng.schedule(0, 8, epochs=2, round=4)
    b, lb = eng.schedule(0, 8, epochs=2, round=4)
    c, _ = eng.schedule(0, 8, epochs=2, round=5)
    assert torch.equal(a, b) and la == lb
    assert not torch.equal(a, c)
    first_epoch = torch.cat([a[s, :ln] for s, ln in enumerate(la[:5])])
    assert sorted(first_epoch.tolist()) == tiny_fed.train_idx[0].tolist()
    s, ls = eng.schedule(0, 8, steps=7)
    assert len(ls) == 7 and s.shape == (7, 8)


def test_persistent_optimizer_state(tiny_fed):
    eng = Engine(tiny_fed, mlp(), device="cpu")
    w0 = eng.initial_state()
    fresh = OptimConfig(name="adam", lr=1e-2)
    kept = fresh.replace(persist_state=True)
    a1 = eng.train(w0, [0], optim=kept, lr=1e-2, batch_size=8, epochs=1).states
    a2 = eng.train(a1, [0], optim=kept, lr=1e-2, batch_size=8, epochs=1, round=1).states
    b2 = eng.train(a1, [0], optim=fresh, lr=1e-2, batch_size=8, epochs=1, round=1).states
    assert not torch.allclose(a2, b2)


def test_adam_step_masks_inactive_rows():
    cfg = OptimConfig(name="adam", lr=0.1)
    w = torch.ones(2, 3)
    st = init_state(cfg, w)
    active = torch.tensor([[1.0], [0.0]])
    step_(cfg, w, torch.ones(2, 3), st, 0.1, active=active)
    assert torch.equal(w[1], torch.ones(3)) and st["step"][1].item() == 0
    torch.testing.assert_close(w[0], torch.full((3,), 0.9))


@pytest.mark.parametrize(
    "okw",
    [
        dict(name="sgd", momentum=0.9),
        dict(name="sgd", momentum=0.9, nesterov=True, weight_decay=0.1),
        dict(name="adam"),
        dict(name="adam", weight_decay=0.1),
    ],
)
@pytest.mark.parametrize("stacked", [False, True])
def test_mask_freezes_entries_and_their_state_whatever_the_kept_state(okw, stacked):
    """Momentum / Adam moments left by a phase that trained an entry never move it once it
    is masked (issue 14.4), and its state waits unchanged until it trains again."""
    cfg = OptimConfig(lr=0.1, **okw)
    torch.manual_seed(0)
    shape = (2, 5) if stacked else (5,)
    w = torch.randn(shape)
    st = init_state(cfg, w)
    for _ in range(3):  # a first phase trains everything: non-zero state everywhere
        step_(cfg, w, torch.randn(shape), st, 0.1)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    frozen = ~mask.bool()
    w0, st0 = w.clone(), {k: v.clone() for k, v in st.items()}
    step_(cfg, w, torch.randn(shape), st, 0.1, mask=mask)
    assert torch.equal(w[..., frozen], w0[..., frozen])
    assert (w[..., ~frozen] != w0[..., ~frozen]).all()
    for k in ("buf", "m", "v"):
        if k in st:
            assert torch.equal(st[k][..., frozen], st0[k][..., frozen])


def bn_mlp(dim=6, classes=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, classes))


def test_grad_at_trains_after_an_evaluation_and_returns_its_own_gradient(tiny_fed):
    """An evaluation leaves the module in eval mode; a hand-written step (`Engine.grad_at`)
    still normalizes with the batch and updates the running statistics (issue 14.1)."""

    eng = Engine(tiny_fed, bn_mlp(), device="cpu")
    s = eng.initial_state()
    P = eng.n_params
    x, y = tiny_fed.batch(torch.arange(8))
    eng.correct(s, tiny_fed.test_idx[0])  # eval mode now
    ref = bn_mlp()
    ref.load_state_dict(bn_mlp().state_dict())
    ref.train()
    nn.functional.cross_entropy(ref(x), y).backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    before = s[P:].clone()
    loss, g = eng.grad_at(s, x, y)
    assert eng.model.training
    torch.testing.assert_close(g, want)
    assert not torch.equal(s[P:], before)  # running statistics moved
    torch.testing.assert_close(s[P:], eng.spec.flatten(ref)[P:])
    g2 = eng.grad_at(s, x[:4], y[:4])[1]
    torch.testing.assert_close(g, want)  # not overwritten by the next call
    assert not torch.equal(g, g2)


def test_engine_train_after_an_evaluation_updates_running_statistics(tiny_fed):
    eng = Engine(tiny_fed, bn_mlp(), device="cpu")
    s = eng.initial_state()
    opt = OptimConfig(lr=0.1)
    a = eng.train(s, [0, 1], optim=opt, lr=0.1, batch_size=8, epochs=1).states
    eng.correct(s, tiny_fed.test_idx[0])
    b = eng.train(s, [0, 1], optim=opt, lr=0.1, batch_size=8, epochs=1).states
    assert torch.equal(a, b)
    assert not torch.equal(a[:, eng.n_params :], s[eng.n_params :].expand(2, -1))


@pytest.mark.quick
def test_a_per_client_mask_is_each_clients_own_call(tiny_fed):
    """trainable [C, P]: one call trains each client under its own row, to the bit what one
    call per client with that row as its [P] mask gives (sequential); a frozen entry of a
    client stays as it was, and a mask with the wrong number of rows is refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    eng = Engine(tiny_fed, model, device="cpu", seed=1, backend="sequential")
    w0 = eng.initial_state()
    masks = torch.rand(3, eng.n_params, generator=torch.Generator().manual_seed(2)) < 0.5
    cfg = OptimConfig(lr=0.1, momentum=0.9)
    kw = dict(optim=cfg, lr=0.1, batch_size=8, epochs=2)
    one = eng.train(w0, [0, 1, 2], trainable=masks, **kw)
    for c in range(3):
        alone = eng.train(w0, [c], trainable=masks[c], **kw)
        assert torch.equal(alone.states[0], one.states[c])
        assert torch.equal(alone.loss[0], one.loss[c])
        frozen = ~masks[c]
        assert torch.equal(one.states[c, : eng.n_params][frozen], w0[: eng.n_params][frozen])
    with pytest.raises(ValueError, match="rows"):
        eng.train(w0, [0, 1], trainable=masks, **kw)
