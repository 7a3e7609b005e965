"""FedCP: the conditional policy and the two heads by hand, the MMD term by hand and its
gradient against autograd, one round by hand (local steps, what is averaged, what each client
keeps), the Gumbel noise per client, the attack on every upload, BatchNorm statistics (and the
frozen extractor's batch statistics in the MMD term), the CPN's own random stream, that it
learns on real FMNIST and that a killed run resumes exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from conftest import TinyFed, bn_mlp, compose, crash_and_resume, make_algo, run_small
from fedbench.algorithms._shared import train_on
from fedbench.algorithms.fedcp import RBF_BANDWIDTHS, CPModel, fedcp_loss, mmd2
from fedbench.config import load_config


def views(spec, state: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each parameter of a flat state as its own leaf tensor (for autograd by hand)."""
    return {
        e.name: state[e.start : e.stop].view(e.shape).clone().requires_grad_(True)
        for e in spec.params
    }


def hand_mmd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """MMD^2 from the pairwise differences (not the Gram expansion the module uses)."""

    def k(u, v):
        d = ((u[:, None, :] - v[None, :, :]) ** 2).sum(-1)
        return sum(torch.exp(-d / (2 * s)) for s in (10, 15, 20, 50))

    return (k(a, a) + k(b, b) - 2 * k(a, b)).mean()


def hand_logits(p, model, x, ctx, tau, noise=None):
    """out = W^hd((1 - s) h) + W_i^hd(s h), s = softmax over the CPN's two halves, by hand."""
    body = {n[len("body.") :]: v for n, v in p.items() if n.startswith("body.")}
    h = functional_call(model.body, body, (x,))
    z = (h * ctx) @ p["cpn.0.weight"].T + p["cpn.0.bias"]
    mu = z.mean(1, keepdim=True)
    var = ((z - mu) ** 2).mean(1, keepdim=True)
    z = torch.relu((z - mu) / torch.sqrt(var + 1e-5) * p["cpn.1.weight"] + p["cpn.1.bias"])
    K = h.shape[1]
    z0, z1 = z[:, :K], z[:, K:]
    if noise is not None:  # Gumbel draws g = -log(e)
        z0, z1 = z0 - noise[:, 0].log(), z1 - noise[:, 1].log()
    s = 1 / (1 + torch.exp(-(z0 - z1) / tau))  # the two-way softmax's first share
    out = (s * h) @ p["phead.weight"].T + p["phead.bias"]
    return out + ((1 - s) * h) @ p["head.weight"].T + p["head.bias"], h, s


def randomize(state: torch.Tensor, seed: int) -> torch.Tensor:
    """`state` plus noise drawn on the CPU (the same values on any device)."""
    g = torch.Generator().manual_seed(seed)
    return state + 0.3 * torch.randn(state.shape, generator=g).to(state.device)


@pytest.mark.quick
@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_policy_and_heads_by_hand(tau):
    """Inference: v^ = normalized class sum of W_i^hd, s = softmax of the CPN's halves (no
    noise), out = W^hd((1 - s) h) + W_i^hd(s h); in training the Gumbel draws of the
    generator enter the logits. r + s = 1 and both lie in (0, 1)."""
    algo, _, fed = make_algo("fedcp", [f"algo.tau={tau}"])
    tr = algo.trainer
    state = randomize(algo.personal_state(0), 0)
    model = tr.to_module(state, CPModel(algo.model_fn(), tau).to(algo.device)).eval()
    p = views(tr.spec, state)
    Wp = p["phead.weight"].detach()
    ctx = Wp.sum(0) / Wp.sum(0).norm()
    torch.testing.assert_close(model.context(), ctx)
    torch.testing.assert_close(algo.contexts(state[algo.phead_cols][None])[0], ctx)
    x = fed.x[:9]
    want, h, s = hand_logits(p, model, x, ctx, tau)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want)
        got_s = model.policy(model.body(x), ctx)
    torch.testing.assert_close(got_s, s.detach())
    assert ((got_s > 0) & (got_s < 1)).all()
    # training: Gumbel noise from the generator, -log of Exp(1) draws; the module draws on
    # the data's device with a generator of that device (as the algorithm's), so the hand
    # draw uses the same seeded stream there
    dev = x.device
    noise = torch.empty(9, 2, 8, device=dev).exponential_(
        generator=torch.Generator(device=dev).manual_seed(5)
    )
    want, _, _ = hand_logits(p, model, x, ctx, tau, noise)
    with torch.no_grad():
        got = model.mix(model.body(x), ctx, torch.Generator(device=dev).manual_seed(5))
    torch.testing.assert_close(got, want)


