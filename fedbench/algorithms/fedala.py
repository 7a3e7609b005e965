"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan: "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023, arXiv:2212.01197, Algorithm 1; the authors' code
TsingZ0/FedALA, system/utils/ALA.py, the same module in PFLlib's clientala/serverala).

Round t, each sampled client i (Algorithm 1 lines 4-15) receives the global model Θ^{t-1} and,
before local training, forms its initialized local model by Adaptive Local Aggregation (ALA)
of Θ^{t-1} with its old local model θ_i^{t-1}:

    θ̂_i^t = θ_i^{t-1} + (Θ^{t-1} - θ_i^{t-1}) ⊙ [1^{|θ|-K}; W_i]                 (eqs. 3-4)

The lower layers take Θ^{t-1} outright; the K parameter entries of the top p layers mix
element-wise with weights W_i in [0, 1]^K, learned on a random s% sample D_i^{s,t} of the
client's training data, one step per mini-batch, then clipped (σ, lines 11 and 14):

    W_i <- clip(W_i - η ∇_{W_i} L(θ̂_i^t, D_i^{s,t}), 0, 1),                          (eq. 5)
    ∇_{W_i} L = (∇_{θ̂} L)_top ⊙ (Θ^{t-1} - θ_i^{t-1})_top                          (eq. 6)

