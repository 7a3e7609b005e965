"""The PLGU family and its baselines (docs/papers/plgu.md): FedSAM, PLGU-LF, FedRep, PLGU-GRep,
Ditto, pFedMe (pFedHN / PLGU-GHN: test_pfedhn.py). Hand-computed steps on a tiny
federation, the FedSAM limit of PLGU-LF, learning on real FMNIST, the paper presets and the
headline command on a fake CIFAR-10."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from conftest import TinyFed, compose, make_algo, run_small
from fedbench.cli import CONF_DIR
from fedbench.config import load_config
from fedbench.errors import ConfigError
from fedbench.models import build_model
from fedbench.models.hypernet import hypernet_size, select_targets


def make(algo: str, extra=(), fed=None):
    return make_algo(algo, extra, fed)[0]


def loss_fn(algo, x, y):
    """Cross-entropy of a flat parameter vector on (x, y), differentiable (for references)."""
    return lambda w: torch.nn.functional.cross_entropy(algo.engine.functional_logits(w, x), y)


def grad(f, w):
    w = w.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(w), w)
    return g


# ---------------------------------------------------------------------------- PLGU-LF
@pytest.mark.quick
def test_plgu_lf_with_no_personal_layers_follows_fedsam():
    """D = 0, uniform scores, ascent gradient at w_i: PLGU-LF's global model is FedSAM's,
    round after round (same seed, same batches), with momentum and partial participation."""
    common = ["optim.momentum=0.9", "optim.weight_decay=1e-3"]
    sam = make("fedsam", [*common, "algo.weighting=uniform"])
    lf = make(
        "plgu_lf",
        [*common, "algo.personal_layers=0", "algo.scores=uniform", "algo.ascent_grad=universal"],
    )
    default = make("plgu_lf", common)
    for t, clients in enumerate([[0, 1, 2], [0, 2], [1, 2]]):
        for a in (sam, lf, default):
            a.round(t, np.array(clients))
        torch.testing.assert_close(lf.global_state(), sam.global_state())
    assert not torch.allclose(default.global_state(), sam.global_state())


@pytest.mark.quick
def test_plgu_lf_step_hand_computed():
    """One local step (one batch, plain SGD) of Algorithm 1 with a personalized theta_i."""
    fed = TinyFed()
    algo = make("plgu_lf", ["batch_size=64", "algo.personal_layers=1", "algo.rho=0.5"], fed)
    P, i, lr, rho = algo.engine.n_params, 1, 0.1, 0.5
    w0 = algo.w.clone()
    theta = w0.clone()
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the same values on any device
    theta[:P] += 0.3 * torch.randn(P, generator=gen).to(algo.device)
    theta[:32] += 1.0  # body.fc1's weight (6 x 8 = 48 entries): the most personalized layer
    algo.theta[i], algo.seen[i] = theta, True
    x, y = fed.batch(fed.train_idx[i])
    f = loss_fn(algo, x, y)

    lm = algo.layers  # layers body.fc1 (56 entries), head (27)
    diff = [(theta[:P] - w0[:P])[lm.seg == j] for j in range(2)]
    xi = torch.stack([d.norm() / d.numel() for d in diff])
    assert xi[0] > xi[1]  # body.fc1 is L_Per (D = 1), the head L_Uni
    per = lm.seg == 0
    theta0 = torch.where(per, theta[:P], w0[:P])  # Alg. 2 line 8
    g = grad(f, theta0)
    mean1 = xi * 2 / xi.sum()
    eps = rho * mean1[lm.seg] * g / g.norm() * ~per  # eq. 5, universal layers only
    expect_w = w0[:P] - lr * grad(f, w0[:P] + eps)
    expect_theta = theta0 - lr * g

    algo.round(0, np.array([i]))
    torch.testing.assert_close(algo.global_state(), expect_w)  # C = 1: w = w_i
    torch.testing.assert_close(algo.personal_states()[i], expect_theta)


@pytest.mark.quick
def test_personal_layer_selection():
    algo = make("plgu_lf", ["algo.personal_layers=1"])
    assert algo.personal_layers(torch.tensor([0.1, 0.3])).tolist() == [False, True]
    # ties (a client's first visit, all scores 0): the shallower layers
    assert algo.personal_layers(torch.zeros(2)).tolist() == [True, False]
    uni = make("plgu_lf", ["algo.personal_layers=1", "algo.d_counts=universal"])
    assert uni.personal_layers(torch.tensor([0.1, 0.3])).tolist() == [False, True]  # L - D = 1
    none = make("plgu_lf", ["algo.personal_layers=0"])
    assert not none.personal_layers(torch.tensor([0.1, 0.3])).any()
    with pytest.raises(ConfigError, match="d_counts"):
        make("plgu_lf", ["algo.d_counts=both"])


# ---------------------------------------------------------------------------- FedRep / GRep
@pytest.mark.quick
@pytest.mark.parametrize("name", ["fedrep", "plgu_grep"])
def test_head_phase_leaves_the_body_untouched(name):
    algo = make(name, ["algo.head_epochs=2"])
    clients = [0, 2]
    before = algo.states_of(clients)
    after = algo.head_phase(before, clients, 0).states
    head = algo.head_entries
    torch.testing.assert_close(after[:, ~head], before[:, ~head], rtol=0, atol=0)
    assert (after[:, head] != before[:, head]).any(dim=1).all()


@pytest.mark.quick
def test_plgu_grep_body_step_hand_computed():
    """Eqs. 10-13 on one mini-batch (body_steps = 1, plain SGD), head fixed."""
    fed = TinyFed()
    algo = make("plgu_grep", ["batch_size=64", "algo.rho=0.5"], fed)
    i, lr, rho = 0, 0.1, 0.5
    s = algo.states_of([i])[0]
    P = algo.engine.n_params
    body = algo.body_mask
    x, y = fed.batch(fed.train_idx[i])
    f = loss_fn(algo, x, y)
    phi_i = s[:P] - lr * grad(f, s[:P]) * body  # eq. 11
    d = phi_i - s[:P]  # eq. 10 over the body's single layer (body.fc1): mean1 -> 1
    assert d[~body].abs().max() == 0
    g1 = grad(f, phi_i) * body
    eps = rho * g1 / g1.norm()  # eq. 12
    expect = phi_i - lr * grad(f, phi_i + eps) * body  # eq. 13
    out = algo.body_phase(s[None], [i], 0).states[0]
    torch.testing.assert_close(out[:P], expect)


@pytest.mark.quick
def test_plgu_grep_last_upload_reference():
    algo = make("plgu_grep", ["algo.score_ref=last_upload", "algo.head_epochs=1"])
    assert algo.uploaded[0].isnan().all()
    algo.round(0, np.array([0, 1]))
    body = ~algo.head_entries
    torch.testing.assert_close(algo.uploaded[:2, body].mean(0), algo.phi[body])  # 1/C average
    assert algo.uploaded[2].isnan().all()


# ---------------------------------------------------------------------------- Ditto / pFedMe
@pytest.mark.quick
@pytest.mark.parametrize("interleave", [False, True])
def test_ditto_global_model_is_fedavg(interleave):
    """Ditto's w is FedAvg's (the personal steps never touch it), in both loop orders;
    theta stays closer to w^t as lambda grows."""
    avg = make("fedavg")
    ditto = make("ditto", [f"algo.interleave={interleave}"])
    stiff = make("ditto", [f"algo.interleave={interleave}", "algo.lam=5.0"])
    w0 = ditto.global_state().clone()
    for a in (avg, ditto, stiff):
        a.round(0, np.array([0, 1, 2]))
    torch.testing.assert_close(ditto.global_state(), avg.global_state())
    assert (stiff.personal_states() - w0).norm() < (ditto.personal_states() - w0).norm()


@pytest.mark.quick
def test_ditto_interleave_needs_equal_epochs():
    with pytest.raises(ConfigError, match="personal_epochs"):
        make("ditto", ["algo.interleave=true", "algo.personal_epochs=3"])


@pytest.mark.quick
def test_pfedme_one_batch_hand_computed():
    fed = TinyFed()
    extra = ["batch_size=64", "algo.local_rounds=1", "algo.inner_steps=2", "algo.beta=0.5"]
    algo = make("pfedme", extra, fed)
    P, i, lam, lr_p, eta = algo.engine.n_params, 2, 15.0, 0.01, 0.1
    w0 = algo.w.clone()
    x, y = fed.batch(fed.train_idx[i])
    f = loss_fn(algo, x, y)
    theta = w0[:P].clone()
    for _ in range(2):
        theta = theta - lr_p * (grad(f, theta) + lam * (theta - w0[:P]))
    local = w0[:P] - eta * lam * (w0[:P] - theta)
    algo.round(0, np.array([i]))
    torch.testing.assert_close(algo.personal_states()[i], theta)
    torch.testing.assert_close(algo.global_state(), 0.5 * w0 + 0.5 * local)
    local_eval = make("pfedme", [*extra, "algo.eval_model=local"], fed)
    local_eval.round(0, np.array([i]))
    torch.testing.assert_close(local_eval.personal_states()[i], local)


@pytest.mark.quick
def test_pfedme_local_rounds_null_is_local_epochs_passes():
    """R = null: every mini-batch of `local_epochs` passes, K inner steps on each (PFLlib)."""
    fed = TinyFed()
    algo = make("pfedme", ["batch_size=8", "local_epochs=2", "algo.local_rounds=null"], fed)
    calls = []
    real = algo.step

    def counted(t):
        inner = real(t)

        def step(state, batch):  # one client: the sequential backend's batch (x, y)
            calls.append(len(batch.y))
            return inner(state, batch)

        return step

    algo.step = counted
    i = 1
    algo.round(0, np.array([i]))
    n = len(fed.train_idx[i])
    assert sum(calls) == 2 * n and len(calls) == 2 * math.ceil(n / 8)


# ---------------------------------------------------------------------------- real FMNIST
# SMALL_FMNIST: 20 clients, pat-2, 150 train / 100 test samples each, MLP 784-64-10, all
# clients every round, E = 1; 3 rounds. Chance is 0.10. On pat-2 a personalized model (two
# classes) passes 0.6 within a few rounds, and every algorithm here must (they reach
# 0.76-0.97); global models, where the algorithm has one, must pass 0.35 (they reach
# 0.48-0.58). Budgets that make a round cheap are stated per case.
LEARN = {
    "fedsam": [],
    "plgu_lf": ["algo.personal_layers=1"],  # the MLP has 2 layers: keep one universal
    "ditto": [],
    "pfedme": ["algo.local_rounds=3"],
    "fedrep": ["algo.head_epochs=2"],
    "plgu_grep": [],
    "pfedhn": ["algo.inner_steps=10", "algo.hypernet.generate=last_k"],  # presets' choice
    "plgu_ghn": ["algo.inner_steps=10", "model.hidden=[16]"],  # generates all of a smaller MLP
}


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(LEARN))
def test_learns_fmnist(tmp_path, algo):
    s, run = run_small(tmp_path, [f"algo={algo}", *LEARN[algo]], rounds=3)
    assert s["final"]["personal"]["L"]["avg"] >= 0.60
    if run.algo.has_global:
        assert s["final"]["global"]["L"]["avg"] >= 0.35
    else:
        assert s["final"]["global"] is None


# ---------------------------------------------------------------------------- presets
PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("plgu_*.yaml"))
SHAPES = {"cifar10": ((3, 32, 32), 10), "cifar100": ((3, 32, 32), 100)}
SHAPES["tinyimagenet"] = ((3, 64, 64), 200)


@pytest.mark.quick
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "plgu_common"])
def test_presets_compose_with_the_paper_settings(preset):
    """Every preset: the paper's data, split, clients, C, E, B, optimizer and a pFedHN
    hypernetwork within `max_params` for the preset's model (built on the meta device)."""
    cfg = compose([f"+experiment={preset}", "algo=pfedhn"])
    data = str(cfg.data.name)
    k, n, c = {"cifar10": (3, 100, 10), "cifar100": (10, 100, 10), "tinyimagenet": (30, 20, 20)}[
        data
    ]
    assert (cfg.split.name, cfg.split.classes_per_client, cfg.clients) == ("pat", k, n)
    assert int(cfg.participation) == (100 if preset.endswith("_c100") else c)
    run = (cfg.local_epochs, cfg.batch_size, cfg.optim.lr, cfg.optim.momentum)
    assert run == (5, 50, 0.01, 0.9)
    assert cfg.model.norm == "group"
    shape, classes = SHAPES[data]
    with torch.device("meta"):
        unit = str(cfg.model.get("layer_unit") or "op_norm")  # what `last_k` counts
        model = build_model(str(cfg.model.name), shape, classes, layer_unit=unit)
    hn = cfg.algo.hypernet
    names = select_targets(model, hn.generate, hn.k).generated
    numels = [model.get_parameter(p).numel() for p in names]
    assert hypernet_size(n, 1 + n // 4, hn.hidden, hn.n_hidden, numels) <= hn.max_params


@pytest.mark.quick
@pytest.mark.parametrize("algo", ["fedavg", "fedsam", "ditto", "pfedme", "fedrep", "plgu_grep"])
def test_preset_cell_composes_for_every_method(algo):
    cfg = compose(["+experiment=plgu_t1_cifar10", f"algo={algo}"])
    assert cfg.algo.name == algo
    if algo in ("fedrep", "plgu_grep"):
        assert cfg.algo.head_epochs == 5  # PLGU: K = E = 5 head epochs


# ---------------------------------------------------------------------------- the headline
def fake_cifar10(root, n_train=60, n_test=40):
    """A few random images in CIFAR-10's pickle format (cifar-10-batches-py/)."""
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [
        *((f"data_batch_{b}", n_train // 5) for b in range(1, 6)),
        ("test_batch", n_test),
    ]:
        batch = {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "labels": [int(v) for v in np.arange(n) % 10],
        }
        with open(d / name, "wb") as f:
            pickle.dump(batch, f)


@pytest.mark.slow
def test_headline_plgu_lf_on_cifar10(tmp_path):
    """`fedbench algo=plgu_lf data=cifar10 data.root=DIR` composes and runs (ResNet-8, one
    round, four clients) on CIFAR-10 files in their own format."""
    from fedbench.runner import Run

    fake_cifar10(tmp_path / "data")
    cfg = compose(
        ["algo=plgu_lf", "data=cifar10", f"data.root={tmp_path / 'data'}", "data.download=false"]
        + ["model=resnet8", "rounds=1", "clients=4", "device=cpu", "batch_size=8"]
    )
    s = Run(cfg, tmp_path / "run", progress=False).run()
    assert s["data"] == "cifar10" and s["final"]["round"] == 1
    assert s["final"]["global"] is not None and s["final"]["personal"] is not None


# ---------------------------------------------------------------------------- issue 14
def make_bn(algo: str, extra=(), backend="auto"):
    """`algo` on TinyFed with a BatchNorm model: body Linear(6, 8) -> BatchNorm1d -> ReLU,
    head Linear(8, 3)."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.engine import Engine
    from fedbench.models.base import FedModel

    fed = TinyFed()
    cfg = compose([f"algo={algo}", "batch_size=8", "optim.lr=0.1", *extra])

    def model_fn():
        body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
        return FedModel(body, 8, 3)

    torch.manual_seed(0)
    eng = Engine(fed, model_fn(), device="cpu", backend=backend)
    return ALGORITHMS.get(algo).from_config(load_config(cfg), fed, eng, model_fn), fed


BN_CASES = [
    ("fedavg", []),
    ("fedsam", []),
    ("local", []),
    ("fedrep", ["algo.head_epochs=1"]),
    ("plgu_lf", []),
    ("plgu_grep", ["algo.head_epochs=1"]),
    ("ditto", []),
    ("ditto", ["algo.interleave=true"]),
    ("pfedme", ["algo.local_rounds=3", "algo.inner_steps=2"]),
    ("pfedhn", ["algo.inner_steps=4"]),
    ("plgu_ghn", ["algo.inner_steps=4"]),
]


@pytest.mark.quick
@pytest.mark.parametrize("name,extra", BN_CASES)
def test_an_evaluation_never_changes_training_with_batchnorm(name, extra):
    """Issue 14.1: an evaluation puts the module in eval mode; every training step after it
    still runs in training mode (batch statistics, running statistics updated). Two runs,
    one evaluated between rounds, end in exactly the same states, whose running statistics
    moved from their initial (0, 1)."""
    from fedbench.evaluation import evaluate

    a, fed = make_bn(name, extra)
    b, _ = make_bn(name, extra)
    clients = np.arange(fed.num_clients)
    for t in range(2):
        a.round(t, clients)
        b.round(t, clients)
        evaluate(b, fed)
    P = a.engine.n_params
    for i in clients:
        sa, sb = a.personal_state(int(i)), b.personal_state(int(i))
        assert torch.equal(sa, sb), f"{name}: client {i} trained differently after evaluating"
        mean, var = sa[P : P + 8], sa[P + 8 : P + 16]
        assert mean.abs().sum() > 0 and (var != 1).any() and (var > 0).all()


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["sequential", "vmap"])
@pytest.mark.parametrize("opt", ["optim.momentum=0.9", "optim.name=adam"])
def test_fedrep_kept_momentum_never_moves_the_frozen_part(backend, opt):
    """Issue 14.4: with optim.persist_state=true (momentum 0.9 or Adam), the state a phase
    leaves does not move the part the next phase freezes: exact equality, both backends."""
    algo, engine, fed = make_algo(
        "fedrep", ["optim.persist_state=true", opt, "algo.head_epochs=2", "algo.body_epochs=2"]
    )
    engine.backend = backend
    clients = [0, 1, 2]
    head = algo.head_entries
    for t in range(3):  # kept state on both parts from earlier rounds
        s0 = algo.states_of(clients)
        h = algo.head_phase(s0, clients, t).states
        b = algo.body_phase(h, clients, t).states
        assert torch.equal(h[:, ~head], s0[:, ~head])  # head phase: body frozen
        assert torch.equal(b[:, head], h[:, head])  # body phase: head frozen
        assert (b[:, ~head] != h[:, ~head]).any() and (h[:, head] != s0[:, head]).any()
        algo.round(t, np.array(clients))
    kept = engine._persist["main"]
    assert all(v.abs().sum() > 0 for k, v in kept.items() if k != "step")
