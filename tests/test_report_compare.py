"""fedbench-report --best-of (the best value of a grid per cell, FedPG's "best lr per
method") and --reference (differences from a row, paired by seed, with a 95% interval).
Run directories as tests/test_report.py writes them: L.avg is the curve's value, S = 0.5 L
and G = 0.4 L, so (L + S + G) / 3 = 1.9 L / 3."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest
from test_report import run_cli, write_run

from fedbench.report import compare
from fedbench.report.collect import find_runs
from fedbench.report.compare import BestOf, compare_to, paired_interval
from fedbench.report.table import build, render, values_of

pytestmark = pytest.mark.quick

T_975 = {2: 4.302652729911275, 3: 3.182446305284263}  # Student t quantiles (tables)


@pytest.fixture
def grid(tmp_path):
    """fedavg: lr 0.01 final L 0.50/0.60, lr 0.1 0.70/0.80 (best), lr 1.0 failed;
    local: lr 0.01 0.90/0.94 (best), lr 0.1 0.60/0.62; seeds 0 and 1."""
    finals = {
        ("fedavg", 0.01): (0.50, 0.60),
        ("fedavg", 0.1): (0.70, 0.80),
        ("local", 0.01): (0.90, 0.94),
        ("local", 0.1): (0.60, 0.62),
    }
    for (algo, lr), values in finals.items():
        for s, v in enumerate(values):
            write_run(tmp_path / f"{algo}_lr{lr}_{s}", [0.3, v], algo__name=algo, seed=s,
                      optim__lr=lr)  # fmt: skip
    write_run(tmp_path / "fedavg_lr1.0_0", [0.1], failed=True, algo__name="fedavg", optim__lr=1.0)
    return tmp_path


def test_best_of_picks_the_grid_value_per_row(grid, capsys):
    runs = find_runs([grid])
    t = build(runs, ["algo"], [], ["personal.L.avg"], best_of=BestOf("optim.lr"))
    fedavg = values_of(t, "fedavg", (), "personal.L.avg")
    assert fedavg.n == 2 and fedavg.failed == 0  # lr 0.1's runs only, the failed lr 1.0 out
    assert fedavg.mean == pytest.approx(0.75) and fedavg.std == pytest.approx(math.sqrt(0.005))
    local = values_of(t, "local", (), "personal.L.avg")
    assert local.mean == pytest.approx(0.92) and local.std == pytest.approx(math.sqrt(0.0008))
    text = render(t, "terminal")
    assert "75.00 ± 7.07 (lr=0.1)" in text and "92.00 ± 2.83 (lr=0.01)" in text
    assert "lr=V: the optim.lr chosen per cell from {0.01, 0.1, 1}" in text
    assert "highest mean over seeds of personal.LSG" in text
    # every value's score: (L + S + G) / 3 = 1.9 L / 3, mean over seeds, in %
    assert "fedavg: 0.01: 34.83; 0.1: 47.50*; 1: - (n=0, 1 failed)" in text
    assert "local: 0.01: 58.27*; 0.1: 38.63" in text
    assert "differ in optim.lr" not in capsys.readouterr().err  # nothing pooled
    rows = {r["algo"]: r for r in csv.DictReader(io.StringIO(render(t, "csv")))}
    assert rows["fedavg"]["optim.lr"] == "0.1" and rows["local"]["optim.lr"] == "0.01"
    assert float(rows["fedavg"]["best_by"]) == pytest.approx(47.5)


def test_best_of_per_column_and_by_another_metric(grid, tmp_path, capsys):
    # a second column (cifar10) whose best lr for fedavg is 0.01
    for s, (a, b) in enumerate(((0.8, 0.2), (0.9, 0.3))):
        write_run(grid / f"c_fedavg_0.01_{s}", [a], algo__name="fedavg", seed=s, optim__lr=0.01,
                  data__name="cifar10")  # fmt: skip
        write_run(grid / f"c_fedavg_0.1_{s}", [b], algo__name="fedavg", seed=s, optim__lr=0.1,
                  data__name="cifar10")  # fmt: skip
    code, out, err = run_cli(grid, "--best-of", "optim.lr", "--format", "csv", capsys=capsys)
    assert code == 0, err
    rows = {(r["algo"], r["data"]): r for r in csv.DictReader(io.StringIO(out))}
    assert rows[("fedavg", "fmnist")]["optim.lr"] == "0.1"
    assert rows[("fedavg", "cifar10")]["optim.lr"] == "0.01"
    assert float(rows[("fedavg", "cifar10")]["mean"]) == pytest.approx(85.0)
    # lowest is best for a loss: train_loss = 1 / rounds; the cifar10 runs ran 1 round
    code, out, _ = run_cli(grid, "--best-of", "optim.lr", "--best-by", "train_loss",
                           "--filter", "data=fmnist", capsys=capsys)  # fmt: skip
    assert code == 0 and "lowest mean over seeds of train_loss" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--best-by", "personal.L.avg"], "--best-by goes with --best-of KEY"),
        (["--best-of", "optim.learning_rate"], "unknown key 'optim.learning_rate'"),
        (["--best-of", "optim.lr", "--best-by", "personal.X"], "unknown metric 'personal.X'"),
        (["--best-of", "optim.lr", "--cols", "optim.lr"], "drop it from --cols"),
        (["--reference", "fedsgd"], "--reference 'fedsgd': not one row of the table; rows: "),
    ],
)
def test_bad_options_are_one_line_and_exit_2(grid, capsys, args, words):
    code, out, err = run_cli(grid, *args, capsys=capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and words in err


def _fedpg_runs(root, column: dict, finals: dict) -> None:
    for (algo, lr), values in finals.items():
        for s, v in enumerate(values):
            name = f"{column.get('data__name', 'fmnist')}_{algo}_{lr}_{s}"
            write_run(root / name, [0.3, v], global_curve=[0.2, v - 0.1], algo__name=algo,
                      seed=s, optim__lr=lr, participation=0.1, attack__kind="none",
                      **column)  # fmt: skip


def test_best_of_with_a_preset(tmp_path, capsys):
    """FedPG Table 1: the best lr per method and column, noted in the cell."""
    _fedpg_runs(
        tmp_path,
        {},
        {
            ("fedavg", 0.01): (0.6, 0.7),
            ("fedavg", 0.05): (0.8, 0.9),
            ("fedpg", 0.01): (0.9, 0.9),
            ("fedpg", 0.05): (0.7, 0.7),
        },
    )
    _fedpg_runs(tmp_path, {"data__name": "cifar10", "model__name": "cnn"},
                {("fedavg", 0.01): (0.5, 0.5), ("fedavg", 0.05): (0.2, 0.2)})  # fmt: skip
    code, out, err = run_cli(tmp_path, "--preset", "fedpg_table1", "--best-of", "optim.lr",
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    fedavg = next(line for line in lines if line.startswith("FedAvg "))
    assert fedavg.split()[:12] == ["FedAvg", "L", "85.00", "±", "7.07", "(lr=0.05)", ".989", "±",
                                   ".019", "50.00", "±", "0.00"]  # fmt: skip
    assert "(lr=0.01)" in fedavg  # CIFAR-10's best lr
    fedpg = next(line for line in lines if line.split()[:2] == ["FedPG", "L"])
    assert "90.00 ± 0.00 (lr=0.01)" in fedpg
    s_line = lines[lines.index(fedavg) + 1]  # the note is on the cell's first stat only
    assert s_line.split()[:4] == ["S", "42.50", "±", "3.54"] and "lr=" not in s_line
    assert "differ in optim.lr" not in err
    code, out, _ = run_cli(tmp_path, "--preset", "fedpg_table1", "--best-of", "optim.lr",
                           "--format", "csv", capsys=capsys)  # fmt: skip
    rows = [r for r in csv.DictReader(io.StringIO(out)) if r["method"] == "FedAvg"]
    assert {(r["column"], r["optim.lr"]) for r in rows if r["status"] == "ok"} == {
        ("FMNIST", "0.05"),
        ("CIFAR-10", "0.01"),
    }
    gm = next(r for r in rows if r["column"] == "FMNIST" and r["stat"] == "GM")
    assert float(gm["mean"]) == pytest.approx(75.0)  # the global model of lr 0.05's runs


# --------------------------------------------------------------------------- paired tests
def test_paired_t_interval_by_hand():
    d = [0.10, 0.12, 0.11, 0.13]  # mean 0.115, sample std sqrt(0.0005 / 3)
    iv = paired_interval(d, "t")
    half = T_975[3] * math.sqrt(0.0005 / 3) / math.sqrt(4)
    assert iv.pairs == 4 and iv.mean == pytest.approx(0.115)
    assert (iv.low, iv.high) == (pytest.approx(0.115 - half), pytest.approx(0.115 + half))
    assert iv.significant and iv.p < 0.05
    iv = paired_interval([0.10, 0.16, 0.07], "t")
    half = T_975[2] * math.sqrt(0.0021) / math.sqrt(3)
    assert (iv.low, iv.high) == (pytest.approx(0.11 - half), pytest.approx(0.11 + half))
    assert not iv.significant and iv.p > 0.05


def test_paired_bootstrap_interval_by_hand():
    # two differences: resampled means 0, 0.5, 1 with probability 1/4, 1/2, 1/4, so the
    # 2.5th and 97.5th percentiles are the two differences themselves
    iv = paired_interval([0.0, 1.0], "bootstrap")
    assert (iv.low, iv.high, iv.significant, iv.p) == (0.0, 1.0, False, None)
    iv = paired_interval([1.0, 2.0], "bootstrap")
    assert (iv.mean, iv.low, iv.high, iv.significant) == (1.5, 1.0, 2.0, True)
    # fixed seed: the same interval every time; equal differences: that value
    d = np.array([0.3, -0.1, 0.5, 0.2, 0.4])
    assert paired_interval(d, "bootstrap") == paired_interval(d, "bootstrap")
    iv = paired_interval(d, "bootstrap")
    assert iv.low < d.mean() < iv.high and d.min() <= iv.low and iv.high <= d.max()
    iv = paired_interval([0.2, 0.2, 0.2], "bootstrap")
    assert (iv.mean, iv.low, iv.high) == (pytest.approx(0.2),) * 3 and iv.significant
    assert paired_interval([0.2], "bootstrap").low is None


@pytest.fixture
def pairs(tmp_path):
    """fedavg seeds 0-3: L 0.60, 0.70, 0.65, 0.75; ditto +0.10, +0.12, +0.11, +0.13;
    local seeds 0-2 with -0.05, +0.02, ... (seed 3 missing); apfl seed 7 only (no pair);
    pfedme seeds 3 and 9 (one pair)."""
    base = {0: 0.60, 1: 0.70, 2: 0.65, 3: 0.75}
    rows = {
        "fedavg": {s: v for s, v in base.items()},
        "ditto": {s: base[s] + d for s, d in zip(range(4), (0.10, 0.12, 0.11, 0.13))},
        "local": {0: 0.65, 1: 0.86, 2: 0.72},  # +0.05, +0.16, +0.07: not significant
        "apfl": {7: 0.9},
        "pfedme": {3: 0.80, 9: 0.1},
    }
    for algo, values in rows.items():
        for s, v in values.items():
            write_run(tmp_path / f"{algo}{s}", [v], algo__name=algo, seed=s)
    return tmp_path


def test_reference_marks_significant_differences(pairs, capsys):
    code, out, err = run_cli(pairs, "--reference", "fedavg", capsys=capsys)
    assert code == 0, err
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln[:1].isalpha()}
    # ditto - fedavg: 0.10, 0.12, 0.11, 0.13 -> 11.50 [9.45, 13.55], significant
    assert line["ditto"].endswith("+11.50 [9.45, 13.55]*")
    # local - fedavg on seeds 0-2: 0.05, 0.16, 0.07; t interval 9.33 ± 4.30 * 5.86 / sqrt 3
    half = T_975[2] * np.std([5, 16, 7], ddof=1) / math.sqrt(3)
    assert line["local"].endswith(f"+9.33 [{9.333333 - half:.2f}, {9.333333 + half:.2f}]")
    assert "(no seed paired with the reference)" in line["apfl"]
    assert "+5.00 (1 paired seed: no test)" in line["pfedme"]
    assert "[" not in line["fedavg"]  # the reference itself
    assert "the difference from fedavg" in out and "paired t-test" in out
    code, out, _ = run_cli(pairs, "--reference", "fedavg", "--format", "csv", capsys=capsys)
    rows = {r["algo"]: r for r in csv.DictReader(io.StringIO(out))}
    ditto = rows["ditto"]
    assert float(ditto["diff"]) == pytest.approx(11.5) and ditto["pairs"] == "4"
    assert ditto["significant"] == "True" and float(ditto["p"]) < 0.05
    assert rows["local"]["significant"] == "False" and rows["pfedme"]["pairs"] == "1"
    assert rows["fedavg"]["diff"] == ""


def test_reference_without_scipy_is_a_paired_bootstrap(pairs, capsys, monkeypatch):
    monkeypatch.setattr(compare, "default_method", lambda: "bootstrap")
    code, out, _ = run_cli(pairs, "--reference", "FedAvg", capsys=capsys)  # any case
    assert code == 0
    ditto = next(ln for ln in out.splitlines() if ln.startswith("ditto"))
    iv = paired_interval([0.10, 0.12, 0.11, 0.13], "bootstrap")
    assert ditto.endswith(f"+11.50 [{iv.low * 100:.2f}, {iv.high * 100:.2f}]*")
    assert "paired bootstrap over seeds: percentiles of 10,000 resampled means, seed 0" in out


def test_reference_pairs_within_the_column_and_stat(pairs):
    for algo, s, v in (("fedavg", 0, 0.2), ("ditto", 0, 0.9), ("ditto", 1, 0.95)):
        write_run(pairs / f"c{algo}{s}", [v], algo__name=algo, seed=s, data__name="cifar10")
    t = build(find_runs([pairs]), ["algo"], ["data"], ["personal.L.avg", "personal.L.top5"])
    compare_to(t, "fedavg", method="t")
    assert t.cell_suffix[(("ditto",), ("cifar10",), "personal.L.avg")] == (
        "+70.00 (1 paired seed: no test)"
    )
    # top5 = avg + 0.1 for every run: the same differences
    assert t.cell_suffix[(("ditto",), ("fmnist",), "personal.L.top5")] == "+11.50 [9.45, 13.55]*"
    assert values_of(t, "ditto", "fmnist", "personal.L.avg").n == 4
