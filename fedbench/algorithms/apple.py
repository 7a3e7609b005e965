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
from fedbench.engine.optim import step_


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

    def client_update(self, i: int, cores: torch.Tensor, t: int) -> torch.Tensor:
        """Client i's round on its downloaded cores [N, D] (row i is trained in place);
        updates p_i and the mixture theta_i (its running statistics included); returns the
        mean training loss."""
        P, eng = self.engine.n_params, self.engine
        p, core = self.p[i], cores[i, :P]  # views: updated in place
        own = self.theta[i]  # view: the client's buffers live in own[P:]
        ost = eng.optim_states.get(self.optim, "core", i, core)
        lr, eta_p = self.optim.lr_at(t), self.hp.eta_p * self.optim.lr_decay**t
        reg = reg_schedule(t, self.L, self.hp.schedule) * self.hp.mu
        losses = []
        for x, y in eng.batches(i, self.run.batch_size, epochs=self.run.local_epochs, round=t):
            state = torch.cat([p @ cores[:, :P], own[P:]])
            loss, g = eng.grad_at(state, x, y)  # updates state's running statistics
            own[P:] = state[P:]
            losses.append(loss)
            grad_p = cores[:, :P] @ g + 2 * reg * (p - self.p0)  # at the same point as g
            with torch.no_grad():
                step_(self.optim, core, p[i] * g, ost, lr)
                p -= eta_p * grad_p
        eng.optim_states.keep(self.optim, "core", i, ost)
        cores[i, P:] = own[P:]  # the uploaded core carries the client's statistics
        own[:P] = p @ cores[:, :P]
        return torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        downloaded = self.cores.clone()  # every sampled client gets the cores of round t-1
        idx = torch.as_tensor(clients, device=self.device)
        losses, trained = [], []
        for i in clients:
            cores = downloaded.clone()
            losses.append(self.client_update(int(i), cores, t))
            trained.append(cores[int(i)])
        self.cores[idx] = self.receive(torch.stack(trained), clients, ref=downloaded[idx])
        D, C = self.engine.n_state, len(clients)
        comm = self.comm(clients, up=C * D, down=C * self.N * D)
        return RoundReport(torch.stack(losses).mean(), comm)
