"""Shared fixtures: a tiny in-memory federation for engine/algorithm unit tests."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import torch

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# Where the tests that train through make_algo / run_small compute: cpu unless
# FEDBENCH_TEST_DEVICE says otherwise (scripts/gpu_check.sh sets cuda on a GPU machine).
TEST_DEVICE = os.environ.get("FEDBENCH_TEST_DEVICE", "cpu")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core: torch's own threads (and those of the fedbench
    # processes a test starts, which inherit the environment) would oversubscribe them
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


class TinyFed:
    """The slice of `Federation` the engine uses, over random data (no files)."""

    def __init__(self, n_clients: int = 3, sizes=(37, 20, 50), dim: int = 6, classes: int = 3):
        g = torch.Generator().manual_seed(0)
        total = sum(sizes) + 10 * n_clients
        self.x = torch.randn(total, dim, generator=g)
        self.y = torch.randint(0, classes, (total,), generator=g)
        self.num_clients = n_clients
        self.num_classes = classes
        self.input_shape = (dim,)
        starts = torch.tensor([0, *sizes]).cumsum(0)
        self.train_idx = [
            torch.arange(int(starts[i]), int(starts[i + 1])) for i in range(n_clients)
        ]
        base = int(starts[-1])
        self.test_idx = [torch.arange(base + 10 * i, base + 10 * (i + 1)) for i in range(n_clients)]
        self.s_idx = self.g_idx = None
        self.train_sizes = torch.tensor([float(s) for s in sizes])

    def batch(self, idx, train=True):
        return self.x[idx], self.y[idx]

    def to(self, device) -> TinyFed:
        """Moves the data and index tensors to `device` (in place, as `Federation` holds
        them there; train_sizes stays on the CPU, as there); returns self."""
        self.x, self.y = self.x.to(device), self.y.to(device)
        self.train_idx = [i.to(device) for i in self.train_idx]
        self.test_idx = [i.to(device) for i in self.test_idx]
        return self


@pytest.fixture
def tiny_fed():
    return TinyFed()


def fmnist_available() -> bool:
    return (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists() or bool(
        os.environ.get("FEDBENCH_DATA")
    )


def missing(module: str, extra: str) -> str | None:
    """None if `module` (an optional package's) is importable, else the reason a test that
    needs it skips: "needs <module>: pip install 'fedbench[<extra>]'", the extra that brings
    it. .ci/run installs the extras and runs again the tests that skipped with this reason."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    return None if found else f"needs {module}: pip install 'fedbench[{extra}]'"


def needs(module: str, extra: str) -> ModuleType:
    """`module`, imported; the calling test skips (see `missing`) if it is not installed.
    Tests get a package that the README's set-up does not install only this way, never by an
    import statement (tests/test_dependencies.py checks it)."""
    __tracebackhide__ = True  # the skip's location (pytest -rs) is the test's line
    reason = missing(module, extra)
    if reason:
        pytest.skip(reason)
    return importlib.import_module(module)


def compose(overrides: list[str]):
    """The CLI's composed config for these overrides (conf/ of this checkout)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fedbench.cli import CONF_DIR
    from fedbench.config import task_config

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    return task_config(cfg)


# For tests of the command line, not of the engine: a process's first vmap call imports
# torch._dynamo (about 2 s of each fedbench process's 3-5 s start); the two backends are
# compared in test_backends.py, and test_cli / test_resume run the default one end to end.
CLI_BACKEND = "engine.backend=sequential"

# A small real-FMNIST federation for "learns" tests: 20 clients, pat-2, 150 train / 100 test
# samples each, a 784-64-10 MLP; a few rounds take seconds on 2 CPU cores.
SMALL_FMNIST = [
    "data=fmnist",
    "split=pat",
    "clients=20",
    "split.train_per_client=150",
    "split.test_per_client=100",
    "model=mlp",
    "model.hidden=[64]",
    "participation=1.0",
    "batch_size=50",
    "eval.every=100",
    f"device={TEST_DEVICE}",
]


# SMALL_FMNIST with a LeNet-5 CNN (BatchNorm) in place of the MLP.
SMALL_FMNIST_BN_CNN = [
    *(o for o in SMALL_FMNIST if not o.startswith("model")),
    "model=cnn",
    "model.preset=lenet",
    "model.norm=batch",
]


def bn_mlp():
    """TinyFed's shapes with BatchNorm: 6 -> Linear 8 -> BatchNorm1d -> ReLU -> head 3."""
    from torch import nn

    from fedbench.models.base import FedModel

    return FedModel(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU()), 8, 3)


