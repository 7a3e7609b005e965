"""pFedMe (Dinh et al., NeurIPS 2020, "Personalized Federated Learning with Moreau
Envelopes", Algorithm 1; authors' code CharlieDinh/pFedMe; docs/papers/plgu.md).

Client i in round t: w_i <- w^t. For each of `local_rounds` R mini-batches b: theta,
warm-started from its value at the previous batch (w_i at the first), takes K (`inner_steps`)
steps of
  theta <- theta - lr_p (grad f_b(theta) + lambda (theta - w_i))   (approximately solving the
                                                                    Moreau envelope's argmin)
then w_i <- w_i - eta lambda (w_i - theta)
with eta the run's `optim.lr` (pFedMe's own plain steps: the run's momentum and weight
decay do not apply). `local_rounds: null` makes R the run's `local_epochs` passes over the
client's mini-batches instead (PFLlib's pFedMe, which the DiversiFed paper ran).
The client loop runs batched: one step function (`step`: a mini-batch's K inner steps and
the w update) over all sampled clients at once (`Engine.client_steps`; vmap, or client after
client on the sequential backend, as `Engine.backend_for` picks).
Server: w <- (1 - beta) w + beta sum_i (n_i / n) w_i (sample-weighted over the sampled
clients). lambda = 15, K = 5, R = 20, lr_p = 0.01, beta = 1.
`eval_model`: `theta` (default: the paper's personalized model, theta_i after the client's
last batch) or `local` (w_i: what the authors' code scores, since its "personalized" copy
aliases the model's parameters and it evaluates right after training, when they hold
w_i). PFLlib's pFedMe has the same alias but evaluates at the start of a round, after
`send_models` has written the global model into every client's model: it scores w, our
global model (DiversiFed Table I FMNIST, 500 rounds: theta 96.08, w_i 91.53, w 80.9; the
paper 96.23). Reports w as the global model; a client never sampled deploys w. Not a
reconstruction.
Uploads: each client's local model w_i (kind "model", ref = w^t).
Buffers: w_i's follow theta's forwards (its only forwards); averaged (weights >= 0) into w
with min(beta, 1) (a beta > 1 extrapolates parameters, never running variances); theta_i
keeps its own (kept local).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import hp, nonneg, positive
from fedbench.engine import ClientStep, StepBatch


@dataclass
class PFedMeParams:
    lam: float = nonneg()  # lambda of the Moreau envelope
    local_rounds: int | None = hp(ge=1)  # R mini-batches per visit; null: local_epochs passes
    inner_steps: int = hp(ge=1)  # K steps on theta per mini-batch
    personal_lr: float = positive()  # lr_p of the inner steps
    beta: float = nonneg()  # server mix w <- (1 - beta) w + beta avg(w_i)
    eval_model: Literal["theta", "local"]  # personalized model: theta_i | w_i


@ALGORITHMS.register()
class PFedMe(Algorithm):
    about = About(
        name="pFedMe",
        paper="Dinh et al., NeurIPS 2020",
        summary=(
            "Moreau-envelope personalization: K inner steps per batch "
            "(`algo.eval_model=theta|local`)"
        ),
        docs="papers/plgu.md#pfedme-pfedme",
        pfllib="pFedMe",
        fl_bench="pFedMe",
    )
    Params = PFedMeParams
    has_global = True
    attackable = True
    state_keys = ("w", "theta", "local", "seen")

    def setup(self) -> None:
        self.w = self.engine.initial_state()
        self.theta = self.w.repeat(self.N, 1)  # personalized models theta_i
        self.local = self.w.repeat(self.N, 1)  # local models w_i
        self.seen = torch.zeros(self.N, dtype=torch.bool, device=self.device)

    def step(self, t: int) -> ClientStep:
        """One mini-batch of the clients' loops in round t (`Engine.client_steps`): K inner
        steps on their theta rows, then the w update. Aux: the K inner losses [k, K]."""
        P, K = self.engine.n_params, self.hp.inner_steps
        lam, lr_p, eta = self.hp.lam, self.hp.personal_lr, self.optim.lr_at(t)

        scratch: list[torch.Tensor] = []  # one [k, P] difference, reused (no fresh pages)

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            theta, w = st["theta"], st["w"]  # [k, D]: theta warm-starts from the last batch
            k = theta.shape[0]
            if not scratch or scratch[0].shape[0] < k:
                scratch[:] = [theta.new_empty(k, P)]
            d = scratch[0][:k]
            losses = []
            for _ in range(K):
                loss, g = batch.grad(theta)  # updates theta's running statistics
                losses.append(loss)
                g.add_(torch.sub(theta[:, :P], w[:, :P], out=d), alpha=lam)
                theta[:, :P].sub_(g, alpha=lr_p)
            w[:, :P].sub_(torch.sub(w[:, :P], theta[:, :P], out=d), alpha=eta * lam)
            w[:, P:] = theta[:, P:]  # float buffers (BatchNorm statistics) follow the forward
            return st, torch.stack(losses, 1)

        return step

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        start = self.w.repeat(len(clients), 1)  # w_i <- w^t; theta_i starts there too
        res = self.engine.client_steps(
            {"theta": start, "w": start},
            [int(i) for i in clients],
            self.step(t),
            batch_size=self.run.batch_size,
            epochs=self.run.local_epochs,
            steps=self.hp.local_rounds,  # None: the schedule's local_epochs passes instead
            round=t,
        )
        idx = torch.as_tensor(clients, device=self.device)
        self.theta[idx] = res.states["theta"]
        self.local[idx] = res.states["w"]
        self.seen[idx] = True
        beta = self.hp.beta
        up = self.receive(self.local[idx], clients, ref=self.w)
        avg = self.weights(clients, "samples") @ up
        w, P = self.w.clone(), self.engine.n_params
        w[:P] = (1 - beta) * self.w[:P] + beta * avg[:P]
        b = min(beta, 1.0)  # buffers: a convex mix, even where beta > 1 extrapolates weights
        w[P:] = (1 - b) * self.w[P:] + b * avg[P:]
        self.w = w
        return RoundReport(res.client_mean().mean(), self.comm(clients))

    def personal_states(self) -> torch.Tensor:
        own = self.theta if self.hp.eval_model == "theta" else self.local
        return torch.where(self.seen[:, None], own, self.w)

    def personal_state(self, i: int) -> torch.Tensor:
        if not bool(self.seen[i]):
            return self.w
        return (self.theta if self.hp.eval_model == "theta" else self.local)[i]

    def global_state(self) -> torch.Tensor:
        return self.w
