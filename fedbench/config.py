"""The run's schema: every key of the composed config, its type and its range, checked once
before anything is built or written (`load_config`), which returns the config typed
(`RunConfig`): what the runner, the engine and the algorithms are built from.

The algorithms' keys are checked by their own `Params` (fedbench/algorithms/); this module
holds the rest with the same machinery (fedbench/schema.py): the run's top-level keys and
sub-groups (`optim`, `eval`, `engine`, `attack`, `checkpoint`, `log`, `objective`), and one
dataclass per option of the `data`, `split`, `model` and `server_opt` groups, whose fields are
exactly the keys of that option's YAML (`conf/<group>/<option>.yaml`;
tests/test_reliability.py holds the two to each other). Checks that need more than one key
(participation against clients, the attack's honest clients, the device string, data.root)
follow in `load_config`. The fields also say which keys a resume may change and which value
a key had before it existed (`hp(resume=..., absent=...)`; `resume_may_change`,
`absent_means`): fedbench/checkpoint.py's resume check reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from fedbench.errors import ConfigError
from fedbench.schema import (
    at_least,
    build_params,
    check_node,
    chosen,
    fraction,
    hp,
    marked_keys,
    nonneg,
    positive,
)
from fedbench.trees import plain

# The largest seed: every generator the run seeds (numpy, torch, CUDA) takes 32 bits.
MAX_SEED = 2**32 - 1
TestMode = Literal["matched", "pooled"]
Norm = Literal["none", "batch", "group"]


# ---------------------------------------------------------------------------- the run's keys


@dataclass(frozen=True)
class OptimParams:
    name: Literal["sgd", "adam"]
    lr: float = positive()
    momentum: float = hp(ge=0, lt=1)
    weight_decay: float = nonneg()
    nesterov: bool
    betas: list[float] = hp(ge=0, lt=1, length=2)
    eps: float = positive()
    lr_decay: float = hp(gt=0, le=1)  # lr at round t = lr * lr_decay^t
    persist_state: bool


@dataclass(frozen=True)
class EvalParams:
    every: int = hp(ge=1, resume=True)
    tail: float = hp(gt=0, le=0.5)  # top5 / bottom5 are the best / worst `tail` of clients
    s_frac: float = fraction()
    batch_size: int = hp(ge=1, resume=True)
    # the round a run reports as `selected` (summary.json; the report's default): val = the
    # best validation (V) avg, last, best_test = the best test L avg (optimistic); auto: val
    # with split.val_frac > 0, else last
    # (absent: a run saved before the key, auto = last without validation: its `final`)
    select: Literal["auto", "val", "last", "best_test"] = hp(absent="auto")


@dataclass(frozen=True)
class EngineParams:
    backend: Literal["auto", "sequential", "vmap"]
    drop_last: bool
    chunk_clients: int | None = at_least(1)
    memory_budget: float | None = positive()
    # per-client rows above this: a memory-mapped file (where rows live, never a result:
    # a run saved before the key equals any value)
    host_rows_gib: float = hp(ge=0, absent=2.0)


@dataclass(frozen=True)
class AttackParams:
    kind: Literal["none", "a1", "a2"]
    fraction: float = hp(gt=0, lt=1)
    a1_grad: Literal["scaled", "gaussian"]


@dataclass(frozen=True)
class WandbParams:
    project: str | None
    mode: Literal["offline", "online", "disabled"]
    entity: str | None


@dataclass(frozen=True)
class MlflowParams:
    uri: str | None
    experiment: str


@dataclass(frozen=True)
class LogParams:
    tensorboard: bool
    wandb: WandbParams
    mlflow: MlflowParams


@dataclass(frozen=True)
class ObjectiveParams:
    metric: str
    # final: the last evaluation; best: the best test L avg; selected: eval.select's round
    at: Literal["final", "best", "selected"]


OBJECTIVE = re.compile(
    r"^((personal|global|head|trained)\.(L|S|G|V)\.(avg|weighted|std|top5|bottom5|min|max)"
    r"|global\.all|auto)$"
)


@dataclass(frozen=True)
class CheckpointParams:
    every: int = nonneg()


@dataclass(frozen=True)
class RunParams:
    """The top-level keys (conf/config.yaml); the groups data/split/model/algo are checked by
    their option's own schema."""

    seed: int = hp(ge=0, le=MAX_SEED)
    # marked resume=True: what a resumed run may change (how long it runs, how often it is
    # evaluated and checkpointed, where it computes and finds its files). Everything else
    # decides the run's numbers or a column's meaning (eval.s_frac makes the S sets,
    # eval.tail top5/bottom5): a resume that changes it stops. (`rounds` may grow: APPLE's
    # L = l_frac * rounds and FedSpa's cosine schedule follow it.)
    device: str = hp(resume=True)
    rounds: int = hp(ge=1, resume=True)
    clients: int = at_least(1)
    participation: float = positive()
    local_epochs: int = at_least(1)
    batch_size: int = at_least(1)
    optim: OptimParams
    eval: EvalParams
    engine: EngineParams = hp(resume=True)
    attack: AttackParams
    log: LogParams = hp(resume=True)
    objective: ObjectiveParams = hp(resume=True)
    checkpoint: CheckpointParams = hp(resume=True)
    resume: bool | Literal["auto"] = hp(resume=True)


