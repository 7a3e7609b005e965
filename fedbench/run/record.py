"""Record: what a run writes about itself. partition.json (the partition, its class counts
and the S/G sets) and the run's description in run.log; one metrics.csv row and the
per-client clients.csv rows per evaluation, passed on to the trackers (`fedbench.tracking`);
the running final, best (test) and best-validation evaluations and the model-size columns
(`Progress`, which the checkpoint saves whole so that a resume ends as an uninterrupted run);
and, once the last round is done, summary.json (the run is then complete) with its
`objective` (what a Hydra sweeper reads). `final_table` is the table the CLI prints.
It never decides when to evaluate or checkpoint (the round loop, fedbench/run/loop.py) nor
what a resume keeps (fedbench/run/checkpoint.py).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TypedDict

import numpy as np
import pandas as pd
import torch

import fedbench
from fedbench.algorithms.base import FLOAT_BYTES, RoundReport
from fedbench.config import RunConfig
from fedbench.errors import FedbenchError
from fedbench.evaluation import SETS, VAL, better, resolve_select, selected, summaries
from fedbench.io import CsvAppender, atomic_write_json
from fedbench.report.partition import partition_counts
from fedbench.run.build import Built
from fedbench.tracking import Sinks

log = logging.getLogger("fedbench")


class Progress(TypedDict, total=False):
    """Everything the loop accumulates: checkpointed with the algorithm (fedbench/run/
    checkpoint.py) so that a resumed run ends exactly as an uninterrupted one. metrics.csv
    (one row per evaluation, small) rides along whole, so a resume can restore it;
    clients.csv only by its length."""

    next_round: int  # rounds done
    elapsed_s: float  # wall time of the rounds done, over every process of the run
    # CPU time of the rounds done (the process's, all its threads), over every process of the
    # run; absent in a run begun before fedbench recorded it (it then records none)
    cpu_s: float
    comm: dict[str, int]  # bytes_up, bytes_down summed over the rounds done
    best: dict | None  # the evaluation with the best L avg (personal where there is one)
    best_val: dict | None  # the evaluation with the best V avg (split.val_frac > 0)
    final: dict | None  # the last evaluation
    size: dict | None  # the last evaluation's SIZE_KEYS columns
    metrics_csv: bytes  # metrics.csv at the last checkpoint
    clients_len: int  # clients.csv's length at the last checkpoint
    # the evaluation made only because the run ended there (its last round not a multiple
    # of eval.every): the files and trackers before it, which an extension goes back to
    pre_final: dict
    clients_csv_old: bytes  # a checkpoint of fedbench <= 0.1.0: clients.csv's rows


def new_progress() -> Progress:
    """The progress of a run before its first round."""
    return {
        "next_round": 0,
        "elapsed_s": 0.0,
        "cpu_s": 0.0,
        "comm": {"bytes_up": 0, "bytes_down": 0},
        "best": None,
        "best_val": None,  # the evaluation with the best V avg (split.val_frac > 0)
        "final": None,
        "size": None,
        "metrics_csv": b"",
        "clients_len": 0,
    }


def write_partition(out: Path, rc: RunConfig, b: Built) -> None:
    """partition.json, and the run and its partition described in run.log."""
    # class counts per client ride along, so the report draws the split without the data
    counts = partition_counts(b.labels_pool, b.partition.train, b.partition.test, b.num_classes)
    atomic_write_json(
        out / "partition.json",
        {**b.partition.to_json(), **counts, "eval_sets": b.eval_sets},
    )
    log.info(
        "%s on %s (%s split, %d clients, %d per round), model %s: %d parameters; device %s",
        rc.algo.name,
        rc.data.name,
        rc.split.name,
        b.fed.num_clients,
        b.per_round,
        rc.model.name,
        b.engine.n_params,
        b.device,
    )
    log.info("partition:\n%s", b.partition.summary(b.labels_pool, b.num_classes))


class Recorder:
    """One run's rows and summaries: metrics.csv and clients.csv continued from `progress`
    (its recorded lengths), the trackers, and summary.json. `t0`: the clock the run's wall
    times count from (this process's start less the time of earlier processes)."""

    def __init__(
        self,
        out: Path,
        rc: RunConfig,
        b: Built,
        progress: Progress,
        sinks: Sinks,
        t0: float,
        tuning: bool = False,
        c0: float | None = None,
    ) -> None:
        self.out, self.config, self.built = out, rc, b
        self.progress, self.sinks, self.t0, self.tuning = progress, sinks, t0, tuning
        self.c0 = c0  # the CPU clock's origin (time.process_time), None: not recorded
        self.metrics = _appender(out / "metrics.csv", progress["metrics_csv"])
        self.clients = _clients_appender(out / "clients.csv", progress["clients_len"])

    def evaluation(
        self, done: int, res: dict, loss: float, report: RoundReport, n_clients: int
    ) -> dict:
        """Record the evaluation `res` (fedbench.evaluation.evaluate) after round `done`
        (1-based) of `n_clients` clients: its metrics.csv row (also to the trackers), its
        clients.csv rows, the final / best / best_val / size trackers. Returns its summaries."""
        st = self.progress
        summ = summaries(res)
        row = {"round": done, "wall_time_s": time.perf_counter() - self.t0}
        if self.c0 is not None:
            row["cpu_time_s"] = time.process_time() - self.c0
        row["train_loss"] = loss
        row.update(st["comm"])
        row.update(diagnostics(report))
        row.update(size_columns(self.built.algo, st["comm"], done, report, n_clients))
        row.update(_flatten(summ))
        self.metrics.append([row])
        self.sinks.log(done, row)
        self.clients.append(_client_frame(done, res).to_dict("records"))
        st["size"] = {k: row[k] for k in SIZE_KEYS if k in row}
        st["final"] = {"round": done, **summ}
        if st["best"] is None or _key(st["final"]) > _key(st["best"]):
            st["best"] = st["final"]
        if better(st["final"], st["best_val"], VAL):
            st["best_val"] = st["final"]
        return summ

    def finish(self, rounds: int) -> dict:
        """Write summary.json (the run is then complete) and close the trackers."""
        rc, b, st = self.config, self.built, self.progress
        wall = time.perf_counter() - self.t0
        if st["final"] is None:
            raise FedbenchError(f"{self.out}: no evaluation was made (rounds={rounds})")
        summary = {
            "algo": rc.algo.name,
            "data": rc.data.name,
            "split": rc.split.name,
            "model": rc.model.name,
            "seed": rc.seed,
            "rounds": rounds,
            "clients": b.fed.num_clients,
            "participation": rc.participation,
            "wall_time_s": round(wall, 3),
            **({} if self.c0 is None else {"cpu_time_s": round(time.process_time() - self.c0, 3)}),
            "device": str(b.device),
            "version": fedbench.__version__,
            "final": st["final"],
            "best": st["best"],
            # the round the tables report (eval.select): by val, last or best_test
            "selected": selected(self._select_rule(), st["final"], st["best"], st["best_val"]),
            "malicious": 0 if b.attack is None else b.attack.count,
            "provenance": b.provenance,
        }
        if st["size"]:
            summary["size"] = st["size"]
        summary["objective"] = objective_record(
            summary, rc.objective.metric, rc.objective.at, self.tuning
        )
        atomic_write_json(self.out / "summary.json", summary)
        self.sinks.finish(summary)
        return summary

    def _select_rule(self) -> str:
        return resolve_select(self.config.eval.select, self.built.fed.val_idx is not None)


def _appender(path: Path, text: bytes) -> CsvAppender:
    """metrics.csv continued from `text` (its content at the checkpoint; b"": a new file)."""
    header = text.split(b"\n", 1)[0].decode().split(",") if text else None
    return CsvAppender(path, header, len(text))


CLIENT_COLUMNS = ("round", "client", "model", "metric", "value")


def _clients_appender(path: Path, length: int) -> CsvAppender:
    return CsvAppender(path, CLIENT_COLUMNS, length)


def diagnostics(report: RoundReport) -> dict:
    """The algorithm's own scalars of a round (FedPG's QP fallbacks, FedSLR's ranks ...), as
    metrics.csv columns. Counters are cumulative on the algorithm's side."""
    out = {}
    for k, v in report.diagnostics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = v
    return out


SIZE_KEYS = (
    "up_MB",
    "down_MB",
    "comm_MB",
    "params_sent_M",
    "params_personal_M",
    "params_global_M",
)


def size_columns(algo, comm: dict, rounds_done: int, report: RoundReport, n_clients: int) -> dict:
    """Model size and communication (FedSLR Table 2), as metrics.csv columns: uplink,
    downlink and their sum in MB (1e6 bytes) per round, averaged over the rounds so far;
    parameters the server sent one client this round (from bytes_down); parameters of each
    deployed model (`Algorithm.model_size`; personal: mean over clients), in millions."""
    mb = 1e6 * max(rounds_done, 1)
    out = {
        "up_MB": comm["bytes_up"] / mb,
        "down_MB": comm["bytes_down"] / mb,
        "comm_MB": (comm["bytes_up"] + comm["bytes_down"]) / mb,
        "params_sent_M": report.comm.bytes_down / FLOAT_BYTES / max(n_clients, 1) / 1e6,
    }
    for k, v in algo.model_size().items():
        out[f"{k}_M"] = float(v) / 1e6
    return out


def _key(s: dict) -> float:
    kind = "personal" if s.get("personal") else "global"
    return s[kind]["L"]["avg"]


def _flatten(summ: dict) -> dict:
    row = {}
    for kind, sets in summ.items():
        if sets is None:
            continue
        for name, stats in sets.items():
            if isinstance(stats, dict):
                for k, v in stats.items():
                    row[f"{kind}.{name}.{k}"] = v
            else:
                row[f"{kind}.{name}"] = stats
    return row


def _client_frame(t: int, res: dict) -> pd.DataFrame:
    parts = []
    for kind, sets in res.items():
        if sets is None:
            continue
        for name in SETS:
            if name in sets:
                acc = sets[name]["acc"]
                parts.append(
                    pd.DataFrame(
                        {
                            "round": t,
                            "client": sets[name].get("ids", np.arange(acc.size)),
                            "model": kind,
                            "metric": name,
                            "value": acc,
                        }
                    )
                )
    return pd.concat(parts, ignore_index=True)


def objective_metric(summary: dict, metric: str, at: str = "final") -> str:
    """`metric` with `auto` resolved: the V avg of the personalized model (global where
    there is none) when the run has validation sets, else its L avg."""
    if metric != "auto":
        return metric
    block = _objective_block(summary, at)
    kind = "personal" if block.get("personal") else "global"
    has_val = isinstance(block.get(kind), dict) and VAL in block[kind]
    return f"{kind}.{VAL if has_val else 'L'}.avg"


def _objective_block(summary: dict, at: str) -> dict:
    # `selected` in a summary written before it: `final` (auto without validation)
    block = summary.get(at) if at != "selected" else summary.get("selected", summary.get("final"))
    return block if isinstance(block, dict) else {}


def objective(summary: dict, metric: str, at: str = "final") -> float:
    """The summary's `metric` (e.g. personal.L.avg, or auto) at its final, best (test) or
    selected evaluation: what a run returns to a Hydra sweeper. NaN where the run has no
    such model or set."""
    node: object = _objective_block(summary, at)
    for part in objective_metric(summary, metric, at).split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return float(node) if isinstance(node, int | float) else float("nan")


def objective_record(summary: dict, metric: str, at: str, tuning: bool) -> dict:
    """summary.json's `objective`: the metric (resolved), the round rule, its value, whether
    it is a test-set number (`on_test`: a study that maximizes it tunes on test data) and
    whether the run was a trial of such a study (`tuning`)."""
    name = objective_metric(summary, metric, at)
    value = objective(summary, name, at)
    return {
        "metric": name,
        "at": at,
        "value": value if math.isfinite(value) else None,
        "on_test": name.split(".")[1:2] != [VAL],
        "tuning": bool(tuning),
    }


def final_table(summary: dict) -> str:
    """The final table: per model kind, L avg / top5 / bottom5 / std and S, G avg (%)."""
    rows = {}
    for kind, s in (summary["final"] or {}).items():
        if not isinstance(s, dict):
            continue
        row = {}
        for k in ("avg", "top5", "bottom5", "std"):
            row[f"L.{k}"] = 100 * s["L"][k]
        for name in ("S", "G", VAL):
            if name in s:
                row[f"{name}.avg"] = 100 * s[name]["avg"]
        if "all" in s:
            row["all"] = 100 * s["all"]
        rows[kind] = row
    pick = summary.get("selected") or {}
    final_round = (summary.get("final") or {}).get("round")
    if pick.get("by") == "val" and pick.get("round", final_round) != final_round:
        # the round validation chose, where it is not the last
        kind = "personal" if pick.get("personal") else "global"
        rows[f"{kind} @ round {pick['round']} (best V)"] = {
            f"{n}.avg": 100 * pick[kind][n]["avg"] for n in ("L", VAL) if n in pick[kind]
        }
    df = pd.DataFrame(rows).T
    head = (
        f"{summary['algo']} | {summary['data']} {summary['split']} | {summary['model']} | "
        f"seed {summary['seed']} | round {summary['final']['round']} | "
        f"{summary['wall_time_s']:.1f} s on {summary['device']}  (accuracy %)"
    )
    return head + "\n" + df.to_string(float_format=lambda v: f"{v:6.2f}", na_rep="-")
