"""FedRep (Collins et al., ICML 2021, "Exploiting Shared Representations for Personalized
Federated Learning", Algorithm 1; authors' code lgcollins/FedRep).

Model = body (the representation phi) + head h_i (the last Linear layer, `FedModel.head`).
Round t, each sampled client i: download phi^t; train the head alone `head_epochs` epochs
(body frozen): h_i <- argmin_h F_i(h, phi^t) by SGD; then the body alone `body_epochs`
epochs (head frozen): phi_i <- SGD on F_i(h_i, phi); upload phi_i. Server:
phi^{t+1} = sum_i w_i phi_i with w_i = n_i / n (the authors' code) or 1/C (`weighting`).
Personalized model of client i = (phi^t, h_i): the current body with the client's head.
Defaults from the authors' CIFAR-10 script: head_epochs 10, body_epochs 1 (their SGD:
lr 0.01, momentum 0.5, weight decay 1e-4, batch 10 -- the run's `optim`, not keys here).
Uploads: each client's trained state, of which the server uses the body (kind "model", ref =
the phi^t it trained from). With `optim.persist_state`, the momentum a phase leaves never
moves the layers the other phase freezes (`optim.step_`'s mask). Not a reconstruction.
Buffers: averaged (weights >= 0) with the body: BatchNorm running statistics belong to phi.

PLGU-GRep (`plgu.py`) is FedRep with another body phase; both share everything else here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import state_entries
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, hp
from fedbench.engine import TrainResult


@dataclass
class FedRepParams:
    head_epochs: int = hp(ge=1)  # epochs on the head, body frozen
    body_epochs: int = hp(ge=1)  # epochs on the body, head frozen
    weighting: Weighting  # body average: samples (n_k / n) | uniform (1/C)


@ALGORITHMS.register()
class FedRep(Algorithm):
    about = About(
        name="FedRep",
        paper="Collins et al., ICML 2021",
        summary="shared body (averaged) + personal head: head epochs, then body epochs",
        docs="papers/plgu.md#fedrep-fedrep",
        pfllib="FedRep",
        fl_bench="FedRep",
    )
    Params = FedRepParams
    needs_head = True
    attackable = True
    server_optimizable = True  # server_opt steps on the average
    state_keys = ("phi", "heads")

    def setup(self) -> None:
        spec = self.engine.spec
        self.head_mask = spec.mask(self.engine.model.head_params(), device=self.device)  # [P]
        self.body_mask = ~self.head_mask
        self.head_entries = state_entries(self.head_mask, spec.n_state)  # [D]: the head
        self.phi = self.engine.initial_state()  # [D] global representation (head entries unused)
        self.heads = self.client_rows("heads", self.phi[self.head_entries])  # [N, H] heads

    # ------------------------------------------------------------------ pieces
    def states_of(self, clients) -> torch.Tensor:
        """[C, D]: the global body with each client's own head."""
        s = self.phi.repeat(len(clients), 1)
        s[:, self.head_entries] = self.heads[torch.as_tensor(clients, device=self.device)]
        return s

    def head_phase(self, states: torch.Tensor, clients, t: int) -> TrainResult:
        """The head update (PLGU eq. 9): `head_epochs` epochs on the head, body frozen."""
        return self.local_train(
            states, clients, t, epochs=self.hp.head_epochs, trainable=self.head_mask, salt=1
        )

    def body_phase(self, states: torch.Tensor, clients, t: int) -> TrainResult:
        """The body update: `body_epochs` epochs on the body, head frozen."""
        return self.local_train(
            states, clients, t, epochs=self.hp.body_epochs, trainable=self.body_mask, salt=2
        )

    # ------------------------------------------------------------------ the contract
    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        head = self.head_phase(self.states_of(clients), clients, t)
        body = self.body_phase(head.states, clients, t)
        self.heads[torch.as_tensor(clients, device=self.device)] = body.states[:, self.head_entries]
        up = self.receive(body.states, clients, ref=self.phi)  # the bodies (head entries unused)
        self.phi = self.server_step("phi", self.phi, self.weights(clients, self.hp.weighting) @ up)
        n = len(clients) * (self.engine.n_state - int(self.head_mask.sum()))  # bodies moved
        return RoundReport(body.loss.mean(), self.comm(clients, up=n, down=n))

    def personal_states(self) -> torch.Tensor:
        return self.states_of(np.arange(self.N))

    def personal_state(self, i: int) -> torch.Tensor:
        return self.states_of([i])[0]
