"""The algorithm contract (docs/design.md): a small class per algorithm, state as tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from fedbench.algorithms._about import About
from fedbench.algorithms._server import ServerOptimizer, ServerOptSettings
from fedbench.engine import ClientRows, Engine, OptimConfig, TrainResult
from fedbench.errors import ConfigError
from fedbench.paths import CONF_DIR
from fedbench.registry import Registry

if TYPE_CHECKING:
    from fedbench.attack import Attack

CONF_ALGO = CONF_DIR / "algo"


class AlgorithmRegistry(Registry["type[Algorithm]"]):
    """The algorithms. `@ALGORITHMS.register()` names a class after its module's file
    (fedbench/algorithms/fedper.py registers "fedper"), so the name is written nowhere
    else; a module holding several algorithms names them (`register("fedprox")`). The
    registry sets the class's `name`. An unknown name says which half is missing: the
    module or the YAML (`conf/algo/<name>.yaml`)."""

    def register(self, name: str | None = None):  # type: ignore[override]
        def deco(cls):
            key = name or cls.__module__.rsplit(".", 1)[-1]
            cls.name = key
            return Registry.register(self, key)(cls)

        return deco

    def get(self, name: str) -> type[Algorithm]:
        if name not in self and (CONF_ALGO / f"{name}.yaml").is_file():
            raise ConfigError(
                f"algo {name!r}: conf/algo/{name}.yaml exists but no module registers it; add "
                f"fedbench/algorithms/{name}.py with a class decorated @ALGORITHMS.register()"
            )
        return super().get(name)


ALGORITHMS = AlgorithmRegistry("algorithm")

FLOAT_BYTES = 4


@dataclass(frozen=True)
class Comm:
    """Bytes one round moved, summed over its clients: uploads and downloads."""

    bytes_up: int
    bytes_down: int


@dataclass(frozen=True)
class RoundReport:
    """What `round` returns to the runner. `train_loss`: the round's mean training loss (a
    0-d tensor is fine: the runner reads it only at evaluations, so a round costs no device
    synchronization for it). `comm`: the bytes moved (`Algorithm.comm`). `diagnostics`: the
    algorithm's own scalars, named as their metrics.csv columns (FedPG's QP fallbacks,
    FedSLR's ranks); tensors are read at evaluations too."""

    train_loss: torch.Tensor | float
    comm: Comm
    diagnostics: Mapping[str, torch.Tensor | float | int] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSettings:
    """The run-level settings an algorithm reads, from the checked config (`from_config`);
    an algorithm reads these and its `hp`, nothing else of the config."""

    local_epochs: int  # local epochs E per round (`local_epochs`)
    batch_size: int  # local mini-batch size B (`batch_size`)
    rounds: int  # communication rounds T (`rounds`)
    seed: int  # the run's seed (`seed`)
    optimizer: OptimConfig  # the run's local optimizer (`optim`)
    server_opt: ServerOptSettings  # the server's optimizer (`server_opt`, averaging servers)

    @classmethod
    def from_config(cls, rc: Any) -> RunSettings:
        """From the checked config (fedbench.config.RunConfig)."""
        o = rc.optim
        optimizer = OptimConfig(
            name=o.name,
            lr=o.lr,
            momentum=o.momentum,
            weight_decay=o.weight_decay,
            nesterov=o.nesterov,
            betas=(o.betas[0], o.betas[1]),
            eps=o.eps,
            lr_decay=o.lr_decay,
            persist_state=o.persist_state,
        )
        return cls(
            local_epochs=rc.local_epochs,
            batch_size=rc.batch_size,
            rounds=rc.rounds,
            seed=rc.seed,
            optimizer=optimizer,
            server_opt=rc.server_opt,
        )


@dataclass(frozen=True)
class RunContext:
    """What an algorithm is built with (`Algorithm(ctx, hp)`): the run's federation, its
    engine (model spec, backends, batches), the model factory (a fresh model of the run's
    architecture), the run-level settings and the malicious clients (None without)."""

    fed: Any  # fedbench.data.Federation
    engine: Engine
    model_fn: Callable[[], nn.Module]
    run: RunSettings
    attack: Attack | None = None


@dataclass(frozen=True)
class Needs:
    """The model pieces an algorithm reads (`Algorithm.needs`)."""

    head: bool = False  # a body/head split: `head_params()` / `body_params()`
    features: bool = False  # `features(x)`: the body's output


