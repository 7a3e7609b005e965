"""MOON: the model-contrastive loss against a hand computation from the three
representations, its gradient through the engine against autograd of the direct formula
(each client with its own previous model), one round by hand, round 0 as FedAvg's (the
previous model is w^0 = the global model then), the reference models' BatchNorm statistics
read and never written, that it learns on real FMNIST, and that a killed run resumes
exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TinyFed, bn_mlp, compose, crash_and_resume, make_algo, run_small
from fedbench.algorithms.moon import ModelContrastive, contrastive_loss
from fedbench.config import load_config


def l_con_by_hand(z, zg, zp, tau):
    """Eq. 2 written out, per sample, then the batch mean."""
    out = []
    for a, g, p in zip(z, zg, zp):
        cos_g = (a @ g) / (a.norm() * g.norm())
        cos_p = (a @ p) / (a.norm() * p.norm())
        e_g, e_p = torch.exp(cos_g / tau), torch.exp(cos_p / tau)
        out.append(-torch.log(e_g / (e_g + e_p)))
    return torch.stack(out).mean()


def module_at(algo, state):
    """A separate module holding `state` (the reference models, built by hand)."""
    return algo.engine.to_module(state, algo.model_fn().to(state.device))


def perturbed(algo, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on any device
    return algo.w + scale * torch.randn(algo.w.shape, generator=g).to(algo.device)


@pytest.mark.quick
def test_contrastive_loss_by_hand():
    g = torch.Generator().manual_seed(0)
    z, zg, zp = (torch.randn(5, 7, generator=g, dtype=torch.float64) for _ in range(3))
    for tau in (0.5, 0.1, 2.0):
        torch.testing.assert_close(contrastive_loss(z, zg, zp, tau), l_con_by_hand(z, zg, zp, tau))
    # z equal to z_glob and orthogonal to z_prev: -log(e^{1/tau} / (e^{1/tau} + 1))
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    want = -math.log(math.exp(2.0) / (math.exp(2.0) + 1.0))
    assert contrastive_loss(z, z, torch.tensor([[0.0, 3.0]], dtype=torch.float64), 0.5).item() == (
        pytest.approx(want)
    )


@pytest.mark.quick
def test_objective_value_from_the_three_models():
    """The local loss on a batch: CE of the trained model + mu * l_con of its features
    against those of the global model and of the client's previous model (separate modules
    built by hand)."""
    algo, eng, fed = make_algo("moon", ["algo.mu=2.0", "algo.tau=0.3"])
    glob, prev, cur = algo.w.clone(), perturbed(algo, 1), perturbed(algo, 2)
    x, y = fed.x[:8], fed.y[:8]
    m_cur, m_glob, m_prev = (module_at(algo, s) for s in (cur, glob, prev))
    with torch.no_grad():
        z, zg, zp = m_cur.features(x), m_glob.features(x), m_prev.features(x)
        want = F.cross_entropy(m_cur(x), y) + 2.0 * l_con_by_hand(z, zg, zp, 0.3)
    obj = ModelContrastive(eng.model, eng.spec, glob, torch.stack([cur, prev]), 2.0, 0.3)
    eng.load(cur)
    got = obj(eng.model, x, y, 1)  # position 1: the previous model is row 1 (prev)
    torch.testing.assert_close(got.detach(), want)


@pytest.mark.quick
def test_gradient_of_each_client_against_autograd():
    """One SGD step (lr 1) through engine.train over clients [2, 0] from their own start
    points, each with its own previous model: the step is the autograd gradient of
    CE + mu * l_con written directly, on the engine's batch, the reference models fixed."""
    algo, eng, fed = make_algo("moon", ["algo.mu=5.0", "algo.tau=0.5"])
    clients = [2, 0]
    glob = algo.w.clone()
    prev = torch.stack([perturbed(algo, 3), perturbed(algo, 4)])
    start = torch.stack([perturbed(algo, 5, 0.1), perturbed(algo, 6, 0.1)])
    obj = ModelContrastive(eng.model, eng.spec, glob, prev, 5.0, 0.5)
    sgd = algo.optim.replace(momentum=0.0, weight_decay=0.0)
    new = eng.train(start, clients, optim=sgd, lr=1.0, batch_size=8, steps=1,
                    objective=obj).states  # fmt: skip
    P = eng.n_params
    m_glob = module_at(algo, glob)
    for c, client in enumerate(clients):
        ((x, y),) = list(eng.batches(client, 8, steps=1))
        m = module_at(algo, start[c])
        with torch.no_grad():
            zg, zp = m_glob.features(x), module_at(algo, prev[c]).features(x)
        z = m.features(x)
        loss = F.cross_entropy(m.head(z), y) + 5.0 * l_con_by_hand(z, zg, zp, 0.5)
        grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(m.parameters()))])
        torch.testing.assert_close(start[c, :P] - new[c, :P], grad, atol=1e-5, rtol=1e-4)


