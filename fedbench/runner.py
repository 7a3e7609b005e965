"""The round loop: build the federation, model, engine and algorithm from a config; sample
clients; train; evaluate every `eval.every` rounds and at the end; write metrics.

`Run(cfg, out)` checks and builds everything and writes nothing; `Run.run()` claims the run
directory (fedbench/rundir.py: a lock for the run's life; another run's directory only with
resume=true), then writes into it: partition.json, summary.json and checkpoint.pt atomically,
metrics.csv and clients.csv by appended rows (a resume cuts them back to its checkpoint),
run.log. SIGTERM (SLURM's preemption and time-out signal) and Ctrl-C finish the round under
way, save a checkpoint and raise `Interrupted`; a second one stops at once. Once the last
round is done a signal only waits: the summary is written and the run is complete.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import fedbench
from fedbench import checkpoint
from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.base import FLOAT_BYTES, RoundReport, RunContext, RunSettings
from fedbench.attack import Attack
from fedbench.checkpoint import (  # noqa: F401 (CHECKPOINT ... finished_run: imported from here too)
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
from fedbench.data.federation import Federation
from fedbench.data.sources import load_dataset
from fedbench.data.splits import eval_sets, make_partition
from fedbench.engine import Engine
from fedbench.engine.rows import GIB, RowsPolicy
from fedbench.errors import ConfigError, FedbenchError
from fedbench.evaluation import SETS, VAL, better, evaluate, resolve_select, selected, summaries
from fedbench.io import CsvAppender, atomic_write_json, atomic_write_text
from fedbench.models import build_model
from fedbench.provenance import provenance
from fedbench.report.partition import partition_counts
from fedbench.rundir import RunDir
from fedbench.tracking import Sinks
from fedbench.trees import plain

log = logging.getLogger("fedbench")

# A run that stopped on an error says why here (fedbench-report lists it); a run that then
# finishes (resumed) removes it.
ERROR_FILE = "error.txt"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise FedbenchError(
                f"device={name} but no CUDA GPU is visible (torch.cuda.is_available() is "
                "False); use device=auto or device=cpu"
            )
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"device={name!r}; valid: auto, cpu, cuda, cuda:N")


# A client test set smaller than this gives accuracies in steps of more than 10 points: the
# split is warned about (clients=10000 with pat-2 on FMNIST leaves each client one sample).
MIN_TEST_SAMPLES = 10


class Interrupted(FedbenchError):
    """SIGTERM or Ctrl-C stopped the run; `saved` says whether a checkpoint holds its last
    round (`checkpoint_round`: the round of the newest checkpoint there, None: none). The
    CLI prints the message and exits with 128 + the signal's number."""

    def __init__(
        self,
        signum: int,
        next_round: int,
        saved: bool,
        out: Path,
        checkpoint_round: int | None = None,
    ) -> None:
        self.signum, self.next_round, self.saved = signum, next_round, saved
        self.checkpoint_round = next_round if saved else checkpoint_round
        name = signal.Signals(signum).name
        if saved:
            msg = (
                f"{name}: stopped after round {next_round}, checkpoint saved; continue with "
                f"resume=true hydra.run.dir={out}"
            )
        elif checkpoint_round is not None:
            msg = (
                f"{name} again: stopped in round {next_round + 1} before it was saved; "
                f"continue from the checkpoint of round {checkpoint_round} with resume=true "
                f"hydra.run.dir={out}"
            )
        else:
            msg = (
                f"{name} again: stopped in round {next_round + 1}, before any checkpoint; "
                f"start it again with resume=auto hydra.run.dir={out}"
            )
        super().__init__(msg)


class _Stop:
    """What the signal handlers saw and where the run stands: the first signal's number (0:
    none), the round of the newest checkpoint in the run directory (None: none), and
    `finishing` / `finished`: the last round is done and the summary is being written /
    written (a signal then only waits: the run is complete a moment later)."""

    def __init__(self) -> None:
        self.signum = 0
        self.checkpoint_round: int | None = None
        self.finishing = False
        self.finished = False


