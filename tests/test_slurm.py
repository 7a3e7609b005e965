"""Sweeps through a real SLURM cluster with `hydra/launcher=slurm` (Hydra's submitit
launcher): a two-job sweep that fedbench-report reads, and a job stopped by SIGTERM
(`scancel --signal=TERM`) that checkpoints and, resumed, ends as the uninterrupted run.

Needs a cluster with a partition `debug` and accounting (`sacct`): scripts/slurm_cluster.sh
starts a one-node one on this machine (Debian) in seconds. Skipped without `sinfo`, without
an idle node, or without the plugin (pip install 'fedbench[slurm]').

What submitit does with signals in the job (submitit/core/job_environment.py): it sets
SIGTERM (and SIGCONT) to a handler that only logs "Bypassing signal SIGTERM", and SIGUSR2
(its preemption / time-out signal, sent by SLURM `signal_delay_s` before the time limit) to
checkpoint-and-requeue. fedbench's own SIGTERM handler replaces the bypass for the rounds
(fedbench/runner.py): a SIGTERM then finishes the round, saves checkpoint.pt and exits 143;
SLURM records the job FAILED, submitit does not requeue it, and the submitting `fedbench -m`
exits non-zero once sacct shows the job ended. A SIGTERM before the rounds start (while the
data loads) is bypassed: the run goes on."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI_BACKEND, fmnist_available, missing

REPO = Path(__file__).resolve().parents[1]
# This checkout's fedbench, whatever the environment's editable install points at. sbatch
# passes the whole environment to the job (--export=ALL, SLURM's default) and submitit runs
# `<this interpreter> -m submitit.core._submit` there, so the job imports the same fedbench
# with the same Python and packages: no `hydra.launcher.setup` is needed on one machine.
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLI = [sys.executable, "-c", "from fedbench.cli import main; main()"]
REPORT = [sys.executable, "-c", "from fedbench.report.cli import main; main()"]
PARTITION = "debug"
LAUNCHER = [
    "hydra/launcher=slurm",
    f"hydra.launcher.partition={PARTITION}",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.mem_gb=2",
    "hydra.launcher.timeout_min=10",
]
SMALL = [
    "seed=0",
    "clients=6",
    "split.train_per_client=60",
    "model.hidden=[16]",
    "device=cpu",
    CLI_BACKEND,
]
# Generous: a busy machine makes each job start (torch, FMNIST) take many seconds.
TIMEOUT = 300

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("slurm"),  # one cluster of one 2-CPU node: its jobs one test at a time
    pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed"),
]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw)


def _skip_reason() -> str | None:
    if reason := missing("hydra_plugins.hydra_submitit_launcher", "slurm"):
        return reason
    if shutil.which("sinfo") is None:
        return "sinfo not on PATH: no SLURM here (scripts/slurm_cluster.sh starts one)"
    try:
        r = _run(["sinfo", "-h", "-p", PARTITION, "-o", "%t"])
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30 s: slurmctld is not up (scripts/slurm_cluster.sh)"
    if r.returncode != 0:
        return f"SLURM is not up (sinfo: {r.stderr.strip()}); scripts/slurm_cluster.sh starts it"
    states = r.stdout.split()
    if not any(s in ("idle", "mix", "alloc") for s in states):
        return f"no node of partition {PARTITION} is up (sinfo states: {states or 'none'})"
    r = _run(["sacct", "-n", "-X", "-S", "now-1minutes", "-o", "JobID"])
    if r.returncode != 0:
        # submitit learns that a job ended without a result (killed, stopped) from sacct
        return f"sacct does not work ({r.stderr.strip()}): submitit needs SLURM accounting"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def sweeps():
    """Sweep directories of the test; their SLURM jobs still queued or running at the end
    (a failed assertion, a timeout) are cancelled."""
    dirs: list[Path] = []
    yield dirs
    ids = [i for d in dirs for i in job_ids(d)]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True)


def job_ids(sweep: Path) -> list[str]:
    """The SLURM job ids of a sweep's runs, from submitit's folders: <job> for a sweep of
    one run; for a job array, <array job> (the sbatch script) and <array job>_<task>."""
    folder = sweep / ".submitit"
    if not folder.is_dir():
        return []
    names = [p.name for p in folder.iterdir() if re.fullmatch(r"\d+(_\d+)?", p.name)]
    arrays = {n.partition("_")[0] for n in names if "_" in n}
    return sorted(n for n in names if n not in arrays)


def job_log(sweep: Path, job: str) -> str:
    """The job's stdout and stderr as submitit wrote them (fedbench's log and its last line,
    submitit's own log lines, srun's and slurmstepd's messages)."""
    return "".join(p.read_text() for p in sorted((sweep / ".submitit" / job).glob("*_log.*")))


