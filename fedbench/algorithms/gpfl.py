"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan: "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning", ICCV 2023,
arXiv:2308.10279; the authors' code: TsingZ0/GPFL system/flcore/{clients/clientgp.py,
servers/servergp.py}, the same as PFLlib's clientgpfl.py / servergpfl.py).

Client i's model: the feature extractor phi (the run model's body, shared), a Conditional
Valve CoV (shared, parameters V), a Global Category Embedding layer GCE with table C in
R^{U x K} (shared; U classes, K = feature_dim; W below) and the head psi_i (the run
model's head, personal). Equation numbers are the paper's (Sec. 3.2, Algorithm 1):

  (3)  f = phi(x);  f^G = ReLU((gamma + 1) * f + beta),  f^P = ReLU((gamma_i + 1) * f + beta_i)
  (4)  {gamma, beta} = CoV(f, g; V),  {gamma_i, beta_i} = CoV(f, p_i; V): CoV_gamma and
       CoV_beta each an FC K -> K layer, a ReLU and a LayerNorm applied to the conditional
       input (g for the global route, p_i for the personalized one).
  (5)  g = (1/U) sum_u What[u]   (identical among clients),
  (6)  alpha_i^u = E_{(x, y) ~ D_i} 1{y = u}   (the client's training label distribution),
  (7)  p_i = (1/U) sum_u alpha_i^u What[u],
       What = Chat, the frozen copy of the global C^t the client received (Algorithm 1,
       lines 6-8: set before local training, constant during it); `conditional` below.
  (8)  L^alg = -log softmax_u(sim(f^G, W[u]))[y], sim the cosine (unscaled); its gradient
       reaches phi, CoV and W ("all the embeddings in GCE are updated through Eq. (8)").
  (9)  L^mlg = ||f^G - What[y]||_2   (`magnitude`: see RECONSTRUCTION).
  (10) L^P = CE(psi(f^P; W_i^h), y).
  (11) L_i = L^P + L^alg + lam L^mlg + mu ||V||_2 + mu ||C||_2, lam = `lam`, mu = `mu`
       (the mu terms: see RECONSTRUCTION); the objective (1) is E_{(x, y) ~ D_i} L_i:
       per batch the mean over its samples; one step of the run's optimizer on
       (phi, V, W, W_i^h) together (Algorithm 1, lines 9-13).
  Server (Algorithm 1, lines 15-18): W^fe, V and C are averaged with weights n_i / n^t over
       the round's clients; W_i^h never leaves client i.
Client i deploys x -> psi_i(CoV(phi(x), p_i)) (only the personalized route, Fig. 1) with the
latest phi, CoV, its own head and its p_i from the latest global C. The server holds no
classifier head: no global model is reported.
`conditional`: `received` (default, the paper) computes g and p_i by (5) and (7) from the
global C the client receives: C^t while it trains in round t, C^{t+1} once the round ends
(round 0 trains with them from C^0). `held` is the authors' code (set_GCE): once the round
ends each client computes g_i = (1/U) sum_u W_i[u] and p_i = sum_u alpha_i^u W_i[u] (no 1/U)
from the GCE it holds before the new global one replaces it (its trained W_i if it trained
this round, else the C^t the authors' server broadcast to every client), so g_i differs
among clients; both are 0 in round 0.
Defaults lam = 0.01, mu = 0.1: the authors' run_me.sh for the 4-layer CNN and the 3-layer
MLP (lam 1e-4 and mu 0 for ResNet-18 and fastText; lam 0.01, mu 1.0 for HAR-CNN); the
paper defers its hyperparameters to its supplementary material, not read here.

RECONSTRUCTION:
- (9)'s reduction over a batch (`magnitude`): `sample` (default) is the mean over the batch
  of each sample's L2 distance, the expectation (1) over (x, y); `batch` is the authors'
  code, `torch.norm(feat_G - emb, 2)` on the [B, K] batch: the Frobenius norm of all the
  batch's differences at once (about sqrt(B) times larger; their lam = 0.01 was set with
  it at B = 10);
- (11)'s mu terms: the paper writes mu ||V||_2 + mu ||C||_2; the authors' code has no such
  loss but weight decay mu on their separate SGD optimizers for CoV and GCE, the gradient
  mu theta of (mu/2)(||V||^2 + ||C||^2), which is what we add to the loss (all CoV
  parameters, LayerNorm's included, and the table); the three optimizers (phi + psi_i,
  CoV, GCE; same lr) are here the run's one optimizer over all four (identical for SGD);
- CoV and GCE are initialized as PyTorch's Linear / LayerNorm / Embedding defaults (the
  authors' modules), one draw shared by all clients, from the run's seed without touching
  the global RNG; every head starts from the run model's initial head (the authors'
  deep copies of one model).
Uploads: each sampled client's trained body in the run model's layout (kind "model", ref =
the global phi; the head entries in it are not used) and its CoV + GCE parameters (kind
"model", ref = the global CoV + GCE, all E entries parameters: `n_params=E`); psi_i, p_i and
g stay local.
Buffers: the body's BatchNorm running statistics are averaged with the body (FedAvg's sample
weights) and deployed with it (the authors' set_parameters copies parameters only, so
their clients keep their own statistics: FedBN-like for their ResNet-18, moot for their
CNNs without BatchNorm); g and p_i are buffers of the training module, one row per client,
set by (5)/(7) and never trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import TrainerLayout, entry_index, make_engine, train_on
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import nonneg
from fedbench.errors import ConfigError


