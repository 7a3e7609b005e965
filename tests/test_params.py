"""Every hyperparameter is checked: each algorithm's Params schema matches its YAML, and the
`fedbench` command turns an invalid value or a mistyped key into one line and exit 2, before
any data loads (the CLI composes and checks the config before Hydra starts)."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedbench import cli
from fedbench.algorithms import ALGORITHMS
from fedbench.config import load_config
from fedbench.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def schema_keys(params: type, prefix: str = "") -> set[str]:
    """Dotted keys of a Params dataclass, nested dataclasses expanded."""
    hints = typing.get_type_hints(params)
    out = set()
    for f in fields(params):
        key = f"{prefix}{f.name}"
        if is_dataclass(hints[f.name]):
            out |= schema_keys(hints[f.name], key + ".")
        else:
            out.add(key)
    return out


def yaml_keys(node, prefix: str = "") -> set[str]:
    out = set()
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= yaml_keys(v, key + ".")
        else:
            out.add(key)
    return out


# (a) ------------------------------------------------------------------------------------
@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_declares_params_matching_its_yaml(name):
    params = ALGORITHMS.get(name).Params
    assert params is not None, f"{name} declares no Params (fedbench/algorithms/params.py)"
    path = REPO / "conf" / "algo" / f"{name}.yaml"
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert yaml_keys(node) - {"name"} == schema_keys(params)


# (b) ------------------------------------------------------------------------------------
# algo, override, the key the message must name
INVALID = [
    ("fedprox", "algo.mu=-1", "algo.mu"),
    ("fedprox", "algo.mu=abc", "algo.mu"),
    ("pfedme", "algo.lam=-1", "algo.lam"),
    ("ditto", "algo.lam=-0.1", "algo.lam"),
    ("fedcac", "algo.tau=1.5", "algo.tau"),
    ("diversifed", "algo.lam=-2", "algo.lam"),
    ("fedsam", "algo.rho=-0.05", "algo.rho"),
    ("plgu_lf", "algo.personal_layers=-1", "algo.personal_layers"),
    ("plgu_grep", "algo.scores=foo", "algo.scores"),
    ("fedamp", "algo.sigma=-1", "algo.sigma"),
    ("apple", "algo.l_frac=1.5", "algo.l_frac"),
    ("fedfomo", "algo.val_frac=-0.2", "algo.val_frac"),
    ("pfedhn", "algo.hypernet.lr=-0.01", "algo.hypernet.lr"),
    ("apfl", "algo.alpha=2", "algo.alpha"),
    ("feddyn", "algo.alpha=-0.1", "algo.alpha"),
    ("fedslr", "algo.rank_penalty=-1", "algo.rank_penalty"),
    ("perfedavg", "algo.alpha=-0.01", "algo.alpha"),
]


def _needs_params(algo: str) -> None:
    if algo not in ALGORITHMS:
        pytest.skip(f"algorithm {algo} not registered in this checkout")
    if ALGORITHMS.get(algo).Params is None:
        pytest.xfail(f"{algo} declares no Params yet (test (a) fails for it)")


@pytest.mark.quick
@pytest.mark.parametrize("algo,override,key", INVALID, ids=[c[1] + "-" + c[0] for c in INVALID])
def test_invalid_hyperparameter_is_one_line(algo, override, key):
    _needs_params(algo)
    msg = cli.refusal([f"algo={algo}", override])
    assert msg is not None, f"algo={algo} {override} passed the check"
    assert msg.startswith(f"fedbench: {key}") and "\n" not in msg


@pytest.mark.quick
def test_valid_defaults_pass():
    for algo in ("fedavg", "fedprox", "pfedme", "plgu_ghn"):
        if ALGORITHMS.get(algo).Params is not None:
            assert cli.refusal([f"algo={algo}"]) is None


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """`fedbench ARGV` in this process (the checks run before Hydra: nothing is written)."""
    monkeypatch.setattr(sys, "argv", ["fedbench", *argv])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.quick
def test_cli_exit_2_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "algo=fedprox", "algo.mu=-1")
    assert (code, out) == (2, "")
    assert err.strip() == "fedbench: algo.mu=-1 must be >= 0"
    # a sweep's first job is composed before Hydra launches any: a mistyped key ends it
    code, _, err = run_main(monkeypatch, capsys, "-m", "algo=fedprox", "seed=0,1", "algo.muu=1")
    assert code == 2 and err.count("\n") == 1 and "algo.muu" in err
    assert list(tmp_path.iterdir()) == []  # no outputs/ or multirun/ directory


@pytest.mark.slow
def test_cli_subprocess_exit_2_one_line(tmp_path):
    """The real command: one line on stderr, nothing on stdout, exit 2, nothing written."""
    cmd = [sys.executable, "-c", "from fedbench.cli import main; main()"]
    r = subprocess.run(
        [*cmd, "algo=fedprox", "algo.muu=0.1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "fedbench: algo.muu: not a key of algo=fedprox; valid: mu, weighting"
    ]
    assert list(tmp_path.iterdir()) == []


# (c) ------------------------------------------------------------------------------------
UNKNOWN = [
    # Hydra's struct error (multi-line, exit 1 without fedbench's check)
    (["algo=fedprox", "algo.muu=0.1"], "fedbench: algo.muu: not a key of algo=fedprox; valid:"),
    (["optim.lrr=0.1"], "fedbench: optim.lrr: not a config key; valid keys of optim: name, lr"),
    (["roundz=3"], "fedbench: roundz: not a config key; valid keys: data, split"),
    (["algo=pfedhn", "algo.hypernet.lrr=0.1"], "fedbench: algo.hypernet.lrr: not a config key"),
    # added with +: composes, then the Params schema refuses it
    (["algo=fedprox", "+algo.muu=0.1"], "fedbench: algo.muu: not a key of algo=fedprox; valid:"),
    (["algo=fedavg", "+algo.mu=0.1"], "fedbench: algo.mu: not a key of algo=fedavg; valid:"),
    (["algo=pfedhn", "+algo.hypernet.zz=1"], "fedbench: algo.hypernet.zz: not a key of"),
    # Hydra's other composition errors, as one line
    (["algo=fedprox", "+algo.mu=3"], "fedbench: Could not append to config"),
    (["split.alpha=[1"], "fedbench: no viable alternative at input"),
]


@pytest.mark.quick
@pytest.mark.parametrize("argv,start", UNKNOWN, ids=[" ".join(c[0]) for c in UNKNOWN])
def test_unknown_key_is_one_line(argv, start):
    algo = next((a.split("=")[1] for a in argv if a.startswith("algo=")), "fedavg")
    if argv[-1].startswith("+"):
        _needs_params(algo)
    msg = cli.refusal(argv)
    assert msg is not None and msg.startswith(start), msg
    assert "\n" not in msg


# typed hyperparameters and run settings where they are read (issue 21) ---------------------
def _algorithm_modules() -> list[Path]:
    return sorted((REPO / "fedbench" / "algorithms").glob("*.py"))


@pytest.mark.quick
@pytest.mark.parametrize("path", _algorithm_modules(), ids=lambda p: p.name)
def test_algorithms_read_no_config_after_construction(path):
    """An algorithm reads `self.hp` (its Params) and `self.run` (RunSettings), never the
    config: no `self.cfg` / `algo.cfg` and no `cfg.<key>` outside base.py's construction."""
    import ast

    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    if path.name == "base.py":  # Algorithm.__init__ and RunSettings.from_cfg build from cfg
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("__init__", "from_cfg"):
                allowed |= {id(n) for n in ast.walk(node)}
    bad = [
        f"{path.name}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and id(node) not in allowed
        and (node.attr == "cfg" or (isinstance(node.value, ast.Name) and node.value.id == "cfg"))
    ]
    assert not bad, bad


