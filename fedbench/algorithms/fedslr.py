"""FedSLR (Huang et al., 2023, "Fusion of Global and Local Knowledge for Personalized
Federated Learning", Algorithms 1-3; authors' code huangtiansheng/fedslr; docs/papers/fedslr.md).

Each personalized model is w + p_i: w = theta, the low-rank global knowledge
representation (GKR), shared; p_i sparse and client i's own.

Phase I (the GKR, FedDyn-like; Algorithm 1 lines 4-9, Algorithm 3's server). Round t, each
sampled client i from x = theta^t: E epochs of the run's SGD on
    f_i(x) - <lambda_i, x - theta^t> + (alpha / 2) ||x - theta^t||^2 + (wd / 2) ||x||^2
(the linear and proximal terms: `terms.dynamic`; wd: the optimizer's weight decay, 1e-3 in
the presets as the authors' code), then lambda_i <- lambda_i - alpha (x_i - theta^t).
Server (memory-efficient, Algorithm 3: only h = (1/N) sum_i lambda_i is kept):
    h <- h - (alpha / N) sum_{i in S_t} (x_i - theta^t)
    z = mean_{i in S_t} x_i - h / alpha
    theta^{t+1} = prox_{tau ||.||_*}(z) per layer, tau = rank_penalty / alpha
(`engine.prox.nuclear_prox`: Conv (o, i, kh, kw) viewed as (o·kh, i·kw); 1-D tensors not
touched). alpha = 1 / eta_g = 0.1, rank_penalty = 1e-4. Phase I is FedDyn's client step and
server mean (`_shared.dynamic_clients`, `_shared.dynamic_server`, which feddyn.py calls too)
with the prox added. The per-client server form (z with every stored lambda_i) is in
tests/test_fedslr.py, which proves the two identical.

Phase II (the sparse component; Algorithm 2). Right after Phase I, each sampled client,
`fusion_epochs` (1) epochs with w = theta^t frozen, per batch (plain SGD at the round's lr)
    p <- p - eta_t (grad_p f_i(theta^t + p) + wd_f p);  p <- sign(p) max(|p| - eta_t lambda_s, 0)
lambda_s = sparse_penalty = 1e-3; wd_f = `fusion_weight_decay` = 1e-3 (the authors'
finetune default), whatever the run's optim.weight_decay. Phase II runs batched: one step
function (`fusion_step`) over all sampled clients at once (`Engine.client_steps`; vmap, or
client after client on the sequential backend, as `Engine.backend_for` picks; a client's
running statistics in Phase II start from theta^t's and are dropped after). p_init: `copy`
(the authors' code) starts the p of every Conv/Linear tensor (biases included) as a copy of
the initial weights and the norm layers' p at zero; `zero` starts every p at zero.

Reported: the GKR theta (global) and theta + p_i (personal, the mixed model), both with
the current theta as the authors' evaluation. Sizes (`model_size`, metrics columns): the
GKR sent factorized, per layer min(rank (m + n), m n) + the 1-D tensors; the mixed model
GKR + nonzeros of p_i (mean over clients; an [N] count of p_i's nonzeros is kept, updated
after each client's Phase II and checkpointed, so no [N, P] mask is built); p's density;
each matrix layer's rank (`rank.<parameter>`). Communication: uplink x_i (dense), downlink
the GKR factorized.
Buffers: averaged (weights >= 0) in the GKR; the mixed model uses the GKR's.
RECONSTRUCTION: the paper's equations are lost in its text; the updates above are
restored from Algorithms 1-3 and the authors' code (docs/papers/fedslr.md). Momentum in Phase II
is not used (plain SGD, as the update above).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import dynamic_clients, dynamic_server
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import nonneg, positive
from fedbench.engine import ClientStep, StepBatch
from fedbench.engine.prox import (
    LayerRank,
    factorized_params,
    matrix_entries,
    matrix_shape,
    nuclear_prox,
    soft_threshold,
)


@dataclass
class FedSLRParams:
    alpha: float = positive()
    rank_penalty: float = nonneg()
    sparse_penalty: float = nonneg()
    fusion_epochs: int = positive()
    fusion_weight_decay: float = nonneg()
    p_init: Literal["copy", "zero"]
    prox_solver: Literal["svd", "svd64", "gram"]


@ALGORITHMS.register()
class FedSLR(Algorithm):
    about = About(
        name="FedSLR",
        paper="Huang et al., TMLR 2023, arXiv:2302.11051, Alg. 1-3",
        summary=(
            "Phase I: a low-rank global model (GKR) by a FedDyn-like proximal method "
            "and a per-layer nuclear-norm prox on the server; Phase II: a sparse "
            "personal part p_i by proximal SGD with soft-thresholding; reports the GKR "
            "(global) and GKR + p_i (personal), their sizes and ranks"
        ),
        docs="papers/fedslr.md#phase-i-the-gkr-proximal-feddyn-like",
    )
    Params = FedSLRParams
    has_personal = True
    has_global = True
    attackable = True
    state_keys = ("theta", "lam", "h", "p", "p_nnz", "ranks")

    def setup(self) -> None:
        self.alpha = self.hp.alpha
        self.tau = self.hp.rank_penalty / self.alpha
        P = self.engine.n_params
        self.theta = self.engine.initial_state()  # [D] the GKR
        self.lam = torch.zeros(self.N, P, device=self.device)  # [N, P] the clients' lambda_i
        self.h = torch.zeros(P, device=self.device)  # [P] (1/N) sum_i lambda_i
        p0 = torch.zeros(P, device=self.device)
        if self.hp.p_init == "copy":
            p0[self.dense_layer_mask()] = self.theta[:P][self.dense_layer_mask()]
        self.p = p0.repeat(self.N, 1)  # [N, P] the clients' sparse components
        self.p_nnz = torch.full((self.N,), int((p0 != 0).sum()), dtype=torch.long)  # [N]
        self.ranks = [
            LayerRank(e.name, *matrix_shape(e.shape), min(matrix_shape(e.shape)))
            for e in matrix_entries(self.engine.spec)
        ]

    def dense_layer_mask(self) -> torch.Tensor:
        """[P]: the parameters of Conv and Linear modules (weights and biases)."""
        names = [
            f"{mod_name}.{pn}" if mod_name else pn
            for mod_name, mod in self.engine.model.named_modules()
            if isinstance(mod, nn.modules.conv._ConvNd | nn.Linear)
            for pn, _ in mod.named_parameters(recurse=False)
        ]
        return self.engine.spec.mask(names, device=self.device)

    # ------------------------------------------------------------------ the phases' pieces
    def server_average(self, x: torch.Tensor) -> torch.Tensor:
        """Phase I's server before the prox (Algorithm 3): h from the uploads x [C, D], and
        z = mean x_i - h / alpha. (tests/test_fedslr.py swaps in the per-client form.)"""
        self.h, z = dynamic_server(x, self.theta, self.h, self.alpha, self.N)
        return z

    def fusion_step(self, base: torch.Tensor, t: int) -> ClientStep:
        """One batch of the clients' Phase II (`Engine.client_steps`) with base [D] frozen:
        the gradient at base + p (the `w` rows, whose running statistics the forwards
        update), then the proximal SGD step on the `p` rows. Aux: the loss."""
        P, lr = self.engine.n_params, self.optim.lr_at(t)
        wd, thr = self.hp.fusion_weight_decay, lr * self.hp.sparse_penalty

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            p, w = st["p"], st["w"]
            w[:, :P] = base[:P] + p
            loss, g = batch.grad(w)
            p = p - lr * (g + wd * p)
            if thr > 0:
                p = soft_threshold(p, thr)
            return {**st, "p": p}, loss

        return step

    def fusion(self, clients: list[int], base: torch.Tensor, t: int) -> torch.Tensor:
        """The clients' p_i by proximal SGD on f_i(base + p), base frozen, all clients at
        once where the engine can; each client's mean loss [C]."""
        idx = torch.as_tensor(clients, device=self.device)
        res = self.engine.client_steps(
            {"p": self.p[idx], "w": base.repeat(len(clients), 1)},
            clients,
            self.fusion_step(base, t),
            batch_size=self.run.batch_size,
            epochs=self.hp.fusion_epochs,
            round=t,
            salt=1,
        )
        p = res.states["p"]
        self.p[idx] = p
        self.p_nnz[idx.cpu()] = (p != 0).sum(1).cpu()
        return res.client_mean()

    # ------------------------------------------------------------------ the contract
    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        sent = self.theta.clone()  # theta^t, the model the clients received
        gkr_sent = factorized_params(self.engine.spec, self.ranks)
        # Phase I, clients: the local problem from theta^t, then lambda_i (client side)
        res, self.lam[idx] = dynamic_clients(
            self, self.theta, self.lam[idx], clients, t, self.alpha
        )
        x = self.receive(res.states, clients, ref=self.theta)  # the uploads x_i
        # Phase II: each client's sparse p_i on its f_i(theta^t + p), theta^t frozen
        fusion_loss = self.fusion([int(i) for i in clients], sent, t)
        # Phase I, server: z = mean x_i - h / alpha, theta^{t+1} = prox_{tau ||.||_*}(z)
        z = self.server_average(x)
        if self.tau > 0:
            self.theta, self.ranks = nuclear_prox(
                z, self.engine.spec, self.tau, solver=self.hp.prox_solver
            )
        else:
            self.theta = z
        D, P, C = self.engine.n_state, self.engine.n_params, len(clients)
        down = C * (gkr_sent + D - P)  # the GKR factorized (+ buffers)
        diagnostics = {"fusion_loss": fusion_loss.mean(), **self.size_diagnostics()}
        return RoundReport(res.loss.mean(), self.comm(clients, up=C * D, down=down), diagnostics)

    def size_diagnostics(self) -> dict:
        nnz = self.p_nnz.float()  # [N] nonzeros of each p_i
        P = self.engine.n_params
        gkr = factorized_params(self.engine.spec, self.ranks)
        out = {
            "gkr_params": gkr,
            "mixed_params": gkr + float(nnz.mean()),
            "p_density": float(nnz.mean()) / P,
        }
        out.update({f"rank.{r.name}": r.rank for r in self.ranks})
        return out

    def model_size(self) -> dict:
        d = self.size_diagnostics()
        return {"params_personal": d["mixed_params"], "params_global": d["gkr_params"]}

    def global_state(self) -> torch.Tensor:
        return self.theta

    def personal_state(self, i: int) -> torch.Tensor:
        s = self.theta.clone()
        s[: self.engine.n_params] += self.p[i]
        return s

    def personal_states(self) -> torch.Tensor:
        s = self.theta.repeat(self.N, 1)
        s[:, : self.engine.n_params] += self.p
        return s

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.ranks = list(self.ranks)
