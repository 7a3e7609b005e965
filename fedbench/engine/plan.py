"""The interface between the `Engine` and its backends: what a call asks for, what it returns.

`Engine.train(...)` turns its keywords into one `TrainPlan` (frozen: the clients, the batch
schedule's arguments, the optimizer and lr, the loss terms, the frozen-parameter mask, SAM,
the slot of kept optimizer state) and hands it to a backend; `Engine.full_grads(...)` does
the same with a `GradPlan`. A backend is any object with

    train(plan: TrainPlan, states [C, D]) -> TrainResult
    full_grads(plan: GradPlan, states [C, D]) -> GradResult
    client_steps(plan: StepPlan, states {name: [C, ...]}, step: ClientStep) -> StepsResult

(`Backend`, as FedJAX's `for_each_client` backends share one signature). Both of fedbench's
(`sequential.SequentialBackend`, `vmap.VmapBackend`) are given what they need when they are
built (the model and its `ModelSpec`, the federation's batches, the `Schedule`, the
`OptimStates` store, the `MemoryModel`); neither imports the engine.

`client_steps` is the client-step vocabulary for client work that `train` cannot express
(pFedMe's inner loops): the algorithm writes one step of one client's loop as a function of
explicit state, `step(state, batch) -> (state, aux)`, where `state` holds rows [k, ...] of
the k clients that take this step and `batch.grad(states [k, D], at=, terms=)` is the
batched primitive (per-client loss [k] and gradient [k, P], buffers updated in place;
optionally at the parameters + `at`, SAM's second gradient, and with loss `Term`s). The
sequential backend calls it with k = 1, client after client, on its module
(`FlatModule.grad_at`); the vmap backend with all clients that still have a batch at step s
at once (`torch.func`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from fedbench.engine.optim import OptimConfig
from fedbench.engine.terms import Term

# A replacement for the cross-entropy: objective(model, x, y, c) -> scalar loss (the batch's
# mean). `c` is the client's position in the train call: an int on the sequential backend, a
# 0-d tensor under vmap, where the objective runs at each client's mapped state; read
# per-client tensors with `client_row(t, c)`, never branch on c or on a tensor's value.
Objective = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]


def client_row(t: torch.Tensor, c: int | torch.Tensor) -> torch.Tensor:
    """Row c of a per-client tensor t [C, ...] inside an `Objective`: `t[c]` for an int (the
    sequential backend's c), an index_select under vmap (a mapped c cannot index directly)."""
    if isinstance(c, int):
        return t[c]
    return t.index_select(0, c.reshape(1)).squeeze(0)


def sequential_objective(objective: Objective, why: str) -> Objective:
    """Mark an objective that vmap cannot run as the sequential backend does (it draws from
    per-client generators, ...): the engine then trains its calls client after client,
    saying `why` (`Engine.backend_for`)."""
    objective.no_vmap = why  # type: ignore[attr-defined]
    return objective


@dataclass
class SAM:
    """Sharpness-aware step: eps = rho * scale * g / ||g||; update with grad at w + eps.

    `scale` is None for SAM/FedSAM (Foret et al. 2021, p = 2), or per-parameter multipliers
    ([P], or [C, P] per client in the train call's order) for LWSAM's layer scores.
    """

    rho: float
    scale: torch.Tensor | None = None

    def perturbation(self, g: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """eps of a gradient g [P], or of each row of g [k, P] (a step function's clients)."""
        e = g * (self.rho / (g.norm(dim=-1, keepdim=True) + 1e-12))
        return e if scale is None else e * scale


@dataclass(frozen=True, eq=False)
class TrainPlan:
    """One `Engine.train` call: E epochs (or K steps) of `optim` over each client's batches.

    Position c of `clients` is row c of the states, of per-client term tensors and of a
    per-client SAM scale. `mask` is the float 0/1 form of `trainable` (0: frozen): [P], the
    same for every client, or [C, P], row c client c's (FedSpa's personal sparse masks).
    """

    clients: tuple[int, ...]
    optim: OptimConfig
    lr: float | torch.Tensor
    batch_size: int
    epochs: int | None = None
    steps: int | None = None
    terms: tuple[Term, ...] = ()
    mask: torch.Tensor | None = None
    sam: SAM | None = None
    objective: Objective | None = None
    round: int = 0  # with the engine's seed, the client and the salt: the batch schedule
    salt: int = 0
    slot: str = "main"  # the kept optimizer state's slot (`optim.persist_state`)

    @classmethod
    def build(
        cls,
        clients: Sequence[int],
        *,
        terms: Sequence[Term] = (),
        trainable: torch.Tensor | None = None,
        **kw,
    ) -> TrainPlan:
        """`Engine.train`'s keywords -> a plan (`trainable`, a [P] or [C, P] bool mask, as 0/1
        floats)."""
        mask = None if trainable is None else trainable.to(torch.get_default_dtype())
        if mask is not None and mask.dim() == 2 and mask.shape[0] != len(clients):
            raise ValueError(f"a per-client trainable mask has {mask.shape[0]} rows, not one "
                             f"per client ({len(clients)})")  # fmt: skip
        return cls(tuple(int(c) for c in clients), terms=tuple(terms), mask=mask, **kw)

    @property
    def per_client_mask(self) -> bool:
        return self.mask is not None and self.mask.dim() == 2

    def term_rows(self, c: int) -> list[tuple[torch.Tensor, ...]]:
        """The terms' tensors of the client at position c."""
        return [t.rows(c) for t in self.terms]

    def sam_scale(self, c: int) -> torch.Tensor | None:
        """SAM's per-parameter scale for the client at position c (None: plain SAM)."""
        if self.sam is None or self.sam.scale is None:
            return None
        return self.sam.scale[c] if self.sam.scale.dim() == 2 else self.sam.scale


@dataclass
class TrainResult:
    states: torch.Tensor  # [C, D] the clients' states after training
    loss: torch.Tensor  # [C] mean training loss over each client's steps
    steps: list[int]  # number of optimizer steps each client took


@dataclass(frozen=True)
class GradPlan:
    """One `Engine.full_grads` call: each client's mean cross-entropy over its whole training
    set (and its gradient), read `block` samples per client at a time, without augmentation."""

    clients: tuple[int, ...]
    with_grad: bool = True
    block: int = 2048


@dataclass
class GradResult:
    loss: torch.Tensor  # [C] mean training loss of each client at its state
    grads: torch.Tensor | None  # [C, P] gradient of that loss (None for losses only)
    buffers: torch.Tensor  # [C, D - P] buffers after the pass (unchanged on vmap)


@dataclass(frozen=True)
class StepPlan:
    """One `Engine.client_steps` call: the clients (position c: row c of every state) and
    their batch schedules (`Schedule.of`: batch size, epochs or steps, round, salt)."""

    clients: tuple[int, ...]
    batch_size: int
    epochs: int | None = None
    steps: int | None = None
    round: int = 0
    salt: int = 0


class StepBatch(Protocol):
    """The t-th batches of the k clients taking a step (`ClientStep`'s second argument);
    `index` is t, the step's position in each client's schedule (the same for all k)."""

    index: int

    def grad(
        self,
        states: torch.Tensor,
        *,
        at: torch.Tensor | None = None,
        terms: Sequence[Term] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss [k], gradient [k, P]) of each client's cross-entropy on its own batch at its
        flat state (row of `states` [k, D]), in training mode; each row's buffers (BatchNorm
        running statistics) are updated in place as that client's forward updated them.

        `at` [k, P]: evaluated at the parameters + `at` (SAM's second gradient), terms too.
        `terms`: loss terms added to each client's cross-entropy (`Term`), their per-client
        tensors rows [k, ...] in the order of `states`, shared ones as they are."""
        ...

    def step(self, name: str, g: torch.Tensor, *, mask: torch.Tensor | None = None) -> None:
        """The optimizer step on the rows `name` (their parameters, in place) with gradient
        g [k, P], for a row the call declared (`Engine.client_steps(optimized=...)`; the
        engine provides it and carries the optimizer's state, `optimized.py`)."""
        ...


# One step of a client's loop: step(state, batch) -> (state, aux). `state` maps names to rows
# [k, ...] of the k clients taking this step (update them in place, or return new tensors
# of the same shapes); `aux` is None or a tensor [k, ...] kept per step (`StepsResult.aux`).
ClientStep = Callable[
    [dict[str, torch.Tensor], StepBatch],
    tuple[dict[str, torch.Tensor], torch.Tensor | None],
]


def write_back(rows: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Copy a step function's returned state into its rows (those it updated in place are
    the rows themselves)."""
    for name, v in new.items():
        if v is not rows[name]:
            rows[name].copy_(v)


@dataclass
class StepsResult:
    states: dict[str, torch.Tensor]  # {name: [C, ...]} after the clients' steps, call order
    aux: torch.Tensor | None  # [S, C, ...] each step's aux (0 past a client's last step)
    steps: list[int]  # number of steps each client took

    def client_mean(self) -> torch.Tensor:
        """[C]: each client's mean of all its steps' aux values (0 without steps): one mean
        per client, over the values in step order (as a per-client loop would take it)."""
        if self.aux is None:
            raise ValueError("the step function returned no aux values")
        out = torch.zeros(len(self.steps), device=self.aux.device)
        for c, n in enumerate(self.steps):
            if n:
                out[c] = self.aux[:n, c].reshape(-1).mean()
        return out


class Backend(Protocol):
    """What the engine asks of a backend (`sequential.py`, `vmap.py`)."""

    name: str

    def train(self, plan: TrainPlan, states: torch.Tensor) -> TrainResult: ...

    def full_grads(self, plan: GradPlan, states: torch.Tensor) -> GradResult: ...

    def client_steps(
        self, plan: StepPlan, states: dict[str, torch.Tensor], step: ClientStep
    ) -> StepsResult: ...
