"""pFedHN (Shamsian et al., ICML 2021, "Personalized Federated Learning using
Hypernetworks", Algorithm 1; authors' code AvivSham/pFedHN; docs/papers/plgu.md).

A hypernetwork h(v_i; phi) (`fedbench.models.hypernet`) generates client i's target weights.
A visit of client i: theta_i = h(v_i; phi); `inner_steps` SGD steps (lr 5e-3, momentum 0.9,
weight decay 5e-5, gradient-norm clip 50) on fresh batches: theta_i -> theta~_i;
Delta_i = theta_i - theta~_i; the hypernetwork's gradient is the vector-Jacobian product
g = (d theta_i / d(phi, v_i))^T Delta_i (`autograd.grad` with grad_outputs = Delta), clipped
to norm 50; phi, v_i <- SGD step (lr 1e-2, momentum 0.9, weight decay 1e-3; the embeddings
are hypernetwork parameters, decayed and carried by momentum like the rest, as
`torch.optim.SGD(hnet.parameters())` does). `hypernet.server_update`: `sequential` applies
the round's clients one after another (Algorithm 1 and the authors' code draw one client per
step, and the next client's theta is generated from the moved phi), `mean` averages their g
into one step.

The inner steps are a step function on `Engine.client_steps` (`inner_step`: gradient,
clip per client, SGD step on rows [k, D]). `sequential` visits one client per call (its start
depends on the previous client's update: nothing to batch across clients; the hypernetwork's
forward, VJP and step over all H entries, once per client, are most of its round on a CPU);
`mean` generates every client's theta from the one phi of the round in one batched forward,
runs all their inner steps at once (vmap, as `Engine.backend_for` picks), and takes the mean
g as one VJP of that forward (sum_i J_i^T Delta_i: the same g as the per-client VJPs' mean,
up to float rounding; no [C, H] stack).

`hypernet.generate` (docs/papers/plgu.md): `all` target tensors (default); `body` (pFedHN-PC: each
client's head is personal, trained in the inner steps, never averaged; the authors' inner lr
there is 5e-2, the default when `inner_lr` is null); `last_k`. Tensors neither generated
nor personal (and float buffers) are shared: trained in the inner steps from the global
copy and averaged over the round's clients by sample count, as in FedAvg. A hypernetwork
over `hypernet.max_params` is refused with one line naming the options (one Linear(hidden,
numel) per tensor makes `all` ~1.1B parameters for ResNet-18).
Personalized model of client i = h(v_i; phi) (+ its head, + the shared tensors); no
fine-tuning. `inner_epochs` (not in pFedHN) replaces the step count by epochs over the
client's data, for presets that fix E local epochs for every method.
Not a reconstruction, except that spectral norm (an authors' option, off) is not offered.
Uploads: client i's trained state theta~_i (kind "model", ref = the state it trained from,
h(v_i; phi) with the shared entries); the server takes Delta_i and the shared entries from
what it receives. The personal head (pFedHN-PC) stays home.
Buffers: shared, i.e. averaged over the round's clients by sample count (weights >= 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedbench.algorithms._about import About
from fedbench.algorithms._steps import clip_
from fedbench.algorithms.base import ALGORITHMS, Algorithm, RoundReport
from fedbench.algorithms.params import hp, nonneg, positive
from fedbench.engine import ClientStep, ModelSpec, OptimConfig, Optimized, StepBatch
from fedbench.engine.optim import step_
from fedbench.errors import ConfigError
from fedbench.models.hypernet import GENERATE, HyperNetwork, hypernet_size, select_targets


def momentum() -> object:
    return hp(ge=0, lt=1)


@dataclass
class HypernetParams:
    generate: Literal["all", "body", "last_k"]  # which target tensors h generates
    k: int = hp(ge=1)  # last_k: how many of the target's last layers
    embed_dim: int | None = hp(ge=1)  # client embedding size; null: 1 + N // 4
    hidden: int = hp(ge=1)  # width of the trunk
    n_hidden: int = hp(ge=0)  # Linear(hidden, hidden) layers after the first
    spectral_norm: bool  # true is refused (not implemented)
    max_params: float = positive()  # refuse a larger hypernetwork
    server_update: Literal["sequential", "mean"]
    lr: float = positive()
    embed_lr: float | None = positive()  # null: lr
    momentum: float = momentum()
    weight_decay: float = nonneg()
    clip: float | None = nonneg()  # gradient-norm clip of the update (0 / null: none)


@dataclass
class PFedHNParams:
    inner_steps: int = hp(ge=1)  # local steps per visit
    inner_epochs: int | None = hp(ge=1)  # instead of inner_steps (null: inner_steps)
    inner_lr: float | None = positive()  # null: 5e-3 (all | last_k), 5e-2 (body)
    inner_momentum: float = momentum()
    inner_wd: float = nonneg()
    inner_clip: float | None = nonneg()  # gradient-norm clip of each inner step (0 / null: none)
    hypernet: HypernetParams


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@ALGORITHMS.register()
class PFedHN(Algorithm):
    about = About(
        name="pFedHN",
        paper="Shamsian et al., ICML 2021",
        summary=(
            "a hypernetwork generates each client's model from its embedding "
            "(`algo.hypernet.generate=all|body|last_k`)"
        ),
        docs="papers/plgu.md#pfedhn-pfedhn",
        fl_bench="pFedHN",
    )
    Params = PFedHNParams
    attackable = True
    state_keys = ("phi", "phi_buf", "heads", "shared")

    def setup(self) -> None:
        hn = self.hp.hypernet
        if hn.spectral_norm:
            raise ConfigError("hypernet.spectral_norm=true is not implemented; use false")
        spec, model, dev = self.engine.spec, self.engine.model, self.device
        P, D = spec.n_params, spec.n_state
        self.targets = select_targets(model, hn.generate, hn.k)
        self.gen_mask = spec.mask(self.targets.generated, device=dev)  # [P]
        own = torch.zeros(D, dtype=torch.bool, device=dev)
        own[:P] = spec.mask(self.targets.personal, device=dev)
        self.personal_entries = own  # [D]: the client's own head (pFedHN-PC)
        self.shared_entries = torch.ones(D, dtype=torch.bool, device=dev)
        self.shared_entries[:P] = ~(self.gen_mask | own[:P])  # [D]: FedAvg'd (and buffers)

        embed_dim = hn.embed_dim or 1 + self.N // 4
        hidden, n_hidden = hn.hidden, hn.n_hidden
        shapes = [spec.index[n].shape for n in self.targets.generated]
        size = hypernet_size(self.N, embed_dim, hidden, n_hidden, [s.numel() for s in shapes])
        if size > hn.max_params:
            raise ConfigError(self._too_big(size, hn, embed_dim))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.run.seed)
            self.hnet = HyperNetwork(self.N, shapes, embed_dim, hidden, n_hidden).to(dev)
        self.hspec = ModelSpec(self.hnet)
        self.phi = self.hspec.flatten(self.hnet).to(dev)  # [H]: embeddings v_i, trunk, heads
        self.embed_entries = self.hspec.mask(["embeddings.weight"], device=dev)
        self.hn_optim = OptimConfig(
            name="sgd",
            lr=hn.lr,
            momentum=hn.momentum,
            weight_decay=hn.weight_decay,
        )
        embed_lr = hn.embed_lr if hn.embed_lr is not None else hn.lr
        self.hn_lr = torch.where(self.embed_entries, embed_lr, hn.lr).to(dev)
        self.phi_buf = torch.zeros_like(self.phi)  # the hypernetwork optimizer's momentum

        init = self.engine.initial_state()
        self.shared = init.clone()  # [D]: the shared entries' global values
        self.heads = init[self.personal_entries].repeat(self.N, 1)  # [N, H_p]
        lr = self.hp.inner_lr
        if lr is None:
            lr = 5e-2 if hn.generate == "body" else 5e-3
        self.inner_optim = OptimConfig(
            name="sgd",
            lr=lr,
            momentum=self.hp.inner_momentum,
            weight_decay=self.hp.inner_wd,
        )

    def _too_big(self, size: int, hn, embed_dim: int) -> str:
        model, spec = self.engine.model, self.engine.spec
        options = []
        for gen, k in (("body", 1), ("last_k", 1), ("last_k", 2)):
            names = select_targets(model, gen, k).generated
            numels = [spec.index[p].shape.numel() for p in names]
            n = hypernet_size(self.N, embed_dim, hn.hidden, hn.n_hidden, numels)
            options.append(
                f"generate={gen}" + (f" k={k}" if gen == "last_k" else "") + f": {_millions(n)}"
            )
        return (
            f"hypernetwork for {type(model).__name__} with hypernet.generate={hn.generate} has "
            f"{_millions(size)} parameters, over hypernet.max_params={_millions(hn.max_params)}; "
            f"set algo.hypernet.generate to one of {', '.join(GENERATE)} ({'; '.join(options)}) "
            "or raise algo.hypernet.max_params"
        )

    # ------------------------------------------------------------------ the hypernetwork
    def generate(self, i: int, phi: torch.Tensor | None = None) -> torch.Tensor:
        """theta_i = h(v_i; phi) [G], differentiable in `phi` (default: the current phi)."""
        phi = self.phi if phi is None else phi
        client = torch.tensor([i], device=self.device)
        return torch.func.functional_call(self.hnet, self.hspec.param_views(phi), (client,))

    def generate_many(self, clients: list[int], phi: torch.Tensor | None = None) -> torch.Tensor:
        """[C, G]: h(v_i; phi) of each of `clients`, one batched forward (`generate` mapped
        over the clients: each head one [C, hidden] x [hidden, numel] product)."""
        params = self.hspec.param_views(self.phi if phi is None else phi)

        def one(c: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.hnet, params, (c[None],))

        return torch.func.vmap(one)(torch.tensor(clients, device=self.device))

    def vjp(self, i: int, delta: torch.Tensor, phi: torch.Tensor | None = None) -> torch.Tensor:
        """g = (d h(v_i; phi) / d phi)^T delta over all hypernetwork entries [H]."""
        phi = (self.phi if phi is None else phi).detach().requires_grad_(True)
        (g,) = torch.autograd.grad(self.generate(i, phi), phi, grad_outputs=delta)
        return g

    def hypernet_grad(self, i: int, delta: torch.Tensor) -> torch.Tensor:
        """The hypernetwork's update direction from client i's Delta (pFedHN: the VJP)."""
        return self.vjp(i, delta)

    def mean_hypernet_grad(self, clients: list[int], delta: torch.Tensor) -> torch.Tensor:
        """The mean of `hypernet_grad` over the round's clients (their Delta rows [C, G]), for
        `server_update: mean`. pFedHN's VJP is linear in Delta and the clients' g are taken
        at one phi: sum_i J_i^T Delta_i is one VJP of the batched forward (no [C, H] stack)."""
        phi = self.phi.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(self.generate_many(clients, phi), phi, grad_outputs=delta)
        return g.div_(len(clients))

    def hypernet_step(self, g: torch.Tensor) -> None:
        """phi's optimizer step with g [H], clipped; g is consumed (the step's temporaries
        go into it: no fresh [H] vectors, `optim.step_`)."""
        clip_(g, self.hp.hypernet.clip)
        st = {"buf": self.phi_buf} if self.hn_optim.momentum else {}
        step_(self.hn_optim, self.phi, g, st, self.hn_lr, consume_grad=True)  # g: ours

    # ------------------------------------------------------------------ clients
    def state_of(self, i: int, theta: torch.Tensor) -> torch.Tensor:
        """Client i's target state [D]: generated theta, its own head, the shared rest."""
        return self.states_of([i], theta[None])[0]

    def states_of(self, clients: list[int], theta: torch.Tensor) -> torch.Tensor:
        """`state_of` for rows: [C, D] from the clients' generated theta [C, G]."""
        P = self.engine.n_params
        s = self.shared.repeat(len(clients), 1)
        s[:, :P][:, self.gen_mask] = theta
        s[:, self.personal_entries] = self.heads[torch.tensor(clients, device=self.device)]
        return s

    def inner_step(self) -> ClientStep:
        """One inner step of the visited clients (`Engine.client_steps`): the gradient at
        their states `s` [k, D], clipped per client, then the inner SGD step (`s` is an
        optimized row: the engine carries its momentum). Aux: the step's losses [k]."""
        max_norm = self.hp.inner_clip

        def step(st: dict[str, torch.Tensor], batch: StepBatch):
            loss, g = batch.grad(st["s"])  # updates the rows' running statistics
            clip_(g, max_norm)
            batch.step("s", g)
            return st, loss

        return step

    def visit(self, clients: list[int], t: int, s0: torch.Tensor):
        """Inner training of `clients` from their states s0 [C, D] (h(v_i; phi) with the
        shared entries and heads), all at once where the engine can: (the final states as
        the server receives them [C, D], Delta_i [C, G], each client's mean loss [C])."""
        P, opt, epochs = self.engine.n_params, self.inner_optim, self.hp.inner_epochs
        res = self.engine.client_steps(
            {"s": s0},
            clients,
            self.inner_step(),
            batch_size=self.run.batch_size,
            epochs=epochs,
            steps=None if epochs else self.hp.inner_steps,
            round=t,
            optimized={"s": Optimized(opt, opt.lr)},  # no slot: fresh every visit, as the authors'
        )
        s = res.states["s"]
        self.heads[torch.tensor(clients, device=self.device)] = s[:, self.personal_entries]
        s = self.receive(s, clients, ref=s0)  # what the server gets of theta~_i (the head stays)
        delta = (s0[:, :P] - s[:, :P])[:, self.gen_mask]
        return s, delta, res.client_mean()

    # ------------------------------------------------------------------ the contract
    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        ids = [int(i) for i in clients]
        if self.hp.hypernet.server_update == "sequential":
            # Algorithm 1: phi moves after each client, and the next client's model is
            # generated from the moved phi, so the clients' visits are one after another
            states, losses = [], []
            for i in ids:
                with torch.no_grad():
                    s0 = self.state_of(i, self.generate(i))
                s, delta, loss = self.visit([i], t, s0[None])
                self.hypernet_step(self.hypernet_grad(i, delta[0]))
                states.append(s[0])
                losses.append(loss[0])
            states_t, loss_t = torch.stack(states), torch.stack(losses)
        else:
            # one phi for the round: every client's visit at once, one mean step
            with torch.no_grad():
                s0 = self.states_of(ids, self.generate_many(ids))
            states_t, delta, loss_t = self.visit(ids, t, s0)
            self.hypernet_step(self.mean_hypernet_grad(ids, delta))
        avg = self.weights(clients, "samples") @ states_t
        self.shared = torch.where(self.shared_entries, avg, self.shared)
        n_gen, n_shared = int(self.gen_mask.sum()), int(self.shared_entries.sum())
        c = len(clients)
        n = c * (n_gen + n_shared)
        return RoundReport(loss_t.mean(), self.comm(clients, up=n, down=n))

    @torch.no_grad()
    def personal_state(self, i: int) -> torch.Tensor:
        return self.state_of(i, self.generate(i))

    def personal_states(self) -> torch.Tensor:
        return torch.stack([self.personal_state(i) for i in range(self.N)])

    def personal_correct(self, i: int, idx: torch.Tensor) -> torch.Tensor:
        return self.engine.correct(self.personal_state(i), idx)
