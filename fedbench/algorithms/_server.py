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

with v starting at tau^2 (the paper's v_{-1} >= tau^2; `initial_accumulator`, FedAdagrad and
FedYogi, may give a larger start) and no bias correction (none in the paper's Algorithm 2):
`server_opt.variant: paper`, the default. `sgd` is server SGD with momentum, FedAvgM (Hsu et
al. 2019, the paper's baseline): v <- momentum v + Delta; x <- x + lr v. With momentum 0 it
is computed as lerp(x, avg, lr), which at lr 1 is avg to the bit: `server_opt=sgd
server_opt.lr=1 server_opt.momentum=0` is today's averaging exactly, as is `server_opt=none`
(the default).

RECONSTRUCTION (`variant: paper`): m starts at 0 (the paper initializes only v).

RECONSTRUCTION (`variant: authors_code`): what the authors' optimizers compute
(google-research/federated, utils/optimizers/optimizer_utils.py, which runs Keras's Adagrad
and Adam, and utils/optimizers/yogi.py; the Keras of their pinned TensorFlow 2.8,
optimization/requirements.txt). TFF hands the server optimizer the gradient g = -Delta; m is
linear in g and v depends on g^2, so with Delta the same steps read (t = the step count of
this vector, 1 at its first step; tau in the role their code gives it, the `epsilon` of
`--server_<opt>_epsilon`, optimization/README.md: "tau in Algorithm 2"):

    FedAdagrad  (Keras Adagrad, ResourceApplyAdagradV2; no m: beta1 must be 0)
        v <- v + Delta^2,  v from initial_accumulator
        x <- x + lr Delta / (sqrt(v) + tau)
    FedAdam     (Keras Adam, ResourceApplyAdam; v from 0)
        m <- beta1 m + (1 - beta1) Delta;  v <- beta2 v + (1 - beta2) Delta^2
        x <- x + lr_t m / (sqrt(v) + tau),  lr_t = lr sqrt(1 - beta2^t) / (1 - beta1^t)
    FedYogi     (yogi.py, sign activation, no l1/l2 term)
        m <- beta1 m + (1 - beta1) Delta;  v <- v + (1 - beta2) sign(Delta^2 - v) Delta^2,
        v from initial_accumulator
        x <- x + lr_t m / (sqrt(v) + tau),  lr_t as for Adam

tau is outside the square root in all three (epsilon-hat in Keras's Adam, the V2 Adagrad
kernel of TF 2.x's optimizer_v2; only Keras >= 2.11's new Adagrad puts it inside). The bias
correction sits in lr_t, so tau is not corrected with it (lr_t m / (sqrt(v) + tau) =
lr m_hat / (sqrt(v_hat) + tau / sqrt(1 - beta2^t))). Here `initial_accumulator: null` is
0: the authors' runs set `--server_adagrad_initial_accumulator_value=0` and
`--server_yogi_initial_accumulator_value=0` (optimization/README.md, their hyperparameters.md:
"we used initial accumulator values of 0"); the code's own defaults are Keras's 0.1
(Adagrad) and 1.0 (yogi.py), set them to get those. The authors ran beta1 0.9, beta2 0.999
(Keras's defaults; their hyperparameters.md); our YAMLs keep the paper's values, set them.
The step count t starts at 1, as Keras counts (t = iterations + 1) and as TFF's Keras
adapter leaves a new optimizer's step at 0; the 2020 trainer
(optimization/shared/fed_avg_schedule.py, `_initialize_optimizer_vars`) created the
variables with one apply_gradients of zeros, which moves neither x, m nor v but left
`iterations` at 1, so its round r corrected with t = r + 1: not reproduced. FedAvgM has no
variant: Keras's SGD (v <- momentum v + lr Delta; x <- x + v) is this v scaled by a constant
lr. Flower's FedAdam likewise bias-corrects its step, and its FedAdagrad has beta1 = 0.

Buffers (BatchNorm running statistics): not parameters; they take the average, as without a
server optimizer. The optimizer's state (m, v and, for the bias-corrected steps, t per
averaged vector) is checkpointed with the algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from fedbench.errors import ConfigError

ServerOptName = Literal["none", "sgd", "adagrad", "adam", "yogi"]
ServerOptVariant = Literal["paper", "authors_code"]


@dataclass(frozen=True)
class ServerOptSettings:
    """The run's `server_opt` node, typed (conf/server_opt/<name>.yaml); a cross-key fault
    raises ConfigError here (`load_config` builds one)."""

    name: ServerOptName = "none"
    lr: float = 1.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    variant: ServerOptVariant = "paper"
    initial_accumulator: float | None = None  # v's start; None: the variant's (v0)

    def __post_init__(self) -> None:
        if self.variant == "authors_code" and self.name == "adagrad" and self.beta1 != 0:
            raise ConfigError(
                f"server_opt.beta1={self.beta1}: variant authors_code runs Keras's Adagrad, "
                "which has no momentum; set server_opt.beta1=0"
            )
        v0 = self.initial_accumulator
        if self.variant == "authors_code" and self.name == "adam" and v0:
            raise ConfigError("variant authors_code runs Keras's Adam, whose v starts at 0")
        if self.variant == "paper" and v0 is not None and v0 < self.tau**2:
            raise ConfigError(
                f"server_opt.initial_accumulator={v0} must be >= tau^2 = {self.tau**2:g} "
                "under variant paper (Algorithm 2: v_-1 >= tau^2), or null"
            )

    @property
    def v0(self) -> float:
        """v's start: `initial_accumulator`, else tau^2 (Algorithm 2) or 0 (the authors'
        runs; Keras's Adam has no other)."""
        if self.initial_accumulator is not None:
            return self.initial_accumulator
        return self.tau**2 if self.variant == "paper" else 0.0

    @classmethod
    def from_cfg(cls, node) -> ServerOptSettings:
        if node is None:  # a config from before server optimizers: plain averaging
            return cls()
        keys = ("lr", "momentum", "beta1", "beta2", "tau")
        given: dict = {k: float(node[k]) for k in keys if k in node}
        if "variant" in node:  # absent in configs saved before it: paper
            given["variant"] = str(node["variant"])
        if node.get("initial_accumulator") is not None:
            given["initial_accumulator"] = float(node["initial_accumulator"])
        return cls(name=str(node["name"]), **given)  # type: ignore[arg-type]


class ServerOptimizer:
    """One per algorithm; `step(key, x, avg, params)` returns the server's new vector for
    the averaged vector named `key` (its m, v and step count t are kept under that name)."""

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
        if s.variant == "authors_code":
            new[params] = xp + self._authors_code_step(st, delta)
            return new
        m = st.get("m", torch.zeros_like(delta))
        v = st.get("v", torch.full_like(delta, s.v0))
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

    def _authors_code_step(self, st: dict[str, torch.Tensor], delta: torch.Tensor) -> torch.Tensor:
        """The authors' optimizers' move of x for the pseudo-gradient `delta` (module
        docstring), updating the vector's state `st` in place."""
        s = self.settings
        d2 = delta * delta
        v = st.get("v", torch.full_like(delta, s.v0))
        if s.name == "adagrad":  # Keras's Adagrad: no m, no step count
            st["v"] = v = v + d2
            return s.lr * delta / (v.sqrt() + s.tau)
        t = int(st["t"]) + 1 if "t" in st else 1
        m = s.beta1 * st.get("m", torch.zeros_like(delta)) + (1 - s.beta1) * delta
        if s.name == "adam":
            v = s.beta2 * v + (1 - s.beta2) * d2
        else:  # yogi.py: v moves toward Delta^2 by (1 - beta2) Delta^2
            v = v + (1 - s.beta2) * torch.sign(d2 - v) * d2
        st["m"], st["v"], st["t"] = m, v, torch.tensor(t, device=delta.device)
        lr_t = s.lr * math.sqrt(1 - s.beta2**t) / (1 - s.beta1**t)  # the bias correction
        return lr_t * m / (v.sqrt() + s.tau)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: dict(v) for k, v in self.state.items()}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.state = {k: {n: t.to(device) for n, t in v.items()} for k, v in state.items()}
