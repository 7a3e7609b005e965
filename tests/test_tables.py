"""Table scripts finish across interruptions: fixed cell directories, resume=auto, and
fedbench-status (scripts/_common.sh, fedbench/status.py), on real FMNIST."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI_BACKEND, fmnist_available, needs

REPO = Path(__file__).resolve().parents[1]
# This checkout's fedbench and the environment's console scripts (fedbench, fedbench-status).
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
}
needs_fmnist = pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")

# A small DiversiFed Table I (FMNIST): one method x three seeds (one sweep), 6 rounds, 8
# clients, a checkpoint every round so that a kill always finds one.
TINY = {
    "METHODS": "fedavg",
    "SEEDS": "0,1,2",
    "ROUNDS": "6",
    "EXTRA": "clients=8 split.train_per_client=60 split.test_per_client=40 local_epochs=1 "
    f"model.hidden=[16] checkpoint.every=1 device=cpu {CLI_BACKEND}",
}


def table(out: Path, *extra_env: tuple[str, str], **popen) -> subprocess.Popen:
    env = {**ENV, **TINY, "OUT": str(out), **dict(extra_env)}
    return subprocess.Popen(
        ["bash", str(REPO / "scripts" / "reproduce_diversifed.sh"), "table1_fmnist"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a kill -9 of the whole sweep
        **popen,
    )


def finish(p: subprocess.Popen) -> tuple[str, str]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return out, err


def cells(out: Path) -> list[Path]:
    return sorted(p.parent.parent for p in out.glob("table1_fmnist/*/*/.hydra/config.yaml"))


def report_table(stdout: str) -> str:
    """The report's table (the lines after its command), without paths or times."""
    lines = stdout.split("+ fedbench-report", 1)[1].splitlines()[1:]
    table = "\n".join(ln for ln in lines if "/" not in ln and " s " not in ln)
    assert "FedAvg" in table, stdout[-3000:]
    return table


@pytest.fixture(scope="session")  # with the tests' xdist_group: made once
def reference(tmp_path_factory) -> str:
    """The tiny table run once without interruption: its script's output."""
    out, _ = finish(table(tmp_path_factory.mktemp("ref")))
    assert "3 cells: 0 done, 0 running, 3 left" in out
    assert "3 cells: 3 done" in out
    return out


def kill_when(p: subprocess.Popen, ready, timeout: float = 300) -> None:
    """SIGKILL the script's whole process group once `ready()` holds."""
    t0 = time.monotonic()
    while not ready():
        assert p.poll() is None, "the table finished before it could be interrupted"
        assert time.monotonic() - t0 < timeout
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=60)


def status(*args: str, cwd: Path = REPO) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "fedbench.status", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
@needs_fmnist
@pytest.mark.xdist_group("table")  # one worker: the reference table is run once
@pytest.mark.long
def test_a_table_killed_twice_finishes_equal_to_an_uninterrupted_one(tmp_path, reference):
    """kill -9 of the whole table (script, sweep, run) twice, mid-run, then the script again
    until it completes: every cell finishes once, and the table equals an uninterrupted
    one's. The status line at each start counts what is done and what resumes."""
    out = tmp_path / "cut"

    def checkpointed(n: int):
        return lambda: sum((c / "checkpoint.pt").exists() for c in cells(out)) >= n

    def summaries() -> int:
        return sum((c / "summary.json").exists() for c in cells(out))

    kill_when(table(out), checkpointed(1))  # inside the first cell
    first = summaries()
    kill_when(table(out), lambda: summaries() > first and checkpointed(first + 2)())
    stdout, _ = finish(table(out))
    start = stdout.splitlines()[0]
    assert "3 cells:" in start and "resume from a checkpoint" in start, start
    assert "3 cells: 3 done" in stdout
    assert report_table(stdout) == report_table(reference)
    ref_cells = [
        Path(ln.split()[-1]) for ln in reference.splitlines() if ln.startswith("results in ")
    ]
    assert len(cells(out)) == len(ref_cells) == 3
    # and the same rows in every cell's metrics (resumed == uninterrupted, to the bit)
    for a, b in zip(cells(out), sorted(ref_cells), strict=True):
        assert a.name == b.name
        assert _metrics(a) == _metrics(b)
    # run again: nothing left, every cell skipped without training
    again, _ = finish(table(out))
    assert again.count("already finished") == 3 and "3 cells: 3 done" in again.splitlines()[0]


