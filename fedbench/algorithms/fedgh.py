"""FedGH (Yi, Wang, Liu, Shi, Yu: "FedGH: Heterogeneous Federated Learning with Generalized
Global Header", ACM Multimedia 2023, arXiv:2303.13137; Section 3 and its Figure 1 workflow).

Model = feature extractor f_i (the body, kept by each client: the paper lets every client
have its own architecture; here all share the run's model) + prediction header H(.; theta)
(the linear head, one global theta^t). Round t, each sampled client i:

1. replaces its header with the global theta^t and trains its whole model (f_i and the
   header) E epochs of the run's optimizer on its data (CE);
2. computes its local averaged representations (LARs) r_i^k = mean of f_i(x) over its
   training samples of class k, for every class k it holds, and uploads (r_i^k, k);
3. the server trains the header on the uploaded pairs by SGD on CE(H(r_i^k; theta), k),
   from theta^t, and broadcasts theta^{t+1}.

Client i deploys (f_i, theta^{t+1}): its latest extractor with the latest global header
(step 4 of the paper's Figure 1: the received header replaces the local one); a client
never sampled deploys the initial extractor with the global header.

Server step (the engine's server-side training, `fedbench.engine.fit_on_server`):
`server_epochs` passes over the round's pairs in a random order keyed by (seed, round),
minibatches of `server_batch_size`, lr `server_lr`, plain SGD from theta^t.
RECONSTRUCTION (the paper's text was not readable where this was written; the workflow,
Figure 1, and both implementations were):
- the server step's settings: PFLlib (servergh.py) runs one shuffled pass in batches of the
  client batch size at its server learning rate (default 1.0); the authors' code
  (LipingYi/FedGH, FedGH.py) steps once per uploaded pair at its client lr 1e-2, but binds
  the optimizer to the client network, so its header never moves; our defaults are one pass
  of batch 1 (one step per pair, the authors' loop) at lr 0.01 (the authors' lr);
- LARs are computed in eval mode over the client's whole training set after training, as
  PFLlib's `collect_protos` (the authors' code averages per-batch means in train mode);
- the client's locally trained header is discarded (both codes); the authors' clip of
  gradient norms at 50 is not applied (the engine does not clip; rarely active at 50).
Uploads: the LARs of the classes each client holds (kind "other"; the class labels beside
them pass as sent, as the sample counts of FedAvg-style servers). Communication: up, every
uploaded LAR and its label (F + 1 entries each); down, the header (K F + K entries) to each
sampled client.
Buffers: all belong to the extractor (the header is one Linear layer): kept by the client.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import (
    class_means,
    keyed_generator,
    state_entries,
)
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import hp, positive
from fedbench.engine import fit_on_server
from fedbench.errors import ConfigError

SERVER_SALT = 0xF6  # the server's minibatch order: keyed_generator(seed, t, SERVER_SALT)


@dataclass
class FedGHParams:
    server_lr: float = positive()  # eta_theta: the server's SGD learning rate on the header
    server_epochs: int = hp(ge=1)  # passes over the round's uploaded LARs
    server_batch_size: int = hp(ge=1)  # LARs per server step


@ALGORITHMS.register()
class FedGH(Algorithm):
    about = About(
        name="FedGH",
        paper="Yi et al., ACM MM 2023 (arXiv:2303.13137)",
        summary=(
            "clients train from the global header and upload per-class mean representations; "
            "the server trains the header on them (SGD) and broadcasts it; a client deploys "
            "its own extractor with the global header"
        ),
        pfllib="FedGH",
    )
    Params = FedGHParams
    needs_head = True
    attackable = True
    state_keys = ("theta", "header")

    def setup(self) -> None:
        model = self.engine.model
        if not hasattr(model, "features"):
            raise ConfigError("fedgh needs a model with a body/head split (models.FedModel)")
        self.K, self.F = self.fed.num_classes, model.feature_dim
        shapes = [tuple(self.engine.spec.index[n].shape) for n in model.head_params()]
        if shapes != [(self.K, self.F), (self.K,)]:
            raise ConfigError(f"fedgh needs a linear head [K, F] + [K]; this one is {shapes}")
        mask = self.engine.spec.mask(model.head_params(), device=self.device)  # [P]
        self.head_entries = state_entries(mask, self.engine.n_state)  # [D]: weight, then bias
        self.theta = self.engine.initial_state().repeat(self.N, 1)  # [N, D]: extractors
        self.header = self.theta[0, self.head_entries].clone()  # [K F + K] global header

    def states_of(self, clients) -> torch.Tensor:
        """[C, D]: each client's extractor with the global header."""
        s = self.theta[torch.as_tensor(clients, device=self.device)].clone()
        s[:, self.head_entries] = self.header
        return s

    def header_params(self) -> dict[str, torch.Tensor]:
        KF = self.K * self.F
        return {"weight": self.header[:KF].view(self.K, self.F), "bias": self.header[KF:]}

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        res = self.local_train(self.states_of(clients), clients, t)
        self.theta[idx] = res.states
        means = [
            class_means(self.engine, s, self.fed.train_idx[int(i)], self.K)
            for s, i in zip(res.states, clients)
        ]
        lars = self.receive(torch.stack([m for m, _ in means]), clients, kind="other")
        held = torch.stack([n for _, n in means]) > 0  # [C, K]
        labels = torch.arange(self.K, device=self.device).expand(len(clients), -1)
        new, server_loss = fit_on_server(
            self.header_params(),
            lambda p, x: F.linear(x, p["weight"], p["bias"]),
            lars[held],  # [M, F], client by client, class by class
            labels[held],
            lr=self.hp.server_lr,
            epochs=self.hp.server_epochs,
            batch_size=self.hp.server_batch_size,
            generator=keyed_generator(self.run.seed, t, SERVER_SALT),
        )
        self.header = torch.cat([new["weight"].reshape(-1), new["bias"]])
        up = int(held.sum()) * (self.F + 1)
        down = len(clients) * self.header.numel()
        return RoundReport(
            res.loss.mean(), self.comm(clients, up=up, down=down), {"server_loss": server_loss}
        )

    def personal_state(self, i: int) -> torch.Tensor:
        return self.states_of([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.states_of(np.arange(self.N))