@pytest.mark.quick
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_round_by_hand(weighting):
    """Round 1 after round 0: clients train from w^1 with their own previous local models
    (client 1 never trained: w^0); the server averages; the trained models become the
    previous models and the deployed ones."""
    algo, eng, fed = make_algo("moon", [f"algo.weighting={weighting}"])
    w0 = algo.w.clone()
    algo.round(0, np.array([0, 2]))
    assert torch.equal(algo.seen, torch.tensor([True, False, True], device=algo.device))
    assert torch.equal(algo.theta[1], w0)  # never trained: its previous model is w^0
    w1, theta = algo.w.clone(), algo.theta.clone()
    clients = np.array([2, 1])
    obj = ModelContrastive(eng.model, eng.spec, w1, theta[clients], algo.hp.mu, algo.hp.tau)
    want = eng.train(w1, clients, optim=algo.optim, lr=algo.optim.lr_at(1), batch_size=8,
                     epochs=1, round=1, objective=obj).states  # fmt: skip
    n = (fed.train_sizes[clients] if weighting == "samples" else torch.ones(2)).to(algo.device)
    info = algo.round(1, clients)
    torch.testing.assert_close(algo.w, (n[:, None] / n.sum() * want).sum(0))
    torch.testing.assert_close(algo.theta[clients], want)
    assert torch.equal(algo.theta[0], theta[0])
    torch.testing.assert_close(algo.personal_state(1), want[1])
    assert torch.equal(algo.global_state(), algo.w)
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * 2 * eng.n_state


@pytest.mark.quick
def test_round_zero_is_fedavg():
    """Before any client trained, z_prev = z_glob (both w^0): l_con = log 2 with zero
    gradient, so round 0 trains as FedAvg (the authors' first round has no negative) and
    the loss is FedAvg's + mu log 2."""
    moon, _, _ = make_algo("moon")
    avg, _, _ = make_algo("fedavg")
    clients = np.array([0, 1, 2])
    a, b = moon.round(0, clients), avg.round(0, clients)
    torch.testing.assert_close(moon.w, avg.w, atol=1e-6, rtol=1e-5)
    mu_log2 = moon.hp.mu * math.log(2)
    assert float(a.train_loss) == pytest.approx(float(b.train_loss) + mu_log2, rel=1e-5)


@pytest.mark.quick
def test_reference_models_read_their_batchnorm_statistics_and_keep_them():
    """With BatchNorm, z_glob and z_prev are the eval-mode features of those states (their
    own running statistics), and the training step leaves the rows it read unchanged."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.engine import Engine

    fed = TinyFed()
    torch.manual_seed(0)
    eng = Engine(fed, bn_mlp(), device="cpu")
    algo = ALGORITHMS.get("moon").from_config(
        load_config(compose(["algo=moon", "batch_size=8"])), fed, eng, bn_mlp
    )
    P = eng.n_params
    glob = algo.w.clone()
    glob[P:] = torch.rand(eng.n_state - P, generator=torch.Generator().manual_seed(1)) + 0.5
    prev = glob[None].clone()
    obj = ModelContrastive(eng.model, eng.spec, glob, prev, 5.0, 0.5)
    x = fed.x[:8]
    ref = algo.engine.to_module(glob, bn_mlp()).eval()
    with torch.no_grad():
        torch.testing.assert_close(obj.represent(glob, x), ref.features(x))
    kept = glob.clone()
    eng.train(algo.w, [0], optim=algo.optim, lr=0.1, batch_size=8, epochs=1, objective=obj)
    assert torch.equal(glob, kept) and torch.equal(prev[0], kept)


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured (seed 0, 2 rounds, mu 1): personalized (each client's last local model)
    0.866, global 0.547 (chance 0.1: two classes per client, the global model after two
    rounds; FedAvg's 0.524)."""
    summary, _ = run_small(tmp_path, ["algo=moon", "optim.lr=0.1"], rounds=2)
    acc = summary["final"]["personal"]["L"]["avg"]
    glob = summary["final"]["global"]["all"]
    assert acc > 0.8, acc
    assert glob > 0.4, glob


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=moon", "clients=10", "eval.every=2", "checkpoint.every=2", "participation=0.5"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 4, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