def _metrics(cell: Path) -> list[str]:
    """metrics.csv without its clocks (wall and CPU time)."""
    rows = [ln.split(",") for ln in (cell / "metrics.csv").read_text().splitlines()]
    keep = [i for i, c in enumerate(rows[0]) if c not in ("wall_time_s", "cpu_time_s")]
    return [",".join(r[i] for i in keep) for r in rows]


@pytest.mark.slow
@needs_fmnist
@pytest.mark.xdist_group("table")  # one worker: the reference table is run once
def test_table_under_the_joblib_launcher_resumes_the_same_way(tmp_path, reference):
    needs("hydra_plugins.hydra_joblib_launcher", "joblib")
    joblib = ("EXTRA", TINY["EXTRA"] + " hydra/launcher=joblib_local hydra.launcher.n_jobs=2")
    out = tmp_path / "cut"
    kill_when(table(out, joblib), lambda: any((c / "checkpoint.pt").exists() for c in cells(out)))
    stdout, _ = finish(table(out, joblib))
    assert "resume from a checkpoint" in stdout.splitlines()[0]
    assert "2 jobs at a time" in stdout.splitlines()[0]
    assert report_table(stdout) == report_table(reference)  # the sequential launcher's


@pytest.mark.quick
def test_dry_run_prints_one_command_per_sweep_and_runs_nothing(tmp_path):
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "reproduce_diversifed.sh"), "table2_fmnist"],
        env={
            **ENV,
            **TINY,
            "OUT": str(tmp_path / "t"),
            "DRY_RUN": "1",
            "COLUMN": "split.alpha=0.1",
            "METHODS": "fedavg local",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("+ fedbench -m")]
    assert len(lines) == 2 and not (tmp_path / "t").exists()
    assert all("split.alpha=0.1 " in ln and ln.endswith(" resume=auto") for ln in lines)
    assert "'hydra.sweep.subdir=${fedbench.cell:}'" in lines[0]


# --------------------------------------------------------------------------- fedbench-status
SWEEP = [
    "data=fmnist",
    "split=pat",
    "clients=6",
    "split.train_per_client=40",
    "split.test_per_client=20",
    "model=mlp",
    "model.hidden=[8]",
    "rounds=3",
    "eval.every=1",
    "seed=0,1,2",
    "hydra.sweep.subdir=${fedbench.cell:}",
    CLI_BACKEND,
]


