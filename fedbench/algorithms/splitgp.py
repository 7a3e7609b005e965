"""SplitGP (Han, Kim, Choi, Brinton, Moon: "SplitGP: Achieving Both Generalization and
Personalization in Federated Learning", INFOCOM 2023, arXiv:2212.08343; docs/papers/fedpg.md).

The model is split: client k holds the body phi_k (`FedModel.body`) and a small auxiliary
classifier a_k (a copy of the head's shape); the server holds the rest, theta (the run model's
head). Client k's loss on a batch, z = phi_k(x):
    gamma CE(a_k(z), y) + (1 - gamma) CE(theta(z), y)
(both parts trained together, the server part on the activations the client sends). After the
round: theta <- sum_k (n_k / n) theta_k; phi_k <- gamma phi_k + (1 - gamma) mean_k(phi)
(the sample-weighted mean of the sampled bodies); a_k stays on the client.
The FedPG authors' group code uses the one gamma (0.2) both as the loss weight and as the
body-mixing weight, and evaluates a client's body with the global server part: so do we
(`eval_head: global`, default; `client`: the body with its auxiliary head).
RECONSTRUCTION: the auxiliary head starts as a copy of the server head.
Global model: the last mean body with theta.
Buffers: the body's mixed as the bodies are (weights gamma, 1 - gamma >= 0).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import (
    WithTrainer,
    base_columns,
    make_engine,
    state_entries,
    train_on,
)
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import fraction
from fedbench.errors import ConfigError


class SplitModel(nn.Module):
    """The run's body and head (server part) plus an auxiliary client head."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.body = base.body
        self.head = base.head
        self.aux = copy.deepcopy(base.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def split_loss(model: SplitModel, x, y, c, gamma: float) -> torch.Tensor:
    z = model.body(x)
    return gamma * F.cross_entropy(model.aux(z), y) + (1 - gamma) * F.cross_entropy(
        model.head(z), y
    )


@dataclass
class SplitGPParams:
    gamma: float = fraction()
    eval_head: Literal["global", "client"]


@ALGORITHMS.register()
class SplitGP(WithTrainer, Algorithm):
    about = About(
        name="SplitGP",
        paper="Han et al., 2023 (SplitGP)",
        summary=(
            "client body + small auxiliary head, server head; loss gamma CE(aux) + "
            "(1-gamma) CE(server); body mixed gamma own + (1-gamma) mean "
            "(`algo.eval_head=global|client`)"
        ),
        docs="papers/fedpg.md#splitgp-splitgp",
    )
    Params = SplitGPParams
    needs_head = True
    has_global = True
    attackable = True
    state_keys = ("g", "rows", "seen")

    def setup(self) -> None:
        base = self.model_fn()
        if not (hasattr(base, "body") and hasattr(base, "head")):
            raise ConfigError("splitgp needs a model with a body/head split (models.FedModel)")
        self.engine.to_module(self.engine.initial_state(), base)
        self.trainer = make_engine(self, SplitModel(base))
        spec, dev = self.trainer.spec, self.device
        self.cols = base_columns(spec, self.engine.spec, "", dev)  # body, head, buffers
        head = self.engine.spec.mask(base.head_params(), device=dev)  # [P]
        self.head = state_entries(head, self.engine.n_state)  # [D] the server part, base layout
        aux_names = [e.name for e in spec.params if e.name.startswith("aux.")]
        self.aux_cols = torch.cat(
            [torch.arange(spec.index[n].start, spec.index[n].stop) for n in aux_names]
        ).to(dev)
        self.g = self.engine.initial_state()  # [D] base layout: mean body + theta
        self.rows = self.trainer.initial_state().repeat(self.N, 1)  # [N, D']
        self.seen = torch.zeros(self.N, dtype=torch.bool, device=dev)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        gamma = self.hp.gamma
        start = self.rows[idx].clone()
        sb = start[:, self.cols]
        sb[:, self.head] = self.g[self.head]  # the current server part
        start[:, self.cols] = sb
        res = train_on(
            self, self.trainer, start, clients, t, objective=partial(split_loss, gamma=gamma)
        )
        states = res.states
        up = self.receive(states[:, self.cols], clients, ref=sb, kind="model")
        avg = self.weights(clients) @ up  # theta and the mean body (and buffers)
        own = states[:, self.cols]  # the client mixes its own body with the mean it gets
        mixed = torch.where(self.head, avg, gamma * own + (1 - gamma) * avg)
        states[:, self.cols] = mixed
        self.rows[idx] = states
        self.seen[idx] = True
        self.g = avg
        return RoundReport(res.loss.mean(), self.comm(clients))

    def personal_state(self, i: int) -> torch.Tensor:
        if not bool(self.seen[i]):
            return self.g
        row = self.rows[i]
        out = row[self.cols].clone()
        if self.hp.eval_head == "global":
            out[self.head] = self.g[self.head]
        else:
            out[self.head] = row[self.aux_cols]
        return out

    def personal_states(self) -> torch.Tensor:
        return torch.stack([self.personal_state(i) for i in range(self.N)])

    def global_state(self) -> torch.Tensor:
        return self.g
