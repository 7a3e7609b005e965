"""APFL (Deng, Kamani, Mahdavi: "Adaptive Personalized Federated Learning", 2020, Algorithm 1;
docs/papers/fedpg.md).

Each client keeps a personal model v_i and a mixing weight alpha_i; its personalized model is
theta_i = alpha_i v_i + (1 - alpha_i) w_i. Per local step on a batch (all at the same point):
    w_i     <- w_i - eta grad F_i(w_i)                               (local copy of the global)
    v_i     <- v_i - eta grad_v F_i(alpha_i v_i + (1 - alpha_i) w_i) = ... alpha_i grad F_i(theta_i)
    alpha_i <- alpha_i - eta (v_i - w_i) . grad F_i(theta_i)          (`adaptive: true`, eq. 10)
The server averages the clients' w_i (weights n_i / n). `adaptive: false` keeps alpha fixed.
One optimizer step on CE(w(x)) + CE(theta(x)) with w detached inside theta gives exactly these
three gradients (the module `APFLModel`, trained by its own engine, sequential backend).
RECONSTRUCTION: alpha is projected onto [0, 1] inside each step's forward (the clamp's value
with alpha's own gradient passed through) and in the state at the end of the round, where
PFLlib clips after every step.
Defaults: alpha 0.5 fixed (spec); the FedPG authors start at 0.1 and adapt it (FedPG presets).

Personalized model: alpha_i v_i + (1 - alpha_i) w_i with the client's w_i after its last
local training; a client never sampled deploys w. Global model: w.
Buffers: w's averaged (weights >= 0) with w (updated by w's forwards); v's kept local, updated
by theta's forwards, and the personalized model theta_i uses them (its own statistics).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import WithTrainer, base_columns, make_engine, train_on
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import fraction


class APFLModel(nn.Module):
    """w (the run's model, the local copy of the global), v (a personal copy), alpha."""

    def __init__(self, base: nn.Module, alpha: float) -> None:
        super().__init__()
        self.w = base
        self.v = copy.deepcopy(base)
        self.alpha = nn.Parameter(torch.tensor([float(alpha)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)


def apfl_loss(model: APFLModel, x, y, c, adaptive: bool) -> torch.Tensor:
    """CE of w + CE of theta = alpha v + (1 - alpha) w.detach() (alpha detached if fixed);
    theta's forward uses (and in training mode updates) v's buffers."""
    a = model.alpha
    a = a + (a.clamp(0.0, 1.0) - a).detach()
    if not adaptive:
        a = a.detach()
    mixed = {
        n: a * pv + (1 - a) * pw.detach()
        for (n, pw), (_, pv) in zip(model.w.named_parameters(), model.v.named_parameters())
    }
    # theta's forward runs on v's buffers (BatchNorm statistics update v's in place, not w's)
    mixed.update(dict(model.v.named_buffers()))
    return F.cross_entropy(model.w(x), y) + F.cross_entropy(
        functional_call(model.w, mixed, (x,)), y
    )


@dataclass
class APFLParams:
    alpha: float = fraction()
    adaptive: bool


@ALGORITHMS.register()
class APFL(WithTrainer, Algorithm):
    about = About(
        name="APFL",
        paper="Deng et al., 2020",
        summary=(
            "personalized model a v_i + (1-a) w_i; w by FedAvg; a fixed or adaptive "
            "(`algo.adaptive`)"
        ),
        docs="papers/fedpg.md#apfl-apfl",
        pfllib="APFL",
        fl_bench="APFL",
    )
    Params = APFLParams
    has_global = True
    attackable = True
    state_keys = ("w", "rows", "seen")

    def setup(self) -> None:
        base = self.model_fn()
        self.engine.to_module(self.engine.initial_state(), base)
        self.trainer = make_engine(self, APFLModel(base, self.hp.alpha))
        spec, dev = self.trainer.spec, self.device
        self.wcols = base_columns(spec, self.engine.spec, "w.", dev)
        self.vcols = base_columns(spec, self.engine.spec, "v.", dev)
        self.acol = spec.index["alpha"].start
        self.trainable = None
        if not self.hp.adaptive:
            self.trainable = torch.ones(spec.n_params, dtype=torch.bool, device=dev)
            self.trainable[self.acol] = False
        self.w = self.engine.initial_state()
        self.rows = self.trainer.initial_state().repeat(self.N, 1)  # [N, D']: w_i, v_i, alpha_i
        self.seen = torch.zeros(self.N, dtype=torch.bool, device=dev)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        start = self.rows[idx].clone()
        start[:, self.wcols] = self.w
        loss = partial(apfl_loss, adaptive=self.hp.adaptive)
        res = train_on(
            self, self.trainer, start, clients, t, objective=loss, trainable=self.trainable
        )
        states = res.states
        states[:, self.acol] = states[:, self.acol].clamp(0.0, 1.0)
        local = self.receive(states[:, self.wcols], clients, ref=self.w, kind="model")
        states[:, self.wcols] = local
        self.rows[idx] = states
        self.seen[idx] = True
        self.w = self.weights(clients) @ local
        alpha_mean = float(self.rows[self.seen, self.acol].mean())
        return RoundReport(res.loss.mean(), self.comm(clients), {"alpha_mean": alpha_mean})

    def personal_state(self, i: int) -> torch.Tensor:
        if not bool(self.seen[i]):
            return self.w
        row = self.rows[i]
        P = self.engine.n_params
        a = row[self.acol]
        out = row[self.vcols].clone()  # v_i's buffers: the statistics of theta's forwards
        out[:P] = a * out[:P] + (1 - a) * row[self.wcols[:P]]
        return out

    def personal_states(self) -> torch.Tensor:
        return torch.stack([self.personal_state(i) for i in range(self.N)])

    def model_size(self) -> dict[str, float]:
        """A client deploys v_i and w (theta_i = alpha v_i + (1 - alpha) w_i needs both): 2P,
        FedSLR Table 2's APFL count (22.35M for ResNet-18)."""
        out = super().model_size()
        out["params_personal"] = 2 * self.engine.n_params
        return out

    def global_state(self) -> torch.Tensor:
        return self.w
