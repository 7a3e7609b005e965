"""IFCA (Ghosh, Chung, Yin, Ramchandran, NeurIPS 2020, "An Efficient Framework for Clustered
Federated Learning", arXiv:2006.04088), Algorithm 1 with model averaging (option II).

k cluster models theta_1..theta_k (`models` [k, D]). Round t, each sampled client i
(M_t, the sampled clients):
    cluster identity estimate  j_i = argmin_{j in [k]} F_i(theta_j),
    F_i the mean cross-entropy of client i's whole training set (the model in evaluation
    mode), ties to the lowest index; s_{i,j} = 1{j = j_i};
    local update  w_i = LocalUpdate(theta_{j_i}): E epochs of the run's optimizer;
server, for every cluster j that some client chose,
    theta_j <- sum_{i in M_t} s_{i,j} w_i / sum_{i in M_t} s_{i,j}
and a cluster no client chose keeps its model. A client deploys the cluster model it
estimates as its own from the current models: theta_{j_i}, j_i = argmin_j F_i(theta_j) on its
training data (as the authors' FEMNIST code; their MNIST and CIFAR scripts evaluate separate
test machines, each with the model of lowest loss on its own test data, which uses the test
labels).
Weight sharing (the paper's combination of IFCA with the weight sharing of multi-task
learning, for an ambiguous cluster structure; `weight_sharing`): the k models share every
layer but the last, the classifier head (`FedModel.head`); the shared part is averaged over
all the sampled clients, each head over the clients that chose its cluster.

RECONSTRUCTION (the paper leaves these open or its code differs):
- initialization: k different random initializations, as the authors' code (their MNIST
  script draws the k models one after another from the seeded generator; their FEMNIST one
  seeds model j with seed + j, then, as run by their run_ifca.sh, loads a FedAvg-pretrained
  model into every layer but the last and trains each model 20 rounds on a random k-th of
  the clients before IFCA starts): theta_1 is the run's initial model and theta_2..theta_k the
  next draws of the model constructor from the run's seed (a forked generator: the global
  one is untouched). The paper's random restarts (keep the best of several runs) and the
  CIFAR script's redraw until every cluster gets a share of the clients are left to the
  user (other seeds).
- k = 2: the paper's rotated CIFAR-10 (the authors' cifar/config.json p=2) and its smallest
  FEMNIST setting; rotated MNIST uses k=4.
- `weighting`: uniform (Algorithm 1: the plain mean over the clients that chose j; the
  authors' MNIST and CIFAR code) | samples (the authors' FEMNIST code weights by n_i).
- weight sharing shares every layer but the last (the classifier head): the paper names the
  technique, not the layers; its shared part is averaged with the same weights as a cluster.
- F_i is evaluated with the model in evaluation mode (BatchNorm's running statistics, no
  dropout) and without augmentation: the loss of theta_j as it is deployed; the paper's
  models have no such layers (the authors' CIFAR code computes F_i on training-augmented
  images).
- the gradient-averaging version (option I, one gradient step per round, used by the
  paper's analysis) is not offered: the experiments on neural networks use option II.
Uploads: each client's trained state (kind "model", ref = the cluster model it trained) and
its cluster identity j_i (an index, counted as one float; not attacked: the attacks replace
model values). Communication: all k models down
(with weight sharing: the shared part once and k heads), one state and the index up.
Buffers: averaged with the parameters over the clients that chose the cluster (weights >= 0);
with weight sharing the body's statistics belong to the shared part, averaged over all the
sampled clients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import argmin_lowest, state_entries
from fedbench.algorithms.base import ALGORITHMS, Algorithm, Needs, RoundReport
from fedbench.algorithms.params import Weighting, hp


@dataclass
class IFCAParams:
    k: int = hp(ge=1)  # number of clusters (cluster models)
    weighting: Weighting  # per-cluster average: uniform (Algorithm 1) | samples (n_i)
    weight_sharing: bool  # share every layer but the head across the k models


@ALGORITHMS.register()
class IFCA(Algorithm):
    about = About(
        name="IFCA",
        paper="Ghosh, Chung, Yin, Ramchandran, NeurIPS 2020",
        summary=(
            "k cluster models; each client trains the one of lowest loss on its data; "
            "averaged per cluster"
        ),
        docs="algorithms.md#ifca-ifca",
    )
    Params = IFCAParams
    attackable = True
    state_keys = ("models",)

    @classmethod
    def needs(cls, hp: IFCAParams) -> Needs:
        """Weight sharing shares the body: it needs a body/head split."""
        return Needs(head=hp.weight_sharing)

    def setup(self) -> None:
        dev, spec = self.device, self.engine.spec
        models = [self.engine.initial_state()]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.run.seed)
            self.model_fn()  # the run's own initial model (the runner draws it first from the seed)
            models += [spec.flatten(self.model_fn()).to(dev) for _ in range(self.hp.k - 1)]
        self.models = torch.stack(models)  # [k, D]
        self.shared_entries = torch.zeros(spec.n_state, dtype=torch.bool, device=dev)  # [D]
        if self.hp.weight_sharing:
            head = spec.mask(self.engine.model.head_params(), device=dev)
            self.shared_entries = ~state_entries(head, spec.n_state)  # body and its buffers
            self.models[:, self.shared_entries] = self.models[0, self.shared_entries]

    @torch.no_grad()
    def train_losses(self, clients) -> torch.Tensor:
        """[C, k]: F_i(theta_j), each client's mean cross-entropy over its whole training set
        under each cluster model (evaluation mode, no augmentation)."""
        fed, eng = self.fed, self.engine
        pools = [fed.train_idx[int(c)] for c in clients]
        sizes = torch.tensor([len(p) for p in pools], device=self.device)
        pool = torch.cat(pools)
        owner = torch.repeat_interleave(torch.arange(len(pools), device=self.device), sizes)
        sums = torch.zeros(self.hp.k, len(pools), device=self.device)
        bs = eng.eval_batch_size
        for j in range(self.hp.k):
            for s in range(0, pool.numel(), bs):
                x, y = fed.batch(pool[s : s + bs], train=False)
                loss = F.cross_entropy(eng.logits(self.models[j], x), y, reduction="none")
                sums[j].index_add_(0, owner[s : s + bs], loss)
        return (sums / sizes.clamp_min(1)).T

    def identities(self, clients) -> torch.Tensor:
        """[C]: j_i = argmin_j F_i(theta_j), a tie (within 1e-6 relative: equal models can
        differ in the last bits on a GPU) going to the lowest index."""
        return argmin_lowest(self.train_losses(clients))

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        clients = np.asarray(clients)
        chosen = self.identities(clients)  # [C]
        start = self.models[chosen]  # [C, D]
        res = self.local_train(start, clients, t)
        up = self.receive(res.states, clients, ref=start)
        models = self.models.clone()
        for j in torch.unique(chosen).tolist():
            rows = torch.nonzero(chosen == j).flatten()
            models[j] = self.weights(clients[rows.cpu().numpy()], self.hp.weighting) @ up[rows]
        shared = self.shared_entries
        if self.hp.weight_sharing:  # the shared part: all the sampled clients' average
            avg = self.weights(clients, self.hp.weighting) @ up
            models[:, shared] = avg[shared]
        self.models = models
        C, D, n_shared = len(clients), self.engine.n_state, int(shared.sum())
        down = C * (n_shared + self.hp.k * (D - n_shared))
        diagnostics = {"clusters_chosen": len(torch.unique(chosen))}
        return RoundReport(
            res.loss.mean(), self.comm(clients, up=C * (D + 1), down=down), diagnostics
        )

    def personal_state(self, i: int) -> torch.Tensor:
        return self.models[self.identities([i])[0]]

    def personal_states(self) -> torch.Tensor:
        return self.models[self.identities(range(self.N))]
