"""FedPG and S-FedPG ("Preserving Global Performance in Personalized Federated Learning";
anonymous ICCV submission, paper ID 6989, whose appendix alone is public; the exact
updates: docs/papers/fedpg.md).

Round t, sampled set S_t, step eta_t = eta_0 0.999^t (`optim.lr`, `optim.lr_decay`):
1. Each sampled client reports L_i = F_i(w^t) and g_i = grad F_i(w^t) on its whole training
   set (`client_grad: full`, default: all clients from one engine call, `Engine.full_grads`)
   or the pseudo-gradient (w^t - w_i) / eta_t after E local epochs (`pseudo`).
   RECONSTRUCTION: the appendix's "5 local epochs" suggests `pseudo`; both are kept.
2. Clients with ||g_i|| <= 1e-6 are dropped; mu = mean ||g_i||, gh_i = mu g_i / ||g_i||.
   (`mu_rule: median` is our extension, not the paper's: one client uploading 100 g_i (A2)
   inflates the mean norm ~10x with 10 online clients, and so the step; the median does not.)
3. Absent-client history: the server keeps each client's last direction g_j/||g_j|| and the
   round t_j it was seen. With M = clients ever seen, if M > |S_t|: tau = floor(M / |S_t|),
   every absent client with t - t_j <= tau adds mu g_j/||g_j|| to the rows (the round counts
   in `history_rounds`).
4. Fairness gradient (appendix A.1.1): F(w) = -cos(L(w), 1), p = 1/sqrt(m) 1,
   h = [(L.p) L / ||L|| - p ||L||] / ||L||^2 = dF/dL; g_F = sum_i h_i gh_i rescaled to
   norm mu; dropped when ~0 (equal losses, one online client).
5. Q = [gh_online; gh_history; g_F]; lambda = argmin 1/2 l^T (Q Q^T) l on the simplex
   (eq. 3; cvxopt, float64, from the Gram matrix, `_qp.py`); d = Q^T lambda (the update is
   w - eta d; the appendix's d^t = -Q lambda with the sign folded in). A failed or degenerate
   QP falls back to the mean of gh_online (one warning per run; `qp_fallback_rounds`).
   One online client and no history: d = gh_1 = g_1.
6. Rescaling: d_old = d; d <- d ||mean_online gh|| / ||d||; while max(-Q d) > 1e-6: halve d
   if ||d|| > 2 ||d_old||, else d = d_old and stop; sigma = ||d|| / ||d_old||.
7. FedPG: w^{t+1} = w^t - eta_t d.
   S-FedPG: the step from appendix Algorithm 1 (`line_search`): eta_ub = 2^s eta_t (eta_t
   when S^{t-1} is not a subset of S^t; `ub_rule: history`: when history was used),
   eta_lb = 0.5^s eta_t / sigma; halve from eta_ub while >= eta_lb, each trial querying
   the online clients' losses at w - eta d; accept the first eta with the Armijo condition
   (eq. 6) for every online L_i (directional derivative g_i.d) and for F (h.(G_online d),
   the true gradient of -cos(L, 1)); else the largest tried eta whose mean loss decreased
   (eq. 7); else the tried eta of smallest mean loss.
Personalized models (appendix A.1.2, the generalization-protected direction): G = rows
[gh_online; gh_history], D_j = d.gh_j, K = G G^T; for online client i:
temp_j = (D_j - K_ij) / D_j (|D_j| >= 1e-12), temp_i = 1, r_i = min(1, 1 / max_j temp_j), so
that p_i = d + r_i (gh_i - d) keeps p_i.gh_j >= 0 for every row j; p_i <- p_i ||d|| / ||p_i||;
theta_i = w^t - eta p_i (eta the round's global step). Absent clients keep their last theta_i;
a client never sampled deploys w.
gamma (the tables' rows "FedPG gamma=0.3/0.6/1.0"): its role is not public. RECONSTRUCTION:
the tables make every gamma row more personal than plain FedPG and more so as gamma grows,
so gamma raises r_i: `gamma_mode: floor` r_i <- max(gamma, r_i) (default), `scale`
min(1, gamma r_i), `cap` min(gamma, r_i); `gamma: null` (plain FedPG) leaves r_i as is.

In the code: `FedPG.round` is the list above, one call per step: 1 `reports`, 2 `normalize`,
3 `history_rows` then `store_directions`, 4 `fairness_row`, 5 `common_direction` (on the
Gram matrix `gram(Q)`), 6 `rescale_direction`, 7 `step_size` (S-FedPG overrides it with
`line_search`) and `update`; the personalized directions are `personalize`. A round
synchronizes the device only where the algorithm needs a number on the host (listed in
`FedPG`'s docstring); timing its sections is opt-in (`profiler`, `SectionTimer`).

Communication per sampled client: up g_i (P) + L_i (1), down w^t (D) + d (P) + r_i (1); per
online client (the ones the line search queries) one step size down and one loss up per trial.
Buffers: averaged (weights >= 0): the global buffers are the sample-weighted mean of the
buffers the online clients' passes leave (none for the tables' MLP/CNN/NFResNet); personal
models take the global buffers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._qp import gram, min_norm_weights
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport, TrainedOrGlobal
from fedbench.algorithms.params import hp, nonneg, positive

log = logging.getLogger("fedbench")

GRAD_TOL = 1e-6  # clients with ||g_i|| <= this are dropped (step 2)
DESCENT_TOL = 1e-6  # step 6: max(-Q d) allowed


@dataclass
class FedPGParams:
    client_grad: Literal["full", "pseudo"]
    gamma: float | None = hp(gt=0, le=1)
    gamma_mode: Literal["floor", "scale", "cap"]
    mu_rule: Literal["mean", "median"]


@dataclass
class SFedPGParams(FedPGParams):
    s: int = nonneg()
    beta: float = positive()
    ub_rule: Literal["subset", "history"]


# ---------------------------------------------------------------------- the pieces, as math
def normalize(g: torch.Tensor, tol: float = GRAD_TOL, rule: str = "mean"):
    """(keep [C] bool, mu, gh [kept, P]): drop tiny gradients, rescale the rest to the mean
    norm mu (step 2; `rule="median"`: the median norm, our robustness variant)."""
    norms = g.norm(dim=1)
    keep = torch.isfinite(norms) & (norms > tol)
    if not bool(keep.any()):
        return keep, 0.0, g[:0]
    n = norms[keep]
    mu = float(n.median() if rule == "median" else n.mean())
    return keep, mu, g[keep] * (mu / n)[:, None]


def fairness_weights(L: torch.Tensor) -> torch.Tensor:
    """h = dF/dL of F(L) = -cos(L, 1) (appendix A.1.1), in float64."""
    L = L.double()
    m = L.numel()
    p = torch.full_like(L, 1 / math.sqrt(m))
    nL = L.norm()
    return ((L @ p) * L / nL - p * nL) / nL**2


def fairness_value(L: torch.Tensor) -> float:
    """F(L) = -(L.1) / (||L|| ||1||)."""
    L = L.double()
    return float(-(L.sum() / math.sqrt(L.numel())) / L.norm().clamp_min(1e-300))


def fairness_row(L: torch.Tensor, gh: torch.Tensor, mu: float) -> torch.Tensor | None:
    """g_F = sum_i h_i gh_i rescaled to norm mu; None when ~0 (step 4)."""
    if L.numel() < 2:
        return None
    h = fairness_weights(L).to(gh.dtype)
    gF = h @ gh
    n = float(gF.norm())
    if not math.isfinite(n) or n <= 1e-8 * max(mu, 1e-12):
        return None
    return gF * (mu / n)


def min_norm_direction(
    Q: torch.Tensor, K: np.ndarray | None = None
) -> tuple[torch.Tensor, np.ndarray] | None:
    """d = Q^T lambda with lambda the min-norm simplex weights (step 5); None if the QP fails.
    `K`: the Gram matrix Q Q^T if already computed (float64)."""
    lam = min_norm_weights(gram(Q) if K is None else K)
    if lam is None:
        return None
    return torch.from_numpy(lam).to(Q.device, Q.dtype) @ Q, lam


def rescale_factor(
    Qd: np.ndarray, n_old: float, target: float, tol: float = DESCENT_TOL
) -> tuple[float, float]:
    """Step 6 on the products Qd = Q d_old (float64): (c, sigma) with the rescaled d = c d_old.
    d <- d_old target / ||d_old||; while max(-Q d) > tol: halve d if ||d|| > 2 ||d_old||,
    else d = d_old and stop; sigma = ||d|| / ||d_old|| (= c)."""
    if n_old <= 0 or not math.isfinite(n_old) or target <= 0:
        return 1.0, 1.0
    c = target / n_old
    while float(np.max(-c * Qd)) > tol:
        if c > 2:
            c /= 2
        else:
            c = 1.0
            break
    return c, c


def rescale(d: torch.Tensor, Q: torch.Tensor, target: float, tol: float = DESCENT_TOL):
    """Step 6 on explicit rows: (d, sigma) with d rescaled to norm `target` unless that breaks
    Q d >= -tol."""
    Qd = (Q.double() @ d.double()).cpu().numpy()
    c, sigma = rescale_factor(Qd, float(d.norm()), target, tol)
    return d * c, sigma


def rescale_direction(
    d: torch.Tensor, Qd: np.ndarray, lam: np.ndarray | None, gh: torch.Tensor
) -> tuple[torch.Tensor, np.ndarray, float]:
    """Step 6 on step 5's d = Q^T lam with its products Qd = Q d = K lam (float64): (d, Q d,
    sigma) with d rescaled to the norm ||mean_online gh|| unless that breaks Q d >= -tol
    (`rescale_factor`; ||d_old|| = sqrt(lam^T K lam)). lam None (d = g_1, or the fallback
    mean: not the QP's): d and Qd as they are, sigma = 1."""
    if lam is None:
        return d, Qd, 1.0
    c, sigma = rescale_factor(Qd, float(np.sqrt(max(lam @ Qd, 0.0))), float(gh.mean(0).norm()))
    return d * c, c * Qd, sigma


def personal_coeffs_from(D: np.ndarray, K: np.ndarray, online: int) -> np.ndarray:
    """r_i of the first `online` rows from D_j = d.gh_j and K = G G^T (appendix A.1.2):
    temp_j = (D_j - K_ij) / D_j (|D_j| >= 1e-12), temp_i = 1, r_i = min(1, 1 / max_j temp_j)."""
    ok = np.abs(D) >= 1e-12
    r = np.ones(online)
    for i in range(online):
        temp = np.full(D.shape, -np.inf)
        temp[ok] = (D[ok] - K[i, ok]) / D[ok]
        temp[i] = 1.0
        r[i] = min(1.0, 1.0 / float(temp.max()))
    return r


def personal_coeffs(d: torch.Tensor, G: torch.Tensor, online: int) -> torch.Tensor:
    """r_i (float64 [online]) of the first `online` rows of G, from explicit rows."""
    D = (G.double() @ d.double()).cpu().numpy()
    return torch.from_numpy(personal_coeffs_from(D, gram(G), online)).to(d.device)


def apply_gamma(r: torch.Tensor, gamma: float | None, mode: str) -> torch.Tensor:
    """The gamma rows' reading of r_i (RECONSTRUCTION, see the module docstring)."""
    if gamma is None:
        return r
    if mode == "floor":
        return r.clamp(min=gamma)
    if mode == "scale":
        return (gamma * r).clamp(max=1.0)
    return r.clamp(max=gamma)  # cap


def personal_directions(d: torch.Tensor, gh: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """p_i = d + r_i (gh_i - d), rescaled to ||d|| ([online, P])."""
    p = d[None, :] + r.to(gh.dtype)[:, None] * (gh - d[None, :])
    n = p.norm(dim=1, keepdim=True)
    return torch.where(n > 0, p * (d.norm() / n.clamp_min(1e-30)), p)


def line_search(
    loss_at,
    eta: float,
    *,
    s: int,
    sigma: float,
    shrink_ub: bool,
    L0: torch.Tensor,
    gd: torch.Tensor,
    dF: float,
    beta: float,
) -> tuple[float, int]:
    """Appendix Algorithm 1: (the step, the number of loss queries). `loss_at(eta)` returns
    the online clients' losses [m] at w - eta d; L0 their losses at w, gd [m] = g_i.d,
    dF = h.(G_online d). At least one trial is made."""
    eta_ub = eta if shrink_ub else eta * 2**s
    eta_lb = eta * 0.5**s / max(sigma, 1e-12)
    L0 = L0.double()
    gd = gd.double()
    F0 = fairness_value(L0)
    tried: list[tuple[float, torch.Tensor]] = []
    e = eta_ub
    while e >= eta_lb or not tried:
        L = loss_at(e).double()
        tried.append((e, L))
        armijo = bool((L0 - beta * e * gd >= L).all())
        armijo = armijo and fairness_value(L) <= F0 - beta * e * dF
        if armijo:
            return e, len(tried)
        e /= 2
    base = float(L0.mean())
    better = [(e, L) for e, L in tried if float(L.mean()) < base]
    if better:
        return max(e for e, _ in better), len(tried)
    return min(tried, key=lambda el: float(el[1].mean()))[0], len(tried)


# ---------------------------------------------------------------------- opt-in profiling
class NoProfiler:
    """FedPG's default profiler: every section is the one shared no-op context (no clock
    read, no device synchronization), every note is dropped."""

    _none = contextlib.nullcontext()

    def section(self, name: str) -> contextlib.AbstractContextManager:
        return self._none

    def note(self, name: str, value: float) -> None:
        pass


class SectionTimer(NoProfiler):
    """Opt-in (scripts/bench_fedpg.py: `algo.profiler = SectionTimer(device)`): wall seconds
    per named section of a round, summed into `times` until the caller clears it, with the
    device synchronized at each boundary so that a section holds the device work it queued
    (the synchronizations a normal round does not pay). `note` records a number as is."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.times: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def section(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def note(self, name: str, value: float) -> None:
        self.times[name] = value


# ---------------------------------------------------------------------- the algorithm
@ALGORITHMS.register()
class FedPG(TrainedOrGlobal, Algorithm):
    """FedPG: `round` is the module docstring's steps 1-7 in order, one call each.

    Device synchronizations in a round (on CUDA; none is for logging or profiling): the
    sampled ids sent to the device; the boolean selections of the online clients (their
    count sizes the QP) and step 2's `bool(keep.any())` and mu; step 3's M (tau = M // |S_t|
    on the host) and the absent clients' ids; step 4's ||g_F|| (its drop test); steps 5-6
    on the CPU: the Gram matrix down (cvxopt solves the QP there), lambda up, the rescaling's
    target ||mean gh||, the fallback's G d down; r_i up; the online clients' ids down when
    buffers are averaged; S-FedPG's line search (each trial's losses down for the Armijo
    test, its online ids and fairness derivative). The train loss is returned as a tensor:
    the runner reads it on evaluation rounds only. `profiler` (default `NoProfiler`) times
    the sections: `SectionTimer` opts in."""

    about = About(
        name="FedPG",
        paper="FedPG, anonymous ICCV submission (appendix)",
        summary=(
            "clients send loss and full gradient at w^t; the server solves a min-norm "
            "QP over the normalized gradients, absent clients' history and a fairness "
            "gradient for a common descent direction d; each online client's "
            "personalized model steps along d + r_i (g_i - d), which keeps it a descent"
            " direction for every other client (`algo.gamma`, `algo.gamma_mode`, "
            "`algo.client_grad=full|pseudo`)"
        ),
        docs="papers/fedpg.md#fedpg-the-global-update",
    )

    Params = FedPGParams
    attackable = True
    state_keys = ("w", "theta", "seen", "hist", "last", "prev", "counts")
    profiler: NoProfiler = NoProfiler()

    def setup(self) -> None:
        self.w = self.engine.initial_state()
        self.init_rows()
        P = self.engine.n_params
        self.hist = torch.zeros(self.N, P, device=self.device)  # last g_j / ||g_j||
        self.last = torch.full((self.N,), -1, dtype=torch.long, device=self.device)
        self.prev = torch.zeros(self.N, dtype=torch.bool, device=self.device)  # S^{t-1}
        # cumulative: [QP fallbacks, rounds that used history, line-search queries]
        self.counts = torch.zeros(3, dtype=torch.long)
        self._warned = False

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        clients = np.asarray(clients)
        idx = torch.as_tensor(clients, device=self.device)
        prof = self.profiler
        with prof.section("grads"):
            L, g, bufs, train_loss = self.reports(t, clients)  # step 1
        with prof.section("direction"):
            keep, mu, gh = normalize(g, rule=self.hp.mu_rule)  # step 2
            if gh.shape[0] == 0:  # no client to learn from: w stays, the sampled deploy it
                d = torch.zeros(self.engine.n_params, device=self.device)
                self.update(clients, idx, keep, bufs, d, 0.0, None)
                return self.round_info(clients, 0, 0, 0.0, train_loss)
            L_on, g_on = L[keep], g[keep]
            H = self.history_rows(t, idx, mu)  # step 3
            self.store_directions(t, idx[keep], g_on)
            gF = fairness_row(L_on, gh, mu)  # step 4
            G = torch.cat([gh, H])  # the rows the personalized directions respect
            Q = G if gF is None else torch.cat([G, gF[None]])
            with prof.section("gram"):
                K = gram(Q)  # Q Q^T, float64 on the CPU: steps 5-6 and r_i work on it
            prof.note("rows", Q.shape[0])
            d, Qd, lam = self.common_direction(t, Q, K, G, gh)  # step 5
            d, Qd, sigma = rescale_direction(d, Qd, lam, gh)  # step 6
        with prof.section("line_search"):  # step 7's step: eta_t (S-FedPG: Algorithm 1)
            used_history = H.shape[0] > 0
            step, trials = self.step_size(t, clients, idx, keep, L_on, g_on, d, sigma, used_history)
        with prof.section("personal"):  # appendix A.1.2
            nG = G.shape[0]
            p = self.personalize(d, gh, Qd[:nG], K[:nG, :nG])
        self.update(clients, idx, keep, bufs, d, step, p)  # step 7: w^{t+1} and the theta_i
        return self.round_info(clients, gh.shape[0], trials, step, train_loss)

    # -------------------------------------------------------------- the steps
    def reports(
        self, t: int, clients
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 1 as the server receives it: (L [C] at w^t, g [C, P], buffers [C, D-P], the
        mean local training loss, a 0-d tensor)."""
        P, w = self.engine.n_params, self.w
        if self.hp.client_grad == "full":
            res = self.engine.full_grads(w, clients)
            L, g, bufs, train_loss = res.loss, res.grads, res.buffers, res.loss.mean()
        else:
            eta = self.optim.lr_at(t)
            tr = self.local_train(w, clients, t)
            g = (w[None, :P] - tr.states[:, :P]) / eta
            L = self.engine.full_grads(w, clients, with_grad=False).loss
            bufs, train_loss = tr.states[:, P:], tr.loss.mean()
        g = self.receive(g, clients, ref=w, kind="grad")
        L = self.receive(L[:, None], clients, kind="loss")[:, 0]
        return L, g, bufs, train_loss

    def history_rows(self, t: int, idx: torch.Tensor, mu: float) -> torch.Tensor:
        """Step 3: the rows mu g_j / ||g_j|| [A, P] of the absent clients seen within tau =
        floor(M / |S_t|) rounds (none unless M > |S_t|), from the directions stored before
        this round's; counts the round in `history_rounds` when there are any."""
        sampled = self._mask(idx)
        ever = int(((self.last >= 0) | sampled).sum())  # M
        ids = torch.zeros(0, dtype=torch.long, device=self.device)
        if ever > idx.numel():
            tau = ever // idx.numel()
            absent = ~sampled & (self.last >= 0) & (t - self.last <= tau)
            ids = absent.nonzero().flatten()
        if ids.numel():
            self.counts[1] += 1
        return mu * self.hist[ids]

    def store_directions(self, t: int, on: torch.Tensor, g_on: torch.Tensor) -> None:
        """Step 3's store: the online clients `on`'s g_i / ||g_i|| and this round."""
        self.hist[on] = g_on / g_on.norm(dim=1, keepdim=True)
        self.last[on] = t

    def common_direction(
        self, t: int, Q: torch.Tensor, K: np.ndarray, G: torch.Tensor, gh: torch.Tensor
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
        """Step 5: (d, its float64 products with the rows, lambda). d = Q^T lambda with
        lambda the min-norm simplex weights from K = Q Q^T, the products Q d = K lambda;
        one row (one online client, no history): d = gh_1 = g_1; a failed QP: the mean of
        gh_online and its products with G's rows (`qp_fallback_rounds`, one warning per run).
        lambda is None when d is not the QP's (step 6 then leaves it)."""
        if Q.shape[0] == 1:
            return gh[0], K[0], None
        with self.profiler.section("qp_solve"):
            found = min_norm_direction(Q, K)
        if found is None:
            self.counts[0] += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "fedpg: the min-norm QP failed or was degenerate at round %d; "
                    "using the mean gradient (counted in qp_fallback_rounds)",
                    t + 1,
                )
            d = gh.mean(0)
            return d, (G.double() @ d.double()).cpu().numpy(), None
        d, lam = found
        return d, K @ lam, lam  # Q d = Q Q^T lambda, exact in float64

    def step_size(
        self, t, clients, idx, keep, L_on, g_on, d, sigma, used_history
    ) -> tuple[float, int]:
        """Step 7's step and its number of loss queries: FedPG's is eta_t (none)."""
        return self.optim.lr_at(t), 0

    def personalize(
        self, d: torch.Tensor, gh: torch.Tensor, D: np.ndarray, KG: np.ndarray
    ) -> torch.Tensor:
        """Appendix A.1.2: the online clients' p_i [m, P] from D_j = d.gh_j and KG = G G^T
        (r_i, gamma's reading of it, then p_i = d + r_i (gh_i - d) at norm ||d||)."""
        r = torch.from_numpy(personal_coeffs_from(D, KG, gh.shape[0])).to(self.device)
        r = apply_gamma(r, self.hp.gamma, self.hp.gamma_mode)
        return personal_directions(d, gh, r)

    def update(self, clients, idx, keep, bufs, d, step: float, p) -> None:
        """Step 7: w^{t+1} = w^t - step d (buffers: the online clients' sample-weighted
        mean); the sampled clients deploy theta_i = w^t - step p_i, p_i = d for a dropped
        client (for all when `p` is None: no online client, w and the buffers stay)."""
        P, D, w = self.engine.n_params, self.engine.n_state, self.w
        new = w.clone()
        new[:P] = w[:P] - step * d
        if D > P and p is not None:
            new[P:] = self.weights(clients[keep.cpu().numpy()]) @ bufs[keep]
        theta = new.repeat(len(clients), 1)
        theta[:, :P] = w[:P] - step * d
        if p is not None:
            theta[keep, :P] = w[None, :P] - step * p
        self.set_trained(idx, theta)
        self.w = new
        self.prev = self._mask(idx)

    def round_info(self, clients, m: int, trials: int, step: float, train_loss) -> RoundReport:
        """The round's report; the line search queries the m online clients only: one step
        down, one loss up each."""
        C, P, D = len(clients), self.engine.n_params, self.engine.n_state
        up = C * (P + 1) + m * trials
        down = C * (D + P + 1) + m * trials
        diagnostics = {
            "qp_fallback_rounds": int(self.counts[0]),
            "history_rounds": int(self.counts[1]),
            "line_search_queries": int(self.counts[2]),
            "step": float(step),
        }
        return RoundReport(train_loss, self.comm(clients, up=up, down=down), diagnostics)

    def _mask(self, idx: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(self.N, dtype=torch.bool, device=self.device)
        m[idx] = True
        return m


@ALGORITHMS.register("sfedpg")
class SFedPG(FedPG):
    """S-FedPG: FedPG with appendix Algorithm 1's step size (step 7; see `FedPG`)."""

    about = About(
        name="S-FedPG",
        paper="FedPG appendix, Algorithm 1",
        summary=(
            "FedPG with the Armijo step-size line search on the online clients' losses "
            "and the fairness term"
        ),
        docs="papers/fedpg.md#fedpg-the-global-update",
    )

    Params = SFedPGParams

    def step_size(
        self, t, clients, idx, keep, L_on, g_on, d, sigma, used_history
    ) -> tuple[float, int]:
        """Step 7's step by Algorithm 1 from eta_t, each trial querying the online clients'
        losses at w - eta d (`line_search`); eta_ub = eta_t when S^{t-1} is not a subset of
        S^t (`ub_rule: history`: when step 3 used history rows)."""
        on = clients[keep.cpu().numpy()]
        P = self.engine.n_params
        if self.hp.ub_rule == "subset":
            shrink = bool((self.prev & ~self._mask(idx)).any())
        else:
            shrink = used_history
        gd = g_on.double() @ d.double()
        dF = float(fairness_weights(L_on) @ gd) if L_on.numel() > 1 else 0.0

        def loss_at(e: float) -> torch.Tensor:
            x = self.w.clone()
            x[:P] -= e * d
            L = self.engine.full_grads(x, on, with_grad=False).loss
            return self.receive(L[:, None], on, kind="loss")[:, 0]

        step, trials = line_search(
            loss_at,
            self.optim.lr_at(t),
            s=self.hp.s,
            sigma=sigma,
            shrink_ub=shrink,
            L0=L_on,
            gd=gd,
            dF=dF,
            beta=self.hp.beta,
        )
        self.counts[2] += trials
        return step, trials
