"""Nothing lost, nothing mislabelled, never a traceback: run directories that belong to one
run, refused commands that change nothing, every config value checked, faults (a corrupt
checkpoint, a read-only or full disk, SIGTERM / Ctrl-C) that end in one line, and resumes
that make one run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import zygote

from conftest import CLI_BACKEND, SMALL_FMNIST, compose, fmnist_available

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLI = [sys.executable, "-c", "from fedbench.cli import main; main()"]
TINY = [*SMALL_FMNIST, "clients=6", "split.train_per_client=60", "split.test_per_client=20",
        CLI_BACKEND]  # fmt: skip

# The finished run's command (the `finished` fixture) and the resumes of its copies.
FINISHED = [*TINY, "rounds=2", "eval.every=1", "checkpoint.every=1"]

needs_fmnist = pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")


def fedbench(*args: str, cwd) -> subprocess.CompletedProcess:
    """`fedbench ARGS` as a new process, forked with fedbench imported (tests/zygote.py)."""
    return zygote.run(args, cwd=cwd, env=ENV, timeout=300)


def snapshot(d: Path) -> dict[str, str]:
    """Every file under d (hidden ones too) by its content hash."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def one_line(r: subprocess.CompletedProcess, code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "][fedbench][" not in ln]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("fedbench:"), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-round run (checkpointed), shared read-only by the tests below."""
    if not fmnist_available():
        pytest.skip("FMNIST not installed")
    d = tmp_path_factory.mktemp("finished")
    r = fedbench(*FINISHED, "hydra.run.dir=run", cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "run"


# ----------------------------------------------------------------------------- every value
BAD_VALUES = [
    (["optim.momentum=-1"], "optim.momentum"),
    (["optim.weight_decay=-1"], "optim.weight_decay"),
    (["optim.betas=[2,3]"], "optim.betas"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["optim.lr_decay=0"], "optim.lr_decay"),
    (["optim.lr=nan"], "optim.lr"),
    (["optim.lr=inf"], "optim.lr"),
    (["optim.lr=0"], "optim.lr"),
    (["checkpoint.every=-2"], "checkpoint.every"),
    (["checkpoint.every=abc"], "checkpoint.every"),
    (["eval.tail=2"], "eval.tail"),
    (["eval.batch_size=0"], "eval.batch_size"),
    (["eval.s_frac=1.5"], "eval.s_frac"),
    (["resume=no"], "resume"),
    (["seed=99999999999999999999"], "seed"),
    (["seed=-1"], "seed"),
    (["participation=1.5"], "participation"),
    (["participation=0"], "participation"),
    (["participation=25"], "participation"),
    (["clients=0"], "clients"),
    (["rounds=0"], "rounds"),
    (["attack.kind=a1", "attack.fraction=1.0"], "attack.fraction"),
    (["attack.kind=a2", "clients=2", "attack.fraction=0.9"], "attack.fraction"),
    (["attack.kind=a3"], "attack.kind"),
    (["engine.backend=jax"], "engine.backend"),
    (["engine.chunk_clients=0"], "engine.chunk_clients"),
    (["device=tpu"], "device"),
    (["model.hidden=[0]"], "model.hidden"),
    (["split=dir", "split.alpha=0"], "split.alpha"),
    (["split.test_mode=both"], "split.test_mode"),
    (["split.train_frac=1"], "split.train_frac"),
    (["data.augment=maybe"], "data.augment"),
    (["algo=fedprox", "algo.mu=nan"], "algo.mu"),
    (["+optim.lrr=0.1"], "optim.lrr"),
    (["+model.layer_unit=cell"], "model.layer_unit"),
]


@pytest.mark.quick
@pytest.mark.parametrize("args,key", BAD_VALUES)
def test_every_bad_value_is_refused_before_anything_runs(args, key):
    from fedbench.cli import refusal

    msg = refusal(args)
    assert msg is not None and msg.startswith("fedbench: ") and key in msg, msg
    assert "\n" not in msg


@pytest.mark.quick
def test_data_root_that_is_a_file_is_refused(tmp_path):
    from fedbench.cli import refusal

    f = tmp_path / "a-file"
    f.write_text("x")
    msg = refusal([f"data.root={f}"])
    assert msg is not None and "is a file, not a directory" in msg


@pytest.mark.quick
def test_experiment_without_plus_says_how(tmp_path):
    from fedbench.cli import refusal

    msg = refusal(["experiment=fedpg_table1_fmnist"])
    assert msg is not None and "+experiment=" in msg


@pytest.mark.quick
@pytest.mark.parametrize("group", ["data", "split", "model", "server_opt"])
def test_every_option_yaml_matches_its_schema(group):
    """The schema (fedbench/config.py) and conf/<group>/<option>.yaml name the same keys."""
    import dataclasses

    import yaml

    from fedbench.config import GROUPS
    from fedbench.schema import listed_keys

    files = sorted((REPO / "conf" / group).glob("*.yaml"))
    assert sorted(p.stem for p in files) == sorted(GROUPS[group])
    for p in files:
        keys = set(yaml.safe_load(p.read_text())) - {"name"}
        schema = GROUPS[group][p.stem]
        assert keys == set(listed_keys(schema)), p
        # the rest: the option's name and keys no YAML lists (`+model.layer_unit=...`)
        rest = {f.name for f in dataclasses.fields(schema)} - keys
        assert all(
            f.metadata.get("chosen") or f.metadata.get("optional")
            for f in dataclasses.fields(schema)
            if f.name in rest
        ), p


@pytest.mark.slow
@pytest.mark.long
def test_every_preset_and_option_passes_the_schema():
    from fedbench.config import check_config

    for p in sorted((REPO / "conf" / "experiment").glob("*.yaml")):
        if not p.stem.endswith("common"):
            check_config(compose([f"+experiment={p.stem}"]))
    for group in ("data", "split", "model", "algo", "server_opt"):
        for p in sorted((REPO / "conf" / group).glob("*.yaml")):
            check_config(compose([f"{group}={p.stem}"]))


@pytest.mark.quick
def test_sweep_values_are_checked_job_by_job_before_the_sweep_starts(tmp_path):
    from fedbench.cli import refusal

    msg = refusal(["-m", "optim.lr=0.1,nan", f"hydra.sweep.dir={tmp_path / 's'}"])
    assert msg is not None and "optim.lr" in msg and "job 1" in msg
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------- one run, one dir
@pytest.mark.slow
@pytest.mark.long
def test_default_directories_differ_for_runs_started_together():
    """The default run directory carries a per-process token: two processes composing in
    the same second get different names (a job array, a joblib pool)."""
    code = (
        "from fedbench.cli import precheck; import sys; "
        "print(precheck(['clients=4']).run_dir); print(precheck(['-m', 'seed=0,1']).sweep_dir)"
    )
    out = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
        for _ in range(3)
    ]
    names = [p.communicate(timeout=120)[0].split() for p in out]
    assert len({n[0] for n in names}) == 3 and len({n[1] for n in names}) == 3


@pytest.mark.slow
@needs_fmnist
def test_a_finished_run_is_never_written_into_without_resume(tmp_path, finished):
    before = snapshot(finished)
    for extra in (
        [],
        ["optim.lr=0.5", "participation=1.5"],  # refused values: the run is not relabelled
        ["resume=true", "device=tpu"],
        ["resume=true", "eval.s_frac=0.2"],  # would change what personal.S means mid-file
    ):
        r = fedbench(*FINISHED, f"hydra.run.dir={finished}", *extra, cwd=tmp_path)
        line = one_line(r)
        assert snapshot(finished) == before, (extra, line)


@pytest.mark.slow
def test_a_run_refused_after_hydra_started_leaves_no_directory(tmp_path):
    """Missing data files are found once the run is built (after Hydra made the run
    directory): the refusal removes the folders this command created."""
    (tmp_path / "empty").mkdir()
    run = tmp_path / "new" / "run"
    r = fedbench("data=cifar10", f"data.root={tmp_path / 'empty'}", "data.download=false",
                 f"hydra.run.dir={run}", cwd=tmp_path)  # fmt: skip
    assert "cifar" in one_line(r).lower()
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@needs_fmnist
@pytest.mark.long
def test_a_second_run_into_a_directory_in_use_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    args = [
        *TINY,
        "rounds=100000",
        "eval.every=50000",
        "checkpoint.every=0",
        f"hydra.run.dir={run}",
    ]
    first = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (run / "partition.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert (run / ".fedbench.lock").exists()
        second = fedbench(*args, cwd=tmp_path)
        line = one_line(second)
        assert f"pid {first.pid}" in line or "holds another run" in line, line
        second = fedbench(*args, "resume=true", cwd=tmp_path)
        assert f"in use by pid {first.pid}" in one_line(second)
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    assert not (run / ".fedbench.lock").exists()  # released on the way out


@pytest.mark.quick
def test_claim_refuses_a_held_directory_and_frees_it_on_release(tmp_path):
    from fedbench.rundir import RunDir, RunDirError

    held = RunDir.claim(tmp_path / "d", resume=False)
    with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()}"):
        RunDir.claim(tmp_path / "d", resume=False)
    held.release()
    RunDir.claim(tmp_path / "d", resume=False).release()
    (tmp_path / "d" / "summary.json").write_text("{}")
    with pytest.raises(RunDirError, match="holds another run"):
        RunDir.claim(tmp_path / "d", resume=False)
    RunDir.claim(tmp_path / "d", resume=True).release()


@pytest.mark.quick
def test_claim_removes_orphaned_temporary_files(tmp_path):
    from fedbench.rundir import RunDir

    d = tmp_path / "d"
    (d / ".hydra").mkdir(parents=True)
    orphans = [d / ".metrics.csv.abc123.tmp", d / ".checkpoint.pt.x.tmp", d / ".hydra/.c.y.tmp"]
    for p in orphans:
        p.write_bytes(b"half")
    (d / "keep.tmp").write_text("not ours")
    RunDir.claim(d, resume=True).release()
    assert not any(p.exists() for p in orphans) and (d / "keep.tmp").exists()


# ----------------------------------------------------------------------------- resume = one run
@pytest.mark.quick
def test_resume_needs_an_explicit_directory():
    from fedbench.cli import refusal

    msg = refusal(["resume=true"])
    assert msg is not None and "hydra.run.dir=" in msg
    msg = refusal(["-m", "resume=true", "seed=0,1"])
    assert msg is not None and "hydra.sweep.dir=" in msg


@pytest.fixture
def finished_copy(tmp_path, finished) -> Path:
    """A copy of the finished run that a test may damage."""
    import shutil

    return Path(shutil.copytree(finished, tmp_path / "run"))


def resume(run: Path, cwd: Path) -> subprocess.CompletedProcess:
    return fedbench(*FINISHED, "resume=true", f"hydra.run.dir={run}", cwd=cwd)


@pytest.mark.slow
@needs_fmnist
def test_corrupt_checkpoint_is_one_line(tmp_path, finished_copy):
    run = finished_copy
    data = (run / "checkpoint.pt").read_bytes()
    for broken in (data[: len(data) // 2], b"garbage" * 10, b""):
        (run / "checkpoint.pt").write_bytes(broken)
        before = snapshot(run)
        # extended: the same rounds would be "already finished", loading nothing
        r = fedbench(*FINISHED, "rounds=3", "resume=true", f"hydra.run.dir={run}", cwd=tmp_path)
        assert "damaged" in one_line(r)
        assert snapshot(run) == before


@pytest.mark.slow
@needs_fmnist
def test_resuming_a_finished_run_restores_a_deleted_metrics_csv(tmp_path, finished_copy):
    run = finished_copy
    want = (run / "metrics.csv").read_bytes()
    (run / "metrics.csv").unlink()
    r = resume(run, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (run / "metrics.csv").read_bytes() == want


@pytest.mark.slow
@needs_fmnist
def test_result_files_are_readable_by_collaborators(finished):
    mask = os.umask(0)
    os.umask(mask)
    for name in ("summary.json", "metrics.csv", "clients.csv", "checkpoint.pt", "partition.json",
                 ".hydra/config.yaml"):  # fmt: skip
        mode = (finished / name).stat().st_mode & 0o777
        assert mode == 0o666 & ~mask, (name, oct(mode))


def _rows_without_time(path: Path) -> pd.DataFrame:
    return pd.read_csv(path).drop(columns=["wall_time_s", "cpu_time_s"], errors="ignore")


@pytest.mark.slow
@needs_fmnist
def test_resume_cuts_appended_rows_back_to_the_checkpoint(tmp_path, monkeypatch):
    """Killed after rows past its checkpoint were appended: the resumed run's metrics.csv and
    clients.csv equal an uninterrupted run's (no row twice, none missing)."""
    from conftest import crash_and_resume

    over = ["eval.every=1", "checkpoint.every=3"]
    full, resumed = crash_and_resume(tmp_path, monkeypatch, over, 6, die_at=5)
    assert full["final"] == resumed["final"]
    a, b = tmp_path / "full", tmp_path / "run"
    pd.testing.assert_frame_equal(_rows_without_time(a / "metrics.csv"),
                                  _rows_without_time(b / "metrics.csv"))  # fmt: skip
    assert (a / "clients.csv").read_bytes() == (b / "clients.csv").read_bytes()
    ckpt = torch.load(b / "checkpoint.pt", weights_only=False)
    assert "client_rows" not in ckpt["progress"]  # the checkpoint does not grow with clients.csv
    assert ckpt["progress"]["clients_len"] == (b / "clients.csv").stat().st_size


@pytest.mark.quick
def test_csv_appender_widens_its_header_and_cuts_a_partial_row(tmp_path):
    from fedbench.io import CsvAppender

    p = tmp_path / "m.csv"
    a = CsvAppender(p)
    a.append([{"round": 1, "x": 0.1}])
    a.append([{"round": 2, "x": float("nan"), "y": 3}])  # a new column: rewritten once
    with open(p, "ab") as f:
        f.write(b"3,0.5")  # a killed append's half row
    a.append([{"round": 3, "x": 0.25, "y": 1}])
    df = pd.read_csv(p)
    assert list(df.columns) == ["round", "x", "y"] and list(df["round"]) == [1, 2, 3]
    assert df["x"].isna().tolist() == [False, True, False] and df["y"].tolist()[1:] == [3, 1]


@pytest.mark.quick
def test_few_test_samples_are_warned_about(caplog):
    import numpy as np

    from fedbench.run.build import _warn_small_tests

    with caplog.at_level("WARNING", logger="fedbench"):
        _warn_small_tests([np.arange(1), np.arange(50), np.arange(3)])
    assert "2 of 3 clients have fewer than 10 test samples (smallest: 1)" in caplog.text


# ----------------------------------------------------------------------------- signals
SIGNALLED = [*TINY, "rounds=300", "eval.every=100", "checkpoint.every=0"]


@pytest.fixture(scope="session")  # with the tests' xdist_group: made once
def uninterrupted(tmp_path_factory) -> dict:
    """The signal tests' run, uninterrupted: its summary."""
    d = tmp_path_factory.mktemp("uninterrupted")
    ref = fedbench(*SIGNALLED, f"hydra.run.dir={d / 'run'}", cwd=d)
    assert ref.returncode == 0, ref.stderr
    return json.loads((d / "run" / "summary.json").read_text())


@pytest.mark.slow
@needs_fmnist
@pytest.mark.xdist_group("signals")  # one worker: the uninterrupted run is made once
# SIGINT (Ctrl-C) in the README's command; SIGTERM (a scheduler's preemption) in the long tests
@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.long), signal.SIGINT]
)
def test_signal_saves_a_checkpoint_and_resume_equals_uninterrupted(tmp_path, sig, uninterrupted):
    run = tmp_path / "run"
    proc = subprocess.Popen([*CLI, *SIGNALLED, f"hydra.run.dir={run}"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 120
    while not (run / "partition.json").exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # into the rounds
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    line = one_line(subprocess.CompletedProcess([], proc.returncode, out, err), 128 + sig)
    assert "checkpoint saved" in line and "resume=true" in line, line
    assert (run / "checkpoint.pt").exists() and not (run / "summary.json").exists()
    again = fedbench(*SIGNALLED, "resume=true", f"hydra.run.dir={run}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    a, b = uninterrupted, json.loads((run / "summary.json").read_text())
    assert (a["final"], a["best"]) == (b["final"], b["best"])


# ----------------------------------------------------------------------------- disks
@contextlib.contextmanager
def tmpfs(path: Path, size: str, ro: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.slow
@needs_fmnist
def test_read_only_directory_is_one_line(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", ro=True) as ro:
        for d in (ro, ro / "sub" / "run"):
            r = fedbench(*TINY, "rounds=1", f"hydra.run.dir={d}", cwd=tmp_path)
            assert "read-only" in one_line(r)


@pytest.mark.slow
@needs_fmnist
def test_full_disk_is_one_line_and_keeps_the_files_there(tmp_path):
    """A disk that fills mid-run: one line, exit 2, no temporary file left, and every file
    already written is complete (the checkpoint of this model is ~1 MB; the disk 600 kB)."""
    with tmpfs(tmp_path / "small", "600k") as small:
        run = small / "run"
        r = fedbench(*TINY, "rounds=3", "eval.every=1", "checkpoint.every=1",
                     f"hydra.run.dir={run}", cwd=tmp_path)  # fmt: skip
        line = one_line(r)
        assert "No space left" in line or "no space" in line, line
        assert not list(run.glob(".*.tmp"))
        json.loads((run / "partition.json").read_text())
        pd.read_csv(run / "metrics.csv")


@pytest.mark.slow
@needs_fmnist
def test_a_sweep_rerun_into_its_directory_refuses_every_job_and_exits_1(tmp_path):
    """Every job's directory holds the first sweep's run: each is refused (nothing written
    into it), the sweep lists them and exits 1."""
    sweep = tmp_path / "sweep"
    args = ["-m", "seed=0,1", *TINY, "rounds=1", f"hydra.sweep.dir={sweep}"]
    assert fedbench(*args, cwd=tmp_path).returncode == 0
    runs = sorted(p for p in sweep.iterdir() if not p.name.startswith("."))
    before = {p.name: snapshot(p) for p in runs}
    r = fedbench(*args, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("fedbench: job ")]
    assert len(failed) == 2 and all("holds another run" in ln for ln in failed), r.stderr
    assert {p.name: snapshot(p) for p in runs} == before


@pytest.mark.slow
@needs_fmnist
def test_resume_auto_skips_a_finished_run_and_starts_an_empty_one(tmp_path):
    """resume=auto (table scripts, requeued jobs): an empty directory starts, a finished run
    of the same config is skipped without writing anything, a longer one extends it."""
    run = tmp_path / "run"
    args = [*FINISHED, "resume=auto"]
    first = fedbench(*args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = snapshot(run)
    again = fedbench(*args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert again.returncode == 0 and "already finished (round 2): skipped" in again.stdout
    assert snapshot(run) == before
    longer = fedbench(*args, "rounds=3", f"hydra.run.dir={run}", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    assert json.loads((run / "summary.json").read_text())["final"]["round"] == 3
    other = fedbench(*args, "optim.lr=0.2", f"hydra.run.dir={run}", cwd=tmp_path)
    assert "optim.lr" in one_line(other)  # another config is still refused
