"""CFL: the optimal bipartition against every bipartition, the split criteria and the
bipartition on constructed updates (two opposite groups split exactly into those groups; a
cluster that misses a criterion does not split), one round by hand, the partial-participation
rule, that it learns on real FMNIST, and that a killed run resumes exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from conftest import TinyFed, crash_and_resume, make_algo, run_small
from fedbench.algorithms.cfl import bipartition, cosine_similarities
from fedbench.engine import TrainResult


def max_cross(sim: torch.Tensor, g1, g2) -> float:
    return float(sim[list(g1)][:, list(g2)].max())


@pytest.mark.quick
@pytest.mark.parametrize("M", [2, 3, 5, 7])
def test_single_linkage_is_the_optimal_bipartition(M):
    """argmin over all 2^(M-1) - 1 bipartitions of the largest cross similarity (the paper's
    optimal bipartition) equals the value single linkage attains; both are entries of sim."""
    g = torch.Generator().manual_seed(M)
    for _ in range(20):
        a = torch.randn(M, 8, generator=g, dtype=torch.float64)
        sim = cosine_similarities(a)
        g1, g2 = bipartition(sim, "single")
        assert sorted(g1 + g2) == list(range(M)) and g1 and g2 and 0 in g1
        best = min(
            max_cross(sim, c1, [i for i in range(M) if i not in c1])
            for r in range(1, M)
            for c1 in itertools.combinations(range(M), r)
            if 0 in c1
        )
        assert max_cross(sim, g1, g2) == best


@pytest.mark.quick
def test_complete_linkage_matches_scipy():
    """`linkage=complete` (the authors' notebook: agglomerative, complete linkage on -alpha,
    two clusters) gives scipy's complete-linkage cut."""
    from scipy.cluster import hierarchy
    from scipy.spatial.distance import squareform

    g = torch.Generator().manual_seed(0)
    for M in (3, 6, 9):
        sim = cosine_similarities(torch.randn(M, 5, generator=g, dtype=torch.float64))
        dist = (1 - sim).clamp_min(0).numpy()
        np.fill_diagonal(dist, 0)
        labels = hierarchy.fcluster(
            hierarchy.linkage(squareform(dist, checks=False), "complete"), 2, "maxclust"
        )
        g1, g2 = bipartition(sim, "complete")
        want = sorted([sorted(np.flatnonzero(labels == v).tolist()) for v in (1, 2)])
        assert sorted([g1, g2]) == want


SIX = TinyFed(n_clients=6, sizes=(20, 20, 20, 20, 20, 20))
A, B = [0, 2, 3], [1, 4, 5]


def directions(P: int, angle_cos: float, noise: float = 0.05, norm: float = 2.0, seed: int = 0):
    """Updates [6, P]: group A along u, group B along v with <u, v> = angle_cos, each plus a
    little noise and scaled to `norm`."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(P, generator=g)
    u /= u.norm()
    w = torch.randn(P, generator=g)
    w -= (w @ u) * u
    w /= w.norm()
    v = angle_cos * u + (1 - angle_cos**2) ** 0.5 * w
    d = torch.zeros(6, P)
    for rows, dirn in ((A, u), (B, v)):
        for r in rows:
            x = dirn + noise * torch.randn(P, generator=g) / P**0.5
            d[r] = norm * x / x.norm()
    return d


def with_updates(algo, monkeypatch, delta: torch.Tensor):
    """Clients' training replaced by ref + the constructed update (parameters only)."""
    P = algo.engine.n_params
    delta = delta.to(algo.device)

    def fake(states, clients, t, **kw):
        out = states.clone()
        out[:, :P] += delta[torch.as_tensor(np.asarray(clients))]
        return TrainResult(out, torch.zeros(len(clients)), [1] * len(clients))

    monkeypatch.setattr(algo, "local_train", fake)


def cfl6(extra=()):
    over = ["algo.warmup_rounds=0", "algo.eps_1=0.5", "algo.eps_2=1.0", *extra]
    return make_algo("cfl", over, fed=SIX)


