"""The sequential backend: the clients of a call one after another on one module.

The module is a `FlatModule` (its parameters, grads and buffers are views of flat vectors),
so loading a client is one copy, a step is a plain forward/backward (autograd accumulates
straight into the flat gradient) plus one fused optimizer update (`optim.step_`), and no
per-client module or optimizer object exists. Data are tensors on the training device,
batches are gathered by index (`Schedule`), and nothing in the step loop synchronises with
the host (losses accumulate on the device).

It runs everything `Engine.train` accepts: float buffers (BatchNorm running statistics
update in the forward, as in any PyTorch training step), dropout (keyed dropout with the
`Schedule`'s key of each batch), custom objectives, data augmentation (as the `Schedule`
draws it per client and batch). `full_grads` reads each
client's whole training set in blocks without augmentation, the module in training mode
(BatchNorm on the block's statistics; the buffers after the pass come back as
`GradResult.buffers`). `client_steps` runs an algorithm's step function client after client
with k = 1, its gradients from `FlatModule.grad_at` (what hand-written loops call, `at` and
terms included: the numbers of the per-client loops the step functions replaced).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fedbench.engine.flat import FlatModule
from fedbench.engine.optim import step_, trained_ranges
from fedbench.engine.plan import (
    ClientStep,
    GradPlan,
    GradResult,
    StepPlan,
    StepsResult,
    TrainPlan,
    TrainResult,
    write_back,
)
from fedbench.engine.schedule import Schedule
from fedbench.engine.store import OptimStates
from fedbench.engine.terms import Term
from fedbench.models.dropout import dropout_key


class OneClient:
    """One client's batch of a step (`StepBatch` with k = 1), its gradients on the module."""

    def __init__(
        self,
        module: FlatModule,
        x: torch.Tensor,
        y: torch.Tensor,
        index: int,
        key: torch.Tensor | None = None,
    ) -> None:
        self.module, self.x, self.y, self.index, self.key = module, x, y, index, key

    def grad(
        self,
        states: torch.Tensor,
        *,
        at: torch.Tensor | None = None,
        terms: Sequence[Term] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # exactly a hand-written loop's call: the terms' rows are the client's (position 0)
        loss, g = self.module.grad_at(
            states[0],
            self.x,
            self.y,
            at=None if at is None else at[0],
            terms=terms,
            rows=[t.rows(0) for t in terms],
            key=self.key,
        )
        return loss[None], g[None]


class SequentialBackend:
    name = "sequential"

    def __init__(
        self,
        module: FlatModule,
        fed,
        schedule: Schedule,
        optim_states: OptimStates,
        device: torch.device,
    ) -> None:
        self.module = module
        self.fed = fed
        self.schedule = schedule
        self.optim_states = optim_states
        self.device = device

    def train(self, plan: TrainPlan, states: torch.Tensor) -> TrainResult:
        """Train each client's state (row c of `states`, client `plan.clients[c]`)."""
        mod, clients = self.module, plan.clients
        out = torch.empty(len(clients), mod.spec.n_state, device=self.device)
        losses = torch.zeros(len(clients), device=self.device)
        n_steps: list[int] = []
        mod.model.train()
        # whole tensors the mask freezes take no gradient (SAM's perturbation reads the whole
        # gradient's norm: not with SAM)
        frozen = mod.spec.frozen(plan.mask) if plan.sam is None else frozenset()
        with mod.frozen(frozen):
            self._train_clients(plan, states, out, losses, n_steps)
        return TrainResult(out, losses, n_steps)

    def _train_clients(self, plan: TrainPlan, states, out, losses, n_steps: list[int]) -> None:
        mod, clients = self.module, plan.clients
        optim, mask, sam = plan.optim, plan.mask, plan.sam
        step_mask = trained_ranges(mask)  # one host read per call
        w, g = mod.params, mod.grad
        for c, client in enumerate(clients):
            if plan.per_client_mask:  # client c's own row
                mask = step_mask = plan.mask[c]
            mod.load(states[c])
            ost = self.optim_states.get(optim, plan.slot, client, w)
            rows = plan.term_rows(c)
            scale = plan.sam_scale(c)
            total = torch.zeros((), device=self.device)
            n = 0
            idx, lens = self.schedule.of(plan, client)
            draws = self.schedule.draws_of(plan, client, idx)
            keys = self.schedule.keys_of(plan, client, len(lens))
            for x, y in self.schedule.read(idx, lens, draws):
                key = None if keys is None else keys[n]
                n += 1
                total += mod.grad_at_loaded(x, y, plan.terms, rows, plan.objective, c, key)
                if sam is not None:
                    e = sam.perturbation(g, scale)
                    if mask is not None:
                        e = e * mask
                    with torch.no_grad():
                        w.add_(e)
                    mod.grad_at_loaded(x, y, plan.terms, rows, plan.objective, c, key)
                    with torch.no_grad():
                        w.sub_(e)
                with torch.no_grad():
                    step_(optim, w, g, ost, plan.lr, mask=step_mask)
            self.optim_states.keep(optim, plan.slot, client, ost)
            out[c] = mod.state
            n_steps.append(n)
            losses[c] = total / max(n, 1)

    def full_grads(self, plan: GradPlan, states: torch.Tensor) -> GradResult:
        """Each client's mean loss (and gradient) over its training set at row c of `states`."""
        mod = self.module
        P, dev, block = mod.spec.n_params, self.device, plan.block
        C = len(plan.clients)
        losses = torch.zeros(C, device=dev)
        grads = torch.zeros(C, P, device=dev) if plan.with_grad else None
        bufs = states[:, P:].clone()
        model = mod.model
        model.train()
        for c, client in enumerate(plan.clients):
            mod.load(states[c])
            pool = self.fed.train_idx[client]
            n = int(pool.numel())
            if n == 0:
                continue
            mod.grad.zero_()
            keys = self.schedule.full_keys(client, -(-n // block))
            for j, s in enumerate(range(0, n, block)):
                x, y = self.fed.batch(pool[s : s + block], train=False)
                key = None if keys is None else keys[j]
                if plan.with_grad:
                    with dropout_key(key):
                        loss = F.cross_entropy(model(x), y, reduction="sum") / n
                    loss.backward()  # accumulates into mod.grad (the module's .grad views)
                else:
                    with torch.no_grad(), dropout_key(key):
                        loss = F.cross_entropy(model(x), y, reduction="sum") / n
                losses[c] += loss.detach()
            if plan.with_grad:
                grads[c] = mod.grad
            bufs[c] = mod.state[P:]
        return GradResult(losses, grads, bufs)

    def client_steps(
        self, plan: StepPlan, states: dict[str, torch.Tensor], step: ClientStep
    ) -> StepsResult:
        """Each client's loop in turn: `step` on its rows [1, ...] for each of its batches."""
        clients = plan.clients
        out = {n: v.clone(memory_format=torch.contiguous_format) for n, v in states.items()}
        sched = [self.schedule.of(plan, c) for c in clients]
        S = max((len(lens) for _, lens in sched), default=0)
        aux: torch.Tensor | None = None
        self.module.model.train()
        for c, client in enumerate(clients):
            idx, lens = sched[c]
            draws = self.schedule.draws_of(plan, client, idx)
            keys = self.schedule.keys_of(plan, client, len(lens))
            rows = {n: v[c : c + 1] for n, v in out.items()}  # views
            for s, (x, y) in enumerate(self.schedule.read(idx, lens, draws)):
                key = None if keys is None else keys[s]
                new, a = step(rows, OneClient(self.module, x, y, s, key))
                write_back(rows, new)
                if a is not None:
                    if aux is None:
                        aux = a.new_zeros(S, len(clients), *a.shape[1:])
                    aux[s, c] = a[0]
        return StepsResult(out, aux, [len(lens) for _, lens in sched])
