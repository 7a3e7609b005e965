"""The run's schema: every key of the composed config, its type and its range, checked once
before anything is built or written (`check_config`).

The algorithms' keys are checked by their own `Params` (fedbench/algorithms/params.py); this
module holds the rest with the same machinery: the run's top-level keys and sub-groups
(`optim`, `eval`, `engine`, `attack`, `checkpoint`), and one dataclass per option of the
`data`, `split` and `model` groups, whose fields are exactly the keys of that option's YAML
(`conf/<group>/<option>.yaml`; tests/test_reliability.py holds the two to each other). Checks that
need more than one key (participation against clients, the attack's honest clients, the
device string, data.root) follow in `check_config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from omegaconf import DictConfig, OmegaConf

from fedbench.algorithms.params import check_node, fraction, hp, nonneg, positive
from fedbench.errors import ConfigError
from fedbench.trees import plain

# The largest seed: every generator the run seeds (numpy, torch, CUDA) takes 32 bits.
MAX_SEED = 2**32 - 1
TestMode = Literal["matched", "pooled"]
Norm = Literal["none", "batch", "group"]


def at_least(n: int):
    return hp(ge=n)


# ---------------------------------------------------------------------------- the run's keys


@dataclass
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


@dataclass
class EvalParams:
    every: int = at_least(1)
    tail: float = hp(gt=0, le=0.5)  # top5 / bottom5 are the best / worst `tail` of clients
    s_frac: float = fraction()
    batch_size: int = at_least(1)
    # the round a run reports as `selected` (summary.json; the report's default): val = the
    # best validation (V) avg, last, best_test = the best test L avg (optimistic); auto: val
    # with split.val_frac > 0, else last
    select: Literal["auto", "val", "last", "best_test"]


@dataclass
class EngineParams:
    backend: Literal["auto", "sequential", "vmap"]
    drop_last: bool
    chunk_clients: int | None = at_least(1)
    memory_budget: float | None = positive()
    host_rows_gib: float = nonneg()  # per-client rows above this: a memory-mapped file


@dataclass
class AttackParams:
    kind: Literal["none", "a1", "a2"]
    fraction: float = hp(gt=0, lt=1)
    a1_grad: Literal["scaled", "gaussian"]


@dataclass
class WandbParams:
    project: str | None
    mode: Literal["offline", "online", "disabled"]
    entity: str | None


@dataclass
class MlflowParams:
    uri: str | None
    experiment: str


@dataclass
class LogParams:
    tensorboard: bool
    wandb: WandbParams
    mlflow: MlflowParams


@dataclass
class ObjectiveParams:
    metric: str
    # final: the last evaluation; best: the best test L avg; selected: eval.select's round
    at: Literal["final", "best", "selected"]


OBJECTIVE = re.compile(
    r"^((personal|global|head|trained)\.(L|S|G|V)\.(avg|weighted|std|top5|bottom5|min|max)"
    r"|global\.all|auto)$"
)


@dataclass
class CheckpointParams:
    every: int = nonneg()


@dataclass
class RunParams:
    """The top-level keys (conf/config.yaml); the groups data/split/model/algo are checked by
    their option's own schema."""

    seed: int = hp(ge=0, le=MAX_SEED)
    device: str
    rounds: int = at_least(1)
    clients: int = at_least(1)
    participation: float = positive()
    local_epochs: int = at_least(1)
    batch_size: int = at_least(1)
    optim: OptimParams
    eval: EvalParams
    engine: EngineParams
    attack: AttackParams
    log: LogParams
    objective: ObjectiveParams
    checkpoint: CheckpointParams
    resume: bool | Literal["auto"]


# ---------------------------------------------------------------------------- data options


@dataclass
class FileData:
    root: str | None
    download: bool
    augment: bool
    normalize: bool


@dataclass
class PathMnistData(FileData):
    use_val: bool


@dataclass
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


@dataclass
class SplitCommon:
    train_per_client: int | None = at_least(1)
    test_mode: TestMode
    test_per_client: int | None = at_least(1)
    train_frac: float = hp(gt=0, lt=1)
    val_frac: float = hp(ge=0, lt=1)  # each client's stratified validation share of its train


@dataclass
class IidSplit(SplitCommon):
    pass


@dataclass
class PatSplit(SplitCommon):
    classes_per_client: int = at_least(1)
    balance: bool


@dataclass
class DirSplit(SplitCommon):
    alpha: float = positive()
    dir_mode: Literal["per_class", "per_client"]
    dir_prior: Literal["shares", "ones"]
    min_samples: int = nonneg()


@dataclass
class PracticalSplit(SplitCommon):
    groups: int = at_least(1)
    dominant_classes: list[list[int]] | None
    dominant_frac: float = fraction()


SPLIT = {"iid": IidSplit, "pat": PatSplit, "dir": DirSplit, "practical": PracticalSplit}

# ---------------------------------------------------------------------------- model options


@dataclass
class MlpModel:
    hidden: list[int] = at_least(1)


@dataclass
class CnnModel:
    preset: Literal["fedavg", "lenet"] | None
    channels: list[int] | None = at_least(1)
    fc: list[int] | None = at_least(1)
    kernel: int = at_least(1)
    padding: int = nonneg()
    norm: Norm


@dataclass
class ResNetModel:
    norm: Norm
    gn_groups: int = at_least(1)


@dataclass
class ResNet8Model(ResNetModel):
    widths: list[int] = hp(ge=1, length=3)
    stem: Literal["cifar", "imagenet"]


@dataclass
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


@dataclass
class NoServerOpt:
    pass


@dataclass
class SgdServerOpt:
    lr: float = positive()
    momentum: float = hp(ge=0, lt=1)


