"""FedPG / S-FedPG (fedbench/algorithms/fedpg.py, _qp.py, engine.full_grads): the QP, the
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


@pytest.mark.quick
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


@pytest.mark.quick
def test_qp_degenerate_returns_none():
    assert min_norm_weights(np.full((3, 3), np.nan)) is None
    assert min_norm_weights(np.zeros((3, 3))) is None
    assert np.allclose(min_norm_weights(np.ones((1, 1))), [1.0])


@pytest.mark.quick
def test_fairness_gradient_equals_autograd_of_minus_cos():
    L = torch.tensor([0.3, 1.2, 0.7, 2.0], dtype=torch.float64, requires_grad=True)
    F_ = -F.cosine_similarity(L, torch.ones_like(L), dim=0)
    (g,) = torch.autograd.grad(F_, L)
    assert torch.allclose(fedpg.fairness_weights(L.detach()), g, atol=1e-12)
    assert fedpg.fairness_value(L.detach()) == pytest.approx(F_.detach().item(), abs=1e-12)


@pytest.mark.quick
def test_fairness_row_dropped_when_losses_equal():
    gh = torch.randn(3, 5)
    assert fedpg.fairness_row(torch.full((3,), 0.7), gh, 1.0) is None
    assert fedpg.fairness_row(torch.tensor([0.7]), gh[:1], 1.0) is None
    row = fedpg.fairness_row(torch.tensor([0.2, 0.9, 0.5]), gh, 2.0)
    assert row.norm().item() == pytest.approx(2.0, rel=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("case", range(10))
def test_rescaled_direction_is_a_common_descent_direction(case):
    g = torch.Generator().manual_seed(case)
    m, P = 3 + case % 4, 20
    raw = torch.randn(m, P, generator=g) + 0.3
    keep, mu, gh = fedpg.normalize(raw)
    L = torch.rand(m, generator=g) + 0.1
    gF = fedpg.fairness_row(L, gh, mu)
    Q = gh if gF is None else torch.cat([gh, gF[None]])
    d_old, _ = fedpg.min_norm_direction(Q)
    target = float(gh.mean(0).norm())
    d, sigma = fedpg.rescale(d_old, Q, target)
    assert float((Q.double() @ d.double()).min()) >= -1e-6
    # the min-norm point has Q d_old >= ||d_old||^2 > 0, so the full rescaling is feasible:
    # ||d|| = ||mean gh|| exactly, along d_old, and sigma = ||d|| / ||d_old||
    assert float(d.norm()) == pytest.approx(target, rel=1e-5)
    assert sigma == pytest.approx(target / float(d_old.norm()), rel=1e-5)
    assert torch.allclose(d, d_old * sigma, atol=1e-6)


@pytest.mark.quick
def test_rescale_halves_while_infeasible_then_falls_back_to_d_old():
    d_old = torch.tensor([1.0, 0.0], dtype=torch.float64)
    # Q d_old = (1, -2e-7): target 8 gives min -1.6e-6 < -1e-6, halved once (4 > 2 ||d_old||)
    # to -8e-7, feasible: d = 4 d_old
    Q = torch.tensor([[1.0, 0.0], [-2e-7, 1.0]], dtype=torch.float64)
    d, sigma = fedpg.rescale(d_old, Q, 8.0)
    assert sigma == 4.0 and torch.equal(d, 4 * d_old)
    # Q d_old = (1, -1e-5): 8 -> 4 -> 2 stay infeasible; at ||d|| <= 2 ||d_old|| d = d_old
    Q = torch.tensor([[1.0, 0.0], [-1e-5, 1.0]], dtype=torch.float64)
    d, sigma = fedpg.rescale(d_old, Q, 8.0)
    assert sigma == 1.0 and torch.equal(d, d_old)
    # a target of 1.5 ||d_old|| that is infeasible: straight back to d_old (no halving)
    d, sigma = fedpg.rescale(d_old, Q, 1.5)
    assert sigma == 1.0 and torch.equal(d, d_old)
    # the factor form used by the algorithm agrees
    assert fedpg.rescale_factor(np.array([1.0, -2e-7]), 1.0, 8.0) == (4.0, 4.0)
    assert fedpg.rescale_factor(np.array([1.0, -1e-5]), 1.0, 8.0) == (1.0, 1.0)


@pytest.mark.quick
def test_normalize_drops_tiny_gradients_and_uses_the_mean_norm():
    g = torch.tensor([[3.0, 4.0], [0.0, 1e-8], [0.0, 1.0]])
    keep, mu, gh = fedpg.normalize(g)
    assert keep.tolist() == [True, False, True]
    assert mu == pytest.approx(3.0)
    assert torch.allclose(gh.norm(dim=1), torch.tensor([3.0, 3.0]))


@pytest.mark.quick
def test_median_mu_ignores_one_scaled_gradient():
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 3.0], [300.0, 0.0]])
    _, mu_mean, _ = fedpg.normalize(g)
    _, mu_med, gh = fedpg.normalize(g, rule="median")
    assert mu_mean == pytest.approx(76.5)
    assert mu_med == pytest.approx(2.0)  # torch's lower median of 1, 2, 3, 300
    assert torch.allclose(gh.norm(dim=1), torch.full((4,), 2.0))


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
def test_line_search_accepts_exactly_the_armijo_step_on_a_quadratic():
    e, n, tried = _quadratic_search(1.0, 1)  # ub 2 > 2(1 - 1e-4) fails, 1 passes
    assert (e, n, tried) == (1.0, 2, [2.0, 1.0])
    e, n, tried = _quadratic_search(0.75, 2)  # 3 fails, 1.5 passes
    assert (e, tried) == (1.5, [3.0, 1.5])
    e, n, tried = _quadratic_search(1.999, 0)  # ub = eta passes
    assert tried == [1.999]


@pytest.mark.quick
def test_line_search_falls_back_to_mean_decrease_then_smallest_mean():
    L0 = torch.tensor([1.0, 1.0], dtype=torch.float64)
    gd = torch.tensor([1.0, 1.0], dtype=torch.float64)

    def search(table):  # trial losses by step size; Armijo (beta 0.5) never holds
        return fedpg.line_search(
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

    e, n = search({4.0: [2.0, 2.0], 2.0: [0.9, 1.05], 1.0: [0.99, 0.999]})
    assert (e, n) == (2.0, 3)  # the largest eta whose mean loss decreased
    e, _ = search({4.0: [2.0, 2.0], 2.0: [1.5, 1.5], 1.0: [1.2, 1.2]})
    assert e == 1.0  # none decreased: the smallest mean loss


@pytest.mark.quick
def test_line_search_rejects_a_step_that_passes_every_L_i_but_not_F():
    # unequal losses: at eta = 2 both losses fall enough (Armijo per client holds) but the
    # spread grows, so F = -cos(L, 1) rises and the trial is rejected; at eta = 1 the
    # losses even out and F falls: accepted
    L0 = torch.tensor([1.0, 2.0], dtype=torch.float64)
    gd = torch.tensor([0.1, 0.1], dtype=torch.float64)
    dF = float(fedpg.fairness_weights(L0) @ gd)
    table = {2.0: [0.5, 1.9], 1.0: [0.8, 1.0], 0.5: [0.95, 1.95]}
    beta = 1e-4
    for e in (2.0, 1.0):
        L = torch.tensor(table[e]).double()
        assert bool((L0 - beta * e * gd >= L).all())  # every L_i passes Armijo
    assert fedpg.fairness_value(torch.tensor(table[2.0])) > fedpg.fairness_value(L0)
    tried = []

    def loss_at(e):
        tried.append(e)
        return torch.tensor(table[e]).double()

    e, n = fedpg.line_search(
        loss_at, 1.0, s=1, sigma=1.0, shrink_ub=False, L0=L0, gd=gd, dF=dF, beta=beta
    )
    assert (e, n, tried) == (1.0, 2, [2.0, 1.0])


@pytest.mark.quick
def test_sfedpg_first_trial_is_eta_when_the_last_round_had_a_client_this_one_lacks(monkeypatch):
    algo, eng, fed = make_algo("sfedpg", ["optim.lr_decay=0.9"])
    firsts = []
    real = fedpg.line_search

    def spy(loss_at, eta, **kw):
        calls = []

        def rec(e):
            calls.append(e)
            return loss_at(e)

        out = real(rec, eta, **kw)
        firsts.append((eta, calls[0]))
        return out

    monkeypatch.setattr(fedpg, "line_search", spy)
    algo.round(0, np.array([0, 1, 2]))  # S^{-1} empty: a subset, eta_ub = 2 eta
    algo.round(1, np.array([0, 1]))  # client 2 was online at t = 0: eta_ub = eta
    algo.round(2, np.array([0, 1]))  # S^1 = S^2: 2 eta again
    assert [f for _, f in firsts] == pytest.approx([0.2, 0.1 * 0.9, 2 * 0.1 * 0.81])
    assert [eta for eta, _ in firsts] == pytest.approx([0.1, 0.09, 0.081])


@pytest.mark.quick
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


@pytest.mark.quick
def test_qp_failure_falls_back_to_the_mean_with_one_warning(monkeypatch, caplog):
    algo, eng, fed = make_algo("fedpg")
    monkeypatch.setattr(fedpg, "min_norm_weights", lambda K, **kw: None)
    with caplog.at_level(logging.WARNING, logger="fedbench"):
        for t in range(3):
            info = algo.round(t, np.array([0, 1, 2]))
    assert info.diagnostics["qp_fallback_rounds"] == 3
    assert sum("min-norm QP" in r.message for r in caplog.records) == 1


def _expected_round(algo, eng, t, clients, hist_rows=None):
    """FedPG's round from the tested pieces: (w^{t+1} params, theta_i params [C, P])."""
    P = eng.n_params
    w = algo.w[:P].clone()
    res = eng.full_grads(algo.w, clients)
    keep, mu, gh = fedpg.normalize(res.grads)
    assert bool(keep.all())
    H = gh[:0] if hist_rows is None else mu * hist_rows
    G = torch.cat([gh, H])
    gF = fedpg.fairness_row(res.loss, gh, mu)
    Q = G if gF is None else torch.cat([G, gF[None]])
    d, _ = fedpg.min_norm_direction(Q)
    d, _ = fedpg.rescale(d, Q, float(gh.mean(0).norm()))
    # personal_coeffs returns a CPU tensor (from numpy); the round moves r to its device too
    r = fedpg.personal_coeffs(d, G, len(clients)).to(d.device)
    p = fedpg.personal_directions(d, gh, fedpg.apply_gamma(r, algo.hp.gamma, algo.hp.gamma_mode))
    eta = algo.optim.lr_at(t)
    return w - eta * d, w[None] - eta * p, res.grads / res.grads.norm(dim=1, keepdim=True)


