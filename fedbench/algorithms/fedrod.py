"""FedRoD (Chen & Chao: "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022).

The model is a shared body with two heads: a generic head h_g (shared) and a personal head
h_p (client's own). Per batch, with z = body(x):
- body and generic head minimize the balanced softmax loss CE(h_g(z) + log n_i, y), n_i the
  client's training class counts (classes it lacks get -inf);
- the personal head minimizes CE(h_g(z).detach() + h_p(z.detach()), y).
The two losses touch disjoint parameters, so one backward of their sum and one optimizer
step equal PFLlib's two optimizers (same optimizer and lr). Server: FedAvg (weighted by
samples) of body + generic head. Prediction: h_g(z) + h_p(z); the global model is body +
generic head. Which model is client i's personalized one (`eval_model`):
- `trained` (default; the FedRoD paper, its personalized evaluation): the client's body,
  generic and personal heads after its local training;
- `aggregated` (PFLlib, whose FedRoD the DiversiFed paper ran: it evaluates right after
  sending the global model): the aggregated body and generic head with the client's
  personal head. The DiversiFed presets use it.
Buffers: averaged (weights >= 0): FedAvg's sample weights over body, generic head and their
running statistics; `aggregated` scores the averaged statistics, `trained` the client's.
Uploads: body + generic head (+ buffers), through `Algorithm.receive` (ref = the global
part the client trained from); the personal head stays on the client.
RECONSTRUCTION: the personal head starts as a copy of the generic head on every client
(PFLlib, which the DiversiFed paper ran; the paper does not say).

The two-head module is `TwoHeadModel` around the run's model, trained by its own engine
with the run's settings; its state rows are [body | generic head | personal head | buffers].
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import TrainerLayout, make_engine, state_entries, train_on
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.engine import client_row
from fedbench.errors import ConfigError


@dataclass
class FedRoDParams:
    eval_model: Literal["trained", "aggregated"]  # the personalized model (see the docstring)


class TwoHeadModel(nn.Module):
    """body -> (generic head + personal head); the body and generic head are the run's."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.body = base.body
        self.head = base.head
        self.phead = copy.deepcopy(base.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.body(x)
        return self.head(z) + self.phead(z)


def rod_loss(model: TwoHeadModel, x, y, c, log_prior: torch.Tensor) -> torch.Tensor:
    """Balanced softmax CE of the generic head + CE of the personal head on detached inputs."""
    z = model.body(x)
    out_g = model.head(z)
    generic = F.cross_entropy(out_g + client_row(log_prior, c), y)
    personal = F.cross_entropy(out_g.detach() + model.phead(z.detach()), y)
    return generic + personal


@ALGORITHMS.register()
class FedRoD(TrainerLayout, Algorithm):
    about = About(
        name="FedRoD",
        paper="Chen & Chao, ICLR 2022",
        summary=(
            "shared body + generic head (balanced softmax) and a personal head; "
            "predicts generic + personal logits"
        ),
        docs="papers/fedpg.md#fedrod-fedrod",
        pfllib="FedRoD",
        fl_bench="FedRoD",
    )
    Params = FedRoDParams
    needs_head = True
    attackable = True
    has_global = True
    state_keys = ("w", "theta")

    def setup(self) -> None:
        base = self.model_fn()
        if not (hasattr(base, "body") and hasattr(base, "head")):
            raise ConfigError("fedrod needs a model with a body/head split (models.FedModel)")
        self.engine.to_module(self.engine.initial_state(), base)
        self.trainer = make_engine(self, TwoHeadModel(base))
        spec = self.trainer.spec
        personal = spec.mask(
            [e.name for e in spec.params if e.name.startswith("phead.")], device=self.device
        )
        # True on what FedAvg shares (body, generic head, buffers), False on the personal head
        self.shared = state_entries(~personal, spec.n_state, buffers=True)
        self.w = self.trainer.initial_state()
        self.theta = self.w.repeat(self.N, 1)
        counts = torch.stack(
            [
                torch.bincount(self.fed.y[ix], minlength=self.fed.num_classes)
                for ix in self.fed.train_idx
            ]
        )
        self.log_prior = counts.float().log().to(self.device)  # [N, K], -inf where absent

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        start = torch.where(self.shared, self.w, self.theta[idx])
        loss = partial(rod_loss, log_prior=self.log_prior[idx])
        res = train_on(self, self.trainer, start, clients, t, objective=loss)
        self.theta[idx] = res.states
        up = self.receive(res.states[:, self.shared], clients, ref=start[:, self.shared])
        self.w[self.shared] = self.weights(clients) @ up
        n = int(self.shared.sum()) * len(clients)
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    def personal_states(self) -> torch.Tensor:
        """[N, D'] in the two-head layout (`self.trainer.spec`; `personal_model` builds it)."""
        if self.hp.eval_model == "trained":
            return self.theta
        return torch.where(self.shared, self.w, self.theta)

    def personal_state(self, i: int) -> torch.Tensor:
        """[D'] client i's personalized model (`eval_model`), two-head layout."""
        if self.hp.eval_model == "trained":
            return self.theta[i]
        return torch.where(self.shared, self.w, self.theta[i])

    def global_state(self) -> torch.Tensor:
        """Body + generic head in the run model's layout (the personal head dropped)."""
        return self.w[self.shared]

    def global_correct(self, idx: torch.Tensor) -> torch.Tensor:
        return self.trainer.correct(torch.where(self.shared, self.w, 0.0), idx)

    def trainer_module(self) -> nn.Module:
        return TwoHeadModel(self.model_fn())
