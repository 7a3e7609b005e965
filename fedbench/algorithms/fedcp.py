"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma, Guan: "FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy", KDD 2023, arXiv:2307.01217; authors'
code TsingZ0/FedCP, the same in PFLlib's clientcp.py / servercp.py).

Client i holds a feature extractor W_i^fe (the run model's body), a Conditional Policy Network
(CPN) Theta_i, its personalized head W_i^hd, and two frozen copies of what the server sent: the
global head W^hd and the global feature extractor W^fe (Figure 2(a)). On a sample x, with
h = W_i^fe(x) in R^K (K = `feature_dim`):
    v_i = sum_c W_i^hd[c, :],  v^_i = v_i / ||v_i||_2       (client-specific conditional input)
    z = ReLU(LayerNorm(A (h (.) v^_i) + a)) in R^{2K}       (Theta_i = {A, a, LayerNorm})
    (s_i, r_i) = softmax over the two K-halves of (z + g) / tau  (per feature: s_i + r_i = 1;
                 g Gumbel(0, 1) noise in training, `gumbel`; none at inference)
    out_i = W^hd(r_i (.) h) + W_i^hd(s_i (.) h)             (the "unified head" W^_i^hd, Eq. (6))
r_i (.) h is the global feature information, processed by the frozen global head; s_i (.) h the
personalized one, processed by the personalized head (Figure 2(a); the authors' slides).
Local objective on a batch B, E epochs of the run's optimizer:
    eps_i = CE(out_i, y) + lambda eps_i^d,
    eps_i^d = MMD^2(W_i^fe(B), W^fe(B))
            = mean_{j,k} [k(h_j, h_k) + k(g_j, g_k) - 2 k(h_j, g_k)],
    k(a, b) = sum_{sigma in (10, 15, 20, 50)} exp(-||a - b||^2 / (2 sigma))
(h_j = W_i^fe(x_j), g_j = W^fe(x_j); the biased estimator with the RBF mixture of the authors'
code, `mmd2`), trained: W_i^fe, Theta_i, W_i^hd; frozen: W^hd, W^fe (Figure 2(a)'s legend:
"Upload & Overwrite & Train", "Upload & Train", "Overwrite & Freeze"). The bandwidths are
absolute, so lambda's pull depends on the features' scale and the learning rate. Measured on
tests' FMNIST federation (20 clients, pat-2, MLP 784-64-10, feature norms ~3 at the start):
at the run's default lr 0.05, lambda = 5 makes local training oscillate (MMD^2 ~3 of its
maximum 8 within the first round) and the features collapse (mean norm 0.19 after 10 rounds,
14 with lambda = 0): 0.53 personalized accuracy after 10 rounds, 0.95 with lambda = 1
(PFLlib's default) or 0; at lr 0.01, 0.80 against 0.87 with lambda = 0. The authors pair
lambda = 5 with lr 0.005 (their main.py's default).
Server (Figure 2(b)), w_i = n_i / sum_{sampled} n_j:
    W^fe <- sum_i w_i W_i^fe,  Theta <- sum_i w_i Theta_i,  W^hd <- sum_i w_i U_i,
with U_i the head client i uploads (`head_upload`). Client i then deploys (W^fe, Theta, W^hd,
W_i^hd): the latest aggregates with its own personalized head, which is what the authors'
code evaluates (after the download, before the next local training).
RECONSTRUCTION (the paper leaves these open; only its figures and the authors' slides and
code were available to us, so equation numbers other than Eq. (6) are not cited):
- `head_upload`: `mean` (default): U_i = (W_i^hd + W^hd) / 2, the authors' code
  (`generate_upload_head`); Figure 2(b) draws the head upload from the unified head W^_i^hd.
  `personal`: U_i = W_i^hd (the legend's "Upload & Train" on W_i^hd read literally).
- v_i: the sum over classes of the personalized head's weight, L2-normalized, multiplied into
  h (the authors' code: `set_head_g` and `Ensemble.forward`; the slides: "client-specific v_i
  as the conditional input"). It is detached, fixed during a round at the head the round starts
  from (the code computes it after the client's training, the head the next round starts
  from); before a client's first visit the code uses U(0, 1) noise, we use its initial head.
- Gumbel-Softmax with tau = 1 in training (the code's `F.gumbel_softmax(tau=1, hard=False)`);
  the code also draws noise at inference, we score the noise-free policy softmax(z / tau) so
  that accuracy is a function of the model. The noise comes from a generator seeded by (run
  seed, round, client), so a client's draws do not depend on the other clients of its round.
- CPN = Linear(K, 2K), LayerNorm(2K), ReLU (the code's `ConditionalSelection(K, K)`; the
  figure's Linear -> LayerNorm -> ReLU), built once for all clients from the run's seed; the
  personalized head starts as a copy of the global head on every client, as in the code.
- Partial participation: every client deploys, and starts its next training from, the latest
  global parts (the code overwrites the extractor of every client but the global head and CPN
  only of the round's clients; the others keep those of their last round).
The module is `CPModel` around the run's model, trained by its own engine with the run's
settings; its state rows are [body | head (W^hd) | phead (W_i^hd) | cpn | gbody (W^fe) |
buffers]. No global model is reported: a prediction needs a personalized head.
Uploads: W_i^fe with U_i and the extractor's buffers, in the run model's layout (kind "model",
ref = what the server sent), and Theta_i (kind "model", ref = Theta). Communication: those,
each way (the server sends W^fe, W^hd, Theta; the client copies W^fe into its frozen copy).
Buffers: the extractor's (BatchNorm running statistics) are averaged with it (weights >= 0) and
copied into the frozen W^fe (RECONSTRUCTION: the authors' code copies parameters only, so there
each client keeps its own statistics); the frozen copy runs in training mode in the MMD term as
in the authors' code (batch statistics; its own running statistics are discarded, never
uploaded or deployed). The CPN's LayerNorm has none.
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
from fedbench.algorithms._shared import TrainerLayout, base_columns, make_engine, train_on
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import nonneg, positive
from fedbench.engine import client_row, sequential_objective
from fedbench.engine.plan import Objective
from fedbench.errors import ConfigError

# The RBF kernel mixture of the authors' MMD (clientcp.py, kernel "rbf"):
# k(a, b) = sum_s exp(-||a - b||^2 / (2 s))
RBF_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)


@dataclass
class FedCPParams:
    lam: float = nonneg()  # lambda: weight of the MMD term eps_i^d
    tau: float = positive()  # temperature of the policy softmax
    gumbel: bool  # Gumbel(0, 1) noise on the CPN logits in training
    head_upload: Literal["mean", "personal"]  # U_i: (W_i^hd + W^hd) / 2 | W_i^hd


def mmd2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Biased MMD^2 between the rows of a and b [B, K]: mean over all pairs (diagonal
    included) of k(a_j, a_k) + k(b_j, b_k) - 2 k(a_j, b_k), k the RBF mixture above."""
    sa, sb = (a * a).sum(1), (b * b).sum(1)
    daa = sa[:, None] + sa[None, :] - 2 * a @ a.T  # squared distances by the Gram expansion
    dbb = sb[:, None] + sb[None, :] - 2 * b @ b.T
    dab = sa[:, None] + sb[None, :] - 2 * a @ b.T

    def k(d: torch.Tensor) -> torch.Tensor:
        return sum(torch.exp(-0.5 * d / s) for s in RBF_BANDWIDTHS)

    return (k(daa) + k(dbb) - 2 * k(dab)).mean()


class CPModel(nn.Module):
    """The run model's body (W_i^fe) and head (the global head W^hd), a personalized head
    (W_i^hd), the CPN (Theta_i) and a frozen copy of the global body (W^fe, for the MMD)."""

    def __init__(self, base: nn.Module, tau: float) -> None:
        super().__init__()
        k = int(base.feature_dim)
        self.body = base.body
        self.head = base.head
        self.phead = copy.deepcopy(base.head)
        self.cpn = nn.Sequential(nn.Linear(k, 2 * k), nn.LayerNorm(2 * k), nn.ReLU())
        self.gbody = copy.deepcopy(base.body)
        self.feature_dim = k
        self.tau = tau

    def context(self) -> torch.Tensor:
        """v^_i [K]: the personalized head's weight summed over classes, L2-normalized."""
        return F.normalize(self.phead.weight.detach().sum(0), dim=0)

    def policy(
        self, h: torch.Tensor, ctx: torch.Tensor, gen: torch.Generator | None = None
    ) -> torch.Tensor:
        """s_i [B, K], the personalized share of each feature (r_i = 1 - s_i); Gumbel noise
        from `gen` when given."""
        z = self.cpn(h * ctx).view(h.shape[0], 2, -1)
        if gen is not None:  # Gumbel(0, 1) = -log(Exp(1))
            e = torch.empty(z.shape, device=z.device, dtype=z.dtype).exponential_(generator=gen)
            z = z - e.log()
        return torch.softmax(z / self.tau, dim=1)[:, 0]

    def mix(
        self, h: torch.Tensor, ctx: torch.Tensor, gen: torch.Generator | None = None
    ) -> torch.Tensor:
        """out_i = W^hd(r_i h) + W_i^hd(s_i h)."""
        s = self.policy(h, ctx, gen)
        return self.head((1 - s) * h) + self.phead(s * h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.body(x), self.context())


def fedcp_loss(
    model: CPModel,
    x: torch.Tensor,
    y: torch.Tensor,
    c: int,
    ctx: torch.Tensor,
    lam: float,
    gens: list[torch.Generator] | None,
) -> torch.Tensor:
    """CE(out_i, y) + lambda MMD^2(W_i^fe(x), W^fe(x)) for the client at position c (its
    conditional input ctx[c], its noise generator gens[c])."""
    h = model.body(x)
    loss = F.cross_entropy(model.mix(h, client_row(ctx, c), None if gens is None else gens[c]), y)
    if lam:
        with torch.no_grad():  # W^fe is frozen: its features are a constant target
            g = model.gbody(x)
        loss = loss + lam * mmd2(h, g)
    return loss


@ALGORITHMS.register()
class FedCP(TrainerLayout, Algorithm):
    about = About(
        name="FedCP",
        paper="Zhang et al., KDD 2023",
        summary=(
            "a conditional policy network splits each feature between a frozen global "
            "head and a personalized head; MMD to the frozen global extractor"
        ),
        docs="algorithms.md#fedcp-fedcp",
        pfllib="FedCP",
    )
    Params = FedCPParams
    needs_head = True
    attackable = True
    server_optimizable = True  # server_opt steps on the averages of W^fe, W^hd and Theta
    state_keys = ("w", "phead")

    def setup(self) -> None:
        base = self.model_fn()
        if not all(hasattr(base, a) for a in ("body", "head", "feature_dim")):
            raise ConfigError("fedcp needs a model with a body/head split (models.FedModel)")
        self.engine.to_module(self.engine.initial_state(), base)
        # the CPN's initialization from a stream of its own derived from the run's seed: the
        # run's model was drawn right after torch.manual_seed(seed), so that seed itself would
        # make the CPN's weight a rescaled copy of the body's first layer
        cpn_seed = int(np.random.SeedSequence([self.run.seed, 0xC9]).generate_state(1)[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cpn_seed)
            model = CPModel(base, self.hp.tau)
        self.trainer = make_engine(self, model)
        spec, dev = self.trainer.spec, self.device

        def cols(prefix: str) -> torch.Tensor:
            return torch.cat(
                [torch.arange(e.start, e.stop) for e in spec.params if e.name.startswith(prefix)]
            ).to(dev)

        self.base_cols = base_columns(spec, self.engine.spec, "", dev)  # [D]: body, head, buffers
        base_entries = self.engine.spec.params + self.engine.spec.buffers
        # the frozen copy, entry for entry in the base layout's body order
        self.gbody_cols = torch.cat(
            [
                torch.arange(spec.index["g" + e.name].start, spec.index["g" + e.name].stop)
                for e in base_entries
                if e.name.startswith("body.")
            ]
        ).to(dev)
        self.body_in_base = torch.zeros(self.engine.n_state, dtype=torch.bool, device=dev)  # [D]
        self.head_in_base = torch.zeros_like(self.body_in_base)
        for e in base_entries:
            if e.name.startswith("body."):
                self.body_in_base[e.start : e.stop] = True
            elif e.name.startswith("head."):
                self.head_in_base[e.start : e.stop] = True
        self.head_cols = cols("head.")
        self.phead_cols = cols("phead.")
        self.cpn_cols = cols("cpn.")
        self.trainable = spec.mask(
            [e.name for e in spec.params if e.name.split(".")[0] in ("body", "phead", "cpn")],
            device=dev,
        )  # [P']: W_i^fe, W_i^hd, Theta_i; W^hd and W^fe frozen
        self.w = self.trainer.initial_state()  # [D'] the global parts (phead entries unused)
        self.phead = self.w[self.phead_cols].repeat(self.N, 1)  # [N, H] each client's W_i^hd

    # ------------------------------------------------------------------ states
    def states_of(self, clients) -> torch.Tensor:
        """[C, D']: the global parts with each client's personalized head."""
        s = self.w.repeat(len(clients), 1)
        s[:, self.phead_cols] = self.phead[torch.as_tensor(clients, device=self.device)]
        return s

    def contexts(self, heads: torch.Tensor) -> torch.Tensor:
        """v^_i [C, K] from personalized heads [C, H] (`phead_cols` order: weight, bias)."""
        e = self.trainer.spec.index["phead.weight"]
        weight = heads[:, : e.stop - e.start].reshape(heads.shape[0], *e.shape)
        return F.normalize(weight.sum(1), dim=1)

    def generators(self, t: int, clients) -> list[torch.Generator]:
        """One Gumbel-noise generator per client, seeded by (run seed, round, client)."""
        out = []
        for i in clients:
            seed = np.random.SeedSequence([self.run.seed, t, int(i), 0xFEDC]).generate_state(1)
            out.append(torch.Generator(device=self.device).manual_seed(int(seed[0])))
        return out

    # ------------------------------------------------------------------ the round
    def objective(self, t: int, clients) -> Objective:
        """Round t's local objective for `clients` (their conditional inputs, their Gumbel
        noise generators); with noise it runs client after client (`sequential_objective`:
        the generators draw in each client's own order, which vmap cannot reproduce)."""
        idx = torch.as_tensor(clients, device=self.device)
        loss = partial(
            fedcp_loss,
            ctx=self.contexts(self.phead[idx]),
            lam=self.hp.lam,
            gens=self.generators(t, clients) if self.hp.gumbel else None,
        )
        if self.hp.gumbel:
            loss = sequential_objective(loss, "Gumbel noise drawn from per-client generators")
        return loss

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        start = self.states_of(clients)
        loss = self.objective(t, clients)
        res = train_on(
            self, self.trainer, start, clients, t, objective=loss, trainable=self.trainable
        )
        trained = res.states
        self.phead[idx] = trained[:, self.phead_cols]
        # uploads: W_i^fe, U_i and the buffers in the run model's layout; Theta_i
        up = trained[:, self.base_cols]
        head_up = trained[:, self.phead_cols]
        if self.hp.head_upload == "mean":
            head_up = 0.5 * (head_up + start[:, self.head_cols])
        up[:, self.head_in_base] = head_up
        ref = start[:, self.base_cols]
        got = self.receive(up, clients, ref=ref, kind="model")
        cpn, cpn0 = trained[:, self.cpn_cols], start[:, self.cpn_cols]
        got_cpn = self.receive(cpn, clients, ref=cpn0, kind="model", n_params=cpn.shape[1])
        wts = self.weights(clients)
        old = torch.cat([self.w[self.base_cols], self.w[self.cpn_cols]])
        avg = torch.cat([wts @ got, wts @ got_cpn])
        is_param = torch.ones_like(old, dtype=torch.bool)
        is_param[self.engine.n_params : self.engine.n_state] = False  # the extractor's buffers
        new = self.server_step("w", old, avg, params=is_param)
        D = self.engine.n_state
        self.w[self.base_cols] = new[:D]
        self.w[self.cpn_cols] = new[D:]
        self.w[self.gbody_cols] = new[:D][self.body_in_base]  # the next round's frozen W^fe
        n = len(clients) * (D + self.cpn_cols.numel())
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    # ------------------------------------------------------------------ deployment
    def personal_state(self, i: int) -> torch.Tensor:
        """[D'] client i's model (`CPModel` layout): the global parts with its W_i^hd."""
        return self.states_of([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.states_of(np.arange(self.N))

    def trainer_module(self) -> nn.Module:
        return CPModel(self.model_fn(), self.hp.tau)

    def model_size(self) -> dict[str, float]:
        """A deployed model: W^fe, Theta, W^hd and W_i^hd (the frozen W^fe copy only serves
        training: Figure 2's caption)."""
        frozen = sum(
            e.stop - e.start for e in self.trainer.spec.params if e.name.startswith("gbody.")
        )
        return {"params_personal": self.trainer.n_params - frozen}
