"""LG-FedAvg (Liang et al., 2020, "Think Locally, Act Globally: Federated Learning with
Local and Global Representations", Algorithm 1; docs/papers/fedslr.md).

Model = body (every parameter but the final classifier's, norm layers' affine parameters
included, as the authors' code) + head (the last Linear layer, `FedModel.head`). Client i
keeps its body phi_i (local representation); the head h is global. Round t, each sampled
client: E epochs of the run's optimizer on the whole model (phi_i, h^t); keeps phi_i,
uploads its head h_i. Server: h^{t+1} = sum_i w_i h_i (w_i = 1/C, the default, as both the
FedSLR authors' train_LGFedAvg and pliang279/LG-FedAvg; or n_i / n: `weighting`).
Personalized model of client i = (phi_i, h^t), its body with the current global head.
Communication: the head alone, each way (FedSLR Table 2: 20 x 5,130 x 4 bytes on CIFAR-10).
Buffers: kept local (part of the body).
Start: every body starts from the common initial model, no FedAvg warm-up. The LG-FedAvg
authors' runs start from a FedAvg-trained model, but the FedSLR authors' train_LGFedAvg (the
code behind FedSLR's Table 1) starts from the initial model, and so does this class.
"""

from __future__ import annotations

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import state_entries
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.fedavg import FedAvgParams


@ALGORITHMS.register()
class LGFedAvg(Algorithm):
    about = About(
        name="LG-FedAvg",
        paper="Liang et al., 2020",
        summary="the body stays local, the classifier head is shared and averaged",
        docs="papers/fedslr.md#lg-fedavg-lg_fedavg",
        pfllib="LG-FedAvg",
        fl_bench="LG-FedAvg",
    )
    Params = FedAvgParams
    needs_head = True
    attackable = True
    state_keys = ("bodies", "head")

    def setup(self) -> None:
        spec = self.engine.spec
        head_mask = spec.mask(self.engine.model.head_params(), device=self.device)  # [P]
        self.head_entries = state_entries(head_mask, spec.n_state)  # [D]
        init = self.engine.initial_state()
        self.head = init[self.head_entries].clone()  # [H] the global head
        self.bodies = init.repeat(self.N, 1)  # [N, D] personal bodies (head entries unused)

    def states_of(self, clients) -> torch.Tensor:
        s = self.bodies[torch.as_tensor(clients, device=self.device)].clone()
        s[:, self.head_entries] = self.head
        return s

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        res = self.local_train(self.states_of(clients), clients, t)
        self.bodies[idx] = res.states
        heads = self.receive(res.states[:, self.head_entries], clients, ref=self.head)
        self.head = self.weights(clients, self.hp.weighting) @ heads
        n = len(clients) * int(self.head_entries.sum())
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    def personal_state(self, i: int) -> torch.Tensor:
        s = self.bodies[i].clone()
        s[self.head_entries] = self.head
        return s

    def personal_states(self) -> torch.Tensor:
        return self.states_of(np.arange(self.N))
