"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar: "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020), first-order version
(Per-FedAvg (FO)).

Client k starts from the global w and walks its E epochs of batches in pairs (D, D'):

    theta' = theta - alpha grad L_D(theta);   theta <- theta - beta grad L_D'(theta')

(the outer step is the run's optimizer at lr beta: exactly the equation with plain SGD; an
odd last batch of the stream is unused). The server averages the clients' theta (by
samples, `weighting`). The personalized model of every client is one SGD step of size
alpha from the new w on one of its training batches. Defaults alpha = 0.01, beta = 0.001
(FedSLR's appendix; docs/papers/fedslr.md). Both loops run batched: a step function over
all clients at once (`Engine.client_steps`; vmap, or client after client on the sequential
backend, as `Engine.backend_for` picks).

Buffers: averaged (weights >= 0): the server's sample-weighted mean of the clients' states,
running statistics included; the personalization step's forward updates them (train mode).
Uploads: the meta-trained theta, through `Algorithm.receive` (ref = the global w).

Not copied from the pFedMe repository's Per-FedAvg (which the DiversiFed paper ran): its
evaluation-time step uses the client's test batches; here it uses a training batch.
RECONSTRUCTION: D and D' are consecutive batches of the client's E-epoch stream (PFLlib
halves one double-size batch); the personalization batch comes from its own seeded stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, nonneg, positive
from fedbench.engine import ClientStep, Optimized, StepBatch


@dataclass
class PerFedAvgParams:
    alpha: float = nonneg()  # inner (adaptation) step size
    beta: float = positive()  # outer (meta) step size, the run optimizer's lr
    weighting: Weighting  # server average: samples | uniform


PERSONAL_SALT = 1  # the personalization step's batch stream, apart from training's


@ALGORITHMS.register()
class PerFedAvg(Algorithm):
    about = About(
        name="Per-FedAvg",
        paper="Fallah et al., NeurIPS 2020",
        summary="first-order MAML FedAvg; personal model = one SGD step from the global model",
        docs="papers/fedslr.md#per-fedavg-perfedavg",
        pfllib="Per-FedAvg",
        fl_bench="Per-FedAvg",
    )
    personal_rows = "theta"
    Params = PerFedAvgParams
    attackable = True
    server_optimizable = True  # server_opt steps on the average
    has_global = True
    state_keys = ("w", "theta")

    def setup(self) -> None:
        self.w = self.engine.initial_state()
        self.theta = self.w.repeat(self.N, 1)  # personalized (one-step adapted) models

    def meta_step(self, t: int) -> ClientStep:
        """One batch of the clients' first-order MAML loops in round t (`Engine.client_steps`).

        Even steps (D): theta' = theta - alpha grad L_D(theta), in the `inner` rows (a copy of
        theta, so an unpaired last batch leaves theta as it is). Odd steps (D'): the outer
        step of the run's optimizer (`outer`) with grad L_D'(theta'); theta's buffers as the
        two forwards left them. Aux: the outer losses [k] (zeros at even steps)."""
        P, alpha = self.engine.n_params, self.hp.alpha

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            theta, inner = st["theta"], st["inner"]
            if batch.index % 2 == 0:
                inner.copy_(theta)
                _, g = batch.grad(inner)
                inner[:, :P] -= alpha * g  # theta'
                return st, torch.zeros(theta.shape[0], device=theta.device)
            loss, g = batch.grad(inner)
            theta[:, P:] = inner[:, P:]  # buffers as the two forwards left them
            batch.step("theta", g)
            return st, loss

        return step

    def meta_train(self, clients: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The clients' first-order MAML steps from w; (their new states [C, D], mean outer
        loss of each [C]), all clients at once where the engine can (`Engine.client_steps`)."""
        start = self.w.repeat(len(clients), 1)
        beta = self.hp.beta * self.optim.lr_decay**t
        res = self.engine.client_steps(
            {"theta": start, "inner": start},
            clients,
            self.meta_step(t),
            batch_size=self.run.batch_size,
            epochs=self.run.local_epochs,
            round=t,
            optimized={"theta": Optimized(self.optim, beta, slot="outer")},
        )
        losses = torch.zeros(len(clients), device=self.device)
        for c, n in enumerate(res.steps):
            if n >= 2:  # the outer losses of its (D, D') pairs, in order
                losses[c] = res.aux[1 : n - n % 2 : 2, c].reshape(-1).mean()
        return res.states["theta"], losses

    def personalize(self, t: int) -> torch.Tensor:
        """[N, D]: one SGD step of size alpha from w on one training batch per client."""
        P, alpha = self.engine.n_params, self.hp.alpha

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            _, g = batch.grad(st["s"])  # updates the state's running statistics
            st["s"][:, :P] -= alpha * g
            return st, None

        res = self.engine.client_steps(
            {"s": self.w.repeat(self.N, 1)},
            range(self.N),
            step,
            batch_size=self.run.batch_size,
            steps=1,
            round=t,
            salt=PERSONAL_SALT,
        )
        return res.states["s"]

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        states, losses = self.meta_train([int(i) for i in clients], t)
        up = self.receive(states, clients, ref=self.w)
        self.w = self.server_step("w", self.w, self.weights(clients, self.hp.weighting) @ up)
        self.theta = self.personalize(t)
        return RoundReport(losses.mean(), self.comm(clients))

    def global_state(self) -> torch.Tensor:
        return self.w
