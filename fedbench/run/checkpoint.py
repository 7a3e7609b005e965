"""Checkpoint: a run's checkpoint.pt as the round loop uses it. `RunCheckpoint.save` writes
the run's state (the algorithm, the engine, the sampler's and the attack's generators,
`fedbench.checkpoint.run_state`) with the loop's `Progress`, metrics.csv's content and
clients.csv's length at that moment; `RunCheckpoint.restore` loads a verified one back into
the run (a damaged file is refused: `fedbench.checkpoint.load_run_state`), upgrades the
progress of an older fedbench, drops the evaluation an extended run would not have made
(`drop_final_only`) and cuts metrics.csv and clients.csv back to what it recorded: the rows
of later rounds are made again. `keep_pre_final` records what an extension goes back to.

The file itself (format, kill-safe writes, SHA-256 verification, per-client row shards) and
the checks that admit a resume before anything is built (what may change on resume, the
data digest, a finished run) are fedbench/checkpoint.py's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import torch

from fedbench import checkpoint
from fedbench.checkpoint import CHECKPOINT, RunParts
from fedbench.io import CsvAppender
from fedbench.run.record import SIZE_KEYS, Progress

log = logging.getLogger("fedbench")


class RunCheckpoint:
    """The checkpoint of the run `run` (its state: `fedbench.checkpoint.RunParts`) in `out`,
    loaded onto `device`; `every`: checkpoint.every (the size line of run.log)."""

    def __init__(self, run: RunParts, out: Path, device: torch.device, every: int) -> None:
        self.run, self.path, self.device, self.every = run, out / CHECKPOINT, device, every
        self.out = out
        self._logged = False  # the checkpoint's size is logged once
        self.digest: str | None = None  # SHA-256 of the checkpoint.pt on disk

    def save(self, progress: Progress, metrics: CsvAppender, clients: CsvAppender) -> None:
        """The run's state and the loop's progress, streamed into place atomically with its
        digest (fedbench/checkpoint.py)."""
        progress["metrics_csv"] = _read_prefix(metrics.path, metrics.length)
        progress["clients_len"] = clients.length
        state = checkpoint.run_state(self.run, progress)
        size, self.digest = checkpoint.save(self.path, state, previous=self.digest)
        if not self._logged:
            self._logged = True
            log.info("%s: %.1f MB (every %s rounds)", CHECKPOINT, size / 1e6, self.every or "no")

    def restore(self, rounds: int, every: int) -> Progress | None:
        """Load the verified checkpoint into the algorithm, engine and generators; cut
        metrics.csv and clients.csv back to what it recorded. Returns the loop's progress
        (None: no checkpoint here, the run starts at round 0). `rounds`, `every`: the
        run's rounds and eval.every now (an extension drops an evaluation made only
        because the run ended)."""
        if not self.path.exists():
            return None
        state, self.digest = checkpoint.load_run_state(self.path, map_location=self.device)
        checkpoint.restore_state(self.run, state)
        progress = _upgrade_progress(state["progress"])
        progress = checkpoint.drop_final_only(progress, rounds, every)
        checkpoint.cut_files(self.out, progress)
        log.info("resumed from %s at round %d", self.path, progress["next_round"])
        progress.setdefault("best_val", None)  # a checkpoint from before validation sets
        return progress


def keep_pre_final(progress: Progress, metrics: CsvAppender, clients: CsvAppender) -> None:
    """Before an evaluation made only because the run ends here (its last round not a
    multiple of eval.every): the files and trackers as they are, which an extension of the
    run goes back to (`fedbench.checkpoint.drop_final_only`)."""
    progress["pre_final"] = {
        "metrics_csv": _read_prefix(metrics.path, metrics.length),
        "clients_len": clients.length,
        **{k: progress[k] for k in ("best", "best_val", "final", "size")},
    }


def _read_prefix(path: Path, length: int) -> bytes:
    if length == 0:
        return b""
    with open(path, "rb") as f:
        return f.read(length)


def _upgrade_progress(p: dict) -> Progress:
    """A checkpoint of fedbench <= 0.1.0 carried every metrics/clients row; as today's."""
    if "metrics_csv" in p:
        return p
    rows, frames = p.pop("metric_rows", []), p.pop("client_rows", [])
    p["metrics_csv"] = pd.DataFrame(rows).to_csv(index=False).encode() if rows else b""
    p["clients_len"] = 0
    if frames:
        text = pd.concat(frames, ignore_index=True).to_csv(index=False).encode()
        p["clients_csv_old"] = text
    p["size"] = {k: rows[-1][k] for k in SIZE_KEYS if rows and k in rows[-1]}
    return p
