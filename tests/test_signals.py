"""A signal at any moment of a run: one line on stderr, never a traceback, an exit status
that says what the files say (0: summary.json written and the run complete; 128 + signal:
stopped, with a checkpoint to continue from or with nothing kept), and the advised command
(the same one, or with resume=true / resume=auto) ends as the uninterrupted run.

The moments are exact: the fedbench command runs in this process and a hook sends the
signal to it at one point of the code (before the checks, while the data loads, after each
file written, in a given round, after the final table, between a sweep's jobs); the last
one, Python's exit handlers, needs a process of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import CLI_BACKEND, fmnist_available

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

TINY = ["clients=4", "split.train_per_client=50", "split.test_per_client=20",
        "model.hidden=[16]", "rounds=3", "eval.every=1", "checkpoint.every=0", "device=cpu",
        CLI_BACKEND]  # fmt: skip

pytestmark = [
    pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed"),
    pytest.mark.skipif(
        threading.current_thread() is not threading.main_thread(),
        reason="signal handlers are installed in the main thread only",
    ),
]


def fedbench(*args: str, capsys) -> tuple[int, str, str]:
    """`fedbench ARGS` in this process: (exit status, stdout, stderr). The signal handlers
    and fedbench's signal state are restored afterwards."""
    from hydra.core.global_hydra import GlobalHydra

    from fedbench import cli

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # as from a terminal: a suite started as a background job inherits SIGINT ignored, and
    # fedbench rightly leaves an ignored signal ignored (nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    argv = sys.argv
    cli._SIG = cli._Signals()
    sys.argv = ["fedbench", *args]
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
        for s, h in handlers.items():
            signal.signal(s, h)
        GlobalHydra.instance().clear()
    out, err = capsys.readouterr()
    return code, out, err


def the_line(err: str) -> str | None:
    """fedbench's one line on stderr (None: none); never a traceback."""
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) <= 1, err
    if lines:
        assert lines[0].startswith("fedbench: "), err
    return lines[0] if lines else None


def kill_me(sig: int = signal.SIGTERM, times: int = 1) -> None:
    for _ in range(times):
        os.kill(os.getpid(), sig)


def after_write(monkeypatch, module, name: str, suffix: str, **kill) -> None:
    """The signal as soon as `module.name` (an atomic write) wrote `suffix`."""
    real = getattr(module, name)

    def write(path, *a, **kw):
        real(path, *a, **kw)
        if str(path).endswith(suffix):
            kill_me(**kill)

    monkeypatch.setattr(module, name, write)


def in_round(monkeypatch, k: int, **kill) -> None:
    """The signal as round `k` (1-based) starts (its clients are being drawn)."""
    from fedbench.runner import Run

    real, calls = Run.sample, []

    def sample(self):
        calls.append(1)
        if len(calls) == k:
            kill_me(**kill)
        return real(self)

    monkeypatch.setattr(Run, "sample", sample)


def before(monkeypatch, module, name: str, **kill) -> None:
    """The signal as `module.name` is called."""
    real = getattr(module, name)

    def call(*a, **kw):
        kill_me(**kill)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, call)


