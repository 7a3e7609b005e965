"""conf/search/<algo>.yaml: every registered algorithm declares the search space of a study
(the learning rate and at most 3 of its own hyperparameters, each with the comment that says
where its range comes from), every key is a real key of the run or of its Params, and every
value a study can draw passes the same checks as a run's config."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from conftest import compose
from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.params import check_params
from fedbench.config import check_config

pytestmark = pytest.mark.quick

SEARCH = Path(__file__).resolve().parents[1] / "conf" / "search"
MAX_OWN = 3  # hyperparameters of the method's own beside the learning rate


def _space(algo: str) -> dict[str, str]:
    text = (SEARCH / f"{algo}.yaml").read_text()
    assert text.startswith("# @package _global_\n"), algo
    params = yaml.safe_load(text)["hydra"]["sweeper"]["params"]
    lines = [ln for ln in text.splitlines() if re.match(r"^\s+(optim|algo)\.", ln)]
    assert len(lines) == len(params) and all("  # " in ln for ln in lines), (
        f"{algo}: every range says where it comes from"
    )
    return params


def _candidates(key: str, value: str) -> list:
    """The values a study may draw for `key`: a choice's, an interval's two ends."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep

    sweep = OverridesParser.create().parse_override(f"{key}={value}").value()
    if isinstance(sweep, ChoiceSweep):
        return list(sweep.list)
    assert isinstance(sweep, IntervalSweep), f"{key}={value}: a choice or an interval"
    assert sweep.start < sweep.end, f"{key}={value}"
    return [sweep.start, sweep.end]


def _field(params: type, path: list[str]) -> None:
    """algo.<path> is a key of `params` (nested Params: hypernet.lr)."""
    for i, name in enumerate(path):
        fields = {f.name for f in dataclasses.fields(params)}
        assert name in fields, f"algo.{'.'.join(path)}: not a key of {params.__name__}"
        if i < len(path) - 1:
            params = typing.get_type_hints(params)[name]
            assert dataclasses.is_dataclass(params), f"algo.{'.'.join(path)}"


def test_every_algorithm_declares_a_search_space():
    assert sorted(p.stem for p in SEARCH.glob("*.yaml")) == sorted(ALGORITHMS.names())


@pytest.mark.parametrize("algo", sorted(ALGORITHMS.names()))
def test_search_space_keys_and_values_are_real(algo):
    params = _space(algo)
    assert params["optim.lr"] == "tag(log, interval(0.001, 0.5))"  # one range for all
    own = [k for k in params if k != "optim.lr"]
    assert len(own) <= MAX_OWN and all(k.startswith("algo.") for k in own), own
    algo_cls = ALGORITHMS.get(algo)
    default = compose([f"algo={algo}"])
    for key, value in params.items():
        path = key.split(".")[1:]
        if key.startswith("algo."):
            _field(algo_cls.Params, path)
        for v in _candidates(key, value):
            cfg = default.copy()
            node = cfg.optim if key == "optim.lr" else cfg.algo
            for name in path[:-1]:
                node = node[name]
            node[path[-1]] = v
            if key == "optim.lr":
                check_config(cfg)
            else:
                check_params(cfg.algo, algo_cls.Params, algo)


def test_a_search_space_composes_into_the_sweeper():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fedbench.cli import CONF_DIR

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = hydra_compose(
            config_name="config",
            overrides=["+search=fedprox", "algo=fedprox"],
            return_hydra_config=True,
        )
    assert dict(cfg.hydra.sweeper.params) == _space("fedprox")
    assert "search" not in cfg  # nothing but the sweeper's params: the run's config is as before
