"""PLGU, "Personalize Locally, Generalize Universally" (Qu et al., CVPR 2023, "How to
Prevent the Poor Performance Clients for Personalized Federated Learning?"; docs/papers/plgu.md).
Three algorithms built on LWSAM (`fedbench.engine.lwsam`: layer scores, eq. 6; the
perturbation eps_l = rho xi_l g_l / ||g||_2, eq. 5 with p = q = 2):

PLGU-LF (`plgu_lf`, Algorithms 1-2, eq. 7; global model w, personalized theta_i).
  Client i in round t: xi = eq. 6 scores of (theta_i, w); the D layers with the largest
  xi are L_Per, the rest L_Uni; theta_i^0 = (L_Uni from w, L_Per its own); w_i^0 = w. Each
  local step on batch b: (a) g = grad F_b(theta_i), theta_i <- theta_i - eta g;
  (b) eps = LWSAM(g, xi); (c) w_i <- w_i - eta grad F_b(w_i + eps).
  Server: w <- w + (1/C) sum_i (w_i - w). Reports w (Table 1) and theta_i (Table 2).
PLGU-GRep (`plgu_grep`, Algorithm 3, eqs. 9-13): FedRep (`fedrep.py`) whose body phase is,
  per mini-batch: phi_i = phi - eta grad_phi F_b(h_i, phi) (eq. 11); xi over the body's
  layers of (phi_i, reference) (eq. 10); eps = LWSAM(grad_phi F_b at phi_i, xi) (eq. 12);
  phi~_i = phi_i - eta grad_phi F_b(h_i, phi_i + eps) (eq. 13). Upload phi~_i; the server
  averages them with weight 1/C (line 14).
PLGU-GHN (`plgu_ghn`, the supplement's eqs. 24-25, not available): pFedHN (`pfedhn.py`) with
  LWSAM on the hypernetwork update: xi_l = ||Delta_l|| / dim(theta_l) over the generated
  target layers; g = VJP(h at phi, Delta); eps = rho Lambda g_phi / ||g_phi|| on phi only
  (the head generating target layer l scaled by xi_l, the trunk by the mean score, the
  embeddings v_i not perturbed); g' = VJP(h at phi + eps, Delta); phi, v_i <- step with g'.

Every step of the run's optimizer (`optim`) is `optim.step_` on flat tensors; with plain
SGD it is the paper's `- eta g`.

RECONSTRUCTIONS (docs/papers/plgu.md; each a config key):
- what a layer is: `model.layer_unit` (op_norm default: a Conv/Linear with its norm);
- score normalization `score_norm`: mean1 (default) | sum1; `scores: uniform` replaces
  Lambda by the identity (LWSAM = SAM; L_Per is still chosen by eq. 6);
- PLGU-LF: what D counts, `d_counts`: personal (default, Alg. 2: D = |L_Per|) | universal
  (Sec. 6.1: D = |L_Uni|); Alg. 1 line 7's gradient is taken at the perturbed universal copy
  w_i + eps; `perturb`: universal (default, eq. 7: eps = 0 on L_Per) | all; `ascent_grad`:
  personal (default, the g of step a) | universal (a third pass at w_i, as SAM). Ties in xi
  (all zero on a client's first visit, where theta_i starts as w) go to the shallower
  layers (the paper: shallow layers personalize). A client never visited deploys w.
  BatchNorm statistics (none in the PLGU presets' GroupNorm nets) stay with their model.
- PLGU-GRep: `body_steps` mini-batches (default 1: Alg. 3 line 11); `score_ref`: this_step
  (default: xi from phi_i vs the downloaded phi^t) | last_upload (vs the body this client
  uploaded last time; phi^t before its first upload); the upload is phi~_i (the poster).
- PLGU-GHN: the whole of its update (above), as docs/papers/plgu.md states it.

Uploads: PLGU-LF's w_i, PLGU-GRep's phi~_i (FedRep's round), PLGU-GHN's theta~_i (pFedHN's
visit), each through `receive` as a model with ref = the state the client trained from.
Buffers: PLGU-LF: w's averaged (weights >= 0: w + sum a_i (w_i - w) with a_i >= 0 summing to 1
is a convex mix), theta_i keeps its own (kept local); PLGU-GRep: averaged (weights >= 0)
with the body, as FedRep; PLGU-GHN: shared and averaged by sample count, as pFedHN.
Every hand-written step runs in training mode (`Engine.grad_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport, TrainedOrGlobal
from fedbench.algorithms.fedrep import FedRep
from fedbench.algorithms.params import Weighting, hp, nonneg
from fedbench.algorithms.pfedhn import PFedHN, PFedHNParams
from fedbench.engine import SAM, TrainResult
from fedbench.engine.lwsam import (
    LayerMap,
    layer_scores,
    lwsam_perturbation,
    lwsam_scale,
    normalize_scores,
)
from fedbench.engine.optim import init_state, step_

Scores = Literal["eq6", "uniform"]
ScoreNorm = Literal["mean1", "sum1"]


@dataclass
class PLGULFParams:
    rho: float = nonneg()  # LWSAM radius
    personal_layers: int = hp(ge=0)  # D
    d_counts: Literal["personal", "universal"]  # what D counts
    scores: Scores
    score_norm: ScoreNorm
    perturb: Literal["universal", "all"]
    ascent_grad: Literal["personal", "universal"]
    weighting: Weighting


@dataclass
class PLGUGRepParams:
    head_epochs: int = hp(ge=1)  # K epochs on the head
    body_steps: int = hp(ge=1)  # mini-batches of the LWSAM body update
    rho: float = nonneg()
    scores: Scores
    score_norm: ScoreNorm
    score_ref: Literal["this_step", "last_upload"]
    weighting: Weighting


@dataclass
class PLGUGHNParams(PFedHNParams):
    rho: float = nonneg()  # LWSAM radius on the hypernetwork
    scores: Scores
    score_norm: ScoreNorm


def score_rule(hp) -> str:
    """The `normalize_scores` rule of a PLGU config: `scores` = eq6 | uniform, `score_norm`."""
    return "uniform" if hp.scores == "uniform" else hp.score_norm


@ALGORITHMS.register("plgu_lf")
class PLGULF(TrainedOrGlobal, Algorithm):
    about = About(
        name="PLGU-LF",
        paper="Qu et al., CVPR 2023, Alg. 1-2",
        summary=(
            "the D most personalized layers stay local; the global model is trained "
            "with layer-wise SAM (LWSAM, eq. 4-6); reports global and personal models"
        ),
        docs="papers/plgu.md#plgu-lf-plgu_lf",
    )
    Params = PLGULFParams
    attackable = True
    state_keys = ("w", "theta", "seen")

    def __init__(self, cfg, fed, engine, model_fn, **kw) -> None:
        super().__init__(cfg, fed, engine, model_fn, **kw)
        hp = self.hp
        self.rule = score_rule(hp)
        self.layers = LayerMap(engine.spec, engine.model.layers(), self.device)
        self.w = engine.initial_state()
        self.init_rows()

    def personal_layers(self, xi: torch.Tensor) -> torch.Tensor:
        """Alg. 2 line 7: [L] bool, True on the layers with the largest scores (L_Per)."""
        L, D = self.layers.n, self.hp.personal_layers
        n_per = min(D, L) if self.hp.d_counts == "personal" else max(L - D, 0)
        order = torch.sort(xi, descending=True, stable=True).indices
        per = torch.zeros(L, dtype=torch.bool, device=xi.device)
        per[order[:n_per]] = True
        return per

    def client(self, i: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Algorithm 1 for client i: (theta_i, w_i, mean personal loss)."""
        eng, P = self.engine, self.engine.n_params
        w = self.w.clone()
        theta = self.theta[i].clone() if self.seen[i] else self.w.clone()
        xi = layer_scores(theta, w, self.layers)  # eq. 6
        per = self.layers.mask(self.personal_layers(xi))  # [P]
        theta[:P] = torch.where(per, theta[:P], w[:P])  # Alg. 2 line 8
        keep = ~per if self.hp.perturb == "universal" else None
        scale = lwsam_scale(normalize_scores(xi, self.rule), self.layers, keep)
        sam = SAM(self.hp.rho, scale)
        lr = self.optim.lr_at(t)
        st_p = eng.optim_states.get(self.optim, "personal", i, theta[:P])
        st_u = eng.optim_states.get(self.optim, "universal", i, w[:P])
        losses = []
        for x, y in eng.batches(i, self.run.batch_size, epochs=self.run.local_epochs, round=t):
            loss, g = eng.grad_at(theta, x, y)  # (a) g = grad F_b(theta_i)
            losses.append(loss)
            eps = sam.perturbation(g, sam.scale)  # (b) eps from the same g
            step_(self.optim, theta[:P], g, st_p, lr)  # (a) theta_i <- theta_i - eta g
            if self.hp.ascent_grad == "universal":  # (b) instead: ascent gradient at w_i (SAM)
                eps = sam.perturbation(eng.grad_at(w, x, y)[1], sam.scale)
            _, g = eng.grad_at(w, x, y, at=eps)  # (c) g~ = grad F_b(w_i + eps)
            step_(self.optim, w[:P], g, st_u, lr)  # w_i <- w_i - eta g~
        eng.optim_states.keep(self.optim, "personal", i, st_p)
        eng.optim_states.keep(self.optim, "universal", i, st_u)
        return theta, w, torch.stack(losses).mean()

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        thetas, ws, losses = zip(*(self.client(int(i), t) for i in clients))
        idx = torch.as_tensor(clients, device=self.device)
        self.set_trained(idx, torch.stack(thetas))
        delta = self.receive(torch.stack(ws), clients, ref=self.w) - self.w  # Alg. 2 line 10
        self.w = self.w + self.weights(clients, self.hp.weighting) @ delta  # line 11
        return RoundReport(torch.stack(losses).mean(), self.comm(clients))


