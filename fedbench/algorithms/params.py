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

import math
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from fedbench.errors import ConfigError

Weighting = Literal["samples", "uniform"]


def hp(
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    length: int | None = None,
) -> Any:
    """A dataclass field with a range (for a list: of each element, and its `length`); the
    default value lives in the YAML."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return field(metadata={"bounds": bounds, "length": length})


# Shorthands for the ranges that recur.
def nonneg() -> Any:
    return hp(ge=0)


def positive() -> Any:
    return hp(gt=0)


def fraction() -> Any:
    return hp(ge=0, le=1)


@dataclass
class NoParams:
    """An algorithm without hyperparameters of its own (beyond the run's optimizer)."""


_OPS = {
    "ge": (lambda v, b: v >= b, ">="),
    "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "<="),
    "lt": (lambda v, b: v < b, "<"),
}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _fits(value: Any, tp: Any) -> bool:
    """Whether a plain (resolved) config value has type `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (elem,) = typing.get_args(tp)
        return isinstance(value, list | tuple) and all(_fits(v, elem) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # nan and inf are no setting of any fedbench key
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if tp is str:
        return isinstance(value, str)
    if is_dataclass(tp):
        return isinstance(value, dict)
    raise TypeError(f"unsupported hyperparameter type {tp!r}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def check_node(node: dict, params: type, prefix: str, owner: str, source: str) -> None:
    """Raise ConfigError (one line) unless the plain dict `node` has exactly the fields of the
    dataclass `params`, each of its type and in its range. `prefix` is the node's dotted key
    (`algo`, `optim`; "" for the top level), `owner` names whose keys they are in messages
    (`algo=fedavg`), `source` the file that lists them all (`conf/algo/fedavg.yaml`)."""
    hints = typing.get_type_hints(params)
    spec = {f.name: f for f in fields(params)}
    for key in node:
        if key not in spec:
            valid = ", ".join(spec) or "none"
            raise ConfigError(f"{_join(prefix, key)}: not a key of {owner}; valid: {valid}")
    for name, f in spec.items():
        key = _join(prefix, name)
        if name not in node:
            raise ConfigError(f"{key} is missing ({source} lists every key)")
        value, tp = node[name], hints[name]
        if not _fits(value, tp):
            raise ConfigError(f"{key}={value!r} must be {_type_name(tp)}")
        if is_dataclass(tp):
            check_node(value, tp, key, owner, source)
            continue
        length = f.metadata.get("length")
        if length is not None and isinstance(value, list | tuple) and len(value) != length:
            raise ConfigError(f"{key}={value!r} must have {length} elements")
        for op, bound in f.metadata.get("bounds", {}).items():
            items = value if isinstance(value, list | tuple) else [value]
            ok, sym = _OPS[op]
            if any(v is not None and not ok(v, bound) for v in items):
                each = ": each element" if isinstance(value, list | tuple) else ""
                raise ConfigError(f"{key}={value!r}{each} must be {sym} {bound}")


def _typed(value: Any, tp: Any) -> Any:
    """A checked plain value as field type `tp` holds it: a nested dataclass built, an int
    given for a float field (`mu: 1`) as a float, a list as a list; all else unchanged."""
    origin = typing.get_origin(tp)
    if is_dataclass(tp) and isinstance(value, dict):
        return build_params(value, tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if isinstance(value, int) and not isinstance(value, bool) and int not in args:
            return float(value) if float in args else value
        for a in args:  # a nested dataclass or a list inside an optional
            if (is_dataclass(a) and isinstance(value, dict)) or (
                typing.get_origin(a) is list and isinstance(value, list | tuple)
            ):
                return _typed(value, a)
        return value
    if origin is list:
        (elem,) = typing.get_args(tp)
        return [_typed(v, elem) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def build_params(node: dict, params: type) -> Any:
    """The dataclass `params` from the checked plain dict `node` (see `check_node`), each
    value cast per its field's annotation (`_typed`)."""
    hints = typing.get_type_hints(params)
    return params(**{f.name: _typed(node[f.name], hints[f.name]) for f in fields(params)})


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