class Algorithm:
    """Base class: `Algorithm(ctx, hp)` holds the run's context (`RunContext`: federation,
    engine, model factory, run settings, attack) and the algorithm's hyperparameters;
    subclasses build their state in `setup()` (most need no `__init__`) and keep their
    models as flat state rows ([D] or [N, D], see `engine.spec`). The runner and the tests
    build one from the checked config with `from_config(rc, fed, engine, model_fn)`.

    Subclasses set `has_personal` / `has_global`, list their tensors in `state_keys` (for
    checkpoints) and implement `round`, `personal_states` and/or `global_state`. A per-client
    predictor reported beside the personalized one (FedProto's classifier head next to its
    nearest-prototype rule) is named in `extra_kinds` and scored by `extra_correct`.

    `Params` is the dataclass of the algorithm's hyperparameters (`params.py`): the keys of
    its YAML with their types and ranges, checked before the run starts; `self.hp` is an
    instance of it (a float field is a float even where the YAML wrote `1`). The run-level
    settings an algorithm uses are `self.run` (`RunSettings`); no algorithm reads the config.

    Capabilities: what an algorithm needs of the run is declared once, as class attributes
    (`needs_head`, `needs_features`: model pieces; `attackable`: its uploads go through
    `receive`; `server_optimizable`: its server averages into one model) or, where it
    depends on the hyperparameters, by overriding `needs(hp)`; `check_needs` is the one
    check, run from the config and again on the built model.

    Uploads: every tensor a client sends the server passes through `receive` where the
    server gets it; that is the one place where malicious clients (`attack.*`) act. An
    algorithm that routes its uploads through `receive` sets `attackable = True`; a run with
    an attack on any other algorithm stops with one line. The run's attack is `ctx.attack`.
    """

    name: ClassVar[str] = ""
    about: ClassVar[About | None] = None  # its docs rows (fedbench/algorithms/_about.py)
    has_personal: ClassVar[bool] = True
    has_global: ClassVar[bool] = False
    state_keys: ClassVar[tuple[str, ...]] = ()
    extra_kinds: ClassVar[tuple[str, ...]] = ()
    Params: ClassVar[type | None] = None  # every algorithm declares one (tests/test_params.py)
    attackable: ClassVar[bool] = False
    personal_rows: ClassVar[str | None] = None  # a stored [N, D] attribute of deployed states
    # True where the server averages uploads into one model through `server_step`, so that
    # `server_opt` (FedAvgM, FedAdagrad, FedAdam, FedYogi; algorithms/_server.py) applies
    server_optimizable: ClassVar[bool] = False

    # The model pieces an algorithm reads (`Needs`); checked once, in `check_needs`.
    needs_head: ClassVar[bool] = False  # a body/head split (`FedModel.head_params`)
    needs_features: ClassVar[bool] = False  # the body's output (`FedModel.features`)

    def __init__(self, ctx: RunContext, hp: Any) -> None:
        if type(hp) is not self.Params:
            raise ConfigError(
                f"algo={self.name} takes its {getattr(self.Params, '__name__', 'Params')}, "
                f"not {type(hp).__name__}"
            )
        self.ctx = ctx
        self.hp = hp
        self.run = ctx.run
        self.fed = ctx.fed
        self.engine = ctx.engine
        self.model_fn = ctx.model_fn
        self.device = ctx.engine.device
        self.N = ctx.fed.num_clients
        self.attack = ctx.attack  # the run's malicious clients, None without (fedbench.attack)
        type(self).check_needs(
            hp,
            model=ctx.engine.model,
            attack=ctx.attack is not None,
            server_opt=ctx.run.server_opt.name,
        )
        self.server_opt = ServerOptimizer(ctx.run.server_opt)
        self.setup()

    def setup(self) -> None:
        """The algorithm's own state, built from `self.hp`, `self.run`, `self.fed`,
        `self.engine` (its `spec`, `initial_state()`, `model`) and `self.model_fn`; called
        once by `__init__`, after the capability checks. A subclass of another algorithm
        calls `super().setup()` first."""

    @classmethod
    def from_config(
        cls, rc: Any, fed, engine: Engine, model_fn, *, attack: Attack | None = None
    ) -> Algorithm:
        """Built from the checked config (fedbench.config.RunConfig; `load_config`)."""
        if isinstance(rc, DictConfig | dict):
            raise TypeError(
                f"{cls.__name__} takes the checked config: "
                "fedbench.config.load_config(cfg), not the composed one"
            )
        if type(rc.algo.params) is not cls.Params:
            raise ConfigError(f"algo={rc.algo.name}: the config is not algo={cls.name}'s")
        ctx = RunContext(fed, engine, model_fn, RunSettings.from_config(rc), attack)
        return cls(ctx, rc.algo.params)

    @classmethod
    def needs(cls, hp: Any) -> Needs:
        """What this algorithm needs of the run at hyperparameters `hp`; an algorithm whose
        needs depend on its hyperparameters (IFCA's weight sharing) overrides it."""
        return Needs(head=cls.needs_head, features=cls.needs_features)

    @classmethod
    def check_needs(cls, hp: Any, *, model: Any, attack: bool, server_opt: str = "none") -> None:
        """ConfigError (one line) unless the run gives this algorithm what it needs: the
        one place these are checked, from the config (`load_config`: `model` the model's
        class, before anything is written) and again on the built model (`__init__`).
        `attack`: malicious clients are configured; `server_opt`: the server optimizer."""
        need = cls.needs(hp)
        # a registered builder function (ResNet-8/18/50) says nothing of its module's pieces
        # until it is built: checked then, on the built model
        known = isinstance(model, nn.Module | type)
        split = hasattr(model, "head_params") and hasattr(model, "body_params")
        if need.head and known and not split:
            raise ConfigError(
                f"algo={cls.name} needs a model with a body/head split (models.FedModel)"
            )
        if need.features and known and not hasattr(model, "features"):
            raise ConfigError(
                f"algo={cls.name} needs a model whose body's output it can read "
                "(models.FedModel.features)"
            )
        if attack and not cls.attackable:
            raise ConfigError(
                f"algo={cls.name} does not route its uploads through Algorithm.receive, "
                "so an attack cannot reach it; attack.kind=none"
            )
        if server_opt != "none" and not cls.server_optimizable:
            able = sorted(n for n in ALGORITHMS.names() if ALGORITHMS.get(n).server_optimizable)
            raise ConfigError(
                f"server_opt={server_opt}: algo={cls.name}'s server does not average uploads "
                f"into one model; a server optimizer applies to {', '.join(able)}"
            )

    @property
    def optim(self) -> OptimConfig:
        """The run's local optimizer (`self.run.optimizer`)."""
        return self.run.optimizer

    # ------------------------------------------------------------------ training helpers
    def local_train(self, states: torch.Tensor, clients, t: int, **kw: Any) -> TrainResult:
        """The engine with the run's defaults (epochs, batch size, optimizer, lr at round t)."""
        kw.setdefault("epochs", None if "steps" in kw else self.run.local_epochs)
        kw.setdefault("batch_size", self.run.batch_size)
        optim = kw.pop("optim", self.optim)
        kw.setdefault("lr", optim.lr_at(t))
        return self.engine.train(states, clients, optim=optim, round=t, **kw)

    def weights(self, clients, mode: str = "samples") -> torch.Tensor:
        """Aggregation weights over `clients` summing to 1: by sample count or uniform."""
        if mode == "uniform":
            w = torch.ones(len(clients))
        else:
            w = self.fed.train_sizes[torch.as_tensor(np.asarray(clients))]
        return (w / w.sum()).to(self.device)

    def comm(self, clients, up: int | None = None, down: int | None = None) -> Comm:
        """Bytes moved this round, from the numbers of floats sent up and down over all the
        round's clients: by default one full state each way per sampled client."""
        D = self.engine.n_state
        c = len(clients)
        return Comm(
            bytes_up=(c * D if up is None else up) * FLOAT_BYTES,
            bytes_down=(c * D if down is None else down) * FLOAT_BYTES,
        )

    def receive(
        self,
        uploads: torch.Tensor,
        clients,
        *,
        ref: torch.Tensor | None = None,
        kind: str = "model",
        n_params: int | None = None,
    ) -> torch.Tensor:
        """What the server receives of the rows `uploads` [C, ...] sent by `clients`.

        `kind`: "model" (a state trained from `ref`, the model the server sent), "grad" (a
        gradient or pseudo-gradient; `ref` = the point it was taken at, if any) or "other"
        (prototypes, scores ...). Honest clients' rows come back unchanged; malicious
        clients' rows are replaced as `attack.kind` says. `n_params`: how many leading
        columns of a "model"/"grad" row are parameters (the rest, buffers, are sent as
        they are); default the run model's `engine.n_params`, for rows in another layout
        (an algorithm's own extra modules) their own count.
        """
        if self.attack is None:
            return uploads
        P = self.engine.n_params if n_params is None else n_params
        return self.attack.apply(uploads, clients, ref=ref, kind=kind, n_params=P)

    # ------------------------------------------------------------------ the contract
    def round(self, t: int, clients: np.ndarray) -> RoundReport:
        raise NotImplementedError

    def personal_states(self) -> torch.Tensor | None:
        """[N, D]: what each client would deploy."""
        return None if self.personal_rows is None else getattr(self, self.personal_rows)

    def global_state(self) -> torch.Tensor | None:
        """[D]: the global model, for scheme-I algorithms."""
        return None

    def personal_state(self, i: int) -> torch.Tensor:
        """[D]: client i's deployed model. An algorithm that stores every client's deployed
        state as rows names them in `personal_rows`; one whose `personal_states` builds rows
        overrides this: an evaluation reads one client at a time and never builds N models."""
        if self.personal_rows is not None:
            return getattr(self, self.personal_rows)[i]
        return self.personal_states()[i]

    def model_size(self) -> dict[str, float]:
        """Parameters of the deployed models (FedSLR Table 2's "# of params"):
        `params_personal` (mean over clients of what one client deploys) and `params_global`
        (the global model), each where the algorithm has that model. Default: the whole
        model's parameters. Override where a deployed model is smaller (FedSLR's factorized
        GKR, FedSpa's sparse models) or larger (two models deployed). What the server sends
        is measured from `round()`'s bytes_down by the runner, not declared here."""
        out: dict[str, float] = {}
        if self.has_personal:
            out["params_personal"] = self.engine.n_params
        if self.has_global:
            out["params_global"] = self.engine.n_params
        return out

    def personal_correct(self, i: int, idx: torch.Tensor) -> torch.Tensor:
        return self.engine.correct(self.personal_state(i), idx)

    def global_correct(self, idx: torch.Tensor) -> torch.Tensor:
        return self.engine.correct(self.global_state(), idx)

    def extra_correct(self, kind: str, i: int, idx: torch.Tensor) -> torch.Tensor:
        """Hits [len(idx)] of client i's predictor `kind` (one of `extra_kinds`)."""
        raise NotImplementedError(f"{self.name} declares no predictor {kind!r}")

    def personal_model(self, i: int) -> nn.Module:
        """Client i's deployed model as a module, on the run's device."""
        return self.engine.to_module(self.personal_state(i), self.model_fn().to(self.device))

    def global_model(self) -> nn.Module | None:
        """The global model as a module on the run's device (None where there is none)."""
        g = self.global_state()
        return None if g is None else self.engine.to_module(g, self.model_fn().to(self.device))

    def server_step(
        self,
        key: str,
        x: torch.Tensor,
        avg: torch.Tensor,
        params: torch.Tensor | slice | None = None,
    ) -> torch.Tensor:
        """The server's new `x` from the clients' average `avg`: `avg` itself, or the step of
        the run's `server_opt` (its state kept under `key`). `params`: which entries are
        parameters (default: a whole state [D], its first `engine.n_params`)."""
        if params is None:
            params = slice(0, self.engine.n_params)
        return self.server_opt.step(key, x, avg, params)

    def state_dict(self) -> dict:
        state = {k: getattr(self, k) for k in self.state_keys}
        if self.server_opt.active:
            state["server_opt"] = self.server_opt.state_dict()
        return state

    def client_rows(self, name: str, default: torch.Tensor) -> ClientRows:
        """One row per client kept off the device (`Engine.client_rows`), every row `default`
        until written: a round reads and writes its sampled clients' rows only. Name it after
        its attribute in `state_keys` (its checkpoint shards are named after it)."""
        return self.engine.client_rows(f"{self.name}.{name}", default)

    def load_state_dict(self, state: dict) -> None:
        for k in self.state_keys:
            v = state[k]
            cur = getattr(self, k, None)
            if isinstance(cur, ClientRows):
                cur.load(v)  # shards verified as they are read (fedbench/checkpoint.py)
                continue
            setattr(self, k, v.to(self.device) if isinstance(v, torch.Tensor) else v)
        if self.server_opt.active:
            self.server_opt.load_state_dict(state.get("server_opt", {}), self.device)


class TrainedOrGlobal:
    """Mixin for a global state `w` [D] plus, per client, the state it ended its last visit
    with (`theta` [N, D] rows off the device, `client_rows`): the personalized model of
    FedAvg-like methods (docs/metrics.md); a client never sampled deploys w. Call
    `init_rows()` once `w` is set."""

    has_global: ClassVar[bool] = True

    def init_rows(self) -> None:
        self.theta = self.client_rows("theta", self.w)  # every row w^0 until trained
        self.seen = torch.zeros(self.N, dtype=torch.bool, device=self.device)

    def set_trained(self, idx: torch.Tensor, states: torch.Tensor) -> None:
        """Clients `idx` deploy `states` [C, D] from now on."""
        self.theta[idx] = states
        self.seen[idx] = True

    def personal_states(self) -> torch.Tensor:
        return torch.where(self.seen[:, None], self.theta.all(), self.w)

    def personal_state(self, i: int) -> torch.Tensor:
        return self.theta[i] if bool(self.seen[i]) else self.w

    def global_state(self) -> torch.Tensor:
        return self.w
