"""fedbench-report: run discovery, seed aggregation, selection, formats, presets, plots.

Run directories are written here in the exact shape the runner writes (.hydra/config.yaml,
overrides.yaml, summary.json, metrics.csv, clients.csv), with per-client accuracies chosen
so that every summary is known by hand: client i of N has accuracy avg + OFFSETS[i], the
offsets symmetric around 0, so L.avg is exactly the given value and top5/bottom5 (one
client of 20) are avg ± 0.1.
"""

from __future__ import annotations

import copy
import csv
import errno
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import CLI_BACKEND, fmnist_available, needs
from fedbench.report import paper_numbers, presets
from fedbench.report.cli import main, truncated
from fedbench.report.collect import find_runs, selected
from fedbench.report.plots import write_plots
from fedbench.report.table import build, render, values_of

N = 20
OFFSETS = np.linspace(-0.1, 0.1, N)
STATS = ("avg", "weighted", "std", "top5", "bottom5", "min", "max")

# .hydra/config.yaml of `fedbench rounds=3` (conf/config.yaml as composed by Hydra)
BASE_CONFIG = {
    "data": {"name": "fmnist", "root": "${oc.env:FEDBENCH_DATA,'~/.cache/fedbench'}",
             "download": True, "augment": False},
    "split": {"name": "pat", "classes_per_client": 2, "balance": True, "train_per_client": None,
              "test_mode": "matched", "test_per_client": None, "train_frac": 0.75},
    "model": {"name": "mlp", "hidden": [200, 200]},
    "algo": {"name": "fedavg", "weighting": "samples"},
    "seed": 0, "device": "auto", "rounds": 3, "clients": N, "participation": 0.5,
    "local_epochs": 1, "batch_size": 50,
    "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0,
              "nesterov": False, "betas": [0.9, 0.999], "eps": 1e-08, "lr_decay": 1.0,
              "persist_state": False},
    "eval": {"every": 1, "tail": 0.05, "s_frac": 0.5, "batch_size": 2048},
    "engine": {"backend": "auto", "drop_last": False},
}  # fmt: skip


def summarize(acc: np.ndarray) -> dict:
    """As fedbench.evaluation.summarize (tail 0.05: one client of 20)."""
    s = np.sort(acc)
    return {
        "avg": float(acc.mean()),
        "weighted": float(acc.mean()),
        "std": float(acc.std()),
        "top5": float(s[-1]),
        "bottom5": float(s[0]),
        "min": float(s[0]),
        "max": float(s[-1]),
    }


def write_run(
    path: Path,
    curve: list[float],
    *,
    global_curve: list[float] | None = None,
    failed: bool = False,
    **overrides,
) -> Path:
    """A run directory: `curve` = personal L.avg per evaluation round (rounds 1, 2, ...);
    S and G are 0.5 and 0.4 of L; a global model when `global_curve` is given.
    `overrides`: dotted config keys with __ for the dots (split__alpha=0.1)."""
    cfg = copy.deepcopy(BASE_CONFIG)
    cfg["rounds"] = len(curve)
    for key, value in overrides.items():
        *parents, leaf = key.split("__")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if cfg["algo"]["name"] != "fedavg":
        cfg["algo"].pop("weighting", None)
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    over = [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(over))
    if failed:
        return path
    metric_rows, client_rows, evals = [], [], []
    for t, avg in enumerate(curve, start=1):
        kinds = {"personal": avg}
        if global_curve is not None:
            kinds["global"] = global_curve[t - 1]
        summ, row = {}, {"round": t, "wall_time_s": 0.5 * t, "train_loss": 1.0 / t}
        row.update(bytes_up=1000 * t, bytes_down=1000 * t)
        for kind, a in kinds.items():
            summ[kind] = {}
            for s, factor in (("L", 1.0), ("S", 0.5), ("G", 0.4)):
                acc = (a + OFFSETS) * factor
                summ[kind][s] = summarize(acc)
                row.update({f"{kind}.{s}.{k}": v for k, v in summ[kind][s].items()})
                client_rows += [(t, i, kind, s, float(x)) for i, x in enumerate(acc)]
        if global_curve is not None:
            summ["global"]["all"] = row["global.all"] = global_curve[t - 1]
        else:
            summ["global"] = None
        metric_rows.append(row)
        evals.append({"round": t, **summ})
    best = max(evals, key=lambda e: e["personal"]["L"]["avg"])
    summary = {
        "algo": cfg["algo"]["name"], "data": cfg["data"]["name"],
        "split": cfg["split"]["name"], "model": cfg["model"]["name"], "seed": cfg["seed"],
        "rounds": cfg["rounds"], "clients": cfg["clients"],
        "participation": float(cfg["participation"]), "wall_time_s": 1.0, "device": "cpu",
        "version": "0.1.0", "final": evals[-1], "best": best,
    }  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary, indent=2))
    pd.DataFrame(metric_rows).to_csv(path / "metrics.csv", index=False)
    pd.DataFrame(client_rows, columns=["round", "client", "model", "metric", "value"]).to_csv(
        path / "clients.csv", index=False
    )
    return path