@pytest.mark.quick
def test_fedpg_round_from_its_pieces_with_history_and_its_expiry():
    algo, eng, fed = make_algo("fedpg", ["optim.lr_decay=0.9"])
    P = eng.n_params
    w1, theta, dirs = _expected_round(algo, eng, 0, [0, 1, 2])
    info = algo.round(0, np.array([0, 1, 2]))
    assert info.diagnostics["history_rounds"] == 0
    assert torch.allclose(algo.w[:P], w1, atol=1e-6)
    for i in range(3):
        assert torch.allclose(algo.personal_state(i)[:P], theta[i], atol=1e-6)
    assert not torch.allclose(theta[0], theta[1])
    # t = 1, only client 0: M = 3 > 1, tau = 3; clients 1, 2 (seen at t = 0) add their stored
    # directions rescaled to this round's mu; their thetas stay
    w2, theta0, _ = _expected_round(algo, eng, 1, [0], hist_rows=dirs[1:])
    info = algo.round(1, np.array([0]))
    assert info.diagnostics["history_rounds"] == 1
    assert torch.allclose(algo.w[:P], w2, atol=1e-6)
    assert torch.allclose(algo.personal_state(0)[:P], theta0[0], atol=1e-6)
    assert torch.allclose(algo.personal_state(1)[:P], theta[1], atol=1e-6)
    # history lasts while t - t_j <= tau = 3: t = 2, 3 use it, t = 4 does not
    for t, used in [(2, 2), (3, 3), (4, 3)]:
        assert algo.round(t, np.array([0])).diagnostics["history_rounds"] == used
    # and without history the single online client's step is d = g_0 at the mean-gradient norm
    w6, _, _ = _expected_round(algo, eng, 5, [0])
    algo.round(5, np.array([0]))
    assert torch.allclose(algo.w[:P], w6, atol=1e-6)


