"""FedCAC (Wu, Liu, Niu, Zhu, Tang: "Bold but Cautious: Unlocking the Potential of
Personalized Federated Learning through Cautiously Aggressive Collaboration", ICCV 2023),
following the authors' code in Fling (FedCACClient / FedCACServerGroup).

Round t, sampled clients S:
1. client i trains E epochs from theta_i^before to theta_i;
2. per parameter tensor (weights and biases separately) its sensitivity is
   c = |(theta_i - theta_i^before) * theta_i|; the top tau fraction of each tensor
   (int(tau numel) entries; every entry >= the k-th largest value, so ties are kept; a zero
   threshold is replaced by the smallest non-zero value) is client i's critical mask m_i;
3. overlap_ij = 1 - ||m_i - m_j||_1 / (2 ||m_i||_1) (all pairs from one Gram matrix of the
   masks); threshold = mean + ((t + 1) / beta) (max - mean) over the off-diagonal overlaps;
4. client i's customized model = mean of theta_i and every theta_j with overlap_ij >=
   threshold; the global model = FedAvg (weighted by samples) of the theta_i;
5. theta_i <- m_i * customized_i + (1 - m_i) * global (buffers stay the client's own).
The personalized model is theta_i after step 5 (what the client trains from next; where
PFLlib scores it). The model right after step 1 is reported beside it as model kind
`trained` (`trained.L.avg`): the authors' Fling config tests both places
(`test_place: after_aggregation, before_aggregation`).
Buffers: kept local in the personalized model (step 5 mixes parameters; theta_i keeps the
running statistics of its own training); the global model averages them (weights >= 0).
Uploads: the trained theta_i, through `Algorithm.receive` (ref = theta_i^before, which the
server sent); the server computes the masks of steps 2-3 from what it received.
Defaults tau = 0.5, beta = 100 (the authors' CIFAR-10 config; CIFAR-100: 0.4, 170).

RECONSTRUCTION: with partial participation, steps 3-5 run over the round's sampled clients
(the authors' code runs full participation); with one sampled client its customized model
is its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import hp
from fedbench.engine import ModelSpec


@dataclass
class FedCACParams:
    tau: float = hp(gt=0, le=1)  # fraction of each tensor marked critical
    beta: float = hp(ge=1)  # rounds until the collaboration threshold reaches the max


def critical_masks(
    before: torch.Tensor, after: torch.Tensor, spec: ModelSpec, tau: float
) -> torch.Tensor:
    """[C, P] bool: per parameter tensor, the top tau fraction of |(after - before) * after|."""
    sens = ((after - before) * after).abs()
    masks = torch.zeros_like(sens, dtype=torch.bool)
    for e in spec.params:
        c = sens[:, e.start : e.stop]
        k = int(tau * c.shape[1])
        if k == 0:
            continue
        thresh = torch.topk(c, k, dim=1).values[:, -1]
        smallest = torch.where(c > 1e-20, c, torch.inf).min(1).values
        thresh = torch.where((thresh <= 1e-10) & torch.isfinite(smallest), smallest, thresh)
        masks[:, e.start : e.stop] = c >= thresh[:, None]
    return masks


def overlap(masks: torch.Tensor) -> torch.Tensor:
    """[C, C] overlap_ij = 1 - ||m_i - m_j||_1 / (2 ||m_i||_1) of 0/1 masks [C, P]."""
    m = masks.double()
    size = m.sum(1)
    gram = m @ m.T
    l1 = size[:, None] + size[None, :] - 2 * gram  # ||m_i - m_j||_1 for 0/1 vectors
    return 1 - l1 / (2 * size[:, None]).clamp_min(1)


def collaborators(ov: torch.Tensor, t: int, beta: float) -> torch.Tensor:
    """[C, C] bool: j collaborates with i (i itself always) when overlap_ij >= the round's
    threshold mean + ((t+1)/beta)(max - mean) over off-diagonal overlaps."""
    n = ov.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=ov.device)
    if n < 2:
        return eye
    off = ov[~eye]
    mean, top = off.mean(), off.max()
    threshold = mean + (t + 1) / beta * (top - mean)
    return (ov >= threshold) | eye


@ALGORITHMS.register()
class FedCAC(Algorithm):
    about = About(
        name="FedCAC",
        paper="Wu et al., ICCV 2023",
        summary=(
            "critical parameters (top tau of |delta theta * theta|) from clients with "
            "overlapping masks, the rest from FedAvg"
        ),
        docs="papers/diversifed.md#fedcac-fedcac",
        pfllib="FedCAC",
    )
    personal_rows = "theta"
    Params = FedCACParams
    attackable = True
    has_global = True
    state_keys = ("theta", "w", "trained")
    extra_kinds = ("trained",)

    def setup(self) -> None:
        self.w = self.engine.initial_state()
        self.theta = self.w.repeat(self.N, 1)
        self.trained = self.theta.clone()  # each client's model after its last local training

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        P = self.engine.n_params
        before = self.theta[idx]
        res = self.local_train(before, clients, t)
        self.trained[idx] = res.states  # the client's own model after training
        after = self.receive(res.states, clients, ref=before)  # what the server gets
        masks = critical_masks(before[:, :P], after[:, :P], self.engine.spec, self.hp.tau)
        collab = collaborators(overlap(masks), t, self.hp.beta).to(after.dtype)
        customized = (collab / collab.sum(1, keepdim=True)) @ after
        self.w = self.weights(clients) @ after
        new = after.clone()
        new[:, :P] = torch.where(masks, customized[:, :P], self.w[:P])
        self.theta[idx] = new
        return RoundReport(
            res.loss.mean(), self.comm(clients), {"collaborators": collab.sum(1).mean()}
        )

    def global_state(self) -> torch.Tensor:
        return self.w

    def extra_correct(self, kind: str, i: int, idx: torch.Tensor) -> torch.Tensor:
        """`trained`: client i's model after its local training, before the server's mix."""
        return self.engine.correct(self.trained[i], idx)
