"""pFedLA: the layer-wise mix by hand, the hypernetwork's VJP against autograd of
<theta_bar_i(psi_i), Delta>, one round by hand, HeurpFedLA's kept layers, the clients' own
running statistics, that it learns on real FMNIST, and that a killed run resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TinyFed, bn_mlp, compose, crash_and_resume, make_algo, run_small
from fedbench.config import load_config
from fedbench.errors import ConfigError


def scrambled(extra=()):
    """pFedLA on the tiny federation with three different stored models and hypernetwork
    heads scaled down, so that the mixing weights are far from uniform."""
    algo, eng, fed = make_algo("pfedla", list(extra))
    g = torch.Generator().manual_seed(4)
    algo.theta += 0.5 * torch.randn(algo.theta.shape, generator=g)
    e = algo.hspec.index["heads.weight"]  # one random scale per output: alpha far from 1/N
    heads = algo.psi[:, e.start : e.stop].view(algo.N, -1, algo.hp.hidden)
    heads *= torch.exp(2 * torch.randn(algo.N, heads.shape[1], 1, generator=g))
    return algo, eng, fed


def alpha_by_hand(algo, i: int) -> torch.Tensor:
    """ReLU(heads(ReLU-MLP(v_i))) normalised over the clients, from client i's own weights."""
    from fedbench.algorithms.pfedla import LayerWeightNet

    net = LayerWeightNet(algo.N, algo.n_layers, algo.hp.embed_dim, algo.hp.hidden)
    algo.hspec.load_into(net, algo.psi[i])
    h = net.embedding
    for lin in (net.mlp[0], net.mlp[2], net.mlp[4]):
        h = torch.relu(h @ lin.weight.T + lin.bias)
    a = torch.relu(h @ net.heads.weight.T + net.heads.bias).view(algo.n_layers, algo.N)
    return (a / a.sum(1, keepdim=True)).detach()


def layer_slices(eng) -> list[list[slice]]:
    return [
        [slice(eng.spec.index[p].start, eng.spec.index[p].stop) for p in layer.params]
        for layer in eng.model.layers()
    ]


@pytest.mark.quick
def test_layer_wise_mix_by_hand():
    """theta_bar_i^l = sum_j alpha_i^{l,j} theta_j^l for the two layers of the MLP (fc1 and
    its bias, the head and its bias), with each client's own alpha_i."""
    algo, eng, _ = scrambled()
    for i in range(3):
        w = alpha_by_hand(algo, i)
        assert not torch.allclose(w, torch.full_like(w, 1 / 3), atol=0.02)  # a real mix
        want = algo.theta[i].clone()
        for l, slices in enumerate(layer_slices(eng)):
            for s in slices:
                want[s] = sum(w[l, j] * algo.theta[j, s] for j in range(3))
        torch.testing.assert_close(algo.personal_state(i), want)
        torch.testing.assert_close(algo.alpha(i)[0], w)


def theta_bar_graph(algo, eng, i, psi, kept=()):
    """theta_bar_i(psi) [P] built entry group by entry group with autograd through it (the
    naive [N, P] graph the algorithm avoids); `kept` layers use one-hot own weights."""
    a = algo.raw_weights(i, psi)
    w = a / a.sum(1, keepdim=True)
    P = eng.n_params
    out = torch.zeros(P)
    groups = layer_slices(eng)
    if algo.hp.granularity == "tensor":
        groups = [[slice(e.start, e.stop)] for e in eng.spec.params]
    for l, slices in enumerate(groups):
        wl = torch.eye(algo.N)[i] if l in kept else w[l]
        for s in slices:
            out[s] = wl @ algo.theta[:, s]
    return out


@pytest.mark.quick
@pytest.mark.parametrize("granularity", ["layer", "tensor"])
def test_hypernet_grad_is_autograd_of_the_inner_product(granularity):
    """g_i = (d theta_bar_i / d psi_i)^T Delta == grad_psi <theta_bar_i(psi), Delta>, entry by
    entry of psi_i (embedding, MLP, heads), the other stored models constant."""
    algo, eng, _ = scrambled([f"algo.granularity={granularity}"])
    n_layers = 2 if granularity == "layer" else 4  # fc1, head | their weights and biases
    assert algo.n_layers == n_layers
    delta = torch.randn(eng.n_params, generator=torch.Generator().manual_seed(5))
    for i in range(3):
        psi = algo.psi[i].clone().requires_grad_(True)
        (want,) = torch.autograd.grad((theta_bar_graph(algo, eng, i, psi) * delta).sum(), psi)
        g, _ = algo.hypernet_grad(i, delta, algo.theta)
        torch.testing.assert_close(g, want)
        assert g.abs().sum() > 0