@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_hp_is_the_params_instance(name):
    from conftest import make_algo
    from fedbench.algorithms.base import RunSettings
    from fedbench.engine import OptimConfig

    try:
        algo, _, _ = make_algo(name)
    except Exception as e:  # noqa: BLE001 - an algorithm that needs another model/data
        pytest.skip(f"{name} not buildable on TinyFed: {e}")
    cls = ALGORITHMS.get(name)
    assert type(algo.hp) is cls.Params
    assert isinstance(algo.run, RunSettings) and isinstance(algo.run.optimizer, OptimConfig)
    assert algo.optim is algo.run.optimizer
    assert not hasattr(algo, "cfg")


@pytest.mark.quick
def test_hp_casts_per_annotation():
    """An int written for a float field is a float in `hp` (arithmetic as `float(...)` did);
    nested groups are their dataclasses; ints and strings keep their types."""
    from conftest import make_algo
    from fedbench.algorithms.pfedhn import HypernetParams

    algo, _, _ = make_algo("fedprox", ["algo.mu=1"])
    assert type(algo.hp.mu) is float and algo.hp.mu == 1.0
    assert isinstance(algo.hp.weighting, str)
    algo, _, _ = make_algo("pfedhn", ["algo.inner_steps=2", "algo.hypernet.max_params=100000000"])
    assert isinstance(algo.hp.hypernet, HypernetParams)
    assert type(algo.hp.hypernet.max_params) is float
    assert type(algo.hp.inner_steps) is int and algo.hp.inner_steps == 2
    assert algo.run.local_epochs == 1 and algo.run.batch_size == 8


