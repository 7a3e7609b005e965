"""The minimum-norm point of a convex hull: the QP of MGDA, FedPG and FedMGDA+.

    min_lambda  1/2 lambda^T K lambda   s.t.  lambda >= 0,  sum lambda = 1   (K = Q Q^T)

(FedPG appendix eq. 3; FedMGDA+ adds the box lo <= lambda <= hi). Solved with cvxopt in
float64 from the Gram matrix K, so the problem's size is the number of rows of Q (clients,
history, the fairness row), never the number of parameters. `gram` builds K from rows [m, P]
in float64 in column chunks.

A solve that fails (cvxopt error, an infeasible or non-finite answer, a status other than
optimal whose answer's KKT (duality) gap on the scaled K exceeds `gap_tol`, a K that is not
finite) returns None: the caller falls back to its mean and counts
the round. cvxopt's answer is cleaned to the exact constraint set (clipped to the bounds,
renormalized).
"""

from __future__ import annotations

import numpy as np
import torch


def gram(rows: torch.Tensor, chunk: int = 1 << 20) -> np.ndarray:
    """[m, m] float64 Gram matrix Q Q^T of rows [m, P], accumulated over column chunks."""
    m = rows.shape[0]
    K = torch.zeros(m, m, dtype=torch.float64, device=rows.device)
    for s in range(0, rows.shape[1], chunk):
        part = rows[:, s : s + chunk].double()
        K += part @ part.T
    return K.cpu().numpy()


def min_norm_weights(
    K: np.ndarray,
    lo: np.ndarray | None = None,
    hi: np.ndarray | None = None,
    ridge: float = 1e-10,
    gap_tol: float = 1e-6,
) -> np.ndarray | None:
    """argmin 1/2 l^T K l over the simplex (intersected with lo <= l <= hi when given);
    None when the solve fails or the box does not meet the simplex."""
    from cvxopt import matrix, solvers

    K = np.asarray(K, dtype=np.float64)
    m = K.shape[0]
    if m == 0 or not np.all(np.isfinite(K)):
        return None
    if m == 1:
        return np.ones(1)
    lo = np.zeros(m) if lo is None else np.maximum(np.asarray(lo, dtype=np.float64), 0.0)
    hi = np.ones(m) if hi is None else np.minimum(np.asarray(hi, dtype=np.float64), 1.0)
    if lo.sum() > 1 + 1e-12 or hi.sum() < 1 - 1e-12 or np.any(lo > hi + 1e-12):
        return None
    scale = float(np.max(np.abs(np.diag(K))))
    if scale <= 0 or not np.isfinite(scale):
        return None  # all rows zero: no direction to find
    Ks = K / scale
    Ks = 0.5 * (Ks + Ks.T) + ridge * np.eye(m)
    G = np.vstack([-np.eye(m), np.eye(m)])
    h = np.concatenate([-lo, hi])
    opts = {"show_progress": False, "abstol": 1e-12, "reltol": 1e-11, "feastol": 1e-12}
    try:
        sol = solvers.qp(
            matrix(Ks),
            matrix(np.zeros(m)),
            matrix(G),
            matrix(h),
            matrix(np.ones((1, m))),
            matrix(np.ones(1)),
            options=opts,
        )
    except (ValueError, ArithmeticError):
        return None
    lam = np.asarray(sol["x"], dtype=np.float64).ravel()
    if not np.all(np.isfinite(lam)):
        return None
    tol = 1e-5
    if np.any(lam < lo - tol) or np.any(lam > hi + tol) or abs(lam.sum() - 1) > tol:
        return None
    lam = project_capped_simplex(np.clip(lam, lo, hi), lo, hi)
    if sol["status"] != "optimal" and kkt_gap(Ks, lam, lo, hi) > gap_tol:
        return None  # an unfinished solve is accepted only when it is (nearly) optimal
    return lam


def kkt_gap(K: np.ndarray, lam: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """The duality (Frank-Wolfe) gap of a feasible lam for min 1/2 l^T K l over the capped
    simplex: g.lam - min_s g.s with g = K lam; >= 1/2 lam^T K lam - the optimum, 0 exactly at
    a KKT point. The minimizing s fills 1 - sum lo from lo upward in increasing g."""
    g = K @ lam
    s = lo.copy()
    left = 1.0 - float(lo.sum())
    for i in np.argsort(g):
        take = min(left, float(hi[i] - lo[i]))
        s[i] += take
        left -= take
        if left <= 0:
            break
    return float(g @ lam - g @ s)


def project_capped_simplex(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Euclidean projection of x onto {lo <= l <= hi, sum l = 1} (bisection on the shift)."""
    a, b = float((lo - x).min()) - 1.0, float((hi - x).max()) + 1.0
    for _ in range(100):
        c = 0.5 * (a + b)
        if np.clip(x + c, lo, hi).sum() > 1:
            b = c
        else:
            a = c
    return np.clip(x + 0.5 * (a + b), lo, hi)
