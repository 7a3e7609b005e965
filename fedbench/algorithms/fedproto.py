"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang: "FedProto: Federated Prototype Learning
across Heterogeneous Clients", AAAI 2022).

No parameters are shared. Client i keeps its whole model (feature extractor f = the body,
and the head) and trains E epochs on (its eq. 8)

    CE(head(f(x)), y) + lambda MSE(f(x), P_y),

P_y the global prototype of class y (samples of a class without one add 0, as in PFLlib);
in round 0, before any global prototype exists, on CE only. After training it uploads its
local prototypes C_i^k = mean of f(x) over its training samples of class k. The server
averages them per class over the clients holding the class (eq. 6; `weighting: uniform`,
PFLlib's, or `samples`, weighted by the clients' counts of the class).
Prediction (the paper's inference, reported as the personalized model): the class of the
nearest global prototype to f(x) under MSE (the head's, before any global prototype exists).
The client's own classifier head is reported beside it as model kind `head`
(`head.L.avg` in metrics.csv), from the same run.
Default lambda = 1 (PFLlib, which the DiversiFed paper ran).

Buffers: kept local (no parameter or statistic leaves the client).
Uploads: the local prototypes, through `Algorithm.receive` (kind "other"); the class counts
beside them pass as sent, like the sample counts every FedAvg-style server weighs by.

RECONSTRUCTION: local prototypes are computed over the client's training data after local
training, in eval mode (PFLlib averages the features seen during the last epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import aggregate_prototypes, class_means
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, nonneg
from fedbench.errors import ConfigError


@dataclass
class FedProtoParams:
    lam: float = nonneg()  # lambda, weight of the prototype regularizer
    weighting: Weighting  # per-class server mean: uniform over holders | samples


def nearest_prototype(features: torch.Tensor, protos: torch.Tensor, has: torch.Tensor):
    """Class of the nearest prototype under MSE (classes without one excluded): [B]."""
    d = ((features[:, None, :] - protos[None]) ** 2).mean(-1)
    return d.masked_fill(~has[None], float("inf")).argmin(1)


@ALGORITHMS.register()
class FedProto(Algorithm):
    about = About(
        name="FedProto",
        paper="Tan et al., AAAI 2022",
        summary=(
            "shares per-class mean features; CE + lambda MSE to the global prototype; "
            "nearest-prototype prediction"
        ),
        docs="papers/diversifed.md#fedproto-fedproto",
        pfllib="FedProto",
        fl_bench="FedProto",
    )
    Params = FedProtoParams
    needs_features = True
    attackable = True
    state_keys = ("theta", "protos", "has_proto")
    extra_kinds = ("head",)

    def setup(self) -> None:
        if not hasattr(self.engine.model, "features"):
            raise ConfigError("fedproto needs a model with a body/head split (models.FedModel)")
        self.K = self.fed.num_classes
        self.theta = self.engine.initial_state().repeat(self.N, 1)
        self.protos = torch.zeros(self.K, self.engine.model.feature_dim, device=self.device)
        self.has_proto = torch.zeros(self.K, dtype=torch.bool, device=self.device)

    def objective(self, model, x, y, c):
        """CE + lambda MSE(f(x), P_y); the target is f(x) itself where P_y does not exist."""
        f = model.features(x)
        target = torch.where(self.has_proto[y][:, None], self.protos[y], f.detach())
        return F.cross_entropy(model.head(f), y) + self.hp.lam * F.mse_loss(f, target)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        obj = self.objective if bool(self.has_proto.any()) else None
        res = self.local_train(self.theta[idx], clients, t, objective=obj)
        self.theta[idx] = res.states
        means = [
            class_means(self.engine, s, self.fed.train_idx[int(i)], self.K)
            for s, i in zip(res.states, clients)
        ]
        local = self.receive(torch.stack([m for m, _ in means]), clients, kind="other")
        counts = torch.stack([n for _, n in means])
        self.protos, self.has_proto = aggregate_prototypes(local, counts, self.hp.weighting)
        per_client = self.K * self.protos.shape[1]
        n = len(clients) * per_client
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    def personal_states(self) -> torch.Tensor:
        return self.theta

    @torch.no_grad()
    def personal_correct(self, i: int, idx: torch.Tensor) -> torch.Tensor:
        if not bool(self.has_proto.any()):
            return self.engine.correct(self.theta[i], idx)
        self.engine.load(self.theta[i])
        model = self.engine.model
        model.eval()
        out = []
        bs = self.engine.eval_batch_size
        for s in range(0, int(idx.numel()), bs):
            x, y = self.fed.batch(idx[s : s + bs], train=False)
            out.append(nearest_prototype(model.features(x), self.protos, self.has_proto) == y)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=self.device)

    def extra_correct(self, kind: str, i: int, idx: torch.Tensor) -> torch.Tensor:
        """`head`: the client's classifier on its own features."""
        return self.engine.correct(self.theta[i], idx)