@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_attack_reaches_the_algorithm_through_its_context(name):
    """The runner hands the attack over in the algorithm's RunContext and sets no attribute
    on the algorithm afterwards; an algorithm whose uploads bypass `receive` refuses it."""
    import ast

    from conftest import TinyFed, compose
    from fedbench.attack import Attack
    from fedbench.engine import Engine
    from fedbench.models import build_model

    fed = TinyFed()
    cfg = compose([f"algo={name}", "batch_size=8"])
    model_fn = lambda: build_model("mlp", fed.input_shape, fed.num_classes, hidden=[8])  # noqa: E731
    attack = Attack("a2", 0.34, fed.num_clients, 0)
    cls = ALGORITHMS.get(name)
    engine = Engine(fed, model_fn(), device="cpu")
    if not cls.attackable:
        with pytest.raises(ConfigError, match=f"algo={name} does not route its uploads"):
            cls.from_config(load_config(cfg), fed, engine, model_fn, attack=attack)
        return
    try:
        algo = cls.from_config(load_config(cfg), fed, engine, model_fn, attack=attack)
    except Exception as e:  # noqa: BLE001 - an algorithm that needs another model/data
        pytest.skip(f"{name} not buildable on TinyFed: {e}")
    assert algo.attack is attack and algo.ctx.attack is attack
    files = [REPO / "fedbench" / "runner.py", *sorted((REPO / "fedbench" / "run").glob("*.py"))]
    set_attrs = [
        ast.unparse(t)
        for f in files
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Attribute)
        and isinstance(t.value, ast.Attribute)
        and t.value.attr == "algo"
    ]
    assert not set_attrs, set_attrs


@pytest.mark.quick
def test_algorithms_build_in_setup_not_init():
    """`Algorithm(ctx, hp)` is the one constructor: every registered algorithm builds its
    state in `setup()` (none overrides `__init__`, so none can skip the capability check)."""
    from fedbench.algorithms.base import Algorithm

    own_init = [
        n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__init__ is not Algorithm.__init__
    ]
    assert not own_init, own_init


@pytest.mark.quick
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo=local", "attack.kind=a2", "attack.fraction=0.2"], "algo=local does not route"),
        (["algo=apple", "server_opt=adam"], "server_opt=adam: algo=apple's server"),
    ],
)
def test_capabilities_are_checked_with_the_config(overrides, message):
    """What an algorithm needs of the run is checked by `load_config` (one line, before a
    run directory exists), through the same `check_needs` the constructor runs."""
    from conftest import compose

    with pytest.raises(ConfigError, match=message):
        load_config(compose(overrides))
    # a model registered as a builder function (ResNet-8) is checked once built, not refused
    load_config(compose(["algo=fedrep", "model=resnet8", "data=cifar10"]))


@pytest.mark.quick
@pytest.mark.parametrize(
    ("name", "extra"), [("fedrep", []), ("fedpac", []), ("ifca", ["algo.weight_sharing=true"])]
)
def test_a_head_split_is_checked_on_the_built_model(name, extra):
    """A model without a body/head split (a plain nn.Sequential, as a user's own model
    factory could give) stops an algorithm that needs one with one line; IFCA needs one
    only with weight sharing (`needs(hp)`)."""
    from torch import nn

    from conftest import TinyFed, compose
    from fedbench.engine import Engine

    fed = TinyFed()
    model_fn = lambda: nn.Sequential(nn.Flatten(), nn.Linear(6, fed.num_classes))  # noqa: E731
    rc = load_config(compose([f"algo={name}", "batch_size=8", *extra]))
    cls = ALGORITHMS.get(name)
    with pytest.raises(ConfigError, match=f"algo={name} needs a model with a body/head split"):
        cls.from_config(rc, fed, Engine(fed, model_fn(), device="cpu"), model_fn)
    if name == "ifca":
        rc = load_config(compose([f"algo={name}", "batch_size=8"]))
        assert not cls.needs(rc.algo.params).head
        cls.from_config(rc, fed, Engine(fed, model_fn(), device="cpu"), model_fn)
