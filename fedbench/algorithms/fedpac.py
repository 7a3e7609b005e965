"""FedPAC (Xu, Tong, Huang: "Personalized Federated Learning with Feature Alignment and
Classifier Collaboration", ICLR 2023, arXiv:2306.11867, Sections 4.1-4.3 and Algorithm 1;
authors' code JianXu95/FedPAC, methods/fedpac.py, tools.py, running.py).

Model = feature extractor theta (the body, f_theta(x) in R^d) + linear classifier phi_i (the
head). Round t, each sampled client i receives theta^t and the global centroids c^t, and holds
its head phi_i; with n_i samples, n_{i,k} of class k, p_i(k) = n_{i,k} / n_i:
1. Statistics at theta^t, before training (Section 4.2, the estimates the collaboration QP
   needs; the heads step 7 combines are trained on theta^t's features), mu_{i,k} = mean of
   f_{theta^t}(x) over its class-k samples:
       h_i = [p_i(k) mu_{i,k}]_k  in R^{K x d}      (estimate of E_{P_i}[y f(x)^T])
       V_i = (1 / n_i) [ (1 / n_i) sum_l ||f(x_l)||^2 - sum_k p_i(k)^2 ||mu_{i,k}||^2 ]
   (V_i = tr Cov(y f(x)^T) / n_i, the variance of h_i's estimate: the authors'
   `statistics_extraction`).
2. Classifier: `head_epochs` epochs of CE on phi_i, theta frozen (the head's own learning
   rate `head_lr`, the authors' code's 0.1).
3. Feature extractor, head frozen, `body_epochs` epochs on the regularized loss (Section 4.1)
       CE(phi_i(f_theta(x)), y) + lambda R_i,   R_i = (1 / d) ||f_theta(x) - c_y||^2
   averaged over the batch (`alignment_loss`); no R_i in round 0 (no global centroid yet).
4. Local centroids after training (Section 4.1): c_{i,k} = mean of f_{theta_i}(x) over class k.
Server:
5. theta^{t+1} = sum_i (n_i / n) theta_i (`weighting`: samples; uniform 1/C).
6. Global centroids c_k = sum_i n_{i,k} c_{i,k} / sum_i n_{i,k} over the clients holding k.
7. Classifier collaboration (Section 4.2): for each sampled i, on the simplex,
       alpha_i = argmin_alpha ||sum_j alpha_j h_j - h_i||_F^2 + sum_j alpha_j^2 V_j
               = argmin_alpha alpha^T (D_i + diag V) alpha,  D_i[j,k] = <h_i - h_j, h_i - h_k>
   (bias of the combined head's estimate plus its variance: the estimated test loss), solved
   with cvxopt (`_qp.min_norm_weights`, float64); then phi_i <- sum_j alpha_ij phi_j over the
   round's trained heads.
Client i deploys (theta^{t+1}, phi_i): the latest feature extractor with its own head.
Defaults: lambda 1 (the authors' `--lam`), 1 head epoch and E body epochs (the authors'
`epoch_classifier = 1`, `local_ep_rep = local_epoch`), head lr 0.1 (their `lr_g`).
The paper's ablation: `collaborate: false` skips step 7 (each client keeps its trained head;
their `--agg_g 0`), `lam: 0` drops the alignment.

RECONSTRUCTION (the paper leaves these open; the authors' code decides):
- the statistics of step 1 are taken when theta^t arrives, before any local training (the
  authors' code, PFLlib and FL-bench all do so), the centroids of step 4 after it;
- the squared distance of R_i is averaged over the d coordinates (their nn.MSELoss, as PFLlib
  and FL-bench); a sample whose class has no global centroid this round (no sampled client
  holds it) is pulled to its client's own start-of-round centroid mu_{i,k} (their
  `local_protos1`; FL-bench too; PFLlib adds nothing for it);
- the global centroids are recomputed from each round's uploads only (their
  `protos_aggregation`), sample-weighted;
- combination weights below 1e-3 are set to 0 and the rest renormalized to sum 1 (their
  `alpha * (alpha > eps)` and `agg_classifier_weighted_p`); a QP that fails keeps the client's
  own trained head (their `alpha = None` branch; counted in `qp_fallbacks`). D_i + diag V is
  positive semidefinite by construction, so their eigenvalue clipping of a non-PSD matrix
  has nothing to clip;
- the head phase's learning rate `head_lr` decays with the run's `optim.lr_decay` (their
  code has no decay); `head_lr: null` uses the run's learning rate;
- statistics and centroids are computed in eval mode without augmentation (their code reads
  features in whatever mode the model was left in).
Uploads: each client's trained state (kind "model", ref = the state it started from), of which
the server averages the body and combines the heads; the local centroids [K, d] and the
statistics (h_i, V_i) (kind "other"); the class counts n_{i,k} pass as sent, like the sample
counts of every FedAvg-style server. Communication per sampled client: up the body, the
centroids of the classes it holds (the authors' per-class dict) and the class counts, and (with
the collaboration) the head and (h_i, V_i) (h_i dense [K, d], as the authors send it); down
the body, the global centroids that exist, and the combined head.
Buffers: averaged (weights >= 0) with the body, as the authors' code averages every
non-classifier key: BatchNorm running statistics belong to theta.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from fedbench.algorithms._about import About
from fedbench.algorithms._qp import gram, min_norm_weights
from fedbench.algorithms._shared import aggregate_prototypes, feature_moments, state_entries
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, hp, nonneg, positive
from fedbench.engine import TrainResult, client_row

ALPHA_EPS = 1e-3  # combination weights below this are dropped (the authors' `eps`)


@dataclass
class FedPACParams:
    lam: float = nonneg()  # lambda: weight of the feature-alignment term R_i
    head_epochs: int = hp(ge=1)  # E_phi: epochs on the head, body frozen
    body_epochs: int = hp(ge=1)  # E_theta: epochs on the body, head frozen
    head_lr: float | None = positive()  # the head phase's lr (null: the run's optim.lr)
    collaborate: bool  # classifier collaboration (false: each client keeps its own head)
    weighting: Weighting  # body average: samples (n_i / n) | uniform (1/C)


# ---------------------------------------------------------------------- the pieces, as functions
def client_statistics(
    means: torch.Tensor, counts: torch.Tensor, sq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_i [K, d], V_i 0-d) of step 1 from one client's class means [K, d], class counts [K]
    and sum of squared feature norms: h_i = [p(k) mu_k]_k and
    V_i = ((1/n) sum_l ||f_l||^2 - sum_k p(k)^2 ||mu_k||^2) / n."""
    n = counts.sum()
    p = counts / n
    h = p[:, None] * means
    v = (sq / n - (h * h).sum()) / n
    return h, v


