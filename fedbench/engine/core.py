"""The engine: E epochs (or K steps) of an optimizer over each sampled client's batches.

Every algorithm's client work goes through `Engine.train`: cross-entropy plus optional
loss terms (`terms.py`), an optional frozen-parameter mask, an optional SAM-style second
gradient at a perturbed point. Batches come from a schedule that depends only on
(seed, round, client, salt), so any backend reproduces the same numbers.

Sequential backend: one module reused for every client. Its parameters, their `.grad` and
its buffers are views of flat vectors owned by the engine, so loading a client is one copy,
a step is a plain forward/backward (autograd accumulates straight into the flat gradient)
plus one fused optimizer update, and no per-client module or optimizer object exists. Data
are tensors on the training device, batches are gathered by index, and nothing in the step
loop synchronises with the host (losses accumulate on the device).

Vmap backend (`vmap.py`): all clients of a call in one batched computation per step, the
GPU's fast path. `Engine.backend_for` picks it or the sequential one per call; see there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedbench.engine.optim import OptimConfig, init_state, step_
from fedbench.engine.spec import ModelSpec
from fedbench.engine.terms import Term
from fedbench.engine.vmap import VmapBackend
from fedbench.errors import ConfigError

BACKENDS = ("auto", "sequential", "vmap")

log = logging.getLogger("fedbench")

# A replacement for the cross-entropy: objective(model, x, y, c) -> scalar loss.
Objective = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class SAM:
    """Sharpness-aware step: eps = rho * scale * g / ||g||; update with grad at w + eps.

    `scale` is None for SAM/FedSAM (Foret et al. 2021, p = 2), or per-parameter multipliers
    ([P], or [C, P] per client in the train call's order) for LWSAM's layer scores.
    """

    rho: float
    scale: torch.Tensor | None = None

    def perturbation(self, g: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        e = g * (self.rho / (g.norm() + 1e-12))
        return e if scale is None else e * scale


@dataclass
class TrainResult:
    states: torch.Tensor  # [C, D] the clients' states after training
    loss: torch.Tensor  # [C] mean training loss over each client's steps
    steps: list[int]  # number of optimizer steps each client took


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


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
    ) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"engine.backend={backend!r}; valid: {', '.join(BACKENDS)}")
        if chunk_clients is not None and chunk_clients < 1:
            raise ConfigError(f"engine.chunk_clients={chunk_clients} must be >= 1 (or null)")
        if memory_budget is not None and memory_budget <= 0:
            raise ConfigError(f"engine.memory_budget={memory_budget} GiB must be > 0 (or null)")
        self.fed = fed
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.spec = ModelSpec(self.model)
        self.seed = seed
        self.backend = backend
        self.chunk_clients = chunk_clients  # vmap: clients per batched chunk (None: by memory)
        self.memory_budget = memory_budget  # vmap: GiB per chunk (None: half the free memory)
        self._vmap = VmapBackend(self)
        self._logged: set[str] = set()
        self._no_vmap = self._vmap_blocker()
        self._has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
        self.drop_last = drop_last
        self.eval_batch_size = eval_batch_size
        self._persist: dict[str, dict[str, torch.Tensor]] = {}
        self._bind()
        self._init = self._flat.clone()

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
        """Sample indices [S, B] (rows padded with 0) and each row's true length.

        One permutation of the client's data per epoch; `steps` keeps drawing epochs until
        that many batches exist and stops there (pFedHN's inner steps, PLGU-GRep's 1 step).
        """
        pool = self.fed.train_idx[client]
        n = int(pool.numel())
        b = min(batch_size, n)
        per_epoch = n // b if self.drop_last else -(-n // b)
        need = steps if steps is not None else per_epoch * int(epochs or 0)
        if need <= 0 or n == 0:
            return torch.zeros(0, b, dtype=torch.long, device=self.device), []
        g = torch.Generator().manual_seed(_seed(self.seed, round, client, salt))
        n_epochs = -(-need // per_epoch)
        rows, lens = [], []
        for _ in range(n_epochs):
            perm = torch.randperm(n, generator=g)
            for s in range(per_epoch):
                chunk = perm[s * b : (s + 1) * b]
                lens.append(int(chunk.numel()))
                rows.append(F.pad(chunk, (0, b - chunk.numel())))
        pos = torch.stack(rows[:need]).to(self.device)
        return pool[pos], lens[:need]

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
        """The client's mini-batches (x, y) in `schedule` order: the ones `train` steps
        through, for hand-written loops that need the same batches."""
        idx, lens = self.schedule(
            client, batch_size, epochs=epochs, steps=steps, round=round, salt=salt
        )
        for s, ln in enumerate(lens):
            yield self.fed.batch(idx[s, :ln])

    # ------------------------------------------------------------------ backends
    def _vmap_blocker(self) -> str | None:
        """Why this model cannot go through the vmap backend and match sequential, if so."""
        if self.spec.has_buffers:
            return "the model has float buffers (BatchNorm running statistics update in place)"
        if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in self.model.modules()):
            return "the model has dropout (vmap cannot draw the sequential random numbers)"
        return None

    def backend_for(self, n_clients: int, objective: Objective | None = None) -> str:
        """The backend a train call over `n_clients` runs on; each choice is logged once.

        1. `sequential` when asked, and wherever vmap cannot reproduce the sequential
           numbers: a custom `objective` (any callable on the module), float buffers
           (BatchNorm running statistics), dropout. An explicit `vmap` falls back there too.
        2. `vmap` when asked.
           With data augmentation it draws the same batches but other random crops and
           flips: the federation's one augmentation stream is read in another order.
        3. auto, one client: sequential (nothing to batch).
        4. auto, data augmentation: sequential (auto never changes a run's numbers).
        5. auto, CUDA: vmap (a per-client loop there is bound by kernel launches).
        6. auto, CPU: vmap for models without convolutions (one batched matmul per layer
           instead of C small ones: 1.9x faster than the loop on the FMNIST MLP round of
           scripts/bench_engine.py), sequential with convolutions (vmap makes them grouped
           convolutions, 2x slower there than a loop on the FedAvg CNN round).
        """
        if self.backend == "sequential":
            return "sequential"
        why_not = "a custom objective" if objective is not None else self._no_vmap
        augment = bool(getattr(self.fed, "augment", False))
        if why_not is not None:
            choice, why = "sequential", f"vmap unavailable: {why_not}"
        elif self.backend == "vmap":
            choice, why = "vmap", "as configured"
            if augment:
                why += "; data.augment: other random crops and flips than sequential"
        elif n_clients < 2:
            choice, why = "sequential", "one client: nothing to batch"
        elif augment:
            choice, why = "sequential", "data.augment: vmap would draw other crops and flips"
        elif self.device.type == "cuda":
            choice, why = "vmap", "CUDA: all clients in one batched computation per step"
        elif self._has_conv:
            choice, why = "sequential", "CPU, convolutions: grouped convolutions are slower"
        else:
            choice, why = "vmap", "CPU, no convolutions: batched matmuls beat a loop"
        msg = f"engine backend {choice} ({self.backend}; {why})"
        if msg not in self._logged:
            self._logged.add(msg)
            log.info(msg)
        return choice

    # ------------------------------------------------------------------ training
    def _opt_state(
        self, opt: OptimConfig, slot: str, client: int | torch.Tensor, w: torch.Tensor
    ) -> dict:
        if not opt.persist_state:
            return init_state(opt, w)
        store = self._persist.setdefault(slot, {})
        fresh = init_state(opt, w)
        for k, v in fresh.items():
            if k not in store:  # one row per client; `client` is an int or an index tensor
                store[k] = torch.zeros((self.fed.num_clients,) + v.shape[-1:], device=v.device)
        return {k: store[k][client].clone() for k in fresh}

    def state_dict(self) -> dict:
        """Per-client optimizer state kept across rounds (`optim.persist_state`)."""
        return {"persist": self._persist}

    def load_state_dict(self, state: dict) -> None:
        self._persist = {
            slot: {k: v.to(self.device) for k, v in d.items()}
            for slot, d in state["persist"].items()
        }

    def _save_opt_state(
        self, opt: OptimConfig, slot: str, client: int | torch.Tensor, st: dict
    ) -> None:
        if opt.persist_state:
            for k, v in st.items():
                self._persist[slot][k][client] = v

    def _bind(self) -> None:
        """Make the module's parameters, grads and buffers views of `self._flat`/`self._g`."""
        spec, model = self.spec, self.model
        self._flat = spec.flatten(model).to(self.device)
        self._g = torch.zeros(spec.n_params, device=self.device)
        for e in spec.params:
            p = model.get_parameter(e.name)
            p.data = self._flat[e.start : e.stop].view(e.shape)
            p.grad = self._g[e.start : e.stop].view(e.shape)
        for e in spec.buffers:
            mod_name, _, leaf = e.name.rpartition(".")
            mod = model.get_submodule(mod_name) if mod_name else model
            mod._buffers[leaf] = self._flat[e.start : e.stop].view(e.shape)

    def load(self, state: torch.Tensor) -> None:
        """Put a flat state ([D], or parameters only [P]) into the engine's module."""
        self._flat[: state.shape[-1]].copy_(state)

    def _terms_grad(self, w: torch.Tensor, terms: Sequence[Term], rows) -> torch.Tensor:
        """Value of the extra terms at w; their gradient is added into the flat grad."""
        wl = w.detach().requires_grad_(True)
        val = sum(t.value(wl, *r) for t, r in zip(terms, rows))
        (g,) = torch.autograd.grad(val, wl)
        self._g.add_(g)
        return val.detach()

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient buffer [P] the last `grad_at_loaded` left (the module's .grad
        views); the next call overwrites it: copy it to keep it (`_steps.grad_at` does)."""
        return self._g

    def grad_at_loaded(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        terms: Sequence[Term] = (),
        rows=(),
        objective: Objective | None = None,
        c: int = 0,
    ) -> torch.Tensor:
        """Loss of the loaded model on (x, y) (+ terms); its gradient lands in `self.grad`.

        A training step: the module is put in training mode (BatchNorm normalizes with the
        batch and updates its running statistics, dropout drops), whatever `correct` or
        `logits` left. `objective(model, x, y, c)` replaces the cross-entropy (FedProto's
        prototype loss, FedRoD's two heads ...); `c` is the client's position in the train call.
        """
        self.model.train()
        self._g.zero_()
        if objective is None:
            loss = F.cross_entropy(self.model(x), y)
        else:
            loss = objective(self.model, x, y, c)
        loss.backward()
        loss = loss.detach()
        if terms:
            loss = loss + self._terms_grad(self._flat[: self.n_params], terms, rows)
        return loss

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

        `trainable` is a [P] mask: False entries get no update (frozen layers). Buffers (BN
        running statistics) update during training as in any PyTorch forward. `salt`
        separates batch streams of several phases in one round (e.g. head, then body).
        """
        clients = [int(c) for c in clients]
        if states.dim() == 1:
            states = states.expand(len(clients), -1)
        if self.backend_for(len(clients), objective) == "vmap":
            return TrainResult(
                *self._vmap.train(
                    states,
                    clients,
                    optim=optim,
                    lr=lr,
                    batch_size=batch_size,
                    epochs=epochs,
                    steps=steps,
                    terms=terms,
                    trainable=trainable,
                    sam=sam,
                    round=round,
                    salt=salt,
                    slot=slot,
                )
            )
        P = self.n_params
        out = torch.empty(len(clients), self.n_state, device=self.device)
        losses = torch.zeros(len(clients), device=self.device)
        n_steps: list[int] = []
        mask = None if trainable is None else trainable.to(out.dtype)
        w, g = self._flat[:P], self._g
        self.model.train()
        for c, client in enumerate(clients):
            self.load(states[c])
            ost = self._opt_state(optim, slot, client, w)
            rows = [t.rows(c) for t in terms]
            scale = None
            if sam is not None and sam.scale is not None:
                scale = sam.scale[c] if sam.scale.dim() == 2 else sam.scale
            total = torch.zeros((), device=self.device)
            n = 0
            for x, y in self.batches(
                client, batch_size, epochs=epochs, steps=steps, round=round, salt=salt
            ):
                n += 1
                total += self.grad_at_loaded(x, y, terms, rows, objective, c)
                if sam is not None:
                    e = sam.perturbation(g, scale)
                    if mask is not None:
                        e = e * mask
                    with torch.no_grad():
                        w.add_(e)
                    self.grad_at_loaded(x, y, terms, rows, objective, c)
                    with torch.no_grad():
                        w.sub_(e)
                with torch.no_grad():
                    step_(optim, w, g, ost, lr, mask=mask)
            self._save_opt_state(optim, slot, client, ost)
            out[c] = self._flat
            n_steps.append(n)
            losses[c] = total / max(n, 1)
        return TrainResult(out, losses, n_steps)

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
    def full_grads(self, states: torch.Tensor, clients: Sequence[int], *, with_grad: bool = True):
        """Each client's mean loss and gradient over its whole training set at its row of
        `states` (FedPG's reports), all clients from one call (`grads.py`; vmap where it can)."""
        from fedbench.engine.grads import full_grads

        return full_grads(self, states, clients, with_grad=with_grad)
