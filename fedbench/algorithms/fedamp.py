"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang: "Personalized Cross-Silo Federated
Learning on Non-IID Data", AAAI 2021): attentive message passing.

Server, for every client i, from the stored personalized models w_j (its eq. 5 with
A(x) = 1 - exp(-x / sigma), so A'(x) = exp(-x / sigma) / sigma):

    u_i = xi_ii w_i + sum_{j != i} xi_ij w_j,
    xi_ij = alpha_k exp(-||w_i - w_j||^2 / sigma) / sigma,   xi_ii = 1 - sum_{j != i} xi_ij.

Client i trains its own w_i for E epochs on F_i(w) + (lambda / (2 alpha_k)) ||w - u_i||^2
(the squared norm, with its gradient). The personalized model is w_i.
Defaults alpha_k = 1, lambda = 1, sigma = 1 (PFLlib's, which the DiversiFed paper ran).

PFLlib's client adds lambda / (2 alpha_k) ||w - u_i|| on detached `.data` tensors: not
squared, and with no gradient at all, so its FedAMP is local training. Not copied: the term
here is the paper's. `detach_prox: true` reproduces the detached variant (pure local
training), which is what the FedPG authors' Table 1 row shows (docs/papers/fedpg.md).

Buffers: kept local. u_i is a combination of parameters (the paper's eq. 5 and PFLlib mix
`parameters()`), and the client trains its own w_i, running statistics included; u_i only
enters the proximal term. The self-weight xi_ii can be negative (alpha_k / sigma = 1 and
close models give xi_ij ~ 1 each), so mixing running variances with xi would make them
negative.
Uploads: the trained w_i, through `Algorithm.receive` (ref = the w_i it trained from).

RECONSTRUCTION: with partial participation the server combines the latest stored model of
every client (PFLlib uses the models uploaded in the previous round, the same set under full
participation); all distances come from one Gram matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import mix_parameters, pairwise_sq_dists
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import nonneg, positive
from fedbench.engine import Proximal


@dataclass
class FedAMPParams:
    alpha_k: float = positive()  # server step alpha_k (the prox weight is lambda / alpha_k)
    lam: float = nonneg()  # lambda
    sigma: float = positive()  # scale of the attention function A(x) = 1 - exp(-x / sigma)
    detach_prox: bool  # true: PFLlib's gradient-free prox term (pure local training)


def attention_weights(w: torch.Tensor, alpha_k: float, sigma: float) -> torch.Tensor:
    """xi [N, N] (float64) with u = xi @ W: off-diagonal alpha_k exp(-d^2/sigma)/sigma,
    diagonal 1 - the row's off-diagonal sum. w: the models' parameters [N, P]."""
    xi = alpha_k * torch.exp(-pairwise_sq_dists(w) / sigma) / sigma
    xi.fill_diagonal_(0)
    xi.diagonal().copy_(1.0 - xi.sum(1))
    return xi


@ALGORITHMS.register()
class FedAMP(Algorithm):
    about = About(
        name="FedAMP",
        paper="Huang et al., AAAI 2021",
        summary=(
            "attentive message passing u_i = sum_j xi_ij w_j; client trains with a "
            "proximal term to u_i"
        ),
        docs="papers/fedpg.md#fedamp-fedamp",
        pfllib="FedAMP",
    )
    personal_rows = "w"
    Params = FedAMPParams
    attackable = True
    state_keys = ("w",)

    def setup(self) -> None:
        self.w = self.engine.initial_state().repeat(self.N, 1)

    def messages(self, clients: torch.Tensor) -> torch.Tensor:
        """u_i [C, D] for the given clients, from all N stored models: parameters mixed by xi,
        buffers the client's own (see Buffers)."""
        P = self.engine.n_params
        xi = attention_weights(self.w[:, :P], self.hp.alpha_k, self.hp.sigma)
        return mix_parameters(xi[clients], self.w, self.w[clients], P)

    def terms(self, u: torch.Tensor) -> list:
        if self.hp.detach_prox:
            return []
        return [Proximal(u, self.hp.lam / self.hp.alpha_k)]

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        u = self.messages(idx)
        start = self.w[idx]
        res = self.local_train(start, clients, t, terms=self.terms(u))
        self.w[idx] = self.receive(res.states, clients, ref=start)
        return RoundReport(res.loss.mean(), self.comm(clients))
