"""Server optimizers for the algorithms whose server averages uploads into one model
(`server_opt=<name>`, conf/server_opt/): the average is not taken as the new model but as a
pseudo-gradient step, written once here.

With x the server's model and avg the (weighted) average of the clients' uploads, Reddi et
al. ("Adaptive Federated Optimization", ICLR 2021, arXiv:2003.00295, Algorithm 2) take
Delta = avg - x and, elementwise,

    m <- beta1 m + (1 - beta1) Delta
    v <- v + Delta^2                                   FedAdagrad
    v <- beta2 v + (1 - beta2) Delta^2                 FedAdam
    v <- v - (1 - beta2) Delta^2 sign(v - Delta^2)     FedYogi
    x <- x + lr m / (sqrt(v) + tau)

with v starting at tau^2 (the paper's v_{-1} >= tau^2) and no bias correction (none in the
paper's Algorithm 2). `sgd` is server SGD with momentum, FedAvgM (Hsu et al. 2019, the
paper's baseline): v <- momentum v + Delta; x <- x + lr v. With momentum 0 it is computed
as lerp(x, avg, lr), which at lr 1 is avg to the bit: `server_opt=sgd server_opt.lr=1
server_opt.momentum=0` is today's averaging exactly, as is `server_opt=none` (the default).

RECONSTRUCTION: m starts at 0 (the paper initializes only v). The authors' code
(google-research/federated, utils/optimizers/optimizer_utils.py) runs Keras's Adam (v from 0,
a bias-corrected step), Keras's Adagrad (no m) and its own Yogi (utils/optimizers/yogi.py: a
bias-corrected step, v from `initial_accumulator_value`); Flower's FedAdam bias-corrects its
step and its FedAdagrad has beta1 = 0, both with v from 0. Here: Algorithm 2 as written.
Buffers (BatchNorm running statistics): not parameters; they take the average, as without a
server optimizer. The optimizer's state (m, v per averaged vector) is checkpointed with the
algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ServerOptName = Literal["none", "sgd", "adagrad", "adam", "yogi"]


@dataclass(frozen=True)
class ServerOptSettings:
    """The run's `server_opt` node, typed (conf/server_opt/<name>.yaml)."""

    name: ServerOptName = "none"
    lr: float = 1.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    @classmethod
    def from_cfg(cls, node) -> ServerOptSettings:
        if node is None:  # a config from before server optimizers: plain averaging
            return cls()
        keys = ("lr", "momentum", "beta1", "beta2", "tau")
        given = {k: float(node[k]) for k in keys if k in node}
        return cls(name=str(node["name"]), **given)  # type: ignore[arg-type]


class ServerOptimizer:
    """One per algorithm; `step(key, x, avg, params)` returns the server's new vector for
    the averaged vector named `key` (its m and v are kept under that name)."""

    def __init__(self, settings: ServerOptSettings) -> None:
        self.settings = settings
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        return self.settings.name != "none"

    def step(
        self, key: str, x: torch.Tensor, avg: torch.Tensor, params: torch.Tensor | slice
    ) -> torch.Tensor:
        """The new value of `x` given the clients' average `avg` (same shape): the entries
        `params` (a bool mask or a slice of x: its parameters) take the optimizer's step,
        the others (buffers) take `avg`."""
        s = self.settings
        if s.name == "none":
            return avg
        new = avg.clone()
        xp, ap = x[params], avg[params]
        if s.name == "sgd" and s.momentum == 0:
            new[params] = torch.lerp(xp, ap, s.lr)  # x + lr (avg - x); avg itself at lr 1
            return new
        delta = ap - xp
        st = self.state.setdefault(key, {})
        if s.name == "sgd":
            v = st.get("v", torch.zeros_like(delta))
            st["v"] = v = s.momentum * v + delta
            new[params] = xp + s.lr * v
            return new
        m = st.get("m", torch.zeros_like(delta))
        v = st.get("v", torch.full_like(delta, s.tau**2))
        m = s.beta1 * m + (1 - s.beta1) * delta
        d2 = delta * delta
        if s.name == "adagrad":
            v = v + d2
        elif s.name == "adam":
            v = s.beta2 * v + (1 - s.beta2) * d2
        else:  # yogi
            v = v - (1 - s.beta2) * d2 * torch.sign(v - d2)
        st["m"], st["v"] = m, v
        new[params] = xp + s.lr * m / (v.sqrt() + s.tau)
        return new

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: dict(v) for k, v in self.state.items()}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.state = {k: {n: t.to(device) for n, t in v.items()} for k, v in state.items()}