@contextmanager
def _graceful(out: Path, progress: dict, stop: _Stop | None = None) -> Iterator[_Stop]:
    """SIGTERM / SIGINT: the first asks the loop to stop after the round under way (it then
    checkpoints); a second raises at once, unless the last round is done (`stop.finishing`):
    the summary is then written whatever comes. Outside the main thread (a threads
    launcher) signals are not ours to handle: nothing is installed."""
    stop = stop or _Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: object) -> None:
        if stop.finishing or stop.finished:
            stop.signum = stop.signum or signum
            return
        if stop.signum:
            raise Interrupted(
                signum, progress["next_round"], False, out, checkpoint_round=stop.checkpoint_round
            )
        stop.signum = signum
        log.warning(
            "%s: finishing round %d, then saving a checkpoint (again: stop at once)",
            signal.Signals(signum).name,
            progress["next_round"] + 1,
        )

    signals = [signal.SIGTERM, signal.SIGINT]
    if "SUBMITIT_EXECUTOR" in os.environ:
        # submitit's SLURM jobs get SIGUSR2 before their time limit (and on preemption);
        # submitit would requeue them mid-round without a checkpoint: save one instead.
        signals.append(signal.SIGUSR2)
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _QuietFileHandler(logging.FileHandler):
    """The run's log file; a write that fails (a full disk) turns it off without the
    logging module's traceback on stderr."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        self.close()
        logging.getLogger().removeHandler(self)


@contextmanager
def _log_file(path: Path) -> Iterator[None]:
    handler = _QuietFileHandler(path, mode="a", encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


class Run:
    """Everything a run is built from; `Run(cfg, out_dir).run()` is what the CLI calls."""

    def __init__(
        self, cfg: DictConfig, out_dir: str | Path, progress: bool = True, tuning: bool = False
    ) -> None:
        """`tuning`: the run is a trial of a study that maximizes its objective (a Hydra
        sweeper other than the basic one); summary.json's `objective` says so."""
        self.cfg = cfg
        self.out = Path(out_dir)
        self.progress = progress
        self.tuning = tuning
        # the one validation: every part below is built from the typed config as it is
        self.config = rc = load_config(cfg)
        algo_cls = ALGORITHMS.get(rc.algo.name)
        saved = check_resume(cfg, self.out) if rc.resume else None
        self.device = resolve_device(rc.device)
        seed = rc.seed
        d = rc.data
        root = str(Path(d.root).expanduser()) if d.root else None
        data = load_dataset(d.name, root, download=d.download, **d.source_keys())
        digest = data.digest()
        check_data(saved, digest)  # a resume trains on its run's data (still nothing written)
        self.provenance = provenance(digest, str(self.device))
        n = rc.clients
        self.partition = make_partition(
            data.y_train.numpy(),
            data.y_test.numpy(),
            n,
            seed,
            rc.split.name,
            rc.option_keys("split"),
        )
        _warn_small_tests(self.partition.test)
        s_idx, g_idx = eval_sets(self.partition, seed, rc.eval.s_frac)
        self.eval_sets = {"S": [i.tolist() for i in s_idx], "G": [i.tolist() for i in g_idx]}
        self.fed = Federation(
            data,
            self.partition,
            self.device,
            s_idx=s_idx,
            g_idx=g_idx,
            augment=d.augment,
            normalize=d.normalize,
        )
        self.labels_pool = np.concatenate([data.y_train.numpy(), data.y_test.numpy()])
        self.num_classes = data.num_classes
        m = rc.model
        self.model_fn = partial(
            build_model, m.name, data.input_shape, data.num_classes, **rc.option_keys("model")
        )
        torch.manual_seed(seed)
        model = self.model_fn()
        e = rc.engine
        self.engine = Engine(
            self.fed,
            model,
            device=self.device,
            seed=seed,
            backend=e.backend,
            drop_last=e.drop_last,
            eval_batch_size=rc.eval.batch_size,
            chunk_clients=e.chunk_clients,
            memory_budget=e.memory_budget,
            # per-client rows off the device; a store past host_rows_gib: a mapped file here
            rows=RowsPolicy(int(e.host_rows_gib * GIB), self.out / "rows"),
        )
        # malicious clients (fedbench/attack.py): they act in Algorithm.receive only
        self.attack = Attack.from_config(rc)  # seeds its own generators, not torch's
        ctx = RunContext(
            self.fed, self.engine, self.model_fn, RunSettings.from_config(rc), self.attack
        )
        self.algo = algo_cls(ctx, rc.algo.params)
        self.honest = None if self.attack is None else self.attack.honest
        self._warned_collapse = False  # one warning per run when an attacked run diverges
        self._ckpt_logged = False  # the checkpoint's size is logged once
        self._ckpt_digest: str | None = None  # SHA-256 of the checkpoint.pt on disk
        # signals seen and how far the run got (the CLI's own handler reads it: a signal
        # after the loop's end only waits, the run is then complete)
        self.stop = _Stop()
        self.per_round = clients_per_round(rc)
        self.sampler = np.random.default_rng([seed, 7])

    # ------------------------------------------------------------------ loop
    def sample(self) -> np.ndarray:
        n = self.fed.num_clients
        if self.per_round == n:
            return np.arange(n)
        return np.sort(self.sampler.choice(n, self.per_round, replace=False))

    def run(self, hydra_files: dict[str, str] | None = None, *, until: int | None = None) -> dict:
        """Claim the run directory, train and evaluate, write the results; returns the
        summary. `hydra_files` ({relative path: text}, e.g. Hydra's `.hydra/hydra.yaml`)
        are written once the directory is claimed; `.hydra/config.yaml` always is. A resume of
        a finished run (`checkpoint.finished`) returns its summary and writes nothing.
        `until`: stop after that round as a preempted run stops (its metrics.csv rows, a
        checkpoint when checkpoints are on, no summary.json; returns {}), with `rounds`
        unchanged: the first rounds of a long run exactly (APPLE's and FedSpa's schedules
        follow `rounds`), which is what scripts/check_pinned.sh re-runs."""
        done = finished(self.cfg, self.out)
        if done is not None:
            log.info("%s", done.line)
            return done.summary
        with RunDir.claim(self.out, resume=bool(self.config.resume)):
            files = {".hydra/config.yaml": OmegaConf.to_yaml(self.cfg), **(hydra_files or {})}
            for rel, text in files.items():
                atomic_write_text(self.out / rel, text)
            with _log_file(self.out / "run.log"):
                sinks = Sinks.from_config(self.config.log)
                try:
                    summary = self._run(sinks, until)
                except Exception as e:
                    log.error("%s", e, exc_info=not isinstance(e, FedbenchError))
                    with contextlib.suppress(OSError, FedbenchError):
                        atomic_write_text(self.out / ERROR_FILE, f"{e}\n")
                    raise
                finally:
                    sinks.close()
                (self.out / ERROR_FILE).unlink(missing_ok=True)
                return summary

    def _run(self, sinks: Sinks, until: int | None = None) -> dict:
        rc = self.config
        # class counts per client ride along, so the report draws the split without the data
        counts = partition_counts(
            self.labels_pool, self.partition.train, self.partition.test, self.num_classes
        )
        atomic_write_json(
            self.out / "partition.json",
            {**self.partition.to_json(), **counts, "eval_sets": self.eval_sets},
        )
        log.info(
            "%s on %s (%s split, %d clients, %d per round), model %s: %d parameters; device %s",
            rc.algo.name,
            rc.data.name,
            rc.split.name,
            self.fed.num_clients,
            self.per_round,
            rc.model.name,
            self.engine.n_params,
            self.device,
        )
        log.info("partition:\n%s", self.partition.summary(self.labels_pool, self.num_classes))
        rounds = rc.rounds
        every = rc.eval.every
        ckpt_every = rc.checkpoint.every
        tail = rc.eval.tail
        # Everything the loop accumulates: checkpointed with the algorithm so that a resumed
        # run ends exactly as an uninterrupted one. metrics.csv (one row per evaluation, small)
        # rides along whole, so a resume can restore it; clients.csv only by its length.
        st = {
            "next_round": 0,
            "elapsed_s": 0.0,
            "comm": {"bytes_up": 0, "bytes_down": 0},
            "best": None,
            "best_val": None,  # the evaluation with the best V avg (split.val_frac > 0)
            "final": None,
            "size": None,
            "metrics_csv": b"",
            "clients_len": 0,
        }
        if rc.resume and (self.out / CHECKPOINT).exists():
            st = self._restore(rounds, every)
            st.setdefault("best_val", None)  # a checkpoint from before validation sets
            self.stop.checkpoint_round = int(st["next_round"])
        sinks.start(plain(self.cfg), self.out, bool(rc.resume))
        metrics = _appender(self.out / "metrics.csv", st["metrics_csv"])
        clients = _clients_appender(self.out / "clients.csv", st["clients_len"])
        comm = st["comm"]
        t0 = time.perf_counter() - st["elapsed_s"]
        stop_at = rounds if until is None else min(int(until), rounds)
        bar = tqdm(
            range(st["next_round"], stop_at),
            desc=rc.algo.name,
            disable=not self.progress,
            leave=False,
            initial=st["next_round"],
            total=rounds,
        )
        first, t_loop = st["next_round"], time.perf_counter()  # this process's pace
        with _graceful(self.out, st, self.stop) as stop:
            for t in bar:
                chosen = self.sample()
                report = self.algo.round(t, chosen)
                comm["bytes_up"] += int(report.comm.bytes_up)
                comm["bytes_down"] += int(report.comm.bytes_down)
                if (t + 1) % every == 0 or t + 1 == rounds:
                    if (t + 1) % every:  # only because the run ends here: an extension drops it
                        st["pre_final"] = {
                            "metrics_csv": _read_prefix(metrics.path, metrics.length),
                            "clients_len": clients.length,
                            **{k: st[k] for k in ("best", "best_val", "final", "size")},
                        }
                    loss = self._check_loss(report.train_loss, t)
                    res = evaluate(self.algo, self.fed, tail, honest=self.honest)
                    summ = summaries(res)
                    row = {"round": t + 1, "wall_time_s": time.perf_counter() - t0}
                    row["train_loss"] = loss
                    row.update(comm)
                    row.update(diagnostics(report))
                    row.update(size_columns(self.algo, comm, t + 1, report, len(chosen)))
                    row.update(_flatten(summ))
                    metrics.append([row])
                    sinks.log(t + 1, row)
                    clients.append(_client_frame(t + 1, res).to_dict("records"))
                    st["size"] = {k: row[k] for k in SIZE_KEYS if k in row}
                    st["final"] = {"round": t + 1, **summ}
                    if st["best"] is None or _key(st["final"]) > _key(st["best"]):
                        st["best"] = st["final"]
                    if better(st["final"], st["best_val"], VAL):
                        st["best_val"] = st["final"]
                    bar.set_postfix_str(_postfix(summ))
                    if not self.progress:  # a SLURM log, a pipe: one line per evaluation
                        log.info(_progress_line(t + 1, rounds, summ, first, t_loop))
                st["next_round"] = t + 1
                # the last round too: a finished run can be extended (rounds=<more> resume=true)
                due = ckpt_every and ((t + 1) % ckpt_every == 0 or t + 1 in (rounds, stop_at))
                if due or stop.signum:
                    st["elapsed_s"] = time.perf_counter() - t0
                    self._checkpoint(st, metrics, clients)
                    stop.checkpoint_round = t + 1
                if t + 1 == rounds:
                    # every round is done (a signal in the last one stops nothing): the
                    # summary is written whatever comes now, so that exit status and files agree
                    stop.finishing = True
                elif stop.signum:
                    bar.close()
                    raise Interrupted(stop.signum, t + 1, True, self.out)
            bar.close()
            if st["next_round"] < rounds:  # stopped at `until`: an unfinished run, no summary
                return {}
            stop.finishing = True  # (a resume of a finished run has no round to run)
            summary = self._finish(st, rounds, t0, sinks)
            stop.finished = True
        return summary

    def _finish(self, st: dict, rounds: int, t0: float, sinks: Sinks) -> dict:
        """Write summary.json (the run is then complete) and close the trackers."""
        rc = self.config
        wall = time.perf_counter() - t0
        if st["final"] is None:
            raise FedbenchError(f"{self.out}: no evaluation was made (rounds={rounds})")
        summary = {
            "algo": rc.algo.name,
            "data": rc.data.name,
            "split": rc.split.name,
            "model": rc.model.name,
            "seed": rc.seed,
            "rounds": rounds,
            "clients": self.fed.num_clients,
            "participation": rc.participation,
            "wall_time_s": round(wall, 3),
            "device": str(self.device),
            "version": fedbench.__version__,
            "final": st["final"],
            "best": st["best"],
            # the round the tables report (eval.select): by val, last or best_test
            "selected": selected(self._select_rule(), st["final"], st["best"], st["best_val"]),
            "malicious": 0 if self.attack is None else self.attack.count,
            "provenance": self.provenance,
        }
        if st["size"]:
            summary["size"] = st["size"]
        summary["objective"] = objective_record(
            summary, rc.objective.metric, rc.objective.at, self.tuning
        )
        atomic_write_json(self.out / "summary.json", summary)
        sinks.finish(summary)
        return summary

    def _select_rule(self) -> str:
        return resolve_select(self.config.eval.select, self.fed.val_idx is not None)

    def _check_loss(self, train_loss: torch.Tensor | float, t: int) -> float:
        loss = float(train_loss)
        if not math.isfinite(loss):
            if self.attack is None:
                raise FedbenchError(
                    f"training diverged at round {t + 1} (loss {loss}); lower optim.lr"
                )
            # under attack a collapse is the outcome measured (FedPG Table 3): go on
            if not self._warned_collapse:
                self._warned_collapse = True
                log.warning(
                    "training diverged at round %d under attack.kind=%s (loss %s); "
                    "the run goes on and scores the collapsed models",
                    t + 1,
                    self.config.attack.kind,
                    loss,
                )
        return loss

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, progress: dict, metrics: CsvAppender, clients: CsvAppender) -> None:
        """The run's state and the loop's progress, streamed into place atomically with its
        digest (fedbench/checkpoint.py)."""
        progress["metrics_csv"] = _read_prefix(metrics.path, metrics.length)
        progress["clients_len"] = clients.length
        state = checkpoint.run_state(self, progress)
        size, self._ckpt_digest = checkpoint.save(
            self.out / CHECKPOINT, state, previous=self._ckpt_digest
        )
        if not self._ckpt_logged:
            self._ckpt_logged = True
            every = self.config.checkpoint.every
            log.info("%s: %.1f MB (every %s rounds)", CHECKPOINT, size / 1e6, every or "no")

    def _restore(self, rounds: int, every: int) -> dict:
        """Load the verified checkpoint into the algorithm, engine and generators; cut
        metrics.csv and clients.csv back to what it recorded. Returns the loop's progress."""
        path = self.out / CHECKPOINT
        state, self._ckpt_digest = checkpoint.load_run_state(path, map_location=self.device)
        checkpoint.restore_state(self, state)
        progress = _upgrade_progress(state["progress"])
        progress = checkpoint.drop_final_only(progress, rounds, every)
        checkpoint.cut_files(self.out, progress)
        log.info("resumed from %s at round %d", path, progress["next_round"])
        return progress