def write_sweep(root: Path, jobs: list[dict]) -> Path:
    """A Hydra multirun directory: multirun.yaml and job dirs NUM_key=value,... ; each job
    is write_run's keyword arguments with its `curve`."""
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    for num, job in enumerate(jobs):
        over = {k: v for k, v in job.items() if k not in ("curve", "global_curve", "failed")}
        name = f"{num}_" + ",".join(f"{k.replace('__', '.')}={v}" for k, v in over.items())
        write_run(root / name, **job)
    return root


@pytest.fixture
def sweep(tmp_path):
    """multirun/12-00-00: fedavg and local, seeds 0-2, on fmnist pat (fedavg seed 0 with a
    global model whose best round, 3, is not the personal model's, 2) and a fedprox run
    that failed; multirun/13-00-00: fedavg on cifar10, eleven seeds."""
    jobs = [
        dict(curve=[0.5, 0.9, 0.70], global_curve=[0.6, 0.5, 0.65], algo__name="fedavg", seed=0),
        dict(curve=[0.5, 0.9, 0.74], algo__name="fedavg", seed=1),
        dict(curve=[0.5, 0.9, 0.78], algo__name="fedavg", seed=2),
        *(dict(curve=[0.6, 0.7, f], algo__name="local", seed=s)
          for s, f in enumerate((0.80, 0.90, 0.85))),
        dict(curve=[0.5, 0.5, 0.5], failed=True, algo__name="fedprox", seed=0),
    ]  # fmt: skip
    write_sweep(tmp_path / "multirun" / "12-00-00", jobs)
    jobs = [dict(curve=[0.1, 0.2, 0.3 + 0.01 * s], algo__name="fedavg", data__name="cifar10",
                 seed=s) for s in range(11)]  # fmt: skip
    write_sweep(tmp_path / "multirun" / "13-00-00", jobs)
    # what a SLURM sweep leaves beside the runs is never a run
    junk = tmp_path / "multirun" / "13-00-00" / ".submitit" / "123" / ".hydra"
    junk.mkdir(parents=True)
    (junk / "config.yaml").write_text("seed: 99\nrounds: 7\n")
    return tmp_path / "multirun"


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- collect
@pytest.mark.quick
def test_find_runs_multirun_failed_and_order(sweep):
    runs = find_runs([sweep])
    assert len(runs) == 6 + 1 + 11
    names = [r.path.name for r in runs]
    assert names[:7] == sorted(names[:7], key=lambda n: int(n.split("_")[0]))
    later = [int(n.split("_")[0]) for n in names[7:]]
    assert later == list(range(11))  # 2 before 10: natural order, not string order
    failed = [r for r in runs if r.failed]
    assert [r.get("algo") for r in failed] == ["fedprox"]
    r = runs[0]
    assert (r.get("algo"), r.get("data"), r.get("split"), r.get("model")) == (
        "fedavg",
        "fmnist",
        "pat",
        "mlp",
    )
    assert r.get("split.classes_per_client") == 2 and r.get("optim.lr") == 0.05
    assert r.get("per_round") == 10  # participation 0.5 of 20 clients
    # a run dir given directly, twice, is one run
    assert len(find_runs([runs[0].path, runs[0].path])) == 1


@pytest.mark.quick
def test_selection_final_best_and_best_of_the_metrics_model(sweep):
    run = next(r for r in find_runs([sweep]) if r.path.name.startswith("0_"))
    assert selected(run, "personal.L.avg", "final") == (3, pytest.approx(0.70))
    assert selected(run, "personal.L.avg", "best") == (2, pytest.approx(0.90))
    assert selected(run, "personal.L.top5", "best") == (2, pytest.approx(1.00))
    # the global model's best round is its own (round 3), not the personal model's
    assert selected(run, "global.L.avg", "best") == (3, pytest.approx(0.65))
    assert selected(run, "global.all", "final")[1] == pytest.approx(0.65)
    assert selected(run, "train_loss", "final")[1] == pytest.approx(1 / 3)
    local = next(r for r in find_runs([sweep]) if r.get("algo") == "local")
    assert selected(local, "global.L.avg", "final")[1] is None  # no global model


