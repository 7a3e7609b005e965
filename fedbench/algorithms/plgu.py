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
PLGU-LF's local steps and PLGU-GRep's body steps are step functions over explicit
per-client rows (`PLGULF.step`, `PLGUGRep.body_lwsam_step`), run for all sampled clients at
once (`Engine.client_steps`: vmap, or client after client on the sequential backend, as
`Engine.backend_for` picks; the perturbed gradient is `batch.grad(rows, at=eps)`); PLGU-LF
keeps its optimizer state per client in the slots "personal" and "universal". Every step
runs in training mode.
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
from fedbench.engine import SAM, ClientStep, Optimized, StepBatch, TrainResult
from fedbench.engine.lwsam import (
    LayerMap,
    layer_scores,
    lwsam_perturbation,
    lwsam_scale,
    normalize_scores,
)
from fedbench.engine.optim import Ranges, init_state, step_, trained_ranges

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

    def setup(self) -> None:
        hp = self.hp
        self.rule = score_rule(hp)
        self.layers = LayerMap(self.engine.spec, self.engine.model.layers(), self.device)
        self.w = self.engine.initial_state()
        self.init_rows()

    def personal_layers(self, xi: torch.Tensor) -> torch.Tensor:
        """Alg. 2 line 7: [..., L] bool, True on the layers with the largest scores (L_Per)
        of each row of xi [..., L]."""
        L, D = self.layers.n, self.hp.personal_layers
        n_per = min(D, L) if self.hp.d_counts == "personal" else max(L - D, 0)
        order = torch.sort(xi, dim=-1, descending=True, stable=True).indices
        per = torch.zeros(xi.shape, dtype=torch.bool, device=xi.device)
        return per.scatter_(-1, order[..., :n_per], True)

    def start(self, clients: list[int]) -> dict[str, torch.Tensor]:
        """Alg. 2 lines 6-8 for the clients: their rows theta_i^0, w_i^0 = w [C, D] and
        LWSAM scales [C, P] (eq. 6 scores of (theta_i, w), the D largest personal)."""
        P = self.engine.n_params
        ids = torch.as_tensor(clients, device=self.device)
        w = self.w.repeat(len(clients), 1)
        theta = torch.where(self.seen[ids, None], self.theta[ids], w)
        xi = layer_scores(theta, w, self.layers)  # eq. 6, [C, L]
        per = self.layers.mask(self.personal_layers(xi))  # [C, P]
        theta[:, :P] = torch.where(per, theta[:, :P], w[:, :P])  # Alg. 2 line 8
        keep = ~per if self.hp.perturb == "universal" else None
        scale = lwsam_scale(normalize_scores(xi, self.rule), self.layers, keep)
        return {"theta": theta, "w": w, "scale": scale}

    def step(self, t: int) -> ClientStep:
        """One batch of Algorithm 1 in round t (`Engine.client_steps`): (a) g = grad
        F_b(theta_i), theta_i <- theta_i - eta g; (b) eps = LWSAM(g, xi); (c) w_i <- w_i -
        eta grad F_b(w_i + eps). Aux: the personal losses [k]."""
        sam = SAM(self.hp.rho)
        universal = self.hp.ascent_grad == "universal"

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            theta, w, scale = st["theta"], st["w"], st["scale"]
            loss, g = batch.grad(theta)  # (a) g = grad F_b(theta_i)
            eps = sam.perturbation(g, scale)  # (b) eps from the same g
            batch.step("theta", g)  # (a)
            if universal:  # (b) instead: the ascent gradient at w_i (SAM)
                eps = sam.perturbation(batch.grad(w)[1], scale)
            _, g = batch.grad(w, at=eps)  # (c) g~ = grad F_b(w_i + eps)
            batch.step("w", g)
            return st, loss

        return step

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        ids = [int(i) for i in clients]
        idx = torch.as_tensor(clients, device=self.device)
        lr = self.optim.lr_at(t)
        res = self.engine.client_steps(
            self.start(ids),
            ids,
            self.step(t),
            batch_size=self.run.batch_size,
            epochs=self.run.local_epochs,
            round=t,
            optimized={
                "theta": Optimized(self.optim, lr, slot="personal"),
                "w": Optimized(self.optim, lr, slot="universal"),
            },
        )
        out = res.states
        self.set_trained(idx, out["theta"])
        delta = self.receive(out["w"], clients, ref=self.w) - self.w  # Alg. 2 line 10
        self.w = self.w + self.weights(clients, self.hp.weighting) @ delta  # line 11
        return RoundReport(res.client_mean().mean(), self.comm(clients))


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

    def setup(self) -> None:
        super().setup()
        self.rule = score_rule(self.hp)
        names = set(self.engine.model.body_params())
        body = [layer for layer in self.engine.model.layers() if set(layer.params) <= names]
        self.body_layers = LayerMap(self.engine.spec, body, self.device)
        # last_upload: the body each client uploaded last time (NaN: not yet)
        self.uploaded = None
        if self.hp.score_ref == "last_upload":
            self.uploaded = torch.full(
                (self.N, self.engine.n_state), float("nan"), device=self.device
            )

    def body_step(
        self, s: torch.Tensor, g: torch.Tensor, lr: float, body: torch.Tensor | Ranges
    ) -> None:
        """phi <- phi - eta g on rows s [k, D]: one step of the run's optimizer from a fresh
        state (SGD: eta (g + wd phi)), on the body only (`body`: the body mask as
        `trained_ranges` gives it)."""
        P = self.engine.n_params
        w = s[:, :P]
        step_(self.optim, w, g, init_state(self.optim, w), lr, mask=body)

    def body_lwsam_step(self, t: int) -> ClientStep:
        """One mini-batch of eqs. 10-13 in round t (`Engine.client_steps`), head frozen, on
        the rows `s` (phi_i with the client's head) and `ref` (eq. 10's reference). Aux:
        the losses of eq. 11's gradient [k]."""
        rho, lr, body = self.hp.rho, self.optim.lr_at(t), self.body_mask
        body_ranges = trained_ranges(body)  # the step touches the body only (one host read)

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            s = st["s"]
            loss, g = batch.grad(s)  # eq. 11: phi_i = phi - eta g
            self.body_step(s, g, lr, body_ranges)
            xi = normalize_scores(layer_scores(s, st["ref"], self.body_layers), self.rule)
            _, g = batch.grad(s)  # eq. 12: eps from the body gradient at phi_i (xi: eq. 10)
            eps = lwsam_perturbation(g * body, xi, self.body_layers, rho)
            _, g = batch.grad(s, at=eps)  # eq. 13: phi~_i = phi_i - eta g(phi_i + eps)
            self.body_step(s, g, lr, body_ranges)
            return st, loss

        return step

    def body_phase(self, states: torch.Tensor, clients, t: int) -> TrainResult:
        """Eqs. 10-13, `body_steps` times, each on one mini-batch; head frozen."""
        ids = [int(i) for i in clients]
        ref = states
        if self.uploaded is not None:  # last_upload: the body each client uploaded last time
            last = self.uploaded[torch.as_tensor(ids, device=self.device)]
            ref = torch.where(last.isnan().any(-1, keepdim=True), states, last)
        res = self.engine.client_steps(
            {"s": states, "ref": ref},
            ids,
            self.body_lwsam_step(t),
            batch_size=self.run.batch_size,
            steps=self.hp.body_steps,
            round=t,
            salt=2,
        )
        out = res.states["s"]
        if self.uploaded is not None:
            self.uploaded[torch.as_tensor(ids, device=self.device)] = out
        # the mean over all clients' losses, client after client
        losses = [res.aux[:n, c] for c, n in enumerate(res.steps)]
        loss = torch.cat(losses).mean() if sum(res.steps) else torch.zeros((), device=self.device)
        return TrainResult(out, loss.expand(len(out)), res.steps)


@ALGORITHMS.register("plgu_ghn")
class PLGUGHN(PFedHN):
    about = About(
        name="PLGU-GHN",
        paper="Qu et al., CVPR 2023 (supplement eq. 24-25, reconstruction)",
        summary="pFedHN with LWSAM on the hypernetwork update",
        docs="papers/plgu.md#plgu-ghn-plgu_ghn",
    )
    Params = PLGUGHNParams

    def setup(self) -> None:
        super().setup()
        self.rule = score_rule(self.hp)
        spec, gen = self.engine.spec, set(self.targets.generated)
        layers = [layer for layer in self.engine.model.layers() if set(layer.params) <= gen]
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
