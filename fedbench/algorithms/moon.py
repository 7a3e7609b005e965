"""MOON (Li, He, Song: "Model-Contrastive Federated Learning", CVPR 2021, arXiv:2103.16257,
Section 3 and Algorithm 1; authors' code QinbinLi/MOON).

FedAvg whose clients add a model-contrastive term to the cross-entropy. Round t, each
sampled client i starts from the global model w^t and trains E epochs (`local_epochs`) of
the run's optimizer on (eq. 3)

    l = CE(w_i; (x, y)) + mu * l_con(z, z_glob, z_prev),
    l_con = -log( exp(sim(z, z_glob) / tau)
                  / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )      (eq. 2)

averaged over the batch, with sim the cosine similarity, z = R_{w_i}(x) the representation
of the model being trained, z_glob = R_{w^t}(x) that of the global model received this
round and z_prev = R_{w_i^{t-1}}(x) that of the client's own local model from its previous
round (Algorithm 1, PartyLocalTraining); z_glob and z_prev are constants (no gradient). Server
(FedAvg): w^{t+1} = sum_i w_i w_i^{t+1} with w_i = n_i / n (Algorithm 1) or 1/C
(`weighting`). Defaults: tau = 0.5 (the paper's); mu = 1, the authors' code default and the
paper's value for CIFAR-100 and Tiny-ImageNet (its best of {0.1, 1, 5, 10}); the paper's
CIFAR-10 value is 5 (`algo.mu=5`). The authors' local optimizer (SGD, lr 0.01, momentum
0.9, weight decay 1e-5, batch 64, 10 epochs) is the run's `optim`, not keys here. With
few local steps on a CNN, mu = 5 can keep a client from fitting its own classes on pat-2
splits (measured: small CNN, FMNIST pat-2, ~3 SGD steps a round: each local model ends its
round at chance on its own data and accuracy alternates 0.76 / 0.09 / 0.68 / 0.08 across
rounds; mu = 1 or an MLP learns): the previous local model is where the cross-entropy
leads, and l_con pushes away from it. A budget effect of ours (the paper trains 10 epochs
a round), not a gradient error (tests/test_moon.py checks the gradient by autograd).
The personalized model of a client is, as for FedAvg (docs/metrics.md), the model its last
local training left (the global model before it first trains); the global model is w^t.

RECONSTRUCTION:
- the representation R_w(x): the paper's network is base encoder -> projection head (a
  2-layer MLP, output 256) -> output layer, and z is the projection head's output. Our
  models have no projection head: z = `model.features(x)` (the body's output, the input
  of the classifier head), the representation of the authors' own variant without a
  projection head (`--use_project_head 0`: ModelFedCon_noheader returns the base's output h
  as the contrasted vector), as PFLlib's MOON; FL-bench contrasts the pre-ReLU features;
- the client's previous model before it has trained: the paper is silent. We use the
  initial model w^0 (PFLlib's old_model, a copy of the client's model at construction).
  In round 0 this makes z_prev = z_glob, so l_con = log 2 with zero gradient: the authors'
  code has no previous model in its first round (an empty pool: the term is 0) and trains on
  the cross-entropy alone, as here. A client first sampled later contrasts against w^0 (the
  authors' code: that client's own untrained network; FL-bench: the global model w^t,
  which zeroes the term's gradient for that round);
- z_glob and z_prev are computed in eval mode (BatchNorm with the global / previous model's
  own running statistics, no dropout), as the authors' code puts those networks in eval();
  z in training mode;
- the previous model is each client's last local model (the authors' `model_buffer_size`
  1, FIFO); their larger buffers (several previous models as several negatives) are not
  implemented.
Uploads: each client's trained state (kind "model", ref = the w^t it trained from); the
previous model stays with its client (the server never needs it).
Buffers: averaged (weights >= 0) with the parameters into w, as FedAvg (the authors average
the whole state dict); a client's previous model keeps its own statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport, TrainedOrGlobal
from fedbench.algorithms.params import Weighting, nonneg, positive
from fedbench.engine import client_row
from fedbench.engine.spec import ModelSpec
from fedbench.errors import ConfigError


@dataclass
class MOONParams:
    mu: float = nonneg()  # weight of the model-contrastive term (0: FedAvg)
    tau: float = positive()  # temperature of l_con
    weighting: Weighting  # server average: samples (n_i / n) | uniform (1/C)


def contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float
) -> torch.Tensor:
    """Mean over the batch of eq. 2, -log(e^{s_g} / (e^{s_g} + e^{s_p})) with s = cos / tau,
    as log(e^{s_g} + e^{s_p}) - s_g (stable for a small tau). z, z_glob, z_prev: [B, F]."""
    s_g = F.cosine_similarity(z, z_glob, dim=-1) / tau
    s_p = F.cosine_similarity(z, z_prev, dim=-1) / tau
    return (torch.logaddexp(s_g, s_p) - s_g).mean()


class _Features(nn.Module):
    """`model.features` as a module's forward, so `functional_call` can run it at any state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.features(x)


