"""Pinned results, re-checked (fedbench/pinned.py, scripts/check_pinned.sh): the comparison of
a re-run's rows with a cell's recorded ones, the round a re-run stops at, `Run.run(until=)`
stopping as a preempted run does, and the check itself on two cheap cells of results/."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import SMALL_FMNIST, compose, fmnist_available
from fedbench.pinned import Cell, compare, find_cells, load_pins, pin_of, save_pins

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def rows(**cols) -> pd.DataFrame:
    return pd.DataFrame(cols)


@pytest.mark.quick
def test_compare_equal_rows_are_exact_and_wall_time_is_ignored():
    a = rows(round=[1, 2], wall_time_s=[1.0, 2.0], **{"personal.L.avg": [0.5, 0.6]})
    b = rows(round=[1, 2], wall_time_s=[9.0, 8.0], **{"personal.L.avg": [0.5, 0.6]})
    d = compare(a, b)
    assert d.exact and d.acc == 0 and d.rel == 0 and not d.problems


@pytest.mark.quick
def test_compare_measures_accuracy_in_points_on_means_and_others_relatively():
    a = rows(
        round=[1, 2],
        train_loss=[1.0, 0.5],
        **{"personal.L.avg": [0.5, 0.6], "personal.L.min": [0.1, 0.2], "global.all": [0.3, 0.3]},
    )
    b = a.copy()
    b.loc[1, "personal.L.avg"] = 0.6025  # 0.25 points
    b.loc[0, "personal.L.min"] = 0.11  # 1 point, an extreme: not judged, reported
    b.loc[1, "train_loss"] = 0.5005  # 1e-3 relative
    d = compare(a, b)
    assert not d.exact
    assert math.isclose(d.acc, 0.25) and "personal.L.avg at round 2" in d.acc_where
    assert math.isclose(d.acc_any, 1.0)
    assert math.isclose(d.rel, 0.0005 / 0.5005) and "train_loss" in d.rel_where
    assert d.within(0.3, 1e-3) and not d.within(0.2, 1e-3) and not d.within(0.3, 1e-4)


@pytest.mark.quick
def test_compare_flags_lost_rows_columns_and_nan():
    a = rows(round=[1, 2], train_loss=[float("nan"), 1.0], bytes_up=[10, 20])
    same_nan = a.copy()
    assert compare(a, same_nan).exact  # a collapsed run's NaN loss is a value like any other
    assert compare(a, a.iloc[:1]).problems == ["no re-run row for round(s) [2]"]
    assert "columns no longer written: bytes_up" in compare(a, a.drop(columns="bytes_up")).problems
    changed = a.copy()
    changed.loc[0, "train_loss"] = 1.0
    assert not compare(a, changed).within(1.0, 1.0)


def _cell(tmp_path: Path, rounds: list[int], summary: dict | None = None) -> Cell:
    folder = tmp_path / "results" / "t" / "algo=x,seed=0"
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (folder / ".hydra" / "overrides.yaml").write_text("- algo=x\n")
    (folder / "summary.json").write_text(json.dumps(summary or {"rounds": 500}))
    rows(round=rounds, **{"personal.L.avg": [0.5] * len(rounds)}).to_csv(
        folder / "metrics.csv", index=False
    )
    return find_cells(tmp_path / "results")[0]


@pytest.mark.quick
def test_a_re_run_stops_at_the_first_recorded_evaluation_at_or_past_k(tmp_path):
    every_round = _cell(tmp_path / "a", [1, 2, 3, 4, 5])
    assert pin_of(every_round, 3, {}).until == 3
    assert list(pin_of(every_round, 3, {}).rows["round"]) == [1, 2, 3]
    every_50 = _cell(tmp_path / "b", [50, 100, 150])
    assert pin_of(every_50, 3, {}).until == 50
    assert pin_of(every_50, 60, {}).until == 100
    assert pin_of(every_50, 999, {}).until == 150  # never past the run's last row


@pytest.mark.quick
def test_exact_only_on_the_recorded_machine_and_torch(tmp_path):
    from fedbench.pinned import here

    old = _cell(tmp_path / "a", [1])
    pin = pin_of(old, 3, {})
    assert not pin.exact and pin.why_tolerance == "machine not recorded"
    same = _cell(tmp_path / "b", [1], {"rounds": 5, "provenance": here()})
    assert pin_of(same, 3, {}).exact
    assert pin_of(same, 3, {}).threads == here()["threads"]  # re-run with these
    other = _cell(tmp_path / "c", [1], {"rounds": 5, "provenance": {**here(), "torch": "0.1"}})
    assert not pin_of(other, 3, {}).exact
    no_threads = {k: v for k, v in here().items() if k != "threads"}  # fedbench <= 0.1 cells
    older = _cell(tmp_path / "d", [1], {"rounds": 5, "provenance": no_threads})
    assert pin_of(older, 3, {}).why_tolerance == "torch threads not recorded"


@pytest.mark.quick
def test_a_budget_draws_cells_whose_estimates_fit(tmp_path, capsys):
    """--budget: cells at random while their estimated re-runs fit (CI's sample); the draw
    is printed and repeats with its --seed."""
    from fedbench.pinned import estimate_s, main

    for i, wall in enumerate([10, 20, 40, 400]):
        _cell(tmp_path / "r" / f"c{i}", [1, 2, 3], {"rounds": 3, "wall_time_s": wall})
    cells = {c.name: estimate_s(pin_of(c, 3, {})) for c in find_cells(tmp_path / "r")}

    def drawn(*args):
        assert main(["--root", str(tmp_path / "r"), "--list", *args]) == 0
        out = capsys.readouterr().out
        return out, [n for n in cells if f"  {n}: " in out]

    for seed in range(5):
        out, names = drawn("--budget", "100", "--seed", str(seed))
        assert f"(--seed {seed})" in out and names
        assert sum(cells[n] for n in names) <= 100 or len(names) == 1
        assert drawn("--budget", "100", "--seed", str(seed))[1] == names
    assert len(drawn("--budget", "1e6", "--sample", "2")[1]) == 2
    # nothing fits: the cheapest cell alone
    assert drawn("--budget", "1")[1] == [min(cells, key=cells.get)]


@pytest.mark.quick
def test_a_renewed_pin_replaces_the_recorded_rows(tmp_path):
    cell = _cell(tmp_path, [1, 2, 3])
    renewed = {cell.name: {"reason": "why", "rows": [{"round": 1, "personal.L.avg": 0.7}]}}
    save_pins(cell.root, renewed)
    assert load_pins(cell.root) == renewed
    pin = pin_of(cell, 3, load_pins(cell.root))
    assert pin.renewed and pin.until == 1 and pin.rows["personal.L.avg"].tolist() == [0.7]


@pytest.mark.quick
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from fedbench.pinned import main

    assert main(["--root", str(tmp_path), str(tmp_path / "nope")]) == 2
    assert "no such cell or folder" in capsys.readouterr().err
    assert main(["--root", str(REPO / "results"), "--renew", str(REPO / "results")]) == 2
    assert "--renew needs --reason" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
def test_run_until_stops_as_a_preempted_run_and_resumes_exactly(tmp_path):
    """`Run.run(until=2)` of a 4-round run: the first two rows of the full run, a checkpoint,
    no summary.json; resumed, the full run to the bit (its schedule saw rounds=4 throughout)."""
    from fedbench.runner import Run

    base = [*SMALL_FMNIST, "rounds=4", "eval.every=1", "algo=fedavg", "participation=0.5"]
    full = Run(compose(base), tmp_path / "full", progress=False).run()
    stopped = Run(compose(base), tmp_path / "run", progress=False).run(until=2)
    assert stopped == {}
    assert not (tmp_path / "run" / "summary.json").exists()
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    clocks = ["wall_time_s", "cpu_time_s"]
    want = pd.read_csv(tmp_path / "full" / "metrics.csv").drop(columns=clocks)
    got = pd.read_csv(tmp_path / "run" / "metrics.csv").drop(columns=clocks)
    pd.testing.assert_frame_equal(got, want.iloc[:2])
    resumed = Run(compose([*base, "resume=true"]), tmp_path / "run", progress=False).run()
    assert {k: resumed[k] for k in ("final", "best")} == {k: full[k] for k in ("final", "best")}


# Two of the cheapest cells of results/ (DiversiFed Table II, FMNIST Dir 0.1: Separate and
# FedAvg), two rounds each: the CI sample (about 20 s on 2 cores).
CI_CELLS = ["diversifed/table2_fmnist/local", "diversifed/table2_fmnist/fedavg"]


@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
@pytest.mark.long
def test_check_pinned_sample_matches():
    r = subprocess.run(
        ["bash", "scripts/check_pinned.sh", "--rounds", "2", *(f"results/{c}" for c in CI_CELLS)],
        cwd=REPO,
        env={**ENV, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 match, 0 drifted" in r.stdout, r.stdout
