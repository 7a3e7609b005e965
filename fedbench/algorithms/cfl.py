"""CFL (Sattler, Müller, Samek, IEEE TNNLS 2020, "Clustered Federated Learning: Model-Agnostic
Distributed Multitask Optimization Under Privacy Constraints", arXiv:1910.01991).

FedAvg inside clusters of clients; a cluster is split in two once FedAvg inside it has
reached a stationary point of the cluster's risk while some of its clients are still far from
a stationary point of their own (their data are incongruent), by the cosine similarity of the
clients' updates. State: a partition of the clients into clusters c (`assign` [N], the index
of each client's cluster) and one model theta_c per cluster (`models` [K, D], K growing with
the splits); at the start one cluster of every client with the initial model.

Round t, each sampled client i of cluster c(i) (the paper's weight-updates as generalized
gradients): dtheta_i = SGD_E(theta_c(i), D_i) - theta_c(i), E epochs of the run's optimizer.
Server, for every cluster c, with its weighted mean update
    dtheta_c = sum_{i in c} (|D_i| / |D_c|) dtheta_i,
the paper's two split criteria (distinguishing congruent from incongruent clients, in the
weight-update form of its CFL algorithm):
    ||dtheta_c|| < eps_1                   (FL in c is close to a stationary point)
    max_{i in c} ||dtheta_i|| > eps_2      (some client is not: its data are incongruent);
if both hold, the cosine similarities alpha_ij = <dtheta_i, dtheta_j> / (||dtheta_i||
||dtheta_j||) and the optimal bipartition (the separation theorem's; the paper's "Optimal
Bipartition" algorithm)
    c_1, c_2 = argmin_{c_1 u c_2 = c} max_{i in c_1, j in c_2} alpha_ij,
    alpha_max^cross = max_{i in c_1, j in c_2} alpha_ij;
c is replaced by c_1 and c_2 if
    gamma_max < sqrt((1 - alpha_max^cross) / 2),
the paper's certificate: if every client's gradient is within gamma_i ||grad r_i|| of its
true cluster's (gamma_i <= gamma_max), two congruent clients are less than 2 arcsin(gamma_max)
apart, alpha^intra > 1 - 2 gamma_max^2, and the bipartition separates incongruent clients
only. Both halves start from theta_c. Then every cluster (after the splits) aggregates
    theta_c <- theta_c + sum_{i in c} (|D_i| / |D_c|) dtheta_i.
A client deploys its cluster's model theta_c(i): the paper's output is every client's theta_i,
which its algorithm keeps equal to its cluster's (the authors' notebook evaluates the same).
The optimal bipartition is single-linkage agglomeration (merge the two most similar groups,
a group's similarity being that of its most similar pair, until two remain): the two groups
it leaves are the sides of the lightest edge of alpha's maximum spanning tree, whose weight is
their largest cross similarity, and every bipartition is crossed by some edge of that tree, so
none does better (tests/test_cfl.py checks it against every bipartition).

RECONSTRUCTION (the paper leaves these open or its code differs):
- `linkage`: single (the paper's optimal bipartition, default) | complete (the authors'
  notebook and FL-bench: sklearn AgglomerativeClustering(linkage="complete") on -alpha, which
  merges by the least similar pair instead and need not attain the optimum).
- eps_1 = 0.4, eps_2 = 1.6 and `warmup_rounds` = 20 (no split before round 21): the
  authors' notebook (EMNIST, 10 clients, their ConvNet, SGD lr 0.1 momentum 0.9, one epoch);
  the paper's algorithm has no warm-up. Both thresholds are norms of weight updates: they
  scale with the learning rate, the epochs and the model, so a setting needs its own (the
  `mean_update_norm` / `max_update_norm` columns of metrics.csv give both norms of the round's
  updates in the cluster with the most sampled clients).
- `gamma_max` = 0: the paper's algorithm takes gamma_max in [0, 1) as an input; the authors'
  notebook and FL-bench have no such check (= gamma_max 0: every bipartition with
  alpha_max^cross < 1 is accepted).
- `min_split_size` = 2 (the paper: any cluster of two or more clients can split); the
  authors' notebook and FL-bench split only clusters of 3 or more (`min_split_size=3`).
- `weighting`: samples (|D_i| / |D_c|, the paper) | uniform (the authors' notebook and
  FL-bench average the updates).
- norms and similarities are over the parameters only (the paper's gradients); buffers are
  averaged with the parameters.
- partial participation (the paper's clients all take part every round): each client's latest
  update is kept (`delta`); a cluster is tested in a round in which some of its members took
  part, on every member's latest update, once every member has reported one since the
  cluster was formed (a split clears the reports); the aggregation uses that round's updates
  of the members that took part. With participation 1 this is the paper's algorithm. Below
  it the rule has two costs: a cluster waits until every member has reported (about H_M / p
  rounds for M members at participation p, H_M the harmonic number), again after each split,
  and the criteria read updates of different ages, taken from older cluster models; since
  update norms shrink as training goes on, the largest norm tends to be the oldest update
  (measured: a 3-client cluster split on a 3-round-old update of norm 0.78 in a round whose
  largest fresh update was 0.04). Run CFL at `participation=1.0` to get the paper's method.
  Memory: the kept updates are an [N, P] tensor (checkpointed too: ResNet-18, N = 100 is
  4.4 GB).
Uploads: each client's trained state (kind "model", ref = its cluster's model); the server
uses the update dtheta_i = upload - ref. Communication: one model each way per client.
Buffers: running statistics are averaged with the parameters inside each cluster (weights
>= 0), so each cluster's model carries its members' statistics; they take no part in the
norms and similarities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, hp, nonneg

Linkage = Literal["single", "complete"]


@dataclass
class CFLParams:
    eps_1: float = nonneg()  # split when the cluster's mean update norm is below eps_1 ...
    eps_2: float = nonneg()  # ... and some client's update norm is above eps_2
    gamma_max: float = hp(ge=0, lt=1)  # accept a bipartition if gamma_max < sqrt((1-a)/2)
    warmup_rounds: int = nonneg()  # no split before this many rounds have run
    min_split_size: int = hp(ge=2)  # only clusters of at least this many clients split
    linkage: Linkage  # bipartition: single (optimal, the paper) | complete (authors' code)
    weighting: Weighting  # cluster mean: samples (|D_i| / |D_c|) | uniform


def cosine_similarities(delta: torch.Tensor) -> torch.Tensor:
    """[M, M] float64 alpha_ij = <d_i, d_j> / (||d_i|| ||d_j||) of the rows of `delta`
    (a zero row has similarity 0 with every row)."""
    d = delta.double()
    n = d.norm(dim=1)
    return (d @ d.T) / (n[:, None] * n[None, :] + 1e-12)


def bipartition(sim: torch.Tensor, linkage: str = "single") -> tuple[list[int], list[int]]:
    """Split the M >= 2 items of the similarity matrix `sim` [M, M] into two groups by
    agglomeration: start from singletons, merge the two most similar groups until two remain.
    A group pair's similarity is that of its most similar item pair (`single`: the optimal
    bipartition, the one minimizing the largest cross similarity) or of its least similar
    pair (`complete`). Ties go to the pair of lowest indices. Returns the two groups, sorted;
    the one holding item 0 first."""
    M = sim.shape[0]
    if M < 2:
        raise ValueError(f"bipartition needs at least 2 items, got {M}")
    link = sim.double().clone()
    link.fill_diagonal_(-math.inf)
    groups = {i: [i] for i in range(M)}
    merge = torch.maximum if linkage == "single" else torch.minimum
    while len(groups) > 2:
        alive = torch.tensor(sorted(groups))
        sub = link[alive][:, alive]
        flat = int(torch.argmax(sub))  # the first maximum: lowest row, then lowest column
        a, b = int(alive[flat // len(alive)]), int(alive[flat % len(alive)])
        a, b = min(a, b), max(a, b)
        groups[a] += groups.pop(b)
        row = merge(link[a], link[b])
        link[a], link[:, a] = row, row
        link[a, a] = -math.inf
        link[b], link[:, b] = -math.inf, -math.inf
    g1, g2 = (sorted(groups[k]) for k in sorted(groups))
    return g1, g2


@ALGORITHMS.register()
class CFL(Algorithm):
    about = About(
        name="CFL",
        paper="Sattler, Müller, Samek, IEEE TNNLS 2020",
        summary=(
            "FedAvg within clusters; a cluster at a stationary point with an "
            "incongruent client is bipartitioned by the cosine similarity of the "
            "clients' updates"
        ),
        docs="algorithms.md#cfl-cfl",
        fl_bench="CFL",
    )
    Params = CFLParams
    attackable = True
    state_keys = ("models", "assign", "delta", "fresh")

    def setup(self) -> None:
        dev = self.device
        self.models = self.engine.initial_state()[None].clone()  # [K, D]: one cluster at first
        self.assign = torch.zeros(self.N, dtype=torch.long, device=dev)  # [N] cluster index
        self.delta = torch.zeros(self.N, self.engine.n_params, device=dev)  # [N, P] latest update
        self.fresh = torch.zeros(self.N, dtype=torch.bool, device=dev)  # reported since formed

    def norms(self, delta: torch.Tensor, clients) -> tuple[float, float]:
        """(||sum_i w_i dtheta_i||, max_i ||dtheta_i||) of the updates `delta` [M, P] of
        `clients`, w the cluster weights (`weighting`)."""
        w = self.weights(np.asarray(clients), self.hp.weighting).to(delta.dtype)
        return float((w @ delta).norm()), float(delta.norm(dim=1).max())

    def split_test(self, members: torch.Tensor) -> bool:
        """Both split criteria on the latest updates of the cluster `members` [M]:
        ||dtheta_c|| < eps_1 and max_i ||dtheta_i|| > eps_2."""
        mean_norm, max_norm = self.norms(self.delta[members], members.cpu().numpy())
        return mean_norm < self.hp.eps_1 and max_norm > self.hp.eps_2

    def split(self, members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The optimal bipartition of the cluster `members` [M] by the cosine similarity of
        their latest updates, if it passes gamma_max < sqrt((1 - alpha_max^cross) / 2)."""
        sim = cosine_similarities(self.delta[members])
        g1, g2 = bipartition(sim, self.hp.linkage)
        cross = float(sim[g1][:, g2].max())
        if not self.hp.gamma_max < math.sqrt(max(1.0 - cross, 0.0) / 2):
            return None
        return members[g1], members[g2]

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        clients = np.asarray(clients)
        idx = torch.as_tensor(clients, device=self.device)
        ref = self.models[self.assign[idx]]  # [C, D]: each client's cluster model
        res = self.local_train(ref, clients, t)
        delta = self.receive(res.states, clients, ref=ref) - ref  # [C, D]: dtheta_i
        P = self.engine.n_params
        self.delta[idx] = delta[:, :P]
        self.fresh[idx] = True

        # diagnostics: this round's updates in the cluster with the most sampled clients
        before = self.assign[idx]
        rows = torch.nonzero(before == int(torch.bincount(before).argmax())).flatten()
        mean_norm, max_norm = self.norms(delta[rows, :P], clients[rows.cpu().numpy()])

        sampled = set(before.tolist())
        for c in range(self.models.shape[0]):  # the clusters as the round found them
            members = torch.nonzero(self.assign == c).flatten()
            if (
                c not in sampled
                or t < self.hp.warmup_rounds
                or len(members) < self.hp.min_split_size
                or not bool(self.fresh[members].all())
                or not self.split_test(members)
            ):
                continue
            halves = self.split(members)
            if halves is None:
                continue
            self.assign[halves[1]] = self.models.shape[0]  # the second half: a new cluster
            self.models = torch.cat([self.models, self.models[c : c + 1]])  # from theta_c
            self.fresh[members] = False  # both halves start anew

        cl = self.assign[idx]  # the clusters after the splits
        for c in torch.unique(cl).tolist():
            rows = torch.nonzero(cl == c).flatten()
            w = self.weights(clients[rows.cpu().numpy()], self.hp.weighting)
            self.models[c] = self.models[c] + w @ delta[rows]
        diagnostics = {
            "clusters": int(self.models.shape[0]),
            "mean_update_norm": mean_norm,
            "max_update_norm": max_norm,
        }
        return RoundReport(res.loss.mean(), self.comm(clients), diagnostics)

    def personal_state(self, i: int) -> torch.Tensor:
        return self.models[self.assign[i]]

    def personal_states(self) -> torch.Tensor:
        return self.models[self.assign]
