"""FedAvg and FedProx: one global model, clients train from it, the server averages.

FedAvg (McMahan et al., AISTATS 2017, Algorithm 1): w^{t+1} = sum_k (n_k / n) w_k^{t+1},
w_k^{t+1} = E epochs of local SGD from w^t on client k's data.
FedProx (Li et al., MLSys 2020, eq. 2): the local objective is
F_k(w) + (mu / 2) ||w - w^t||^2; mu = 0.01 (docs/papers/fedpg.md: from the FedProx paper's grid).

Personalized model (docs/metrics.md): a client's model after its last local training from
w, as FedPG's appendix and FedRoD do; a client not yet sampled deploys w.
Uploads: each client's trained state (kind "model", ref = the w it trained from).
Buffers: averaged (weights n_k / n or 1/C, >= 0) with the parameters into w; a personal
model keeps the statistics of its own last training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport, TrainedOrGlobal
from fedbench.algorithms.params import Weighting, nonneg
from fedbench.engine import Proximal


@dataclass
class FedAvgParams:
    weighting: Weighting  # server average: samples (n_k / n) | uniform (1/C)


@dataclass
class FedProxParams(FedAvgParams):
    mu: float = nonneg()  # proximal weight, >= 0


@ALGORITHMS.register()
class FedAvg(TrainedOrGlobal, Algorithm):
    about = About(
        name="FedAvg",
        paper="McMahan et al., AISTATS 2017",
        summary="local SGD from the global model, sample-weighted average",
        docs="papers/fedpg.md#fedavg-and-fedprox",
        pfllib="FedAvg",
        fl_bench="FedAvg",
    )
    Params = FedAvgParams
    attackable = True
    server_optimizable = True  # server_opt steps on the average
    state_keys = ("w", "theta", "seen")

    def setup(self) -> None:
        self.w = self.engine.initial_state()
        self.init_rows()

    def terms(self) -> list:
        return []

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        res = self.local_train(self.w, clients, t, terms=self.terms())
        idx = torch.as_tensor(clients, device=self.device)
        self.set_trained(idx, res.states)
        up = self.receive(res.states, clients, ref=self.w)
        self.w = self.server_step("w", self.w, self.weights(clients, self.hp.weighting) @ up)
        return RoundReport(res.loss.mean(), self.comm(clients))


@ALGORITHMS.register("fedprox")
class FedProx(FedAvg):
    about = About(
        name="FedProx",
        paper="Li et al., MLSys 2020",
        summary="FedAvg with a proximal term (mu/2)||w - w^t||^2 in the local loss",
        docs="papers/fedpg.md#fedavg-and-fedprox",
        pfllib="FedProx",
        fl_bench="FedProx",
    )
    Params = FedProxParams

    def terms(self) -> list:
        return [Proximal(self.w, self.hp.mu)]
