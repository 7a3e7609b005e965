"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez: "Personalized Federated Learning with First
Order Model Optimization", ICLR 2021).

Each client holds out `val_frac` (20%) of its training data. At the start of a round,
sampled client i receives the M models theta_n of the online clients with the highest
affinity P_in (`m: null` = every online model), and weighs each by the first-order
approximation of its benefit on the validation set (its eq. 5):

    w_n = (L_val(theta_i) - L_val(theta_n)) / (||theta_n - theta_i|| + 1e-5).

Negative weights are clipped to 0 and the rest normalized; the client's start model is
sum_n w_n theta_n (eq. 6: theta_i + sum_n w_n (theta_n - theta_i) with sum w_n = 1), or
its own theta_i when no weight is positive. It then trains E epochs on the other 80% of
its data and uploads theta_i. The server adds the raw weights to its affinity matrix,
P_in += w_n, so the next round's top M follow the clients that helped. The personalized
model is theta_i.

Defaults: M = 5, val_frac = 0.2 (PFLlib, which the DiversiFed paper ran); the FedPG authors
send every online model (`m: null`).

Buffers: averaged (weights >= 0): the start model sum_n w_n theta_n is over whole states,
running statistics included, with the clipped, normalized weights of eq. 6.
Uploads: the trained theta_i, through `Algorithm.receive` (ref = the start model it
trained from).

Not copied from PFLlib: its "own model" in eq. 5 is the model the client started its
previous round from (it clones the mixed model before training), not its trained theta_i.
RECONSTRUCTION: "online" = the clients that uploaded in the previous round (PFLlib); the
client itself is not a candidate (its weight would be 0 by definition); affinity ties are
broken by a seeded random order; the validation split is a seeded random 20% per client.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import TrainSubset, WithTrainer, make_engine, train_on
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import hp


@dataclass
class FedFomoParams:
    m: int | None = hp(ge=1)  # models sent to each client (null: every online model)
    val_frac: float = hp(gt=0, lt=1)  # fraction of each client's data held out


@ALGORITHMS.register()
class FedFomo(WithTrainer, Algorithm):
    about = About(
        name="FedFomo",
        paper="Zhang et al., ICLR 2021",
        summary=(
            "client mixes the top-M received models by first-order weights "
            "(validation-loss gain / distance), then trains"
        ),
        docs="papers/fedpg.md#fedfomo-fedfomo",
        pfllib="FedFomo",
        fl_bench="FedFomo",
    )
    personal_rows = "theta"
    Params = FedFomoParams
    attackable = True
    state_keys = ("theta", "P", "online")

    def setup(self) -> None:
        frac = self.hp.val_frac
        rng = np.random.default_rng([self.run.seed, 31])
        self.val_idx, train_idx = [], []
        for pool in self.fed.train_idx:
            perm = torch.as_tensor(rng.permutation(len(pool)), device=pool.device)
            n_val = max(1, int(frac * len(pool)))
            self.val_idx.append(pool[perm[:n_val]])
            train_idx.append(pool[perm[n_val:]])
        self.trainer = make_engine(self, self.model_fn(), TrainSubset(self.fed, train_idx))
        self.theta = self.engine.initial_state().repeat(self.N, 1)
        self.P = torch.eye(self.N, device=self.device)  # affinity P_in
        self.online = torch.zeros(0, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ server
    def candidates(self, i: int, t: int) -> torch.Tensor:
        """The online clients (not i) that client i receives: top M by affinity."""
        cand = self.online[self.online != i]
        order = np.random.default_rng([self.run.seed, t, i, 37]).permutation(len(cand))
        cand = cand[torch.as_tensor(order, device=self.device)]
        cand = cand[torch.argsort(self.P[i, cand], descending=True, stable=True)]
        return cand if self.hp.m is None else cand[: self.hp.m]

    # ------------------------------------------------------------------ client
    @torch.no_grad()
    def val_loss(self, i: int, states: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of each state [K, D] on client i's validation set."""
        x, y = self.fed.batch(self.val_idx[i], train=False)
        return torch.stack([F.cross_entropy(self.engine.logits(s, x), y) for s in states])

    def first_order_weights(self, i: int, cand: torch.Tensor) -> torch.Tensor:
        """w_n (eq. 5) for the candidates, unclipped."""
        P = self.engine.n_params
        own, theirs = self.theta[i], self.theta[cand]
        losses = self.val_loss(i, torch.cat([own[None], theirs]))
        dist = (theirs[:, :P] - own[:P]).norm(dim=1)
        return (losses[0] - losses[1:]) / (dist + 1e-5)

    def start_model(self, i: int, cand: torch.Tensor) -> torch.Tensor:
        """Client i's model after aggregating the candidates (eq. 6); updates P row i."""
        if cand.numel() == 0:
            return self.theta[i]
        w = self.first_order_weights(i, cand)
        self.P[i, cand] += w
        w = w.clamp_min(0)
        if w.sum() <= 0:
            return self.theta[i]
        return (w / w.sum()) @ self.theta[cand]

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        cands = [self.candidates(int(i), t) for i in clients]
        start = torch.stack([self.start_model(int(i), c) for i, c in zip(clients, cands)])
        res = train_on(self, self.trainer, start, clients, t)
        self.theta[idx] = self.receive(res.states, clients, ref=start)
        self.online = idx
        down = self.engine.n_state * sum(len(c) for c in cands)
        return RoundReport(res.loss.mean(), self.comm(clients, down=down))
