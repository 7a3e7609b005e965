"""Ditto (Li et al., ICML 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization", Algorithm 1; authors' code litian96/ditto; docs/papers/plgu.md).

Global w by FedAvg local training (E epochs of the run's optimizer from w^t, sample-weighted
average). Personalized theta_i: `personal_epochs` epochs (default E) of the run's optimizer
on F_i(theta) + (lambda / 2) ||theta - w^t||^2 (eq. 2) each time client i is sampled.
lambda = 0.1 (FedSLR's setting; the Ditto authors' scripts use 1, PLGU gives none).
`interleave`: false (default) runs the global phase, then the personal one; true is the
authors' code: on each batch, one personal step, then one global step (then
`personal_epochs` must equal `local_epochs`).
Reports w and theta_i; a client never sampled deploys w. Not a reconstruction.
Uploads: each client's trained global copy w_i (kind "model", ref = w^t); theta_i stays home.
Buffers: w's averaged (weights >= 0) with its parameters; theta_i keeps its own (kept local).
Every step, interleaved ones included, runs in training mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport, TrainedOrGlobal
from fedbench.algorithms.params import Weighting, hp, nonneg
from fedbench.engine import Proximal
from fedbench.engine.optim import step_
from fedbench.errors import ConfigError


@dataclass
class DittoParams:
    lam: float = nonneg()  # lambda of (lambda / 2) ||theta - w||^2, >= 0
    personal_epochs: int = hp(ge=1)  # epochs on theta_i per visit
    interleave: bool  # one personal + one global step per batch (the authors' code)
    weighting: Weighting  # server average: samples | uniform


@ALGORITHMS.register()
class Ditto(TrainedOrGlobal, Algorithm):
    about = About(
        name="Ditto",
        paper="Li et al., ICML 2021",
        summary="FedAvg global model + personal models with a proximal pull (lambda 0.1)",
        docs="papers/plgu.md#ditto-ditto",
        pfllib="Ditto",
        fl_bench="Ditto",
    )
    Params = DittoParams
    attackable = True
    server_optimizable = True  # server_opt steps on the average
    state_keys = ("w", "theta", "seen")

    def setup(self) -> None:
        self.lam = self.hp.lam
        self.personal_epochs = self.hp.personal_epochs or self.run.local_epochs
        if self.hp.interleave and self.personal_epochs != self.run.local_epochs:
            raise ConfigError(
                f"ditto.interleave=true takes one personal and one global step per batch: "
                f"algo.personal_epochs={self.personal_epochs} must equal "
                f"local_epochs={self.run.local_epochs}"
            )
        self.w = self.engine.initial_state()
        self.init_rows()

    def interleaved(self, i: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The authors' loop for client i: (theta_i, w_i, mean global loss)."""
        eng, P, lr = self.engine, self.engine.n_params, self.optim.lr_at(t)
        theta, w = self.theta[i].clone(), self.w.clone()
        prox = Proximal(self.w, self.lam)
        st_p = eng.optim_states.get(self.optim, "personal", i, theta[:P])
        st_g = eng.optim_states.get(self.optim, "main", i, w[:P])
        losses = []
        for x, y in eng.batches(i, self.run.batch_size, epochs=self.run.local_epochs, round=t):
            _, g = eng.grad_at(theta, x, y, terms=[prox], rows=[prox.rows(0)])
            step_(self.optim, theta[:P], g, st_p, lr)
            loss, g = eng.grad_at(w, x, y)
            losses.append(loss)
            step_(self.optim, w[:P], g, st_g, lr)
        eng.optim_states.keep(self.optim, "personal", i, st_p)
        eng.optim_states.keep(self.optim, "main", i, st_g)
        return theta, w, torch.stack(losses).mean()

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        if self.hp.interleave:
            thetas, ws, losses = zip(*(self.interleaved(int(i), t) for i in clients))
            theta, local, loss = torch.stack(thetas), torch.stack(ws), torch.stack(losses)
        else:
            glob = self.local_train(self.w, clients, t)
            pers = self.local_train(
                self.theta[idx],
                clients,
                t,
                epochs=self.personal_epochs,
                terms=[Proximal(self.w, self.lam)],
                salt=1,
                slot="personal",
            )
            theta, local, loss = pers.states, glob.states, glob.loss
        self.set_trained(idx, theta)
        up = self.receive(local, clients, ref=self.w)
        self.w = self.server_step("w", self.w, self.weights(clients, self.hp.weighting) @ up)
        return RoundReport(loss.mean(), self.comm(clients))