# ---------------------------------------------------------------------------- data options


@dataclass(frozen=True)
class Option:
    """A group's chosen option (`data=fmnist`): its name and, in a subclass, its keys."""

    name: str = chosen()

    def as_kwargs(self) -> dict[str, Any]:
        """The option's keys besides `name` ({key: value}), an optional key not given left
        out: what a builder takes as keyword arguments."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "name"
            and not (f.metadata.get("optional") and getattr(self, f.name) is None)
        }


@dataclass(frozen=True)
class FileData(Option):
    # data.root may change on resume: the data's digest is checked instead
    root: str | None = hp(resume=True)
    download: bool = hp(resume=True)
    augment: bool
    normalize: bool = hp(absent=True)  # inputs were always normalized before the key

    def source_keys(self) -> dict[str, Any]:
        """The keys of the option's own source (`load_dataset`'s keyword arguments): those
        beyond FileData's."""
        common = {f.name for f in fields(FileData)}
        return {k: v for k, v in self.as_kwargs().items() if k not in common}


@dataclass(frozen=True)
class PathMnistData(FileData):
    use_val: bool


@dataclass(frozen=True)
class SyntheticData(FileData):
    alpha: float = nonneg()
    beta: float = nonneg()
    dim: int = at_least(1)
    num_classes: int = at_least(2)
    num_samples: int = at_least(2)
    groups: int = at_least(1)


DATA = {
    "fmnist": FileData,
    "cifar10": FileData,
    "cifar100": FileData,
    "tinyimagenet": FileData,
    "pathmnist": PathMnistData,
    "synthetic": SyntheticData,
}

# ---------------------------------------------------------------------------- split options


@dataclass(frozen=True)
class SplitCommon(Option):
    train_per_client: int | None = at_least(1)
    test_mode: TestMode
    test_per_client: int | None = at_least(1)
    train_frac: float = hp(gt=0, lt=1)
    # each client's stratified validation share of its train (absent: none, before the key)
    val_frac: float = hp(ge=0, lt=1, absent=0.0)


@dataclass(frozen=True)
class IidSplit(SplitCommon):
    pass


@dataclass(frozen=True)
class PatSplit(SplitCommon):
    classes_per_client: int = at_least(1)
    balance: bool


@dataclass(frozen=True)
class DirSplit(SplitCommon):
    alpha: float = positive()
    dir_mode: Literal["per_class", "per_client"]
    dir_prior: Literal["shares", "ones"]
    min_samples: int = nonneg()


@dataclass(frozen=True)
class PracticalSplit(SplitCommon):
    groups: int = at_least(1)
    dominant_classes: list[list[int]] | None
    dominant_frac: float = fraction()


SPLIT = {"iid": IidSplit, "pat": PatSplit, "dir": DirSplit, "practical": PracticalSplit}

# ---------------------------------------------------------------------------- model options


@dataclass(frozen=True)
class ModelOption(Option):
    # accepted by every model (fedbench/models/registry.py) without being in a YAML; an
    # override adds it with `+model.layer_unit=...`
    layer_unit: Literal["op_norm", "module"] | None = hp(optional=True)


@dataclass(frozen=True)
class MlpModel(ModelOption):
    hidden: list[int] = at_least(1)


@dataclass(frozen=True)
class CnnModel(ModelOption):
    preset: Literal["fedavg", "lenet"] | None
    channels: list[int] | None = at_least(1)
    fc: list[int] | None = at_least(1)
    kernel: int = at_least(1)
    padding: int = nonneg()
    norm: Norm


@dataclass(frozen=True)
class ResNetModel(ModelOption):
    norm: Norm
    gn_groups: int = at_least(1)


@dataclass(frozen=True)
class ResNet8Model(ResNetModel):
    widths: list[int] = hp(ge=1, length=3)
    stem: Literal["cifar", "imagenet"]


@dataclass(frozen=True)
class WrnModel(ResNetModel):
    depth: int = at_least(10)
    widen: int = at_least(1)


MODEL = {
    "mlp": MlpModel,
    "cnn": CnnModel,
    "resnet8": ResNet8Model,
    "resnet18": ResNetModel,
    "resnet50": ResNetModel,
    "wrn28_10": WrnModel,
}

