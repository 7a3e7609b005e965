"""Local ("Separate" in DiversiFed): every client trains its own model alone; nothing is
shared. theta_i <- E epochs of local SGD on F_i each time client i is sampled. All clients
start from the same initialization (the seed's model). No uploads (not attackable).
Buffers: kept local (each client's own statistics, as its parameters)."""

from __future__ import annotations

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import NoParams


@ALGORITHMS.register()
class Local(Algorithm):
    about = About(
        name="Local",
        paper='— (DiversiFed\'s "Separate")',
        summary="each client trains alone",
        docs="papers/fedpg.md#local-local",
        pfllib="Local",
        fl_bench="Local",
    )
    Params = NoParams
    state_keys = ("theta",)

    def setup(self) -> None:
        self.theta = self.client_rows("theta", self.engine.initial_state())  # [N, D] off the device

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        res = self.local_train(self.theta[idx], clients, t)
        self.theta[idx] = res.states
        return RoundReport(res.loss.mean(), self.comm(clients, up=0, down=0))

    def personal_states(self) -> torch.Tensor:
        return self.theta.all()

    def personal_state(self, i: int) -> torch.Tensor:
        return self.theta[i]