@pytest.mark.quick
@pytest.mark.parametrize("linkage", ["single", "complete"])
def test_opposite_groups_split_exactly_into_those_groups(linkage, monkeypatch):
    """Group A's updates along u, group B's along -u (norm 2 each): the mean update is ~0
    (< eps_1 = 0.5), the largest norm 2 > eps_2 = 1; the cluster splits into exactly A and
    B; each half then aggregates its own members' updates from the parent's model."""
    algo, eng, fed = cfl6([f"algo.linkage={linkage}"])
    P = eng.n_params
    delta = directions(P, -1.0).to(algo.device)
    with_updates(algo, monkeypatch, delta)
    theta = algo.models[0].clone()
    info = algo.round(0, np.arange(6))
    assert algo.models.shape[0] == 2 and info.diagnostics["clusters"] == 2
    assert algo.assign[A].tolist() == [0, 0, 0] and algo.assign[B].tolist() == [1, 1, 1]
    sizes = fed.train_sizes.to(algo.device)  # the federation keeps them on the CPU
    for c, rows in ((0, A), (1, B)):
        w = sizes[rows] / sizes[rows].sum()
        want = theta.clone()
        want[:P] += (w[:, None] * delta[rows]).sum(0)
        torch.testing.assert_close(algo.models[c], want)
        for i in rows:  # each client deploys its cluster's model
            assert torch.equal(algo.personal_state(i), algo.models[c])
    mean = (sizes / sizes.sum()) @ delta
    assert info.diagnostics["mean_update_norm"] == pytest.approx(float(mean.norm()), rel=1e-5)
    assert info.diagnostics["max_update_norm"] == pytest.approx(float(delta.norm(dim=1).max()))


@pytest.mark.quick
@pytest.mark.parametrize(
    "extra,angle,norm,t",
    [
        ([], 1.0, 2.0, 0),  # one direction: mean norm 2 >= eps_1 (not stationary)
        ([], -1.0, 0.8, 0),  # opposite but small: max norm 0.8 <= eps_2 (all congruent)
        (["algo.warmup_rounds=3"], -1.0, 2.0, 2),  # criteria hold, warm-up not over
        (["algo.min_split_size=7"], -1.0, 2.0, 0),  # criteria hold, cluster too small
        (["algo.eps_1=1.99", "algo.gamma_max=0.3"], 0.9, 2.0, 0),  # sqrt((1-.9)/2) < .3
    ],
)
def test_no_split_without_the_criteria(extra, angle, norm, t, monkeypatch):
    """A cluster that misses a split criterion (or the warm-up, the size, the gamma_max
    certificate) stays one cluster, its model the weighted mean of the updates."""
    algo, eng, fed = cfl6(extra)
    P = eng.n_params
    delta = directions(P, angle, norm=norm).to(algo.device)
    with_updates(algo, monkeypatch, delta)
    theta = algo.models[0].clone()
    algo.round(t, np.arange(6))
    assert algo.models.shape[0] == 1 and not algo.assign.any()
    want = theta.clone()
    sizes = fed.train_sizes.to(algo.device)  # the federation keeps them on the CPU
    want[:P] += (sizes / sizes.sum()) @ delta
    torch.testing.assert_close(algo.models[0], want)


@pytest.mark.quick
def test_gamma_max_below_the_certificate_accepts_the_split(monkeypatch):
    """The same groups at cosine 0.9 (alpha_cross ~0.9, sqrt((1 - 0.9) / 2) ~0.22): gamma_max
    0.1 accepts the bipartition (0.3 refuses it, above)."""
    algo, eng, _ = cfl6(["algo.eps_1=1.99", "algo.gamma_max=0.1"])
    with_updates(algo, monkeypatch, directions(eng.n_params, 0.9))
    algo.round(0, np.arange(6))
    assert algo.assign[A].tolist() == [0, 0, 0] and algo.assign[B].tolist() == [1, 1, 1]