@pytest.mark.quick
def test_comm_counts_the_line_search_queries_of_the_online_clients(monkeypatch):
    algo, eng, fed = make_algo("sfedpg")
    algo.round(0, np.array([0, 1, 2]))
    real_reports = algo.reports

    def client_1_flat(t, clients):  # client 1 reports a zero gradient: dropped (step 2)
        L, g, bufs, tl = real_reports(t, clients)
        g = g.clone()
        g[list(clients).index(1)] = 0
        return L, g, bufs, tl

    queried = []
    real_full = eng.full_grads

    def counting(states, clients, with_grad=True):
        if not with_grad:
            queried.append(len(clients))
        return real_full(states, clients, with_grad=with_grad)

    monkeypatch.setattr(algo, "reports", client_1_flat)
    monkeypatch.setattr(eng, "full_grads", counting)
    q = algo.counts[2].item()
    info = algo.round(1, np.array([0, 1, 2]))
    trials = info.diagnostics["line_search_queries"] - q
    assert trials >= 1 and queried == [2] * trials  # the two online clients, per trial
    P, D = eng.n_params, eng.n_state
    assert info.comm.bytes_up == (3 * (P + 1) + 2 * trials) * 4
    assert info.comm.bytes_down == (3 * (D + P + 1) + 2 * trials) * 4


@pytest.mark.quick
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


@pytest.mark.slow
@pytest.mark.long
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
        job = [a for a in args if not a.startswith(("hydra.sweep.", "'hydra.sweep.", "resume="))]
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


@pytest.mark.quick
def test_qp_non_optimal_status_accepted_only_with_a_small_kkt_gap(monkeypatch):
    from cvxopt import matrix, solvers

    from fedbench.algorithms._qp import kkt_gap

    K = np.array([[2.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 3.0]])
    best = min_norm_weights(K)
    lo, hi = np.zeros(3), np.ones(3)
    assert kkt_gap(K / 3.0, best, lo, hi) < 1e-9
    # feasible, better than every vertex (value 0.247 < 1/3 on K / 3) yet not optimal (0.242)
    bad = np.array([0.3, 0.5, 0.2])
    assert bad @ K @ bad / 3 < np.diag(K).min() / 3
    assert kkt_gap(K / 3.0, bad, lo, hi) > 1e-2
    for x, ok in [(bad, False), (best, True)]:
        answer = {"status": "unknown", "x": matrix(x)}
        monkeypatch.setattr(solvers, "qp", lambda *a, answer=answer, **kw: answer)
        lam = min_norm_weights(K)
        assert (lam is not None) == ok
        if ok:
            assert np.allclose(lam, best, atol=1e-9)
