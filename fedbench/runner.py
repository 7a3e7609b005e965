"""The runner: `Run(cfg, out).run()`, what the CLI, the scripts and the tests call, and the
names they import with it. The run is built, looped, checkpointed and recorded by the four
modules of fedbench/run/ (its docstring says which owns what); this module gathers their
public names (and the checkpoint names imported from here before the split)."""

from __future__ import annotations

from fedbench.checkpoint import (
    ABSENT_MEANS,
    CHECKPOINT,
    RESUME_MAY_CHANGE,
    CheckpointError,
    check_data,
    check_resume,
    finished,
    finished_run,
    load_checkpoint,
    resume_differences,
)
from fedbench.config import clients_per_round, load_config
from fedbench.run.build import MIN_TEST_SAMPLES, Built, build, resolve_device
from fedbench.run.checkpoint import RunCheckpoint
from fedbench.run.loop import ERROR_FILE, Interrupted, Run
from fedbench.run.record import (
    CLIENT_COLUMNS,
    SIZE_KEYS,
    Progress,
    Recorder,
    diagnostics,
    final_table,
    objective,
    objective_metric,
    objective_record,
    size_columns,
)

__all__ = [
    "ABSENT_MEANS",
    "CHECKPOINT",
    "CLIENT_COLUMNS",
    "ERROR_FILE",
    "MIN_TEST_SAMPLES",
    "RESUME_MAY_CHANGE",
    "SIZE_KEYS",
    "Built",
    "CheckpointError",
    "Interrupted",
    "Progress",
    "Recorder",
    "Run",
    "RunCheckpoint",
    "build",
    "check_data",
    "check_resume",
    "clients_per_round",
    "diagnostics",
    "final_table",
    "finished",
    "finished_run",
    "load_checkpoint",
    "load_config",
    "objective",
    "objective_metric",
    "objective_record",
    "resolve_device",
    "resume_differences",
    "size_columns",
]
