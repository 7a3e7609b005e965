"""Runs and sweeps own their directories: a run never goes into a sweep's directory, a sweep
never into a run's (fedbench-report would hide one of them), one sweep at a time writes a
sweep directory, a sweep's job directories are named by their overrides (a later sweep finds
them whatever the order of its values) and the report counts each run once. The command
line's edges (names too long for the file system, a missing --config-dir, an unknown flag)
are one line and exit 2 before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zygote

from conftest import CLI_BACKEND, fmnist_available

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLI = [sys.executable, "-c", "from fedbench.cli import main; main()"]
TINY = ["clients=4", "split.train_per_client=50", "split.test_per_client=20",
        "model.hidden=[16]", "rounds=2", "eval.every=1", "device=cpu", CLI_BACKEND]  # fmt: skip


def snapshot(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def refused(argv: list[str], needle: str) -> str:
    from fedbench.cli import refusal

    msg = refusal(argv)
    assert msg is not None and msg.startswith("fedbench: ") and "\n" not in msg, msg
    assert needle in msg, msg
    return msg


def fake_run(d: Path, finished: bool = True) -> Path:
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text("seed: 0\n")
    if finished:
        (d / "summary.json").write_text("{}\n")
    return d


# ----------------------------------------------------------------------------- runs vs sweeps
@pytest.mark.quick
def test_runs_and_sweeps_keep_out_of_each_others_directories(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    fake_run(sweep / "seed=0")
    run = fake_run(tmp_path / "run")
    bare = tmp_path / "bare"  # a sweep's cells without its multirun.yaml (or a tree of runs)
    fake_run(bare / "a" / "seed=1", finished=False)
    before = snapshot(tmp_path)
    for extra in ([], ["resume=true"], ["resume=auto"]):
        refused([*extra, f"hydra.run.dir={sweep}"], "holds a sweep or other runs (multirun.yaml")
    refused([f"hydra.run.dir={bare}"], "1 run in its subfolders")
    refused(["-m", "seed=0,1", f"hydra.sweep.dir={run}"], "holds a run (summary.json")
    refused([f"hydra.run.dir={run / 'sub'}"], f"inside the run directory {run}")
    refused(["-m", "seed=0,1", f"hydra.sweep.dir={run / 'sub'}"], "inside the run directory")
    assert snapshot(tmp_path) == before and not (run / "sub").exists()
    # a cell of the sweep is a run's own directory (resumed there), a new folder beside the
    # cells is free: the report finds either
    from fedbench.cli import refusal
    from fedbench.rundir import sweep_marks

    assert sweep_marks(sweep / "seed=0") == []
    assert refusal([f"hydra.run.dir={sweep / 'extra'}"]) is None


@pytest.mark.quick
def test_claims_refuse_the_other_kind_and_a_second_sweep(tmp_path):
    from fedbench.rundir import RunDir, RunDirError, SweepDir

    sweep = SweepDir.claim(tmp_path / "sweep")
    with pytest.raises(RunDirError, match=f"sweep directory .* in use by pid {os.getpid()}"):
        SweepDir.claim(tmp_path / "sweep")
    with pytest.raises(RunDirError, match="a live sweep's lock"):
        RunDir.claim(tmp_path / "sweep", resume=True)  # a run into a sweep starting there
    sweep.release()
    assert not list((tmp_path / "sweep").iterdir())  # its lock goes with it
    SweepDir.claim(tmp_path / "sweep").release()
    run = RunDir.claim(tmp_path / "run", resume=False)
    with pytest.raises(RunDirError, match="holds a run .*a live run's lock"):
        SweepDir.claim(tmp_path / "run")  # a run there that has not written yet
    run.release()
    fake_run(tmp_path / "done")
    with pytest.raises(RunDirError, match="holds a run"):
        SweepDir.claim(tmp_path / "done")


@pytest.mark.quick
def test_a_second_sweep_into_a_sweep_directory_in_use_is_refused_up_front(tmp_path):
    """Two sweeps into one hydra.sweep.dir would each find the other's jobs taken and list
    every job as failed: the second is one line and exit 2, and writes nothing."""
    from fedbench.rundir import SweepDir

    sweep = tmp_path / "sweep"
    with SweepDir.claim(sweep):  # the first sweep, running
        r = zygote.run(["-m", "seed=0,1", *TINY, f"hydra.sweep.dir={sweep}"], tmp_path, ENV)
        assert r.returncode == 2, r.stderr
        (line,) = r.stderr.splitlines()
        assert f"in use by pid {os.getpid()}" in line and "wait for that sweep" in line, line
        assert sorted(p.name for p in sweep.iterdir()) == [".fedbench-sweep.lock"]


# ----------------------------------------------------------------------------- sweep cells
@pytest.mark.quick
def test_sweep_job_directories_are_named_by_their_overrides():
    """Not by Hydra's job number: `seed=1,0` after `seed=0,1,2,3` finds the same cells."""
    from fedbench import cell_name
    from fedbench.cli import _compose

    for num in (0, 3):
        cfg = _compose(["seed=1", "optim.lr=0.1", "device=cpu", f"hydra.job.num={num}"])
        assert cfg.hydra.sweep.subdir == "optim.lr=0.1,seed=1"  # device: no other run
    assert _compose(["device=cpu"]).hydra.sweep.subdir == "defaults" == cell_name("")