def results(run: Path) -> tuple:
    s = json.loads((run / "summary.json").read_text())
    return s["final"], s["best"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple:
    """The uninterrupted run's final and best evaluations."""
    d = tmp_path_factory.mktemp("reference")
    capsys = _NoCapture()
    code, _, _ = fedbench(*TINY, f"hydra.run.dir={d / 'run'}", capsys=capsys)
    assert code == 0
    return results(d / "run")


class _NoCapture:
    def readouterr(self) -> tuple[str, str]:
        return "", ""


def hook(point: str, monkeypatch, sig: int) -> None:
    import fedbench.cli as cli
    import fedbench.run.build as build
    import fedbench.run.loop as loop
    import fedbench.run.record as record
    import fedbench.runner as runner

    if point == "checks":  # before anything: the config and directory checks
        before(monkeypatch, cli, "precheck", sig=sig)
    elif point == "data":  # set-up: the data loading, before the directory is claimed
        before(monkeypatch, build, "load_dataset", sig=sig)
    elif point == "config":  # the directory claimed, .hydra/config.yaml written
        after_write(monkeypatch, loop, "atomic_write_text", ".hydra/config.yaml", sig=sig)
    elif point == "partition":  # partition.json written, the loop not yet started
        after_write(monkeypatch, record, "atomic_write_json", "partition.json", sig=sig)
    elif point == "partition-twice":  # ... and a second one while the first is handled
        after_write(monkeypatch, record, "atomic_write_json", "partition.json", sig=sig)
        before(monkeypatch, cli, "_clean_stopped", sig=sig)
    elif point == "round-2":
        in_round(monkeypatch, 2, sig=sig)
    elif point == "last-round":
        in_round(monkeypatch, 3, sig=sig)
    elif point == "last-round-twice":  # the second signal: stop at once, before a checkpoint
        in_round(monkeypatch, 3, sig=sig, times=2)
    elif point == "summary":  # summary.json just written
        after_write(monkeypatch, record, "atomic_write_json", "summary.json", sig=sig)
    elif point == "table":  # the run returned; the final table is printed
        before(monkeypatch, runner, "final_table", sig=sig)
    else:  # pragma: no cover
        raise ValueError(point)


# point, signal, the exit status, what the line says, what continues the run
CASES = [
    ("checks", signal.SIGTERM, 143, "nothing written", "gone"),
    ("data", signal.SIGTERM, 143, "nothing kept", "gone"),
    ("config", signal.SIGTERM, 143, "nothing kept", "gone"),
    ("partition", signal.SIGINT, 130, "nothing kept", "same"),
    ("partition-twice", signal.SIGTERM, 143, "nothing kept", "gone"),
    ("round-2", signal.SIGTERM, 143, "checkpoint saved", "resume=true"),
    ("last-round", signal.SIGTERM, 0, "came as the run finished", None),
    ("last-round-twice", signal.SIGINT, 130, "before any checkpoint", "resume=auto"),
    ("summary", signal.SIGTERM, 0, "came as the run finished", None),
    ("table", signal.SIGTERM, 0, "came as the run finished", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("point,sig,code,says,then", CASES, ids=[c[0] for c in CASES])
def test_a_signal_at_any_moment(tmp_path, monkeypatch, capsys, reference, point, sig, code,
                                says, then):  # fmt: skip
    run = tmp_path / "run"
    cmd = [*TINY, f"hydra.run.dir={run}"]
    with monkeypatch.context() as m:
        hook(point, m, sig)
        got, _, err = fedbench(*cmd, capsys=capsys)
    line = the_line(err)
    assert got == code, (point, got, err)
    assert line is not None and says in line, (point, line)
    name = signal.Signals(sig).name
    assert line.startswith(f"fedbench: {name}"), line
    # the exit status says what the files say
    assert (run / "summary.json").exists() == (code == 0)
    if code == 0:
        assert results(run) == reference
        return
    if then in ("gone", "same"):  # nothing kept, not even the directory it made
        assert not run.exists(), sorted(p.name for p in run.iterdir())
        if then == "gone":
            return
        again = cmd  # the same command starts it afresh
    else:
        assert f"{then} hydra.run.dir={run}" in line, line
        assert (run / "checkpoint.pt").exists() == (then == "resume=true")
        again = [*cmd, then]
    if then == "resume=true":  # a resume stopped before it trains keeps the checkpoint
        with monkeypatch.context() as m:
            hook("partition", m, signal.SIGTERM)
            got, _, err = fedbench(*again, capsys=capsys)
        line = the_line(err)
        assert got == 143 and "the same command continues it" in line, line
        assert (run / "checkpoint.pt").exists() and not (run / "summary.json").exists()
    got, _, err = fedbench(*again, capsys=capsys)
    assert got == 0 and the_line(err) is None, err
    assert results(run) == reference


@pytest.mark.slow
def test_a_new_run_stopped_before_training_leaves_its_directory_as_found(tmp_path, monkeypatch,
                                                                        capsys):  # fmt: skip
    """A directory that existed (with a file of the user's) before the run: a signal after
    partition.json leaves it as it was, so the same command starts cleanly."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    with monkeypatch.context() as m:
        hook("partition", m, signal.SIGTERM)
        code, _, err = fedbench(*TINY, f"hydra.run.dir={run}", capsys=capsys)
    assert code == 143 and "nothing kept" in the_line(err)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_a_signal_between_a_sweeps_jobs_stops_the_sweep(tmp_path, monkeypatch, capsys,
                                                       reference):  # fmt: skip
    """The first job complete, the signal as it prints its table: the sweep stops before the
    second job (exit 143, one line); resume=auto skips the first and runs the second."""
    sweep = tmp_path / "sweep"
    cmd = ["-m", *TINY, "eval.every=1,3", f"hydra.sweep.dir={sweep}"]
    with monkeypatch.context() as m:
        hook("table", m, signal.SIGTERM)
        code, _, err = fedbench(*cmd, capsys=capsys)
    line = the_line(err)
    assert code == 143 and "the sweep stopped before job" in line, line
    assert f"resume=auto hydra.sweep.dir={sweep}" in line
    cells = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(cells) == 1 and results(cells[0]) == reference
    code, out, err = fedbench(*cmd, "resume=auto", capsys=capsys)
    assert code == 0 and the_line(err) is None, err
    assert "already finished" in out
    cells = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(cells) == 2
    assert all(results(c)[0] == reference[0] for c in cells)  # eval.every: the same final


@pytest.mark.slow
def test_a_signal_in_pythons_exit_handlers_changes_nothing(tmp_path):
    """SIGTERM while Python runs its exit handlers, after a finished run: exit 0, no
    "Exception ignored in atexit callback"."""
    run = tmp_path / "run"
    code = (
        "import atexit, os, signal\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))\n"
        "from fedbench.cli import main\n"
        "main()\n"
    )
    cmd = [sys.executable, "-c", code, *TINY, f"hydra.run.dir={run}"]
    r = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert the_line(r.stderr) is None
    assert (run / "summary.json").exists()
    assert re.search(r"results in .*run", r.stdout)