def collaboration_matrix(h: torch.Tensor, v: torch.Tensor, i: int) -> np.ndarray:
    """[C, C] float64 matrix D_i + diag V of client i's QP (step 7) from the statistics h
    [C, K, d] and V [C] of the round's clients: alpha^T (D_i + diag V) alpha =
    ||sum_j alpha_j h_j - h_i||^2 + sum_j alpha_j^2 V_j on the simplex."""
    H = gram(h.flatten(1))  # <h_j, h_k>, float64
    a = H[i, i] - H[i][None, :] - H[i][:, None] + H  # <h_i - h_j, h_i - h_k>
    return a + np.diag(v.double().cpu().numpy())


def combination_weights(P: np.ndarray, eps: float = ALPHA_EPS) -> np.ndarray | None:
    """alpha = argmin alpha^T P alpha on the simplex (cvxopt), weights below `eps` dropped and
    the rest renormalized; None when the solve fails."""
    alpha = min_norm_weights(P)
    if alpha is None:
        return None
    keep = alpha > eps
    if not keep.any():  # more than 1/eps clients, all weights tiny: nothing to drop
        return alpha
    alpha = np.where(keep, alpha, 0.0)
    return alpha / alpha.sum()


def alignment_loss(
    model, x: torch.Tensor, y: torch.Tensor, c: int, targets: torch.Tensor, lam: float
) -> torch.Tensor:
    """CE(head(f(x)), y) + lam (1/(B d)) sum_b ||f(x_b) - targets[c, y_b]||^2 (step 3);
    `targets` [C, K, d]: per position c in the train call, the centroid each class pulls to."""
    f = model.features(x)
    return F.cross_entropy(model.head(f), y) + lam * F.mse_loss(f, client_row(targets, c)[y])


