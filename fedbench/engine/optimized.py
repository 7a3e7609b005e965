"""Optimizer state of `Engine.client_steps` rows, kept by the engine.

A step function that moves some of its rows with an optimizer (Per-FedAvg's outer step,
APPLE's cores, Ditto's and PLGU's two models, pFedHN's inner steps) declares them when it
calls `Engine.client_steps(..., optimized={"theta": Optimized(optim, lr, slot="outer")})`
and steps them with `batch.step("theta", g)`. The engine then

- loads each declared row's optimizer state (momentum, Adam moments) for the call's clients:
  from the `OptimStates` store under `slot` (fresh, or kept across rounds with
  `optim.persist_state`), or fresh for every call without a slot;
- carries it through the steps as rows of the call's states, under names no step function
  sees (`ROWS`), so that both backends move it with the rows they belong to (client after
  client on the sequential backend, in the vmap backend's chunks and step prefixes);
- applies `optim.step_` to the row's parameters (its first P entries: a flat state [D] or a
  parameter row [P]) with that state, and keeps the state in the store after the call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedbench.engine.optim import OptimConfig, init_state, step_
from fedbench.engine.plan import ClientStep, StepBatch, StepsResult
from fedbench.engine.store import OptimStates
from fedbench.engine.terms import Term

ROWS = "optim:"  # the carried state's names: "optim:<row>.<key>" (no step function's)


@dataclass(frozen=True)
class Optimized:
    """A row of a `client_steps` call that its step function moves with `optim` at `lr`
    (`StepBatch.step`). `slot`: the store's slot its state is kept under across rounds
    (`optim.persist_state`, per client, checkpointed with the engine; a client training two
    models keeps two slots); None: a fresh state for every call, never kept."""

    optim: OptimConfig
    lr: float | torch.Tensor
    slot: str | None = None


class Stepping:
    """The batch a step function receives when its call has optimized rows: the backend's
    batch (`index`, `grad`) plus `step`, the optimizer step on a declared row."""

    def __init__(
        self,
        batch: StepBatch,
        rows: dict[str, torch.Tensor],
        optimized: Mapping[str, Optimized],
        keys: Mapping[str, tuple[str, ...]],
        n_params: int,
    ) -> None:
        self.batch, self.rows, self.optimized = batch, rows, optimized
        self.keys, self.n_params = keys, n_params
        self.index = batch.index

    def grad(
        self,
        states: torch.Tensor,
        *,
        at: torch.Tensor | None = None,
        terms: Sequence[Term] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch.grad(states, at=at, terms=terms)

    def step(self, name: str, g: torch.Tensor, *, mask: torch.Tensor | None = None) -> None:
        """One step of row `name`'s optimizer with gradient g [k, P], in place on the rows
        the step function received (their parameters) and on their optimizer state;
        `mask` [P] freezes entries (`optim.step_`). g is left as it is."""
        o = self.optimized[name]
        state = {k: self.rows[f"{ROWS}{name}.{k}"] for k in self.keys[name]}
        with torch.no_grad():
            step_(o.optim, self.rows[name][:, : self.n_params], g, state, o.lr, mask=mask)


class OptimizedRows:
    """One `client_steps` call's optimized rows: `load` before the backend runs, `step` the
    function it runs, `keep` after it."""

    def __init__(
        self,
        optimized: Mapping[str, Optimized],
        store: OptimStates,
        clients: Sequence[int],
        n_params: int,
        device: torch.device,
    ) -> None:
        slots = [o.slot for o in optimized.values() if o.slot is not None]
        if len(set(slots)) != len(slots):
            raise ValueError(f"optimized rows share a slot: {slots}")
        self.optimized, self.store, self.n_params = dict(optimized), store, n_params
        self.ids = torch.as_tensor(list(clients), dtype=torch.long, device=device)
        self.keys: dict[str, tuple[str, ...]] = {}

    def load(self, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`states` with each optimized row's state added under its `ROWS` names."""
        if not self.optimized:
            return states
        if any(n.startswith(ROWS) for n in states):
            raise ValueError(f"state names starting with {ROWS!r} are the engine's")
        out = dict(states)
        for name, o in self.optimized.items():
            rows = states.get(name)
            if rows is None or rows.dim() != 2 or rows.shape[1] < self.n_params:
                raise ValueError(
                    f"optimized row {name!r}: not a state of rows [C, >= {self.n_params}]"
                )
            w = rows[:, : self.n_params]
            if o.slot is None:
                st = init_state(o.optim, w)
            else:
                st = self.store.get(o.optim, o.slot, self.ids, w)
            self.keys[name] = tuple(st)
            out.update({f"{ROWS}{name}.{k}": v for k, v in st.items()})
        return out

    def step(self, step: ClientStep) -> ClientStep:
        """`step` given the rows it declared (not the carried state) and a `Stepping` batch."""
        if not self.optimized:
            return step

        def stepping(st: dict[str, torch.Tensor], batch: StepBatch):
            mine = {n: v for n, v in st.items() if not n.startswith(ROWS)}
            return step(mine, Stepping(batch, st, self.optimized, self.keys, self.n_params))

        return stepping

    def keep(self, res: StepsResult) -> StepsResult:
        """Store the carried state (slots) and drop it from the result's states."""
        if not self.optimized:
            return res
        for name, o in self.optimized.items():
            if o.slot is not None:
                st = {k: res.states[f"{ROWS}{name}.{k}"] for k in self.keys[name]}
                self.store.keep(o.optim, o.slot, self.ids, st)
        res.states = {n: v for n, v in res.states.items() if not n.startswith(ROWS)}
        return res
