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
  (vmap in_dims 0), shared ones broadcast (in_dims None). A term with a closed-form gradient
  (`Term.value_and_grad`: every term fedbench has) is added after the mapped gradient, over
  the [k, P] rows at once, in the order autograd would add it (the same bits). SAM's
  perturbation is the same `SAM.perturbation`, mapped per client; the second gradient is
  taken at W + eps.
- Buffers (BatchNorm running statistics, and its step counter) are per-client batched
  inputs of the mapped loss, one contiguous [C, ...] tensor per buffer: the forward updates
  them in place per client, as the sequential loop's forward updates the loaded client's
  (momentum update; each forward, SAM's second one too, counts one step on the module's
  counter). A model with BatchNorm normalizes with its batch's statistics, so padding must
  not enter them: a step runs one mapped call per group of clients whose batches have the
  same length (one group except at an epoch's short last batch), each on its real samples.
- Augmentation (`data.augment`) crops and flips as the `Schedule`'s draws say, keyed by
  (seed, round, client, salt) and the batch: the sequential backend's crops and flips.
- Dropout (`fedbench.models.dropout.KeyedDropout`) drops as the `Schedule`'s keys say, one
  per client and batch, stacked step-major [S, C] like the draws and mapped into the loss
  (a 0-d key per client): its masks are a hash of (key, layer, element), the sequential
  backend's masks.
- `client_steps` (an algorithm's own step function, `plan.ClientStep`) walks the same
  stacked schedules step by step: at step s the clients that still have a batch (a prefix,
  longest first) take it together; their `MappedBatch.grad` is the mapped gradient of the
  same `_loss` (with the step's terms, at W + `at` for SAM), in the same groups of batch
  lengths, buffers as above.

Full gradients (`full_grads`, FedPG's client reports): each client's whole training set,
padded to the longest with weight 0 and each real sample weighted 1/n_c, one batched pass per
block of samples, so a client's weighted sum is its mean loss (with BatchNorm, per group of
equal block lengths, as in training).

Memory: clients go through in chunks, each chunk running all of its steps (or blocks) before
the next, so a chunk's size moves peak memory and nothing else (`memory.MemoryModel`, the
same estimate for training and for full gradients).

Not covered (`blocker` says why; the engine routes these to the sequential backend, see
`Engine.backend_for`): torch's own dropout (`nn.Dropout` rather than `KeyedDropout`: its
masks come from torch's global generator inside the forward, drawn in the order forwards
run, so one mapped forward would draw other masks than C sequential ones) and BatchNorm
without momentum (its cumulative average reads the step counter as a Python number, which a
mapped counter cannot give).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedbench.engine.memory import GRAD_ROWS, STEP_ROWS, MemoryModel
from fedbench.engine.optim import OptimConfig, Ranges, step_, trained_ranges
from fedbench.engine.plan import (
    SAM,
    ClientStep,
    GradPlan,
    GradResult,
    Objective,
    StepPlan,
    StepsResult,
    TrainPlan,
    TrainResult,
    write_back,
)
from fedbench.engine.schedule import Schedule
from fedbench.engine.spec import ModelSpec
from fedbench.engine.store import OptimStates
from fedbench.engine.terms import Term, Workspace, closed_form, values_and_grad
from fedbench.models.dropout import KeyedDropout, dropout_key, has_keyed_dropout


def blocker(model: nn.Module, spec: ModelSpec) -> str | None:
    """Why `model` cannot go through the vmap backend and match sequential, if so."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and not isinstance(m, KeyedDropout):
            return (
                "the model has torch's dropout (its masks come from torch's global generator;"
                " fedbench.models.KeyedDropout draws keyed masks)"
            )
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None:
            return "BatchNorm with momentum=None (a cumulative average over a global counter)"
    return None


def batch_statistics(model: nn.Module) -> bool:
    """Whether a training forward normalizes with statistics over the batch (BatchNorm):
    padded samples must then stay out of the batch."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


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
        # integer buffers (BatchNorm's num_batches_tracked): not in the flat state; mapped
        # as per-client counters, their counts added to the module's (the sequential count)
        self.counters = [n for n, b in model.named_buffers() if not b.is_floating_point()]
        self.batch_stats = batch_statistics(model)
        # keyed dropout: each mapped loss takes its client's batch key (else a None, unmapped)
        self.key_dim = 0 if has_keyed_dropout(model) else None
        self._plain = None  # `_plain_grad`, built on first use

    def _buffers(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of `states`' buffers, one contiguous [C, *shape] per buffer (a batched
        in-place update of a strided view is lost), and zero counters [C]."""
        C = states.shape[0]
        out = {
            e.name: states[:, e.start : e.stop]
            .reshape(C, *e.shape)
            .clone(memory_format=torch.contiguous_format)
            for e in self.spec.buffers
        }
        for n in self.counters:
            out[n] = torch.zeros(C, dtype=torch.long, device=self.device)
        return out

    def _keep_buffers(self, out: torch.Tensor, rows, bufs: dict[str, torch.Tensor]) -> None:
        """Write the buffers into rows `rows` of the flat states `out`; count the forwards."""
        for e in self.spec.buffers:
            b = bufs[e.name]
            out[rows, e.start : e.stop] = b.reshape(b.shape[0], -1)
        with torch.no_grad():
            for n in self.counters:
                self.model.get_buffer(n).add_(bufs[n].sum())

    # ------------------------------------------------------------------ training
    def train(self, plan: TrainPlan, states: torch.Tensor) -> TrainResult:
        """New states [C, D], the clients' mean losses [C] and their step counts."""
        clients, optim, sam = plan.clients, plan.optim, plan.sam
        C, P, dev = len(clients), self.spec.n_params, self.device
        sched = [self.schedule.of(plan, c) for c in clients]
        B = max((idx.shape[1] for idx, _ in sched), default=1)
        k = self.memory.chunk_size(C, self.memory.train_bytes(optim, B, sam is not None))
        out = torch.empty(C, self.spec.n_state, device=dev)
        losses = torch.empty(C, device=dev)
        # longest first (stable): the clients still training are always a prefix of a chunk,
        # and a chunk holds clients of similar step counts
        order = sorted(range(C), key=lambda c: -len(sched[c][1]))
        # whole tensors the mask freezes take no gradient (not with SAM: its perturbation
        # reads the whole gradient's norm)
        frozen = self.spec.frozen(plan.mask) if sam is None else frozenset()
        step_mask = trained_ranges(plan.mask)  # one host read per call
        self.model.train()
        for lo in range(0, C, k):
            pos = torch.tensor(order[lo : lo + k], device=dev)  # positions in the call
            W = states[pos, :P]  # a copy: advanced indexing
            ids = torch.tensor([clients[c] for c in order[lo : lo + k]], device=dev)
            ost = self.optim_states.get(optim, plan.slot, ids, W)
            bufs = self._buffers(states[pos])
            chunk = [sched[c] for c in order[lo : lo + k]]
            mine = order[lo : lo + k]  # positions on the host: no device-to-host copy
            draws = [self.schedule.draws_of(plan, clients[c], sched[c][0]) for c in mine]
            keys = [self.schedule.keys_of(plan, clients[c], len(sched[c][1])) for c in mine]
            losses[pos] = self._train_chunk(
                W, bufs, ost, chunk, draws, optim, plan.lr, plan.terms,
                step_mask[pos] if plan.per_client_mask else step_mask, sam, pos,
                plan.objective, frozen, keys,
            )  # fmt: skip
            self.optim_states.keep(optim, plan.slot, ids, ost)
            out[pos, :P] = W
            self._keep_buffers(out, pos, bufs)
        return TrainResult(out, losses, [len(lens) for _, lens in sched])

    def _train_chunk(
        self,
        W: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        ost: dict[str, torch.Tensor],
        sched: list[tuple[torch.Tensor, list[int]]],
        draws: list[torch.Tensor | None],
        optim: OptimConfig,
        lr: float | torch.Tensor,
        terms: Sequence[Term],
        mask: torch.Tensor | Ranges | None,
        sam: SAM | None,
        rows: torch.Tensor,
        objective: Objective | None = None,
        frozen: frozenset[str] = frozenset(),
        keys: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """All steps of one chunk of clients, ordered by step count (longest first); W [C, P],
        the buffers `bufs` and `ost` are updated in place. `draws`: each client's augmentation
        draws (or None); `rows`: the clients' positions in the train call, which a custom
        `objective` receives as its `c` (a 0-d tensor under vmap: it indexes with it);
        `frozen`: the parameters that take no gradient (`ModelSpec.frozen`); `keys`: each
        client's dropout keys [S_c] (or None).

        Returns each client's mean loss over its own steps.
        """
        dev = self.device
        idx, wt, n_steps = stack_schedules(sched, dev)
        aug = stack_draws(draws, idx.shape, dev)
        K = stack_keys(keys or [], idx.shape[0], dev)
        S, C, B = idx.shape
        training = [sum(n > s for n in n_steps) for s in range(S)]  # clients left at step s
        # real samples per step [S][C] (batch statistics or an objective, which takes the
        # batch's mean itself: padding must stay out), from the host-side schedules
        exact = self.batch_stats or objective is not None
        lens = step_lengths(sched, S) if exact else [[B] * C] * S
        # the chunk's rows of per-client tensors: terms' references, LWSAM's scale
        tensors, dims = [], []
        for t in terms:
            for v, pc in zip(t.tensors(), t.per_client):
                tensors.append(v[rows] if pc else v)
                dims.append(0 if pc else None)
        # a mask whose trained ranges hold whole parameters (FedRep's head epochs): the
        # gradient of those ranges alone, not a [k, P] one assembled around the frozen zeros
        plain_sgd = optim.name == "sgd" and sam is None and not terms
        ranges = mask.ranges if plain_sgd and isinstance(mask, Ranges) else ()
        where = self.spec.range_of(ranges) if ranges else None
        if where is not None:
            by_range = vmap(
                grad_and_value(self._loss_ranges(ranges, where, objective)),
                in_dims=(0, 0, 0, 0, 0, 0, 0, self.key_dim),
            )

            def grad(w, b, x, y, ws, c, key):
                return by_range(tuple(w[:, a:z] for a, z in ranges), w, b, x, y, ws, c, key)
        elif terms and closed_form(terms):
            grad = self._with_terms(
                vmap(
                    grad_and_value(self._loss((), objective, frozen)),
                    in_dims=(0, 0, 0, 0, 0, 0, self.key_dim),
                ),
                terms,
                Workspace(),  # this chunk's steps
            )
        else:
            grad = vmap(
                grad_and_value(self._loss(terms, objective, frozen)),
                in_dims=(0, 0, 0, 0, 0, 0, self.key_dim, *dims),
            )
        scale, scale_dim = None, None
        if sam is not None:
            scale = sam.scale
            scale_dim = 0 if scale is not None and scale.dim() == 2 else None
            scale = scale[rows] if scale_dim == 0 else scale
            perturbation = vmap(sam.perturbation, in_dims=(0, scale_dim))
        total = torch.zeros(C, device=dev)
        rows_mask = isinstance(mask, torch.Tensor) and mask.dim() == 2  # [C, P]: the chunk's

        def step(sel, n: int, x, y, ws, ks) -> None:
            """One step of the clients `sel` (a slice: views, updated in place; an index
            tensor: copies, written back) on the first n samples of their batches."""
            w, b = W[sel], {k: v[sel] for k, v in bufs.items()}
            st = {k: v[sel] for k, v in ost.items()}
            ts = [v[sel] if d == 0 else v for v, d in zip(tensors, dims)]
            x, y, ws, c = x[sel, :n], y[sel, :n], ws[sel, :n], rows[sel]
            key = None if ks is None else ks[sel]
            m = mask[sel] if rows_mask else mask  # a per-client mask: these clients' rows
            g, val = grad(w, b, x, y, ws, c, key, *ts)  # g: [k, P], or per trained range
            if sam is not None:
                e = perturbation(g, scale[sel] if scale_dim == 0 else scale)
                if m is not None:
                    e = e * (m.mask if isinstance(m, Ranges) else m)
                g, _ = grad(w + e, b, x, y, ws, c, key, *ts)
            total[sel] += val
            step_(optim, w, g, st, lr, mask=m, consume_grad=True)  # g: this step's own
            if isinstance(sel, torch.Tensor):
                W[sel] = w
                for k, v in b.items():
                    bufs[k][sel] = v
                for k, v in st.items():
                    ost[k][sel] = v

        for s, k in enumerate(training):
            ix = idx[s, :k].reshape(-1)
            x, y = self.schedule.batch(ix, None if aug is None else aug[s, :k].reshape(-1, 3))
            x, y = x.view(k, B, *x.shape[1:]), y.view(k, B)
            for sel, n in self._groups(lens[s][:k], B, exact):
                step(sel, n, x, y, wt[s], None if K is None else K[s])
        return total / torch.tensor(n_steps, device=dev).clamp(min=1)

    @staticmethod
    def _with_terms(fn, terms: Sequence[Term], workspace: Workspace):
        """`fn(W, ..., *the terms' tensors)` -> (gradient, loss) of the mapped loss without the
        terms, plus the terms in closed form over the [k, P] rows at once (`Term.value_and_grad`):
        the same bits as mapping autograd over `_loss(terms)`, whose values it adds in the same
        order, and whose gradients it sums as autograd does (`terms.values_and_grad`), in
        `workspace`'s buffers (kept by the caller for its train call's steps)."""
        sizes = [len(t.per_client) for t in terms]
        n = sum(sizes)

        def grad(w, *args):  # fn's own arguments, then the terms' tensors (the last n)
            g, val = fn(w, *args[: len(args) - n])
            rows, i = [], len(args) - n
            for k in sizes:
                rows.append(args[i : i + k])
                i += k
            values, gt = values_and_grad(w, terms, rows, workspace)
            for v in values:
                val = val + v
            return g.add_(gt), val

        return grad

    def _groups(
        self, lens: list[int], width: int, exact: bool | None = None
    ) -> list[tuple[slice | torch.Tensor, int]]:
        """The mapped calls of one step over clients whose batches hold `lens` real samples
        (0: none, skipped) padded to `width`: (clients, samples read). Unless `exact` (default:
        batch statistics) one call reads all (padding weighs 0); if so one call per batch
        length, each on its real samples only. A group that is a prefix of the clients is a
        slice (views)."""
        if not (self.batch_stats if exact is None else exact):
            return [(slice(0, len(lens)), width)]
        out = []
        for n in sorted(set(lens) - {0}, reverse=True):
            pos = [c for c, m in enumerate(lens) if m == n]
            prefix = pos[-1] == len(pos) - 1
            out.append((slice(0, len(pos)) if prefix else torch.tensor(pos, device=self.device), n))
        return out

    def _loss(
        self,
        terms: Sequence[Term],
        objective: Objective | None = None,
        frozen: frozenset[str] = frozenset(),
    ):
        """One client's loss at w [P] with buffers `bufs` (updated in place by a training
        forward): weighted cross-entropy of its batch (or the custom `objective` on the
        batch, which holds no padding then: `exact` groups) plus the terms. `c`: the client's
        position in the train call; `key` its batch's dropout key (None without keyed
        dropout). `frozen` parameters enter detached: no gradient, and no backward through
        them where nothing upstream trains."""
        model, spec = self.model, self.spec
        sizes = [len(t.per_client) for t in terms]
        wrapped = None if objective is None else _Objective(model, objective)

        def loss(w, bufs, x, y, wt, c, key, *tensors):
            params = spec.param_views(w)
            if frozen:
                params = {k: v.detach() if k in frozen else v for k, v in params.items()}
            val = self._batch_loss(wrapped, {**params, **bufs}, x, y, wt, c, key)
            i = 0
            for t, k in zip(terms, sizes):
                val = val + t.value(w, *tensors[i : i + k])
                i += k
            return val

        return loss

    def _loss_ranges(
        self,
        ranges: tuple[tuple[int, int], ...],
        where: list[int | None],
        objective: Objective | None = None,
    ):
        """`_loss` without terms, differentiated in the trained ranges' entries alone:
        `pieces[j]` is w[a_j:b_j] of range j, split into the parameters it holds whole
        (`where`: `ModelSpec.range_of`; a split's backward is one concatenation), every other
        parameter a detached view of w."""
        model, spec = self.model, self.spec
        wrapped = None if objective is None else _Objective(model, objective)
        held = [[e for e, j in zip(spec.params, where) if j == r] for r in range(len(ranges))]
        sizes = [[e.stop - e.start for e in es] for es in held]

        def loss(pieces, w, bufs, x, y, wt, c, key):
            params = spec.param_views(w.detach())
            for es, n, piece in zip(held, sizes, pieces):
                for e, v in zip(es, torch.split(piece, n)):
                    params[e.name] = v.view(e.shape)
            return self._batch_loss(wrapped, {**params, **bufs}, x, y, wt, c, key)

        return loss

    def _batch_loss(self, wrapped, views: dict, x, y, wt, c, key) -> torch.Tensor:
        """A training forward at `views` (named parameters and buffers) under the dropout
        `key`: the batch's weighted cross-entropy, or the custom objective `wrapped`."""
        with dropout_key(key):
            if wrapped is None:
                logits = functional_call(self.model, views, (x,))
                return (F.cross_entropy(logits, y, reduction="none") * wt).sum()
            views = {f"model.{k}": v for k, v in views.items()}
            return functional_call(wrapped, views, (x, y, c))

    # ------------------------------------------------------------------ client steps
    def client_steps(
        self, plan: StepPlan, states: dict[str, torch.Tensor], step: ClientStep
    ) -> StepsResult:
        """All clients' loops at once: at step s, `step` on the rows [k, ...] of the k clients
        that still have a batch (a chunk's clients ordered longest first: a prefix, views)."""
        clients, dev = plan.clients, self.device
        C = len(clients)
        out = {n: v.clone(memory_format=torch.contiguous_format) for n, v in states.items()}
        sched = [self.schedule.of(plan, c) for c in clients]
        S = max((len(lens) for _, lens in sched), default=0)
        B = max((idx.shape[1] for idx, _ in sched), default=1)
        # parameter rows per client: the gradient's, the step's temporaries and the states'
        n_state = sum(v[0].numel() for v in out.values())
        rows = GRAD_ROWS + STEP_ROWS + -(-n_state // self.spec.n_params)
        kc = self.memory.chunk_size(C, self.memory.client_bytes(rows, B))
        order = sorted(range(C), key=lambda c: -len(sched[c][1]))
        aux: torch.Tensor | None = None
        workspace = Workspace()  # closed-form terms: buffers for this call's steps
        self.model.train()
        for lo in range(0, C, kc):
            mine = order[lo : lo + kc]
            pos = torch.tensor(mine, device=dev)
            st = {n: v[pos] for n, v in out.items()}  # copies, in the chunk's order
            chunk = [sched[c] for c in mine]
            idx, wt, n_steps = stack_schedules(chunk, dev)
            draws = [self.schedule.draws_of(plan, clients[c], sched[c][0]) for c in mine]
            aug = stack_draws(draws, idx.shape, dev)
            keys = [self.schedule.keys_of(plan, clients[c], len(sched[c][1])) for c in mine]
            K = stack_keys(keys, idx.shape[0], dev)
            Sc, _, Bc = idx.shape
            training = [sum(n > s for n in n_steps) for s in range(Sc)]
            lens = step_lengths(chunk, Sc) if self.batch_stats else [[Bc] * len(mine)] * Sc
            for s, k in enumerate(training):
                ix = idx[s, :k].reshape(-1)
                x, y = self.schedule.batch(ix, None if aug is None else aug[s, :k].reshape(-1, 3))
                x, y = x.view(k, Bc, *x.shape[1:]), y.view(k, Bc)
                view = {n: v[:k] for n, v in st.items()}
                ks = None if K is None else K[s, :k]
                batch = MappedBatch(self, x, y, wt[s, :k], lens[s][:k], s, ks, workspace)
                new, a = step(view, batch)
                write_back(view, new)
                if a is not None:
                    if aux is None:
                        aux = a.new_zeros(S, C, *a.shape[1:])
                    aux[s, pos[:k]] = a
            for n, v in st.items():
                out[n][pos] = v
        return StepsResult(out, aux, [len(lens) for _, lens in sched])

    def _plain_grad(self):
        """The mapped (gradient, loss) of the plain cross-entropy, built once."""
        if self._plain is None:
            self._plain = self._terms_grad(())
        return self._plain

    def _terms_grad(self, terms: Sequence[Term]):
        """The mapped (gradient, loss) of the cross-entropy plus `terms` (no objective):
        fn(W, bufs, x, y, wt, keys, *the terms' tensors), per-client tensors mapped with the
        clients, shared ones broadcast."""
        value = self._loss(terms)  # no objective: its client position c is unused
        dims = [0 if pc else None for t in terms for pc in t.per_client]
        return vmap(
            grad_and_value(lambda w, b, x, y, wt, key, *ts: value(w, b, x, y, wt, None, key, *ts)),
            in_dims=(0, 0, 0, 0, 0, self.key_dim, *dims),
        )

    # ------------------------------------------------------------------ full gradients
    def full_grads(self, plan: GradPlan, states: torch.Tensor) -> GradResult:
        """Each client's mean loss (and gradient) over its training set at row c of `states`:
        all clients of a chunk in one batched pass per block of samples (with BatchNorm, per
        group of equal block lengths); the buffers after the pass come back."""
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
        n_host = [int(p.numel()) for p in pools]

        def loss(w, bufs, x, y, wc, key):
            with dropout_key(key):
                logits = functional_call(model, {**spec.param_views(w), **bufs}, (x,))
            return (F.cross_entropy(logits, y, reduction="none") * wc).sum()

        dims = (0, 0, 0, 0, 0, self.key_dim)
        fn = vmap(grad_and_value(loss), in_dims=dims) if plan.with_grad else vmap(loss, dims)
        n_blocks = -(-n_max // block)
        K = stack_keys([self.schedule.full_keys(c, n_blocks) for c in plan.clients], n_blocks, dev)
        k = self.memory.chunk_size(C, self.memory.grad_bytes(block))
        losses = torch.zeros(C, device=dev)
        grads = torch.zeros(C, P, device=dev) if plan.with_grad else None
        out = states.clone()
        model.train()
        for lo in range(0, C, k):
            W = states[lo : lo + k, :P]
            bufs = self._buffers(states[lo : lo + k])
            kc = W.shape[0]
            ls = losses[lo : lo + k]
            gs = None if grads is None else grads[lo : lo + k]
            for j, s in enumerate(range(0, n_max, block)):
                ib = idx[lo : lo + k, s : s + block]
                kb = None if K is None else K[j, lo : lo + k]
                b = ib.shape[1]
                x, y = self.fed.batch(ib.reshape(-1), train=False)
                x, y = x.view(kc, b, *x.shape[1:]), y.view(kc, b)
                wb = wt[lo : lo + k, s : s + block]
                lens = [min(max(n - s, 0), b) for n in n_host[lo : lo + k]]
                for sel, n in self._groups(lens, b):
                    bs = {name: v[sel] for name, v in bufs.items()}
                    ks = None if kb is None else kb[sel]
                    args = (W[sel], bs, x[sel, :n], y[sel, :n], wb[sel, :n], ks)
                    if plan.with_grad:
                        g, v = fn(*args)
                        gs[sel] += g
                    else:
                        with torch.no_grad():
                            v = fn(*args)
                    ls[sel] += v.detach()
                    if isinstance(sel, torch.Tensor):
                        for name, t in bs.items():
                            bufs[name][sel] = t
            self._keep_buffers(out, slice(lo, lo + k), bufs)
        return GradResult(losses, grads, out[:, P:])


class MappedBatch:
    """The step's batches of k clients (`StepBatch`): x [k, B, ...], y [k, B], sample
    weights wt [k, B] (1/len, 0 on padding), each batch's real length and dropout key [k]
    (None without keyed dropout)."""

    def __init__(
        self,
        backend: VmapBackend,
        x,
        y,
        wt,
        lens: list[int],
        index: int,
        keys=None,
        workspace: Workspace | None = None,
    ) -> None:
        self.backend, self.x, self.y, self.wt, self.lens = backend, x, y, wt, lens
        self.index, self.keys = index, keys
        self.workspace = workspace or Workspace()  # closed-form terms' buffers

    def grad(
        self,
        states: torch.Tensor,
        *,
        at: torch.Tensor | None = None,
        terms: Sequence[Term] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        be = self.backend
        P, k, B = be.spec.n_params, states.shape[0], self.x.shape[1]
        tensors = [v for t in terms for v in t.tensors()]
        dims = [0 if pc else None for t in terms for pc in t.per_client]
        if not terms:
            fn = be._plain_grad()
        elif closed_form(terms):
            fn = be._with_terms(be._plain_grad(), terms, self.workspace)
        else:
            fn = be._terms_grad(terms)
        W, bufs = states[:, :P], be._buffers(states)
        if at is not None:  # SAM's second gradient: at W + at (`states` keeps W)
            W = W + at
        groups = be._groups(self.lens, B)
        if len(groups) == 1 and isinstance(groups[0][0], slice):  # all k clients: no copies
            n = groups[0][1]
            x, y, wt = self.x[:, :n], self.y[:, :n], self.wt[:, :n]
            g, loss = fn(W, bufs, x, y, wt, self.keys, *tensors)
        else:
            g = states.new_zeros(k, P)
            loss = states.new_zeros(k)
            for sel, n in groups:
                b = {name: v[sel] for name, v in bufs.items()}
                x, y, wt = self.x[sel, :n], self.y[sel, :n], self.wt[sel, :n]
                ts = [v[sel] if d == 0 else v for v, d in zip(tensors, dims)]
                ks = None if self.keys is None else self.keys[sel]
                g[sel], loss[sel] = fn(W[sel], b, x, y, wt, ks, *ts)
                if isinstance(sel, torch.Tensor):
                    for name, v in b.items():
                        bufs[name][sel] = v
        if bufs:
            be._keep_buffers(states, slice(None), bufs)
        return loss.detach(), g.detach()


class _Objective(nn.Module):
    """A custom objective(model, x, y, c) as a module's forward, so that `functional_call`
    runs it (every call it makes on `model`: forward, `features`, `head`) at a client's
    mapped parameters and buffers."""

    def __init__(self, model: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.objective(self.model, x, y, c)


def stack_draws(
    draws: list[torch.Tensor | None], shape: tuple[int, int, int], device: torch.device
) -> torch.Tensor | None:
    """Per-client augmentation draws [S_c, B_c, 3] -> step-major [S, C, B, 3] (padding 0),
    as `stack_schedules` stacks their batches; None without augmentation."""
    if not draws or draws[0] is None:
        return None
    S, C, B = shape
    out = torch.zeros(S, C, B, 3, dtype=torch.long, device=device)
    for c, d in enumerate(draws):
        out[: d.shape[0], c, : d.shape[1]] = d
    return out


def stack_keys(
    keys: list[torch.Tensor | None], steps: int, device: torch.device
) -> torch.Tensor | None:
    """Per-client dropout keys [S_c] -> step-major [S, C] (padding 0), as `stack_schedules`
    stacks their batches; None without keyed dropout."""
    if not keys or keys[0] is None:
        return None
    out = torch.zeros(steps, len(keys), dtype=torch.long, device=device)
    for c, k in enumerate(keys):
        out[: k.shape[0], c] = k
    return out


def step_lengths(sched: list[tuple[torch.Tensor, list[int]]], steps: int) -> list[list[int]]:
    """[S][C]: the real samples of each client's s-th batch (0 past its last step), read from
    the schedules' host-side lengths (no device read: none on a GPU, and none of a tensor
    that has no data, on the meta device)."""
    return [[int(ln[s]) if s < len(ln) else 0 for _, ln in sched] for s in range(steps)]


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
