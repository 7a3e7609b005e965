"""GPFL: the Conditional Valve, the angle- and magnitude-level losses and the objective against
hand computation; a round against a hand-written SGD replay (uploads, averages, the heads
each client keeps, the conditional inputs); attack A2 on both uploads; that it learns on real
FMNIST; that a killed run resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import crash_and_resume, make_algo, run_small
from fedbench.algorithms.gpfl import CoV, angle_loss, gpfl_objective, magnitude_loss
from fedbench.config import load_config


def layer_norm(v: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return (v - v.mean()) / torch.sqrt(v.var(unbiased=False) + 1e-5) * weight + bias


def cov_by_hand(cov: CoV, f: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(3)-(4) written out: ReLU((LN(ReLU(A_g c + a_g)) + 1) f + LN(ReLU(A_b c + a_b)))."""
    out = []
    for seq in (cov.gamma, cov.beta):
        lin, ln = seq[0], seq[2]
        out.append(layer_norm(torch.relu(lin.weight @ c + lin.bias), ln.weight, ln.bias))
    gamma, beta = out
    return torch.relu(f * (gamma + 1) + beta)


@pytest.mark.quick
def test_angle_and_magnitude_losses_by_hand():
    """(8): mean_b -log(e^{cos_by} / sum_c e^{cos_bc}), cos_bc = <f_b, W_c> / (|f_b| |W_c|);
    (9): mean_b |f_b - E_b| (sample) and sqrt(sum_b |f_b - E_b|^2) (batch, the authors')."""
    g = torch.Generator().manual_seed(0)
    f = torch.randn(5, 4, generator=g)
    W = torch.randn(3, 4, generator=g)
    y = torch.tensor([0, 2, 1, 1, 0])
    losses = []
    for b in range(5):
        cos = [float(f[b] @ W[c] / (f[b].norm() * W[c].norm())) for c in range(3)]
        losses.append(-cos[int(y[b])] + np.log(sum(np.exp(v) for v in cos)))
    torch.testing.assert_close(angle_loss(f, W, y), torch.tensor(np.mean(losses)).float())
    E = torch.randn(5, 4, generator=g)
    dists = [float(((f[b] - E[b]) ** 2).sum().sqrt()) for b in range(5)]
    torch.testing.assert_close(magnitude_loss(f, E, "sample"), torch.tensor(np.mean(dists)).float())
    total = float(((f - E) ** 2).sum().sqrt())
    torch.testing.assert_close(magnitude_loss(f, E, "batch"), torch.tensor(total))
    # the angle loss ignores magnitudes: scaling f or W changes nothing
    torch.testing.assert_close(angle_loss(3 * f, 0.5 * W, y), angle_loss(f, W, y))


@pytest.mark.quick
def test_objective_by_hand():
    """(3)-(11) on one batch of the tiny federation's model: the value composed by hand, What
    and the conditional inputs constants, the mu term's gradient mu theta on CoV and W only."""
    algo, eng, fed = make_algo("gpfl", ["algo.lam=0.3", "algo.mu=0.2"])
    model = algo.trainer.model
    g = torch.Generator().manual_seed(4)  # drawn on the CPU: the same values on any device
    dev = algo.device
    row = algo.rows([1])[0].clone()
    row[algo.p_idx] = torch.randn(len(algo.p_idx), generator=g).to(dev)
    row[algo.g_idx] = torch.randn(len(algo.g_idx), generator=g).to(dev)
    algo.trainer.load(row)
    x, y = fed.x[:7], fed.y[:7]
    frozen = torch.randn(algo.table_shape, generator=g).to(dev)
    kw = dict(frozen=frozen, lam=0.3, mu=0.2, magnitude="sample")
    loss = gpfl_objective(model, x, y, 0, **kw)

    with torch.no_grad():
        f = model.body(x)
        f_p = torch.stack([cov_by_hand(model.cov, fb, model.cond_p) for fb in f])
        f_g = torch.stack([cov_by_hand(model.cov, fb, model.cond_g) for fb in f])
        logits = f_p @ model.head.weight.T + model.head.bias
        rows = torch.arange(7, device=dev)
        ce = (torch.logsumexp(logits, 1) - logits[rows, y]).mean()
        W = model.gce.weight
        cos = F.normalize(f_g) @ F.normalize(W).T
        alg = (torch.logsumexp(cos, 1) - cos[rows, y]).mean()
        mlg = (f_g - frozen[y]).norm(dim=1).mean()
        sq = sum(p.pow(2).sum() for p in model.cov.parameters()) + W.pow(2).sum()
        want = ce + alg + 0.3 * mlg + 0.1 * sq
    torch.testing.assert_close(loss, want)

    gw = torch.autograd.grad(loss, model.gce.weight, retain_graph=True)[0]
    f_g = model.cov(model.body(x), model.cond_g)
    (g_alg,) = torch.autograd.grad(angle_loss(f_g, model.gce.weight, y), model.gce.weight)
    torch.testing.assert_close(gw, g_alg + 0.2 * model.gce.weight.detach())  # W^fr: no grad
    gh = torch.autograd.grad(loss, model.head.weight)[0]
    plain = gpfl_objective(model, x, y, 0, **{**kw, "mu": 0.0})
    torch.testing.assert_close(gh, torch.autograd.grad(plain, model.head.weight)[0])


