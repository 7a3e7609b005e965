"""SCAFFOLD (Karimireddy et al., ICML 2020, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", Algorithm 1, option II; docs/papers/fedslr.md).

Server state x and control variate c; client i's control variate c_i (zeros at start).
Round t, each sampled client from y = x, K steps (E epochs) of the run's optimizer with
the corrected gradient (eq. 3)
    y <- y - eta (grad f_b(y) - c_i + c)                 (`terms.correction`: <c - c_i, y>)
then option II (eq. 4): c_i+ = c_i - c + (x - y) / (K eta); uploads Delta y = y - x and
Delta c = c_i+ - c_i. Server (Algorithm 1, lines 16-17), uniform means over S_t:
    x <- x + eta_g mean(Delta y),   c <- c + (|S| / N) mean(Delta c).
eta_g = `global_lr` = 1. eta: the round's lr (K counts the client's own steps).
Option II reads (x - y) / (K eta) as the client's mean gradient, which holds for SGD steps
(with or without momentum) but not for Adam's normalized steps (there it is ~1 per entry
whatever the gradient, and the correction swamps the gradient: chance accuracy on FMNIST),
so `optim.name=adam` is refused.
Reports the global model x (a global method: no personal rows are kept).
Communication: x and c down, Delta y and Delta c up (twice FedAvg's, FedSLR Table 2).
Buffers: averaged (weights >= 0): the new x's buffers are the mean of the clients'.
Per-client c_i ([N, P]) and c are in `state_keys` (checkpoints). Not a reconstruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import positive
from fedbench.engine.terms import correction
from fedbench.errors import ConfigError


@dataclass
class ScaffoldParams:
    global_lr: float = positive()


@ALGORITHMS.register()
class Scaffold(Algorithm):
    about = About(
        name="SCAFFOLD",
        paper="Karimireddy et al., ICML 2020",
        summary="control variates (option II) correct each local step by c - c_i",
        docs="papers/fedslr.md#scaffold-scaffold",
        pfllib="SCAFFOLD",
        fl_bench="SCAFFOLD",
    )
    Params = ScaffoldParams
    has_personal = False
    has_global = True
    attackable = True
    state_keys = ("x", "c", "c_i")

    def setup(self) -> None:
        if self.optim.name != "sgd":
            raise ConfigError(
                f"scaffold: option II control variates (x - y) / (K lr) assume SGD steps; "
                f"optim.name={self.optim.name} is not supported (use optim.name=sgd)"
            )
        P = self.engine.n_params
        self.x = self.engine.initial_state()  # [D] server model
        self.c = torch.zeros(P, device=self.device)  # [P] server control variate
        self.c_i = self.client_rows("c_i", torch.zeros(P))  # [N, P] clients' control variates

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        P = self.engine.n_params
        ci = self.c_i[idx]
        res = self.local_train(self.x, clients, t, terms=[correction(ci, self.c)])
        lr = self.optim.lr_at(t)
        k = torch.tensor(res.steps, dtype=ci.dtype, device=self.device).clamp_min(1)[:, None]
        ci_new = ci - self.c + (self.x[:P] - res.states[:, :P]) / (k * lr)  # option II
        self.c_i[idx] = ci_new  # client side
        y = self.receive(res.states, clients, ref=self.x)
        dc = self.receive(ci_new - ci, clients, kind="other")
        new = y.mean(0)  # buffers: the clients' mean
        new[:P] = self.x[:P] + self.hp.global_lr * (y[:, :P] - self.x[:P]).mean(0)
        self.x = new
        self.c = self.c + (len(clients) / self.N) * dc.mean(0)
        D, C = self.engine.n_state, len(clients)
        return RoundReport(res.loss.mean(), self.comm(clients, up=C * (D + P), down=C * (D + P)))

    def global_state(self) -> torch.Tensor:
        return self.x