@pytest.mark.quick
@pytest.mark.parametrize("sign", ["sent_minus_trained", "trained_minus_sent"])
def test_one_round_by_hand(sign):
    """Clients 0 and 2 train theta_bar_i E epochs; psi_i <- psi_i - eta g_i with Delta_i =
    theta_bar_i - theta~_i (or its negative), all against the models stored at the round's
    start; the server stores theta~_i; client 1 keeps its model and hypernetwork."""
    algo, eng, fed = scrambled([f"algo.delta={sign}", "algo.hn_lr=0.5"])
    theta0, psi0 = algo.theta.clone(), algo.psi.clone()
    clients = np.array([0, 2])
    start = torch.stack([algo.personal_state(i) for i in clients])
    want = eng.train(start.clone(), clients, optim=algo.optim, round=0, lr=algo.optim.lr_at(0),
                     epochs=1, batch_size=8).states  # fmt: skip
    P = eng.n_params
    info = algo.round(0, clients)
    for c, i in enumerate(clients):
        delta = start[c, :P] - want[c, :P]
        if sign == "trained_minus_sent":
            delta = -delta
        psi = psi0[i].clone().requires_grad_(True)
        saved, algo.theta = algo.theta, theta0
        (g,) = torch.autograd.grad((theta_bar_graph(algo, eng, i, psi) * delta).sum(), psi)
        algo.theta = saved
        torch.testing.assert_close(algo.psi[i], psi0[i] - 0.5 * g)
        torch.testing.assert_close(algo.theta[i], want[c])
    assert torch.equal(algo.theta[1], theta0[1]) and torch.equal(algo.psi[1], psi0[1])
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * 2 * eng.n_state
    alpha_self = np.mean([float(alpha_by_hand_at(psi0, algo, i)[:, i].mean()) for i in clients])
    assert float(info.diagnostics["alpha_self"]) == pytest.approx(alpha_self, rel=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("sign", ["sent_minus_trained", "trained_minus_sent"])
def test_sign_moves_the_mix_toward_or_away_from_the_trained_model(sign):
    """The claim behind the default: with a small step, psi_i's update moves theta_bar_i (the
    round-start stored models held fixed) toward the trained theta~_i; the reproduction's
    sign (`trained_minus_sent`) moves it away, for every client."""
    algo, eng, _ = scrambled([f"algo.delta={sign}", "algo.hn_lr=0.01"])
    P, clients = eng.n_params, np.arange(3)
    theta0 = algo.theta.clone()
    before = torch.stack([algo.personal_state(i) for i in clients])[:, :P]
    algo.round(0, clients)
    trained = algo.theta[:, :P].clone()
    algo.theta = theta0  # theta_bar_i(new psi_i) over the same stored models
    after = torch.stack([algo.personal_state(i) for i in clients])[:, :P]
    closer = (trained - after).norm(dim=1) < (trained - before).norm(dim=1)
    assert bool(closer.all()) if sign == "sent_minus_trained" else not closer.any()


def alpha_by_hand_at(psi, algo, i):
    saved, algo.psi = algo.psi, psi
    try:
        return alpha_by_hand(algo, i)
    finally:
        algo.psi = saved


@pytest.mark.quick
def test_momentum_buffer_per_client():
    """hn_momentum: SGD with one momentum buffer per client's hypernetwork (two visits)."""
    algo, eng, _ = scrambled(["algo.hn_momentum=0.9", "algo.hn_lr=0.1"])
    assert algo.psi_buf.shape == algo.psi.shape
    psi0 = algo.psi.clone()
    algo.round(0, np.array([1]))
    buf1 = algo.psi_buf[1].clone()
    torch.testing.assert_close(algo.psi[1], psi0[1] - 0.1 * buf1)  # the first step: buf = g
    assert not algo.psi_buf[[0, 2]].any()
    psi1 = algo.psi[1].clone()
    algo.round(1, np.array([1]))
    g2 = algo.psi_buf[1] - 0.9 * buf1
    torch.testing.assert_close(algo.psi[1], psi1 - 0.1 * (0.9 * buf1 + g2))


@pytest.mark.quick
def test_heurpfedla_keeps_the_top_self_weight_layer():
    """k=1: the layer with the largest alpha_i^{l,i} is client i's own theta_i^l (not sent:
    bytes down exclude it), the other layer is mixed; the kept layer gives no gradient."""
    algo, eng, _ = scrambled(["algo.k=1"])
    slices = layer_slices(eng)
    for i in range(3):
        w = alpha_by_hand(algo, i)
        top = int(w[:, i].argmax())
        got = algo.personal_state(i)
        for s in slices[top]:
            assert torch.equal(got[s], algo.theta[i, s])
        other = 1 - top
        for s in slices[other]:
            torch.testing.assert_close(got[s], w[other] @ algo.theta[:, s])
        delta = torch.randn(eng.n_params, generator=torch.Generator().manual_seed(i))
        psi = algo.psi[i].clone().requires_grad_(True)
        out = theta_bar_graph(algo, eng, i, psi, kept=(top,))
        (want,) = torch.autograd.grad((out * delta).sum(), psi)
        torch.testing.assert_close(algo.hypernet_grad(i, delta, algo.theta)[0], want)
    tops = [int(alpha_by_hand(algo, i)[:, i].argmax()) for i in (0, 2)]
    kept = sum(sum(s.stop - s.start for s in slices[t]) for t in tops)
    info = algo.round(0, np.array([0, 2]))
    assert info.comm.bytes_down == 4 * (2 * eng.n_state - kept)
    assert info.comm.bytes_up == 4 * 2 * eng.n_state


@pytest.mark.quick
def test_running_statistics_are_the_clients_own():
    """A BatchNorm MLP: theta_bar_i mixes the parameters (the norm's affine ones with its
    layer) and keeps theta_i's running statistics; training updates them and the server
    stores them with theta~_i."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.engine import Engine

    fed = TinyFed()
    torch.manual_seed(0)
    eng = Engine(fed, bn_mlp(), device="cpu")
    algo = ALGORITHMS.get("pfedla").from_config(
        load_config(compose(["algo=pfedla", "batch_size=8"])), fed, eng, bn_mlp
    )
    assert algo.n_layers == 2  # Linear + BatchNorm, head
    P = eng.n_params
    g = torch.Generator().manual_seed(1)
    algo.theta[:, P:] = torch.rand(3, eng.n_state - P, generator=g) + 0.5
    algo.theta[:, :P] += 0.3 * torch.randn(3, P, generator=g)
    for i in range(3):
        s = algo.personal_state(i)
        assert torch.equal(s[P:], algo.theta[i, P:])
        assert not torch.allclose(s[:P], algo.theta[i, :P])
    before = algo.theta.clone()
    algo.round(0, np.array([1]))
    assert not torch.equal(algo.theta[1, P:], before[1, P:])
    assert torch.equal(algo.theta[[0, 2]], before[[0, 2]])


@pytest.mark.quick
def test_bad_values_are_one_line():
    with pytest.raises(ConfigError, match=r"algo.k=3: the model has 2 layers; use 0..2"):
        make_algo("pfedla", ["algo.k=3"])
    with pytest.raises(ConfigError, match="over algo.max_params"):
        make_algo("pfedla", ["algo.max_params=1000"])


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured 0.817 in 5 rounds (seed 0, hn_lr 10). The same run with the hypernetwork at
    the reproduction's hn_lr 5e-3 (alpha stays ~uniform: FedAvg's global model over the 20
    stored models) gives 0.672, and with KarhouTam/FL-bench's sign of Delta 0.356; seeds 1 and
    2 give 0.694 and 0.766: seed 0's margin over the bar is about the spread over seeds."""
    summary, _ = run_small(tmp_path, ["algo=pfedla", "optim.lr=0.1", "algo.hn_lr=10.0"], rounds=5)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.70, acc


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=pfedla", "algo.hn_momentum=0.9", "eval.every=2", "checkpoint.every=2",
            "participation=0.5"]  # fmt: skip
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 5, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
