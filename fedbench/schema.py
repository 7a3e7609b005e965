"""The config's schema machinery: typed, ranged dataclass fields, checked once.

A schema is a dataclass whose fields are exactly the keys of a config node (a YAML under
conf/): the annotation is the type (`float`, `int | None`, `Literal["a", "b"]`, `list[int]`,
a nested dataclass for a sub-group), and `hp(ge=..., gt=..., le=..., lt=...)` adds a range.
`check_node` raises ConfigError (one line naming the key and what would be valid) unless a
plain dict fits the schema; `build_params` then builds the dataclass from it. The run's
schema is fedbench/config.py's; each algorithm's `Params` (fedbench/algorithms/) uses the
same machinery.

Two marks on a field say how a resume treats it (fedbench/checkpoint.py reads them through
`marked_keys`): `resume=True`, the key may change when a run is resumed (how long it runs,
where it computes, ...); `absent=<value>`, the value a run saved before the key existed had,
so that a saved config without the key is not refused for its absence.

    @dataclass(frozen=True)
    class EvalParams:
        every: int = hp(ge=1, resume=True)
        select: Literal["auto", "val"] = hp(absent="auto")
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import field, fields, is_dataclass
from typing import Any, Literal

from fedbench.errors import ConfigError

_UNSET: Any = object()


def hp(
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    length: int | None = None,
    resume: bool = False,
    absent: Any = _UNSET,
    optional: bool = False,
) -> Any:
    """A dataclass field with a range (for a list: of each element, and its `length`) and the
    resume marks (module docstring); the default value lives in the YAML. `optional`: a key
    no YAML lists, given with `+group.key=...`; None when it is not given."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    meta: dict[str, Any] = {"bounds": bounds, "length": length, "resume": resume}
    meta["optional"] = optional
    if absent is not _UNSET:
        meta["absent"] = absent
    return field(metadata=meta)


def chosen(*, absent: Any = _UNSET) -> Any:
    """The `name` field of a config group's option (`data.name`): which option the group is,
    checked against the group's options before the option's own keys; `absent` as in `hp`."""
    meta: dict[str, Any] = {"chosen": True}
    if absent is not _UNSET:
        meta["absent"] = absent
    return field(metadata=meta)


# Shorthands for the ranges that recur.
def nonneg() -> Any:
    return hp(ge=0)


def positive() -> Any:
    return hp(gt=0)


def fraction() -> Any:
    return hp(ge=0, le=1)


def at_least(n: int) -> Any:
    return hp(ge=n)


_OPS = {
    "ge": (lambda v, b: v >= b, ">="),
    "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "<="),
    "lt": (lambda v, b: v < b, "<"),
}


def type_name(tp: Any) -> str:
    """The annotation as a message names it: `0 | 1`, `null | int`, `a list of int`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def fits(value: Any, tp: Any) -> bool:
    """Whether a plain (resolved) config value has type `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (elem,) = typing.get_args(tp)
        return isinstance(value, list | tuple) and all(fits(v, elem) for v in value)
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


def _keys(params: type) -> dict:
    """The fields a node may hold: all but a group option's `name` (checked by its group),
    the optional ones last."""
    spec = [f for f in fields(params) if not f.metadata.get("chosen")]
    return {f.name: f for f in sorted(spec, key=lambda f: bool(f.metadata.get("optional")))}


def listed_keys(params: type) -> list[str]:
    """The keys a node of the schema `params` lists (its YAML's, without `name`): every
    field but the chosen option's name and the optional ones."""
    return [k for k, f in _keys(params).items() if not f.metadata.get("optional")]


def check_node(node: dict, params: type, prefix: str, owner: str, source: str) -> None:
    """Raise ConfigError (one line) unless the plain dict `node` has exactly the fields of the
    dataclass `params`, each of its type and in its range. `prefix` is the node's dotted key
    (`algo`, `optim`; "" for the top level), `owner` names whose keys they are in messages
    (`algo=fedavg`), `source` the file that lists them all (`conf/algo/fedavg.yaml`)."""
    hints = typing.get_type_hints(params)
    spec = _keys(params)
    for key in node:
        if key not in spec:
            valid = ", ".join(spec) or "none"
            raise ConfigError(f"{_join(prefix, key)}: not a key of {owner}; valid: {valid}")
    for name, f in spec.items():
        key = _join(prefix, name)
        if name not in node:
            if f.metadata.get("optional"):
                continue
            raise ConfigError(f"{key} is missing ({source} lists every key)")
        value, tp = node[name], hints[name]
        if not fits(value, tp):
            raise ConfigError(f"{key}={value!r} must be {type_name(tp)}")
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
    return params(**{f.name: _typed(node.get(f.name), hints[f.name]) for f in fields(params)})


def marked_keys(params: type, prefix: str = "", options: dict | None = None) -> Iterator[tuple]:
    """(dotted key, field metadata) of every field of the schema `params` and of the schemas
    nested in it, parents before their fields. `options` ({field name: the schemas a group
    field may hold}, e.g. every data option's) stands in for a field typed as one of
    several options."""
    hints = typing.get_type_hints(params)
    for f in fields(params):
        key = _join(prefix, f.name)
        yield key, f.metadata
        for sub in _schemas(hints[f.name], (options or {}).get(f.name, ())):
            yield from marked_keys(sub, key)


def _schemas(tp: Any, extra: Iterable[type]) -> list[type]:
    """The dataclasses a field's annotation names (itself, or inside an optional), and
    `extra`, without repeats."""
    out = [tp] if is_dataclass(tp) else []
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        out += [a for a in typing.get_args(tp) if is_dataclass(a)]
    return list(dict.fromkeys([*out, *extra]))
