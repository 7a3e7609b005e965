"""Experiment tracking for real: one run logged to TensorBoard, W&B (offline) and MLflow at
once, read back with each tool's own reader and compared with metrics.csv."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import fmnist_available, needs

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
TINY = ["rounds=2", "eval.every=1", "clients=6", "split.train_per_client=60",
        "model.hidden=[16]", "device=cpu"]  # fmt: skip


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (`run-<id>.wandb`): a 7-byte header
    (':W&B', magic 0xBEE1, version 0), then LevelDB-log chunks (crc32c 4, length 2, type 1:
    full 1, first 2, middle 3, last 4) in 32 KiB blocks."""
    wandb_internal_pb2 = needs("wandb.proto.wandb_internal_pb2", "wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        parts += chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            records.append(rec)
            parts = b""
    return records


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


@pytest.mark.slow
@pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")
def test_one_run_logged_to_three_sinks_reads_back(tmp_path):
    # each tool's own reader, or a skip naming the extra that brings it
    tb = needs("tensorboard.backend.event_processing.event_accumulator", "tensorboard")
    needs("wandb.proto.wandb_internal_pb2", "wandb")
    mlflow_tracking = needs("mlflow.tracking", "mlflow")
    run = tmp_path / "run"
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = subprocess.run(
        [sys.executable, "-c", "from fedbench.cli import main; main()", *TINY,
         "log.tensorboard=true", "log.wandb.project=fedbench-test", f"log.mlflow.uri={db}",
         f"hydra.run.dir={run}"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "turned off" not in r.stdout + r.stderr  # no sink failed
    csv = pd.read_csv(run / "metrics.csv")
    want = list(csv["personal.L.avg"])
    summary = json.loads((run / "summary.json").read_text())

    # TensorBoard: its own event reader
    acc = tb.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("personal.L.avg")
    assert [e.step for e in events] == [1, 2]
    assert [e.value for e in events] == pytest.approx(want, abs=1e-6)  # float32 in the file
    assert "summary/final.personal.L.avg" in acc.Tags()["scalars"]

    # W&B offline: the run file in its run directory
    (path,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = [], {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind in ("run", "config"):  # the config comes with the run, updates after
            updates = rec.run.config.update if kind == "run" else rec.config.update
            config.update({_key(i): json.loads(i.value_json) for i in updates})
    assert [h["personal.L.avg"] for h in history] == pytest.approx(want)
    assert [h["_step"] for h in history] == [1, 2]
    assert config["optim.lr"] == 0.05 and config["algo.name"] == "fedavg"

    # MLflow: its client API on the store
    client = mlflow_tracking.MlflowClient(tracking_uri=db)
    exp = client.get_experiment_by_name("fedbench")
    (found,) = client.search_runs([exp.experiment_id])
    assert found.data.tags["fedbench.run_dir"] == str(run.resolve())
    assert found.data.params["optim.lr"] == "0.05" and found.info.status == "FINISHED"
    hist = client.get_metric_history(found.info.run_id, "personal.L.avg")
    assert [(m.step, m.value) for m in hist] == list(zip([1, 2], want))
    final = summary["final"]["personal"]["L"]["avg"]
    assert found.data.metrics["summary.final.personal.L.avg"] == pytest.approx(final)


@pytest.mark.quick
def test_a_missing_extra_is_one_line_naming_pip(monkeypatch):
    from fedbench import tracking
    from fedbench.cli import refusal

    monkeypatch.setitem(tracking.EXTRAS, "wandb", ("no_such_module_here", "wandb"))
    msg = refusal(["log.wandb.project=p"])
    assert (
        msg
        == "fedbench: log.wandb.project needs no_such_module_here: pip install 'fedbench[wandb]'"
    )


@pytest.mark.quick
def test_a_failing_sink_is_turned_off_not_the_run(caplog):
    from fedbench.tracking import Sinks

    class Broken:
        def start(self, *a):
            raise RuntimeError("server down")

        def close(self):
            pass

    class Fine:
        logged = []

        def start(self, *a):
            pass

        def log(self, step, metrics):
            self.logged.append((step, metrics))

        def close(self):
            pass

    sinks = Sinks({"mlflow": Broken(), "tensorboard": Fine()})
    with caplog.at_level("WARNING", logger="fedbench"):
        sinks.start({}, Path("."), False)
        sinks.log(1, {"a": 0.5, "b": "text", "c": float("nan")})
    assert "log.mlflow: start failed (RuntimeError: server down)" in caplog.text
    assert list(sinks.sinks) == ["tensorboard"] and Fine.logged == [(1, {"a": 0.5})]
