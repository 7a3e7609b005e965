"""FedMGDA+, APFL and SplitGP (the FedPG appendix's baselines this repo adds): the update
rules against hand-computed/autograd values, and learning on real FMNIST."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import bn_mlp, make_algo, run_small
from fedbench.algorithms._qp import gram, min_norm_weights
from fedbench.algorithms.apfl import APFLModel, apfl_loss
from fedbench.algorithms.fedmgda import box_weights
from fedbench.config import load_config
from fedbench.models import build_model


@pytest.mark.quick
@pytest.mark.parametrize("case", range(8))
def test_fedmgda_weights_stay_in_the_box_and_on_the_simplex(case):
    rng = np.random.default_rng(case)
    m = 3 + case % 5
    gh = torch.tensor(rng.normal(size=(m, 40)))
    gh = gh / gh.norm(dim=1, keepdim=True)
    lam0 = rng.uniform(0.5, 2, size=m)
    lam0 /= lam0.sum()
    eps = 0.1 * (1 + case % 2)
    lam = box_weights(gh, lam0, eps)
    assert abs(lam.sum() - 1) < 1e-9
    assert (lam >= np.maximum(lam0 - eps, 0) - 1e-9).all()
    assert (lam <= lam0 + eps + 1e-9).all()
    # no point of the feasible set has a smaller norm (random feasible points)
    K = gram(gh)
    v = lam @ K @ lam
    for _ in range(200):
        x = lam0 + rng.uniform(-eps, eps, size=m)
        x = np.clip(x, 0, None)
        x /= x.sum()
        if (np.abs(x - lam0) <= eps).all():
            assert x @ K @ x >= v - 1e-9
    # a box wider than the simplex gives the plain min-norm weights
    assert np.allclose(box_weights(gh, lam0, 1.0), min_norm_weights(K), atol=1e-6)


@pytest.mark.quick
def test_fedmgda_server_step_is_the_normalized_combination():
    algo, eng, fed = make_algo("fedmgda", ["algo.server_lr=0.5"])
    w0 = algo.w.clone()
    algo.round(0, np.array([0, 1, 2]))
    P = eng.n_params
    delta = w0[None, :P] - algo.theta[:, :P]
    gh = delta / delta.norm(dim=1, keepdim=True)
    lam = torch.as_tensor(algo.last_lambda, dtype=gh.dtype)
    assert torch.allclose(algo.w[:P], w0[:P] - 0.5 * lam @ gh, atol=1e-6)


@pytest.mark.quick
def test_fedmgda_default_server_step_is_the_runs_decayed_lr():
    # server_lr: null (the YAML default) steps by optim.lr_at(t), as the FedPG authors' code
    algo, eng, fed = make_algo("fedmgda", ["optim.lr_decay=0.5"], lr=0.05)
    assert algo.hp.server_lr is None
    P = eng.n_params
    for t in range(2):
        w0 = algo.w.clone()
        algo.round(t, np.array([0, 1, 2]))
        delta = w0[None, :P] - algo.theta[:, :P]
        gh = delta / delta.norm(dim=1, keepdim=True)
        lam = torch.as_tensor(algo.last_lambda, dtype=gh.dtype)
        eta = algo.optim.lr_at(t)
        assert eta == pytest.approx(0.05 * 0.5**t)
        assert torch.allclose(algo.w[:P], w0[:P] - eta * lam @ gh, atol=1e-6)


@pytest.mark.quick
def test_apfl_loss_gives_the_three_apfl_gradients():
    torch.manual_seed(0)
    base = build_model("mlp", (6,), 3, hidden=[5])
    m = APFLModel(base, 0.3)
    with torch.no_grad():
        for p in m.v.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
    loss = apfl_loss(m, x, y, 0, adaptive=True)
    loss.backward()
    a = 0.3
    w = [p.detach() for p in m.w.parameters()]
    v = [p.detach() for p in m.v.parameters()]
    # reference gradients
    ref_w = build_model("mlp", (6,), 3, hidden=[5])
    ref_t = build_model("mlp", (6,), 3, hidden=[5])
    with torch.no_grad():
        for pr, pw in zip(ref_w.parameters(), w):
            pr.copy_(pw)
        for pr, pw, pv in zip(ref_t.parameters(), w, v):
            pr.copy_(a * pv + (1 - a) * pw)
    gw = torch.autograd.grad(F.cross_entropy(ref_w(x), y), list(ref_w.parameters()))
    gt = torch.autograd.grad(F.cross_entropy(ref_t(x), y), list(ref_t.parameters()))
    for p, g in zip(m.w.parameters(), gw):
        assert torch.allclose(p.grad, g, atol=1e-6)
    for p, g in zip(m.v.parameters(), gt):
        assert torch.allclose(p.grad, a * g, atol=1e-6)
    galpha = sum(((pv - pw) * g).sum() for pv, pw, g in zip(v, w, gt))
    assert m.alpha.grad.item() == pytest.approx(galpha.item(), rel=1e-5, abs=1e-7)
    m.zero_grad()
    apfl_loss(m, x, y, 0, adaptive=False).backward()
    assert m.alpha.grad is None or m.alpha.grad.abs().item() == 0


@pytest.mark.quick
def test_apfl_fixed_alpha_stays_and_adaptive_alpha_moves():
    fixed, *_ = make_algo("apfl", ["algo.alpha=0.5", "algo.adaptive=false"])
    adapt, *_ = make_algo("apfl", ["algo.alpha=0.1", "algo.adaptive=true"], lr=0.5)
    for t in range(3):
        fixed.round(t, np.array([0, 1, 2]))
        adapt.round(t, np.array([0, 1, 2]))
    assert torch.allclose(fixed.rows[:, fixed.acol], torch.tensor(0.5))
    a = adapt.rows[:, adapt.acol]
    assert not torch.allclose(a, torch.tensor(0.1)) and (a >= 0).all() and (a <= 1).all()


@pytest.mark.slow
def test_apfl_personal_model_has_v_s_own_batchnorm_statistics():

    from conftest import TinyFed, compose
    from fedbench.algorithms.apfl import APFL
    from fedbench.engine import Engine

    fed = TinyFed()
    cfg = compose(["algo=apfl", "batch_size=8", "optim.lr=0.1", "algo.alpha=0.5"])
    torch.manual_seed(0)
    eng = Engine(fed, bn_mlp(), device="cpu")
    algo = APFL.from_config(load_config(cfg), fed, eng, bn_mlp)
    P, D = eng.n_params, eng.n_state
    init = algo.rows[0].clone()
    for t in range(2):
        algo.round(t, np.array([0, 1, 2]))
    for i in range(3):
        row = algo.rows[i]
        v_buf, w_buf = row[algo.vcols[P:]], row[algo.wcols[P:]]
        # theta's forwards moved v's statistics (from mean 0 / var 1), separately from w's
        assert not torch.allclose(v_buf, init[algo.vcols[P:]])
        assert not torch.allclose(v_buf, w_buf)
        assert torch.isfinite(v_buf).all()
        var = v_buf[8:16]  # BatchNorm1d(8): running_mean, running_var
        assert (var > 0).all()
        # the personalized model deploys v_i's statistics with the mixed parameters
        a = row[algo.acol]
        out = algo.personal_state(i)
        assert out.shape == (D,) and torch.equal(out[P:], v_buf)
        exp = a * row[algo.vcols[:P]] + (1 - a) * row[algo.wcols[:P]]
        assert torch.allclose(out[:P], exp)


@pytest.mark.quick
def test_apfl_model_size_counts_v_and_w():
    algo, eng, fed = make_algo("apfl")
    size = algo.model_size()
    assert size["params_personal"] == 2 * eng.n_params
    assert size["params_global"] == eng.n_params


@pytest.mark.quick
def test_splitgp_server_head_is_averaged_and_bodies_mixed(monkeypatch):
    from fedbench.algorithms import splitgp

    algo, eng, fed = make_algo("splitgp", ["algo.gamma=0.2"])
    clients = np.array([0, 1, 2])
    trained = {}
    real = splitgp.train_on

    def capture(*args, **kw):
        res = real(*args, **kw)
        trained["states"] = res.states.clone()  # the clients' states after local training
        return res

    monkeypatch.setattr(splitgp, "train_on", capture)
    start_rows = algo.rows.clone()
    algo.round(0, clients)
    head, body = algo.head, ~algo.head
    own = trained["states"][:, algo.cols]  # base layout: body, server head, buffers
    avg = algo.weights(clients) @ own
    rows = algo.rows[:, algo.cols]
    # server part and global state: the weighted mean; bodies: gamma own + (1 - gamma) mean
    assert torch.allclose(algo.g, avg, atol=1e-6)
    assert torch.allclose(rows[:, head], avg[head].expand(3, -1), atol=1e-6)
    assert torch.allclose(rows[:, body], 0.2 * own[:, body] + 0.8 * avg[body], atol=1e-6)
    assert not torch.allclose(own[:, body], avg[body].expand(3, -1))  # the mix is not trivial
    # the auxiliary heads stay as trained
    assert torch.equal(algo.rows[:, algo.aux_cols], trained["states"][:, algo.aux_cols])
    assert not torch.equal(algo.rows, start_rows)
    # eval heads: global uses the server head, client uses its auxiliary head
    g_state = algo.personal_state(0)
    assert torch.equal(g_state[head], algo.g[head])
    algo.hp.eval_head = "client"
    c_state = algo.personal_state(0)
    assert torch.equal(c_state[head], algo.rows[0, algo.aux_cols])


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo,extra",
    [
        ("fedmgda", []),
        ("apfl", ["algo.alpha=0.1", "algo.adaptive=true"]),
        ("splitgp", []),
    ],
)
def test_baselines_learn_fmnist(tmp_path, algo, extra):
    # pat-2, 20 clients, a quarter online, 8 rounds: chance is 0.1 for both the personalized
    # model on its own test set (L) and the global model on the mixed set (G)
    summary, _ = run_small(
        tmp_path, [f"algo={algo}", "participation=0.25", "optim.lr=0.1", *extra], 8
    )
    final = summary["final"]
    assert final["personal"]["L"]["avg"] > 0.7
    assert final["global"]["G"]["avg"] > 0.25
