"""The round loop and the run's life: `Run(cfg, out)` checks the config once
(`fedbench.config.load_config`), admits a resume (`fedbench.checkpoint.check_resume`) and
builds the run's parts (fedbench/run/build.py), writing nothing; `Run.run()` claims the run
directory (fedbench/rundir.py: a lock for the run's life; another run's directory only with
resume=true), writes .hydra/config.yaml and run.log, then loops over the rounds: sample
clients, `Algorithm.round`, evaluate every `eval.every` rounds and at the end (the rows and
summaries: fedbench/run/record.py), checkpoint every `checkpoint.every` rounds, at the end
and on a signal (fedbench/run/checkpoint.py). A run that fails leaves error.txt saying why.

SIGTERM (SLURM's preemption and time-out signal) and Ctrl-C finish the round under way, save
a checkpoint and raise `Interrupted`; a second one stops at once. Once the last round is done
a signal only waits: the summary is written and the run is complete.
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
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from fedbench.checkpoint import check_resume, finished
from fedbench.config import load_config
from fedbench.errors import FedbenchError
from fedbench.evaluation import evaluate
from fedbench.io import atomic_write_text
from fedbench.run.build import build
from fedbench.run.checkpoint import RunCheckpoint, keep_pre_final
from fedbench.run.record import Progress, Recorder, new_progress, write_partition
from fedbench.rundir import RunDir
from fedbench.tracking import Sinks
from fedbench.trees import plain

log = logging.getLogger("fedbench")

# A run that stopped on an error says why here (fedbench-report lists it); a run that then
# finishes (resumed) removes it.
ERROR_FILE = "error.txt"


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
        saved = check_resume(cfg, self.out) if rc.resume else None
        self.built = b = build(rc, self.out, saved)
        # the parts by name (scripts and tests reach them as run.fed, run.algo ...)
        self.device, self.provenance, self.partition = b.device, b.provenance, b.partition
        self.eval_sets, self.fed, self.model_fn = b.eval_sets, b.fed, b.model_fn
        self.labels_pool, self.num_classes = b.labels_pool, b.num_classes
        self.engine, self.attack, self.algo = b.engine, b.attack, b.algo
        self.per_round, self.sampler = b.per_round, b.sampler
        self.honest = None if self.attack is None else self.attack.honest
        self._warned_collapse = False  # one warning per run when an attacked run diverges
        self.checkpoint = RunCheckpoint(self, self.out, self.device, rc.checkpoint.every)
        # signals seen and how far the run got (the CLI's own handler reads it: a signal
        # after the loop's end only waits, the run is then complete)
        self.stop = _Stop()

    def sample(self) -> np.ndarray:
        """The clients of the next round (sorted; all of them at participation 1)."""
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
        write_partition(self.out, rc, self.built)
        rounds = rc.rounds
        every = rc.eval.every
        ckpt_every = rc.checkpoint.every
        tail = rc.eval.tail
        st: Progress | None = self.checkpoint.restore(rounds, every) if rc.resume else None
        if st is None:
            st = new_progress()
        else:
            self.stop.checkpoint_round = int(st["next_round"])
        sinks.start(plain(self.cfg), self.out, bool(rc.resume))
        comm = st["comm"]
        t0 = time.perf_counter() - st["elapsed_s"]
        # CPU seconds, beside the wall clock: what a run costs whatever else shares the
        # machine (a run begun by an older fedbench, resumed, records none)
        c0 = None if "cpu_s" not in st else time.process_time() - st["cpu_s"]
        rec = Recorder(self.out, rc, self.built, st, sinks, t0, self.tuning, c0)
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
                        keep_pre_final(st, rec.metrics, rec.clients)
                    loss = self._check_loss(report.train_loss, t)
                    res = evaluate(self.algo, self.fed, tail, honest=self.honest)
                    summ = rec.evaluation(t + 1, res, loss, report, len(chosen))
                    bar.set_postfix_str(_postfix(summ))
                    if not self.progress:  # a SLURM log, a pipe: one line per evaluation
                        log.info(_progress_line(t + 1, rounds, summ, first, t_loop))
                st["next_round"] = t + 1
                # the last round too: a finished run can be extended (rounds=<more> resume=true)
                due = ckpt_every and ((t + 1) % ckpt_every == 0 or t + 1 in (rounds, stop_at))
                if due or stop.signum:
                    st["elapsed_s"] = time.perf_counter() - t0
                    if c0 is not None:
                        st["cpu_s"] = time.process_time() - c0
                    self.checkpoint.save(st, rec.metrics, rec.clients)
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
            summary = rec.finish(rounds)
            stop.finished = True
        return summary

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
