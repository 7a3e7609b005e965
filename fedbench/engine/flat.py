"""One module for every client: its parameters, their `.grad` and its buffers are views of
flat vectors, so loading a client's state is one copy.

`FlatModule.state` [D] (parameters, then float buffers, `spec.py`'s layout) and
`FlatModule.grad` [P] own the memory; `load(state)` copies a client's row in, a plain
forward/backward (`grad_at_loaded`) accumulates straight into `grad`. The sequential backend
trains and computes full gradients on it, the engine evaluates on it, and the hand-written
loops of `fedbench/algorithms/_steps.py` and the sequential `Engine.client_steps` step on it
(`grad_at`, `Engine.grad_at`: a state's gradient, its buffers updated as the forward
left them).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fedbench.engine.plan import Objective
from fedbench.engine.spec import ModelSpec
from fedbench.engine.terms import Term, Workspace, closed_form, values_and_grad
from fedbench.models.dropout import dropout_key


class FlatModule:
    def __init__(self, model: nn.Module, spec: ModelSpec, device: torch.device) -> None:
        """Make `model`'s parameters, grads and buffers views of `state` / `grad`."""
        self.model = model
        self.spec = spec
        self.state = spec.flatten(model).to(device)  # [D]
        self.grad = torch.zeros(spec.n_params, device=device)  # [P]
        self._workspace = Workspace()  # closed-form terms' [P] buffers, kept across steps
        for e in spec.params:
            p = model.get_parameter(e.name)
            p.data = self.state[e.start : e.stop].view(e.shape)
            p.grad = self.grad[e.start : e.stop].view(e.shape)
        for e in spec.buffers:
            mod_name, _, leaf = e.name.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            mod._buffers[leaf] = self.state[e.start : e.stop].view(e.shape)

    @contextmanager
    def frozen(self, names: frozenset[str]):
        """Within the block the named parameters take no gradient (`requires_grad` off):
        a backward stops where nothing upstream trains (FedRep's head epochs backpropagate
        through the head alone). Their `.grad` entries stay 0."""
        params = [self.model.get_parameter(n) for n in names]
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in params:
                p.requires_grad_(True)

    @property
    def params(self) -> torch.Tensor:
        """The parameter part [P] of `state` (a view: the module's parameters)."""
        return self.state[: self.spec.n_params]

    def load(self, state: torch.Tensor) -> None:
        """Put a flat state ([D], or parameters only [P]) into the module."""
        self.state[: state.shape[-1]].copy_(state)

    def _terms_grad(self, w: torch.Tensor, terms: Sequence[Term], rows) -> torch.Tensor:
        """Value of the extra terms at w; their gradient is added into `grad` (in closed
        form where every term has one: the same bits as autograd's, `terms.values_and_grad`)."""
        w = w.detach()
        if closed_form(terms):
            values, g = values_and_grad(w, terms, rows, self._workspace)
            self.grad.add_(g)
            return sum(values)
        wl = w.requires_grad_(True)
        val = sum(t.value(wl, *r) for t, r in zip(terms, rows))
        (g,) = torch.autograd.grad(val, wl)
        self.grad.add_(g)
        return val.detach()

    def grad_at_loaded(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        terms: Sequence[Term] = (),
        rows=(),
        objective: Objective | None = None,
        c: int = 0,
        key: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss of the loaded model on (x, y) (+ terms); its gradient lands in `grad`.

        A training step: the module is put in training mode (BatchNorm normalizes with the
        batch and updates its running statistics, dropout drops), whatever an evaluation
        left. `objective(model, x, y, c)` replaces the cross-entropy (FedProto's prototype
        loss, FedRoD's two heads ...); `c` is the client's position in the train call.
        `key`: the batch's dropout key (`Schedule.keys`; None: the surrounding block's).
        """
        self.model.train()
        self.grad.zero_()
        with dropout_key(key):
            if objective is None:
                loss = F.cross_entropy(self.model(x), y)
            else:
                loss = objective(self.model, x, y, c)
        loss.backward()
        loss = loss.detach()
        if terms:
            loss = loss + self._terms_grad(self.params, terms, rows)
        return loss

    def grad_at(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        at: torch.Tensor | None = None,
        terms: Sequence[Term] = (),
        rows=(),
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, gradient [P]) of the flat `state` [D] (evaluated at state + `at` when given)
        on (x, y), a training step (`grad_at_loaded`, with the dropout `key`). The gradient
        is a tensor of its own (not `grad`, which the next call overwrites); `state`'s
        buffers (running statistics) are updated in place as the forward updated the
        module's. A perturbed evaluation is done as the sequential backend does SAM: add `at`
        in place, forward/backward, subtract.
        """
        P = self.spec.n_params
        if at is not None:
            state[:P].add_(at)
        self.load(state)
        loss = self.grad_at_loaded(x, y, terms, rows, key=key)
        if at is not None:
            state[:P].sub_(at)
        if self.spec.has_buffers:
            buffers = dict(self.model.named_buffers())
            for e in self.spec.buffers:
                state[e.start : e.stop] = buffers[e.name].reshape(-1)
        return loss, self.grad.clone()
