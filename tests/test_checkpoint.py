"""Checkpoints are data, verified, and resumed only into the run they belong to.

- Data, never code: every algorithm's state is written and read back with
  `weights_only=True`; a crafted pickle (a `__reduce__` that writes a marker file) is one line
  and exit 2 on resume=true and on a refused resume, and resume=auto / resume=true of a
  finished run load nothing: the marker never appears.
- Verified: `checkpoint.pt.sha256`; bytes flipped in the middle, a cut and an appended tail
  are one line and exit 2; a kill between the checkpoint's and the digest's writes leaves a
  pair that verifies the last complete checkpoint.
- The same run: other data of the same shape are refused (a moved copy is not); a checkpoint
  without its config is checked against .hydra/config.yaml; resume=true into a missing or
  empty directory is refused naming resume=auto; a finished run is not rewritten; an extended
  run drops the evaluation its shorter run made only because it ended there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from test_reliability import FINISHED, TINY, fedbench, one_line, snapshot
from test_sources import write_fmnist, write_idx

from conftest import (
    CLI_BACKEND,
    SMALL_FMNIST,
    TinyFed,
    bn_mlp,
    compose,
    fmnist_available,
    run_small,
)
from fedbench import checkpoint
from fedbench.algorithms import ALGORITHMS
from fedbench.checkpoint import CheckpointError, check_resume, load_run_state, load_verified, save
from fedbench.config import load_config
from fedbench.engine import ClientRows, Engine
from fedbench.errors import ConfigError
from fedbench.trees import plain

needs_fmnist = pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")


class Evil:
    """What a crafted checkpoint carries: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_digest(path: Path) -> None:
    """The digest file an attacker who rewrites checkpoint.pt writes too."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (path.parent / (path.name + ".sha256")).write_text(f"{digest}  {path.name}\n")


def minimal_state(next_round: int = 2, config: dict | None = None, **extra) -> dict:
    return {"format": 2, "progress": {"next_round": next_round}, "algo": {}, "config": config,
            **extra}  # fmt: skip


# ----------------------------------------------------------------------------- data only
@pytest.mark.quick
@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithms_state_is_data_and_restores_exactly(tmp_path, name):
    """A round, the state through save / load_verified (weights_only), into a fresh
    instance: every state tensor and value is the saved one."""
    fed = TinyFed()
    cfg = compose([f"algo={name}", "batch_size=64", "optim.lr=0.1",
                   "optim.persist_state=true", "optim.momentum=0.9"])  # fmt: skip
    torch.manual_seed(0)
    eng = Engine(fed, bn_mlp(), device="cpu")
    algo = ALGORITHMS.get(name).from_config(load_config(cfg), fed, eng, bn_mlp)
    algo.round(0, [0, 1, 2])
    state = {**minimal_state(), "algo": algo.state_dict(), "engine": eng.state_dict()}
    save(tmp_path / "checkpoint.pt", state)
    back, _ = load_run_state(tmp_path / "checkpoint.pt")  # per-client rows from their shards
    torch.manual_seed(1)
    eng2 = Engine(fed, bn_mlp(), device="cpu")
    fresh = ALGORITHMS.get(name).from_config(load_config(cfg), fed, eng2, bn_mlp)
    fresh.load_state_dict(back["algo"])
    eng2.load_state_dict(back["engine"])

    def same(a, b, where):
        if isinstance(a, ClientRows):
            assert isinstance(b, ClientRows) and torch.equal(a.written, b.written), where
            a, b = a.all(), b.all()
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list | tuple):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{where}[{i}]")
        else:
            assert a == b, where

    same(algo.state_dict(), fresh.state_dict(), name)
    same(eng.state_dict(), eng2.state_dict(), f"{name} engine")


@pytest.mark.quick
def test_a_state_that_would_not_load_again_fails_when_saved(tmp_path):
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"state\.algo\.x is a .*Opaque"):
        save(tmp_path / "checkpoint.pt", {**minimal_state(), "algo": {"x": Opaque()}})
    assert not (tmp_path / "checkpoint.pt").exists()
    # numpy scalars and str subclasses become plain values; the rest is as it was
    path = tmp_path / "checkpoint.pt"
    save(path, {**minimal_state(), "algo": {"f": np.float32(0.5), "v": torch.__version__}})
    algo = load_verified(path)[0]["algo"]
    assert algo == {"f": 0.5, "v": str(torch.__version__)} and type(algo["v"]) is str


@pytest.mark.quick
def test_a_crafted_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "MARKER"
    path = tmp_path / "checkpoint.pt"
    torch.save({**minimal_state(), "progress": {"next_round": Evil(marker)}}, path)
    with pytest.raises(CheckpointError, match=r"not checkpoint data.*posix\.system"):
        load_verified(path)  # no digest file: an older fedbench's, read as data only
    write_digest(path)
    with pytest.raises(CheckpointError, match=r"not checkpoint data.*posix\.system"):
        load_verified(path)
    assert not marker.exists()


# ----------------------------------------------------------------------------- verified
@pytest.mark.quick
def test_any_change_to_the_bytes_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save(path, {**minimal_state(), "algo": {"w": torch.randn(20_000)}})
    good = path.read_bytes()
    mid = len(good) // 2
    damaged = {
        "flipped": good[:mid] + bytes(b ^ 0xFF for b in good[mid : mid + 64]) + good[mid + 64 :],
        "cut": good[:mid],
        "appended": good + b"\0" * 100,
        "empty": b"",
    }
    for what, data in damaged.items():
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match="damaged or changed") as e:
            load_verified(path)
        assert "\n" not in str(e.value), what
    path.write_bytes(good)
    side = tmp_path / "checkpoint.pt.sha256"
    text = side.read_text()
    side.write_text("not a digest\n")
    with pytest.raises(CheckpointError, match="sha256 cannot be read"):
        load_verified(path)
    side.unlink()
    with pytest.raises(CheckpointError, match="sha256 is missing"):
        load_verified(path)
    side.write_text(text)
    assert load_verified(path)[0]["algo"]["w"].shape == (20_000,)


@pytest.mark.quick
def test_an_older_checkpoint_without_digest_is_checked_by_its_zip_crcs(tmp_path):
    path = tmp_path / "checkpoint.pt"
    old = {"progress": {"next_round": 1, "metrics_csv": b""}, "algo": {"w": torch.ones(5000)}}
    torch.save(old, path)  # as fedbench 0.x wrote it: no format key, no digest file
    assert torch.equal(load_verified(path)[0]["algo"]["w"], torch.ones(5000))
    data = bytearray(path.read_bytes())
    i = data.find(np.ones(4, dtype=np.float32).tobytes())  # inside the tensor's bytes
    data[i : i + 8] = b"\x00" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="CRC-32"):
        load_verified(path)


@pytest.mark.quick
def test_a_kill_between_the_two_writes_leaves_a_verifiable_pair(tmp_path, monkeypatch):
    """Killed after the digest file announced the new checkpoint but before its rename: the
    previous checkpoint verifies; killed after the rename, before the digest file's final
    write: the new one verifies. A first checkpoint killed before its rename: none."""
    path = tmp_path / "checkpoint.pt"
    _, d1 = save(path, minimal_state(1))
    real_replace = os.replace

    def killed_at(n):
        calls = []

        def replace(src, dst):
            calls.append(dst)
            if len(calls) == n:
                raise KeyboardInterrupt  # as if killed here
            real_replace(src, dst)

        return replace

    # replaces: 1 the announcing digest file, 2 the checkpoint, 3 the final digest file
    monkeypatch.setattr(os, "replace", killed_at(2))
    with pytest.raises(KeyboardInterrupt):
        save(path, minimal_state(2), previous=d1)
    assert load_verified(path)[0]["progress"]["next_round"] == 1
    assert len((tmp_path / "checkpoint.pt.sha256").read_text().splitlines()) == 2
    monkeypatch.setattr(os, "replace", killed_at(3))
    with pytest.raises(KeyboardInterrupt):
        save(path, minimal_state(3), previous=d1)
    state, d3 = load_verified(path)
    assert state["progress"]["next_round"] == 3
    monkeypatch.setattr(os, "replace", real_replace)
    save(path, minimal_state(4), previous=d3)
    assert len((tmp_path / "checkpoint.pt.sha256").read_text().splitlines()) == 1
    fresh = tmp_path / "new" / "checkpoint.pt"
    monkeypatch.setattr(os, "replace", killed_at(2))
    with pytest.raises(KeyboardInterrupt):
        save(fresh, minimal_state(1))
    assert not fresh.exists()


# ----------------------------------------------------------------------------- resume checks
@pytest.mark.quick
def test_resume_true_into_a_missing_or_empty_directory_names_resume_auto(tmp_path):
    from fedbench.cli import refusal

    (tmp_path / "empty").mkdir()
    for d in (tmp_path / "typo", tmp_path / "empty"):
        msg = refusal([*TINY, "resume=true", f"hydra.run.dir={d}"])
        assert msg is not None and "resume=auto" in msg and "no run to resume" in msg, msg
        assert "\n" not in msg
    assert refusal([*TINY, "resume=auto", f"hydra.run.dir={tmp_path / 'typo'}"]) is None
    assert not (tmp_path / "typo").exists() and not any((tmp_path / "empty").iterdir())
    # a sweep's job that has not started yet (Run.__init__'s check) starts fresh
    cfg = compose([*TINY, "resume=true"])
    assert check_resume(cfg, tmp_path / "typo") is None


@pytest.mark.quick
def test_a_checkpoint_without_its_config_is_checked_against_hydra_config(tmp_path):
    fedavg = compose([*TINY, "algo=fedavg", "rounds=2", "resume=true"])
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(fedavg))
    save(tmp_path / "checkpoint.pt", minimal_state(2, config=None))
    fedprox = compose([*TINY, "algo=fedprox", "rounds=3", "resume=true"])
    with pytest.raises(ConfigError, match=r"algo.name \('fedavg' -> 'fedprox'\)"):
        check_resume(fedprox, tmp_path)
    longer = compose([*TINY, "algo=fedavg", "rounds=3", "resume=true"])
    assert check_resume(longer, tmp_path).next_round == 2
    (tmp_path / ".hydra" / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="nothing to check this config against"):
        check_resume(longer, tmp_path)


@pytest.mark.quick
def test_a_checkpoint_with_the_old_shared_augmentation_stream_is_refused(tmp_path):
    """Augmentation is keyed now (no generator state): a checkpoint that saved the old
    federation-wide stream cannot continue exactly and is refused in one line; an old one
    without augmentation (its "augment" None) resumes."""
    cfg = compose([*TINY, "algo=fedavg", "rounds=3", "resume=true"])
    config = plain(cfg)
    save(tmp_path / "checkpoint.pt", minimal_state(2, config, augment=torch.zeros(5056)))
    with pytest.raises(ConfigError, match="older fedbench whose data.augment") as e:
        check_resume(cfg, tmp_path)
    assert "\n" not in str(e.value)
    save(tmp_path / "checkpoint.pt", minimal_state(2, config, augment=None))
    assert check_resume(cfg, tmp_path).next_round == 2


@pytest.mark.quick
def test_check_data_refuses_other_data_and_warns_without_a_digest(tmp_path, caplog):
    path = tmp_path / "checkpoint.pt"
    saved = checkpoint.Saved(path, 2, {"data_digest": "a" * 64})
    checkpoint.check_data(saved, "a" * 64)
    with pytest.raises(ConfigError, match="not those the run .* trained on"):
        checkpoint.check_data(saved, "b" * 64)
    with caplog.at_level(logging.WARNING, logger="fedbench"):
        checkpoint.check_data(checkpoint.Saved(path, 2, None), "b" * 64)
    assert "records no data digest" in caplog.text


@pytest.mark.quick
def test_an_extension_drops_the_evaluation_made_only_because_the_run_ended():
    before = {"metrics_csv": b"h\n", "clients_len": 2, "best": None, "final": None, "size": None}
    done = {"next_round": 3, "metrics_csv": b"h\n3\n", "clients_len": 9, "best": {"round": 3},
            "final": {"round": 3}, "size": {"up_MB": 1.0}}  # fmt: skip

    def progress():
        return {**done, "pre_final": dict(before)}

    assert checkpoint.drop_final_only(progress(), 6, 5) == {**done, **before}
    # not extended: kept (a later extension drops it); an extension whose eval.every has
    # round 3 keeps the row (an uninterrupted run with that cadence makes it too)
    assert checkpoint.drop_final_only(progress(), 3, 5) == progress()
    assert checkpoint.drop_final_only(progress(), 6, 3) == done


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-round run (checkpointed each round), copied by the tests that damage it."""
    if not fmnist_available():
        pytest.skip("FMNIST not installed")
    d = tmp_path_factory.mktemp("finished")
    r = fedbench(*FINISHED, "hydra.run.dir=run", cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "run"


def copy_of(finished: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run"))


@pytest.mark.slow
@needs_fmnist
def test_a_crafted_checkpoint_never_runs_its_code(tmp_path, finished):
    from fedbench.runner import Run

    run = copy_of(finished, tmp_path)
    marker = tmp_path / "MARKER"
    state = load_verified(run / "checkpoint.pt")[0]
    state["progress"]["best"] = Evil(marker)
    torch.save(state, run / "checkpoint.pt")
    write_digest(run / "checkpoint.pt")
    before = snapshot(run)
    # the command line: one line, exit 2, nothing run, nothing written
    r = fedbench(*FINISHED, "rounds=3", "resume=true", f"hydra.run.dir={run}", cwd=tmp_path)
    assert "not checkpoint data" in one_line(r) and not marker.exists()
    assert snapshot(run) == before
    # a resume the config check refuses reads the file the same way (in process: the
    # command line's path to this error is the one above)
    cfg = compose([*FINISHED, "rounds=3", "optim.lr=0.5", "resume=true"])
    with pytest.raises(CheckpointError, match="not checkpoint data"):
        Run(cfg, run, progress=False)
    assert not marker.exists() and snapshot(run) == before
    (run / "checkpoint.pt.sha256").unlink()  # as an older fedbench's checkpoint
    with pytest.raises(CheckpointError, match="not checkpoint data"):
        load_verified(run / "checkpoint.pt")
    assert not marker.exists()
    # a finished run is never loaded: skipped, nothing written
    before = snapshot(run)
    r = fedbench(*FINISHED, "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0 and "skipped" in r.stdout and r.stderr == "", r.stderr
    assert not marker.exists() and snapshot(run) == before


@pytest.mark.slow
@needs_fmnist
def test_a_damaged_checkpoint_is_one_line_and_a_finished_run_is_not_rewritten(tmp_path, finished):
    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    r = fedbench(*FINISHED, "resume=true", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.strip() == f"fedbench: {run} already finished at round 2; to extend it give "\
        "rounds=<more>"  # fmt: skip
    assert snapshot(run) == before  # summary.json and .hydra/config.yaml not rewritten
    good = (run / "checkpoint.pt").read_bytes()
    mid = len(good) // 2
    garbage = np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    damaged = [good[:mid] + garbage + good[mid + 20_000 :], good[:mid], good + b"x" * 100]
    for i, data in enumerate(damaged):
        (run / "checkpoint.pt").write_bytes(data)
        before = snapshot(run)
        if i == 0:  # the command line: one line, exit 2, nothing written
            r = fedbench(*FINISHED, "rounds=3", "resume=true", f"hydra.run.dir={run}", cwd=tmp_path)
            assert "damaged" in one_line(r)
            assert snapshot(run) == before
        with pytest.raises(CheckpointError, match="damaged"):
            load_verified(run / "checkpoint.pt")


@pytest.mark.slow
def test_a_resume_on_other_data_is_refused_and_a_moved_copy_is_fine(tmp_path, caplog):
    """Synthetic FMNIST files in a/; b/ a copy; c/ the same images with labels shifted."""
    x, y, xt, yt = write_fmnist(tmp_path / "a", n_train=400, n_test=200, seed=3)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "c").mkdir()
    for f in (tmp_path / "a").glob("*images*"):
        shutil.copy(f, tmp_path / "c")
    write_idx(tmp_path / "c" / "train-labels-idx1-ubyte", (y + 1) % 10)
    write_idx(tmp_path / "c" / "t10k-labels-idx1-ubyte", (yt + 1) % 10)
    args = [*TINY, "clients=4", "split.train_per_client=40", "split.test_per_client=20",
            "eval.every=1", "checkpoint.every=1"]  # fmt: skip
    from fedbench.runner import Run

    run = tmp_path / "run"
    Run(compose([*args, "rounds=2", f"data.root={tmp_path / 'a'}"]), run, progress=False).run()
    digest = json.loads((run / "summary.json").read_text())["provenance"]["data_digest"]
    assert load_verified(run / "checkpoint.pt")[0]["provenance"]["data_digest"] == digest
    before = snapshot(run)
    r = fedbench(*args, "rounds=3", f"data.root={tmp_path / 'c'}", "resume=true",
                 f"hydra.run.dir={run}", cwd=tmp_path)  # fmt: skip
    assert "not those the run" in one_line(r)
    assert snapshot(run) == before
    cfg = compose([*args, "rounds=3", f"data.root={tmp_path / 'b'}", "resume=true"])
    Run(cfg, run, progress=False).run()
    assert json.loads((run / "summary.json").read_text())["final"]["round"] == 3
    # a checkpoint of an older fedbench (no provenance): resumed, with a warning
    state = load_verified(run / "checkpoint.pt")[0]
    del state["provenance"]
    save(run / "checkpoint.pt", state)
    cfg = compose([*args, "rounds=4", f"data.root={tmp_path / 'c'}", "resume=true"])
    with caplog.at_level(logging.WARNING, logger="fedbench"):
        Run(cfg, run, progress=False)
    assert "records no data digest" in caplog.text


@pytest.mark.slow
@needs_fmnist
def test_an_extended_run_equals_the_longer_run_from_scratch(tmp_path):
    """3 rounds with eval.every=5 (one evaluation, at round 3, only because the run ends
    there), extended to 6: metrics.csv, clients.csv and summary.json (wall times aside) are
    those of an uninterrupted 6-round run (evaluations at 5 and 6)."""
    from fedbench.runner import Run

    over = ["eval.every=5", "checkpoint.every=2", "participation=0.5", CLI_BACKEND]
    full, _ = run_small(tmp_path / "full", over, rounds=6)
    run_small(tmp_path / "run", over, rounds=3)
    rows = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert rows["round"].tolist() == [3]
    ext = Run(compose([*SMALL_FMNIST, "rounds=6", *over, "resume=true"]), tmp_path / "run",
              progress=False)  # fmt: skip
    ext.run()
    a, b = tmp_path / "full", tmp_path / "run"

    def rows_of(d):
        return pd.read_csv(d / "metrics.csv").drop(columns=["wall_time_s", "cpu_time_s"])

    assert rows_of(b)["round"].tolist() == [5, 6]
    pd.testing.assert_frame_equal(rows_of(a), rows_of(b))
    assert (a / "clients.csv").read_bytes() == (b / "clients.csv").read_bytes()
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for s_ in (sa, sb):
        s_.pop("wall_time_s"), s_.pop("cpu_time_s")
    assert sa == sb and sb["best"]["round"] == full["best"]["round"]
