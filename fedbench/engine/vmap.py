"""The vmap backend: all sampled clients' local steps as one batched computation.

Why: on a GPU a per-client loop over small models is bound by kernel launches and Python,
not by arithmetic. Stacking the clients' parameter vectors along a leading client axis and
mapping one client's loss over it (`torch.func.vmap` of `grad_and_value` of
`functional_call`) turns C small matmuls into one batched matmul (C convolutions into one
grouped convolution), so a round costs about as many launches as one client does.

Equal to the sequential backend, by construction:
- Batches are the `Schedule`'s, per client, stacked step-major into idx [S, C, B] with S
  the longest client's step count and B the largest batch; padding points at sample 0.
- Per-sample weights wt [S, C, B] are 1/len on a batch's real samples and 0 on padding, so
  the weighted sum of per-sample cross-entropies is the sequential backend's batch mean.
- Each client takes exactly its own steps: clients are ordered by step count (longest
  first), so at step s the clients still training are a prefix of the chunk and the step
  runs on the view W[:k]. Finished clients cost nothing, and their parameters and optimizer
  state stay exactly as they are (masking them, `optim.step_(active=...)`, would compute
  their padded steps only to throw them away).
- Loss terms are the same `Term.value` code; their per-client tensors map with the clients
  (vmap in_dims 0), shared ones broadcast (in_dims None). SAM's perturbation is the same
  `SAM.perturbation`, mapped per client; the second gradient is taken at W + eps.

Full gradients (`full_grads`, FedPG's client reports): each client's whole training set,
padded to the longest with weight 0 and each real sample weighted 1/n_c, one batched pass per
block of samples, so a client's weighted sum is its mean loss.

Memory: clients go through in chunks, each chunk running all of its steps (or blocks) before
the next, so a chunk's size moves peak memory and nothing else (`memory.MemoryModel`, the
same estimate for training and for full gradients).

Not covered (`blocker` says why; the engine routes these to the sequential backend, see
`Engine.backend_for`): models with float buffers (BatchNorm running statistics update in
place in the forward), models with dropout (vmap cannot draw the sequential backend's random
numbers) and custom objectives (an arbitrary callable on the module). With `data.augment`,
the federation's one augmentation stream would be read in step order instead of client order
(the same batches, other random crops and flips), so only an explicit `engine.backend=vmap`
runs it there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedbench.engine.memory import MemoryModel
from fedbench.engine.optim import OptimConfig, step_
from fedbench.engine.plan import SAM, GradPlan, GradResult, TrainPlan, TrainResult
from fedbench.engine.schedule import Schedule
from fedbench.engine.spec import ModelSpec
from fedbench.engine.store import OptimStates
from fedbench.engine.terms import Term


def blocker(model: nn.Module, spec: ModelSpec) -> str | None:
    """Why `model` cannot go through the vmap backend and match sequential, if so."""
    if spec.has_buffers:
        return "the model has float buffers (BatchNorm running statistics update in place)"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return "the model has dropout (vmap cannot draw the sequential random numbers)"
    return None


class VmapBackend:
    """Trains a chunk of clients at a time with one vmapped gradient per step."""

    name = "vmap"

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        fed,
        schedule: Schedule,
        optim_states: OptimStates,
        memory: MemoryModel,
        device: torch.device,
    ) -> None:
        self.model = model  # called functionally (`functional_call`): its own values unused
        self.spec = spec
        self.fed = fed
        self.schedule = schedule
        self.optim_states = optim_states
        self.memory = memory
        self.device = device

    # ------------------------------------------------------------------ training
    def train(self, plan: TrainPlan, states: torch.Tensor) -> TrainResult:
        """New states [C, D], the clients' mean losses [C] and their step counts."""
        if plan.objective is not None:
            raise ValueError("a custom objective runs on the sequential backend only")
        clients, optim, sam = plan.clients, plan.optim, plan.sam
        C, P, dev = len(clients), self.spec.n_params, self.device
        sched = [self.schedule.of(plan, c) for c in clients]
        B = max((idx.shape[1] for idx, _ in sched), default=1)
        k = self.memory.chunk_size(C, self.memory.train_bytes(optim, B, sam is not None))
        out = torch.empty(C, self.spec.n_state, device=dev)
        out[:, P:] = states[:, P:]  # buffers (none on this path) pass through
        losses = torch.empty(C, device=dev)
        # longest first (stable): the clients still training are always a prefix of a chunk,
        # and a chunk holds clients of similar step counts
        order = sorted(range(C), key=lambda c: -len(sched[c][1]))
        self.model.train()
        for lo in range(0, C, k):
            pos = torch.tensor(order[lo : lo + k], device=dev)  # positions in the call
            W = states[pos, :P]  # a copy: advanced indexing
            ids = torch.tensor([clients[c] for c in order[lo : lo + k]], device=dev)
            ost = self.optim_states.get(optim, plan.slot, ids, W)
            chunk = [sched[c] for c in order[lo : lo + k]]
            losses[pos] = self._train_chunk(
                W, ost, chunk, optim, plan.lr, plan.terms, plan.mask, sam, pos
            )
            self.optim_states.keep(optim, plan.slot, ids, ost)
            out[pos, :P] = W
        return TrainResult(out, losses, [len(lens) for _, lens in sched])

    def _train_chunk(
        self,
        W: torch.Tensor,
        ost: dict[str, torch.Tensor],
        sched: list[tuple[torch.Tensor, list[int]]],
        optim: OptimConfig,
        lr: float | torch.Tensor,
        terms: Sequence[Term],
        mask: torch.Tensor | None,
        sam: SAM | None,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """All steps of one chunk of clients, ordered by step count (longest first); W [C, P]
        and `ost` are updated in place. `rows`: the clients' positions in the train call.

        Returns each client's mean loss over its own steps.
        """
        dev = self.device
        idx, wt, n_steps = stack_schedules(sched, dev)
        S, C, B = idx.shape
        training = [sum(n > s for n in n_steps) for s in range(S)]  # clients left at step s
        # the chunk's rows of per-client tensors: terms' references, LWSAM's scale
        tensors, dims = [], []
        for t in terms:
            for v, pc in zip(t.tensors(), t.per_client):
                tensors.append(v[rows] if pc else v)
                dims.append(0 if pc else None)
        grad = vmap(grad_and_value(self._loss(terms)), in_dims=(0, 0, 0, 0, *dims))
        if sam is not None:
            scale = sam.scale
            scale_dim = 0 if scale is not None and scale.dim() == 2 else None
            scale = scale[rows] if scale_dim == 0 else scale
            perturbation = vmap(sam.perturbation, in_dims=(0, scale_dim))
        total = torch.zeros(C, device=dev)
        for s, k in enumerate(training):
            # views of the first k clients: the step updates W and `ost` in place
            w, st = W[:k], {name: v[:k] for name, v in ost.items()}
            ts = [v[:k] if d == 0 else v for v, d in zip(tensors, dims)]
            x, y = self.fed.batch(idx[s, :k].reshape(-1))
            x, y = x.view(k, B, *x.shape[1:]), y.view(k, B)
            g, val = grad(w, x, y, wt[s, :k], *ts)
            if sam is not None:
                e = perturbation(g, scale[:k] if scale_dim == 0 else scale)
                if mask is not None:
                    e = e * mask
                g, _ = grad(w + e, x, y, wt[s, :k], *ts)
            total[:k] += val
            step_(optim, w, g, st, lr, mask=mask)
        return total / torch.tensor(n_steps, device=dev).clamp(min=1)

    def _loss(self, terms: Sequence[Term]):
        """One client's loss: weighted cross-entropy of its batch plus the terms at w [P]."""
        model, spec = self.model, self.spec
        sizes = [len(t.per_client) for t in terms]

        def loss(w, x, y, wt, *tensors):
            logits = functional_call(model, spec.param_views(w), (x,))
            val = (F.cross_entropy(logits, y, reduction="none") * wt).sum()
            i = 0
            for t, k in zip(terms, sizes):
                val = val + t.value(w, *tensors[i : i + k])
                i += k
            return val

        return loss

    # ------------------------------------------------------------------ full gradients
    def full_grads(self, plan: GradPlan, states: torch.Tensor) -> GradResult:
        """Each client's mean loss (and gradient) over its training set at row c of `states`:
        all clients of a chunk in one batched pass per block of samples."""
        P, dev, block = self.spec.n_params, self.device, plan.block
        C = len(plan.clients)
        model, spec = self.model, self.spec
        pools = [self.fed.train_idx[c] for c in plan.clients]
        sizes = torch.tensor([int(p.numel()) for p in pools], device=dev)
        n_max = int(sizes.max())
        idx = torch.zeros(C, n_max, dtype=torch.long, device=dev)
        for c, p in enumerate(pools):
            idx[c, : p.numel()] = p.to(dev)
        wt = (torch.arange(n_max, device=dev)[None, :] < sizes[:, None]).float()
        wt = wt / sizes.clamp(min=1)[:, None].float()

        def loss(w, x, y, wc):
            logits = functional_call(model, spec.param_views(w), (x,))
            return (F.cross_entropy(logits, y, reduction="none") * wc).sum()

        fn = vmap(grad_and_value(loss)) if plan.with_grad else vmap(loss)
        k = self.memory.chunk_size(C, self.memory.grad_bytes(block))
        losses = torch.zeros(C, device=dev)
        grads = torch.zeros(C, P, device=dev) if plan.with_grad else None
        model.train()
        for lo in range(0, C, k):
            W = states[lo : lo + k, :P]
            kc = W.shape[0]
            for s in range(0, n_max, block):
                ib = idx[lo : lo + k, s : s + block]
                b = ib.shape[1]
                x, y = self.fed.batch(ib.reshape(-1), train=False)
                x, y = x.view(kc, b, *x.shape[1:]), y.view(kc, b)
                wb = wt[lo : lo + k, s : s + block]
                if plan.with_grad:
                    g, v = fn(W, x, y, wb)
                    grads[lo : lo + k] += g
                else:
                    with torch.no_grad():
                        v = fn(W, x, y, wb)
                losses[lo : lo + k] += v.detach()
        return GradResult(losses, grads, states[:, P:].clone())


def stack_schedules(
    sched: list[tuple[torch.Tensor, list[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Per-client schedules -> step-major idx [S, C, B] (padding: pool index 0), sample
    weights wt [S, C, B] (1/len on a batch's samples, 0 on padding) and each client's steps."""
    C = len(sched)
    S = max((len(lens) for _, lens in sched), default=0)
    B = max((idx.shape[1] for idx, _ in sched), default=1)
    idx = torch.zeros(S, C, B, dtype=torch.long, device=device)
    lens = torch.zeros(S, C)
    for c, (ix, ln) in enumerate(sched):
        idx[: ix.shape[0], c, : ix.shape[1]] = ix
        lens[: len(ln), c] = torch.tensor(ln, dtype=lens.dtype)
    wt = (torch.arange(B) < lens[..., None]) / lens.clamp(min=1)[..., None]
    return idx, wt.to(device), [len(ln) for _, ln in sched]