@pytest.mark.slow
@needs_fmnist
@pytest.mark.long
def test_status_names_every_state_and_never_takes_a_lock(tmp_path):
    from fedbench.rundir import RunDir

    sweep = tmp_path / "sweep"
    args = [*SWEEP, f"hydra.sweep.dir={sweep}"]
    r = subprocess.run(
        [sys.executable, "-c", "from fedbench.cli import main; main()", "-m", *args,
         "seed=0,1", "checkpoint.every=1"],  # fmt: skip
        capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cells_now = sorted(p for p in sweep.iterdir() if p.is_dir() and "seed=" in p.name)
    assert len(cells_now) == 2, cells_now  # named by their overrides: seed=0 sorts first
    seed0, seed1 = cells_now
    # seed 1 as if killed after round 2: its summary gone, its checkpoint left
    (seed1 / "summary.json").unlink()
    lines = status("-v", *args, "seed=0,1,2").splitlines()
    state = {ln.split()[-1]: ln.split()[0] for ln in lines[:-1]}
    assert state[str(seed0)] == "done" and state[str(seed1)] == "interrupted"
    assert sum(s == "left" for s in state.values()) == 1
    assert lines[-1].startswith("3 cells: 1 done, 0 running, 2 left (1 resume from a checkpoint)")
    assert "measured s/round: fedavg" in lines[-1]
    # a live holder: running; the probe must not take the lock (a claim still fails after)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from fedbench.rundir import RunDir; "
         f"d = RunDir.claim({str(seed1)!r}, resume=True); print('ok', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "ok"
        line = status(*args, "seed=0,1,2").splitlines()[-1]
        assert "1 done, 1 running, 1 left" in line, line
        with pytest.raises(Exception, match="in use by pid"):
            RunDir.claim(seed1, resume=True)
    finally:
        holder.kill()
        holder.wait()
    # a failed cell (error.txt, no checkpoint) is counted apart
    (seed1 / "checkpoint.pt").unlink()
    (seed1 / "error.txt").write_text("loss is nan at round 2\n")
    rows = json.loads(status("--json", *args, "seed=0,1,2"))
    assert [c["state"] for c in rows] == ["done", "failed", "left"]
    assert rows[1]["note"] == "loss is nan at round 2"


@pytest.mark.quick
def test_status_refuses_a_sweep_without_a_fixed_directory():
    r = subprocess.run(
        [sys.executable, "-m", "fedbench.status", "seed=0,1"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "hydra.sweep.dir" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.quick
def test_estimate_uses_each_methods_pace():
    from fedbench.status import Cell, estimate, summary_line

    cells = [
        Cell(Path("a"), "fedavg", 100, "done", 100, 0.5),
        Cell(Path("b"), "fedavg", 100, "interrupted", 40, 0.7),  # its own pace
        Cell(Path("c"), "fedavg", 100, "left"),  # fedavg's mean, (0.5 + 0.7) / 2
        Cell(Path("d"), "fedpg", 100, "left"),  # no fedpg measured: the mean over methods
    ]
    seconds, pace = estimate(cells)
    assert pace == pytest.approx({"fedavg": 0.6})
    assert seconds == pytest.approx(60 * 0.7 + 100 * 0.6 + 100 * 0.6)
    line = summary_line(cells, "T", jobs_at_once=2)
    assert line.startswith("T: 4 cells: 1 done, 0 running, 3 left (1 resume from a checkpoint)")
    assert "about 1 min left, 2 jobs at a time"  # 162 s / 2 in line
    assert estimate([Cell(Path("x"), "a", 5, "left")])[0] is None


@pytest.mark.quick
def test_cell_names_fit_a_file_name_and_stay_distinct():
    from fedbench import CELL_NAME_BYTES, cell_name

    short = "algo=fedavg,seed=0"
    assert cell_name(short) == short
    a = ",".join(f"key{i}=é{i}" for i in range(60))  # multi-byte characters near the cut
    b = a[:-1] + "X"
    assert len(a.encode()) > 255
    for name in (cell_name(a), cell_name(b)):
        assert len(name.encode()) <= CELL_NAME_BYTES
        assert name.startswith(a[:100])
    assert cell_name(a) != cell_name(b) and cell_name(a) == cell_name(a)


@pytest.mark.slow
@needs_fmnist
@pytest.mark.long
def test_a_cell_whose_overrides_are_too_long_for_a_file_name_runs_and_is_found_again(
    tmp_path,
):
    """Every key of the sweep in the cell's name would be over 255 bytes ("File name too
    long" from the OS); the cell gets a shortened name, and the same sweep again finds it
    finished."""
    sweep = tmp_path / "sweep"
    many = ["optim.momentum=0.0", "optim.weight_decay=0.0", "optim.lr_decay=1.0",
            "eval.s_frac=0.5", "participation=1.0", "local_epochs=1", "batch_size=20",
            "split.classes_per_client=2", "split.balance=true"]  # fmt: skip
    args = [*(a for a in SWEEP if not a.startswith(("seed=", "rounds="))), "seed=0",
            "rounds=1", *many, f"hydra.sweep.dir={sweep}", "resume=auto"]  # fmt: skip
    cmd = [sys.executable, "-c", "from fedbench.cli import main; main()", "-m", *args]
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path,
                           timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        (cell,) = [p for p in sweep.iterdir() if p.is_dir()]
        assert "~" in cell.name and len(cell.name.encode()) <= 200
        assert (cell / "summary.json").exists()
    assert "already finished (round 1): skipped" in r.stdout