@pytest.mark.quick
@pytest.mark.parametrize("weighting,splits", [("samples", False), ("uniform", True)])
def test_the_stationarity_criterion_uses_the_weighting(weighting, splits, monkeypatch):
    """Opposite groups of norm 2, group A with 60 samples a client and B with 20: the
    uniform mean update is ~0 (< eps_1 = 0.5, a split), the |D_i| / |D_c| mean is
    (180 - 60) / 240 * 2 = 1 >= eps_1 (no split)."""
    fed = TinyFed(n_clients=6, sizes=(60, 20, 60, 60, 20, 20))
    over = ["algo.warmup_rounds=0", "algo.eps_1=0.5", "algo.eps_2=1.0"]
    algo, eng, _ = make_algo("cfl", [*over, f"algo.weighting={weighting}"], fed=fed)
    with_updates(algo, monkeypatch, directions(eng.n_params, -1.0))
    algo.round(0, np.arange(6))
    assert (algo.models.shape[0] == 2) == splits


@pytest.mark.quick
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_round_by_hand(weighting):
    """No split (default eps and warm-up): the sampled clients train the cluster model E
    epochs; the cluster model moves by their weighted mean update; every client, sampled or
    not, deploys it; one model each way per sampled client."""
    algo, eng, fed = make_algo("cfl", [f"algo.weighting={weighting}"])
    clients = np.array([0, 2])
    theta = algo.models[0].clone()
    want = eng.train(theta.repeat(2, 1), clients, optim=algo.optim, round=0,
                     lr=algo.optim.lr_at(0), epochs=1, batch_size=8).states  # fmt: skip
    n = (fed.train_sizes[clients] if weighting == "samples" else torch.ones(2)).to(algo.device)
    info = algo.round(0, clients)
    torch.testing.assert_close(
        algo.models[0], theta + (n[:, None] / n.sum() * (want - theta)).sum(0)
    )
    assert algo.models.shape[0] == 1
    for i in range(3):
        assert torch.equal(algo.personal_state(i), algo.models[0])
    assert torch.equal(algo.delta[clients], (want - theta)[:, : eng.n_params])
    assert algo.fresh.tolist() == [True, False, True]
    assert info.comm.bytes_up == info.comm.bytes_down == 4 * 2 * eng.n_state


@pytest.mark.quick
def test_a_cluster_waits_for_every_member_to_report(monkeypatch):
    """Partial participation: the criteria hold on the sampled clients, but client 5 has
    not reported an update yet: no split; once it has (its latest update kept), the cluster
    splits on every member's latest update."""
    algo, eng, _ = cfl6()
    delta = directions(eng.n_params, -1.0)
    with_updates(algo, monkeypatch, delta)
    algo.round(0, np.arange(5))
    assert algo.models.shape[0] == 1 and algo.fresh.tolist() == [True] * 5 + [False]
    algo.round(1, np.array([5]))
    assert algo.assign[A].tolist() == [0, 0, 0] and algo.assign[B].tolist() == [1, 1, 1]
    assert not algo.fresh.any()  # both halves wait for new reports


@pytest.mark.slow
def test_learns_on_fmnist(tmp_path):
    """Measured 0.890 in 5 rounds (seed 0; 10 clusters of the 20 pathological clients); the
    same run without a split (default eps_2 and warm-up) 0.674: FedAvg's one model."""
    over = ["algo=cfl", "optim.lr=0.1", "participation=1.0", "algo.warmup_rounds=0",
            "algo.eps_2=0.5"]  # fmt: skip
    summary, run = run_small(tmp_path, over, rounds=5)
    acc = summary["final"]["personal"]["L"]["avg"]
    assert run.algo.models.shape[0] > 2
    assert acc > 0.8, acc


@pytest.mark.slow
@pytest.mark.long  # every algorithm's state round trip stays quick (test_checkpoint)
def test_resume_is_exact(tmp_path, monkeypatch):
    """Killed as round 3 starts, clusters already split (checkpoint at round 2), which go on
    splitting after the resume."""
    over = ["algo=cfl", "optim.lr=0.1", "algo.warmup_rounds=0", "algo.eps_2=0.5",
            "eval.every=2", "checkpoint.every=2", "participation=1.0"]  # fmt: skip
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 4, die_at=3)
    assert (full["final"], full["best"]) == (resumed["final"], resumed["best"])
