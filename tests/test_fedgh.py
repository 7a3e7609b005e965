"""FedGH: the server's SGD on uploaded tensors against a hand-computed gradient, one round
against the engine and the class means by hand, that it learns on real FMNIST, and that a
killed run resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import crash_and_resume, make_algo, run_small
from fedbench.algorithms._shared import keyed_generator
from fedbench.engine import fit_on_server


def linear(p, x):
    return F.linear(x, p["weight"], p["bias"])


@pytest.mark.quick
def test_one_full_batch_step_is_the_hand_gradient():
    """One step on all M pairs: W <- W - lr (softmax(XW^T + b) - onehot(y))^T X / M."""
    g = torch.Generator().manual_seed(0)
    x, W, b = torch.randn(4, 3, generator=g), torch.randn(2, 3, generator=g), torch.zeros(2)
    y = torch.tensor([0, 1, 1, 0])
    new, loss = fit_on_server({"weight": W, "bias": b}, linear, x, y, lr=0.5, epochs=1,
                              batch_size=4, generator=keyed_generator(0))  # fmt: skip
    err = torch.softmax(x @ W.T + b, 1) - F.one_hot(y, 2).float()
    torch.testing.assert_close(new["weight"], W - 0.5 * err.T @ x / 4)
    torch.testing.assert_close(new["bias"], b - 0.5 * err.mean(0))
    torch.testing.assert_close(loss, F.cross_entropy(x @ W.T + b, y))
    assert torch.equal(b, torch.zeros(2))  # the inputs are left as they were


@pytest.mark.quick
def test_server_fit_with_the_run_optimizer_matches_torch_optim():
    """With an `optim`, each server step is that optimizer's (here Adam, against torch.optim
    on the same minibatches); without one, plain SGD."""
    from fedbench.engine import OptimConfig

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=g), torch.randint(0, 3, (12,), generator=g)
    W, b = torch.randn(3, 4, generator=g), torch.zeros(3)
    linear = lambda p, z: F.linear(z, p["weight"], p["bias"])  # noqa: E731
    adam = OptimConfig(name="adam", lr=0.05)
    gen = keyed_generator(3, 1, 7)
    new, _ = fit_on_server(
        {"weight": W, "bias": b}, linear, x, y, lr=0.05, epochs=2, batch_size=5, generator=gen,
        optim=adam,
    )  # fmt: skip
    ref = {"weight": W.clone().requires_grad_(True), "bias": b.clone().requires_grad_(True)}
    opt = torch.optim.Adam(ref.values(), lr=0.05)
    gen = keyed_generator(3, 1, 7)
    for _ in range(2):
        order = torch.randperm(12, generator=gen)
        for s in range(0, 12, 5):
            i = order[s : s + 5]
            opt.zero_grad()
            F.cross_entropy(linear(ref, x[i]), y[i]).backward()
            opt.step()
    for k in ref:
        torch.testing.assert_close(new[k], ref[k].detach(), rtol=1e-4, atol=1e-5)  # eps order
    assert torch.equal(W, W.clone()) and b.abs().sum() == 0  # the inputs are left as they were


@pytest.mark.quick
def test_keyed_order_needs_no_saved_state():
    """The same key draws the same minibatch order (so the same result); another round's
    key another one."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, generator=g), torch.tensor([0, 1, 0, 1, 1, 0])
    p = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}

    def fit(*key):
        return fit_on_server(p, linear, x, y, lr=1.0, epochs=2, batch_size=1,
                             generator=keyed_generator(*key))[0]["weight"]  # fmt: skip

    assert torch.equal(fit(0, 3, 7), fit(0, 3, 7))
    assert not torch.equal(fit(0, 3, 7), fit(0, 4, 7))


@pytest.mark.quick
def test_round_by_hand():
    """Clients train (own extractor, global header); they keep the trained extractor; the
    server fits the header to their per-class mean features from theta^t with the keyed
    order; a client deploys its extractor with the new header; bytes: every LAR and label up,
    the header down to each sampled client."""
    from fedbench.algorithms.fedgh import SERVER_SALT

    algo, eng, fed = make_algo("fedgh", ["algo.server_lr=0.5", "algo.server_batch_size=2"])
    g = torch.Generator().manual_seed(2)
    algo.theta += 0.1 * torch.randn(algo.theta.shape, generator=g)  # distinct extractors
    algo.header += 0.1 * torch.randn(algo.header.shape, generator=g)
    head, theta0, h0 = algo.head_entries, algo.theta.clone(), algo.header.clone()
    clients = np.array([0, 2])
    start = theta0[clients].clone()
    start[:, head] = h0
    trained = eng.train(start.clone(), clients, optim=algo.optim, round=0, lr=algo.optim.lr_at(0),
                        epochs=1, batch_size=8).states  # fmt: skip
    xs, ys = [], []
    for s, i in zip(trained, clients):
        model = eng.to_module(s, eng.model)
        model.eval()
        idx = fed.train_idx[int(i)]
        x, y = fed.batch(idx)
        with torch.no_grad():
            f = model.features(x)
        for k in range(fed.num_classes):
            if (y == k).any():
                xs.append(f[y == k].mean(0))
                ys.append(k)
    x, y = torch.stack(xs), torch.tensor(ys)
    K, Fd = fed.num_classes, algo.F
    W, b = h0[: K * Fd].view(K, Fd).clone(), h0[K * Fd :].clone()
    order = torch.randperm(len(y), generator=keyed_generator(algo.run.seed, 0, SERVER_SALT))
    for s in range(0, len(y), 2):  # plain SGD by autograd, batches of 2
        bi = order[s : s + 2]
        W.requires_grad_(True), b.requires_grad_(True)
        gW, gb = torch.autograd.grad(F.cross_entropy(x[bi] @ W.T + b, y[bi]), [W, b])
        W, b = (W - 0.5 * gW).detach(), (b - 0.5 * gb).detach()
    info = algo.round(0, clients)
    torch.testing.assert_close(algo.theta[clients][:, ~head], trained[:, ~head])
    assert torch.equal(algo.theta[1], theta0[1])  # not sampled: untouched
    torch.testing.assert_close(algo.header, torch.cat([W.reshape(-1), b]))
    deployed = algo.personal_state(1)
    assert torch.equal(deployed[~head], theta0[1][~head]) and torch.equal(
        deployed[head], algo.header
    )
    assert info.comm.bytes_up == 4 * len(y) * (Fd + 1)
    assert info.comm.bytes_down == 4 * 2 * (K * Fd + K)


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured 0.972 in 5 rounds (seed 0; server loss on the LARs 0.41 -> 0.07). On this
    pathological split the clients' extractors carry most of it: a header never trained
    (server_lr 1e-6, the fault of the authors' code's optimizer binding) still gives 0.967,
    so the server step itself is checked by test_round_by_hand, not here."""
    summary, _ = run_small(tmp_path, ["algo=fedgh", "optim.lr=0.1"], rounds=5)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.9, acc


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=fedgh", "eval.every=2", "checkpoint.every=2", "participation=0.5"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 5, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
