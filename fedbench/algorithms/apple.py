"""APPLE (Luo & Wu: "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning", IJCAI 2022), following the authors' code (github.com/ljaiverson/pFL-APPLE).

Every client i owns a core model c_i and a directed-relationship vector p_i [N]; its
personalized model is the mixture w_i = sum_j p_ij c_j of the cores it downloaded at the
start of the round (its own core kept up to date). Per batch, with g = grad CE(w_i):

    c_i  <- c_i - lr * p_ii * g                                  (the chain rule)
    p_ij <- p_ij - eta_p [<g, c_j> + 2 lambda(r) mu (p_ij - p0_j)]  (full inner product)

both from the gradient at the same point; the pull towards p0 is the gradient of the
authors' `reg_loss` lambda(r) mu ||p_i - p0||^2 (no 1/2, hence the 2). c_i steps with the
run's optimizer (its state fresh each round unless `optim.persist_state`); p takes plain
gradient steps, eta_p decaying with the run's `optim.lr_decay` as the authors' `decay` does.
p_i and p0 start at 1/N. lambda(r) decays from 1 to 0 over the first L = int(l_frac * rounds)
rounds and is 0 after: `exp` (the authors' default) 0.001^(r / L), `cos` (cos(r pi / L) + 1) / 2.
The client uploads its core c_i (p_i stays on the client); the personalized model is the
mixture w_i.
The client loop runs batched: one step function (`step`: a batch's gradient at w_i, both
updates, the new mixture) over all sampled clients at once (`Engine.client_steps`; vmap, or
client after client on the sequential backend, as `Engine.backend_for` picks). The round's
clients share the downloaded cores and differ from them in their own row only, so k clients
mix as (p_i with p_ii = 0) @ cores + p_ii c_i and take <g, c_j> as cores @ g with entry i
replaced by <g, c_i>: no k copies of the N cores.
Defaults from the authors' code: eta_p (lr_coef) 0.001, mu 0.1, L = 0.1 of the rounds (its
cores use SGD lr 0.01, momentum 0.9: `optim.*`; the DiversiFed presets use Adam 1e-3 for
every method, as that paper does).

Not copied from PFLlib's variant: it takes the mean over tensors of per-tensor means of
g * c_j instead of the inner product, multiplies the core step by N, and uploads the mixture
as the core.

Buffers: kept local. Client i's running statistics live in its personalized model w_i,
are what its training forwards update (the mixture p_i @ cores is over parameters, as the
authors' and PFLlib's `parameters()` mixtures), and are copied into the buffer part of the
core it uploads; a signed mixture of statistics (p_ij can go below 0) is never formed.
Uploads: the core c_i, through `Algorithm.receive` (ref = the core it downloaded).

RECONSTRUCTION: all cores start from the run's common initialization (the authors' code
draws one initialization per core, PFLlib copies one); a client first sampled late mixes
the latest cores like any other; the authors' p update shares the cores' momentum, this code
uses plain steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import fraction, nonneg
from fedbench.engine import ClientStep, Optimized, StepBatch


@dataclass
class APPLEParams:
    eta_p: float = nonneg()  # learning rate of the directed relationships p
    mu: float = nonneg()  # weight of the pull of p towards p0
    l_frac: float = fraction()  # lambda(r) decays to 0 over the first l_frac * rounds rounds
    schedule: Literal["exp", "cos"]  # the decay of lambda(r)


def reg_schedule(r: int, L: int, kind: str = "exp") -> float:
    """lambda(r): 1 at r = 0, decaying over the first L rounds, 0 from round L on."""
    if r >= L:
        return 0.0
    if kind == "cos":
        return (math.cos(r * math.pi / L) + 1) / 2
    return 0.001 ** (r / L)


@ALGORITHMS.register()
class APPLE(Algorithm):
    about = About(
        name="APPLE",
        paper="Luo & Wu, IJCAI 2022",
        summary=(
            "personalized model sum_j p_ij core_j; the client learns its core and its p_i per batch"
        ),
        docs="papers/diversifed.md#apple-apple",
        pfllib="APPLE",
    )
    personal_rows = "theta"
    Params = APPLEParams
    attackable = True
    state_keys = ("cores", "p", "theta")

    def setup(self) -> None:
        self.cores = self.engine.initial_state().repeat(self.N, 1)  # c_j as the server holds them
        self.p = torch.full((self.N, self.N), 1.0 / self.N, device=self.device)
        self.p0 = torch.full((self.N,), 1.0 / self.N, device=self.device)
        self.theta = self.cores.clone()  # personalized mixtures w_i, with the client's buffers
        self.L = int(self.hp.l_frac * self.run.rounds)

    def step(self, t: int, cores: torch.Tensor) -> ClientStep:
        """One batch of the clients' loops in round t (`Engine.client_steps`) on the cores
        `cores` [N, D] they downloaded (shared, read-only): the gradient g at each client's
        mixture w_i (the `theta` rows, buffers updated in place), then the core step on
        p_ii g and the p step, both from that point, then w_i <- p_i @ cores with the new
        c_i and p_i (the mixture the next batch, or the round's end, reads). Aux: the loss.

        A client's cores are the downloaded ones with row i replaced by its own c_i. One
        client (k = 1, the sequential backend) takes p_i @ cores and cores @ g on a copy of
        them with row i written in (the per-client loop's products, bit for bit); k clients
        the same sums without k copies of the cores: (p_i with p_ii = 0) @ cores + p_ii c_i,
        and cores @ g with entry i replaced by <c_i, g>."""
        P = self.engine.n_params
        eta_p = self.hp.eta_p * self.optim.lr_decay**t
        reg2 = 2 * (reg_schedule(t, self.L, self.hp.schedule) * self.hp.mu)
        shared = cores[:, :P]  # [N, P] the downloaded cores
        # k = 1: one copy of the cores (made at the first such step), the stepping client's
        # own core written into its row, the downloaded one written back after the step
        mine: list[torch.Tensor] = []

        def mixture(p, core, ids) -> torch.Tensor:  # [k, P], with own[i] = c_i when k = 1
            if p.shape[0] == 1:
                return (p[0] @ mine[0][:, :P])[None]
            ar = torch.arange(p.shape[0], device=p.device)
            return (p.index_put((ar, ids), p.new_zeros(())) @ shared).addcmul_(
                p[ar, ids, None], core
            )

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            core, p, w, ids = st["core"], st["p"], st["theta"], st["id"]
            k, ar = p.shape[0], torch.arange(p.shape[0], device=p.device)
            if k == 1:
                if not mine:
                    mine.append(cores.clone())
                own = mine[0][:, :P]
                own.index_copy_(0, ids, core)  # row i = c_i (an index tensor: no host read)
            if batch.index == 0:
                w[:, :P] = mixture(p, core, ids)  # p_i @ cores at the round's start
            loss, g = batch.grad(w)  # updates the rows' running statistics
            if k == 1:
                grad_p = (own @ g[0])[None]
            else:
                grad_p = g @ shared.T
                grad_p[ar, ids] = (core * g).sum(1)  # <c_i, g>
            grad_p = grad_p + reg2 * (p - self.p0)  # at the same point as g
            batch.step("core", p[ar, ids, None] * g)  # the run's optimizer on the core rows
            with torch.no_grad():
                p -= eta_p * grad_p
            if k == 1:
                own.index_copy_(0, ids, core)
            w[:, :P] = mixture(p, core, ids)
            if k == 1:  # the next client's cores are the downloaded ones
                own.index_copy_(0, ids, shared.index_select(0, ids))
            return st, loss

        return step

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        eng, P = self.engine, self.engine.n_params
        downloaded = self.cores.clone()  # every sampled client gets the cores of round t-1
        idx = torch.as_tensor(clients, device=self.device)
        core = downloaded[idx, :P]  # the rows each client trains
        res = eng.client_steps(
            {
                "core": core,
                "p": self.p[idx],
                "theta": self.theta[idx],  # its [P:]: the client's running statistics
                "id": idx,
            },
            [int(i) for i in clients],
            self.step(t, downloaded),
            batch_size=self.run.batch_size,
            epochs=self.run.local_epochs,
            round=t,
            batched_on_cpu=True,  # one product over the shared cores serves all k clients
            optimized={"core": Optimized(self.optim, self.optim.lr_at(t), slot="core")},
        )
        st = res.states
        for c, n in enumerate(res.steps):
            if n == 0:  # no batch: the mixture of the downloaded cores
                st["theta"][c, :P] = st["p"][c] @ downloaded[:, :P]
        self.p[idx], self.theta[idx] = st["p"], st["theta"]
        trained = torch.cat([st["core"], st["theta"][:, P:]], 1)  # with the client's statistics
        self.cores[idx] = self.receive(trained, clients, ref=downloaded[idx])
        D, C = self.engine.n_state, len(clients)
        comm = self.comm(clients, up=C * D, down=C * self.N * D)
        return RoundReport(res.client_mean().mean(), comm)
