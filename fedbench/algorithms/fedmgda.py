"""FedMGDA+ (Hu, Shaloudegi, Zhang, Yu: "Federated Learning Meets Multi-objective
Optimization", IEEE TNSE 2022, Algorithm 2; docs/papers/fedpg.md).

Round t: each sampled client i trains E local epochs from w^t to w_i and uploads it; the
server normalizes the updates, gh_i = (w^t - w_i) / ||w^t - w_i|| (gradient normalization),
and finds the min-norm convex combination within eps of the data weights:

    lambda = argmin_l || sum_i l_i gh_i ||^2   s.t.  l on the simplex,
             lambda0_i - eps <= l_i <= lambda0_i + eps,   lambda0_i = n_i / sum_j n_j

(cvxopt, float64, from the Gram matrix: `_qp.min_norm_weights` with the box), then
w^{t+1} = w^t - eta_t sum_i lambda_i gh_i. eta_t = `server_lr` when a number (the FedMGDA+
paper's global learning rate); `server_lr: null` (default) = the run's decayed step
optim.lr_at(t), as the FedPG authors' FedMGDA+ code steps (RECONSTRUCTION of their tables).
A failed QP falls back to lambda0 (counted in `qp_fallback_rounds`). Clients whose update is
~0 are left out.

Personalized model (FedPG appendix L317, "we follow [4]"): a client's model after its last
local training; a client never sampled deploys w.
Buffers: averaged (weights lambda0 >= 0) over the sampled clients' trained states.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._qp import gram, min_norm_weights
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport, TrainedOrGlobal
from fedbench.algorithms.params import fraction, positive

log = logging.getLogger("fedbench")


@dataclass
class FedMGDAParams:
    eps: float = fraction()
    server_lr: float | None = positive()


def box_weights(gh: torch.Tensor, lam0: np.ndarray, eps: float) -> np.ndarray | None:
    """The min-norm weights over the simplex intersected with [lam0 - eps, lam0 + eps]."""
    return min_norm_weights(gram(gh), lo=lam0 - eps, hi=lam0 + eps)


@ALGORITHMS.register()
class FedMGDA(TrainedOrGlobal, Algorithm):
    about = About(
        name="FedMGDA+",
        paper="Hu et al., IEEE TNSE 2022 (FedMGDA+)",
        summary=(
            "min-norm combination of the clients' normalized updates, weights in a box "
            "around n_i/n on the simplex"
        ),
        docs="papers/fedpg.md#fedmgda-fedmgda",
    )
    Params = FedMGDAParams
    attackable = True
    state_keys = ("w", "theta", "seen", "fallbacks")

    def setup(self) -> None:
        self.w = self.engine.initial_state()
        self.init_rows()
        self.fallbacks = 0
        self.last_lambda: np.ndarray | None = None

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        P = self.engine.n_params
        res = self.local_train(self.w, clients, t)
        states = self.receive(res.states, clients, ref=self.w, kind="model")
        idx = torch.as_tensor(clients, device=self.device)
        self.set_trained(idx, states)
        lam0_all = self.weights(clients)
        delta = self.w[None, :P] - states[:, :P]
        norms = delta.norm(dim=1)
        keep = torch.isfinite(norms) & (norms > 1e-12)
        new = self.w.clone()
        if bool(keep.any()):
            gh = delta[keep] / norms[keep, None]
            lam0 = lam0_all[keep].double().cpu().numpy()
            lam0 = lam0 / lam0.sum()
            lam = box_weights(gh, lam0, self.hp.eps)
            if lam is None:
                self.fallbacks += 1
                if self.fallbacks == 1:
                    log.warning("fedmgda: the QP failed at round %d; using lambda0", t + 1)
                lam = lam0
            self.last_lambda = lam
            lam_t = torch.as_tensor(lam, dtype=gh.dtype, device=self.device)
            new[:P] = self.w[:P] - self.server_lr(t) * (lam_t @ gh)
        if self.engine.n_state > P:
            new[P:] = lam0_all @ states[:, P:]
        self.w = new
        return RoundReport(
            res.loss.mean(), self.comm(clients), {"qp_fallback_rounds": self.fallbacks}
        )

    def server_lr(self, t: int) -> float:
        """The server's step on the normalized direction: `server_lr`, or optim.lr_at(t)."""
        lr = self.hp.server_lr
        return self.optim.lr_at(t) if lr is None else lr