def make_algo(
    algo: str,
    extra=(),
    fed=None,
    lr: float | None = 0.1,
    backend: str = "auto",
    model_fn=None,
):
    """Algorithm `algo` on TinyFed (3 clients with 37, 20, 50 samples, 6 features, 3
    classes), an MLP 6-8-3 (or `model_fn(fed)`'s model), batch 8, 1 epoch, optimizer lr `lr`
    (None: the config's), the engine's `backend`, on TEST_DEVICE (`fed` is moved there).
    Returns (algorithm, engine, federation)."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.config import load_config
    from fedbench.engine import Engine
    from fedbench.models import build_model

    fed = (fed or TinyFed()).to(TEST_DEVICE)
    lr_override = [] if lr is None else [f"optim.lr={lr}"]
    cfg = compose([f"algo={algo}", "batch_size=8", *lr_override, *extra])
    torch.manual_seed(0)
    if model_fn is None:
        model_fn = lambda: build_model("mlp", fed.input_shape, fed.num_classes, hidden=[8])  # noqa: E731
    else:
        model_fn = partial(model_fn, fed)
    eng = Engine(fed, model_fn(), device=TEST_DEVICE, backend=backend)
    return ALGORITHMS.get(algo).from_config(load_config(cfg), fed, eng, model_fn), eng, fed


def run_small(tmp_path, overrides: list[str], rounds: int = 5, base: list[str] = SMALL_FMNIST):
    """Run on `base` (SMALL_FMNIST) + overrides in tmp_path; returns (summary, Run)."""
    from fedbench.runner import Run

    if not fmnist_available():
        pytest.skip("Fashion-MNIST files not installed (apt-get install dataset-fashion-mnist)")
    cfg = compose([*base, f"rounds={rounds}", *overrides])
    run = Run(cfg, tmp_path, progress=False)
    return run.run(), run


def crash_and_resume(
    tmp_path,
    monkeypatch,
    overrides: list[str],
    rounds: int,
    die_at: int,
    after_crash=None,
    base: list[str] = SMALL_FMNIST,
):
    """Run on `base` (SMALL_FMNIST) + overrides uninterrupted in tmp_path/full; run again in
    tmp_path/run, killed (KeyboardInterrupt) as round `die_at` starts, then resumed from its
    last checkpoint with resume=true. `after_crash(run_dir)` checks the directory in between.
    Returns (the uninterrupted summary, the resumed one)."""
    from fedbench.runner import Run

    full, _ = run_small(tmp_path / "full", overrides, rounds=rounds, base=base)
    cfg = [*base, f"rounds={rounds}", *overrides]
    crashed = Run(compose(cfg), tmp_path / "run", progress=False)
    real_round = crashed.algo.round

    def dies(t, clients):
        if t == die_at:
            raise KeyboardInterrupt  # as if killed during that round
        return real_round(t, clients)

    monkeypatch.setattr(crashed.algo, "round", dies)
    with pytest.raises(KeyboardInterrupt):
        crashed.run()
    if after_crash is not None:
        after_crash(tmp_path / "run")
    resumed = Run(compose([*cfg, "resume=true"]), tmp_path / "run", progress=False)
    return full, resumed.run()


def pytest_collection_modifyitems(config, items):
    """Every test is `quick` (a unit test, seconds) or `slow` (real data, end to end), not
    both: `pytest -m quick` and `pytest -m slow` together are the whole suite."""
    bad = [
        it.nodeid
        for it in items
        if (it.get_closest_marker("quick") is None) == (it.get_closest_marker("slow") is None)
    ]
    if bad:
        raise pytest.UsageError(
            f"{len(bad)} test(s) need exactly one of @pytest.mark.quick / @pytest.mark.slow: "
            + ", ".join(bad[:5])
        )


# $FEDBENCH_SKIPPED_TO=<file>: the session's skipped tests, one JSON line each ({"nodeid",
# "reason"}), written by the main process (with xdist, the controller sees every report).
# .ci/run runs these tests again once the extras, Chromium and SLURM are installed.
_skipped: list[dict] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        # xdist's --dist loadgroup appends "@<group>" to a grouped test's id: not part of the
        # id pytest takes back (a name has no "@"; a parameter id ends with "]")
        nodeid = re.sub(r"@[^\]]*$", "", report.nodeid)
        _skipped.append({"nodeid": nodeid, "reason": reason.removeprefix("Skipped: ")})


def pytest_sessionfinish(session):
    out = os.environ.get("FEDBENCH_SKIPPED_TO")
    # a worker has `workerinput`; the environment would not tell (a test that starts pytest
    # from inside a worker passes PYTEST_XDIST_WORKER on to that inner controller)
    if out and not hasattr(session.config, "workerinput"):
        Path(out).write_text("".join(json.dumps(s) + "\n" for s in _skipped))
