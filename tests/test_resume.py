"""Checkpoint and resume: a run interrupted mid-way and resumed ends exactly as an
uninterrupted one with the same seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zygote

from conftest import SMALL_FMNIST, compose, crash_and_resume, fmnist_available, run_small
from fedbench.errors import ConfigError
from fedbench.runner import RESUME_MAY_CHANGE, Run, resume_differences

REPO = Path(__file__).resolve().parents[1]
# This checkout's fedbench, whatever the environment's editable install points at.
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLI = [sys.executable, "-c", "from fedbench.cli import main; main()"]

pytestmark = pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")


def results(summary: dict) -> dict:
    return {k: summary[k] for k in ("final", "best")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo,extra",
    [
        ("fedavg", []),
        ("local", []),
        # hand-written loops whose optimizer state is kept across rounds (engine.optim_states)
        ("apple", ["optim.persist_state=true", "optim.momentum=0.9"]),
        ("perfedavg", ["optim.persist_state=true", "optim.momentum=0.9"]),
        ("ditto", ["optim.persist_state=true", "optim.momentum=0.9"]),
    ],
)
def test_resume_after_crash_equals_uninterrupted(tmp_path, algo, extra, monkeypatch):
    over = [f"algo={algo}", "eval.every=2", "checkpoint.every=3", "participation=0.5", *extra]

    def killed_after_the_round_3_checkpoint(run_dir):
        assert not (run_dir / "summary.json").exists()
        ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
        assert ckpt["progress"]["next_round"] == 3

    full, resumed = crash_and_resume(
        tmp_path, monkeypatch, over, 7, die_at=5, after_crash=killed_after_the_round_3_checkpoint
    )
    assert results(resumed) == results(full)


@pytest.mark.slow
@pytest.mark.long
def test_sigkill_then_resume(tmp_path):
    """The real thing: SIGKILL the CLI after its first checkpoint, rerun with resume=true."""
    args = [*SMALL_FMNIST, "rounds=16", "eval.every=4", "checkpoint.every=2"]
    cli = CLI
    ref = subprocess.run(
        [*cli, *args, f"hydra.run.dir={tmp_path / 'ref'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
    )
    assert ref.returncode == 0, ref.stderr
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [*cli, *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not (run_dir / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists(), "the run finished before it was killed"
    for f in ("metrics.csv", "clients.csv", "partition.json"):  # complete files or none
        p = run_dir / f
        if p.exists() and f.endswith(".json"):
            json.loads(p.read_text())
    again = subprocess.run(
        [*cli, *args, "resume=true", f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
    )
    assert again.returncode == 0, again.stderr
    a = json.loads((tmp_path / "ref" / "summary.json").read_text())
    b = json.loads((run_dir / "summary.json").read_text())
    assert results(a) == results(b)


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.quick
def test_resume_differences_names_keys_outside_the_allowed_ones():
    saved = {
        "seed": 0,
        "rounds": 5,
        "algo": {"name": "fedavg"},
        "optim": {"lr": 0.1},
        "eval": {"every": 1},
        "engine": {"backend": "auto"},
        "device": "cpu",
    }
    now = {
        "seed": 1,
        "rounds": 9,
        "algo": {"name": "fedprox", "mu": 0.01},
        "optim": {"lr": 0.1},
        "eval": {"every": 3},
        "engine": {"backend": "vmap"},
        "device": "cuda",
    }
    assert resume_differences(saved, now) == [
        "algo.mu (absent -> 0.01)",
        "algo.name ('fedavg' -> 'fedprox')",
        "seed (0 -> 1)",
    ]
    assert set(RESUME_MAY_CHANGE) == {
        "rounds",
        "eval.every",
        "eval.batch_size",
        "checkpoint",
        "log",
        "objective",
        "device",
        "engine",
        "resume",
        "data.root",
        "data.download",
    }
    # eval.every may change, eval.s_frac (the S sets) and eval.tail (top5/bottom5) may not
    assert resume_differences(
        {"eval": {"every": 1, "s_frac": 0.5, "tail": 0.05}},
        {"eval": {"every": 5, "s_frac": 0.2, "tail": 0.1}},
    ) == ["eval.s_frac (0.5 -> 0.2)", "eval.tail (0.05 -> 0.1)"]
    # data.root may move, data.name may not
    assert (
        resume_differences(
            {"data": {"name": "fmnist", "root": "/a"}}, {"data": {"name": "fmnist", "root": "/b"}}
        )
        == []
    )
    assert resume_differences({"data": {"name": "fmnist"}}, {"data": {"name": "cifar10"}}) == [
        "data.name ('fmnist' -> 'cifar10')"
    ]


@pytest.mark.slow
def test_refused_resume_exits_2_and_leaves_the_directory_as_it_was(tmp_path):
    """CLI end to end: a finished run, then resumes with another algorithm, seed and lr, and
    another split: each is one line naming the differing keys, exit 2, and every file of the
    run directory (Hydra's .hydra/ and log included) is byte-identical afterwards."""
    run_dir = tmp_path / "run"
    args = [*SMALL_FMNIST, "rounds=2", "eval.every=1", "checkpoint.every=1"]
    first = zygote.run([*args, f"hydra.run.dir={run_dir}"], tmp_path, ENV)
    assert first.returncode == 0, first.stderr
    before = snapshot(run_dir)
    assert "checkpoint.pt" in before and "summary.json" in before and ".hydra/config.yaml" in before
    changed = {
        "algo": (
            ["algo=fedprox", "optim.lr=0.2", "seed=3", "rounds=4", "eval.every=2"],
            ["algo.name ('fedavg' -> 'fedprox')", "optim.lr (", "seed (0 -> 3)"],
        ),
        "split": (["split=dir", "device=cpu"], ["split.name ('pat' -> 'dir')"]),
    }
    for over, named in changed.values():
        r = zygote.run([*args, *over, "resume=true", f"hydra.run.dir={run_dir}"], tmp_path, ENV)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and r.stdout == "", r.stderr
        for key in named:
            assert key in lines[0]
        differing = lines[0].split("(only")[0]  # the list of keys that may change follows
        for allowed in ("rounds (", "eval.every", "device ("):
            assert allowed not in differing
        assert snapshot(run_dir) == before


@pytest.mark.slow
def test_refused_resume_through_the_api_writes_nothing(tmp_path):
    """Run(cfg, dir) (the multirun and library path) refuses before it loads data or writes."""
    if not fmnist_available():
        pytest.skip("FMNIST not installed")
    run_small(tmp_path, ["checkpoint.every=1"], rounds=2)
    before = snapshot(tmp_path)
    cfg = compose(
        [*SMALL_FMNIST, "rounds=2", "checkpoint.every=1", "model.hidden=[32]", "resume=true"]
    )
    with pytest.raises(ConfigError, match=r"model.hidden \(\[64\] -> \[32\]\)"):
        Run(cfg, tmp_path, progress=False)
    cfg = compose([*SMALL_FMNIST, "rounds=1", "checkpoint.every=1", "resume=true"])
    with pytest.raises(ConfigError, match="rounds=1 but .* has 2 rounds done"):
        Run(cfg, tmp_path, progress=False)
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_finished_run_extends_without_redoing_rounds(tmp_path, monkeypatch):
    """rounds=2 to the end, then rounds=4 resume=true: rounds 3 and 4 only, and the same
    numbers as an uninterrupted 4-round run."""
    over = ["algo=fedprox", "eval.every=1", "checkpoint.every=5", "participation=0.5"]
    full, _ = run_small(tmp_path / "full", over, rounds=4)
    run_small(tmp_path / "run", over, rounds=2)
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["progress"]["next_round"] == 2  # the last round is saved
    assert ckpt["config"]["algo"]["name"] == "fedprox"

    ext = Run(
        compose([*SMALL_FMNIST, "rounds=4", *over, "resume=true"]), tmp_path / "run", progress=False
    )
    seen = []
    real_round = ext.algo.round
    monkeypatch.setattr(ext.algo, "round", lambda t, c: seen.append(t) or real_round(t, c))
    assert results(ext.run()) == results(full)
    assert seen == [2, 3]
    m = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert m["rounds"] == 4 and m["final"]["round"] == 4
    again = Run(
        compose([*SMALL_FMNIST, "rounds=4", *over, "resume=true"]), tmp_path / "run", progress=False
    )
    monkeypatch.setattr(again.algo, "round", lambda t, c: pytest.fail("a round was redone"))
    assert results(again.run()) == results(full)