class ModelContrastive:
    """The local objective(model, x, y, c) of eq. 3 for one `Engine.train` call: CE on the
    trained model plus mu * l_con against the global state `glob` [D] and the previous local
    state `prev[c]` ([C, D], row c = the client at position c of the call)."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        glob: torch.Tensor,
        prev: torch.Tensor,
        mu: float,
        tau: float,
    ) -> None:
        self.features = _Features(model)
        self.spec = spec
        self.glob, self.prev = glob, prev
        self.mu, self.tau = mu, tau

    @torch.no_grad()
    def represent(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """R_state(x): features at a flat state [D], in eval mode (its own running statistics;
        a BatchNorm then reads, never writes, them), without gradient."""
        P = self.spec.n_params
        views = {f"model.{k}": v for k, v in self.spec.views(state[:P], state[P:]).items()}
        model = self.features.model
        was = model.training
        model.eval()
        try:
            return functional_call(self.features, views, (x,))
        finally:
            model.train(was)

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, c: int):
        z = model.features(x)
        ce = F.cross_entropy(model.head(z), y)
        z_glob = self.represent(self.glob, x)
        z_prev = self.represent(client_row(self.prev, c), x)
        return ce + self.mu * contrastive_loss(z, z_glob, z_prev, self.tau)


@ALGORITHMS.register()
class MOON(TrainedOrGlobal, Algorithm):
    about = About(
        name="MOON",
        paper="Li, He, Song, CVPR 2021",
        summary=(
            "FedAvg with a model-contrastive local term: the representation pulled "
            "toward the global model's and pushed from the client's previous local "
            "model's"
        ),
        docs="algorithms.md#moon-moon",
        pfllib="MOON",
        fl_bench="MOON",
    )
    Params = MOONParams
    needs_features = True
    attackable = True
    server_optimizable = True  # server_opt steps on the average
    state_keys = ("w", "theta", "seen")  # theta[i]: client i's previous local model (w^0 first)

    def setup(self) -> None:
        if not hasattr(self.engine.model, "features"):
            raise ConfigError("moon needs a model with a body/head split (models.FedModel)")
        self.w = self.engine.initial_state()
        self.init_rows()  # theta = w^0: the previous model of a client that has not trained

    def objective(self, clients) -> ModelContrastive | None:
        """The round's local objective for `clients` (None for mu = 0: plain CE, FedAvg)."""
        if self.hp.mu == 0:
            return None
        idx = torch.as_tensor(clients, device=self.device)
        prev = self.theta[idx]
        return ModelContrastive(
            self.engine.model, self.engine.spec, self.w, prev, self.hp.mu, self.hp.tau
        )

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        res = self.local_train(self.w, clients, t, objective=self.objective(clients))
        idx = torch.as_tensor(clients, device=self.device)
        self.set_trained(idx, res.states)  # the deployed model and next round's z_prev
        up = self.receive(res.states, clients, ref=self.w)
        self.w = self.server_step("w", self.w, self.weights(clients, self.hp.weighting) @ up)
        return RoundReport(res.loss.mean(), self.comm(clients))