@pytest.mark.quick
def test_summary_json_is_the_fallback_without_metrics_csv(sweep):
    run = next(r for r in find_runs([sweep]) if r.path.name.startswith("1_"))
    (run.path / "metrics.csv").unlink()
    run = find_runs([run.path])[0]
    assert selected(run, "personal.L.avg", "final") == (3, pytest.approx(0.74))
    assert selected(run, "personal.L.bottom5", "best") == (2, pytest.approx(0.80))


# --------------------------------------------------------------------------- aggregation
@pytest.mark.quick
def test_mean_and_sample_std_over_seeds(sweep):
    runs = find_runs([sweep / "12-00-00"])
    t = build(runs, ["algo"], [], ["personal.L.avg"], select="final")
    fedavg = values_of(t, "fedavg", (), "personal.L.avg")
    assert fedavg.n == 3 and fedavg.failed == 0
    assert fedavg.mean == pytest.approx(0.74)  # (0.70 + 0.74 + 0.78) / 3
    assert fedavg.std == pytest.approx(0.04)  # sqrt((0.04^2 + 0 + 0.04^2) / (3 - 1))
    local = values_of(t, "local", (), "personal.L.avg")
    assert local.mean == pytest.approx(0.85)
    assert local.std == pytest.approx(math.sqrt((0.05**2 + 0.05**2) / 2))
    assert values_of(t, "fedprox", (), "personal.L.avg").status == "failed"
    text = render(t, "terminal")
    assert "74.00 ± 4.00" in text and "85.00 ± 5.00" in text
    assert "mean ± std over 3 seeds" in text
    best = build(runs, ["algo"], [], ["personal.L.avg"], select="best")
    assert values_of(best, "fedavg", (), "personal.L.avg").mean == pytest.approx(0.90)
    assert "90.00 ± 0.00" in render(best, "terminal")


@pytest.mark.quick
def test_cli_final_vs_best_and_stacked_metrics(sweep, capsys):
    code, out, _ = run_cli(sweep / "12-00-00", "--rows", "algo", capsys=capsys)
    assert code == 0 and "74.00 ± 4.00" in out
    code, out, _ = run_cli(sweep / "12-00-00", "--select", "best", capsys=capsys)
    assert code == 0 and "90.00 ± 0.00" in out
    code, out, _ = run_cli(
        sweep / "12-00-00",
        "--metric",
        "personal.L.avg,personal.L.bottom5",
        "--metric",
        "personal.L.top5",
        capsys=capsys,
    )
    assert code == 0
    assert "personal.L: avg, bottom5, top5" in out
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("fedavg"))
    assert "avg" in lines[i] and "74.00 ± 4.00" in lines[i]
    assert "bottom5" in lines[i + 1] and "64.00 ± 4.00" in lines[i + 1]
    assert "top5" in lines[i + 2] and "84.00 ± 4.00" in lines[i + 2]


@pytest.mark.quick
def test_upto_cuts_every_run_at_a_round(sweep, capsys):
    """--upto N: each run as if it had stopped after round N. fedavg's curves are
    0.5, 0.9, 0.70-0.78: at N = 1 the last and the best are round 1's 0.5; at N = 2 the best
    is 0.9 and the last is round 2's; a run without metrics.csv has nothing to cut and
    counts as failed, with a warning, not summary.json's whole-run numbers."""
    code, out, _ = run_cli(sweep / "12-00-00", "--upto", "1", capsys=capsys)
    assert code == 0 and "50.00 ± 0.00" in out and "up to round 1 (--upto)" in out
    code, out, _ = run_cli(sweep / "12-00-00", "--upto", "2", "--select", "last", capsys=capsys)
    assert code == 0 and "90.00 ± 0.00" in out and "74.00" not in out
    runs = [r for r in find_runs([sweep / "12-00-00"]) if not r.failed]
    assert {truncated(r, 2).get("rounds") for r in runs} == {2}  # pooled with 2-round runs
    code, out, _ = run_cli(sweep / "12-00-00", "--upto", "99", capsys=capsys)
    assert code == 0 and "74.00 ± 4.00" in out  # past the last round: the whole runs
    run = next(r for r in find_runs([sweep]) if r.path.name.startswith("1_"))
    (run.path / "metrics.csv").unlink()
    code, out, err = run_cli(sweep / "12-00-00", "--upto", "2", capsys=capsys)
    assert code == 0 and "no metrics.csv to cut at a round" in err
    assert "90.00 ± 0.00 (1 failed)" in out
    code, _, err = run_cli(sweep / "12-00-00", "--upto", "x", capsys=capsys)
    assert code == 2


