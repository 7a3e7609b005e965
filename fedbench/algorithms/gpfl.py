"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan: "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning", ICCV 2023,
arXiv:2308.10279; the authors' code: TsingZ0/GPFL system/flcore/{clients/clientgp.py,
servers/servergp.py}, the same as PFLlib's clientgpfl.py / servergpfl.py).

Client i's model: the feature extractor phi (the run model's body, shared), a Conditional
Valve CoV (shared), a Global Category Embedding layer GCE with table W in R^{C x K} (shared;
C classes, K = feature_dim) and the classifier head h_i (the run model's head, personal).
Numbered here G1-G7 (the paper's CoV, GCE and objective subsections):

  G1 (CoV)   CoV(f, c) = ReLU((gamma(c) + 1) * f + beta(c)),
             gamma(c) = LN(ReLU(A_g c + a_g)), beta(c) = LN(ReLU(A_b c + a_b)),
             two fully connected K -> K layers with ReLU and LayerNorm.
  G2 (routes)  f = phi(x); f^G = CoV(f, g_i) (global guidance route),
             f^P = CoV(f, p_i) (personalized task route).
  G3 (conditional inputs)  g_i = (1/C) sum_c W_i[c],  p_i = sum_c alpha_i^c W_i[c],
             alpha_i^c = n_i^c / n_i the client's training label distribution;
             constants during training; g_i = p_i = 0 before the first round ends.
  G4 (angle-level guidance)  L_alg = E_(x,y) -log softmax_c(cos(f^G, W[c]))[y]
             (unscaled cosine logits; the gradient reaches phi, CoV and W).
  G5 (magnitude-level guidance)  L_mlg = ||f^G - W^fr[y]||_2 with W^fr the GCE received
             this round, frozen (`magnitude`: see RECONSTRUCTION).
  G6 (client objective, per batch)
             L_i = CE(h_i(f^P), y) + L_alg + lam L_mlg + (mu/2)(||theta_CoV||^2 + ||W||^2),
             lam = `lam`, mu = `mu`; one step of the run's optimizer on (phi, CoV, W, h_i).
  G7 (server)  phi, CoV and W are averaged with weights n_i / n over the round's clients
             (FedAvg); h_i never leaves client i.
After the round, each client computes G3 from the GCE it holds (its trained W_i if it
trained this round, else the W^t it was sent) before the new global W^{t+1} replaces it
(set_GCE in the authors' code); W^{t+1} becomes W^fr of the next round.
Client i deploys x -> h_i(CoV(phi(x), p_i)) with the latest phi and CoV, its own head and
its p_i. The server holds no classifier head: no global model is reported.
Defaults lam = 0.01, mu = 0.1: the authors' run_me.sh for the 4-layer CNN and the 3-layer
MLP (lam 1e-4 and mu 0 for ResNet-18 and fastText; lam 0.01, mu 1.0 for HAR-CNN).

RECONSTRUCTION (from the authors' code; the paper text was not at hand here):
- G5's reduction (`magnitude`): `sample` (default) is the mean over the batch of each
  sample's L2 distance, the expectation over (x, y) the paper's losses are written as;
  `batch` is the authors' code, `torch.norm(feat_G - emb, 2)` on the [B, K] batch: the
  Frobenius norm of all the batch's differences at once (about sqrt(B) times larger);
- mu is the weight decay of the authors' separate SGD optimizers for CoV and GCE: as a loss
  term (mu/2) ||.||^2 it gives the same gradient mu theta; the three optimizers (phi + h_i,
  CoV, GCE; same lr) are here the run's one optimizer over all four (identical for SGD);
- G3 uses the client's GCE before the new global one replaces it (set_GCE reads
  self.GCE.embedding before copying the server's parameters in); an unsampled client
  holds the W^t the authors' server broadcast to every client;
- CoV and GCE are initialized as PyTorch's Linear / LayerNorm / Embedding defaults (the
  authors' modules), drawn from the run's seed without touching the global RNG.
Uploads: each sampled client's trained body in the run model's layout (kind "model", ref =
the global phi; the head entries in it are not used) and its CoV + GCE parameters (kind
"model", ref = the global CoV + GCE, sent in pieces of at most the run model's parameter
count, the length `Algorithm.receive` treats as parameters); h_i and p_i, g_i stay local.
Buffers: the body's BatchNorm running statistics are averaged with the body (FedAvg's sample
weights) and deployed with it; g_i and p_i are buffers of the training module, one row per
client, set by G3 and never trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedbench.algorithms._shared import WithTrainer, make_engine, train_on
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import nonneg
from fedbench.errors import ConfigError


@dataclass
class GPFLParams:
    lam: float = nonneg()  # lambda, weight of the magnitude-level guidance (G5)
    mu: float = nonneg()  # mu, L2 weight on CoV and GCE (G6)
    magnitude: Literal["sample", "batch"]  # G5's reduction over the batch (RECONSTRUCTION)


class CoV(nn.Module):
    """G1: the Conditional Valve, an affine transformation of f conditioned on c."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))

    def forward(self, f: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return F.relu(f * (self.gamma(context) + 1) + self.beta(context))


class GPFLModel(nn.Module):
    """The run model's body and head with CoV and GCE; the conditional inputs as buffers.
    Its forward is the deployed personalized model (G2's personalized route)."""

    def __init__(self, base: nn.Module, num_classes: int) -> None:
        super().__init__()
        dim = base.feature_dim
        self.body = base.body
        self.head = base.head
        self.cov = CoV(dim)
        self.gce = nn.Embedding(num_classes, dim)  # W
        self.register_buffer("cond_p", torch.zeros(dim))  # p_i
        self.register_buffer("cond_g", torch.zeros(dim))  # g_i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cov(self.body(x), self.cond_p))


def angle_loss(f_g: torch.Tensor, table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """G4: cross-entropy of the cosine similarities between f^G and every class embedding."""
    return F.cross_entropy(F.normalize(f_g) @ F.normalize(table).T, y)


def magnitude_loss(f_g: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    """G5: the L2 distance of f^G to the frozen embeddings of its labels: per sample, averaged
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
    """G6 on one batch; `frozen` is W^fr [C, K]."""
    f = model.body(x)
    f_p = model.cov(f, model.cond_p)
    f_g = model.cov(f, model.cond_g)
    loss = F.cross_entropy(model.head(f_p), y) + angle_loss(f_g, model.gce.weight, y)
    loss = loss + lam * magnitude_loss(f_g, frozen[y], magnitude)
    if mu:
        sq = sum(p.pow(2).sum() for p in model.cov.parameters()) + model.gce.weight.pow(2).sum()
        loss = loss + 0.5 * mu * sq
    return loss


def entry_index(spec, names: list[str], device) -> torch.Tensor:
    """Indices into `spec`'s flat state of the named parameters/buffers, in the given order."""
    parts = [torch.arange(spec.index[n].start, spec.index[n].stop) for n in names]
    return torch.cat(parts).to(device)


@ALGORITHMS.register()
class GPFL(WithTrainer, Algorithm):
    Params = GPFLParams
    attackable = True
    server_optimizable = True
    state_keys = ("w", "ext", "heads", "cond_p", "cond_g")

    def __init__(self, cfg, fed, engine, model_fn, **kw) -> None:
        super().__init__(cfg, fed, engine, model_fn, **kw)
        with torch.random.fork_rng(devices=[]):  # CoV and GCE from the run's seed only
            torch.manual_seed(self.run.seed)
            base = model_fn()
            if not all(hasattr(base, a) for a in ("body", "head", "feature_dim")):
                raise ConfigError("gpfl needs a model with a body/head split (models.FedModel)")
            module = GPFLModel(base, fed.num_classes)
        engine.to_module(engine.initial_state(), base)
        self.trainer = make_engine(self, module)
        spec, dev = self.trainer.spec, self.device
        run_names = [e.name for e in engine.spec.params + engine.spec.buffers]
        head = engine.model.head_params()
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
        self.run_head = torch.zeros(engine.n_state, dtype=torch.bool, device=dev)
        self.run_head[: engine.n_params] = engine.spec.mask(head, device=dev)

        init = self.trainer.initial_state()
        self.w = engine.initial_state()  # [D] phi (+ buffers), run layout; head entries unused
        self.heads = init[self.head_idx].repeat(self.N, 1)  # [N, H] h_i
        self.ext = init[self.ext_idx]  # [E] global CoV + GCE
        K = base.feature_dim
        self.cond_p = torch.zeros(self.N, K, device=dev)  # [N, K] p_i
        self.cond_g = torch.zeros(self.N, K, device=dev)  # [N, K] g_i
        counts = torch.stack(
            [torch.bincount(fed.y[ix], minlength=fed.num_classes) for ix in fed.train_idx]
        ).float()
        self.alpha = (counts / counts.sum(1, keepdim=True).clamp_min(1)).to(dev)  # [N, C]

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

    def receive_extra(self, rows: torch.Tensor, clients, ref: torch.Tensor) -> torch.Tensor:
        """The CoV + GCE uploads [C, E] as parameters ("model") in pieces of at most the run
        model's parameter count, the columns `Algorithm.receive` treats as parameters."""
        P = self.engine.n_params
        parts = [
            self.receive(rows[:, s : s + P], clients, ref=ref[s : s + P], kind="model")
            for s in range(0, rows.shape[1], P)
        ]
        return torch.cat(parts, 1)

    def conditional_inputs(self, idx: torch.Tensor, trained: torch.Tensor, held: torch.Tensor):
        """G3 for every client from the GCE it holds: `trained` [C, C', K] for clients `idx`,
        `held` [C', K] (the W^t sent to all) for the others."""
        p = self.alpha @ held
        g = held.mean(0).expand_as(p).clone()
        p[idx] = torch.bmm(self.alpha[idx][:, None], trained)[:, 0]
        g[idx] = trained.mean(1)
        return p, g

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        frozen = self.table(self.ext)  # W^fr = W^t
        objective = partial(
            gpfl_objective,
            frozen=frozen,
            lam=self.hp.lam,
            mu=self.hp.mu,
            magnitude=self.hp.magnitude,
        )
        res = train_on(self, self.trainer, self.rows(clients), clients, t, objective=objective)
        self.heads[idx] = res.states[:, self.head_idx]
        self.cond_p, self.cond_g = self.conditional_inputs(
            idx, self.table(res.states[:, self.ext_idx]), frozen
        )
        up = self.receive(res.states[:, self.run_idx], clients, ref=self.w)
        up_ext = self.receive_extra(res.states[:, self.ext_idx], clients, self.ext)
        wts = self.weights(clients)
        avg = self.server_step("w", self.w, wts @ up)
        self.w = torch.where(self.run_head, self.w, avg)  # the head entries are personal
        self.ext = self.server_step("ext", self.ext, wts @ up_ext, params=slice(None))
        n = len(clients) * (self.engine.n_state - int(self.run_head.sum()) + self.ext.numel())
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    def personal_state(self, i: int) -> torch.Tensor:
        """[D'] client i's deployed model in the training module's layout (`personal_model`)."""
        return self.rows([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.rows(np.arange(self.N))

    def personal_correct(self, i: int, idx: torch.Tensor) -> torch.Tensor:
        return self.trainer.correct(self.personal_state(i), idx)

    def personal_model(self, i: int) -> nn.Module:
        module = GPFLModel(self.model_fn(), self.fed.num_classes)
        return self.trainer.to_module(self.personal_state(i), module)

    def model_size(self) -> dict[str, float]:
        """The deployed model: phi, CoV and h_i (W only trains and guides)."""
        cov = sum(p.numel() for p in self.trainer.model.cov.parameters())
        return {"params_personal": self.engine.n_params + cov}
