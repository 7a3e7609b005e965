"""`fedbench-status`: where a set of sweeps stands, cell by cell, without running anything.

A table script (scripts/reproduce_*.sh) is a list of `fedbench -m` sweeps, each into a fixed
`hydra.sweep.dir`; every job of a sweep (a cell) has a fixed directory,
`<sweep dir>/<its overrides>` (hydra.sweep.subdir, fedbench.cell_name), exactly as Hydra
names it. Run again with
`resume=auto`, a finished cell is skipped and an interrupted one resumes from its
checkpoint. This module composes every cell's config as Hydra will, finds its directory and
tells what it holds:

    done         summary.json of this config at its full length
    running      its lock is held by a live process (rundir.py)
    interrupted  a checkpoint to resume from (killed, preempted, stopped)
    failed       error.txt and no checkpoint (resume=auto starts it again)
    left         nothing yet

and estimates the time left from the seconds per round measured in the cells' own
metrics.csv (per method where a cell of that method has run, else over all of them).

    fedbench-status +experiment=diversifed_table1_fmnist algo=fedavg,local seed=0,1 \\
        hydra.sweep.dir=multirun/t1/fedavg           # one sweep, as given to fedbench -m
    fedbench-status --plan sweeps.txt --label "FedPG Table 1"   # one sweep per line
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shlex
import socket
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fedbench.errors import FedbenchError

STATES = ("done", "running", "interrupted", "failed", "left")


@dataclass(frozen=True)
class Cell:
    """One job of a sweep: its directory, what it needs, and what it holds."""

    path: Path
    algo: str
    rounds: int
    state: str
    rounds_done: int = 0  # the last evaluated round in its metrics.csv
    seconds_per_round: float | None = None  # measured in this cell (wall time / rounds)
    note: str = ""  # who holds it, why it failed

    @property
    def rounds_left(self) -> int:
        return 0 if self.state == "done" else max(self.rounds - self.rounds_done, 0)


class StatusError(FedbenchError):
    """A sweep that cannot be enumerated here (no fixed sweep directory, bad syntax)."""


@dataclass(frozen=True)
class Sweep:
    cells: list[Cell]
    jobs_at_once: int  # the launcher's parallelism (1: one job at a time)


def sweep_cells(overrides: list[str], user_dirs: tuple[str, ...] = ()) -> Sweep:
    """Every cell of one `fedbench -m <overrides>` sweep, with its state."""
    from hydra import compose, initialize_config_dir

    from fedbench.cli import _jobs
    from fedbench.config import task_config
    from fedbench.paths import CONF_DIR

    if not any(o.startswith("hydra.sweep.dir=") for o in overrides):
        raise StatusError(
            "fedbench-status: the sweep needs a fixed hydra.sweep.dir=<dir> (a table's cells "
            "are found again only in a directory that does not change with the time)"
        )
    jobs = _jobs(overrides)
    if jobs is None:
        raise StatusError(
            f"fedbench-status: cannot enumerate the jobs of {' '.join(overrides)} (an interval "
            "or another sweeper's syntax)"
        )
    extra = []
    if user_dirs:
        paths = ",".join(f"file://{Path(d).expanduser().absolute()}" for d in user_dirs)
        extra = [f"hydra.searchpath=[{paths}]"]
    cells = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="fedbench"):
        for num, job in enumerate(jobs):  # Hydra's basic sweeper numbers jobs in this order
            try:
                cfg = compose(
                    "config", overrides=[*job, *extra, f"hydra.job.num={num}"],
                    return_hydra_config=True,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 (Hydra's and OmegaConf's errors)
                raise StatusError(f"fedbench-status: {' '.join(job)}: {e}") from None
            path = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
            task = task_config(cfg)
            cells.append(cell_state(task, path))
            if num == 0:
                at_once = parallelism(cfg.hydra.launcher)
    return Sweep(cells, at_once)


def parallelism(launcher) -> int:
    """How many of a sweep's jobs run at once: the joblib launcher's n_jobs (-1: every
    core), SLURM's array_parallelism when set; else one."""
    n = launcher.get("n_jobs", launcher.get("array_parallelism"))
    if n is None:
        return 1
    n = int(n)
    return (os.cpu_count() or 1) if n < 0 else max(n, 1)


def cell_state(cfg, path: Path) -> Cell:
    """What the directory of a cell whose config is `cfg` holds (reads small files only)."""
    from fedbench.rundir import LOCK
    from fedbench.runner import CHECKPOINT, ERROR_FILE, finished_run

    algo, rounds = str(cfg.algo.name), int(cfg.rounds)
    done, spr = _measured(path / "metrics.csv")
    base = {"path": path, "algo": algo, "rounds": rounds}
    if not path.is_dir():
        return Cell(state="left", **base)
    holder = _lock_holder(path / LOCK)
    if holder:
        return Cell(state="running", rounds_done=done, seconds_per_round=spr, note=holder, **base)
    if finished_run(cfg, path) is not None:
        return Cell(state="done", rounds_done=rounds, seconds_per_round=spr, **base)
    if (path / CHECKPOINT).exists():
        return Cell(state="interrupted", rounds_done=done, seconds_per_round=spr, **base)
    if (path / ERROR_FILE).exists():
        note = ""
        with contextlib.suppress(OSError, IndexError):
            note = (path / ERROR_FILE).read_text().strip().splitlines()[0][:200]
        return Cell(state="failed", seconds_per_round=spr, note=note, **base)
    # Started but killed before its first checkpoint: resume=auto starts it from round 0.
    return Cell(state="left", seconds_per_round=spr, **base)