# ------------------------------------------------------------------ server optimizer options
# (fedbench/algorithms/_server.py; the keys of conf/server_opt/<name>.yaml)


@dataclass(frozen=True)
class ServerOptOption(Option):
    name: str = chosen(absent="none")  # plain averaging, all there was before server_opt


@dataclass(frozen=True)
class NoServerOpt(ServerOptOption):
    pass


@dataclass(frozen=True)
class SgdServerOpt(ServerOptOption):
    lr: float = positive()
    momentum: float = hp(ge=0, lt=1)


@dataclass(frozen=True)
class AdaptiveServerOpt(ServerOptOption):
    lr: float = positive()
    beta1: float = hp(ge=0, lt=1)
    tau: float = positive()
    # paper: Algorithm 2 as printed (all there was before the key); authors_code: the
    # authors' Keras/Yogi optimizers
    variant: Literal["paper", "authors_code"] = hp(absent="paper")


@dataclass(frozen=True)
class AdagradServerOpt(AdaptiveServerOpt):
    # v's start (null: the variant's own)
    initial_accumulator: float | None = hp(ge=0, absent=None)


@dataclass(frozen=True)
class AdamServerOpt(AdaptiveServerOpt):
    beta2: float = hp(ge=0, lt=1)


@dataclass(frozen=True)
class YogiServerOpt(AdamServerOpt):
    initial_accumulator: float | None = hp(ge=0, absent=None)


SERVER_OPT = {
    "none": NoServerOpt,
    "sgd": SgdServerOpt,
    "adagrad": AdagradServerOpt,
    "adam": AdamServerOpt,
    "yogi": YogiServerOpt,
}

GROUPS = {"data": DATA, "split": SPLIT, "model": MODEL, "server_opt": SERVER_OPT}

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


# ---------------------------------------------------------------------------- the typed run


@dataclass(frozen=True)
class AlgoConfig:
    """The chosen algorithm: its name and its `Params` instance (fedbench/algorithms/)."""

    name: str
    params: Any


@dataclass(frozen=True)
class RunConfig(RunParams):
    """The run's config, checked and typed (`load_config`): the top-level keys and groups of
    RunParams, the chosen option of each group, and the algorithm with its Params.
    `server_opt` is fedbench.algorithms._server.ServerOptSettings (its checks across keys run
    when it is built); `source` is the config as given, plain (saved with the run)."""

    data: FileData
    split: SplitCommon
    model: ModelOption
    server_opt: Any
    algo: AlgoConfig
    source: dict

    def option_keys(self, group: str) -> dict[str, Any]:
        """The keys of `group`'s chosen option (`Option.as_kwargs`), in the order the config gives
        them (the YAML's: partition.json records the split's so)."""
        keys = getattr(self, group).as_kwargs()
        return {k: keys[k] for k in self.source[group] if k in keys}


