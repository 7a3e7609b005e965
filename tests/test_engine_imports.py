"""The engine's structure: modules import downwards only, the backends stand alone, and one
optimizer-state store serves `Engine.train` and the hand-written loops alike."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import make_algo
from fedbench.engine import Engine, OptimConfig
from fedbench.engine.plan import TrainPlan
from fedbench.engine.schedule import Schedule
from fedbench.engine.sequential import SequentialBackend
from fedbench.engine.spec import ModelSpec
from fedbench.engine.store import OptimStates

pytestmark = pytest.mark.quick

ENGINE = Path(__file__).resolve().parents[1] / "fedbench" / "engine"
PACKAGE = "fedbench.engine"


def engine_imports(path: Path) -> set[str]:
    """The engine modules `path` imports, at run time or under `if TYPE_CHECKING` (every
    import statement of the file, wherever it sits): `__init__` for the package itself."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = node.module or ""
                names = [base] if base else [a.name for a in node.names]
                found.update(n.split(".")[0] for n in names)
                continue
            mod = node.module or ""
            if mod == PACKAGE:
                # `from fedbench.engine import core` names a module; anything else the package
                found.update(
                    a.name if (ENGINE / f"{a.name}.py").exists() else "__init__" for a in node.names
                )
            elif mod.startswith(PACKAGE + "."):
                found.add(mod[len(PACKAGE) + 1 :].split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == PACKAGE:
                    found.add("__init__")
                elif a.name.startswith(PACKAGE + "."):
                    found.add(a.name[len(PACKAGE) + 1 :].split(".")[0])
    return found - {path.stem}


def import_graph() -> dict[str, set[str]]:
    return {p.stem: engine_imports(p) for p in sorted(ENGINE.glob("*.py"))}


def test_engine_import_graph_is_acyclic():
    graph = import_graph()
    assert set(graph) >= {"__init__", "core", "plan", "sequential", "vmap", "store", "memory"}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import cycle in fedbench/engine: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_only_the_package_imports_the_engine_and_the_backends_stand_alone():
    graph = import_graph()
    assert {m for m, deps in graph.items() if "core" in deps} == {"__init__"}
    assert not [m for m, deps in graph.items() if "__init__" in deps]
    for backend in ("sequential", "vmap"):
        assert not graph[backend] & {"core", "__init__", "sequential", "vmap"}


def test_the_import_parser_sees_type_checking_imports(tmp_path):
    f = tmp_path / "mod.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "from fedbench.engine.optim import step_\n"
        "if TYPE_CHECKING:\n"
        "    from fedbench.engine.core import Engine\n"
        "from fedbench.engine import OptimConfig\n"
    )
    assert engine_imports(f) == {"optim", "core", "__init__"}


def test_a_backend_runs_on_its_parts_without_an_engine(tiny_fed):
    """The sequential backend built by hand from its parts trains as `Engine.train` does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    from fedbench.engine.flat import FlatModule

    spec = ModelSpec(model)
    dev = torch.device("cpu")
    module = FlatModule(model, spec, dev)
    w0 = module.state.clone()
    backend = SequentialBackend(
        module, tiny_fed, Schedule(tiny_fed, dev), OptimStates(tiny_fed.num_clients), dev
    )
    cfg = OptimConfig(lr=0.1, momentum=0.9)
    plan = TrainPlan.build([2, 0], optim=cfg, lr=0.1, batch_size=8, epochs=1)
    got = backend.train(plan, w0.expand(2, -1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    eng = Engine(tiny_fed, model, device=dev, backend="sequential")
    want = eng.train(w0, [2, 0], optim=cfg, lr=0.1, batch_size=8, epochs=1, slot="x")
    assert torch.equal(got.states, want.states) and got.steps == want.steps


@pytest.mark.parametrize("algo,slots", [("ditto", {"personal", "main"}), ("apple", {"core"})])
def test_step_functions_keep_their_state_in_the_engine_store(algo, slots):
    """Kept optimizer state of step functions (Ditto's interleaved steps, APPLE's cores)
    lives in the engine's one store: `Engine.state_dict` carries it to a resumed run."""
    extra = ["optim.persist_state=true", "optim.momentum=0.9"]
    if algo == "ditto":
        extra.append("algo.interleave=true")
    clients = np.array([0, 2])
    alg, eng, _ = make_algo(algo, extra)
    alg.round(0, clients)
    kept = eng.state_dict()["persist"]
    assert set(kept) == slots and "opt" not in alg.state_dict()
    for d in kept.values():
        assert d["buf"].shape == (3, eng.n_params)
        assert d["buf"][clients].abs().sum(1).gt(0).all() and (d["buf"][1] == 0).all()
    buf = io.BytesIO()  # a checkpoint
    torch.save({"algo": alg.state_dict(), "engine": eng.state_dict()}, buf)
    runs = []
    for engine_state in (True, False):  # resumed with and without the engine's state
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=False)
        again, eng2, _ = make_algo(algo, extra)
        again.load_state_dict(ckpt["algo"])
        if engine_state:
            eng2.load_state_dict(ckpt["engine"])
        again.round(1, clients)
        runs.append(again)
    alg.round(1, clients)
    key = "cores" if algo == "apple" else "w"
    assert torch.equal(getattr(runs[0], key), getattr(alg, key))
    assert not torch.equal(getattr(runs[1], key), getattr(alg, key))
