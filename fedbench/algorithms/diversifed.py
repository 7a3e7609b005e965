"""DiversiFed (Wu, Liu, Niu, Zhu, Tang, Li, Cao: "The Diversity Bonus: Learning from
Dissimilar Distributed Clients in Personalized Federated Learning", 2024). Equation numbers
are the paper's (arXiv:2407.15464); the updates as implemented: docs/papers/diversifed.md.

Client i's objective (eq. 3) is CE_i(w_i) + lambda L_d(w_i) with the model distance loss
(eq. 4), over a(i) = the N - 1 other clients and d_j = ||w_i - w_j||_2 / tau (all
parameters flattened):

    L_d(w_i) = (1 / (N - 1)) sum_j log q_j,   q_j = exp(d_j) / sum_k exp(d_k).

It is minimized by an incremental proximal method (Algorithm 1):
- server (eq. 6, 8-10): z_i = w_i - alpha grad L_d(w_i), in closed form
      grad L_d(w_i) = sum_j beta_j (w_i - w_j),  beta_j = (1/(N-1) - q_j) / (tau^2 d_j),
  so z_i = (1 - alpha sum_j beta_j) w_i + alpha sum_j beta_j w_j, a combination of the
  personalized models whose coefficients sum to 1 (Lemma 1): a near model (q_j < 1/(N-1))
  has beta_j > 0 and attracts, a far one has beta_j < 0 and repels. All N^2 distances come
  from one Gram matrix of the flattened models (`_shared.pairwise_sq_dists`); d_j = 0
  (identical models) contributes 0.
- client (eq. 7): w_i <- E epochs on CE(w) + (lambda / (2 alpha)) ||w - z_i||^2, i.e. a
  proximal weight lambda / alpha. Round 0: CE only, from the common initialization.
Defaults: lambda = 2, alpha = 1 (the paper), tau = 1.0; Adam 1e-3, E = 10, batch 100 are
the presets' (`conf/experiment/diversifed_*`). The personalized model is w_i.
Buffers: kept local. z_i's running statistics are client i's own (eq. 6 moves parameters
only: L_d is a function of the parameters, its gradient in a running statistic is 0);
mixing them with the signed coefficients of eq. 9 could make a running variance negative.
Uploads: the trained w_i, through `Algorithm.receive` (ref = the state it trained from).

RECONSTRUCTION (docs/papers/diversifed.md; no public code exists):
- a sampled client starts its local training from z_i (Algorithm 1 only names the
  objective); `algo.start: own` starts it from its own w_i instead, as FedAMP's code does
  with the same proximal objective (on FMNIST Dir 0.1 / pat-2, seed 0, the best accuracy
  moved by 0.1 points or less);
- the tau of Tables I-III is not stated; 1.0 is used;
- partial participation: z_i uses the latest stored w_j of every other client, sampled or
  not; "round 0" is the first round (t = 0), whoever is sampled in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import mix_parameters, pairwise_sq_dists
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import positive
from fedbench.engine import Proximal
from fedbench.errors import ConfigError


@dataclass
class DiversiFedParams:
    lam: float = positive()  # lambda, weight of L_d (the prox weight is lambda / alpha)
    alpha: float = positive()  # server step size alpha_t
    tau: float = positive()  # temperature of the distances
    start: Literal["z", "own"]  # where a sampled client's local training starts


def distance_betas(d2: torch.Tensor, tau: float) -> torch.Tensor:
    """beta [N, N] of eq. 10 from squared distances d2 [N, N]: row i holds client i's
    beta_j = (1/(N-1) - q_ij) / (tau^2 d_ij); 0 on the diagonal and where d_ij = 0."""
    n = d2.shape[0]
    d = d2.sqrt() / tau
    eye = torch.eye(n, dtype=torch.bool, device=d.device)
    q = torch.softmax(d.masked_fill(eye, float("-inf")), dim=1)
    beta = (1.0 / (n - 1) - q) / (tau**2 * d)
    return torch.where(d > 0, beta, torch.zeros_like(beta))


def mixing_matrix(w: torch.Tensor, alpha: float, tau: float) -> torch.Tensor:
    """A [N, N] (float64) with z = A @ W (eq. 9): A_ij = alpha beta_ij for j != i,
    A_ii = 1 - alpha sum_j beta_ij; every row sums to 1. w: the models' parameters [N, P]."""
    a = alpha * distance_betas(pairwise_sq_dists(w), tau)
    a.diagonal().copy_(1.0 - a.sum(1))
    return a


def distance_grad(w: torch.Tensor, tau: float) -> torch.Tensor:
    """grad L_d(w_i) for every row i of w [N, P], in closed form (eq. 8):
    sum_j beta_ij (w_i - w_j) = (sum_j beta_ij) w_i - (beta W)_i."""
    beta = distance_betas(pairwise_sq_dists(w), tau).to(w.dtype)
    return beta.sum(1, keepdim=True) * w - beta @ w


def model_distance_loss(w: torch.Tensor, i: int, tau: float) -> torch.Tensor:
    """L_d(w_i) of eq. 4 written out directly (differentiable; the reference for tests)."""
    others = torch.arange(w.shape[0], device=w.device) != i
    d = (w[i] - w[others]).norm(dim=1) / tau
    return torch.log_softmax(d, dim=0).mean()


@ALGORITHMS.register()
class DiversiFed(Algorithm):
    about = About(
        name="DiversiFed",
        paper="Wu et al., 2024, arXiv:2407.15464",
        summary=(
            "server step z_i = w_i - alpha grad L_d(w_i): a closed-form mix of all "
            "personalized models (one Gram matrix) that pulls near ones and pushes far "
            "ones; client trains CE + lambda/(2 alpha)||w - z_i||^2"
        ),
        docs="papers/diversifed.md#diversifed-diversifed-algorithm-1",
    )
    personal_rows = "w"
    Params = DiversiFedParams
    attackable = True
    state_keys = ("w",)

    def setup(self) -> None:
        if self.N < 2:
            raise ConfigError(f"diversifed needs at least 2 clients; clients={self.N}")
        self.w = self.engine.initial_state().repeat(self.N, 1)  # latest uploaded w_i, [N, D]

    def server_models(self, clients: torch.Tensor) -> torch.Tensor:
        """z_i [C, D] for the given clients (eq. 9), from all N stored models: parameters
        combined with the coefficients of eq. 9, buffers the client's own (see Buffers)."""
        P = self.engine.n_params
        a = mixing_matrix(self.w[:, :P], self.hp.alpha, self.hp.tau)
        return mix_parameters(a[clients], self.w, self.w[clients], P)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        if t == 0:
            start = self.w[idx]
            res = self.local_train(start, clients, t)
            down = 0
        else:
            z = self.server_models(idx)
            prox = Proximal(z, self.hp.lam / self.hp.alpha)
            start = z if self.hp.start == "z" else self.w[idx]
            res = self.local_train(start, clients, t, terms=[prox])
            down = None
        self.w[idx] = self.receive(res.states, clients, ref=start)
        return RoundReport(res.loss.mean(), self.comm(clients, down=down))
