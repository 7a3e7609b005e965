"""FedDBE: FedAvg with the Domain Bias Eliminator (Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan:
"Eliminating Domain Bias for Federated Learning in Representation Space", NeurIPS 2023,
arXiv:2311.14975; the authors' code: TsingZ0/DBE system/flcore/{clients/clientDBE.py,
servers/serverDBE.py}, the same as PFLlib's clientdbe.py / serverdbe.py).

The model g = h o f (feature extractor f = the run model's body, classifier h = its head)
gets two pieces of DBE (numbered here D1-D5; the paper's PRBM and MR subsections):

  D1 (PRBM)  z_i = z_i^g + zbar_i^p,   z_i^g = f(x; W_f),
             zbar_i^p in R^K a trainable vector (Personalized Representation Bias Memory),
             initialized to 0, trained by client i only and never uploaded; h reads z_i.
  D2 (local mean)  per mini-batch b of a local run, with momentum mu (`momentum`):
             zbar_i^g <- (1 - mu) sg(zbar_i^g) + mu mean_{x in b} z_i^g(x),
             reset to 0 at the start of every local run; sg = stop-gradient, so the
             gradient reaches f only through the current batch's mean.
  D3 (MR)    L_i^MR = kappa E(zbar_i^g, zbar^g),  E(a, b) = (1 / 2K) ||a - b||_2^2,
             kappa = `kappa`, zbar^g the consensual global mean (D5).
  D4 (client objective, per batch)
             L_i = CE(h(z_i^g + zbar_i^p), y) + L_i^MR,
             one step of the run's optimizer on (W_f, W_h, zbar_i^p) together.
  D5 (server)  W^{t+1} = sum_i n_i / n W_i (FedAvg over the round's clients, body and head);
             zbar^g = sum_{i=1..N} n_i / n zbar_i^g, computed ONCE, in an initialization
             period before round 0: every client runs one local training of W^0 without
             DBE (CE(h(z^g), y), D2 tracked) and uploads its zbar_i^g; those trained models
             are discarded (the authors' send_models overwrites them) and zbar^g is fixed
             for the rest of training.

Client i deploys (W^{t+1}, zbar_i^p): the latest aggregated body and head with its own PRBM
(the authors evaluate right after sending the global model); a client never sampled
deploys zbar_i^p = 0. The global model is (W^{t+1}) without any PRBM.
Defaults: kappa = 50, mu = 1.0: the authors' Fashion-MNIST command (TsingZ0/DBE
system/run_me.sh: -mo 1 -klw 50, with their 4-layer CNN, K = 512, lr 0.005, batch 10);
PFLlib's argparse defaults (momentum 0.1, kl_weight 0) switch MR off. E averages over the
K coordinates, so MR's pull on each coordinate is kappa / K: the same kappa is 8 times
stronger at K = 64 than on the authors' CNN (the paper's own values were not checked here).

RECONSTRUCTION (from the authors' code; the paper text was not at hand here):
- zbar^g once, in an initialization period over all N clients, from the initial model
  trained locally without PRBM and MR (serverDBE.__init__), weighted by sample counts; we run
  it at the start of the first round (its own batch order, salt 1, and its own kept-optimizer
  slot `init`); its traffic is counted in that round (each client: the model and zbar^g
  down, zbar_i^g up);
- E is 0.5 times the mean over the K coordinates of the squared difference
  (`torch.mean(0.5 * (running_mean - global_mean)**2)`), the running mean restarts from 0
  each local run (`reset_running_stats`, no bias correction), and its history is detached
  after every step (`detach_running`);
- the PRBM has its own SGD at the model's lr in the authors' code; here it is one more
  parameter of the run's optimizer (identical for plain SGD);
- the global model scores without a PRBM (the server holds none).
Uploads: each sampled client's trained body and head in the run model's layout (kind
"model", ref = W^t), and once, in the initialization period, every client's zbar_i^g (kind
"other"); zbar_i^p never leaves the client.
Buffers: the body's BatchNorm running statistics are averaged with the body (FedAvg's sample
weights) and deployed with it (the authors' set_parameters copies parameters only, so their
clients keep their own statistics: FedBN-like for their ResNet-18); the running mean
zbar_i^g of D2 is a buffer of the training module, restarted every local run and uploaded
only in the initialization period.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import TrainerLayout, entry_index, make_engine, train_on
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import hp, nonneg
from fedbench.errors import ConfigError

INIT_SALT = 1  # the initialization period's batch order differs from round 0's


@dataclass
class FedDBEParams:
    kappa: float = nonneg()  # kappa: weight of the mean regularizer MR (D3)
    momentum: float = hp(gt=0, le=1)  # mu: momentum of the running local mean (D2)


class DBEModel(nn.Module):
    """The run model's body and head with the PRBM between them (D1) and the running mean
    of the body's representations (D2) as a buffer."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.body = base.body
        self.head = base.head
        dim = base.feature_dim
        self.prbm = nn.Parameter(torch.zeros(dim))  # zbar_i^p
        self.register_buffer("rep_mean", torch.zeros(dim))  # zbar_i^g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) + self.prbm)


def running_mean_step(model: DBEModel, z: torch.Tensor, momentum: float) -> torch.Tensor:
    """D2: (1 - mu) sg(zbar_i^g) + mu mean(z) (differentiable through z); the module's buffer
    takes the detached value, so the next batch sees it as history."""
    r = (1 - momentum) * model.rep_mean.clone() + momentum * z.mean(0)
    # `.data`: the engine's buffers are views of one flat state sharing a version counter;
    # a tracked in-place write would invalidate what BatchNorm saved for backward, though
    # nothing reads these entries before the next batch
    model.rep_mean.data.copy_(r.detach())
    return r