@pytest.mark.quick
def test_missing_failed_and_na_cells_are_marked(sweep, capsys):
    code, out, err = run_cli(sweep, "--cols", "data", "--metric", "global.all", capsys=capsys)
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines() if line[:1].isalpha()}
    # fedavg: fmnist from seed 0 only (the others have no global model), cifar10 none
    assert "n/a" in lines["local"] and "—" in lines["local"]  # no global model; no cifar10 run
    assert "failed" in lines["fedprox"]
    assert "—" in lines["fedprox"]
    assert "6_algo.name=fedprox,seed=0" in out  # the failed run is listed under the table
    assert "(n=1)" in lines["fedavg"] or "65.00" in lines["fedavg"]


@pytest.mark.quick
def test_auto_columns_filter_and_keys(sweep, capsys):
    code, out, _ = run_cli(sweep, capsys=capsys)  # data varies -> it is the column
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("algo"))
    assert "cifar10" in header and "fmnist" in header
    code, out, _ = run_cli(sweep, "--filter", "data=cifar10", capsys=capsys)
    assert code == 0 and "fmnist" not in out and "35.00 ± 3.32" in out
    code, out, _ = run_cli(sweep, "--filter", "algo=local,fedprox", "--cols", "", capsys=capsys)
    assert code == 0 and "fedavg" not in out and "local" in out and "failed" in out
    code, out, _ = run_cli(sweep, "--keys", capsys=capsys)
    assert code == 0 and "data: cifar10, fmnist" in out and "seed: 0, 1, 2, 3" in out
    assert "rounds" not in out


@pytest.mark.quick
def test_pooling_runs_that_differ_warns(tmp_path, capsys):
    write_run(tmp_path / "a", [0.5], seed=0)
    write_run(tmp_path / "b", [0.7], seed=1, optim__lr=0.1)
    code, out, err = run_cli(tmp_path, "--cols", "", capsys=capsys)
    assert code == 0 and "60.00" in out
    assert "optim.lr (0.05, 0.1)" in err and "--filter optim.lr=VALUE" in err


# --------------------------------------------------------------------------- formats
@pytest.mark.quick
def test_formats(sweep):
    runs = find_runs([sweep])
    t = build(runs, ["algo"], ["data"], ["personal.L.avg", "personal.L.top5"])
    md = render(t, "markdown").splitlines()
    header = next(line for line in md if line.startswith("| algo"))
    assert header == "| algo | stat | cifar10 | fmnist |"
    assert md[md.index(header) + 1] == "|:---|:---|---:|---:|"
    assert "| fedavg | avg | 35.00 ± 3.32 (n=11) | 74.00 ± 4.00 |" in md
    tex = render(t, "latex")
    assert "\\begin{tabular}{llrr}" in tex and "\\toprule" in tex and "\\bottomrule" in tex
    assert "74.00 $\\pm$ 4.00" in tex and "\\end{tabular}" in tex
    rows = list(csv.DictReader(io.StringIO(render(t, "csv"))))
    cell = next(r for r in rows if r["algo"] == "fedavg" and r["data"] == "fmnist")
    assert float(cell["mean"]) == pytest.approx(74.0) and float(cell["std"]) == pytest.approx(4)
    assert cell["n"] == "3" and cell["status"] == "ok" and cell["metric"] == "personal.L.avg"
    gone = next(r for r in rows if r["algo"] == "local" and r["data"] == "cifar10")
    assert gone["status"] == "missing" and gone["mean"] == ""
    failed = next(r for r in rows if r["algo"] == "fedprox" and r["data"] == "fmnist")
    assert failed["status"] == "failed" and failed["failed"] == "1"
    frac = build(runs, ["algo"], ["data"], ["personal.L.avg"], scale=1.0, digits=3)
    assert "0.740 ± 0.040" in render(frac, "terminal")


@pytest.mark.quick
def test_latex_escapes_labels(tmp_path):
    write_run(tmp_path / "a", [0.5], algo__name="plgu_lf")
    t = build(find_runs([tmp_path]), ["algo"], [], ["personal.L.avg"])
    assert "plgu\\_lf & 50.00" in render(t, "latex")


