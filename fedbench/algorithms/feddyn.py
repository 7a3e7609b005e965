"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic Regularization",
Algorithm 1; specs/fedslr.md "Baselines").

Round t, each sampled client i, from the server model theta^t, E epochs of the run's
optimizer on the local problem (Algorithm 1, line 6)
    f_i(x) - <g_i, x> + (alpha / 2) ||x - theta^t||^2           (`terms.dynamic`)
then its first-order state g_i <- g_i - alpha (x_i - theta^t) (line 7). Server (lines 9-10),
with only the running h = (1/N) sum_i g_i (all N clients, sampled or not):
    h <- h - (alpha / N) sum_{i in S_t} (x_i - theta^t)
    theta^{t+1} = mean_{i in S_t} x_i - h / alpha.
alpha = 0.1 (FedSLR's setting, its authors' `alpha_coef`). The run's weight decay (FedSLR's
presets: 1e-3) is the optimizer's, as the authors' code. Uniform means, as the paper.
Reports the global model theta (a global method: no personal rows are kept).
Buffers: averaged (weights >= 0); the correction -h / alpha acts on parameters only.
Per-client state g_i ([N, P]) and h are in `state_keys` (checkpoints).
Not a reconstruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms.base import ALGORITHMS, Algorithm
from fedbench.algorithms.params import positive
from fedbench.engine.terms import dynamic


@dataclass
class FedDynParams:
    alpha: float = positive()


@ALGORITHMS.register("feddyn")
class FedDyn(Algorithm):
    name = "feddyn"
    Params = FedDynParams
    has_personal = False
    has_global = True
    attackable = True
    state_keys = ("theta", "lam", "h")

    def __init__(self, cfg, fed, engine, model_fn) -> None:
        super().__init__(cfg, fed, engine, model_fn)
        self.alpha = float(self.hp.alpha)
        P = engine.n_params
        self.theta = engine.initial_state()  # [D] the server model
        self.lam = torch.zeros(self.N, P, device=self.device)  # [N, P] clients' g_i / lambda_i
        self.h = torch.zeros(P, device=self.device)  # [P] (1/N) sum_i lambda_i

    # ------------------------------------------------------------------ Phase I pieces
    def local_phase(self, t: int, clients: np.ndarray):
        """The clients' local problems from theta^t; updates their lambda_i and returns
        (the server's uploads x_i [C, D], the train result)."""
        idx = torch.as_tensor(clients, device=self.device)
        P = self.engine.n_params
        lam = self.lam[idx]
        res = self.local_train(self.theta, clients, t, terms=dynamic(lam, self.theta, self.alpha))
        self.lam[idx] = lam - self.alpha * (res.states[:, :P] - self.theta[:P])  # client side
        x = self.receive(res.states, clients, ref=self.theta)
        return x, res

    def server_average(self, x: torch.Tensor) -> torch.Tensor:
        """Memory-efficient server (FedDyn Alg. 1 lines 9-10; FedSLR Alg. 3): update h from
        the uploads, return z = mean x_i - h / alpha."""
        P = self.engine.n_params
        self.h = self.h - (self.alpha / self.N) * (x[:, :P] - self.theta[:P]).sum(0)
        z = x.mean(0)
        z[:P] -= self.h / self.alpha
        return z

    # ------------------------------------------------------------------ the contract
    def round(self, t: int, clients: np.ndarray) -> dict:
        x, res = self.local_phase(t, clients)
        self.theta = self.server_average(x)
        return {"train_loss": res.loss.mean(), **self.comm(clients)}

    def global_state(self) -> torch.Tensor:
        return self.theta
