"""Typed hyperparameters: every algorithm's keys, their types and ranges, checked once.

Each algorithm class names a dataclass `Params` whose fields are exactly the keys of its
YAML (`conf/algo/<name>.yaml`, where the defaults and their comments live; `name` is the
file's, conf/config.yaml). The annotation is the type (`float`, `int | None`, `Literal["a", "b"]`,
`list[int]`, a nested `Params` dataclass for a sub-group such as pFedHN's `hypernet`), and
`hp(ge=..., gt=..., le=..., lt=...)` adds a range. `check_params` runs before the algorithm
is built: a mistyped key, a wrong type or a value out of range is one line naming the key
and what would be valid (exit 2), never a run with a silently ignored or nonsensical value.

    @dataclass
    class FedProxParams(FedAvgParams):
        mu: float = hp(ge=0)          # the YAML gives the default 0.01

A subclass of an algorithm extends its parent's dataclass, as FedProx extends FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

# The schema machinery is fedbench/schema.py's (the run's keys use it too); algorithms import
# the field helpers from here, beside their own vocabulary (`Weighting`, `NoParams`).
from fedbench.schema import build_params, check_node, fraction, hp, nonneg, positive

__all__ = [
    "NoParams",
    "Weighting",
    "build_params",
    "check_node",
    "check_params",
    "fraction",
    "hp",
    "nonneg",
    "plain_params",
    "positive",
    "typed_params",
]

Weighting = Literal["samples", "uniform"]


@dataclass
class NoParams:
    """An algorithm without hyperparameters of its own (beyond the run's optimizer)."""


def plain_params(algo_cfg: DictConfig | dict) -> dict:
    """The algorithm's config node as a plain dict, interpolations resolved, without `name`."""
    node = (
        OmegaConf.to_container(algo_cfg, resolve=True)
        if isinstance(algo_cfg, DictConfig)
        else dict(algo_cfg)
    )
    node.pop("name", None)  # the group option's own name
    return node


def typed_params(algo_cfg: DictConfig | dict, params: type | None, algo: str) -> Any:
    """`check_params`, then the checked node as an instance of `params` (None: no Params)."""
    if params is None:
        return None
    node = plain_params(algo_cfg)  # resolved once, checked, then built
    check_node(node, params, "algo", f"algo={algo}", f"conf/algo/{algo}.yaml")
    return build_params(node, params)


def check_params(algo_cfg: DictConfig | dict, params: type | None, algo: str) -> None:
    """Raise ConfigError (one line) unless `algo_cfg` has exactly the keys of `params`, each of
    its type and in its range. Interpolations (`${local_epochs}`) are resolved first."""
    if params is None:  # not declared yet: tests/test_params.py fails for such an algorithm
        return
    node = plain_params(algo_cfg)
    check_node(node, params, "algo", f"algo={algo}", f"conf/algo/{algo}.yaml")