def task_config(cfg: DictConfig) -> DictConfig:
    """The run's config from one Hydra composed: its `hydra` node dropped, and the chosen
    algorithm's name (`${fedbench.choice:algo}`, conf/config.yaml) resolved to a plain
    value while the choice is still known, so that the config saved with the run, checked
    and compared on resume carries the name itself."""
    name = str(cfg.algo.name)
    out = OmegaConf.create({k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"})
    out.algo.name = name
    return out


def load_config(cfg: DictConfig | dict) -> RunConfig:
    """The run's config typed, or ConfigError (one line) unless every key is known, of its
    type and in its range (`algo` by the algorithm's `Params`) and the keys agree with each
    other. The one validation of a run's config: what it returns is used as it is. Reads no
    file but `data.root`'s kind (a directory, or absent)."""
    # the algorithms are imported when a config is checked, not with this module
    from fedbench.algorithms import ALGORITHMS
    from fedbench.algorithms._server import ServerOptSettings
    from fedbench.algorithms.params import typed_params
    from fedbench.models import MODELS

    source = {k: v for k, v in plain(cfg).items() if k != "hydra"}
    node = dict(source)
    node.setdefault("server_opt", {"name": "none"})  # a config saved before server_opt
    groups = {g: node.pop(g, None) for g in ("data", "split", "model", "algo", "server_opt")}
    for g, value in groups.items():
        if not isinstance(value, dict) or "name" not in value:
            raise ConfigError(f"{g}: missing from the config (conf/config.yaml's defaults)")
    check_node(node, RunParams, "", "the run", "conf/config.yaml")
    options = {}
    for g, choices in GROUPS.items():
        sub = dict(groups[g])
        name = sub.pop("name")
        if name not in choices:
            raise ConfigError(f"unknown {g} {name!r}; valid: {', '.join(sorted(choices))}")
        check_node(sub, choices[name], g, f"{g}={name}", f"conf/{g}/{name}.yaml")
        options[g] = build_params(groups[g], choices[name])
    server_opt = ServerOptSettings(
        **options["server_opt"].as_kwargs(), name=options["server_opt"].name
    )
    algo = str(groups["algo"]["name"])
    algo_cls = ALGORITHMS.get(algo)
    params = typed_params(groups["algo"], algo_cls.Params, algo)
    run = build_params(node, RunParams)
    algo_cls.check_needs(
        params,
        model=MODELS.get(options["model"].name),
        attack=run.attack.kind != "none",
        server_opt=server_opt.name,
    )
    out = RunConfig(
        **{f.name: getattr(run, f.name) for f in fields(RunParams)},
        data=options["data"],
        split=options["split"],
        model=options["model"],
        server_opt=server_opt,
        algo=AlgoConfig(algo, params),
        source=source,
    )
    _check_together(out)
    return out


def check_config(cfg: DictConfig | dict) -> None:
    """`load_config` for its ConfigError only (a check before a job is launched)."""
    load_config(cfg)


def _check_together(rc: RunConfig) -> None:
    n = rc.clients
    if not _DEVICE.match(rc.device):
        raise ConfigError(f"device={rc.device!r}; valid: auto, cpu, cuda, cuda:N")
    from fedbench.tracking import check_installed

    check_installed(rc.log)
    metric = rc.objective.metric
    if not OBJECTIVE.match(metric):
        raise ConfigError(
            f"objective.metric={metric!r}; valid: auto, <personal|global|head|trained>."
            "<L|S|G|V>.<avg|weighted|std|top5|bottom5|min|max>, or global.all"
        )
    if not rc.split.val_frac:
        if rc.eval.select == "val":
            raise ConfigError(
                "eval.select=val needs validation data: set split.val_frac (e.g. 0.1), or "
                "use eval.select=last"
            )
        if metric.split(".")[1:2] == ["V"]:
            raise ConfigError(
                f"objective.metric={metric} needs validation data: set split.val_frac (e.g. 0.1)"
            )
    p = rc.participation
    if p > 1 and (p != int(p) or p > n):
        raise ConfigError(
            f"participation={p:g}: a fraction in (0, 1] or a whole count of clients <= {n}"
        )
    attack = rc.attack
    if attack.kind != "none":
        k = max(1, round(attack.fraction * n))
        if k >= n:
            raise ConfigError(
                f"attack.fraction={attack.fraction} makes {k} of the {n} clients malicious: "
                "no honest client is left to score; lower it"
            )
    root = rc.data.root
    if root and Path(root).expanduser().exists() and not Path(root).expanduser().is_dir():
        raise ConfigError(f"data.root={root} is a file, not a directory")


def clients_per_round(rc: RunConfig) -> int:
    """`participation` as a count: a fraction in (0, 1] of the clients, or a whole count
    (checked against `clients` by `load_config`)."""
    p = rc.participation
    return max(1, round(p * rc.clients)) if p <= 1.0 else int(p)


# ---------------------------------------------------------------------------- resume marks


def _marks() -> dict[str, Any]:
    """{dotted key: field metadata} of the run's schema, every group's options included."""
    out: dict[str, Any] = {}
    for key, meta in marked_keys(RunParams):
        out.setdefault(key, meta)
    for g, choices in GROUPS.items():
        for option in choices.values():
            for key, meta in marked_keys(option, g):
                out.setdefault(key, meta)
    return out


def resume_may_change() -> tuple[str, ...]:
    """The keys (a group: all its keys) a resumed run may change: the schema's fields marked
    `resume=True`."""
    return tuple(k for k, meta in _marks().items() if meta.get("resume"))


def absent_means() -> dict[str, Any]:
    """{key: value} for keys added to the config after runs were saved: the value a run
    without the key had (the fields' `absent` mark), so that a resume or resume=auto of such
    a run is not refused for the key's absence."""
    return {k: meta["absent"] for k, meta in _marks().items() if "absent" in meta}


def objective_on_test(cfg: DictConfig | dict) -> bool:
    """Whether the run's objective (what a sweeper maximizes) is a test-set number: an
    explicit metric of L, S, G or global.all, or `auto` without validation data."""
    node = plain(cfg)
    metric = str(node["objective"]["metric"])
    if metric == "auto":
        return not (node["split"].get("val_frac") or 0)
    return metric.split(".")[1:2] != ["V"]


TEST_OBJECTIVE_WARNING = (
    "objective on the test set: tuning on test data is optimistic (set split.val_frac, e.g. "
    "0.1, for a validation objective)"
)
