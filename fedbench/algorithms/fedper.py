"""FedPer (Arivazhagan et al., 2019, "Federated Learning with Personalization Layers",
arXiv:1912.00818, Section 3 and Algorithm 1).

Model = base layers W_B (shared) + the last K_P personalization layers W_P,i (kept by each
client; K_P = `personal_layers`, counted in `model.layers()` units, the classifier head
being the last one). Round t, each sampled client i: start from (W_B^t, W_P,i); train both
together E epochs of the run's optimizer on its data; keep W_P,i; upload W_B,i.
Server: W_B^{t+1} = sum_i w_i W_B,i with w_i = n_i / n (FedAvg's weights, the paper's
Algorithm 1) or 1/C (`weighting`). Client i deploys (W_B^t, W_P,i): the current base with
its own personalization layers; a client never sampled deploys the initial ones.
This is also what the FedSLR authors' code runs as "FedRep" (head and body trained
together for E epochs, no separate head phase).
Uploads: each client's trained state, of which the server uses the base entries (kind
"model", ref = the W_B^t it trained from). Communication: the base entries, each way.
Buffers: with the base (averaged, weights >= 0): a BatchNorm inside a personalization
layer keeps its affine parameters personal, its running statistics shared.
Not a reconstruction; K_P = 1 (the head) is our default, the paper varies it (1-4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._shared import state_entries
from fedbench.algorithms.base import ALGORITHMS, Algorithm
from fedbench.algorithms.params import Weighting, hp
from fedbench.errors import ConfigError


@dataclass
class FedPerParams:
    personal_layers: int = hp(ge=1)  # K_P: the last K_P layers stay with each client
    weighting: Weighting  # base average: samples (n_i / n) | uniform (1/C)


@ALGORITHMS.register()
class FedPer(Algorithm):
    Params = FedPerParams
    attackable = True
    state_keys = ("base", "personal")

    def __init__(self, cfg, fed, engine, model_fn) -> None:
        super().__init__(cfg, fed, engine, model_fn)
        layers = engine.model.layers()
        k = int(self.hp.personal_layers)
        if k >= len(layers):
            raise ConfigError(
                f"algo.personal_layers={k}: the model has {len(layers)} layers; at most "
                f"{len(layers) - 1} can be personal"
            )
        names = [p for layer in layers[-k:] for p in layer.params]
        mask = engine.spec.mask(names, device=self.device)  # [P]
        self.personal_entries = state_entries(mask, engine.n_state)  # [D]: buffers shared
        self.base = engine.initial_state()  # [D] (personal entries unused)
        self.personal = self.base[self.personal_entries].repeat(self.N, 1)  # [N, K]

    def states_of(self, clients) -> torch.Tensor:
        """[C, D]: the current base with each client's personalization layers."""
        s = self.base.repeat(len(clients), 1)
        s[:, self.personal_entries] = self.personal[torch.as_tensor(clients, device=self.device)]
        return s

    def round(self, t: int, clients: np.ndarray) -> dict:
        res = self.local_train(self.states_of(clients), clients, t)
        idx = torch.as_tensor(clients, device=self.device)
        self.personal[idx] = res.states[:, self.personal_entries]
        up = self.receive(res.states, clients, ref=self.base)  # the bases (personal unused)
        self.base = self.weights(clients, self.hp.weighting) @ up
        n = len(clients) * (self.engine.n_state - int(self.personal_entries.sum()))
        return {"train_loss": res.loss.mean(), **self.comm(clients, up=n, down=n)}

    def personal_state(self, i: int) -> torch.Tensor:
        return self.states_of([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.states_of(np.arange(self.N))