@pytest.mark.quick
def test_mmd_by_hand_and_its_gradient():
    """mmd2 = (1/B^2) sum_jk k(a_j,a_k) + k(b_j,b_k) - 2 k(a_j,b_k), k = sum_s exp(-d^2/(2s)),
    against a double loop; its gradient against autograd of the loop; 0 for equal sets."""
    g = torch.Generator().manual_seed(2)
    a = (3 * torch.randn(5, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    b = (3 * torch.randn(5, 4, generator=g, dtype=torch.float64) + 1).requires_grad_(True)

    def k(u, v):
        return sum(torch.exp(-((u - v) ** 2).sum() / (2 * s)) for s in RBF_BANDWIDTHS)

    loop = (
        sum(k(a[j], a[m]) + k(b[j], b[m]) - 2 * k(a[j], b[m]) for j in range(5) for m in range(5))
        / 25
    )
    ours = mmd2(a, b)
    torch.testing.assert_close(ours, loop)
    ga, gb = torch.autograd.grad(ours, (a, b))
    wa, wb = torch.autograd.grad(loop, (a, b))
    torch.testing.assert_close(ga, wa)
    torch.testing.assert_close(gb, wb)
    assert float(ours.detach()) > 0
    assert abs(float(mmd2(a, a).detach())) < 1e-12
    # the kernel is the authors' mixture: one pair at squared distance 8
    x, y = torch.zeros(1, 2, dtype=torch.float64), torch.full((1, 2), 2.0, dtype=torch.float64)
    want = 2 * 4 - 2 * sum(math.exp(-8 / (2 * s)) for s in (10, 15, 20, 50))
    assert float(mmd2(x, y)) == pytest.approx(want)


@pytest.mark.quick
@pytest.mark.parametrize("head_upload", ["mean", "personal"])
def test_round_by_hand(head_upload):
    """Clients 0 and 2, E = 1 epoch of SGD (lr 0.1, batch 8) on CE + lambda MMD^2 (no noise),
    by hand with autograd: W_i^fe, Theta_i, W_i^hd step; W^hd and W^fe stay frozen. Server:
    sample-weighted means of the extractors (and their copy W^fe), the CPNs and the uploaded
    heads (W_i^hd + W^hd) / 2 or W_i^hd; each client keeps its W_i^hd, client 1 its own."""
    lam = 2.0
    algo, eng, fed = make_algo(
        "fedcp", ["algo.gumbel=false", f"algo.lam={lam}", f"algo.head_upload={head_upload}"]
    )
    tr = algo.trainer
    algo.w = randomize(algo.w, 1)
    algo.w[algo.gbody_cols] = algo.w[algo.base_cols][algo.body_in_base]  # W^fe = the extractor
    algo.phead = randomize(algo.phead, 2)
    w0, heads0 = algo.w.clone(), algo.phead.clone()
    clients = np.array([0, 2])
    model = CPModel(algo.model_fn(), 1.0).to(algo.device)
    trained = {}
    for i in clients:
        start = w0.clone()
        start[algo.phead_cols] = heads0[i]
        p = views(tr.spec, start)
        Wp = p["phead.weight"].detach()
        ctx = Wp.sum(0) / Wp.sum(0).norm()  # fixed for the round
        for x, y in tr.batches(int(i), 8, epochs=1, round=0):
            out, h, _ = hand_logits(p, model, x, ctx, 1.0)
            gbody = {n[len("gbody.") :]: v for n, v in p.items() if n.startswith("gbody.")}
            hg = functional_call(model.gbody, gbody, (x,)).detach()
            loss = F.cross_entropy(out, y) + lam * hand_mmd(h, hg)
            names = [n for n in p if n.split(".")[0] in ("body", "cpn", "phead")]
            grads = torch.autograd.grad(loss, [p[n] for n in names])
            with torch.no_grad():
                for n, gr in zip(names, grads):
                    p[n] -= 0.1 * gr
        trained[int(i)] = p
    info = algo.round(0, clients)

    n = fed.train_sizes[clients].to(algo.device)  # the federation keeps the sizes on the CPU
    wts = n / n.sum()

    def mean(name):
        return sum(w * trained[int(i)][name].detach() for w, i in zip(wts, clients))

    got = {e.name: algo.w[e.start : e.stop].view(e.shape) for e in tr.spec.params}
    tol = dict(rtol=1e-4, atol=1e-5)
    for name in got:
        if name.startswith(("body.", "cpn.")):
            torch.testing.assert_close(got[name], mean(name), **tol)
        if name.startswith("gbody."):  # the next round's frozen copy: the new extractor
            torch.testing.assert_close(got[name], got[name[1:]])
        if name.startswith("head."):  # W^hd <- mean of U_i, (W_i^hd + W^hd) / 2 or W_i^hd
            e = tr.spec.index[name]
            old = w0[e.start : e.stop].view(e.shape)
            want = mean("p" + name)
            want = 0.5 * (want + old) if head_upload == "mean" else want
            torch.testing.assert_close(got[name], want, **tol)
    for i in clients:
        mine = torch.cat([trained[int(i)][f"phead.{leaf}"].detach().reshape(-1)
                          for leaf in ("weight", "bias")])  # fmt: skip
        torch.testing.assert_close(algo.phead[i], mine, **tol)
    assert torch.equal(algo.phead[1], heads0[1])
    deployed = algo.personal_state(1)  # the new global parts with client 1's own head
    assert torch.equal(deployed[algo.phead_cols], heads0[1])
    own = torch.zeros_like(deployed, dtype=torch.bool)
    own[algo.phead_cols] = True
    assert torch.equal(deployed[~own], algo.w[~own])
    moved = 2 * (eng.n_state + algo.cpn_cols.numel())  # W^fe + U_i (+ buffers) and Theta_i
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * moved
    assert algo.model_size()["params_personal"] == tr.n_params - algo.gbody_cols.numel()


@pytest.mark.quick
def test_gumbel_noise_is_per_client_and_changes_training():
    """A client's noise depends on (seed, round, client) only: client 2 trains to the same
    state alone or beside client 0; without noise it trains elsewhere."""
    a, _, _ = make_algo("fedcp")
    b, _, _ = make_algo("fedcp")
    c, _, _ = make_algo("fedcp", ["algo.gumbel=false"])
    a.round(0, np.array([0, 2]))
    b.round(0, np.array([2]))
    c.round(0, np.array([2]))
    torch.testing.assert_close(a.phead[2], b.phead[2])
    assert not torch.allclose(b.phead[2], c.phead[2])
    g1 = a.generators(3, [1, 2])
    g2 = a.generators(3, [2])
    dev = g1[1].device  # the algorithm's generators live on its device: draw there
    assert torch.equal(
        torch.rand(4, generator=g1[1], device=dev), torch.rand(4, generator=g2[0], device=dev)
    )


@pytest.mark.quick
def test_a2_scales_every_upload():
    """Attack A2 (malicious clients scale their update by 100): the averaged extractor, head
    and CPN are the means of the scaled uploads; the CPN (176 entries, more than the run
    model's 83 parameters) is scaled whole. The frozen W^hd and W^fe never step."""
    from fedbench.attack import Attack

    algo, eng, fed = make_algo("fedcp", ["algo.head_upload=personal"])
    clients = np.arange(3)
    start = algo.states_of(clients)
    loss = algo.objective(0, clients)  # with its Gumbel noise: client after client
    want = train_on(algo, algo.trainer, start, clients, 0, objective=loss, trainable=algo.trainable)
    frozen = torch.cat([algo.head_cols, algo.gbody_cols])  # W^hd and W^fe: no step in training
    assert torch.equal(want.states[:, frozen], start[:, frozen])
    algo.attack = Attack("a2", 0.5, 3, seed=0)
    bad = torch.as_tensor(algo.attack.malicious, device=algo.device)
    assert bad.any() and not bad.all()
    algo.round(0, clients)
    wts = (fed.train_sizes / fed.train_sizes.sum()).to(algo.device)
    P = eng.n_params
    sent = want.states.clone()
    sent[:, algo.head_cols] = want.states[:, algo.phead_cols]  # U_i = W_i^hd
    params = torch.cat([algo.base_cols[:P], algo.cpn_cols])
    assert algo.cpn_cols.numel() > P
    sent[:, params] = torch.where(
        bad[:, None], 100 * (sent[:, params] - start[:, params]) + start[:, params],
        sent[:, params],
    )  # fmt: skip
    torch.testing.assert_close(algo.w[params], (wts[:, None] * sent[:, params]).sum(0))


def bn_fedcp():
    """FedCP on TinyFed with bn_mlp, batch 8: (algorithm, federation)."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.engine import Engine

    fed = TinyFed()
    torch.manual_seed(0)
    eng = Engine(fed, bn_mlp(), device="cpu")
    cfg = compose(["algo=fedcp", "batch_size=8"])
    return ALGORITHMS.get("fedcp").from_config(load_config(cfg), fed, eng, bn_mlp), fed


@pytest.mark.quick
def test_batchnorm_statistics_are_averaged_and_copied_to_the_frozen_extractor():
    algo, fed = bn_fedcp()
    spec = algo.trainer.spec
    clients = np.array([0, 1])
    start = algo.states_of(clients)
    loss = algo.objective(0, clients)
    want = train_on(algo, algo.trainer, start, clients, 0, objective=loss, trainable=algo.trainable)
    algo.round(0, clients)
    wts = fed.train_sizes[:2] / fed.train_sizes[:2].sum()
    for e in spec.buffers:
        got = algo.w[e.start : e.stop]
        if e.name.startswith("body."):
            avg = (wts[:, None] * want.states[:, e.start : e.stop]).sum(0)
            torch.testing.assert_close(got, avg)
            assert not torch.equal(got, start[0, e.start : e.stop])  # statistics updated
            twin = spec.index["g" + e.name]
            torch.testing.assert_close(algo.w[twin.start : twin.stop], got)


@pytest.mark.quick
def test_frozen_extractor_uses_batch_statistics_in_the_mmd_term():
    """The frozen W^fe runs in training mode (batch statistics), as the authors' Ensemble
    under model.train(): at a round's start (W^fe = W_i^fe) on a BatchNorm model both
    extractors give the same features, so the MMD term is 0 and the objective is the CE
    alone (with W^fe in eval mode its running statistics would make it differ)."""
    algo, fed = bn_fedcp()
    algo.round(0, np.array([0, 1]))  # running statistics away from their (0, 1) start
    start = algo.states_of([2])[0]
    model = algo.trainer.to_module(start, CPModel(bn_mlp(), 1.0)).train()
    ctx = algo.contexts(algo.phead[2:3])
    x, y = fed.x[:16], fed.y[:16]
    with torch.no_grad():
        got = fedcp_loss(model, x, y, 0, ctx, lam=5.0, gens=None)
        ce = F.cross_entropy(model.mix(model.body(x), ctx[0]), y)
    torch.testing.assert_close(got, ce)


@pytest.mark.quick
def test_cpn_initialization_is_not_the_models_random_stream():
    """The run's model is drawn right after torch.manual_seed(seed); the CPN is drawn from a
    stream of its own, so its weight is not a rescaled copy of the body's first layer."""
    algo, _, _ = make_algo("fedcp")
    spec = algo.trainer.spec
    e, b = spec.index["cpn.0.weight"], spec.params[0]
    assert b.name.startswith("body.")
    n = min(e.stop - e.start, b.stop - b.start)
    pair = torch.stack([algo.w[e.start : e.start + n], algo.w[b.start : b.start + n]])
    assert abs(float(torch.corrcoef(pair)[0, 1])) < 0.3
    again, _, _ = make_algo("fedcp")  # seeded: the same CPN in every build
    assert torch.equal(again.w[e.start : e.stop], algo.w[e.start : e.stop])


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured 0.918 in 3 rounds (seed 0, lr 0.1, lambda 0.5). The YAML's lambda = 5 (the
    authors' MNIST script, with lr 0.005) at lr 0.1 makes local training oscillate and the
    features collapse (mean norm 0.08 after 3 rounds): 0.49; lambda = 0, 0.92."""
    summary, _ = run_small(tmp_path, ["algo=fedcp", "optim.lr=0.1", "algo.lam=0.5"], rounds=3)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert acc > 0.85, acc


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    over = ["algo=fedcp", "eval.every=2", "checkpoint.every=1", "participation=0.5"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 3, die_at=2)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