def replay(algo, client: int, row: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
    """Plain SGD by hand over the engine's batches of `client` (the run's lr, batch 8, one
    epoch) on (11) written out with (3)-(4) by hand."""
    from fedbench.algorithms.gpfl import GPFLModel

    tr = algo.trainer
    model = tr.to_module(row, GPFLModel(algo.model_fn(), algo.fed.num_classes).to(row.device))
    params = dict(model.named_parameters())
    lam, mu, lr = algo.hp.lam, algo.hp.mu, algo.optim.lr
    for x, y in tr.batches(client, 8, epochs=1, round=0):
        f = model.body(x)
        f_p = torch.stack([cov_by_hand(model.cov, fb, model.cond_p) for fb in f])
        f_g = torch.stack([cov_by_hand(model.cov, fb, model.cond_g) for fb in f])
        loss = F.cross_entropy(model.head(f_p), y)
        cos = F.normalize(f_g) @ F.normalize(model.gce.weight).T
        loss = loss + F.cross_entropy(cos, y) + lam * (f_g - frozen[y]).norm(dim=1).mean()
        ext = [p for n, p in params.items() if n.startswith(("cov.", "gce."))]
        loss = loss + mu / 2 * sum(p.pow(2).sum() for p in ext)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, gr in zip(params.values(), grads):
                p -= lr * gr
    return tr.spec.flatten(model)


def round_by_hand(conditional: str):
    """One round on the tiny federation from random conditional inputs and heads, against
    the SGD replay: returns (algo, fed, clients, trained rows, C^t table, the round's info,
    the heads before)."""
    algo, eng, fed = make_algo(
        "gpfl", ["algo.lam=0.5", "algo.mu=0.1", f"algo.conditional={conditional}"]
    )
    g = torch.Generator().manual_seed(2)  # drawn on the CPU: the same values on any device
    dev = algo.device
    algo.cond_p = torch.randn(algo.cond_p.shape, generator=g).to(dev)
    algo.cond_g = torch.randn(algo.cond_g.shape, generator=g).to(dev)
    algo.heads = algo.heads + 0.1 * torch.randn(algo.heads.shape, generator=g).to(dev)
    w0, ext0, heads0 = algo.w.clone(), algo.ext.clone(), algo.heads.clone()
    W0 = algo.table(ext0)
    start = algo.rows(np.arange(3))
    torch.testing.assert_close(start[:, algo.p_idx], algo.cond_p)
    clients = np.array([0, 2])
    trained = torch.stack([replay(algo, int(i), start[int(i)], W0) for i in clients])
    info = algo.round(0, clients)

    n = fed.train_sizes[clients].to(dev)  # the federation keeps the sizes on the CPU
    avg = (n[:, None] / n.sum() * trained).sum(0)
    body = ~algo.run_head
    torch.testing.assert_close(algo.w[body], avg[algo.run_idx][body])
    assert torch.equal(algo.w[algo.run_head], w0[algo.run_head])
    torch.testing.assert_close(algo.ext, avg[algo.ext_idx])
    torch.testing.assert_close(algo.heads[clients], trained[:, algo.head_idx])
    assert torch.equal(algo.heads[1], heads0[1])
    sent = eng.n_state - int(algo.run_head.sum()) + algo.ext.numel()
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * 2 * sent
    return algo, fed, clients, trained, W0


def label_distribution(fed) -> torch.Tensor:
    """(6): alpha_i^u = n_i^u / n_i, [N, U]."""
    counts = torch.stack([torch.bincount(fed.y[ix], minlength=3) for ix in fed.train_idx])
    return counts.float() / counts.sum(1, keepdim=True)


@pytest.mark.quick
def test_round_by_hand():
    """Sampled clients 0 and 2 train (11) from (phi^t, CoV^t, C^t, own head, own p_i, g);
    phi, CoV and C are averaged by sample count; each keeps its head; client 1 keeps its
    own; the head is never sent. After the round every client's conditional inputs are
    (5) and (7) of the new global C^{t+1}: g = (1/U) sum_u C[u] for all, p_i = (1/U)
    sum_u alpha_i^u C[u]; the deployed model uses them with the latest phi, CoV."""
    algo, fed, clients, trained, W0 = round_by_hand("received")
    alpha, W1 = label_distribution(fed), algo.table(algo.ext)
    U = W1.shape[0]
    for i in range(3):
        torch.testing.assert_close(algo.cond_p[i], sum(alpha[i, u] * W1[u] for u in range(U)) / U)
        torch.testing.assert_close(algo.cond_g[i], sum(W1[u] for u in range(U)) / U)

    deployed = algo.personal_state(1)  # latest phi and CoV, own head and p_1
    model = algo.personal_model(1).to(algo.device)  # built on the CPU by model_fn
    x = fed.x[fed.test_idx[1]]
    f = model.body(x)
    logits = model.head(torch.stack([cov_by_hand(model.cov, fb, algo.cond_p[1]) for fb in f]))
    torch.testing.assert_close(algo.trainer.logits(deployed, x), logits.detach())


@pytest.mark.quick
def test_received_inputs_from_the_initial_embeddings_in_round_0():
    """Algorithm 1, lines 7-8: round 0 trains with (5) and (7) of C^0 (not zeros); with
    `held` (the authors' code) the inputs are zeros until the first round ends."""
    algo, _, fed = make_algo("gpfl")
    W0, alpha = algo.table(algo.ext), label_distribution(fed)
    torch.testing.assert_close(algo.cond_p, alpha @ W0 / W0.shape[0])
    torch.testing.assert_close(algo.cond_g, W0.mean(0).expand(3, -1))
    assert algo.cond_p.abs().sum() > 0
    held, _, _ = make_algo("gpfl", ["algo.conditional=held"])
    assert not held.cond_p.any() and not held.cond_g.any()


@pytest.mark.quick
def test_held_conditional_inputs_are_the_authors_set_gce():
    """`conditional=held`: after the round, g_i = mean_u W_i[u] and p_i = sum_u alpha_i^u
    W_i[u] (no 1/U) from the trained W_i for the sampled clients, from C^t for client 1."""
    algo, fed, clients, trained, W0 = round_by_hand("held")
    alpha = label_distribution(fed)
    Wi = algo.table(trained[:, algo.ext_idx])  # [2, U, K]
    for c, i in enumerate(clients):
        torch.testing.assert_close(algo.cond_p[i], alpha[i] @ Wi[c])
        torch.testing.assert_close(algo.cond_g[i], Wi[c].mean(0))
    torch.testing.assert_close(algo.cond_p[1], alpha[1] @ W0)
    torch.testing.assert_close(algo.cond_g[1], W0.mean(0))


@pytest.mark.quick
def test_a2_scales_both_uploads():
    """Attack A2 on every client but one: the server averages 100 (u_i - u^t) + u^t of the
    body and of all of CoV + GCE (`n_params=E`: here E = 200 > P = 83, the run model's
    parameter count `receive` would otherwise scale); heads come from the honest training."""
    from fedbench.attack import Attack

    algo, eng, fed = make_algo("gpfl")
    w0, ext0 = algo.w.clone(), algo.ext.clone()
    assert ext0.numel() > eng.n_params
    clients = np.arange(3)
    res = algo.trainer.train(
        algo.rows(clients), clients, optim=algo.optim, lr=algo.optim.lr, batch_size=8, epochs=1,
        objective=lambda m, x, y, c: gpfl_objective(
            m, x, y, c, frozen=algo.table(ext0), lam=algo.hp.lam, mu=algo.hp.mu,
            magnitude=algo.hp.magnitude),
    )  # fmt: skip
    algo.attack = Attack("a2", 0.5, 3, seed=0)
    bad = torch.as_tensor(algo.attack.malicious, device=algo.device)
    assert 0 < int(bad.sum()) < 3
    algo.round(0, clients)
    wts = (fed.train_sizes / fed.train_sizes.sum())[:, None].to(algo.device)
    P = eng.n_params
    up = res.states[:, algo.run_idx]
    sent = torch.where(bad[:, None], 100 * (up - w0) + w0, up)
    body = ~algo.run_head[:P]
    torch.testing.assert_close(algo.w[:P][body], (wts * sent).sum(0)[:P][body])
    up = res.states[:, algo.ext_idx]
    sent = torch.where(bad[:, None], 100 * (up - ext0) + ext0, up)
    torch.testing.assert_close(algo.ext, (wts * sent).sum(0))
    torch.testing.assert_close(algo.heads, res.states[:, algo.head_idx])


@pytest.mark.quick
def test_cov_and_gce_come_from_the_seed_not_the_global_rng():
    """CoV and GCE are drawn from the run's seed; building GPFL leaves the global RNG as it
    was."""
    from conftest import compose

    a, eng, fed = make_algo("gpfl")
    before = torch.random.get_rng_state()
    b = type(a).from_config(load_config(compose(["algo=gpfl", "seed=1"])), fed, eng, a.model_fn)
    assert torch.equal(torch.random.get_rng_state(), before)
    c = type(a).from_config(load_config(compose(["algo=gpfl"])), fed, eng, a.model_fn)
    assert torch.equal(a.ext, c.ext) and not torch.equal(a.ext, b.ext)


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """5 rounds at lr 0.05: personalized L accuracy measured 0.881 (seed 0; 0.869 with
    `conditional=held`; 0.738 at lr 0.1, FedPer's 0.949 there)."""
    summary, _ = run_small(tmp_path, ["algo=gpfl", "optim.lr=0.05"], rounds=5)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.75, acc


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=gpfl", "eval.every=1", "checkpoint.every=1", "participation=0.25"]
    # the second engine's kept optimizer state (momentum) must come back too (WithTrainer)
    over += ["optim.momentum=0.9", "optim.persist_state=true", "optim.lr=0.02"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 3, die_at=2)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
