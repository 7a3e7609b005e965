"""The run's config checked once and typed (fedbench/config.py, fedbench/schema.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import compose
from fedbench.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.quick
def test_importing_the_config_does_not_import_the_algorithms():
    """The schema machinery lives outside fedbench/algorithms/: config imports no algorithm
    until a config is checked."""
    code = (
        "import sys, fedbench.config\n"
        "print(sorted(m for m in sys.modules if m.startswith('fedbench.algorithms')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.quick
def test_load_config_returns_frozen_typed_parts():
    from fedbench.algorithms._server import ServerOptSettings
    from fedbench.algorithms.fedavg import FedProxParams
    from fedbench.config import RunConfig, load_config

    rc = load_config(
        compose(
            [
                "algo=fedprox",
                "algo.mu=1",
                "optim.lr=1",
                "participation=3",
                "server_opt=adam",
                "model.hidden=[16]",
                "+model.layer_unit=module",
            ]
        )
    )
    assert isinstance(rc, RunConfig)
    # an int written for a float field is a float, as the arithmetic had it with float(...)
    assert type(rc.optim.lr) is float and rc.optim.lr == 1.0
    assert type(rc.participation) is float and type(rc.clients) is int
    assert rc.algo.name == "fedprox" and type(rc.algo.params) is FedProxParams
    assert type(rc.algo.params.mu) is float
    assert isinstance(rc.server_opt, ServerOptSettings) and rc.server_opt.name == "adam"
    assert rc.model.name == "mlp" and rc.model.as_kwargs() == {
        "layer_unit": "module",
        "hidden": [16],
    }
    assert list(rc.option_keys("model")) == ["hidden", "layer_unit"]  # the config's order
    assert rc.data.name == "fmnist" and rc.data.source_keys() == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.optim.lr = 2.0  # type: ignore[misc]
    # an option not given is left out of what a builder receives
    assert "layer_unit" not in load_config(compose([])).model.as_kwargs()


@pytest.mark.quick
def test_a_cross_key_fault_is_one_config_error():
    from fedbench.config import load_config

    for bad, msg in (
        (["participation=30"], "participation=30"),
        (["server_opt=adagrad", "server_opt.variant=authors_code"], "server_opt.beta1"),
        (["algo=local", "server_opt=sgd"], "server_opt=sgd"),
        (["optim.name=rmsprop"], "optim.name"),
        (["engine.memory_budget=0"], "engine.memory_budget"),
    ):
        with pytest.raises(ConfigError, match=msg) as e:
            load_config(compose(bad))
        assert "\n" not in str(e.value)


@pytest.mark.quick
def test_resume_marks_are_the_schemas():
    """What a resume may change and what an absent key meant are marks on the schema's
    fields, and the resume check reads them."""
    from fedbench.checkpoint import ABSENT_MEANS, RESUME_MAY_CHANGE
    from fedbench.config import EvalParams, absent_means, resume_may_change

    assert resume_may_change() == RESUME_MAY_CHANGE and absent_means() == ABSENT_MEANS
    every = {f.name: f for f in dataclasses.fields(EvalParams)}
    assert every["every"].metadata["resume"] and not every["tail"].metadata["resume"]
    assert every["select"].metadata["absent"] == "auto"
    assert ABSENT_MEANS == {
        "eval.select": "auto",
        "data.normalize": True,
        "split.val_frac": 0.0,
        "server_opt.name": "none",
        "server_opt.variant": "paper",
        "server_opt.initial_accumulator": None,
        "engine.host_rows_gib": 2.0,
    }


@pytest.mark.quick
def test_an_algorithm_takes_the_typed_config():
    """The runner hands the algorithm its checked config; a composed one is checked there."""
    from conftest import TinyFed
    from fedbench.algorithms import ALGORITHMS
    from fedbench.config import load_config
    from fedbench.engine import Engine
    from fedbench.models import build_model

    fed = TinyFed()
    model_fn = lambda: build_model("mlp", fed.input_shape, fed.num_classes, hidden=[8])  # noqa: E731
    rc = load_config(compose(["algo=fedprox", "algo.mu=0.5", "batch_size=8"]))
    algo = ALGORITHMS.get("fedprox").from_config(
        rc, fed, Engine(fed, model_fn(), device="cpu"), model_fn
    )
    assert algo.hp is rc.algo.params and algo.run.server_opt is rc.server_opt
    assert algo.run.optimizer.betas == tuple(rc.optim.betas)
    with pytest.raises(ConfigError, match="algo=fedprox"):
        ALGORITHMS.get("fedavg").from_config(
            rc, fed, Engine(fed, model_fn(), device="cpu"), model_fn
        )
