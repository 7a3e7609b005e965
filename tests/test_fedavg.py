"""FedAvg / FedProx / Local: the server math by hand, and learning on real FMNIST."""

from __future__ import annotations

import pytest
import torch

from conftest import make_algo as make
from conftest import run_small


@pytest.mark.quick
def test_fedavg_round_is_sample_weighted_mean():
    algo, eng, fed = make("fedavg")
    w0 = algo.w.clone()
    clients = [0, 2]
    algo.round(0, clients)
    res = eng.train(w0, clients, optim=algo.optim, lr=0.1, batch_size=8, epochs=1)
    n = fed.train_sizes[clients]
    expect = (n[0] * res.states[0] + n[1] * res.states[1]) / n.sum()
    torch.testing.assert_close(algo.w, expect)
    torch.testing.assert_close(algo.personal_states()[2], res.states[1])
    torch.testing.assert_close(algo.personal_states()[1], algo.w)  # never sampled: deploys w


@pytest.mark.quick
def test_fedprox_mu_zero_is_fedavg_and_mu_pulls_towards_w():
    avg, _, _ = make("fedavg")
    prox0, _, _ = make("fedprox", ["algo.mu=0.0"])
    prox, _, _ = make("fedprox", ["algo.mu=10.0"])
    w0 = avg.w.clone()
    for a in (avg, prox0, prox):
        a.round(0, [0, 1, 2])
    torch.testing.assert_close(prox0.w, avg.w)
    assert (prox.theta - w0).norm() < (avg.theta - w0).norm()


@pytest.mark.quick
def test_uniform_weighting():
    algo, eng, _ = make("fedavg", ["algo.weighting=uniform"])
    w0 = algo.w.clone()
    algo.round(0, [0, 1])
    res = eng.train(w0, [0, 1], optim=algo.optim, lr=0.1, batch_size=8, epochs=1)
    torch.testing.assert_close(algo.w, res.states.mean(0))


# The engine family's uploads reach the server through `receive` (attackable algorithms).
SERVER_STATE = {"fedrep": "phi", "plgu_grep": "phi", "pfedhn": "phi", "plgu_ghn": "phi"}
ATTACKABLE = [
    ("fedavg", []),
    ("fedprox", []),
    ("fedsam", []),
    ("fedrep", ["algo.head_epochs=1"]),
    ("plgu_lf", []),
    ("plgu_grep", ["algo.head_epochs=1"]),
    ("ditto", []),
    ("ditto", ["algo.interleave=true"]),
    ("pfedme", ["algo.local_rounds=2", "algo.inner_steps=2"]),
    ("pfedhn", ["algo.inner_steps=3"]),
    ("plgu_ghn", ["algo.inner_steps=3"]),
]


@pytest.mark.quick
@pytest.mark.parametrize("name,extra", ATTACKABLE)
def test_uploads_go_through_receive(name, extra):
    """With every client malicious (A2: each model update scaled 100 times where the server
    receives it), the server's state moves away from the honest run's."""
    from fedbench.attack import Attack

    honest, _, fed = make(name, extra)
    attacked, _, _ = make(name, extra)
    assert type(attacked).attackable
    attacked.attack = Attack("a2", 1.0, fed.num_clients, 0)
    key = SERVER_STATE.get(name)
    before = getattr(attacked, key).clone() if key else attacked.global_state().clone()
    for a in (honest, attacked):
        a.round(0, [0, 1, 2])
    h, b = (
        (getattr(honest, key), getattr(attacked, key))
        if key
        else (honest.global_state(), attacked.global_state())
    )
    assert torch.isfinite(b).all() and not torch.allclose(h, b)
    if name in ("fedavg", "fedprox", "fedsam", "ditto", "plgu_lf"):  # a weighted mean of models
        torch.testing.assert_close(b - before, 100 * (h - before), rtol=1e-4, atol=1e-4)


@pytest.mark.quick
def test_local_uploads_nothing():
    algo, _, _ = make("local")
    assert not type(algo).attackable


# Chance is 0.10. On pat-2, personal models (two classes each) pass 0.8 within a few rounds;
# the global model must clearly beat chance.
@pytest.mark.slow
@pytest.mark.parametrize("algo", ["fedavg", "fedprox"])
def test_global_algorithms_learn_fmnist(tmp_path, algo):
    s, _ = run_small(tmp_path, [f"algo={algo}"], rounds=5)
    assert s["final"]["personal"]["L"]["avg"] >= 0.80
    assert s["final"]["global"]["L"]["avg"] >= 0.40


@pytest.mark.slow
def test_local_learns_fmnist(tmp_path):
    s, _ = run_small(tmp_path, ["algo=local"], rounds=3)
    assert s["final"]["global"] is None
    assert s["final"]["personal"]["L"]["avg"] >= 0.80


@pytest.mark.slow
def test_fedavg_iid_reaches_80_percent(tmp_path):
    """The foundation's acceptance bar, on a smaller budget: FedAvg iid, MLP, global >= 0.80.
    20 rounds reach 0.8365 (measured); 10 rounds reached 0.803, six test samples of 2000
    above the bar: too close for a result that moves with the CPU's float rounding."""
    s, _ = run_small(
        tmp_path, ["algo=fedavg", "split=iid", "split.train_per_client=600", "optim.lr=0.1"], 20
    )
    assert s["final"]["global"]["L"]["avg"] >= 0.80
