"""Ditto (Li et al., ICML 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization", Algorithm 1; authors' code litian96/ditto; docs/papers/plgu.md).

Global w by FedAvg local training (E epochs of the run's optimizer from w^t, sample-weighted
average). Personalized theta_i: `personal_epochs` epochs (default E) of the run's optimizer
on F_i(theta) + (lambda / 2) ||theta - w^t||^2 (eq. 2) each time client i is sampled.
lambda = 0.1 (FedSLR's setting; the Ditto authors' scripts use 1, PLGU gives none).
`interleave`: false (default) runs the global phase, then the personal one; true is the
authors' code: on each batch, one personal step, then one global step (then
`personal_epochs` must equal `local_epochs`), a step function over all sampled clients at
once (`interleaved_step`, `Engine.client_steps`: vmap, or client after client on the
sequential backend, as `Engine.backend_for` picks; optimizer state per client in the slots
"personal" and "main", as the two phases keep theirs).
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
from fedbench.engine import ClientStep, Optimized, Proximal, StepBatch
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

    def interleaved_step(self, t: int) -> ClientStep:
        """One batch of the authors' loop in round t (`Engine.client_steps`): one step of the
        run's optimizer on theta_i's F_b(theta) + (lambda / 2) ||theta - w^t||^2 (eq. 2),
        then one on w_i's F_b. Aux: the global copy's losses [k]."""
        prox = Proximal(self.w, self.lam)  # shared by all clients: w^t

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            theta, w = st["theta"], st["w"]
            _, g = batch.grad(theta, terms=[prox])
            batch.step("theta", g)
            loss, g = batch.grad(w)
            batch.step("w", g)
            return st, loss

        return step

    def interleaved(self, clients: list[int], t: int) -> tuple[torch.Tensor, ...]:
        """The authors' loop for the clients, all at once where the engine can:
        (theta_i [C, D], w_i [C, D], mean global loss of each [C])."""
        ids = torch.as_tensor(clients, device=self.device)
        lr = self.optim.lr_at(t)
        res = self.engine.client_steps(
            {"theta": self.theta[ids], "w": self.w.repeat(len(clients), 1)},
            clients,
            self.interleaved_step(t),
            batch_size=self.run.batch_size,
            epochs=self.run.local_epochs,
            round=t,
            optimized={
                "theta": Optimized(self.optim, lr, slot="personal"),
                "w": Optimized(self.optim, lr, slot="main"),
            },
        )
        out = res.states
        return out["theta"], out["w"], res.client_mean()

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        if self.hp.interleave:
            theta, local, loss = self.interleaved([int(i) for i in clients], t)
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