(L the mean cross-entropy of a batch; the gradient is autograd's through `engine.
functional_logits`, which is the product of eq. 6). W_i starts at ones and carries over
across rounds. Start phase (Algorithm 1 lines 8-11, "if t = 2"): the first time a client runs
ALA, the steps repeat over D_i^{s,t} epoch after epoch until the losses converge: the
authors' rule, stop after epoch e once e > num_pre_loss and the (population) standard
deviation of the last num_pre_loss recorded losses is below `threshold`, the recorded loss of
an epoch being that of its last batch, computed before its step. Every later ALA runs one
epoch (lines 12-14). Then the client trains θ̂_i^t E epochs with the run's optimizer (line
16, `Algorithm.local_train`) to θ_i^t, keeps it and uploads it; the server averages
Θ^t = sum_i (n_i / n) θ_i^t over the round's clients (line 18; `server_step`, so `server_opt`
applies).
Deployed model: Algorithm 1 returns the initialized local models θ̂_1, ..., θ̂_N (its
Output and line 19), and the authors score the models right after ALA, before training
(serverALA.train: send_models, whose local_initialization runs ALA, then evaluate). So
client i deploys the θ̂_i it would train from next: the ALA of the current Θ with its θ_i,
from its W_i, on the next round's sample (one epoch, or its start phase if it has not run
one), computed at evaluation and kept nowhere (the next round computes the same again). A
client never sampled deploys Θ (eq. 4 with W = 1 from Θ^0; docs/metrics.md). Its model after
its last local training, θ_i^t, is reported beside it as model kind `trained`.
Defaults: η = 1, s = 80, p = 1 (the classifier head) (the authors' run_me.sh), threshold
0.01 (the paper's, by the authors' README; their ALA.py default is 0.1 since June 2023),
num_pre_loss 10 (ALA.py).

RECONSTRUCTION (where the paper leaves it open, from the authors' ALA.py):
- ALA is skipped while θ_i^{t-1} = Θ^{t-1} (nothing to aggregate: every client at t = 1,
  when all hold Θ^0); the start phase (the paper's "if t = 2", every client's first ALA at
  full participation) is then the client's first ALA that runs (the authors' `start_phase`
  flag). The authors test the first parameter tensor; we test all.
- a client's local model before its first participation is Θ^0 (line 1: "Server sends Θ^0
  to all clients to initialize local models"), so a client first sampled in a later round
  runs its start phase between Θ^0 and Θ^{t-1}; W_i = 1 starts it from Θ^{t-1}. ALA runs on
  the round's sampled clients (lines 4-5); the authors' code runs it on every client every
  round, which is the same at their join ratio 1.
- D_i^{s,t}: the first int(s n_i / 100) samples of a permutation of the client's training
  data seeded by (seed, round, client) (`Engine.schedule` with its own salt; at least one
  sample), read without data augmentation (the authors' ALA reads their un-augmented
  tensors), in batches of the run's batch size, the last one partial, the same batches in
  the same order every epoch (the authors: a random contiguous slice of their unshuffled
  data, an unshuffled loader with drop_last=False).
- p counts units of `model.layers()` (a Conv/Linear with its norm); the authors'
  `layer_idx` counts parameter tensors (their -p 2 = the head's weight and bias = p 1 here).
  Only p = 1 (the head) means the same in the paper: its p > 1 counts coarse blocks (on
  ResNet-18 its p = 2 is the whole last stage, 8.4M weights), ours the next conv unit.
- the start phase stops after at most `max_start_epochs` epochs (not in the paper: the
  authors' README warns that too small a threshold can leave the loop running forever);
  the default 1000 is far above what the default threshold takes (24 to 39 epochs on the
  tests' FMNIST federation, 11 at least).
- the deployed θ̂_i is computed at evaluation from the kept state and dropped, so an
  evaluation changes nothing (`eval.every` leaves the results alone); the authors' evaluated
  θ̂_i is the one their next local training starts from, the same model for a sampled client.
- the weight learning forwards in training mode (BatchNorm on batch statistics; the
  authors' local model is in training mode there); running statistics its forwards update
  are discarded, as the authors discard their temporary model.
The weight learning is FedALA's own step on W (the model's parameters are never stepped
there), written with the engine's pieces: `Engine.schedule`, `Engine.functional_logits`,
autograd; `Engine.train` trains model parameters with the run's optimizer and cannot train
a reparametrization's weights. With ALA on the head alone (p = 1), the body's features at
Θ^{t-1} (which W does not change) are computed once per batch and the steps run the head
(the same numbers as the whole forward, tests/test_fedala.py).
Uploads: each client's trained θ_i^t (kind "model", ref = the Θ^{t-1} the server sent).
Buffers: ALA mixes parameters only, as the authors' ALA: θ̂_i^t keeps the running statistics
of θ_i^{t-1} (the client's own; Θ^0's before its first training); the server averages them
(weights n_i / n >= 0) into Θ, which a never-sampled client deploys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport, TrainedOrGlobal
from fedbench.algorithms.params import hp, nonneg, positive
from fedbench.engine import Engine
from fedbench.errors import ConfigError
from fedbench.models.dropout import dropout_key

ALA_SALT = 1  # D_i^{s,t}'s permutation, apart from local training's batch stream


@dataclass
class FedALAParams:
    eta: float = nonneg()  # η: learning rate of the ALA weights
    rand_percent: float = hp(gt=0, le=100)  # s: percent of the local data ALA learns on
    p: int = hp(ge=1)  # ALA on the top p layers of model.layers(); the lower take Θ
    threshold: float = positive()  # start phase: std of the last losses below this
    num_pre_loss: int = hp(ge=1)  # start phase: how many recent epoch losses the std covers
    max_start_epochs: int = hp(ge=1)  # start phase: a guard on its epochs (not in the paper)


def aggregate(
    weights: torch.Tensor, theta: torch.Tensor, glob: torch.Tensor, top: torch.Tensor
) -> torch.Tensor:
    """Eq. 4 on parameter vectors [P]: theta + (glob - theta) * [1; weights], i.e. `glob` on
    the lower entries and theta + (glob - theta) * weights on the entries `top` [K] (indices);
    differentiable in `weights` [K]."""
    t = theta[top]
    return glob.index_put((top,), t + (glob[top] - t) * weights)


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (params [P], input) -> logits


def ala_step(
    forward: Forward,
    weights: torch.Tensor,
    theta: torch.Tensor,
    glob: torch.Tensor,
    top: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ALA weight step on the batch (x, y) (eqs. 5-6): (the batch's loss at θ̂(weights),
    clip(weights - eta * grad, 0, 1)). `theta`, `glob`: parameter vectors [P]; `forward`:
    the logits of a parameter vector on x, differentiable in it (`Engine.functional_logits`)."""
    w = weights.detach().requires_grad_(True)
    loss = F.cross_entropy(forward(aggregate(w, theta, glob, top), x), y)
    (g,) = torch.autograd.grad(loss, w)
    return loss.detach(), (w.detach() - eta * g).clamp_(0.0, 1.0)


def submodule_views(engine: Engine, prefix: str, params, buffers=None) -> dict:
    """The views of `params` [P] (and `buffers`) that belong to the model's submodule
    `prefix` ("body" or "head"), named as inside it (for `functional_call` on it)."""
    n = len(prefix) + 1
    views = engine.spec.views(params, buffers)
    return {k[n:]: v for k, v in views.items() if k.startswith(prefix + ".")}


def start_phase_done(losses: list[float], num_pre_loss: int, threshold: float) -> bool:
    """The authors' convergence test after an epoch of the start phase: more than
    num_pre_loss epochs recorded and the population std of the last num_pre_loss < threshold."""
    return len(losses) > num_pre_loss and float(np.std(losses[-num_pre_loss:])) < threshold


@ALGORITHMS.register()
class FedALA(TrainedOrGlobal, Algorithm):
    about = About(
        name="FedALA",
        paper="Zhang et al., AAAI 2023",
        summary=(
            "Adaptive Local Aggregation: a client starts from its old model plus the "
            "global update weighted element-wise (W in [0, 1], learned on s% of its "
            "data) on the top p layers, the global model below; then FedAvg"
        ),
        docs="algorithms.md#fedala-fedala",
        pfllib="FedALA",
        fl_bench="FedALA",
    )
    Params = FedALAParams
    needs_head = True
    attackable = True
    server_optimizable = True  # server_opt steps on the average
    state_keys = ("w", "theta", "seen", "ala_weights", "started", "next_round")
    extra_kinds = ("trained",)  # θ_i^t, the model after the client's last local training

    def setup(self) -> None:
        layers = self.engine.model.layers()
        if self.hp.p > len(layers):
            raise ConfigError(f"algo.p={self.hp.p}: the model has {len(layers)} layers")
        names = [n for layer in layers[-self.hp.p :] for n in layer.params]
        self.top = self.engine.spec.mask(names, device=self.device).nonzero().squeeze(1)  # [K]
        # ALA on the head alone: the body's features at Θ do not depend on W, so each batch's
        # are computed once per ALA and every step runs only the head (the same numbers as
        # the whole forward; not with dropout in the body, whose masks differ per forward)
        model = self.engine.model
        self.head_only = set(names) == set(model.head_params()) and not any(
            isinstance(m, nn.modules.dropout._DropoutNd) for m in model.body.modules()
        )
        self.w = self.engine.initial_state()  # Θ [D]
        self.init_rows()  # theta [N, D]: Θ^0 until a client's first training (line 1)
        self.ala_weights = torch.ones(self.N, self.top.numel(), device=self.device)  # W [N, K]
        self.started = torch.zeros(self.N, dtype=torch.bool, device=self.device)  # start done
        self.next_round = 0  # the round whose ALA an evaluation computes (its s% sample)

    def ala_batches(self, c: int, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """D_c^{s,t} in batches: the first int(s n_c / 100) samples (at least 1) of a seeded
        permutation of the client's training data, without augmentation."""
        n = int(self.fed.train_idx[c].numel())
        m = max(1, int(self.hp.rand_percent / 100 * n))
        idx, _ = self.engine.schedule(c, n, epochs=1, round=t, salt=ALA_SALT)  # one row
        x, y = self.fed.batch(idx[0, :m], train=False)
        B = self.run.batch_size
        return list(zip(x.split(B), y.split(B)))

    def forward_of(
        self, glob: torch.Tensor, buffers: torch.Tensor, batches: list
    ) -> tuple[Forward, list]:
        """The weight learning's forward and its batches, in training mode (BatchNorm on the
        batch; the running statistics it updates land in `buffers`, a copy then dropped):
        the whole model, or with `head_only` the head on the batches' body features at the
        global parameters `glob` [P]."""
        eng = self.engine
        eng.model.train()
        buffers = buffers if eng.spec.has_buffers else None
        if not self.head_only:
            return partial(eng.functional_logits, buffers=buffers), batches
        with torch.no_grad():
            body = submodule_views(eng, "body", glob, buffers)
            batches = [(functional_call(eng.model.body, body, (x,)), y) for x, y in batches]

        def head(params: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
            return functional_call(eng.model.head, submodule_views(eng, "head", params), (f,))

        return head, batches

    def ala(self, c: int, t: int) -> tuple[torch.Tensor, torch.Tensor, bool, int]:
        """Client c's ALA in round t: (θ̂_c^t [D], its new W_c [K], whether its start phase is
        done, the epochs of weight learning run)."""
        P = self.engine.n_params
        theta, glob = self.theta[c], self.w
        weights, started = self.ala_weights[c], bool(self.started[c])
        init = theta.clone()  # buffers: the client's own
        init[:P] = glob[:P]
        if torch.equal(theta[:P], glob[:P]) or self.fed.train_idx[c].numel() == 0:
            return init, weights, started, 0  # nothing to aggregate (or to learn on)
        batches = self.ala_batches(c, t)
        forward, batches = self.forward_of(glob[:P], theta[P:].clone(), batches)
        losses: list[float] = []
        epochs = 1 if started else self.hp.max_start_epochs
        # a model with keyed dropout: each forward's masks keyed by (seed, round, client,
        # ALA's salt, forward), so a resumed run drops as an uninterrupted one
        keys = self.engine.dropout_keys(c, epochs * len(batches), round=t, salt=ALA_SALT)
        n = 0
        for _ in range(epochs):
            for x, y in batches:
                with dropout_key(None if keys is None else keys[n]):
                    loss, weights = ala_step(
                        forward, weights, theta[:P], glob[:P], self.top, x, y, self.hp.eta
                    )
                n += 1
            losses.append(float(loss))  # the epoch's last batch (the authors' record)
            if start_phase_done(losses, self.hp.num_pre_loss, self.hp.threshold):
                break
        init[:P] = aggregate(weights, theta[:P], glob[:P], self.top)
        return init, weights, True, len(losses)

    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        idx = torch.as_tensor(clients, device=self.device)
        inits, epochs = [], []
        for c in clients:
            init, self.ala_weights[c], self.started[c], n = self.ala(int(c), t)
            inits.append(init)
            epochs.append(n)
        res = self.local_train(torch.stack(inits), clients, t)
        self.set_trained(idx, res.states)
        up = self.receive(res.states, clients, ref=self.w)
        self.w = self.server_step("w", self.w, self.weights(clients) @ up)
        self.next_round = t + 1
        return RoundReport(res.loss.mean(), self.comm(clients), {"ala_epochs": np.mean(epochs)})

    def personal_state(self, i: int) -> torch.Tensor:
        """θ̂_i, what client i would train from next (Algorithm 1's output, where the authors
        evaluate): its ALA on the current Θ, nothing kept; Θ if it was never sampled."""
        if not bool(self.seen[i]):
            return self.w
        with torch.enable_grad():  # evaluations run under no_grad; ALA learns W
            return self.ala(i, self.next_round)[0]

    def personal_states(self) -> torch.Tensor:
        return torch.stack([self.personal_state(i) for i in range(self.N)])

    def extra_correct(self, kind: str, i: int, idx: torch.Tensor) -> torch.Tensor:
        """`trained`: client i's model after its last local training (Θ if never sampled)."""
        return self.engine.correct(TrainedOrGlobal.personal_state(self, i), idx)
