"""fedbench-report on pandas: cells (groupby), formats (to_string, to_latex, to_csv),
columns that do not split by a key following the rows, and the plots' fixes (one-point
curves, personal and global L/S/G bars). Run directories as tests/test_report.py writes
them (client i of 20 has accuracy avg + OFFSETS[i]: L.avg is the given value, S = 0.5 L,
G = 0.4 L)."""

from __future__ import annotations

import csv
import io
import math

import pytest
from test_report import run_cli, write_run

from fedbench.report import presets
from fedbench.report.collect import find_runs, selected
from fedbench.report.plots import _curves, _lsg, write_plots
from fedbench.report.table import build, render, values_of

pytestmark = pytest.mark.quick


def test_cells_mean_std_and_duplicate_seeds(tmp_path, capsys):
    """mean and sample std by hand; a seed run twice with another setting (optim.lr, not a
    row or column) counts twice (and is warned about); the same run twice counts once."""
    for name, seed, final in (("a", 0, 0.50), ("b", 1, 0.60), ("c", 2, 0.70)):
        write_run(tmp_path / name, [0.1, final], seed=seed)
    write_run(tmp_path / "d", [0.1, 0.80], seed=2, optim__lr=0.5)
    write_run(tmp_path / "e", [0.1, 0.90], seed=2)  # c again (another sweep's cell of it)
    t = build(find_runs([tmp_path]), ["algo"], [], ["personal.L.avg", "personal.L.top5"])
    cell = values_of(t, "fedavg", (), "personal.L.avg")
    assert cell.n == 4 and cell.mean == pytest.approx(0.65)
    # deviations -0.15, -0.05, 0.05, 0.15: sum of squares 0.05, / (4 - 1)
    assert cell.std == pytest.approx(math.sqrt(0.05 / 3))
    assert sorted(cell.seeds) == [0, 1, 2, 2]
    assert values_of(t, "fedavg", (), "personal.L.top5").mean == pytest.approx(0.75)
    err = capsys.readouterr().err
    assert "1 run(s) repeat a seed" in err
    assert f"{tmp_path / 'e'}: the same run as {tmp_path / 'c'}" in err and "counted once" in err
    text = render(t, "terminal")
    assert "65.00 ± 12.91" in text and "75.00 ± 12.91" in text


def test_terminal_labels_left_values_right(tmp_path, capsys):
    write_run(tmp_path / "a", [0.5], algo__name="fedavg", seed=0)
    write_run(tmp_path / "b", [0.6], algo__name="local", seed=0, data__name="cifar10")
    code, out, _ = run_cli(tmp_path, "--cols", "data", capsys=capsys)
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("algo"))
    assert header.split() == ["algo", "cifar10", "fmnist"]
    fedavg = next(line for line in lines if line.startswith("fedavg "))
    local = next(line for line in lines if line.startswith("local "))
    # value columns are right-aligned: every line of a column ends at the same place
    assert len(fedavg) == len(header) and fedavg.endswith("50.00")
    assert local.rstrip().endswith("—") and "60.00" in local
    assert lines[lines.index(header) + 1].startswith("─")


def test_preset_formats_with_the_papers_pairs(tmp_path, capsys):
    common = dict(participation=1.0, clients=20)
    for s in range(2):
        write_run(tmp_path / f"l{s}", [0.96, 0.90 + 0.02 * s], algo__name="local", seed=s,
                  **common)  # fmt: skip
    code, out, _ = run_cli(tmp_path, "--preset", "diversifed_table1", "--compact", "--format",
                           "latex", capsys=capsys)  # fmt: skip
    assert code == 0
    assert "\\begin{tabular}{lrr}" in out
    assert "method & \\multicolumn{2}{c}{FMNIST} \\\\" in out
    assert "\\cmidrule(lr){2-3}" in out and " & ours & paper \\\\" in out
    assert "Separate & 96.00 $\\pm$ 0.00 & 96.10 $\\pm$ 0.26 \\\\" in out
    code, out, _ = run_cli(tmp_path, "--preset", "diversifed_table1", "--compact", "--format",
                           "csv", capsys=capsys)  # fmt: skip
    row = next(r for r in csv.DictReader(io.StringIO(out)) if r["method"] == "Separate")
    assert (row["mean"], row["std"], row["n"], row["paper"], row["paper_std"]) == (
        "96", "0", "2", "96.10", "0.26"
    )  # fmt: skip
    code, out, _ = run_cli(tmp_path, "--preset", "diversifed_table1", "--compact", capsys=capsys)
    lines = out.splitlines()
    top = next(line for line in lines if line.startswith("method"))
    assert "FMNIST" in top and lines[lines.index(top) + 1].split() == ["ours", "paper"]
    sep = next(line for line in lines if line.startswith("Separate "))
    assert sep.split() == ["Separate", "96.00", "±", "0.00", "96.10", "±", "0.26"]


def test_lsg_metric_is_the_mean_of_l_s_g(tmp_path):
    run = find_runs([write_run(tmp_path / "a", [0.5, 0.6])])[0]
    assert selected(run, "personal.LSG", "final") == (2, pytest.approx(0.6 * 1.9 / 3))
    assert selected(run, "global.LSG", "final")[1] is None  # no global model