@ALGORITHMS.register()
class FedPAC(Algorithm):
    about = About(
        name="FedPAC",
        paper="Xu, Tong, Huang, ICLR 2023",
        summary=(
            "head first, then a shared feature extractor aligned to global class "
            "centroids; each client's head a QP-weighted combination of the clients' "
            "heads minimizing an estimated test loss"
        ),
        docs="algorithms.md#fedpac-fedpac",
        pfllib="FedPAC",
        fl_bench="FedPAC",
    )
    Params = FedPACParams
    needs_head = True
    needs_features = True
    attackable = True
    server_optimizable = True  # server_opt steps on the body average
    state_keys = ("theta", "heads", "centroids", "has_centroid", "qp_fallbacks")

    def setup(self) -> None:
        model = self.engine.model
        spec = self.engine.spec
        self.K = self.fed.num_classes
        self.head_mask = spec.mask(model.head_params(), device=self.device)  # [P]
        self.body_mask = ~self.head_mask
        self.head_entries = state_entries(self.head_mask, spec.n_state)  # [D]
        self.theta = self.engine.initial_state()  # [D] global body (head entries unused)
        self.heads = self.theta[self.head_entries].repeat(self.N, 1)  # [N, H] personal heads
        self.centroids = torch.zeros(self.K, model.feature_dim, device=self.device)  # [K, d]
        self.has_centroid = torch.zeros(self.K, dtype=torch.bool, device=self.device)
        self.qp_fallbacks = torch.zeros((), dtype=torch.long)  # cumulative, over clients

    # ------------------------------------------------------------------ pieces
    def states_of(self, clients) -> torch.Tensor:
        """[C, D]: the global body with each client's own head."""
        s = self.theta.repeat(len(clients), 1)
        s[:, self.head_entries] = self.heads[torch.as_tensor(clients, device=self.device)]
        return s

    def moments(self, states: torch.Tensor, clients) -> tuple[torch.Tensor, ...]:
        """Per client: class means [C, K, d], class counts [C, K], sum ||f||^2 [C]."""
        out = [
            feature_moments(self.engine, s, self.fed.train_idx[int(i)], self.K)
            for s, i in zip(states, clients)
        ]
        return tuple(torch.stack(parts) for parts in zip(*out))

    def head_phase(self, states: torch.Tensor, clients, t: int) -> TrainResult:
        """Step 2: `head_epochs` epochs of CE on the head, body frozen."""
        lr = self.hp.head_lr
        lr = self.optim.lr_at(t) if lr is None else lr * self.optim.lr_decay**t
        return self.local_train(
            states, clients, t, epochs=self.hp.head_epochs, trainable=self.head_mask, salt=1, lr=lr
        )

    def body_phase(
        self, states: torch.Tensor, clients, t: int, own_means: torch.Tensor
    ) -> TrainResult:
        """Step 3: `body_epochs` epochs on the body, head frozen, CE + lambda R_i towards the
        global centroids (a class without one: the client's start-of-round mean
        `own_means` [C, K, d]); CE alone while no global centroid exists."""
        objective = None
        if bool(self.has_centroid.any()) and self.hp.lam > 0:
            targets = torch.where(self.has_centroid[None, :, None], self.centroids, own_means)
            objective = partial(alignment_loss, targets=targets, lam=self.hp.lam)
        return self.local_train(
            states,
            clients,
            t,
            epochs=self.hp.body_epochs,
            trainable=self.body_mask,
            salt=2,
            objective=objective,
        )

    def combine_heads(
        self, heads: torch.Tensor, h: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Step 7: each round client's new head sum_j alpha_ij phi_j from the trained heads
        [C, H] and the statistics h [C, K, d], V [C]; (new heads [C, H], QP failures)."""
        C = heads.shape[0]
        alpha = torch.eye(C, dtype=torch.float64)
        failed = 0
        for i in range(C):
            a = combination_weights(collaboration_matrix(h, v, i))
            if a is None:
                failed += 1  # keep the own head (row i of the identity)
            else:
                alpha[i] = torch.from_numpy(a)
        return (alpha.to(heads.device) @ heads.double()).to(heads.dtype), failed

    # ------------------------------------------------------------------ the contract
    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        start = self.states_of(clients)
        means0, counts, sq = self.moments(start, clients)  # step 1, at theta^t
        sent_centroids = int(self.has_centroid.sum())  # downloaded with theta^t
        head = self.head_phase(start, clients, t)
        body = self.body_phase(head.states, clients, t, means0)
        local, _, _ = self.moments(body.states, clients)  # step 4
        # uploads
        up = self.receive(body.states, clients, ref=start)
        local = self.receive(local, clients, kind="other")
        C, K, d = means0.shape
        # server: steps 5-7
        avg = self.weights(clients, self.hp.weighting) @ up
        self.theta = self.server_step("theta", self.theta, avg)  # head entries unused
        self.centroids, self.has_centroid = aggregate_prototypes(local, counts, "samples")
        if self.hp.collaborate:
            stats = [client_statistics(m, n, s) for m, n, s in zip(means0, counts, sq)]
            hv = torch.stack([torch.cat([h.flatten(), v[None]]) for h, v in stats])
            hv = self.receive(hv, clients, kind="other")  # rows (h_i, V_i)
            h, v = hv[:, :-1].reshape(C, K, d), hv[:, -1]
            new, failed = self.combine_heads(up[:, self.head_entries], h, v)
            self.qp_fallbacks += failed
        else:  # the head never leaves the client
            new = body.states[:, self.head_entries]
        self.heads[idx] = new
        # floats moved per client: up the body, the centroids of the classes it holds and the
        # class counts, and for the collaboration the head and (h_i, V_i); down the body and
        # the global centroids, and the combined head
        body_n = self.engine.n_state - int(self.head_mask.sum())
        head_n = int(self.head_mask.sum()) if self.hp.collaborate else 0
        held = int((counts > 0).sum())  # local centroids sent, over the round's clients
        n_up = C * (body_n + K + (head_n + K * d + 1 if head_n else 0)) + held * d
        n_down = C * (body_n + sent_centroids * d + head_n)
        diagnostics = {"qp_fallbacks": int(self.qp_fallbacks)}
        return RoundReport(body.loss.mean(), self.comm(clients, up=n_up, down=n_down), diagnostics)

    def personal_state(self, i: int) -> torch.Tensor:
        return self.states_of([i])[0]

    def personal_states(self) -> torch.Tensor:
        return self.states_of(np.arange(self.N))
