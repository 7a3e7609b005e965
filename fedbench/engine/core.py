"""The engine: E epochs (or K steps) of an optimizer over each sampled client's batches.

Every algorithm's client work goes through `Engine.train`: cross-entropy plus optional
loss terms (`terms.py`), an optional frozen-parameter mask, an optional SAM-style second
gradient at a perturbed point; or, for loops `train` cannot express (pFedMe's inner steps),
through `Engine.client_steps`: the algorithm's own step function over explicit per-client
state, run client by client (sequential) or all clients at once (vmap). `Engine` is the
front: it builds one `TrainPlan` from the call's keywords (`plan.py`), picks a backend
(`backend_for`) and hands the plan over. The backends implement the same calls,
`train(plan, states)`, `full_grads(plan, states)` and `client_steps(plan, states, step)`:

- `sequential.SequentialBackend`: one module reused for every client (`flat.FlatModule`);
- `vmap.VmapBackend`: all clients of a call in one batched computation per step, the GPU's
  fast path (BatchNorm statistics as per-client batched buffers).

The engine owns the pieces both get when they are built: the model and its `ModelSpec`,
the `Schedule` (batches and their augmentation depend only on (seed, round, client, salt),
so any backend reproduces the same numbers), the `OptimStates` store (optimizer state kept
across rounds, also of the rows a step function declares optimized, `optimized.py`,
checkpointed through `state_dict`) and the `MemoryModel` (vmap's chunk sizes). It also
evaluates (`correct`, `logits`) and serves hand-written loops (`batches`, `load`,
`grad_at_loaded`, `grad`) on the sequential backend's module. Nothing in
`fedbench/engine/` imports this module but the package's `__init__`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

from fedbench.engine.flat import FlatModule
from fedbench.engine.memory import MemoryModel
from fedbench.engine.optim import OptimConfig
from fedbench.engine.optimized import Optimized, OptimizedRows
from fedbench.engine.plan import (
    SAM,
    Backend,
    ClientStep,
    GradPlan,
    GradResult,
    Objective,
    StepPlan,
    StepsResult,
    TrainPlan,
    TrainResult,
)
from fedbench.engine.rows import ClientRows, RowsPolicy
from fedbench.engine.schedule import Schedule
from fedbench.engine.sequential import SequentialBackend
from fedbench.engine.spec import ModelSpec
from fedbench.engine.store import OptimStates
from fedbench.engine.terms import Term
from fedbench.engine.vmap import VmapBackend, blocker
from fedbench.models.dropout import has_keyed_dropout

BACKENDS = ("auto", "sequential", "vmap")

log = logging.getLogger("fedbench")

__all__ = [
    "BACKENDS",
    "SAM",
    "ClientStep",
    "Engine",
    "GradResult",
    "Objective",
    "Optimized",
    "StepsResult",
    "TrainResult",
]


class Engine:
    def __init__(
        self,
        fed,
        model: nn.Module,
        *,
        device: torch.device,
        seed: int = 0,
        backend: str = "auto",
        drop_last: bool = False,
        eval_batch_size: int = 2048,
        chunk_clients: int | None = None,
        memory_budget: float | None = None,
        rows: RowsPolicy | None = None,
    ) -> None:
        # a run's settings come checked (fedbench/config.py's `engine` and `eval` keys)
        self.fed = fed
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.spec = ModelSpec(self.model)
        self.backend = backend
        self.eval_batch_size = eval_batch_size
        self.module = FlatModule(self.model, self.spec, self.device)
        self.batch_schedule = Schedule(
            fed, self.device, seed=seed, drop_last=drop_last, dropout=has_keyed_dropout(model)
        )
        self.rows_policy = rows or RowsPolicy()  # where per-client rows live (`client_rows`)
        self.optim_states = OptimStates(fed.num_clients, self.device, self.rows_policy)
        # vmap: clients per batched chunk (None: by memory), GiB per chunk (None: half free)
        self.memory = MemoryModel(
            self.model,
            self.spec,
            fed,
            self.device,
            chunk_clients=chunk_clients,
            memory_budget=memory_budget,
        )
        self.backends: dict[str, Backend] = {
            "sequential": SequentialBackend(
                self.module, fed, self.batch_schedule, self.optim_states, self.device
            ),
            "vmap": VmapBackend(
                self.model,
                self.spec,
                fed,
                self.batch_schedule,
                self.optim_states,
                self.memory,
                self.device,
            ),
        }
        self._logged: set[str] = set()
        self._no_vmap = blocker(self.model, self.spec)
        self._has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
        self._init = self.module.state.clone()

    # ------------------------------------------------------------------ settings
    @property
    def seed(self) -> int:
        return self.batch_schedule.seed

    @property
    def drop_last(self) -> bool:
        return self.batch_schedule.drop_last

    @property
    def chunk_clients(self) -> int | None:
        return self.memory.chunk_clients

    @property
    def memory_budget(self) -> float | None:
        return self.memory.memory_budget

    # ------------------------------------------------------------------ state helpers
    @property
    def n_params(self) -> int:
        return self.spec.n_params

    @property
    def n_state(self) -> int:
        return self.spec.n_state

    def initial_state(self) -> torch.Tensor:
        """The flat state [D] of the model as constructed (seeded by the caller)."""
        return self._init.clone()

    def to_module(self, state: torch.Tensor, model: nn.Module) -> nn.Module:
        return self.spec.load_into(model, state)

    # ------------------------------------------------------------------ batches
    def schedule(
        self,
        client: int,
        batch_size: int,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        round: int = 0,
        salt: int = 0,
    ) -> tuple[torch.Tensor, list[int]]:
        """Sample indices [S, B] (rows padded with 0) and each row's true length
        (`Schedule.indices`)."""
        return self.batch_schedule.indices(
            client, batch_size, epochs=epochs, steps=steps, round=round, salt=salt
        )

    def batches(
        self,
        client: int,
        batch_size: int,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        round: int = 0,
        salt: int = 0,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The client's mini-batches (x, y) in `schedule` order, augmented as `train`'s
        (`Schedule.draws`): the ones `train` steps through, for hand-written loops."""
        idx, lens = self.schedule(
            client, batch_size, epochs=epochs, steps=steps, round=round, salt=salt
        )
        draws = self.batch_schedule.draws(client, idx.shape, round=round, salt=salt)
        return self.batch_schedule.read(idx, lens, draws)

    # ------------------------------------------------------------------ backends
    def backend_for(
        self,
        n_clients: int,
        objective: Objective | None = None,
        *,
        client_steps: bool = False,
        batched_on_cpu: bool = False,
    ) -> str:
        """The backend a train call over `n_clients` runs on; each choice is logged once.

        Both backends give the same numbers (to float tolerance) wherever vmap runs: BatchNorm
        statistics are per-client batched buffers, and augmentation and dropout
        (`KeyedDropout`) draw from streams keyed by (seed, round, client, salt, batch), not
        read in call order.

        1. `sequential` when asked, and where vmap cannot run the same computation (an
           explicit `vmap` falls back there too): torch's own `nn.Dropout` (its masks come
           from torch's global generator inside the forward, drawn in the order forwards
           run; fedbench's models use `KeyedDropout`, which runs on vmap); BatchNorm
           with momentum=None (its cumulative average reads a step counter as a Python
           number, one per module, not per client); an objective marked
           `sequential_objective` (FedCP's Gumbel noise from per-client generators). Any
           other custom `objective` runs on vmap: it is called (through `functional_call`)
           at each client's mapped state, with `c` the client's position as a 0-d tensor
           (`client_row`).
        2. `vmap` when asked.
        3. auto, one client: sequential (nothing to batch).
        4. auto, CUDA: vmap (a per-client loop there is bound by kernel launches).
        5. auto, CPU: vmap for models without convolutions (one batched matmul per layer
           instead of C small ones: 1.9x faster than the loop on the FMNIST MLP round of
           scripts/bench_engine.py), sequential with convolutions (vmap makes them grouped
           convolutions, 2x slower there than a loop on the FedAvg CNN round).

        `client_steps` (an algorithm's own step function: pFedMe, Per-FedAvg, APPLE, FedSLR's
        Phase II, pFedHN, Ditto's interleaved mode, PLGU) is chosen the same way (never a
        custom objective: its batches' `grad` is the cross-entropy), but auto on a CPU picks
        sequential: a step function's own vector updates run over [k, P] rows that outgrow
        the cache where one client's [P] row stays in it (pFedMe on the FMNIST MLP of
        scripts/bench_algorithms.py, quiet machine: 8.8x FedAvg's round sequential, 10.5x on
        vmap; FedSLR 3.4x / 4.6x; Ditto's interleaved steps, PLGU-LF and PLGU-GRep were no
        faster on vmap there, within the noise of a loaded machine), and the sequential path
        keeps their numbers bit-identical to the per-client loops they replaced. Unless
        `batched_on_cpu`: a step whose clients all read one shared matrix (APPLE's N cores:
        the mixtures and the p-gradients of k clients are one matrix product, where a client
        alone re-reads all N cores every step) is faster batched on a CPU too (APPLE 2.3x
        FedAvg's round on vmap, 3.8x sequential).
        """
        if self.backend == "sequential":
            return "sequential"
        why_not = getattr(objective, "no_vmap", None) or self._no_vmap
        if why_not is not None:
            choice, why = "sequential", f"vmap unavailable: {why_not}"
        elif self.backend == "vmap":
            choice, why = "vmap", "as configured"
        elif n_clients < 2:
            choice, why = "sequential", "one client: nothing to batch"
        elif self.device.type == "cuda":
            choice, why = "vmap", "CUDA: all clients in one batched computation per step"
        elif client_steps and batched_on_cpu:
            choice, why = "vmap", "CPU, a step function over one shared matrix: batched products"
        elif client_steps:
            choice, why = "sequential", "CPU, a step function: [k, P] row updates outgrow the cache"
        elif self._has_conv:
            choice, why = "sequential", "CPU, convolutions: grouped convolutions are slower"
        else:
            choice, why = "vmap", "CPU, no convolutions: batched matmuls beat a loop"
        msg = f"engine backend {choice} ({self.backend}; {why})"
        if msg not in self._logged:
            self._logged.add(msg)
            log.info(msg)
        return choice

    # ------------------------------------------------------------------ per-client rows
    def client_rows(self, name: str, default: torch.Tensor) -> ClientRows:
        """A store of one row per client, off the device (`engine.rows`), every row
        `default` until written; `name` is unique in the run (its checkpoint shards)."""
        return ClientRows(
            self.fed.num_clients, default, device=self.device, name=name, policy=self.rows_policy
        )

    # ------------------------------------------------------------------ kept optimizer state
    def state_dict(self) -> dict:
        """Per-client optimizer state kept across rounds (`optim.persist_state`)."""
        return self.optim_states.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optim_states.load_state_dict(state, self.device)

    @property
    def _persist(self) -> dict[str, dict[str, torch.Tensor]]:
        """The kept state by slot (`optim_states.slots`), for code that read it here."""
        return self.optim_states.slots

    # ------------------------------------------------------------------ hand-written steps
    def load(self, state: torch.Tensor) -> None:
        """Put a flat state ([D], or parameters only [P]) into the engine's module."""
        self.module.load(state)

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient buffer [P] the last `grad_at_loaded` left (the module's .grad
        views); the next call overwrites it: copy it to keep it (`grad_at` does)."""
        return self.module.grad

    def grad_at_loaded(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        terms: Sequence[Term] = (),
        rows=(),
        objective: Objective | None = None,
        c: int = 0,
    ) -> torch.Tensor:
        """Loss of the loaded model on (x, y) (+ terms); its gradient lands in `self.grad`
        (`FlatModule.grad_at_loaded`: a training step, the module in training mode)."""
        return self.module.grad_at_loaded(x, y, terms, rows, objective, c)

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
        """(loss, gradient [P]) of one flat `state` on (x, y), a training step; the state's
        buffers updated in place (`FlatModule.grad_at`: the step of hand-written per-client
        loops, `algorithms/_steps.py`, and of the sequential `client_steps`). `key`: the
        batch's dropout key (`dropout_keys`; None: torch's global generator)."""
        return self.module.grad_at(state, x, y, at=at, terms=terms, rows=rows, key=key)

    def dropout_keys(
        self, client: int, n: int, *, round: int = 0, salt: int = 0
    ) -> torch.Tensor | None:
        """n dropout keys [n] for a client's own training forwards outside `train` (FedALA's
        weight learning, FedSPA's pruning gradient): key s for its s-th forward, keyed by
        (seed, round, client, salt) as `train`'s batches are; None without keyed dropout."""
        return self.batch_schedule.keys(client, n, round=round, salt=salt)

    # ------------------------------------------------------------------ training
    def train(
        self,
        states: torch.Tensor,
        clients: Sequence[int],
        *,
        optim: OptimConfig,
        lr: float,
        batch_size: int,
        epochs: int | None = None,
        steps: int | None = None,
        terms: Sequence[Term] = (),
        trainable: torch.Tensor | None = None,
        sam: SAM | None = None,
        objective: Objective | None = None,
        round: int = 0,
        salt: int = 0,
        slot: str = "main",
    ) -> TrainResult:
        """Train each client's state (row c of `states`, client `clients[c]`); return new rows.

        `trainable` is a [P] mask: False entries get no update (frozen layers); or [C, P],
        row c client c's own (FedSpa's personal sparse masks). Buffers (BN
        running statistics) update during training as in any PyTorch forward. `salt`
        separates batch streams of several phases in one round (e.g. head, then body).
        `slot` names the kept optimizer state (`optim.persist_state`) the clients step with.
        """
        plan = TrainPlan.build(
            clients,
            optim=optim,
            lr=lr,
            batch_size=batch_size,
            epochs=epochs,
            steps=steps,
            terms=terms,
            trainable=trainable,
            sam=sam,
            objective=objective,
            round=round,
            salt=salt,
            slot=slot,
        )
        if states.dim() == 1:
            states = states.expand(len(plan.clients), -1)
        backend = self.backend_for(len(plan.clients), objective)
        # training needs autograd even when called from evaluation, which runs under no_grad
        # (FedBABU fine-tunes its personalized models there)
        with torch.enable_grad():
            return self.backends[backend].train(plan, states)

    # ------------------------------------------------------------------ client steps
    def client_steps(
        self,
        states: dict[str, torch.Tensor],
        clients: Sequence[int],
        step: ClientStep,
        *,
        batch_size: int,
        epochs: int | None = None,
        steps: int | None = None,
        round: int = 0,
        salt: int = 0,
        batched_on_cpu: bool = False,
        optimized: Mapping[str, Optimized] | None = None,
    ) -> StepsResult:
        """Run `step(state, batch) -> (state, aux)` over each client's batches (`batches`'
        schedule for the same arguments: the same batches and crops), from row c of every
        tensor of `states` ({name: [C, ...]}) for client `clients[c]`; returns the rows after
        the clients' last steps and each step's aux (`plan.ClientStep`, `StepsResult`).

        `batch.grad(rows [k, D], at=, terms=)` is the batched primitive: each client's loss
        [k] and gradient [k, P] of the cross-entropy (+ `terms`) on its own batch, at its
        parameters (+ `at` [k, P], SAM's second gradient), its buffers updated in place.
        Sequential: client after client with k = 1 (`FlatModule.grad_at`, a hand-written
        loop's numbers); vmap: at step s, every client that has an s-th batch at once.
        `batched_on_cpu`: vmap is the CPU's choice too (`backend_for`).

        `optimized` ({row name: `Optimized(optim, lr, slot)`}): rows the step moves with an
        optimizer, `batch.step(name, g)`; the engine loads their optimizer state (from the
        store under `slot`, or fresh), carries it through the steps on either backend and
        keeps it afterwards (`optimized.py`).
        """
        plan = StepPlan(
            tuple(int(c) for c in clients),
            batch_size,
            epochs=epochs,
            steps=steps,
            round=round,
            salt=salt,
        )
        backend = self.backend_for(
            len(plan.clients), client_steps=True, batched_on_cpu=batched_on_cpu
        )
        rows = OptimizedRows(
            optimized or {}, self.optim_states, plan.clients, self.n_params, self.device
        )
        with torch.enable_grad():
            res = self.backends[backend].client_steps(plan, rows.load(states), rows.step(step))
        return rows.keep(res)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def logits(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.load(state)
        self.model.eval()
        return self.model(x)

    def functional_logits(
        self, w: torch.Tensor, x: torch.Tensor, buffers: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits as a differentiable function of a parameter vector w [P] (for VJPs, vmap)."""
        return functional_call(self.model, self.spec.views(w, buffers), (x,))

    @torch.no_grad()
    def correct(self, state: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Per-sample correctness (bool, on the device) of `state` on pool indices `idx`."""
        out = []
        self.load(state)
        self.model.eval()
        for s in range(0, int(idx.numel()), self.eval_batch_size):
            x, y = self.fed.batch(idx[s : s + self.eval_batch_size], train=False)
            out.append(self.model(x).argmax(-1) == y)
        if not out:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        return torch.cat(out)

    # ------------------------------------------------------------------ full gradients
    def full_grads(
        self,
        states: torch.Tensor,
        clients: Sequence[int],
        *,
        with_grad: bool = True,
        block: int | None = None,
    ) -> GradResult:
        """Each client's mean loss F_c(w_c) over its whole training set and its gradient [P]
        at its row of `states` ([C, D], or one [D] shared by all), all clients from one call
        (FedPG's reports; `with_grad=False`: losses only, S-FedPG's line search). Samples
        are read without augmentation, `block` per client per pass (default: the evaluation
        batch size). The backend is `backend_for`'s (vmap where it can)."""
        plan = GradPlan(
            tuple(int(c) for c in clients), with_grad, int(block or self.eval_batch_size)
        )
        C = len(plan.clients)
        states = states.expand(C, -1) if states.dim() == 1 else states
        if C == 0:
            P = self.n_params
            empty = torch.zeros(0, device=self.device)
            return GradResult(empty, torch.zeros(0, P) if with_grad else None, states[:, P:])
        with torch.enable_grad():
            return self.backends[self.backend_for(C)].full_grads(plan, states)
