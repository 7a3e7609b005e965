"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic Regularization",
Algorithm 1; docs/papers/fedslr.md).

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
The client step and the server mean are `_shared.dynamic_clients` / `dynamic_server`, which
FedSLR's Phase I calls too.
Not a reconstruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import dynamic_clients, dynamic_server
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import positive


@dataclass
class FedDynParams:
    alpha: float = positive()


@ALGORITHMS.register()
class FedDyn(Algorithm):
    about = About(
        name="FedDyn",
        paper="Acar et al., ICLR 2021",
        summary=(
            "dynamic regularization: local loss f_i(x) - <grad_i, x> + alpha/2 ||x - "
            "theta||^2; server theta = mean x_i - h/alpha"
        ),
        docs="papers/fedslr.md#feddyn-feddyn",
        pfllib="FedDyn",
        fl_bench="FedDyn",
    )
    Params = FedDynParams
    has_personal = False
    has_global = True
    attackable = True
    state_keys = ("theta", "lam", "h")

    def setup(self) -> None:
        self.alpha = self.hp.alpha
        P = self.engine.n_params
        self.theta = self.engine.initial_state()  # [D] the server model
        self.lam = torch.zeros(self.N, P, device=self.device)  # [N, P] clients' g_i / lambda_i
        self.h = torch.zeros(P, device=self.device)  # [P] (1/N) sum_i lambda_i

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        # clients (lines 6-7): the local problem from theta^t, then lambda_i (client side)
        res, self.lam[idx] = dynamic_clients(
            self, self.theta, self.lam[idx], clients, t, self.alpha
        )
        x = self.receive(res.states, clients, ref=self.theta)  # the uploads x_i
        # server (lines 9-10): h, then theta^{t+1} = mean x_i - h / alpha
        self.h, self.theta = dynamic_server(x, self.theta, self.h, self.alpha, self.N)
        return RoundReport(res.loss.mean(), self.comm(clients))

    def global_state(self) -> torch.Tensor:
        return self.theta