@dataclass
class GPFLParams:
    lam: float = nonneg()  # lambda, weight of the magnitude-level guidance (9) in (11)
    mu: float = nonneg()  # mu, L2 weight on CoV and GCE in (11)
    magnitude: Literal["sample", "batch"]  # (9)'s reduction over the batch (RECONSTRUCTION)
    conditional: Literal["received", "held"]  # g, p_i from the received C (5, 7) | authors'


class CoV(nn.Module):
    """(3)-(4): the Conditional Valve, an affine transformation of f conditioned on c."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))

    def forward(self, f: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return F.relu(f * (self.gamma(context) + 1) + self.beta(context))


class GPFLModel(nn.Module):
    """The run model's body and head with CoV and GCE; the conditional inputs as buffers.
    Its forward is the deployed personalized model ((3)'s personalized route)."""

    def __init__(self, base: nn.Module, num_classes: int) -> None:
        super().__init__()
        dim = base.feature_dim
        self.body = base.body
        self.head = base.head
        self.cov = CoV(dim)
        self.gce = nn.Embedding(num_classes, dim)  # W
        self.register_buffer("cond_p", torch.zeros(dim))  # p_i
        self.register_buffer("cond_g", torch.zeros(dim))  # g (g_i with `held`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cov(self.body(x), self.cond_p))


def angle_loss(f_g: torch.Tensor, table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(8): cross-entropy of the cosine similarities between f^G and every class embedding."""
    return F.cross_entropy(F.normalize(f_g) @ F.normalize(table).T, y)


def magnitude_loss(f_g: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    """(9): the L2 distance of f^G to the frozen embeddings of its labels: per sample, averaged
    (`sample`), or the norm of the whole batch's differences (`batch`, the authors' code)."""
    d = f_g - target
    if reduction == "batch":
        return torch.linalg.vector_norm(d)
    return torch.linalg.vector_norm(d, dim=1).mean()


def gpfl_objective(
    model: GPFLModel,
    x: torch.Tensor,
    y: torch.Tensor,
    c: int,
    *,
    frozen: torch.Tensor,
    lam: float,
    mu: float,
    magnitude: str,
) -> torch.Tensor:
    """(11) on one batch (its mean over the samples); `frozen` is What = C^t [U, K]."""
    f = model.body(x)
    f_p = model.cov(f, model.cond_p)
    f_g = model.cov(f, model.cond_g)
    loss = F.cross_entropy(model.head(f_p), y) + angle_loss(f_g, model.gce.weight, y)
    loss = loss + lam * magnitude_loss(f_g, frozen[y], magnitude)
    if mu:
        sq = sum(p.pow(2).sum() for p in model.cov.parameters()) + model.gce.weight.pow(2).sum()
        loss = loss + 0.5 * mu * sq
    return loss


@ALGORITHMS.register()
class GPFL(TrainerLayout, Algorithm):
    about = About(
        name="GPFL",
        paper="Zhang et al., ICCV 2023",
        summary=(
            "a Conditional Valve turns the shared features into a global route (guided "
            "by shared class embeddings: angle- and magnitude-level losses) and a "
            "personalized route for the client's own head"
        ),
        docs="algorithms.md#gpfl-gpfl",
        pfllib="GPFL",
    )
    Params = GPFLParams
    needs_head = True
    attackable = True
    server_optimizable = True
    state_keys = ("w", "ext", "heads", "cond_p", "cond_g")

    def setup(self) -> None:
        with torch.random.fork_rng(devices=[]):  # CoV and GCE from the run's seed only
            torch.manual_seed(self.run.seed)
            base = self.model_fn()
            if not all(hasattr(base, a) for a in ("body", "head", "feature_dim")):
                raise ConfigError("gpfl needs a model with a body/head split (models.FedModel)")
            module = GPFLModel(base, self.fed.num_classes)
        self.engine.to_module(self.engine.initial_state(), base)
        self.trainer = make_engine(self, module)
        spec, dev = self.trainer.spec, self.device
        run_names = [e.name for e in self.engine.spec.params + self.engine.spec.buffers]
        head = self.engine.model.head_params()
        ext = [n for n in (e.name for e in spec.params) if n.split(".")[0] in ("cov", "gce")]
        self.run_idx = entry_index(spec, run_names, dev)  # trainer entries of the run model
        self.head_idx = entry_index(spec, head, dev)
        self.ext_idx = entry_index(spec, ext, dev)  # CoV + GCE parameters
        self.p_idx = entry_index(spec, ["cond_p"], dev)
        self.g_idx = entry_index(spec, ["cond_g"], dev)
        gce = spec.index["gce.weight"]
        s0 = int(self.ext_idx.tolist().index(gce.start))
        self.gce_in_ext = slice(s0, s0 + gce.stop - gce.start)  # W inside `ext`
        self.table_shape = tuple(gce.shape)  # (C, K)
        self.run_head = torch.zeros(self.engine.n_state, dtype=torch.bool, device=dev)
        self.run_head[: self.engine.n_params] = self.engine.spec.mask(head, device=dev)

        init = self.trainer.initial_state()
        self.w = self.engine.initial_state()  # [D] phi (+ buffers), run layout; head entries unused
        self.heads = init[self.head_idx].repeat(self.N, 1)  # [N, H] h_i
        self.ext = init[self.ext_idx]  # [E] global CoV + GCE
        counts = torch.stack(
            [
                torch.bincount(self.fed.y[ix], minlength=self.fed.num_classes)
                for ix in self.fed.train_idx
            ]
        ).float()
        self.alpha = (counts / counts.sum(1, keepdim=True).clamp_min(1)).to(dev)  # [N, U] (6)
        K = base.feature_dim
        if self.hp.conditional == "received":  # (5), (7) from C^0 for round 0
            self.cond_p, self.cond_g = self.received_inputs(self.table(self.ext))
        else:  # the authors' zeros until the first round ends
            self.cond_p = torch.zeros(self.N, K, device=dev)  # [N, K] p_i
            self.cond_g = torch.zeros(self.N, K, device=dev)  # [N, K] g_i

    def rows(self, clients) -> torch.Tensor:
        """[C, D'] training-module states: the global phi, CoV and GCE with each client's
        head and conditional inputs."""
        idx = torch.as_tensor(np.asarray(clients), device=self.device)
        s = torch.empty(len(idx), self.trainer.n_state, device=self.device)
        s[:, self.run_idx] = self.w
        s[:, self.head_idx] = self.heads[idx]
        s[:, self.ext_idx] = self.ext
        s[:, self.p_idx] = self.cond_p[idx]
        s[:, self.g_idx] = self.cond_g[idx]
        return s

    def table(self, ext: torch.Tensor) -> torch.Tensor:
        """W [C, K] (or [..., C, K]) inside CoV + GCE vectors [..., E]."""
        return ext[..., self.gce_in_ext].reshape(*ext.shape[:-1], *self.table_shape)

    def received_inputs(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(7) p_i [N, K] for every client and (5) g [N, K] (one row repeated) from the global
        table `table` [U, K]."""
        U = table.shape[0]
        p = self.alpha @ table / U
        return p, table.mean(0).expand_as(p).clone()

    def held_inputs(
        self, idx: torch.Tensor, trained: torch.Tensor, held: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The authors' set_GCE for every client from the GCE it holds: `trained` [C, U, K]
        for clients `idx`, `held` [U, K] (the C^t sent to all) for the others; p_i without
        (7)'s 1/U."""
        p = self.alpha @ held
        g = held.mean(0).expand_as(p).clone()
        p[idx] = torch.bmm(self.alpha[idx][:, None], trained)[:, 0]
        g[idx] = trained.mean(1)
        return p, g

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        frozen = self.table(self.ext)  # What = C^t
        objective = partial(
            gpfl_objective,
            frozen=frozen,
            lam=self.hp.lam,
            mu=self.hp.mu,
            magnitude=self.hp.magnitude,
        )
        res = train_on(self, self.trainer, self.rows(clients), clients, t, objective=objective)
        self.heads[idx] = res.states[:, self.head_idx]
        if self.hp.conditional == "held":
            trained = self.table(res.states[:, self.ext_idx])
            self.cond_p, self.cond_g = self.held_inputs(idx, trained, frozen)
        up = self.receive(res.states[:, self.run_idx], clients, ref=self.w)
        up_ext = self.receive(  # CoV + GCE: all E columns are parameters
            res.states[:, self.ext_idx], clients, ref=self.ext, n_params=self.ext.numel()
        )
        wts = self.weights(clients)
        avg = self.server_step("w", self.w, wts @ up)
        self.w = torch.where(self.run_head, self.w, avg)  # the head entries are personal
        self.ext = self.server_step("ext", self.ext, wts @ up_ext, params=slice(None))
        if self.hp.conditional == "received":  # from C^{t+1}: deployed now, trained next
            self.cond_p, self.cond_g = self.received_inputs(self.table(self.ext))
        n = len(clients) * (self.engine.n_state - int(self.run_head.sum()) + self.ext.numel())
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    def personal_state(self, i: int) -> torch.Tensor:
        """[D'] client i's deployed model in the training module's layout (`personal_model`)."""
        return self.rows([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.rows(np.arange(self.N))

    def trainer_module(self) -> nn.Module:
        return GPFLModel(self.model_fn(), self.fed.num_classes)

    def model_size(self) -> dict[str, float]:
        """The deployed model: phi, CoV and h_i (W only trains and guides)."""
        cov = sum(p.numel() for p in self.trainer.model.cov.parameters())
        return {"params_personal": self.engine.n_params + cov}
