"""FedSpa (Huang et al., 2022, "Achieving Personalized Federated Learning with Sparse Local
Models", arXiv:2201.11380; docs/papers/fedslr.md: FedSLR's Table 1-2 comparison).

Each client i holds a binary mask m_i at a fixed `density` per layer (random at start,
drawn from the run's seed). Round t, each sampled client: downloads m_i ⊙ w^t (a sparse
model), trains it E epochs with the run's optimizer on its active entries only (the rest
stay zero), then updates its mask by prune-and-grow (dynamic sparse training, RigL-style):
per layer, drop the k = round(alpha_t · active) smallest-magnitude active weights and grow
k inactive ones with the largest gradient magnitude (one batch, at the trained model);
alpha_t = prune_rate · (1 + cos(pi t / T)) / 2. Prune-and-grow changes only the mask of
the NEXT round: the client uploads its trained model w_i ⊙ m_i^old as trained, and a grown
entry starts from the global value at the client's next download (m_i^new ⊙ w^{t'}).
Server: every entry averaged over the sampled clients whose TRAINED mask m_i^old holds it;
an entry no sampled client holds keeps its value.
Personalized model of client i: m_i ⊙ w (the current global model under its mask).
Sizes: a client deploys and each transfer carries the mask's nonzeros (FedSLR Table 2: half
of FedAvg's parameters and communication at density 0.5; the mask's index cost is not counted).
Buffers: averaged (weights >= 0).
RECONSTRUCTION: implemented from a short description only ("personalized sparse masks,
dynamic sparse training at 50% density, masked models averaged"); the masked (per-entry)
average, the RigL grow criterion, the cosine prune schedule and `dense_1d` (1-D tensors dense
and shared) are ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import first_k_mask
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import fraction, hp


@dataclass
class FedSpaParams:
    density: float = hp(gt=0, le=1)
    prune_rate: float = fraction()
    dense_1d: bool


@ALGORITHMS.register()
class FedSpa(Algorithm):
    about = About(
        name="FedSpa",
        paper="Huang et al., ICML 2022",
        summary=(
            "personalized sparse masks by dynamic sparse training (prune-and-grow) at a"
            " set density; masked models averaged"
        ),
        docs="papers/fedslr.md#fedspa-fedspa",
    )
    Params = FedSpaParams
    attackable = True
    state_keys = ("w", "masks")

    def setup(self) -> None:
        spec = self.engine.spec
        self.w = self.engine.initial_state()  # [D]
        self.layers = [e for e in spec.params if len(e.shape) >= 2 or not self.hp.dense_1d]
        g = torch.Generator().manual_seed(self.run.seed + 11)
        masks = torch.ones(self.N, spec.n_params, dtype=torch.bool)
        dens = self.hp.density
        for e in self.layers:
            n = e.stop - e.start
            k = max(1, round(dens * n))
            scores = torch.rand(self.N, n, generator=g)
            keep = scores.argsort(1)[:, :k]
            m = torch.zeros(self.N, n, dtype=torch.bool)
            m.scatter_(1, keep, True)
            masks[:, e.start : e.stop] = m
        self.masks = masks.to(self.device)  # [N, P]

    def masked(self, state: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = state.clone()
        s[..., : self.engine.n_params] *= mask
        return s

    def prune_grow(self, clients, states: torch.Tensor, t: int) -> None:
        """The clients' mask update after training, in place on their rows of `masks` (row c
        of `states`, client clients[c]'s trained model, is read, not changed). Per layer each
        client drops its k smallest active weights and grows its k inactive entries of
        largest gradient (one batch's), k = alpha_t x its active count, ties to the lowest
        index (`first_k_mask`); rows with the same k are selected together."""
        rate = self.hp.prune_rate * (1 + math.cos(math.pi * t / self.run.rounds)) / 2
        if rate <= 0:
            return
        grads = []
        for c, i in enumerate(clients):
            i = int(i)
            x, y = next(self.engine.batches(i, self.run.batch_size, steps=1, round=t, salt=3))
            keys = self.engine.dropout_keys(i, 1, round=t, salt=3)  # that batch's dropout masks
            key = None if keys is None else keys[0]
            grads.append(self.engine.grad_at(states[c].clone(), x, y, key=key)[1])
        g = torch.stack(grads)
        idx = torch.as_tensor(clients, device=self.device)
        for e in self.layers:
            sl = slice(e.start, e.stop)
            m = self.masks[idx, sl]  # [C, n] a copy
            on = m.sum(1)
            ks = torch.minimum((rate * on.double()).floor().long(), m.shape[1] - on).tolist()
            # FMNIST's always-blank border pixels give weights a gradient of exactly 0: the
            # ties go to the lowest index (topk breaks them one way on the CPU, another on CUDA)
            weights = torch.where(m, states[:, sl].abs(), torch.full_like(g[:, sl], float("inf")))
            grad = torch.where(~m, g[:, sl].abs(), torch.full_like(g[:, sl], -1.0))
            for k in sorted(set(ks) - {0}):
                rows = torch.tensor([c for c, kc in enumerate(ks) if kc == k], device=m.device)
                drop = first_k_mask(weights[rows], k, largest=False)
                grow = first_k_mask(grad[rows], k)
                m[rows] = (m[rows] & ~drop) | grow
            self.masks[idx, sl] = m

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        P = self.engine.n_params
        m_old = self.masks[idx].clone()  # [C, P] the masks the clients train with
        sent = self.masked(self.w.expand(len(clients), -1), m_old.float())
        # one call, each client under its own mask (the engine's per-client rows)
        res = self.local_train(sent, clients, t, trainable=m_old)
        self.prune_grow(clients, res.states, t)  # the next round's masks
        up = self.receive(res.states, clients, ref=self.w)
        m = m_old.float()  # [C, P] averaged over the masks the uploads were trained with
        cnt = m.sum(0)
        new = self.w.clone()
        avg = (up[:, :P] * m).sum(0) / cnt.clamp_min(1)
        new[:P] = torch.where(cnt > 0, avg, self.w[:P])
        new[P:] = up[:, P:].mean(0)
        self.w = new
        nnz = int(m_old.sum()) + len(clients) * (self.engine.n_state - P)
        density = float(self.masks.float().mean())
        return RoundReport(
            res.loss.mean(), self.comm(clients, up=nnz, down=nnz), {"density": density}
        )

    def model_size(self) -> dict:
        return {"params_personal": float(self.masks.sum(1).float().mean())}

    def personal_state(self, i: int) -> torch.Tensor:
        return self.masked(self.w, self.masks[i].float())

    def personal_states(self) -> torch.Tensor:
        return self.masked(self.w.expand(self.N, -1), self.masks.float())