def _warn_small_tests(test_idx: list) -> None:
    sizes = np.array([len(t) for t in test_idx])
    few = int((sizes < MIN_TEST_SAMPLES).sum())
    if few:
        log.warning(
            "split: %d of %d clients have fewer than %d test samples (smallest: %d), so their "
            "accuracies move in steps of %.0f points or more; use fewer clients or more data "
            "per client",
            few,
            sizes.size,
            MIN_TEST_SAMPLES,
            sizes.min(),
            100 / max(1, MIN_TEST_SAMPLES - 1),
        )


def _read_prefix(path: Path, length: int) -> bytes:
    if length == 0:
        return b""
    with open(path, "rb") as f:
        return f.read(length)


def _appender(path: Path, text: bytes) -> CsvAppender:
    """metrics.csv continued from `text` (its content at the checkpoint; b"": a new file)."""
    header = text.split(b"\n", 1)[0].decode().split(",") if text else None
    return CsvAppender(path, header, len(text))


CLIENT_COLUMNS = ("round", "client", "model", "metric", "value")


def _clients_appender(path: Path, length: int) -> CsvAppender:
    return CsvAppender(path, CLIENT_COLUMNS, length)


def _upgrade_progress(p: dict) -> dict:
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


def _progress_line(done: int, rounds: int, summ: dict, first: int, t_loop: float) -> str:
    """'round 40/500 | personal L 91.2% global L 80.1% | 1.31 s/round, 10m03s left'."""
    accs = [
        f"{kind} L {100 * summ[kind]['L']['avg']:.1f}%"
        for kind in ("personal", "global")
        if summ.get(kind)
    ]
    pace = (time.perf_counter() - t_loop) / max(1, done - first)
    left = int(round(pace * (rounds - done)))
    h, rest = divmod(left, 3600)
    eta = f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"
    return f"round {done}/{rounds} | {' '.join(accs)} | {pace:.2f} s/round, {eta} left"


def _postfix(summ: dict) -> str:
    parts = []
    for kind in ("personal", "global"):
        if summ.get(kind):
            parts.append(f"{kind[0]}.acc={summ[kind]['L']['avg']:.3f}")
    return " ".join(parts)


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