@dataclass
class AdaptiveServerOpt:
    lr: float = positive()
    beta1: float = hp(ge=0, lt=1)
    tau: float = positive()
    # paper: Algorithm 2 as printed; authors_code: the authors' Keras/Yogi optimizers
    variant: Literal["paper", "authors_code"]


@dataclass
class AdagradServerOpt(AdaptiveServerOpt):
    initial_accumulator: float | None = nonneg()  # v's start (null: the variant's own)


@dataclass
class AdamServerOpt(AdaptiveServerOpt):
    beta2: float = hp(ge=0, lt=1)


@dataclass
class YogiServerOpt(AdamServerOpt):
    initial_accumulator: float | None = nonneg()


SERVER_OPT = {
    "none": NoServerOpt,
    "sgd": SgdServerOpt,
    "adagrad": AdagradServerOpt,
    "adam": AdamServerOpt,
    "yogi": YogiServerOpt,
}

GROUPS = {"data": DATA, "split": SPLIT, "model": MODEL, "server_opt": SERVER_OPT}

# `model.layer_unit` is accepted by every model (fedbench/models/registry.py) without being in
# a YAML; an override adds it with `+model.layer_unit=...`.
OPTIONAL = {"model": {"layer_unit": Literal["op_norm", "module"]}}

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def task_config(cfg: DictConfig) -> DictConfig:
    """The run's config from one Hydra composed: its `hydra` node dropped, and the chosen
    algorithm's name (`${fedbench.choice:algo}`, conf/config.yaml) resolved to a plain
    value while the choice is still known, so that the config saved with the run, checked
    and compared on resume carries the name itself."""
    name = str(cfg.algo.name)
    out = OmegaConf.create({k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"})
    out.algo.name = name
    return out


def check_config(cfg: DictConfig | dict) -> None:
    """Raise ConfigError (one line) unless every key of the run's config is known, of its
    type and in its range; `algo` is checked by the algorithm's `Params`. Reads no file but
    `data.root`'s kind (a directory, or absent)."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.algorithms._server import ServerOptSettings
    from fedbench.algorithms.params import check_params

    node = {k: v for k, v in plain(cfg).items() if k != "hydra"}
    node.setdefault("server_opt", {"name": "none"})  # a config saved before server_opt
    groups = {g: node.pop(g, None) for g in ("data", "split", "model", "algo", "server_opt")}
    for g, value in groups.items():
        if not isinstance(value, dict) or "name" not in value:
            raise ConfigError(f"{g}: missing from the config (conf/config.yaml's defaults)")
    check_node(node, RunParams, "", "the run", "conf/config.yaml")
    for g, options in GROUPS.items():
        sub = dict(groups[g])
        name = sub.pop("name")
        if name not in options:
            raise ConfigError(f"unknown {g} {name!r}; valid: {', '.join(sorted(options))}")
        extra = OPTIONAL.get(g, {})
        for key, tp in extra.items():
            if key in sub and sub[key] not in tp.__args__:
                valid = ", ".join(tp.__args__)
                raise ConfigError(f"{g}.{key}={sub[key]!r} must be {valid}")
            sub.pop(key, None)
        check_node(sub, options[name], g, f"{g}={name}", f"conf/{g}/{name}.yaml")
    ServerOptSettings.from_cfg(groups["server_opt"])  # its checks across keys
    algo = str(groups["algo"]["name"])
    algo_cls = ALGORITHMS.get(algo)
    check_params(groups["algo"], algo_cls.Params, algo)
    server_opt = groups["server_opt"]["name"]
    if server_opt != "none" and not algo_cls.server_optimizable:
        able = sorted(n for n in ALGORITHMS.names() if ALGORITHMS.get(n).server_optimizable)
        raise ConfigError(
            f"server_opt={server_opt}: algo={algo}'s server does not average uploads into one "
            f"model; a server optimizer applies to {', '.join(able)}"
        )
    _check_together(node, groups)


def _check_together(node: dict, groups: dict) -> None:
    n = node["clients"]
    device = node["device"]
    if not _DEVICE.match(device):
        raise ConfigError(f"device={device!r}; valid: auto, cpu, cuda, cuda:N")
    from fedbench.tracking import check_installed

    check_installed(node["log"])
    metric = node["objective"]["metric"]
    if not OBJECTIVE.match(metric):
        raise ConfigError(
            f"objective.metric={metric!r}; valid: auto, <personal|global|head|trained>."
            "<L|S|G|V>.<avg|weighted|std|top5|bottom5|min|max>, or global.all"
        )
    val_frac = groups["split"].get("val_frac") or 0
    if not val_frac:
        select = node["eval"]["select"]
        if select == "val":
            raise ConfigError(
                "eval.select=val needs validation data: set split.val_frac (e.g. 0.1), or "
                "use eval.select=last"
            )
        if metric.split(".")[1:2] == ["V"]:
            raise ConfigError(
                f"objective.metric={metric} needs validation data: set split.val_frac (e.g. 0.1)"
            )
    p = node["participation"]
    if p > 1 and (p != int(p) or p > n):
        raise ConfigError(
            f"participation={p}: a fraction in (0, 1] or a whole count of clients <= {n}"
        )
    attack = node["attack"]
    if attack["kind"] != "none":
        k = max(1, round(attack["fraction"] * n))
        if k >= n:
            raise ConfigError(
                f"attack.fraction={attack['fraction']} makes {k} of the {n} clients malicious: "
                "no honest client is left to score; lower it"
            )
    root = groups["data"].get("root")
    if root and Path(str(root)).expanduser().exists() and not Path(root).expanduser().is_dir():
        raise ConfigError(f"data.root={root} is a file, not a directory")


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
