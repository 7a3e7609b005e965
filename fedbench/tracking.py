"""Experiment tracking: a run's config, every evaluation's metrics and its final summary,
also in TensorBoard, Weights & Biases or MLflow (several at once). The run directory's
CSV/JSON files stay the source of truth: a sink that fails is warned about once and turned
off, never the run.

    log.tensorboard=true                # <run dir>/tensorboard ('fedbench[tensorboard]')
    log.wandb.project=fl                # W&B, offline: <run dir>/wandb ('fedbench[wandb]')
    log.mlflow.uri=sqlite:///mlflow.db  # an MLflow store or server ('fedbench[mlflow]')

A resumed run continues its W&B run (id from the run directory) and its MLflow run (found
by the tag `fedbench.run_dir`); TensorBoard appends to the same folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from fedbench.errors import ConfigError
from fedbench.trees import flat_items


class LogParams(Protocol):
    """The run's checked `log` settings (fedbench.config.LogParams, which checks them; the
    config sits above this module, which it calls)."""

    tensorboard: bool
    wandb: Any  # project, mode, entity
    mlflow: Any  # uri, experiment


log = logging.getLogger("fedbench")

# config key -> (module to import, extra to install)
EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


class Sink(Protocol):
    """One tracking tool. `start` once, `log` at every evaluation, `finish` at the end;
    `close` always (an interrupted run too)."""

    def start(self, config: dict[str, Any], run_dir: Path, resume: bool) -> None: ...
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def finish(self, summary: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def wanted(log_cfg: LogParams) -> list[str]:
    """The sinks a `log` config switches on."""
    out = []
    if log_cfg.tensorboard:
        out.append("tensorboard")
    if log_cfg.wandb.project:
        out.append("wandb")
    if log_cfg.mlflow.uri:
        out.append("mlflow")
    return out


def check_installed(log_cfg: LogParams) -> None:
    """ConfigError (one line, naming the pip command) for a sink whose package is missing."""
    for name in wanted(log_cfg):
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            key = {"tensorboard": "log.tensorboard=true", "wandb": "log.wandb.project",
                   "mlflow": "log.mlflow.uri"}[name]  # fmt: skip
            raise ConfigError(f"{key} needs {module}: pip install 'fedbench[{extra}]'")


def flatten(node: Any) -> dict[str, Any]:
    """{dotted key: scalar} of nested dicts (lists become strings)."""
    return {
        k: str(list(v)) if isinstance(v, list | tuple) else v for k, v in flat_items(node).items()
    }


def numbers(d: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in d.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))
    }


class TensorBoardSink:
    def __init__(self) -> None:
        self.w = None

    def start(self, config: dict[str, Any], run_dir: Path, resume: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.w = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        hp = {
            k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in config.items()
        }
        # the hyperparameters tab: the config, with the headline metric to plot against
        exp, ssi, sei = hparams(hp, {"personal.L.avg": float("nan")})
        for s in (exp, ssi, sei):
            self.w.file_writer.add_summary(s)
        self.w.add_text("run_dir", str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def finish(self, summary: dict[str, float]) -> None:
        for k, v in summary.items():
            self.w.add_scalar(f"summary/{k}", v, 0)
        self.w.flush()

    def close(self) -> None:
        if self.w is not None:
            self.w.close()


class WandbSink:
    def __init__(self, project: str, mode: str, entity: str | None) -> None:
        self.project, self.mode, self.entity = project, mode, entity
        self.run = None

    def start(self, config: dict[str, Any], run_dir: Path, resume: bool) -> None:
        import wandb

        # one W&B run per run directory: a resumed run continues it
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
            name=run_dir.name,
            notes=str(run_dir),
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run.summary["run_dir"] = str(run_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, float]) -> None:
        for k, v in summary.items():
            self.run.summary[k] = v

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MlflowSink:
    def __init__(self, uri: str, experiment: str) -> None:
        self.uri, self.experiment = uri, experiment
        self.client = None
        self.run_id = None

    def start(self, config: dict[str, Any], run_dir: Path, resume: bool) -> None:
        import os

        # MLflow retries an unreachable server for minutes by default: a run should learn in
        # seconds that its tracking server is down (the user's own settings win).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment)
        where = str(run_dir.resolve())
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`fedbench.run_dir` = '{where}'", max_results=1
        )
        if resume and found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(
            exp_id, run_name=run_dir.name, tags={"fedbench.run_dir": where}
        )
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in config.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = [Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i : i + 1000])

    def finish(self, summary: dict[str, float]) -> None:
        self.log(0, {f"summary.{k}": v for k, v in summary.items()})
        self.client.set_terminated(self.run_id, status="FINISHED")
        self.run_id = None

    def close(self) -> None:
        if self.run_id is not None:  # interrupted: the run stays open for the resume
            self.client.set_terminated(self.run_id, status="KILLED")
            self.run_id = None


def _mlflow_key(k: str) -> str:
    # MLflow keys: alphanumerics, _ - . / and spaces
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in k)


class Sinks:
    """The run's sinks, each guarded: one that raises is warned about and dropped."""

    def __init__(self, sinks: dict[str, Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def from_config(cls, log_cfg: LogParams) -> Sinks:
        """The sinks the run's `log` settings switch on."""
        made: dict[str, Sink] = {}
        for name in wanted(log_cfg):
            if name == "tensorboard":
                made[name] = TensorBoardSink()
            elif name == "wandb":
                w = log_cfg.wandb
                made[name] = WandbSink(w.project, w.mode, w.entity)
            elif name == "mlflow":
                m = log_cfg.mlflow
                made[name] = MlflowSink(m.uri, m.experiment)
        return cls(made)

    def _each(self, what: str, *args: Any) -> None:
        for name in list(self.sinks):
            try:
                getattr(self.sinks[name], what)(*args)
            except Exception as e:  # noqa: BLE001 (a tracking tool must never stop a run)
                log.warning("log.%s: %s failed (%s: %s); turned off for this run", name, what,
                            type(e).__name__, " ".join(str(e).split())[:200])  # fmt: skip
                sink = self.sinks.pop(name)
                with contextlib.suppress(Exception):
                    sink.close()

    def start(self, config: dict[str, Any], run_dir: Path, resume: bool) -> None:
        self._each("start", flatten(config), run_dir, resume)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self._each("log", step, numbers(row))

    def finish(self, summary: Mapping[str, Any]) -> None:
        keep = {
            k: summary[k]
            for k in ("final", "best", "selected", "size", "wall_time_s")
            if k in summary
        }
        self._each("finish", numbers(flatten(keep)))

    def close(self) -> None:
        self._each("close")