# --------------------------------------------------------------------------- columns
def _four_algorithms(root, lrs=(0.05,)):
    """Four algorithms whose YAMLs set algo.mode differently (as algo.weighting differs
    between fedavg's and fedrep's), two seeds, each lr of `lrs`."""
    modes = {"fedavg": "samples", "fedprox": "samples", "fedrep": "uniform", "lg": "uniform"}
    for algo, mode in modes.items():
        for lr in lrs:
            for s in range(2):
                write_run(root / f"{algo}_{lr}_{s}", [0.5 + 0.1 * s], algo__name=algo,
                          algo__mode=mode, optim__lr=lr, seed=s)  # fmt: skip


def test_columns_do_not_split_by_a_key_that_follows_the_rows(tmp_path, capsys):
    _four_algorithms(tmp_path)
    code, out, err = run_cli(tmp_path, capsys=capsys)
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("algo"))
    assert header.split() == ["algo", "personal.L.avg"]  # one column, not mode=samples/uniform
    for algo in ("fedavg", "fedprox", "fedrep", "lg"):
        line = next(line for line in out.splitlines() if line.startswith(algo + " "))
        assert line.split()[1:] == ["55.00", "±", "7.07"]
    assert "not columns (each follows from the keys named): algo.mode (algo)" in out
    code, out, _ = run_cli(tmp_path, "--keys", capsys=capsys)
    assert "algo.mode: samples, uniform" in out  # it does differ between the runs
    # asked for, it is a column
    code, out, _ = run_cli(tmp_path, "--cols", "algo.mode", capsys=capsys)
    header = next(line for line in out.splitlines() if line.startswith("algo"))
    assert header.split() == ["algo", "mode=samples", "mode=uniform"]


def test_a_key_the_sweep_varied_is_still_a_column(tmp_path, capsys):
    _four_algorithms(tmp_path, lrs=(0.01, 0.1))
    code, out, _ = run_cli(tmp_path, capsys=capsys)
    header = next(line for line in out.splitlines() if line.startswith("algo"))
    assert header.split() == ["algo", "lr=0.01", "lr=0.1"]


# --------------------------------------------------------------------------- plots
def test_curves_with_one_evaluation_are_points_on_whole_rounds(tmp_path):
    for algo in ("fedavg", "local"):
        for s in range(2):
            write_run(tmp_path / f"{algo}{s}", [0.6 + 0.1 * s], algo__name=algo, seed=s)
    t = build(find_runs([tmp_path]), ["algo"], [], ["personal.L.avg"])
    ax = _curves(t).axes[0]
    assert list(ax.get_xticks()) == [1]  # not 0.8 ... 1.2
    lo, hi = ax.get_xlim()
    assert lo <= 0 and hi >= 2
    assert len(ax.containers) == 2  # one error bar (mean ± std) per row
    xs = [c.lines[0].get_xdata()[0] for c in ax.containers]
    assert xs[0] != xs[1]  # side by side, not on top of each other


def test_curves_mark_few_evaluations(sweep_three):
    t = build(find_runs([sweep_three]), ["algo"], [], ["personal.L.avg"])
    ax = _curves(t).axes[0]
    assert list(ax.get_xticks()) == [1, 2, 3]
    assert all(line.get_marker() == "o" for line in ax.get_lines())


@pytest.fixture
def sweep_three(tmp_path):
    for s in range(2):
        write_run(tmp_path / f"f{s}", [0.5, 0.9, 0.7 + 0.04 * s], global_curve=[0.6, 0.5, 0.65],
                  algo__name="fedavg", seed=s)  # fmt: skip
        write_run(tmp_path / f"l{s}", [0.6, 0.7, 0.8], algo__name="local", seed=s)
    return tmp_path


def test_lsg_shows_the_global_model_beside_the_personal(sweep_three, tmp_path):
    t = build(find_runs([sweep_three]), ["algo"], [], ["personal.L.avg"])
    ax = _lsg(t).axes[0]
    names = [tick.get_text() for tick in ax.get_xticklabels()]
    assert names == ["fedavg\npersonal", "fedavg\nglobal", "local\npersonal"]  # local: no global
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    # fedavg's global model, last round: L 65, S 32.5, G 26
    assert {65.0, 32.5, 26.0} <= set(heights)
    # a table of the global model draws the same bars
    t = build(find_runs([sweep_three]), ["algo"], [], ["global.L.avg"])
    assert [x.get_text() for x in _lsg(t).axes[0].get_xticklabels()] == names
    paths = write_plots(t, tmp_path / "figs")
    assert [p.name for p in paths] == ["curves.png", "clients.png", "lsg.png"]


def test_presets_warn_when_cells_pool_a_grid(tmp_path, capsys):
    """FedPG's layout leaves the lr free (the best of a grid): pooling a grid is warned."""
    for lr in (0.01, 0.1):
        write_run(tmp_path / f"r{lr}", [0.5], algo__name="local", participation=0.1,
                  optim__lr=lr, attack__kind="none")  # fmt: skip
    table, _ = presets.get("fedpg_table1").build(find_runs([tmp_path]))
    err = capsys.readouterr().err
    assert "cells pool runs that differ in optim.lr (0.01, 0.1)" in err
    assert "--best-of optim.lr" in err and "--rows" not in err
    assert values_of(table, "Local", "FMNIST", "L").n == 2
