"""FedPer (Arivazhagan et al., 2019, "Federated Learning with Personalization Layers",
arXiv:1912.00818, Section 3 and Algorithm 1).

Model = base layers W_B (shared) + the last K_P personalization layers W_P,i (kept by each
client; K_P = `personal_layers`). Round t, each sampled client i: start from
(W_B^t, W_P,i); train both together E epochs of the run's optimizer on its data; keep
W_P,i; upload W_B,i. Server: W_B^{t+1} = sum_i w_i W_B,i with w_i = n_i / n (FedAvg's
weights, the paper's Algorithm 1) or 1/C (`weighting`). Client i deploys
(W_B^{t+1}, W_P,i): the latest aggregated base with its own personalization layers (as
PFLlib, FL-bench and the Flower baseline evaluate); a client never sampled deploys the
initial personalization layers.
RECONSTRUCTION (the paper leaves these open):
- a "layer" is one unit of `model.layers()` (a Conv/Linear with the norm after it; the
  classifier head is the last one); K_P = 1, the head, as PFLlib and FL-bench personalize
  the classifier (the paper and the Flower baseline also try 2-4);
- the deployed base is the latest aggregate (the FedSLR authors' code, whose "FedRep" is
  FedPer's training step with their fully connected layers personal and a uniform base
  average, scores with the base before aggregation).
Uploads: each client's trained state, of which the server uses the base entries (kind
"model", ref = the W_B^t it trained from); the personal entries of the base row never
change. Communication: the base entries (parameters and shared buffers), each way.
Buffers: belong to their module: a BatchNorm inside a personalization layer keeps its
running statistics with the client, as its affine parameters (Flower and FL-bench keep the
personal modules' whole state); every other buffer is averaged with the base.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import state_entries
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, hp
from fedbench.errors import ConfigError


@dataclass
class FedPerParams:
    personal_layers: int = hp(ge=1)  # K_P: the last K_P layers stay with each client
    weighting: Weighting  # base average: samples (n_i / n) | uniform (1/C)


@ALGORITHMS.register()
class FedPer(Algorithm):
    about = About(
        name="FedPer",
        paper="Arivazhagan et al., 2019 (arXiv:1912.00818)",
        summary=(
            "shared base layers (averaged) + the last `personal_layers` kept by each "
            "client, trained together for E epochs"
        ),
        docs=None,
        pfllib="FedPer",
        fl_bench="FedPer",
    )
    Params = FedPerParams
    attackable = True
    server_optimizable = True  # server_opt steps on the average
    state_keys = ("base", "personal")

    def setup(self) -> None:
        names = self.personal_params(self.engine)
        mask = self.engine.spec.mask(names, device=self.device)  # [P]
        self.personal_entries = state_entries(mask, self.engine.n_state)  # [D]
        modules = {n.rsplit(".", 1)[0] for n in names}
        for e in self.engine.spec.buffers:  # a personal module's statistics are personal too
            if e.name.rsplit(".", 1)[0] in modules:
                self.personal_entries[e.start : e.stop] = True
        self.base = self.engine.initial_state()  # [D] (personal entries unused)
        self.personal = self.base[self.personal_entries].repeat(self.N, 1)  # [N, K]

    def personal_params(self, engine) -> list[str]:
        """The parameters each client keeps: those of the last K_P units of model.layers()."""
        layers = engine.model.layers()
        k = self.hp.personal_layers
        if k >= len(layers):
            raise ConfigError(
                f"algo.personal_layers={k}: the model has {len(layers)} layers; at most "
                f"{len(layers) - 1} can be personal"
            )
        return [p for layer in layers[-k:] for p in layer.params]

    def states_of(self, clients) -> torch.Tensor:
        """[C, D]: the current base with each client's personalization layers."""
        s = self.base.repeat(len(clients), 1)
        s[:, self.personal_entries] = self.personal[torch.as_tensor(clients, device=self.device)]
        return s

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        res = self.local_train(self.states_of(clients), clients, t)
        idx = torch.as_tensor(clients, device=self.device)
        self.personal[idx] = res.states[:, self.personal_entries]
        up = self.receive(res.states, clients, ref=self.base)  # the bases (personal unused)
        avg = self.weights(clients, self.hp.weighting) @ up
        avg = self.server_step("base", self.base, avg)  # personal entries: discarded below
        self.base = torch.where(self.personal_entries, self.base, avg)
        n = len(clients) * (self.engine.n_state - int(self.personal_entries.sum()))
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    def personal_state(self, i: int) -> torch.Tensor:
        return self.states_of([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.states_of(np.arange(self.N))