def run_dirs(sweep: Path) -> list[Path]:
    return sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))


def wait_for(cond, what: str, proc: subprocess.Popen | None = None, timeout: float = TIMEOUT):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"waiting for {what}: the sweep exited {proc.returncode}\n{err[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def test_sweep_through_slurm_is_reported(slurm, sweeps, tmp_path):
    """Two jobs, one per algorithm, as a SLURM job array: every run writes its results in
    its directory under the sweep directory, and fedbench-report tables both."""
    sweep = tmp_path / "sweep"
    sweeps.append(sweep)
    r = subprocess.run(
        [*CLI, "-m", *LAUNCHER, "algo=fedavg,local", *SMALL, "rounds=2", "eval.every=1",
         f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    runs = run_dirs(sweep)
    assert len(runs) == 2, runs
    for run in runs:
        assert (run / "summary.json").exists(), (run, sorted(os.listdir(run)))
    algos = {json.loads((run / "summary.json").read_text())["algo"] for run in runs}
    assert algos == {"fedavg", "local"}

    # They ran as SLURM jobs, with this interpreter (and so this environment's packages).
    ids = job_ids(sweep)
    assert len(ids) == 2, ids
    script = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_submission.sh"))
    assert f"#SBATCH --partition={PARTITION}" in script, script
    assert f"{shlex.quote(sys.executable)} -u -m submitit.core._submit" in script, script
    for job in ids:
        assert f"JobEnvironment(job_id={job}," in job_log(sweep, job), job_log(sweep, job)

    rep = subprocess.run([*REPORT, str(sweep)], cwd=tmp_path, env=ENV, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    rows = {ln.split()[0] for ln in rep.stdout.splitlines() if ln.strip()}
    assert {"fedavg", "local"} <= rows, rep.stdout


def test_sigterm_checkpoints_and_a_resume_ends_as_uninterrupted(slurm, sweeps, tmp_path):
    """`scancel --signal=TERM` during the rounds: the job finishes its round, saves
    checkpoint.pt, notes in the sweep how to continue and ends cleanly (submitit does not
    requeue it); the submitting command lists the job as stopped, one line, and exits 1.
    The same sweep command with resume=true continues the job in its directory, through
    SLURM, to the result of a run never stopped."""
    run = [*SMALL, "algo=fedavg", "rounds=200", "eval.every=100", "checkpoint.every=0"]
    sweep = tmp_path / "sweep"
    sweeps.append(sweep)
    sweep_cmd = [*CLI, "-m", *LAUNCHER, *run, f"hydra.sweep.dir={sweep}"]
    ref_dir = tmp_path / "ref"
    with contextlib.ExitStack() as procs:

        def start(cmd: list[str]) -> subprocess.Popen:
            p = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
            procs.callback(lambda: p.poll() is None and (p.kill(), p.communicate()))
            return p

        # the uninterrupted run, here (no SLURM), while the SLURM jobs run
        ref = start([*CLI, *run, f"hydra.run.dir={ref_dir}"])
        sub = start(sweep_cmd)

        def in_the_rounds() -> Path | None:
            # the first round's engine line (should its text change: the round-100
            # evaluation's metrics.csv): fedbench's SIGTERM handler is in place. Before it,
            # submitit's handler ignores SIGTERM ("Bypassing signal SIGTERM"): the run goes on.
            for log in sweep.glob("*/run.log"):  # the sweep's one job
                if "engine backend" in log.read_text() or (log.parent / "metrics.csv").exists():
                    return log.parent
            return None

        job_dir = wait_for(in_the_rounds, "the SLURM job's first round", sub)
        (job,) = job_ids(sweep)
        signal = _run(["scancel", "--signal=TERM", job])
        assert signal.returncode == 0, signal.stderr
        wait_for(lambda: not _run(["squeue", "-h", "-j", job]).stdout.strip(), "the job's end")
        if (job_dir / "summary.json").exists():
            pytest.skip("the job finished its 200 rounds before SIGTERM arrived")
        # fedbench's handler ran: the round finished, checkpoint.pt was saved
        log = job_log(sweep, job)
        assert re.search(r"fedbench: SIGTERM: stopped after round \d+, checkpoint saved", log), log
        assert "resume=true hydra.sweep.dir=" in log, log
        assert "Bypassing signal SIGTERM" not in log, log
        assert (job_dir / "checkpoint.pt").exists(), sorted(os.listdir(job_dir))

        # Resume now: the first command is still waiting (submitit polls sacct, then gives
        # the result file 15 s) before it reports the job that ended without a result.
        again = start([*sweep_cmd, "resume=true"])
        out, err = sub.communicate(timeout=TIMEOUT)
        assert sub.returncode == 1 and "Traceback" not in err, (out, err)
        stopped = [ln for ln in err.splitlines() if ln.startswith("fedbench: job ")]
        assert len(stopped) == 1 and "SIGTERM: stopped after round" in stopped[0], err
        assert job_log(sweep, job).count("Starting with JobEnvironment") == 1  # no requeue
        _, again_err = again.communicate(timeout=TIMEOUT)
        assert again.returncode == 0, again_err[-3000:]
        _, ref_err = ref.communicate(timeout=TIMEOUT)
        assert ref.returncode == 0, ref_err[-3000:]

    moved = [d for d in run_dirs(sweep) if d != job_dir]
    if moved and "resume=True" in moved[0].name and not (job_dir / "summary.json").exists():
        pytest.xfail(
            "resume=true is part of hydra.job.override_dirname (conf/config.yaml excludes "
            "only device), so the resumed job ran from scratch in a new directory "
            f"{moved[0].name}: add resume to hydra.job.config.override_dirname.exclude_keys"
        )
    assert run_dirs(sweep) == [job_dir]  # continued in its directory
    assert not (job_dir / "error.txt").exists()
    a = json.loads((ref_dir / "summary.json").read_text())
    b = json.loads((job_dir / "summary.json").read_text())
    assert (b["final"], b["best"]) == (a["final"], a["best"])
    assert b["rounds"] == 200


def test_table_script_through_slurm_resumes_a_stopped_cell(slurm, sweeps, tmp_path):
    """A table script (scripts/reproduce_diversifed.sh, one method x two seeds) with the SLURM
    launcher: one job stopped by `scancel --signal=TERM` mid-run makes the script exit 1 with
    its line; the script run again resumes that cell from its checkpoint (the status line
    says so) and skips the finished one; the table equals the uninterrupted runs'."""
    tiny = (
        "clients=6 split.train_per_client=60 split.test_per_client=40 local_epochs=1 "
        f"model.hidden=[16] eval.every=10 checkpoint.every=5 device=cpu {CLI_BACKEND}"
    )
    env = {
        **ENV,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "METHODS": "fedavg",
        "SEEDS": "0,1",
        "ROUNDS": "60",
    }

    def table(out: Path, extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(REPO / "scripts" / "reproduce_diversifed.sh"), "table1_fmnist"],
            env={**env, "OUT": str(out), "EXTRA": extra}, cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    slurm_extra = f"{tiny} {' '.join(LAUNCHER)}"
    out = tmp_path / "slurm"
    sweep = out / "table1_fmnist" / "fedavg"
    sweeps.append(sweep)
    ref = table(tmp_path / "ref", tiny)  # here, without SLURM, meanwhile
    first = table(out, slurm_extra)

    def a_cell_in_its_rounds() -> Path | None:
        for d in sorted(sweep.glob("*seed=1*")):  # the second job: stop it, not the first
            if (d / "checkpoint.pt").exists():
                return d
        return None

    cell = wait_for(a_cell_in_its_rounds, "seed 1's first checkpoint", first)
    job = next(j for j in job_ids(sweep) if j.endswith("_1"))
    assert _run(["scancel", "--signal=TERM", job]).returncode == 0
    stdout, stderr = first.communicate(timeout=TIMEOUT)
    if (cell / "summary.json").exists():
        pytest.skip("the job finished its rounds before SIGTERM arrived")
    assert first.returncode == 1 and "SIGTERM: stopped after round" in stderr, stderr[-3000:]
    assert "run the same command again" in stderr

    again = table(out, slurm_extra)
    stdout, stderr = again.communicate(timeout=TIMEOUT)
    assert again.returncode == 0, stderr[-3000:]
    head = stdout.splitlines()[0]
    assert "2 cells: 1 done, 0 running, 1 left (1 resume from a checkpoint)" in head, head
    assert "2 cells: 2 done" in stdout
    ref_out, ref_err = ref.communicate(timeout=TIMEOUT)
    assert ref.returncode == 0, ref_err[-3000:]

    def table_of(text: str) -> str:
        lines = text.split("+ fedbench-report", 1)[1].splitlines()[1:]
        return "\n".join(ln for ln in lines if "/" not in ln)

    assert "FedAvg" in table_of(stdout) and table_of(stdout) == table_of(ref_out)