@pytest.mark.quick
@pytest.mark.parametrize(
    "args, words",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--metric", "personal.L.mean"], "unknown metric 'personal.L.mean'"),
        (["--format", "html"], "invalid choice: 'html'"),
        (["--rows", "optim.learning_rate"], "unknown key 'optim.learning_rate'"),
        (["--filter", "seed"], "expected KEY=VALUE"),
        (["--filter", "seed=70"], "no runs left"),
        (["--preset", "plgu_table1", "--rows", "algo"], "drop --rows"),
        (["--digits", "-3"], "argument --digits: '-3' is not a number of decimals"),
        (["--digits", "1.5"], "'1.5' is not a number of decimals (a whole number from 0"),
        (["--digits", "two"], "'two' is not a number of decimals"),
        (["--digits", "16"], "'16' is not a number of decimals"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(sweep, capsys, args, words):
    code, out, err = run_cli(sweep, *args, capsys=capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err and err.startswith("fedbench-report: ")


@pytest.mark.quick
def test_no_runs_or_no_path_is_exit_2(tmp_path, capsys):
    code, _, err = run_cli(tmp_path, capsys=capsys)
    assert code == 2 and "no runs found" in err and err.count("\n") == 1
    code, _, err = run_cli(tmp_path / "absent", capsys=capsys)
    assert code == 2 and "no such file or directory" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys=capsys)
    assert code == 2 and "give at least one" in err and err.count("\n") == 1


# --------------------------------------------------------------------------- robustness
# Whatever the input or the disk does, fedbench-report ends with one line and no traceback.
REPO = Path(__file__).resolve().parents[1]


def report(*args, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """The real command (`python -m fedbench.report`, this checkout's fedbench)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "fedbench.report", *map(str, args)],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env=env,
    )


def assert_one_line_exit_2(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedbench-report: "), r.stderr
    for w in words:
        assert w in lines[0], r.stderr


@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, options): a tmpfs mounted at tmp_path/name, unmounted after the test.
    Read-only and full-disk cases need a real file system: root (the tests' user here)
    ignores permission bits, so chmod cannot make a folder unwritable. Skipped where
    mounting is not allowed."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"cannot mount a tmpfs here: {e}")
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill_up(folder: Path) -> None:
    """Write into `folder` until its file system is full."""
    chunk = b"\0" * 4096
    try:
        with open(folder / "filler", "wb") as f:
            while True:
                f.write(chunk)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e


@pytest.mark.quick
def test_bad_digits_and_plots_on_a_file_through_the_command(sweep):
    runs = sweep / "12-00-00"
    r = report(runs, "--digits", "-3")
    assert_one_line_exit_2(r, "--digits", "'-3'")
    assert r.stdout == ""
    r = report(runs, "--plots", runs / "multirun.yaml")
    assert_one_line_exit_2(r, "--plots", "exists and is not a directory")
    assert r.stdout == ""  # refused before anything is printed


@pytest.mark.quick
@pytest.mark.parametrize("sub", ["", "figs", "figs/deeper"])
def test_plots_into_a_read_only_folder_is_one_line(sweep, tmpfs, sub):
    """The folder itself, or the folder a new one would be made in, is read-only."""
    ro = tmpfs("ro", "ro,size=1m")
    r = report(sweep / "12-00-00", "--plots", ro / sub if sub else ro)
    assert_one_line_exit_2(r, "--plots", "read-only file system")
    assert r.stdout == ""  # refused before the table is printed


@pytest.mark.quick
def test_an_output_file_that_cannot_be_written_is_one_line(sweep, tmp_path):
    out = tmp_path / "report"
    (out / "table.txt").mkdir(parents=True)  # a directory where the table file goes
    r = report(sweep / "12-00-00", "--plots", out)
    assert_one_line_exit_2(r, f"cannot write {out / 'table.txt'}")
    assert sorted(p.name for p in out.iterdir()) == ["table.txt"]  # no temporary file left


@pytest.mark.quick
def test_a_full_disk_is_one_line_and_leaves_no_partial_file(sweep, tmpfs):
    full = tmpfs("full", "size=64k")
    fill_up(full)
    figs = full / "figs"
    r = report(sweep / "12-00-00", "--plots", figs)
    assert_one_line_exit_2(r, "No space left on device")
    assert not figs.exists() or list(figs.iterdir()) == []  # no half-written table or PNG
    # the table itself to a file on the full disk, or to /dev/full
    with open(full / "table.txt", "w") as f:
        r = report(sweep / "12-00-00", stdout=f)
    assert_one_line_exit_2(r, "cannot write to standard output", "No space left on device")
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as f:
            r = report(sweep / "12-00-00", "--format", "csv", stdout=f)
        assert_one_line_exit_2(r, "cannot write to standard output")


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.quick
def test_unreadable_run_files_mark_the_run_failed_with_a_warning(tmp_path, capsys):
    """A truncated summary.json or metrics.csv, a corrupt CSV or YAML: the run counts as
    failed (its numbers are not used), the table notes why, stderr has one warning line
    per such run; the report goes on."""
    for s in range(4):
        write_run(tmp_path / f"fedavg{s}", [0.5, 0.6 + 0.1 * s], seed=s)
    write_run(tmp_path / "local0", [0.8], algo__name="local", seed=0)
    _cut(tmp_path / "fedavg1" / "summary.json")
    _cut(tmp_path / "fedavg2" / "metrics.csv")
    (tmp_path / "fedavg3" / "metrics.csv").write_bytes(b'round,a\n1,"x\n2,\xff\xfe\n')
    (tmp_path / "local0" / ".hydra" / "config.yaml").write_text("algo: {name: [local\n")
    (tmp_path / "local0" / "summary.json").write_text("[1, 2]")
    (tmp_path / "fedavg0" / "clients.csv").write_bytes(b"\x00\xff garbage")  # plots only
    code, out, err = run_cli(tmp_path, "--plots", tmp_path / "figs", capsys=capsys)
    assert code == 0 and "Traceback" not in err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 4 and all(w.endswith("the run counts as failed") for w in warnings)
    assert "fedavg1: summary.json: not valid JSON (truncated or corrupt)" in err
    assert "fedavg2: metrics.csv: truncated (its last line is cut off)" in err
    assert "fedavg3: metrics.csv: not a readable CSV file" in err
    assert ".hydra/config.yaml: not readable YAML" in err and "not a JSON object" in err
    fedavg = next(line for line in out.splitlines() if line.startswith("fedavg"))
    assert fedavg.split()[1:] == ["60.00", "(3", "failed)"]  # seed 0 alone: its final 0.6
    assert "failed" in next(line for line in out.splitlines() if line.startswith("null"))
    assert "4 run(s) with unreadable files (counted as failed):" in out
    assert (tmp_path / "figs" / "curves.png").is_file()


@pytest.mark.quick
def test_only_unreadable_runs_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"algo": "fedavg", "final": {"rou')
    r = report(tmp_path)
    assert_one_line_exit_2(r, "no readable run", "summary.json: not valid JSON")


@pytest.mark.quick
def test_a_bug_is_one_line_with_the_traceback_in_a_file(sweep, capsys, monkeypatch, tmp_path):
    import tempfile

    import fedbench.report.cli as cli

    def broken(*a, **kw):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli, "render", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code, out, err = run_cli(sweep / "12-00-00", capsys=capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("fedbench-report: internal error (RuntimeError: boom)")
    (saved,) = tmp_path.glob("fedbench-report-error-*.txt")
    assert "Traceback" in saved.read_text() and "Traceback" not in err


# --------------------------------------------------------------------------- presets
@pytest.mark.quick
@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_every_preset_cell_has_its_paper_number(name):
    p = presets.PRESETS[name]
    numbers = p.paper_numbers()
    assert len(numbers) == len(p.rows) * len(p.columns) * len(p.stats)
    assert all(n.value for n in numbers.values())


@pytest.mark.quick
def test_paper_numbers_are_the_accuracies():
    """Table VII prints each accuracy with its change from 100% beneath: not a cell."""
    numbers = presets.get("diversifed_table7").paper_numbers()
    assert numbers[("FedAvg", "CIFAR-10 90%", "avg")] == presets.PaperNumber("51.48", "0.63")
    numbers = presets.get("diversifed_table2").paper_numbers()
    assert numbers[("FedCAC", "CIFAR-100 Dir(0.01)", "avg")].value == "85.79"
    assert ("FedAvg", "FMNIST Dir(1.0)", "avg") in numbers


# The packaged tables' manifest: docs/paper-tables.md, "Files" (CSV | rows | caption).
MANIFEST = Path(__file__).resolve().parents[1] / "docs" / "paper-tables.md"


@pytest.mark.quick
def test_packaged_paper_tables_match_the_documented_manifest():
    """Every preset's table ships, and the packaged CSVs are exactly the files the
    documentation lists, each with the number of rows it states (one per printed number)."""
    needed = {p.csv for p in presets.PRESETS.values()}
    shipped = {p.name: p for p in paper_numbers.PACKAGED.glob("*.csv")}
    assert needed <= set(shipped)
    listed = {}
    for line in MANIFEST.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].endswith(".csv") and cells[1].isdigit():
            listed[cells[0]] = int(cells[1])
    assert set(listed) == set(shipped)
    for name, rows in listed.items():
        with open(shipped[name], newline="", encoding="utf-8") as f:
            assert sum(1 for _ in csv.DictReader(f)) == rows, name


@pytest.mark.quick
def test_paper_numbers_come_from_the_shipped_copies_only(monkeypatch, tmp_path):
    """The report reads fedbench/report/paper_tables/ and nothing outside the package."""
    assert not hasattr(presets, "SHARED")
    paper_numbers.paper_csv.cache_clear()
    try:
        numbers = presets.get("plgu_table2").paper_numbers()
        assert numbers[("FedRep", "CIFAR10 C=10", "avg")].value == "71.32"  # from the poster
        monkeypatch.setattr(paper_numbers, "PACKAGED", tmp_path)
        paper_numbers.paper_csv.cache_clear()
        with pytest.raises(presets.ReportError, match="plgu_table2.csv not found in"):
            presets.get("plgu_table2").paper_numbers()
    finally:
        paper_numbers.paper_csv.cache_clear()


@pytest.mark.quick
def test_diversifed_table1_layout_with_paper_numbers(tmp_path, capsys):
    common = dict(participation=1.0, clients=N)
    for s, g in enumerate((0.80, 0.84)):
        write_run(tmp_path / f"fedavg{s}", [0.9, 0.95], global_curve=[0.7, g],
                  algo__name="fedavg", seed=s, **common)  # fmt: skip
        write_run(tmp_path / f"local{s}", [0.96, 0.90 + 0.02 * s], algo__name="local", seed=s,
                  **common)  # fmt: skip
    write_run(tmp_path / "half", [0.5], algo__name="local", participation=0.5)
    p = presets.get("diversifed_table1")
    table, unmatched = p.build(find_runs([tmp_path]))
    assert [r[0] for r in table.rows] == [
        "FedAvg", "Separate", "Per-FedAvg", "pFedMe", "FedAMP", "FedFomo", "APPLE", "FedRep",
        "FedProto", "FedRoD", "FedCAC", "DiversiFed",
    ]  # fmt: skip
    assert table.col_labels == ["FMNIST", "CIFAR-10", "CIFAR-100"]
    assert [r.path.name for r in unmatched] == ["half"]
    # FedAvg's cell is its global model at its best round; Separate's the personal best
    assert values_of(table, "FedAvg", "FMNIST", "avg").mean == pytest.approx(0.82)
    assert values_of(table, "Separate", "FMNIST", "avg").mean == pytest.approx(0.96)
    code, out, _ = run_cli(tmp_path, "--preset", "diversifed_table1", capsys=capsys)
    assert code == 0
    fedavg = next(line for line in out.splitlines() if line.startswith("FedAvg "))
    assert fedavg.split() == ["FedAvg", "82.00", "±", "2.83", "83.55", "±", "1.16", "—",
                              "51.19", "±", "1.05", "—", "23.55", "±", "1.97"]  # fmt: skip
    diversifed = [line for line in out.splitlines() if line.startswith("DiversiFed ")][-1]
    assert diversifed.split()[:5] == ["DiversiFed", "—", "96.47", "±", "0.83"]
    assert "best round" in out
    assert "clients 20 (paper 40)" in out and "rounds 2 (paper 500)" in out
    assert "participation: 0.5 (needs 1)" in out
    code, out, _ = run_cli(tmp_path, "--preset", "diversifed_table1", "--compact",
                           "--format", "markdown", capsys=capsys)  # fmt: skip
    assert "| method | FMNIST ours | FMNIST paper |" in out
    assert "| Separate | 96.00 ± 0.00 | 96.10 ± 0.26 |" in out and "CIFAR" not in out


@pytest.mark.quick
def test_plgu_table1_avg_with_bottom_and_top_beneath(tmp_path, capsys):
    for s in range(2):
        write_run(tmp_path / f"r{s}", [0.6, 0.5], global_curve=[0.5, 0.62 + 0.02 * s],
                  algo__name="fedavg", seed=s, data__name="cifar10", clients=100,
                  participation=0.1, split__classes_per_client=3, model__name="resnet18",
                  model__norm="group")  # fmt: skip
    code, out, _ = run_cli(tmp_path, "--preset", "plgu_table1", "--format", "csv", capsys=capsys)
    assert code == 0
    rows = [r for r in csv.DictReader(io.StringIO(out)) if r["column"] == "CIFAR10 C=10"]
    fedavg = {r["stat"]: r for r in rows if r["method"] == "FedAvg"}
    assert list(fedavg) == ["avg", "bottom5", "top5"]
    assert [fedavg[s]["paper"] for s in fedavg] == ["64.79", "60.69", "68.45"]
    assert float(fedavg["avg"]["mean"]) == pytest.approx(63.0)  # global model, final round
    assert float(fedavg["bottom5"]["mean"]) == pytest.approx(53.0)
    assert float(fedavg["top5"]["mean"]) == pytest.approx(73.0)
    assert fedavg["avg"]["metric"] == "global.L.avg"
    plgu = {r["stat"]: r for r in rows if r["method"] == "PLGU-LF"}
    assert plgu["avg"]["status"] == "missing" and plgu["avg"]["paper"] == "69.36"
    code, out, _ = run_cli(tmp_path, "--preset", "plgu_table1", capsys=capsys)
    assert "last evaluation" in out and "C=100" in out and "TmgNet C=20" in out


@pytest.mark.quick
def test_list_presets(capsys):
    code, out, _ = run_cli("--list-presets", capsys=capsys)
    assert code == 0 and all(name in out for name in presets.PRESETS)


# --------------------------------------------------------------------------- plots
def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, path


@pytest.mark.quick
def test_plots_are_written(sweep, tmp_path):
    runs = find_runs([sweep])
    t = build(runs, ["algo"], ["data"], ["personal.L.avg"], select="best")
    paths = write_plots(t, tmp_path / "figs")
    assert [p.name for p in paths] == ["curves.png", "clients.png", "lsg.png"]
    for p in paths:
        assert_png(p)


@pytest.mark.quick
def test_cli_plots_next_to_the_table(sweep, tmp_path, capsys):
    out_dir = tmp_path / "report"
    code, out, err = run_cli(sweep / "12-00-00", "--format", "markdown", "--plots", out_dir,
                             capsys=capsys)  # fmt: skip
    assert code == 0
    assert (out_dir / "table.md").read_text() == out
    for name in ("curves", "clients", "lsg"):
        assert_png(out_dir / f"{name}.png")
        assert f"{name}.png" in err
    # a metric that is no per-client accuracy: only the curves
    code, _, _ = run_cli(sweep / "12-00-00", "--metric", "train_loss", "--plots",
                         tmp_path / "loss", capsys=capsys)  # fmt: skip
    assert code == 0 and sorted(p.name for p in (tmp_path / "loss").iterdir()) == [
        "curves.png",
        "table.txt",
    ]


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
@pytest.mark.long
def test_sweep_then_report(tmp_path):
    """A real Hydra multirun (2 algorithms x 2 seeds), then fedbench-report on it."""
    sweep_dir = tmp_path / "sweep"
    fedbench = [sys.executable, "-c", "from fedbench.cli import main; main()"]
    args = ["-m", "algo=fedavg,local", "seed=0,1", "rounds=2", "clients=10",
            "participation=1.0", "eval.every=1", "split.train_per_client=100",
            "split.test_per_client=50", "model.hidden=[32]", "device=cpu",
            CLI_BACKEND, f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    # this checkout's fedbench, whatever the environment's editable install points at
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([*fedbench, *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert (sweep_dir / "multirun.yaml").is_file()
    report = [sys.executable, "-m", "fedbench.report", str(sweep_dir)]
    r = subprocess.run([*report, "--select", "best", "--format", "csv", "--plots",
                        str(tmp_path / "figs")], capture_output=True, text=True,
                       timeout=120, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {row["algo"]: row for row in csv.DictReader(io.StringIO(r.stdout))}
    assert set(rows) == {"fedavg", "local"}
    for row in rows.values():
        assert row["n"] == "2" and row["status"] == "ok" and 0 < float(row["mean"]) <= 100
    for name in ("curves", "clients", "lsg"):
        assert_png(tmp_path / "figs" / f"{name}.png")
    r = subprocess.run([*report, "--preset", "diversifed_table1", "--compact"],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "FedAvg" in r.stdout and "Separate" in r.stdout and "96.10 ± 0.26" in r.stdout


# --------------------------------------------------------------------------- launchers
@pytest.mark.quick
@pytest.mark.parametrize(
    "name, base, plugin, extra",
    [
        ("joblib_local", "joblib", "hydra_plugins.hydra_joblib_launcher", "joblib"),
        ("slurm", "submitit_slurm", "hydra_plugins.hydra_submitit_launcher", "slurm"),
    ],
)
def test_launcher_presets(name, base, plugin, extra):
    """The presets extend the plugin's own config; with the plugin installed they compose."""
    from fedbench.cli import CONF_DIR

    cfg = yaml.safe_load((CONF_DIR / "hydra" / "launcher" / f"{name}.yaml").read_text())
    assert cfg["defaults"] == [base]
    from hydra import compose, initialize_config_dir

    needs(f"{plugin}.config", extra)  # the plugin stores its configs on import

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        composed = compose("config", [f"hydra/launcher={name}"], return_hydra_config=True)
    launcher = composed.hydra.launcher
    assert launcher._target_.startswith(plugin)
    assert {k: launcher[k] for k in cfg if k != "defaults"} == {
        k: v for k, v in cfg.items() if k != "defaults"
    }