def _measured(metrics: Path) -> tuple[int, float | None]:
    """(last evaluated round, seconds per round) from a run's metrics.csv; (0, None) when
    there is none. Its wall_time_s is cumulative over resumes."""
    try:
        with open(metrics, "rb") as f:
            header = f.readline().decode()
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(end - 65536, 0))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0, None
    if len(tail) < 2:
        return 0, None
    try:
        row = next(csv.DictReader(io.StringIO(header + tail[-1] + "\n")))
        r, wall = int(row["round"]), float(row["wall_time_s"])
    except (StopIteration, KeyError, TypeError, ValueError):
        return 0, None
    return r, (wall / r if r > 0 and wall > 0 else None)


def _lock_holder(lock: Path) -> str:
    """Who holds the run's lock ("" when nobody does). Never takes the lock itself (a probe
    would make a run starting at that instant see the directory in use): a holder on this
    host is looked up in /proc/locks; one on another host (a SLURM node over a shared file
    system) is trusted by its note, which it removes when it lets go."""
    try:
        st = lock.stat()
        info = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return ""
    host, pid = str(info.get("host", "")), info.get("pid")
    who = f"pid {pid} on {host}" if pid else "another process"
    if host and host != socket.gethostname():
        return who
    try:
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:  # not Linux: whether the holder's process is alive
        return who if pid and _alive(int(pid)) else ""
    ino = str(st.st_ino)
    for line in locks:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == ino:
            return who
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _duration(seconds: float) -> str:
    m = round(seconds / 60)
    if m < 60:
        return f"{max(m, 1)} min"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min" if h < 48 else f"{h / 24:.1f} days"


def estimate(cells: list[Cell]) -> tuple[float | None, dict[str, float]]:
    """Seconds of work left (one job at a time) and the s/round used per method: a cell's
    own pace, else its method's mean over the cells that measured one, else the mean over
    all methods; None when no cell has measured a round yet."""
    by_algo: dict[str, list[float]] = defaultdict(list)
    for c in cells:
        if c.seconds_per_round:
            by_algo[c.algo].append(c.seconds_per_round)
    pace = {a: sum(v) / len(v) for a, v in by_algo.items()}
    if not pace:
        return (0.0 if all(c.state == "done" for c in cells) else None), pace
    overall = sum(pace.values()) / len(pace)
    total = 0.0
    for c in cells:
        if c.rounds_left:
            total += c.rounds_left * (c.seconds_per_round or pace.get(c.algo, overall))
    return total, pace


def summary_line(cells: list[Cell], label: str = "", jobs_at_once: int = 1) -> str:
    count = {s: sum(c.state == s for c in cells) for s in STATES}
    left = count["interrupted"] + count["failed"] + count["left"]
    parts = [f"{count['done']} done", f"{count['running']} running", f"{left} left"]
    more = []
    if count["interrupted"]:
        more.append(f"{count['interrupted']} resume from a checkpoint")
    if count["failed"]:
        more.append(f"{count['failed']} failed before")
    head = f"{label}: " if label else ""
    line = f"{head}{len(cells)} cells: {', '.join(parts)}"
    line += f" ({', '.join(more)})" if more else ""
    seconds, pace = estimate(cells)
    if count["done"] == len(cells):
        return line
    if seconds is None:
        return line + "; time left: known once a round has been measured"
    at_once = f", {jobs_at_once} jobs at a time" if jobs_at_once > 1 else ""
    return (
        f"{line}; about {_duration(seconds / max(jobs_at_once, 1))} left{at_once} "
        f"(measured s/round: {', '.join(f'{a} {s:.2f}' for a, s in sorted(pace.items()))})"
    )


def cell_lines(cells: list[Cell]) -> list[str]:
    out = []
    for c in cells:
        where = f"round {c.rounds_done}/{c.rounds}" if c.state != "left" else f"0/{c.rounds}"
        note = f"  {c.note}" if c.note else ""
        out.append(f"  {c.state:<11} {where:<14} {c.path}{note}")
    return out


def read_plan(path: Path) -> list[list[str]]:
    """A plan file: one sweep per line, the overrides of its `fedbench -m` as shell words
    (a leading `fedbench -m` is allowed); blank lines and # comments are skipped."""
    sweeps = []
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["fedbench", "-m"]:
            words = words[2:]
        if words:
            sweeps.append(words)
    return sweeps


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedbench-status",
        description="Where a table's sweeps stand: cells done, running, left, and the time "
        "left at the measured seconds per round. Runs nothing.",
    )
    p.add_argument("overrides", nargs="*", help="one sweep's overrides, as given to fedbench -m")
    p.add_argument("--plan", type=Path, help="a file of sweeps, one per line")
    p.add_argument("--label", default="", help="what to call them in the summary line")
    p.add_argument("-v", "--cells", action="store_true", help="also one line per cell")
    p.add_argument("--config-dir", "-cd", action="append", default=[], help="as fedbench's")
    p.add_argument("--json", action="store_true", help="the cells as JSON instead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        sweeps = read_plan(args.plan) if args.plan else []
        if args.overrides:
            sweeps.append(list(args.overrides))
        if not sweeps:
            raise StatusError("fedbench-status: no sweep given (overrides, or --plan FILE)")
        cells: list[Cell] = []
        at_once = 1
        for overrides in sweeps:
            sweep = sweep_cells(overrides, tuple(args.config_dir))
            cells.extend(sweep.cells)
            at_once = max(at_once, sweep.jobs_at_once)
    except (FedbenchError, OSError) as e:
        print(e if isinstance(e, FedbenchError) else f"fedbench-status: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        rows = [{**c.__dict__, "path": str(c.path)} for c in cells]
        print(json.dumps(rows, indent=1))
        return 0
    if args.cells:
        print("\n".join(cell_lines(cells)))
    print(summary_line(cells, args.label, at_once))
    return 0


if __name__ == "__main__":
    sys.exit(main())
