"""FedPG / S-FedPG (fedbench/algorithms/fedpg.py, _qp.py, engine/grads.py): the QP, the
fairness gradient, the rescaling, r_i, the line search, the full-gradient engine piece, the
fallback, the communication count, and learning on real FMNIST."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_algo, run_small
from fedbench.algorithms import fedpg
from fedbench.algorithms._qp import gram, min_norm_weights
from fedbench.engine import Engine
from fedbench.models import build_model


def brute_force_min_norm(K: np.ndarray) -> np.ndarray:
    """Min of l^T K l over the simplex by enumerating supports (K positive definite)."""
    m = K.shape[0]
    best, arg = np.inf, None
    for k in range(1, m + 1):
        for S in itertools.combinations(range(m), k):
            S = list(S)
            A = np.zeros((k + 1, k + 1))
            A[:k, :k] = K[np.ix_(S, S)]
            A[:k, k] = -1
            A[k, :k] = 1
            rhs = np.zeros(k + 1)
            rhs[k] = 1
            sol = np.linalg.solve(A, rhs)[:k]
            if (sol >= -1e-12).all():
                lam = np.zeros(m)
                lam[S] = sol
                v = lam @ K @ lam
                if v < best:
                    best, arg = v, lam
    return arg


@pytest.mark.parametrize("case", range(12))
def test_qp_satisfies_kkt_and_equals_brute_force(case):
    rng = np.random.default_rng(case)
    m = 2 + case % 4
    Q = torch.tensor(rng.normal(size=(m, m + 4)) + (case % 3) * 0.5)
    K = gram(Q)
    lam = min_norm_weights(K)
    assert lam is not None
    # KKT: feasibility, and (K lam)_i >= lam^T K lam with equality on the support
    assert lam.min() >= 0 and abs(lam.sum() - 1) < 1e-9
    v = lam @ K @ lam
    Kl = K @ lam
    assert (Kl >= v - 1e-6 * max(1, v)).all()
    assert np.allclose(Kl[lam > 1e-6], v, rtol=1e-5, atol=1e-7)
    ref = brute_force_min_norm(K)
    assert np.allclose(lam, ref, atol=1e-5)


def test_qp_degenerate_returns_none():
    assert min_norm_weights(np.full((3, 3), np.nan)) is None
    assert min_norm_weights(np.zeros((3, 3))) is None
    assert np.allclose(min_norm_weights(np.ones((1, 1))), [1.0])


def test_fairness_gradient_equals_autograd_of_minus_cos():
    L = torch.tensor([0.3, 1.2, 0.7, 2.0], dtype=torch.float64, requires_grad=True)
    F_ = -F.cosine_similarity(L, torch.ones_like(L), dim=0)
    (g,) = torch.autograd.grad(F_, L)
    assert torch.allclose(fedpg.fairness_weights(L.detach()), g, atol=1e-12)
    assert fedpg.fairness_value(L.detach()) == pytest.approx(F_.detach().item(), abs=1e-12)


def test_fairness_row_dropped_when_losses_equal():
    gh = torch.randn(3, 5)
    assert fedpg.fairness_row(torch.full((3,), 0.7), gh, 1.0) is None
    assert fedpg.fairness_row(torch.tensor([0.7]), gh[:1], 1.0) is None
    row = fedpg.fairness_row(torch.tensor([0.2, 0.9, 0.5]), gh, 2.0)
    assert row.norm().item() == pytest.approx(2.0, rel=1e-5)


@pytest.mark.parametrize("case", range(10))
def test_rescaled_direction_is_a_common_descent_direction(case):
    g = torch.Generator().manual_seed(case)
    m, P = 3 + case % 4, 20
    raw = torch.randn(m, P, generator=g) + 0.3
    keep, mu, gh = fedpg.normalize(raw)
    L = torch.rand(m, generator=g) + 0.1
    gF = fedpg.fairness_row(L, gh, mu)
    Q = gh if gF is None else torch.cat([gh, gF[None]])
    d, _ = fedpg.min_norm_direction(Q)
    d, sigma = fedpg.rescale(d, Q, float(gh.mean(0).norm()))
    assert float((Q.double() @ d.double()).min()) >= -1e-6
    assert sigma > 0


def test_normalize_drops_tiny_gradients_and_uses_the_mean_norm():
    g = torch.tensor([[3.0, 4.0], [0.0, 1e-8], [0.0, 1.0]])
    keep, mu, gh = fedpg.normalize(g)
    assert keep.tolist() == [True, False, True]
    assert mu == pytest.approx(3.0)
    assert torch.allclose(gh.norm(dim=1), torch.tensor([3.0, 3.0]))


def test_median_mu_ignores_one_scaled_gradient():
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 3.0], [300.0, 0.0]])
    _, mu_mean, _ = fedpg.normalize(g)
    _, mu_med, gh = fedpg.normalize(g, rule="median")
    assert mu_mean == pytest.approx(76.5)
    assert mu_med == pytest.approx(2.0)  # torch's lower median of 1, 2, 3, 300
    assert torch.allclose(gh.norm(dim=1), torch.full((4,), 2.0))


def test_personal_coeffs_on_a_hand_made_case():
    # gh1 = (1, 0), gh2 = (-0.6, 0.8): the min-norm point is d = (0.2, 0.4), D = (0.2, 0.2),
    # K12 = -0.6; r_1 = D_2 / (D_2 - K_12) = 0.2 / 0.8 = 0.25 and likewise r_2.
    G = torch.tensor([[1.0, 0.0], [-0.6, 0.8]])
    d, lam = fedpg.min_norm_direction(G)
    assert torch.allclose(d, torch.tensor([0.2, 0.4]), atol=1e-6)
    r = fedpg.personal_coeffs(d, G, 2)
    assert torch.allclose(r, torch.tensor([0.25, 0.25], dtype=torch.float64), atol=1e-6)
    p = fedpg.personal_directions(d, G, r)
    assert (p @ G.T).min() >= -1e-6  # every p_i is still a descent direction for every row
    assert torch.allclose(p.norm(dim=1), d.norm().expand(2))
    # a row that does not conflict leaves r_i = 1
    r1 = fedpg.personal_coeffs(torch.tensor([0.5, 0.5]), torch.eye(2), 2)
    assert torch.allclose(r1, torch.ones(2, dtype=torch.float64))


def test_gamma_modes():
    r = torch.tensor([0.1, 0.5, 1.0], dtype=torch.float64)
    assert fedpg.apply_gamma(r, None, "floor").tolist() == [0.1, 0.5, 1.0]
    assert fedpg.apply_gamma(r, 0.3, "floor").tolist() == [0.3, 0.5, 1.0]
    assert torch.allclose(
        fedpg.apply_gamma(r, 0.6, "scale"), torch.tensor([0.06, 0.3, 0.6]).double()
    )
    assert fedpg.apply_gamma(r, 0.3, "cap").tolist() == [0.1, 0.3, 0.3]


def _quadratic_search(eta, s, sigma=1.0, beta=1e-4):
    # L_i(w) = 0.5 ||w - c_i||^2, c_1 = (1, 0), c_2 = (0, 1), w = (-1, -1): equal losses at
    # every w - e d along d = (-1.5, -1.5), so F is constant; g_i.d = 4.5 = ||d||^2, hence
    # Armijo holds iff e <= 2 (1 - beta).
    w = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    c = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    d = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    g = w - c
    tried = []

    def loss_at(e):
        tried.append(e)
        x = w - e * d
        v = 0.5 * ((x - c[0]) ** 2).sum()
        return torch.stack([v, v])

    L0 = 0.5 * ((w - c) ** 2).sum(1)
    gd = g @ d
    dF = float(fedpg.fairness_weights(L0) @ gd)
    e, n = fedpg.line_search(
        loss_at, eta, s=s, sigma=sigma, shrink_ub=False, L0=L0, gd=gd, dF=dF, beta=beta
    )
    return e, n, tried


def test_line_search_accepts_exactly_the_armijo_step_on_a_quadratic():
    e, n, tried = _quadratic_search(1.0, 1)  # ub 2 > 2(1 - 1e-4) fails, 1 passes
    assert (e, n, tried) == (1.0, 2, [2.0, 1.0])
    e, n, tried = _quadratic_search(0.75, 2)  # 3 fails, 1.5 passes
    assert (e, tried) == (1.5, [3.0, 1.5])
    e, n, tried = _quadratic_search(1.999, 0)  # ub = eta passes
    assert tried == [1.999]


def test_line_search_falls_back_to_mean_decrease_then_smallest_mean():
    L0 = torch.tensor([1.0, 1.0], dtype=torch.float64)
    gd = torch.tensor([1.0, 1.0], dtype=torch.float64)
    table = {4.0: [2.0, 2.0], 2.0: [0.9, 1.05], 1.0: [0.99, 0.999]}  # Armijo never holds
    e, n = fedpg.line_search(
        lambda e: torch.tensor(table[e]).double(),
        2.0,
        s=1,
        sigma=1.0,
        shrink_ub=False,
        L0=L0,
        gd=gd,
        dF=0.0,
        beta=0.5,
    )
    assert (e, n) == (2.0, 3)  # the largest eta whose mean loss decreased
    table = {4.0: [2.0, 2.0], 2.0: [1.5, 1.5], 1.0: [1.2, 1.2]}
    e, _ = fedpg.line_search(
        lambda e: torch.tensor(table[e]).double(),
        2.0,
        s=1,
        sigma=1.0,
        shrink_ub=False,
        L0=L0,
        gd=gd,
        dF=0.0,
        beta=0.5,
    )
    assert e == 1.0  # none decreased: the smallest mean loss


@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_full_grads_equal_autograd_client_by_client(tiny_fed, backend):
    torch.manual_seed(0)
    model = build_model("mlp", tiny_fed.input_shape, tiny_fed.num_classes, hidden=[8])
    eng = Engine(tiny_fed, model, device="cpu", backend=backend, eval_batch_size=16)
    states = eng.initial_state() + 0.1 * torch.randn(3, eng.n_state)
    res = eng.full_grads(states, [2, 0, 1])
    for c, client in enumerate([2, 0, 1]):
        ref = build_model("mlp", tiny_fed.input_shape, tiny_fed.num_classes, hidden=[8])
        eng.to_module(states[c], ref)
        x, y = tiny_fed.batch(tiny_fed.train_idx[client])
        loss = F.cross_entropy(ref(x), y)
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        flat = torch.cat([g.reshape(-1) for g in grads])
        assert res.loss[c].item() == pytest.approx(loss.item(), rel=1e-5)
        assert torch.allclose(res.grads[c], flat, atol=1e-6)
    only = eng.full_grads(states, [2, 0, 1], with_grad=False)
    assert only.grads is None and torch.allclose(only.loss, res.loss)


def test_qp_failure_falls_back_to_the_mean_with_one_warning(monkeypatch, caplog):
    algo, eng, fed = make_algo("fedpg")
    monkeypatch.setattr(fedpg, "min_norm_weights", lambda K, **kw: None)
    with caplog.at_level(logging.WARNING, logger="fedbench"):
        for t in range(3):
            info = algo.round(t, np.array([0, 1, 2]))
    assert info["qp_fallback_rounds"] == 3
    assert sum("min-norm QP" in r.message for r in caplog.records) == 1


def test_history_rounds_counted_and_comm_counts_line_search_queries():
    algo, eng, fed = make_algo("sfedpg")
    algo.round(0, np.array([0, 1, 2]))
    info = algo.round(1, np.array([0]))  # clients 1, 2 absent: tau = 3, both history rows
    assert info["history_rounds"] == 1
    q = info["line_search_queries"]
    info = algo.round(2, np.array([0, 1]))
    trials = info["line_search_queries"] - q
    P, D = eng.n_params, eng.n_state
    assert trials >= 1
    assert info["bytes_up"] == 2 * (P + 1 + trials) * 4
    assert info["bytes_down"] == 2 * (D + P + 1 + trials) * 4


def test_pseudo_gradient_mode_runs_and_personal_models_differ():
    algo, eng, fed = make_algo("fedpg", ["algo.client_grad=pseudo", "algo.gamma=0.6"])
    w0 = algo.w.clone()
    algo.round(0, np.array([0, 1, 2]))
    assert not torch.equal(algo.w, w0)
    assert not torch.equal(algo.personal_state(0), algo.personal_state(1))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["fedpg", "sfedpg"])
def test_fedpg_learns_fmnist(tmp_path, algo):
    # pat-2, 20 clients, half online, 15 rounds: chance is 0.1 on the G set (10 classes)
    summary, _ = run_small(tmp_path, [f"algo={algo}", "participation=0.5", "optim.lr=0.1"], 15)
    final = summary["final"]
    assert final["global"]["G"]["avg"] > 0.55
    assert final["personal"]["L"]["avg"] > 0.6
    assert final["personal"]["G"]["avg"] > 0.55


def test_reproduce_script_cells_are_one_cell_commands():
    """Every run scripts/reproduce_fedpg.sh starts for Tables 1 (FMNIST) and 3 (A2) composes
    exactly `fedbench +experiment=<preset> algo=<a> seed=0 optim.lr=<lr> [algo.gamma=<g>]`
    and passes the Params schema; the FedPG authors' FedAMP/APFL settings come with it."""
    import os
    import subprocess
    from pathlib import Path

    from conftest import compose
    from fedbench.algorithms import ALGORITHMS
    from fedbench.algorithms.params import check_params

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        ["bash", str(repo / "scripts" / "reproduce_fedpg.sh"), "table1_fmnist", "table3_fmnist_a2"],
        capture_output=True,
        text=True,
        env={**os.environ, "DRY_RUN": "1", "SEEDS": "0"},
        timeout=60,
        check=True,
    ).stdout
    cells = [ln.split()[3:] for ln in out.splitlines() if ln.startswith("+ fedbench -m ")]
    assert len(cells) == 3 * (17 + 10)  # lr grid x (Table 1's rows + Table 3's)
    for args in cells:
        job = [a for a in args if not a.startswith("hydra.sweep.dir=")]
        keys = [a.split("=")[0] for a in job]
        assert keys[:3] == ["+experiment", "algo", "seed"]
        assert set(keys[3:]) <= {"optim.lr", "algo.gamma"}
        cfg = compose(job)
        check_params(cfg.algo, ALGORITHMS.get(cfg.algo.name).Params, cfg.algo.name)
        if cfg.algo.name == "fedamp":
            assert (cfg.algo.alpha_k, cfg.algo.sigma, cfg.algo.lam) == (5e-3, 0.1, 0.1)
            assert cfg.algo.detach_prox is True
        if cfg.algo.name == "apfl":
            assert (cfg.algo.alpha, cfg.algo.adaptive) == (0.1, True)
        if "table3" in job[0]:
            assert cfg.attack.kind == "a2" and cfg.attack.fraction == 0.1
    assert (cfg.clients, cfg.participation, cfg.rounds, cfg.local_epochs, cfg.batch_size) == (
        100,
        0.1,
        2000,
        5,
        50,
    )
