"""FedBABU (Oh, Kim, Yun: "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022, arXiv:2106.06042, Section 4 and Algorithm 1; authors' code
jhoon-oh/FedBABU).

Model = body theta_ext (every layer but the last) + head theta_cls (the last Linear,
`FedModel.head`). The head keeps its random initialization theta_cls^0 (the run's seeded
model init, the same for every client: PyTorch's default Linear init, as in the authors'
main_fed.py; their main_single.py compares head inits, orthogonal among them, in centralized
training only) during the whole federated training: it is never updated, never averaged and
never sent.

Federated training (Algorithm 1), round k, each sampled client i: from (theta_ext^k,
theta_cls^0), tau local epochs (`local_epochs`) of the run's optimizer on its data,
    min_{theta_ext} CE(theta_cls^0(theta_ext(x)), y)          (head frozen: lr 0 on it),
upload theta_ext,i. Server: theta_ext^{k+1} = sum_i w_i theta_ext,i with w_i = n_i / n
(FedAvg's weights, Algorithm 1) or 1/C (`weighting`: the authors' main_fed.py).
Global model (`has_global`): (theta_ext^k, theta_cls^0), the model FedBABU reports before
fine-tuning.
Personalization (evaluation): every client fine-tunes the global model on its own training
data for tau_f = `finetune_epochs` epochs (5: the authors' `ft_ep` and their evaluation
notebook) with the run's optimizer and batch size, a fresh optimizer state, at the
learning rate of the current round; `finetune_part` = full (body and head together) | head
| body (below). The fine-tuned model is the client's personalized model
(`personal_state(i)`); tau_f = 0 deploys the global model.

How the personalized models are produced: the first `personal_state(i)` after the global
model changed fine-tunes ALL N clients in one `engine.train` call (`_finetuned`; the vmap
backend batches them where it applies, the sequential one loops), and the [N, D] result
is kept until the next `round` replaces the global model. An evaluation reads every
client once, so it costs one batched call of tau_f epochs over all clients, not N calls;
the rows are as many as FedAvg's `theta` (N models), dropped when the model changes. The
cache is no state: it is a function of (theta_ext^k, the round, the run's seed), so it is
rebuilt after a resume (`last_round` is checkpointed) and not saved.

RECONSTRUCTION (the paper leaves these open):
- what fine-tuning updates: the abstract says the head is fine-tuned; the authors'
  evaluation notebook fine-tunes body and head together with one learning rate, as PFLlib
  (`fine_tune(['base', 'head'])`) and FL-bench (the whole model) do: `full` by default,
  `head` the abstract's reading;
- fine-tuning learning rate (`finetune_lr`): null (default) is the run's lr at the last
  trained round (`optim.lr_at`); the authors' notebook fine-tunes at 1e-3, which is the lr
  their step schedule (0.1, x0.1 at 1/2 and 3/4 of the rounds) ends at, so null equals
  theirs under their schedule (`finetune_lr=0.001` fixes it); their optimizer is SGD with
  the training momentum, fresh for the fine-tuning, as here (`persist_state` is not applied
  to it);
- fine-tuning batches: the engine's schedule for (seed, round, client) with their own salt,
  so they differ from the round's training batches and are the same on every backend; with
  `data.augment` their crops are keyed the same way (no shared stream is read), so how often
  a run evaluates never changes its training;
- the paper fine-tunes once, after training; we fine-tune at every evaluation (from the
  global model then), so the personalized curve is FedBABU's fine-tuned accuracy over
  rounds (PFLlib evaluates the un-fine-tuned model during training and fine-tunes once at
  the end; FL-bench fine-tunes at evaluations, as here).
Uploads: each client's trained state, of which the server uses the body (kind "model", ref
= the global model it trained from); the head entries it sends back are theta_cls^0 and are
discarded (the server restores theta_cls^0 after its step, also against an attack).
Communication: the body entries (parameters and buffers), each way.
Buffers: belong to the body (the head is one Linear, no buffers): BatchNorm running
statistics are averaged with the body, as any body entry (the authors average the whole state
dict but the head; their models keep no running statistics, BatchNorm with
track_running_stats=False); a personalized model keeps the statistics its fine-tuning
forwards update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._shared import state_entries
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import Weighting, hp, positive
from fedbench.engine import TrainResult

FINETUNE_SALT = 7  # the fine-tuning batches: their own stream, not the round's training batches


@dataclass
class FedBABUParams:
    finetune_epochs: int = hp(ge=0)  # tau_f: personalization epochs (0: the global model)
    finetune_part: Literal["full", "head", "body"]  # what fine-tuning updates
    finetune_lr: float | None = positive()  # fine-tuning lr (null: the run's lr at the round)
    weighting: Weighting  # body average: samples (n_i / n) | uniform (1/C)


@ALGORITHMS.register()
class FedBABU(Algorithm):
    about = About(
        name="FedBABU",
        paper="Oh, Kim, Yun, ICLR 2022",
        summary=(
            "FedAvg on the body only, the head frozen at its random initialization; "
            "each client fine-tunes the global model (whole model, 5 epochs) as its "
            "personalized model"
        ),
        docs="algorithms.md#fedbabu-fedbabu",
        pfllib="FedBABU",
        fl_bench="FedBABU",
    )
    Params = FedBABUParams
    needs_head = True
    has_global = True
    attackable = True
    server_optimizable = True  # server_opt steps on the body average
    state_keys = ("w", "last_round")

    def setup(self) -> None:
        spec = self.engine.spec
        self.head_mask = spec.mask(self.engine.model.head_params(), device=self.device)  # [P]
        self.head_entries = state_entries(self.head_mask, spec.n_state)  # [D]
        part = self.hp.finetune_part
        self.finetune_mask = (
            None if part == "full" else self.head_mask if part == "head" else ~self.head_mask
        )
        self.w = self.engine.initial_state()  # [D]: theta_ext^k with theta_cls^0
        self.last_round = 0  # the round the fine-tuning's lr and batches belong to
        self._tuned: tuple[torch.Tensor, torch.Tensor] | None = None  # (w it came from, [N, D])

    # ------------------------------------------------------------------ pieces
    def finetune(self, w: torch.Tensor, clients, t: int) -> TrainResult:
        """Clients `clients` fine-tune `w` [D] (or their rows [C, D]) on their training data:
        `finetune_epochs` epochs of `finetune_part`, the run's optimizer from a fresh state,
        the lr of round t."""
        lr = self.optim.lr_at(t) if self.hp.finetune_lr is None else self.hp.finetune_lr
        return self.local_train(
            w,
            clients,
            t,
            lr=lr,
            epochs=self.hp.finetune_epochs,
            trainable=self.finetune_mask,
            salt=FINETUNE_SALT,
            slot="finetune",
            optim=self.optim.replace(persist_state=False),
        )

    def _finetuned(self) -> torch.Tensor:
        """[N, D]: every client's fine-tuned model from the current global model, one engine
        call for all clients, kept until the global model changes."""
        if self._tuned is None or self._tuned[0] is not self.w:
            # called from evaluations (under no_grad): Engine.train enables autograd itself;
            # its augmentation is keyed (round, client, salt): training's draws stay as they are
            rows = self.finetune(self.w, np.arange(self.N), self.last_round).states
            self._tuned = (self.w, rows)
        return self._tuned[1]

    # ------------------------------------------------------------------ the contract
    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        res = self.local_train(self.w, clients, t, trainable=~self.head_mask)
        up = self.receive(res.states, clients, ref=self.w)  # the bodies (head entries unused)
        avg = self.server_step("w", self.w, self.weights(clients, self.hp.weighting) @ up)
        self.w = torch.where(self.head_entries, self.w, avg)  # theta_cls^0 stays
        self.last_round = t
        self._tuned = None
        n = len(clients) * (self.engine.n_state - int(self.head_mask.sum()))  # bodies moved
        return RoundReport(res.loss.mean(), self.comm(clients, up=n, down=n))

    def global_state(self) -> torch.Tensor:
        return self.w

    def personal_state(self, i: int) -> torch.Tensor:
        if self.hp.finetune_epochs == 0:
            return self.w
        return self._finetuned()[i]

    def personal_states(self) -> torch.Tensor:
        if self.hp.finetune_epochs == 0:
            return self.w.repeat(self.N, 1)
        return self._finetuned()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._tuned = None