def mean_regularizer(local_mean: torch.Tensor, global_mean: torch.Tensor) -> torch.Tensor:
    """E of D3: (1 / 2K) ||local - global||^2."""
    return 0.5 * ((local_mean - global_mean) ** 2).mean()


def dbe_objective(
    model: DBEModel,
    x: torch.Tensor,
    y: torch.Tensor,
    c: int,
    *,
    global_mean: torch.Tensor | None,
    kappa: float,
    momentum: float,
) -> torch.Tensor:
    """D4 on one batch; without a global mean (the initialization period) CE(h(z^g), y)
    while D2 still tracks the local mean."""
    z = model.body(x)
    r = running_mean_step(model, z, momentum)
    if global_mean is None:
        return F.cross_entropy(model.head(z), y)
    ce = F.cross_entropy(model.head(z + model.prbm), y)
    return ce + kappa * mean_regularizer(r, global_mean)


@ALGORITHMS.register()
class FedDBE(TrainerLayout, Algorithm):
    about = About(
        name="FedDBE",
        paper="Zhang et al., NeurIPS 2023",
        summary=(
            "FedAvg + Domain Bias Eliminator: a local trainable shift of the "
            "representation (PRBM) and a regularizer pulling the local representation "
            "mean to a global mean"
        ),
        docs="algorithms.md#feddbe-feddbe",
        pfllib="FedDBE",
    )
    Params = FedDBEParams
    needs_head = True
    attackable = True
    server_optimizable = True
    has_global = True
    state_keys = ("w", "prbm", "global_mean", "has_mean")

    def setup(self) -> None:
        base = self.model_fn()
        if not (hasattr(base, "body") and hasattr(base, "head") and hasattr(base, "feature_dim")):
            raise ConfigError("feddbe needs a model with a body/head split (models.FedModel)")
        self.engine.to_module(self.engine.initial_state(), base)
        self.trainer = make_engine(self, DBEModel(base))
        spec, dev = self.trainer.spec, self.device
        run_names = [e.name for e in self.engine.spec.params + self.engine.spec.buffers]
        self.run_idx = entry_index(spec, run_names, dev)  # trainer entries of the run model
        self.prbm_idx = entry_index(spec, ["prbm"], dev)
        self.w = self.engine.initial_state()  # [D] body + head + buffers, the run model's layout
        K = base.feature_dim
        self.prbm = torch.zeros(self.N, K, device=dev)  # [N, K] zbar_i^p
        self.global_mean = torch.zeros(K, device=dev)  # zbar^g
        self.has_mean = torch.zeros((), dtype=torch.bool, device=dev)

    def rows(self, clients) -> torch.Tensor:
        """[C, D'] training-module states: W with each client's PRBM, running mean 0."""
        idx = torch.as_tensor(np.asarray(clients), device=self.device)
        s = torch.zeros(len(idx), self.trainer.n_state, device=self.device)
        s[:, self.run_idx] = self.w
        s[:, self.prbm_idx] = self.prbm[idx]
        return s

    def objective(self, global_mean: torch.Tensor | None):
        return partial(
            dbe_objective,
            global_mean=global_mean,
            kappa=self.hp.kappa,
            momentum=self.hp.momentum,
        )

    def initialization_period(self, t: int) -> tuple[int, int]:
        """D5's zbar^g from every client's local run of W^0 without DBE; (floats up, down)."""
        everyone = np.arange(self.N)
        res = train_on(
            self,
            self.trainer,
            self.rows(everyone),
            everyone,
            t,
            objective=self.objective(None),
            salt=INIT_SALT,
            slot="init",
        )
        mean_idx = entry_index(self.trainer.spec, ["rep_mean"], self.device)
        local = self.receive(res.states[:, mean_idx], everyone, kind="other")
        self.global_mean = self.weights(everyone) @ local
        self.has_mean = torch.ones((), dtype=torch.bool, device=self.device)
        K = self.global_mean.numel()
        return self.N * K, self.N * (self.engine.n_state + K)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        up0 = down0 = 0
        if not bool(self.has_mean):
            up0, down0 = self.initialization_period(t)
        res = train_on(
            self,
            self.trainer,
            self.rows(clients),
            clients,
            t,
            objective=self.objective(self.global_mean),
        )
        idx = torch.as_tensor(clients, device=self.device)
        self.prbm[idx] = res.states[:, self.prbm_idx]
        up = self.receive(res.states[:, self.run_idx], clients, ref=self.w)
        avg = self.weights(clients) @ up
        self.w = self.server_step("w", self.w, avg)
        n = len(clients) * self.engine.n_state
        return RoundReport(res.loss.mean(), self.comm(clients, up=n + up0, down=n + down0))

    def personal_state(self, i: int) -> torch.Tensor:
        """[D'] client i's deployed model in the training module's layout (`personal_model`)."""
        return self.rows([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.rows(np.arange(self.N))

    def trainer_module(self) -> nn.Module:
        return DBEModel(self.model_fn())

    def global_state(self) -> torch.Tensor:
        return self.w

    def model_size(self) -> dict[str, float]:
        """The personalized model carries its PRBM (K more parameters)."""
        n = self.engine.n_params
        return {"params_personal": n + self.prbm.shape[1], "params_global": n}
