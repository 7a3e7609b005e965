"""DiversiFed: the closed-form server step against autograd of L_d, its coefficients and
their sign (Lemma 1, Remark 1), round 0 and the client's proximal problem under partial
participation, the Table III practical-split preset, and learning on real FMNIST."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TinyFed, compose, run_small
from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms._shared import pairwise_sq_dists
from fedbench.algorithms.diversifed import (
    distance_betas,
    distance_grad,
    mixing_matrix,
    model_distance_loss,
)
from fedbench.config import load_config
from fedbench.data.splits import SPLITS
from fedbench.engine import Engine, Proximal
from fedbench.models import build_model

CONF = Path(__file__).resolve().parent.parent / "conf"


def random_models(n: int = 7, p: int = 30, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, p, generator=g, dtype=torch.float64)


@pytest.mark.quick
@pytest.mark.parametrize("tau", [0.3, 1.0, 2.5])
def test_closed_form_gradient_equals_autograd(tau):
    w = random_models()
    wr = w.clone().requires_grad_(True)
    auto = torch.stack(
        [torch.autograd.grad(model_distance_loss(wr, i, tau), wr)[0][i] for i in range(len(w))]
    )
    torch.testing.assert_close(distance_grad(w, tau), auto)


@pytest.mark.quick
@pytest.mark.parametrize("alpha,tau", [(1.0, 1.0), (0.3, 0.7)])
def test_z_coefficients_sum_to_one_and_give_the_gradient_step(alpha, tau):
    w = torch.cat([random_models(), random_models(1, seed=2)])
    w = torch.cat([w, w[-1:]])  # two identical models: their pair contributes nothing
    a = mixing_matrix(w, alpha, tau)
    torch.testing.assert_close(a.sum(1), torch.ones(len(w), dtype=a.dtype))
    assert torch.isfinite(a).all() and a[-1, -2] == 0 and a[-2, -1] == 0
    torch.testing.assert_close(a @ w, w - alpha * distance_grad(w, tau))


@pytest.mark.quick
def test_near_model_attracts_and_far_model_repels():
    w = torch.zeros(3, 4, dtype=torch.float64)
    w[1, 0] = 0.5  # near w_0
    w[2, 1] = 3.0  # far from w_0
    beta = distance_betas(pairwise_sq_dists(w), tau=1.0)
    assert beta[0, 1] > 0 > beta[0, 2]
    z0 = mixing_matrix(w, 1.0, 1.0)[0] @ w
    assert (z0 - w[1]).norm() < (w[0] - w[1]).norm()  # towards the near one
    assert (z0 - w[2]).norm() > (w[0] - w[2]).norm()  # away from the far one


@pytest.mark.quick
def test_gram_distances_match_direct_ones():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 1000, generator=g) + 100.0  # a large common offset
    direct = (w.double()[:, None] - w.double()[None]).pow(2).sum(-1)
    torch.testing.assert_close(pairwise_sq_dists(w), direct, rtol=1e-4, atol=1e-3)


@pytest.mark.quick
def test_round0_is_cross_entropy_then_proximal_from_z_with_partial_participation():
    fed = TinyFed()
    cfg = compose(
        ["algo=diversifed", "algo.lam=2.0", "algo.alpha=0.5", "batch_size=8", "optim.lr=0.1"]
    )
    torch.manual_seed(0)
    model_fn = lambda: build_model("mlp", fed.input_shape, fed.num_classes, hidden=[8])  # noqa: E731
    eng = Engine(fed, model_fn(), device="cpu")
    algo = ALGORITHMS.get("diversifed").from_config(load_config(cfg), fed, eng, model_fn)
    kw = dict(optim=algo.optim, lr=0.1, batch_size=8, epochs=1)

    w0 = algo.w.clone()
    algo.round(0, [0, 1, 2])
    torch.testing.assert_close(algo.w, eng.train(w0, [0, 1, 2], round=0, **kw).states)

    w1 = algo.w.clone()
    z = mixing_matrix(w1[:, : eng.n_params], 0.5, 1.0)[[0, 2]].float() @ w1
    algo.round(1, [0, 2])
    ref = eng.train(z, [0, 2], terms=[Proximal(z, 2.0 / 0.5)], round=1, **kw)
    torch.testing.assert_close(algo.w[[0, 2]], ref.states)
    torch.testing.assert_close(algo.w[1], w1[1])  # not sampled: unchanged

    # start=own: the client trains its own w_i towards z_i (FedAMP's convention)
    algo.hp.start = "own"
    w2 = algo.w.clone()
    z = mixing_matrix(w2[:, : eng.n_params], 0.5, 1.0)[[1, 2]].float() @ w2
    algo.round(2, [1, 2])
    ref = eng.train(w2[[1, 2]], [1, 2], terms=[Proximal(z, 2.0 / 0.5)], round=2, **kw)
    torch.testing.assert_close(algo.w[[1, 2]], ref.states)


@pytest.mark.quick
def test_presets_compose_and_table3_is_the_6_6_8_practical_split():
    for path in sorted((CONF / "experiment").glob("diversifed_*.yaml")):
        cfg = compose([f"+experiment={path.stem}", "algo=fedavg"])
        assert cfg.algo.name == "fedavg" and cfg.rounds == 500 and cfg.local_epochs == 10
    cfg = compose(["+experiment=diversifed_table3_pathmnist"])
    assert (cfg.data.name, cfg.split.name, cfg.clients) == ("pathmnist", "practical", 20)
    labels = np.repeat(np.arange(9), 2000)
    params = {k: v for k, v in cfg.split.items() if k != "name"}
    parts = SPLITS.get("practical")(labels, cfg.clients, np.random.default_rng(0), **params)
    groups = [6, 6, 8]
    dominant = [labels[p][:, None] == np.arange(9) for p in parts]
    first = 0
    for g, size in enumerate(groups):
        for c in range(first, first + size):
            counts = dominant[c].sum(0)
            assert len(parts[c]) == 500
            assert counts[3 * g : 3 * g + 3].sum() == 400  # 80% from the group's classes
        first += size


@pytest.mark.slow
def test_diversifed_learns_fmnist(tmp_path):
    """pat-2, 20 clients, Adam 1e-3, 2 epochs x 3 rounds. Chance is 0.1 (0.5 for a model that
    only knows its client's two classes); pat-2 personalized models reach 0.9+ here."""
    s, _ = run_small(
        tmp_path,
        ["algo=diversifed", "optim.name=adam", "optim.lr=1e-3", "local_epochs=2"],
        rounds=3,
    )
    assert s["final"]["personal"]["L"]["avg"] >= 0.9
