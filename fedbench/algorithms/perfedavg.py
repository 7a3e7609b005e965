"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar: "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020), first-order version
(Per-FedAvg (FO)).

Client k starts from the global w and walks its E epochs of batches in pairs (D, D'):

    theta' = theta - alpha grad L_D(theta);   theta <- theta - beta grad L_D'(theta')

(the outer step is the run's optimizer at lr beta: exactly the equation with plain SGD; an
odd last batch of the stream is unused). The server averages the clients' theta (by
samples, `weighting`). The personalized model of every client is one SGD step of size
alpha from the new w on one of its training batches. Defaults alpha = 0.01, beta = 0.001
(FedSLR's appendix; docs/papers/fedslr.md).

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
from fedbench.algorithms._steps import grad_at
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, nonneg, positive
from fedbench.engine.optim import step_


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

    def __init__(self, cfg, fed, engine, model_fn, **kw) -> None:
        super().__init__(cfg, fed, engine, model_fn, **kw)
        self.w = engine.initial_state()
        self.theta = self.w.repeat(self.N, 1)  # personalized (one-step adapted) models

    def meta_train(self, i: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client i's first-order MAML steps from w; (its new state, mean outer loss)."""
        eng, P = self.engine, self.engine.n_params
        theta = self.w.clone()
        ost = eng.optim_states.get(self.optim, "outer", i, theta[:P])
        alpha, beta = self.hp.alpha, self.hp.beta * self.optim.lr_decay**t
        stream = eng.batches(i, self.run.batch_size, epochs=self.run.local_epochs, round=t)
        losses = []
        for (x1, y1), (x2, y2) in zip(stream, stream):  # consecutive pairs (D, D')
            _, g = grad_at(eng, theta, x1, y1)
            inner = theta.clone()
            inner[:P] -= alpha * g  # theta'
            loss, g = grad_at(eng, inner, x2, y2)
            losses.append(loss)
            theta[P:] = inner[P:]  # buffers as the two forwards left them
            with torch.no_grad():
                step_(self.optim, theta[:P], g, ost, beta)
        eng.optim_states.keep(self.optim, "outer", i, ost)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        return theta, loss

    def personalize(self, t: int) -> torch.Tensor:
        """[N, D]: one SGD step of size alpha from w on one training batch per client."""
        eng, P = self.engine, self.engine.n_params
        out = self.w.repeat(self.N, 1)
        for i in range(self.N):
            for x, y in eng.batches(i, self.run.batch_size, steps=1, round=t, salt=PERSONAL_SALT):
                _, g = grad_at(eng, out[i], x, y)  # updates out[i]'s running statistics
                out[i, :P] -= self.hp.alpha * g
        return out

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        states, losses = zip(*(self.meta_train(int(i), t) for i in clients))
        up = self.receive(torch.stack(states), clients, ref=self.w)
        self.w = self.server_step("w", self.w, self.weights(clients, self.hp.weighting) @ up)
        self.theta = self.personalize(t)
        return RoundReport(torch.stack(losses).mean(), self.comm(clients))

    def global_state(self) -> torch.Tensor:
        return self.w