@pytest.mark.quick
def test_jobs_that_would_share_a_directory_are_refused(tmp_path):
    msg = refused(["-m", "engine.backend=vmap,sequential", f"hydra.sweep.dir={tmp_path / 's'}"],
                  "engine.backend=vmap and engine.backend=sequential would share")  # fmt: skip
    assert "hydra.sweep.dir" in msg and not (tmp_path / "s").exists()
    refused(["-m", "seed=0,1", "hydra.sweep.subdir=.", f"hydra.sweep.dir={tmp_path / 's'}"],
            "not a folder below the sweep directory")  # fmt: skip


# ----------------------------------------------------------------------------- the edges
@pytest.mark.quick
def test_names_too_long_for_the_file_system_are_one_line(tmp_path):
    long = "x" * 300
    refused([f"hydra.run.dir={tmp_path / long}"], "has 300 bytes, more than the 255")
    refused([f"hydra.run.dir={tmp_path / long / 'run'}"], "has 300 bytes")
    refused(["-m", "seed=0,1", f"hydra.sweep.dir={tmp_path / long}"], "sweep directory")
    deep = tmp_path.joinpath(*["y" * 250] * 17)
    refused([f"hydra.run.dir={deep}"], "the path has")
    # a sweep's job named by a long override list (Hydra's own override_dirname, uncut)
    many = [f"+algo.k{i}={'v' * 20}" for i in range(12)]
    from fedbench.cli import _check_cell, _compose  # the keys are not fedbench's: compose alone

    cfg = _compose([*many, "hydra.sweep.subdir=${hydra.job.override_dirname}"])
    with pytest.raises(Exception, match="sweep job directory .* more than the 255"):
        _check_cell(tmp_path / "s", cfg, many, {})
    # fedbench's default cuts it (fedbench.cell_name) and checks what it would write
    cfg = _compose(many)
    _check_cell(tmp_path / "s", cfg, many, {})
    assert len(str(cfg.hydra.sweep.subdir).encode()) <= 200
    assert list(tmp_path.iterdir()) == []


@pytest.mark.quick
def test_command_line_edges_are_one_line(tmp_path, capsys):
    refused(["--config-dir", str(tmp_path / "nope")], "--config-dir")
    refused(["--foo"], "unknown flag --foo; valid flags: --help")
    refused(["--cfg"], "expected one argument")
    assert capsys.readouterr() == ("", "")  # nothing of argparse's usage text


@pytest.mark.quick
def test_a_corrupt_saved_config_is_one_line(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("a: [b\n  c: d\n")
    refused(["resume=true", f"hydra.run.dir={run}"], str(run))


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
def test_a_later_sweep_finds_its_cells_and_the_report_counts_each_run_once(tmp_path):
    """seed=0,1 then seed=1,0 with resume=auto: both cells are skipped (found by name, not
    by job number); an old layout's copy of a cell (`0_seed=0`) is counted once."""
    from fedbench.report import build, find_runs
    from fedbench.report.table import values_of

    sweep = tmp_path / "sweep"

    def run(*values: str) -> subprocess.CompletedProcess:
        return zygote.run(["-m", *TINY, *values, f"hydra.sweep.dir={sweep}"], tmp_path, ENV)

    first = run("seed=0,1")
    assert first.returncode == 0, first.stderr
    cells = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(cells) == 2 and all(c.startswith("clients=4,") for c in cells), cells  # no number
    again = run("seed=1,0", "resume=auto")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("already finished") == 2, again.stdout
    shutil.copytree(sweep / cells[0], sweep / f"0_{cells[0]}")  # an older sweep's cell
    warned: list[str] = []
    runs = find_runs([sweep], warn=warned.append)
    assert len(runs) == 2 and len(warned) == 1 and "counted once" in warned[0], warned
    cell = values_of(build(runs, ["algo"], [], ["personal.L.avg"]), "fedavg", (),
                     "personal.L.avg")  # fmt: skip
    assert cell.n == 2 and sorted(cell.seeds) == [0, 1]
    assert json.loads((sweep / cells[0] / "summary.json").read_text())["rounds"] == 2
