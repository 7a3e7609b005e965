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

Each failed step is one line naming what to fix; exit 1. `--collect` prints the selected
tests and runs nothing; arguments after `--` go to pytest (`-- -n 0`).
"""

from __future__ import annotations

import argparse
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


def collect(paths: list[str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    if out.returncode != 0 or not ids:
        tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
        raise SystemExit(fail("pytest could not collect the tests:\n" + "\n".join(tail)))
    return ids


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

    selected = select(collect([*PER_ALGORITHM, files[3]]), name, module)
    selected += WHOLE_REGISTRY
    if args.collect:
        print("\n".join(selected))
        return 0
    print(f"check_algorithm: {name}: {len(selected)} tests or files", flush=True)
    code = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *args.pytest_args, *selected], cwd=REPO
    ).returncode
    took = time.monotonic() - start
    if code != 0:
        return fail(f"{name}: tests failed ({took:.0f} s)")
    print(f"check_algorithm: {name}: every check passed in {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
