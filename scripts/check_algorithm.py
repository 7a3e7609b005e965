#!/usr/bin/env python3
"""Every free check of one algorithm, in one command (CONTRIBUTING.md, step 4):

    python scripts/check_algorithm.py NAME

1. its four files exist: fedbench/algorithms/<module>.py (registering NAME),
   conf/algo/<name>.yaml, conf/search/<name>.yaml, tests/test_<module>.py;
2. ruff (lint and format) on its module and test file;
3. the README's and docs/README.md's generated algorithm tables include it
   (else: `python scripts/update_docs_tables.py`), and `fedbench algo=NAME` passes every
   check a run makes before it starts (the run's schema, its Params against its YAML);
4. pytest on its own test file and on every test that covers each registered algorithm,
   selected for NAME alone: its Params against its YAML, a resume-exact state, two rounds on
   a BatchNorm model, evaluation memory, size columns, both engine backends, the meta
   device, the server optimizer where it has one, its search space; plus the checks that
   read the whole registry (search spaces, docs tables, import graph, paths).

Each failed step is one line naming what to fix; exit 1. `--collect` lists the selected
tests and runs nothing; arguments after `--` go to pytest (`-- -n 0`). The selection is a
pytest plugin (this module, `-p check_algorithm`), so the tests are collected once, by
pytest itself and by each xdist worker alike.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Files whose tests are parametrized by algorithm name: the ones for NAME are selected.
PER_ALGORITHM = [
    "tests/test_params.py",
    "tests/test_checkpoint.py",
    "tests/test_buffers.py",
    "tests/test_eval_memory.py",
    "tests/test_model_size.py",
    "tests/test_backends.py",
    "tests/test_device.py",
    "tests/test_server_opt.py",
    "tests/test_search.py",
]
# Tests that read the whole registry (a new algorithm can break them), run as they are.
WHOLE_REGISTRY = [
    "tests/test_search.py::test_every_algorithm_declares_a_search_space",
    "tests/test_tune.py::test_every_search_space_becomes_dimensions",
    "tests/test_docs_tables.py::test_registry_tables_are_current",
    "tests/test_docs_tables.py::test_every_algorithm_says_what_it_is",
    "tests/test_import_graph.py",
    "tests/test_repo_paths.py",
]


def fail(msg: str) -> int:
    print(f"check_algorithm: {msg}", file=sys.stderr)
    return 1


def param_tokens(node_id: str) -> set[str]:
    """The parameter ids of a test, split: `test_x[fedavg-vmap]` -> {"fedavg", "vmap"}."""
    m = re.search(r"\[(.*)\]$", node_id)
    if not m:
        return set()
    return set(m.group(1).split("-"))


def select(node_ids: list[str], name: str, module: str) -> list[str]:
    """NAME's tests among the collected ones: its own file's, and those whose parameters
    name it (`[NAME]`, `[NAME-vmap]`) or its module (`[<module>.py]`)."""
    own = f"tests/test_{module}.py"
    return [
        nid
        for nid in node_ids
        if nid.startswith(own + "::") or {name, f"{module}.py"} & param_tokens(nid)
    ]


ENV = "FEDBENCH_CHECK_ALGORITHM"  # "name:module" for the plugin below


def pytest_collection_modifyitems(config, items) -> None:
    """As a pytest plugin (`-p check_algorithm`, scripts/ on the path): keep NAME's tests
    and the whole-registry ones, deselect the rest, in one collection (xdist workers too)."""
    if not os.environ.get(ENV):
        return
    name, module = os.environ[ENV].split(":")
    mine = set(select([i.nodeid for i in items], name, module))
    keep = [
        i for i in items if i.nodeid in mine or any(i.nodeid.startswith(w) for w in WHOLE_REGISTRY)
    ]
    kept = {id(i) for i in keep}
    config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
    items[:] = keep


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="the algorithm's registered name (algo=NAME)")
    p.add_argument("--collect", action="store_true", help="list the selected tests only")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = p.parse_args()
    start = time.monotonic()

    sys.path.insert(0, str(REPO))
    from fedbench.algorithms import ALGORITHMS
    from fedbench.errors import ConfigError
    from fedbench.report import doctables
    from fedbench.report.collect import ReportError

    name = args.name
    try:
        cls = ALGORITHMS.get(name)
    except ConfigError as e:
        return fail(str(e))
    module = cls.__module__.rsplit(".", 1)[1]
    files = [
        f"fedbench/algorithms/{module}.py",
        f"conf/algo/{name}.yaml",
        f"conf/search/{name}.yaml",
        f"tests/test_{module}.py",
    ]
    missing = [f for f in files if not (REPO / f).is_file()]
    if missing:
        return fail("missing: " + ", ".join(missing) + " (CONTRIBUTING.md, Adding an algorithm)")

    if not args.collect:
        code = [f for f in files if f.endswith(".py")]
        for cmd in (["ruff", "check", *code], ["ruff", "format", "--check", *code]):
            if subprocess.run([sys.executable, "-m", *cmd], cwd=REPO).returncode != 0:
                return fail(f"{' '.join(cmd)} failed (`ruff format {' '.join(code)}` formats)")
        try:
            stale = doctables.stale(doctables.docs_files(REPO), REPO, tool=doctables.REGISTRY)
        except ReportError as e:
            return fail(str(e))
        if stale:
            where = ", ".join(f"{b.path.relative_to(REPO)}:{b.line}" for b, _ in stale)
            return fail(
                f"generated tables are stale ({where}): python scripts/update_docs_tables.py"
            )

    paths = [*PER_ALGORITHM, files[3], *WHOLE_REGISTRY]
    env = {**os.environ, ENV: f"{name}:{module}"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "scripts"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # the `long` ones too: here they are this algorithm's own runs (its BatchNorm and
    # kill-and-resume runs), which the README's command leaves to CI's second half
    marks = [] if "-m" in args.pytest_args else ["-m", "quick or slow"]
    mode = ["--collect-only", "-q", "-n", "0"] if args.collect else ["-q", *args.pytest_args]
    mode = [*marks, *mode]
    print(f"check_algorithm: {name}: its tests and the per-algorithm ones", flush=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "check_algorithm", *mode, *paths]
    code = subprocess.run(cmd, cwd=REPO, env=env).returncode
    if args.collect:
        return code
    took = time.monotonic() - start
    if code != 0:
        return fail(f"{name}: tests failed ({took:.0f} s)")
    print(f"check_algorithm: {name}: every check passed in {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
