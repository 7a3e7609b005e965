"""scripts/check_algorithm.py, the one check command of CONTRIBUTING.md: which tests it
selects for an algorithm, and its one line for an unknown one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_algorithm.py"


def load():
    spec = importlib.util.spec_from_file_location("check_algorithm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.quick
def test_selects_the_algorithms_own_tests_and_its_parameters_only():
    ids = [
        "tests/test_fedavg.py::test_round",
        "tests/test_params.py::test_hp_is_the_params_instance[fedprox]",
        "tests/test_params.py::test_hp_is_the_params_instance[fedavg]",
        "tests/test_params.py::test_hp_is_the_params_instance[lg_fedavg]",
        "tests/test_params.py::test_algorithms_read_no_config_after_construction[fedavg.py]",
        "tests/test_device.py::test_a_fedavg_round_runs_whole_on_another_device[vmap]",
        "tests/test_server_opt.py::test_x[fedprox-sgd]",
        "tests/test_engine.py::test_other",
    ]
    got = load().select(ids, "fedprox", "fedavg")
    assert got == [ids[0], ids[1], ids[4], ids[6]]
    got = load().select(ids, "fedavg", "fedavg")
    assert got == [ids[0], ids[2], ids[4]]


@pytest.mark.quick
def test_an_unknown_algorithm_is_one_line():
    r = subprocess.run([sys.executable, str(SCRIPT), "fednope", "--collect"], cwd=REPO,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "unknown algorithm 'fednope'" in r.stderr