@ALGORITHMS.register("plgu_grep")
class PLGUGRep(FedRep):
    about = About(
        name="PLGU-GRep",
        paper="Qu et al., CVPR 2023, Alg. 3",
        summary="FedRep whose body update is an LWSAM step (eq. 9-13)",
        docs="papers/plgu.md#plgu-grep-plgu_grep",
    )
    Params = PLGUGRepParams
    state_keys = ("phi", "heads", "uploaded")

    def __init__(self, cfg, fed, engine, model_fn, **kw) -> None:
        super().__init__(cfg, fed, engine, model_fn, **kw)
        self.rule = score_rule(self.hp)
        names = set(engine.model.body_params())
        body = [layer for layer in engine.model.layers() if set(layer.params) <= names]
        self.body_layers = LayerMap(engine.spec, body, self.device)
        # last_upload: the body each client uploaded last time (NaN: not yet)
        self.uploaded = None
        if self.hp.score_ref == "last_upload":
            self.uploaded = torch.full((self.N, engine.n_state), float("nan"), device=self.device)

    def body_step(self, s: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        """phi <- phi - eta g: one step of the run's optimizer from a fresh state
        (SGD: eta (g + wd phi)), on the body only."""
        P = self.engine.n_params
        step_(self.optim, s[:P], g, init_state(self.optim, s[:P]), lr, mask=self.body_mask)

    def body_phase(self, states: torch.Tensor, clients, t: int) -> TrainResult:
        """Eqs. 10-13, `body_steps` times, each on one mini-batch; head frozen."""
        eng, body = self.engine, self.body_mask
        rho, lr = self.hp.rho, self.optim.lr_at(t)
        out, losses = states.clone(), []
        for c, i in enumerate(int(i) for i in clients):
            s = out[c]
            ref = states[c]
            if self.uploaded is not None and not self.uploaded[i].isnan().any():
                ref = self.uploaded[i]
            steps = self.hp.body_steps
            for x, y in eng.batches(i, self.run.batch_size, steps=steps, round=t, salt=2):
                loss, g = eng.grad_at(s, x, y)  # eq. 11: phi_i = phi - eta g
                losses.append(loss)
                self.body_step(s, g, lr)
                xi = normalize_scores(layer_scores(s, ref, self.body_layers), self.rule)  # eq. 10
                _, g = eng.grad_at(s, x, y)  # eq. 12: eps from the body gradient at phi_i
                eps = lwsam_perturbation(g * body, xi, self.body_layers, rho)
                _, g = eng.grad_at(s, x, y, at=eps)  # eq. 13: phi~_i = phi_i - eta g(phi_i + eps)
                self.body_step(s, g, lr)
            if self.uploaded is not None:
                self.uploaded[i] = s
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        return TrainResult(out, loss.expand(len(out)), [self.hp.body_steps] * len(out))


@ALGORITHMS.register("plgu_ghn")
class PLGUGHN(PFedHN):
    about = About(
        name="PLGU-GHN",
        paper="Qu et al., CVPR 2023 (supplement eq. 24-25, reconstruction)",
        summary="pFedHN with LWSAM on the hypernetwork update",
        docs="papers/plgu.md#plgu-ghn-plgu_ghn",
    )
    Params = PLGUGHNParams

    def __init__(self, cfg, fed, engine, model_fn, **kw) -> None:
        super().__init__(cfg, fed, engine, model_fn, **kw)
        self.rule = score_rule(self.hp)
        spec, gen = engine.spec, set(self.targets.generated)
        layers = [layer for layer in engine.model.layers() if set(layer.params) <= gen]
        self.gen_layers = LayerMap(spec, layers, self.device)
        # Lambda over the hypernetwork's tensors: head j generates target tensor j, of layer
        # layer_of[j]; id n = the trunk (the mean score), n + 1 = the embeddings (0).
        n = self.gen_layers.n
        layer_of = [int(self.gen_layers.seg[spec.index[p].start]) for p in self.targets.generated]
        ids = []
        for e in self.hspec.params:
            if e.name.startswith("heads."):
                ids.append(layer_of[int(e.name.split(".")[1])])
            else:
                ids.append(n + 1 if e.name.startswith("embeddings.") else n)
        self.hn_ids = torch.tensor(ids, device=self.device)

    def hn_scale(self, xi: torch.Tensor) -> torch.Tensor:
        """Lambda per hypernetwork tensor ([len(hspec.params)]) for target-layer scores xi."""
        return torch.cat([xi, xi.mean().reshape(1), xi.new_zeros(1)])[self.hn_ids]

    def hypernet_grad(self, i: int, delta: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(self.engine.n_params, device=self.device)
        full[self.gen_mask] = delta
        xi = normalize_scores(self.gen_layers.norms(full) / self.gen_layers.dims, self.rule)
        g = self.vjp(i, delta)
        emb = self.hspec.index["embeddings.weight"]
        g[emb.start : emb.stop] = 0  # g_phi: the embeddings v_i are not perturbed
        eps = SAM(self.hp.rho).perturbation(g, None)  # rho g_phi / ||g_phi||
        for e, lam in zip(self.hspec.params, self.hn_scale(xi).tolist()):
            eps[e.start : e.stop] *= lam  # Lambda, one tensor at a time
        return self.vjp(i, delta, self.phi + eps)

    def mean_hypernet_grad(self, clients: list[int], delta: torch.Tensor) -> torch.Tensor:
        # LWSAM's perturbation is each client's own (not linear in Delta): a VJP pair per client
        return torch.stack([self.hypernet_grad(i, d) for i, d in zip(clients, delta)]).mean(0)
