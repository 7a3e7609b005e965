"""`python -m fedbench.tune FEDERATION`: equal-budget tuning, one Optuna study per algorithm.

Every algorithm gets the same budget on a named federation (conf/federation/<name>.yaml): the
same number of trials, each trial the same seeds and rounds, its search space from
conf/search/<algo>.yaml (the learning rate over one range for all, and at most 3 of its own
hyperparameters), and the same objective: `objective.metric` (auto: the validation accuracy of
the personalized model at the validation-selected round), averaged over the trial's seeds.
When a study has all its trials, its winner is written as <federation>/<algo>.yaml in conf/tuned/,
which `tuned=<federation>` applies (conf/config.yaml's defaults; docs/leaderboard.md).

    python -m fedbench.tune fmnist_pat2 --algos fedavg,ditto --trials 12 --seeds 100
    scripts/tune.sh fmnist_pat2                # every algorithm, with the table scripts' env

A study lives in its folder, `<out>/<federation>/<algo>/`, and nowhere else:

- `study.json`: what makes the study (federation, seeds, rounds, objective, sampler, search
  space); a later command with other values is refused rather than mixed into it;
- `trial_NNN/trial.json`: the trial's values, written before its runs start (state `running`)
  and again when they end (`complete` with the objective, or `failed` with the error);
- `trial_NNN/seed_S/`: the trial's run for seed S, a plain `fedbench` run in a fixed
  directory with resume=auto (its one-line command is in trial.json).

Run the same command again after an interruption (Ctrl-C, a kill, a reboot): a trial left
`running` is run again with its own values, and its runs skip what finished and resume what
was interrupted from their checkpoints (the runs die with this process: PR_SET_PDEATHSIG on
Linux, so a killed study leaves no run behind). The sampler (TPE) is seeded per trial number
and rebuilt from the trial files at every draw, so a study that was interrupted draws exactly
the values an uninterrupted one draws.

Why not Hydra's Optuna sweeper (hydra/sweeper=optuna_lr, the same search spaces): it runs
`n_trials` more trials at every invocation, leaves the trial a kill interrupted unfinished in
its storage with its run abandoned, and numbers its jobs from 0 again; and its optuna < 3 pin
ties an RDB storage to an old SQLAlchemy. Here optuna only draws: its in-memory study is
rebuilt from the trial files (optuna >= 2.10: `pip install 'fedbench[optuna]'`).

Bad input is one line on stderr and exit code 2, before anything is written.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import math
import shlex
import signal
import subprocess
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fedbench.errors import FedbenchError
from fedbench.paths import CONF_DIR

EXIT_BAD_INPUT = 2
# How the sampler sees a failed trial: as a finished one with an objective below every
# finished trial's (study.json's sampler.failed; draw()).
FAILED_AS = "worst"
EXIT_FAILED = 1
NEEDS_OPTUNA = "needs optuna: pip install 'fedbench[optuna]'"
DEFAULT_OUT = "multirun/tune"
DEFAULT_SEEDS = (
    100,
)  # apart from the leaderboard's 0-4: its numbers are on splits tuning never saw
DEFAULT_TRIALS = 12
SIG_DIGITS = 3  # a drawn float is rounded to 3 significant digits (readable, and exact in YAML)
STUDY_FILE = "study.json"
TRIAL_FILE = "trial.json"
STATES = ("running", "complete", "failed")
ERROR_FILE = "error.txt"  # fedbench.runner.ERROR_FILE (not imported: it needs torch)


class TuneError(FedbenchError):
    """Bad input, or a study that cannot go on here: one line, exit 2."""


class Interrupted(Exception):
    """A trial's run was stopped by a signal: the study stops and resumes when run again.
    `code`: the exit code to end with (128 + the signal)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- configs
def compose_run(overrides: list[str] | tuple[str, ...], hydra: bool = False):
    """The run config the `fedbench` command composes for `overrides` (conf/ of this
    install); with `hydra`, the whole composed config, its hydra node included."""
    from hydra import compose, initialize_config_dir

    from fedbench.config import task_config

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="fedbench"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return cfg if hydra else task_config(cfg)


def federations() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "federation").glob("*.yaml"))


def incidental_keys() -> set[str]:
    """Keys that change where or how a run computes, not what (conf/config.yaml's
    hydra.job.config.override_dirname.exclude_keys): not part of a study's identity."""
    cfg = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    return set(cfg["hydra"]["job"]["config"]["override_dirname"]["exclude_keys"])


# --------------------------------------------------------------------------- search spaces
@dataclass(frozen=True)
class Dimension:
    """One key of a search space as conf/search/<algo>.yaml writes it in Hydra's sweep
    syntax: choice(...) (categorical) or [tag(log, ]interval(low, high)[)] (a float)."""

    key: str
    text: str
    choices: tuple | None = None
    low: float = 0.0
    high: float = 0.0
    log: bool = False

    @classmethod
    def parse(cls, key: str, text: str) -> Dimension:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

        try:
            override = OverridesParser.create().parse_override(f"{key}={text}")
        except Exception as e:  # noqa: BLE001 (Hydra's parse errors: one line)
            raise TuneError(f"search space {key}={text}: not Hydra sweep syntax ({e})") from None
        value = override.value()
        if isinstance(value, ChoiceSweep | RangeSweep):
            choices = tuple(override.sweep_iterator())
            if not choices or not all(
                v is None or isinstance(v, bool | int | float | str) for v in choices
            ):
                raise TuneError(f"search space {key}={text}: choices must be plain values")
            return cls(key, text, choices=choices)
        if isinstance(value, IntervalSweep):
            low, high = float(value.start), float(value.end)
            if not low < high or ("log" in value.tags and low <= 0):
                raise TuneError(f"search space {key}={text}: an empty or invalid interval")
            return cls(key, text, low=low, high=high, log="log" in value.tags)
        raise TuneError(f"search space {key}={text}: a choice(...) or an interval(...)")

    def suggest(self, trial: Any) -> Any:
        """The value an optuna trial draws; a float rounded to SIG_DIGITS (inside the range)."""
        if self.choices is not None:
            return trial.suggest_categorical(self.key, list(self.choices))
        x = trial.suggest_float(self.key, self.low, self.high, log=self.log)
        return min(max(float(f"{x:.{SIG_DIGITS}g}"), self.low), self.high)


def search_space(algo: str) -> dict[str, Dimension]:
    """conf/search/<algo>.yaml's keys (applied to a sweep by +search=<algo>)."""
    path = CONF_DIR / "search" / f"{algo}.yaml"
    try:
        params = yaml.safe_load(path.read_text())["hydra"]["sweeper"]["params"]
    except FileNotFoundError:
        raise TuneError(f"algo {algo!r}: no search space {path}") from None
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise TuneError(f"{path}: no hydra.sweeper.params ({type(e).__name__})") from None
    return {k: Dimension.parse(k, str(v)) for k, v in params.items()}


def override_text(value: Any) -> str:
    """A drawn value as the command line writes it (floats exactly: repr round-trips)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


# --------------------------------------------------------------------------- a study
@dataclass(frozen=True)
class Study:
    """One algorithm's study on one federation, and where it lives."""

    federation: str
    algo: str
    trials: int
    seeds: tuple[int, ...]
    rounds: int  # the federation's, or --rounds
    objective: str  # objective.metric of every run (auto: validation where there is some)
    sampler_seed: int
    startup: int  # trials drawn at random before TPE models the history
    overrides: tuple[str, ...]  # more overrides for every run
    space: dict[str, Dimension]
    folder: Path
    rounds_given: bool = False  # --rounds on the command line (else the federation's)

    def identity(self) -> dict[str, Any]:
        """What a study is: a later command must agree on all of it (trials may grow)."""
        skip = incidental_keys()
        return {
            "federation": self.federation,
            "algo": self.algo,
            "seeds": list(self.seeds),
            "rounds": self.rounds,
            "objective": self.objective,
            "sampler": {
                "name": "tpe",
                "seed": self.sampler_seed,
                "startup": self.startup,
                "failed": FAILED_AS,
            },
            "space": {k: d.text for k, d in self.space.items()},
            "overrides": [o for o in self.overrides if _key(o) not in skip],
        }

    def run_args(self, params: dict[str, Any], seed: int) -> list[str]:
        """The overrides of one run of a trial (without its directory)."""
        args = [f"+federation={self.federation}", f"algo={self.algo}"]
        args += [f"{k}={override_text(v)}" for k, v in params.items()]
        args += [f"seed={seed}"]
        if self.rounds_given:
            args.append(f"rounds={self.rounds}")
        if self.objective != "auto":
            args.append(f"objective.metric={self.objective}")
        return [*args, *self.overrides]


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


@dataclass
class Trial:
    """trial_NNN/trial.json."""

    number: int
    params: dict[str, Any]
    state: str = "running"
    value: float | None = None  # the objective, mean over the seeds
    values: dict[str, float] = field(default_factory=dict)  # per seed
    metric: str | None = None  # the objective as the runs resolved it (personal.V.avg)
    error: str | None = None
    started: str = ""
    ended: str | None = None
    # what its runs took, summed over its seeds (summary.json): {"wall": s, "cpu": s}, the
    # CPU time where every run recorded it; {} for a trial recorded before fedbench kept it
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "number": self.number,
            "state": self.state,
            "params": self.params,
            "value": self.value,
            "values": self.values,
            "metric": self.metric,
            "error": self.error,
            "started": self.started,
            "ended": self.ended,
        }
        if self.seconds:
            out["seconds"] = self.seconds
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Trial:
        trial = cls(
            number=int(obj["number"]),
            params=dict(obj["params"]),
            state=str(obj["state"]),
            value=None if obj.get("value") is None else float(obj["value"]),
            values={str(k): float(v) for k, v in (obj.get("values") or {}).items()},
            metric=obj.get("metric"),
            error=obj.get("error"),
            started=str(obj.get("started") or ""),
            ended=obj.get("ended"),
            seconds={str(k): float(v) for k, v in (obj.get("seconds") or {}).items()},
        )
        if trial.state not in STATES:
            raise ValueError(f"state {trial.state!r}")
        return trial


def trial_dir(study: Study, number: int) -> Path:
    return study.folder / f"trial_{number:03d}"


def run_dir(study: Study, number: int, seed: int) -> Path:
    return trial_dir(study, number) / f"seed_{seed}"


def command(study: Study, trial: Trial, seed: int) -> list[str]:
    """The one-line command of a trial's run (as a user types it)."""
    where = run_dir(study, trial.number, seed)
    return [
        "fedbench",
        *study.run_args(trial.params, seed),
        f"hydra.run.dir={where}",
        "resume=auto",
    ]


def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def _write_json(path: Path, obj: Any) -> None:
    from fedbench.io import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def load_trials(study: Study) -> list[Trial]:
    """The study's trials, by number (0, 1, ... without gaps)."""
    trials = []
    for path in sorted(study.folder.glob(f"trial_*/{TRIAL_FILE}")):
        try:
            trials.append(Trial.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TuneError(f"{path}: unreadable ({e}); move the trial's folder away") from None
    trials.sort(key=lambda t: t.number)
    if [t.number for t in trials] != list(range(len(trials))):
        raise TuneError(f"{study.folder}: trial numbers with a gap; not a study this tool wrote")
    return trials


def check_identity(study: Study) -> None:
    """Write study.json, or refuse a study whose folder was made with other settings."""
    path = study.folder / STUDY_FILE
    ident = study.identity()
    if path.exists():
        try:
            saved = json.loads(path.read_text())["identity"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TuneError(f"{path}: unreadable ({e})") from None
        if isinstance(saved.get("sampler"), dict) and "failed" not in saved["sampler"]:
            upgraded = {**saved, "sampler": {**saved["sampler"], "failed": FAILED_AS}}
            # rewritten only for a study this command continues (else refused below, unwritten)
            saved = _upgrade(study, path, upgraded) if upgraded == ident else upgraded
        diff = [k for k in sorted(set(saved) | set(ident)) if saved.get(k) != ident.get(k)]
        if diff:
            show = "; ".join(f"{k}: {saved.get(k)} -> {ident.get(k)}" for k in diff)
            raise TuneError(
                f"{study.folder} holds a study with other settings ({show}); run it with its "
                "own settings, or choose another --out"
            )
        return
    _write_json(path, {"identity": ident, "created": now()})


def _upgrade(study: Study, path: Path, upgraded: dict[str, Any]) -> dict[str, Any]:
    """A study.json from before FAILED_AS (its sampler never saw a failed trial), as
    `upgraded` (FAILED_AS added). Without a failed trial its draws are the ones FAILED_AS
    gives (the rule only acts on failures): it is rewritten as such. With one, the trials
    after the first failed one were drawn under the old rule: refused, naming them."""
    trials = load_trials(study)
    first = next((t for t in trials if t.state == "failed"), None)
    later = trials[first.number + 1 :] if first is not None else []  # numbered 0, 1, ...
    if later:
        names = f"trial_{later[0].number:03d}" + (
            f" to trial_{later[-1].number:03d}" if len(later) > 1 else ""
        )
        raise TuneError(
            f"{study.folder}: drawn by an older fedbench whose sampler ignored failed trials; "
            f"trial {first.number + 1} failed, so {names} were drawn without it: move them "
            "away and run again (they are drawn anew, the failure counted)"
        )
    _write_json(path, {**json.loads(path.read_text()), "identity": upgraded})
    return upgraded


# --------------------------------------------------------------------------- drawing
def _optuna():
    try:
        import optuna
    except ImportError:
        raise TuneError(f"python -m fedbench.tune {NEEDS_OPTUNA}") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def draw(study: Study, history: list[Trial]) -> dict[str, Any]:
    """Trial len(history)'s values: TPE (seeded by sampler_seed + the trial's number) over
    the history's finished trials, the first `startup` at random. A failed trial (a diverged
    run) counts as worse than every finished one (FAILED_AS), not as absent: TPE ignores
    Optuna's FAIL trials and so draws again from a region that just diverged (FedAMP's
    fmnist_dir03 study, when they were: 7 of its last 8 trials diverged there). A function of
    the history alone, so an interrupted study draws what an uninterrupted one does."""
    optuna = _optuna()
    number = len(history)
    sampler = optuna.samplers.TPESampler(
        seed=study.sampler_seed + number, n_startup_trials=study.startup
    )
    memory = optuna.create_study(direction="maximize", sampler=sampler)
    scratch = optuna.create_study().ask()  # the distributions as this optuna names them
    for dim in study.space.values():
        dim.suggest(scratch)
    dists = dict(scratch.distributions)
    done = [t.value for t in history if t.state == "complete" and t.value is not None]
    worst = (min(done) if done else 0.0) - 1.0  # FAILED_AS: below every finished trial
    with warnings.catch_warnings():  # create_trial/add_trial are "experimental" in optuna 2
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for t in history:
            if t.state in ("complete", "failed"):
                value = t.value if t.state == "complete" else worst
                memory.add_trial(
                    optuna.trial.create_trial(params=t.params, distributions=dists, value=value)
                )
    trial = memory.ask()
    return {k: dim.suggest(trial) for k, dim in study.space.items()}


# --------------------------------------------------------------------------- running
def _die_with_parent() -> None:
    """In a trial's run (before exec): SIGTERM when this process dies, even by kill -9, so
    that the run checkpoints and stops instead of running on unowned."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def fedbench_argv() -> list[str]:
    """How to start `fedbench` with this interpreter and this fedbench."""
    return [sys.executable, "-m", "fedbench.cli"]


@dataclass(frozen=True)
class RunOutcome:
    seed: int
    value: float | None
    metric: str | None
    error: str | None  # the run failed (error.txt)
    seconds: dict[str, float] = field(default_factory=dict)  # its summary's wall / cpu time


def run_one(study: Study, trial: Trial, seed: int, quiet: bool) -> RunOutcome:
    """One run of a trial: `fedbench ... resume=auto` in its fixed directory. Raises
    Interrupted (a signal), TuneError (refused before it ran: the study's fault)."""
    where = run_dir(study, trial.number, seed)
    argv = [*fedbench_argv(), *command(study, trial, seed)[1:]]
    linux = sys.platform.startswith("linux")
    last: deque[str] = deque(maxlen=5)  # the run's last stderr lines (a refusal's reason)
    started = time.time()
    with subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL if quiet else None,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        preexec_fn=_die_with_parent if linux else None,
    ) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:  # passed on as it comes (the run's progress)
            if line.strip():
                last.append(line.strip())
            if not quiet:
                sys.stderr.write(line)
    rc = proc.returncode
    if rc < 0 or rc in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        code = 128 + (-rc if rc < 0 else rc - 128)
        raise Interrupted(f"{study.algo} trial {trial.number + 1} seed {seed} was stopped", code)
    if rc != 0:
        error_file = where / ERROR_FILE
        # the run started and failed (its error.txt is this attempt's): the trial's values
        if error_file.is_file() and error_file.stat().st_mtime >= started - 1:
            text = error_file.read_text(errors="replace").strip()
            return RunOutcome(seed, None, None, (text.splitlines() or ["failed"])[0][:500])
        raise TuneError(
            f"{study.algo} trial {trial.number + 1} seed {seed} was refused: "
            f"{last[-1].removeprefix('fedbench: ') if last else f'exit code {rc}'}"
        )
    try:
        summary = json.loads((where / "summary.json").read_text())
        obj = summary["objective"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return RunOutcome(seed, None, None, f"no objective in {where}/summary.json ({e})")
    value = obj.get("value")
    secs = run_seconds(summary)
    if not isinstance(value, int | float) or not math.isfinite(value):
        why = f"objective {obj.get('metric')}: no value"
        return RunOutcome(seed, None, obj.get("metric"), why, secs)
    return RunOutcome(seed, float(value), str(obj.get("metric")), None, secs)


def run_seconds(summary: Any) -> dict[str, float]:
    """{"wall": ..., "cpu": ...} of a run's summary.json (the keys it has)."""
    out = {}
    for key, name in (("wall_time_s", "wall"), ("cpu_time_s", "cpu")):
        v = summary.get(key) if isinstance(summary, dict) else None
        if isinstance(v, int | float) and math.isfinite(v):
            out[name] = float(v)
    return out


def sum_seconds(parts: list[dict[str, float]]) -> dict[str, float]:
    """The runs' times summed: each clock only where every run has it."""
    if not parts:
        return {}
    return {k: sum(p[k] for p in parts) for k in ("wall", "cpu") if all(k in p for p in parts)}


def trial_seconds(study: Study, trial: Trial) -> dict[str, float]:
    """What the trial's runs took: its record's, else its run folders' summaries (a trial
    recorded before fedbench kept the time, its runs still on disk), else {}."""
    if trial.seconds:
        return trial.seconds
    from fedbench.report.collect import read_run
    from fedbench.report.leaderboard import seconds_per_round

    parts = []
    for seed in study.seeds:
        run = read_run(run_dir(study, trial.number, seed))
        if run.summary is None:
            return {}
        secs = run_seconds(run.summary)
        rounds = run.summary.get("rounds")
        steady = seconds_per_round(run)
        if "cpu" not in secs and steady is not None and isinstance(rounds, int):
            # no CPU time: the median wall seconds per round between metrics rows, times the
            # rounds (a paused run's wall clock counts its pause)
            secs["wall"] = min(secs.get("wall", math.inf), steady * rounds)
        parts.append(secs)
    return sum_seconds(parts)


def run_trial(study: Study, trial: Trial, quiet: bool = False) -> Trial:
    """Run every seed of `trial` (each resumes or is skipped as it stands), then record
    its state and objective (the mean over the seeds) in trial.json."""
    outcomes = [run_one(study, trial, s, quiet) for s in study.seeds]
    errors = [f"seed {o.seed}: {o.error}" for o in outcomes if o.error]
    trial.values = {str(o.seed): o.value for o in outcomes if o.value is not None}
    trial.metric = next((o.metric for o in outcomes if o.metric), None)
    trial.seconds = sum_seconds([o.seconds for o in outcomes if o.seconds])
    if errors:
        trial.state, trial.value, trial.error = "failed", None, "; ".join(errors)
    else:
        trial.state = "complete"
        trial.value = sum(trial.values.values()) / len(trial.values)
        trial.error = None
    trial.ended = now()
    write_trial(study, trial)
    return trial


def write_trial(study: Study, trial: Trial) -> None:
    """trial.json, with the one-line command of each of its runs."""
    commands = [shlex.join(command(study, trial, s)) for s in study.seeds]
    _write_json(
        trial_dir(study, trial.number) / TRIAL_FILE, {**trial.to_json(), "commands": commands}
    )


def best_trial(trials: list[Trial]) -> Trial | None:
    """The complete trial with the highest objective; on a tie, the earlier trial."""
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    return max(done, key=lambda t: (t.value, -t.number)) if done else None


def run_study(
    study: Study, quiet: bool = False, say: Callable[[str], None] = print
) -> Trial | None:
    """Run the study's trials that are not done (resuming one left running), and return its
    winner once it has all its trials (None: every trial failed)."""
    from fedbench.rundir import RunDirError, SweepDir

    try:  # a study is a sweep of trials: one process at a time, its runs below it
        lock = SweepDir.claim(study.folder)
    except RunDirError as e:
        raise TuneError(str(e).replace("sweep directory", "study directory", 1)) from None
    with lock:
        check_identity(study)
        trials = load_trials(study)
        while True:
            budget = trials[: study.trials]
            pending = next((t for t in budget if t.state == "running"), None)
            if pending is None and len(budget) >= study.trials:
                break
            if pending is None:
                pending = Trial(len(trials), draw(study, trials), started=now())
                write_trial(study, pending)
                trials.append(pending)
                what = "trial"
            else:
                what = "trial (resumed)"
            values = ", ".join(f"{k}={override_text(v)}" for k, v in pending.params.items())
            say(f"{study.algo} {what} {pending.number + 1}/{study.trials}: {values}")
            run_trial(study, pending, quiet)
            best = best_trial(trials[: study.trials])
            result = (
                f"{pending.value:.4f}"
                if pending.state == "complete"
                else f"failed ({pending.error})"
            )
            say(
                f"{study.algo} trial {pending.number + 1}/{study.trials}: {result}"
                + (f"; best {best.value:.4f} (trial {best.number + 1})" if best else "")
            )
        return best_trial(trials[: study.trials])


# --------------------------------------------------------------------------- the winners
def nest(params: dict[str, Any]) -> dict[str, Any]:
    """{'optim.lr': 0.01, 'algo.hypernet.lr': 0.1} -> {'optim': {'lr': ..}, 'algo': {...}}."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _shown(path: Path) -> str:
    """A path as a header writes it: relative to the working directory when below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def tuned_text(study: Study, winner: Trial, trials: list[Trial]) -> str:
    """<federation>/<algo>.yaml in conf/tuned/: the winner, with the study in its header."""
    done = sum(t.state == "complete" for t in trials)
    seeds = ", ".join(str(s) for s in study.seeds)
    metric = winner.metric or study.objective
    at = "the validation-selected round" if ".V." in metric else "the selected round"
    lines = [
        "# @package _global_",
        f"# {study.algo} tuned on federation {study.federation} by an equal-budget study",
        "# (python -m fedbench.tune; docs/leaderboard.md), applied by",
        f"#   fedbench +federation={study.federation} tuned={study.federation} algo={study.algo}",
        f"# study: {study.trials} trials ({done} complete, {len(trials) - done} failed), "
        f"{study.rounds} rounds, seed(s) {seeds};",
        f"#   objective {metric} at {at}, mean over the seeds;",
        f"#   TPE sampler seed {study.sampler_seed}, the first {study.startup} trials at random;",
        f"#   search space conf/search/{study.algo}.yaml",
        f"# best: trial {winner.number + 1} of {study.trials}, objective {winner.value:.6g}",
        f"# written {_dt.date.today().isoformat()}; the study: {_shown(study.folder)}",
    ]
    if study.identity()["overrides"]:
        lines.append(f"# every run also had: {' '.join(study.identity()['overrides'])}")
    body = yaml.safe_dump(nest(winner.params), default_flow_style=False, sort_keys=True)
    return "\n".join(lines) + "\n" + body


FEDERATION_TUNED = """# @package _global_
# The winners of the equal-budget studies on federation {fed} ({fed}/<algo>.yaml in conf/tuned/,
# written by python -m fedbench.tune / scripts/tune.sh; docs/leaderboard.md). tuned={fed}
# applies the file of the run's algorithm (conf/config.yaml's defaults), where it has one.
"""


def write_tuned(study: Study, winner: Trial, trials: list[Trial], tuned_dir: Path) -> Path:
    from fedbench.io import atomic_write_text

    group = tuned_dir / f"{study.federation}.yaml"
    if not group.exists():
        atomic_write_text(group, FEDERATION_TUNED.format(fed=study.federation))
    path = tuned_dir / study.federation / f"{study.algo}.yaml"
    atomic_write_text(path, tuned_text(study, winner, trials))
    return path


def check_applied(study: Study, winner: Trial) -> None:
    """`tuned=<federation>` gives the run the winner's values (conf/ of this install)."""
    cfg = compose_run(
        [f"+federation={study.federation}", f"tuned={study.federation}", f"algo={study.algo}"]
    )
    for key, value in winner.params.items():
        node: Any = cfg
        for part in key.split("."):
            node = node[part]
        if node != value:
            raise TuneError(
                f"tuned={study.federation} gives {key}={node!r}, not the winner's {value!r}: "
                "a value given elsewhere overrides conf/tuned"
            )


# --------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedbench.tune",
        description="Equal-budget tuning: one study per algorithm on a named federation "
        "(conf/federation/<name>.yaml); the winners go to conf/tuned/ as <federation>/<algo>.yaml, "
        "applied by tuned=<federation>. Run the same command again to continue a study.",
    )
    p.add_argument("federation", help="a federation: conf/federation/<name>.yaml")
    p.add_argument("overrides", nargs="*", help="more overrides for every run (engine.backend=..)")
    p.add_argument("--algos", default="all", help="comma list, or all (default)")
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS, help="trials per study (12)")
    p.add_argument(
        "--seeds",
        default=",".join(map(str, DEFAULT_SEEDS)),
        help="the seeds of every trial, comma list (default 100: apart from the leaderboard's)",
    )
    p.add_argument("--rounds", type=int, help="rounds of every run (default: the federation's)")
    p.add_argument("--objective", default="auto", help="objective.metric (default auto: V avg)")
    p.add_argument("--sampler-seed", type=int, default=0, help="TPE's seed (0)")
    p.add_argument("--startup", type=int, help="random trials first (default: trials // 3)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"studies' root (default {DEFAULT_OUT})")
    p.add_argument(
        "--tuned-dir",
        default=str(CONF_DIR / "tuned"),
        help="where the winners go (default: conf/tuned of this install)",
    )
    p.add_argument("--dry-run", action="store_true", help="say where each study stands only")
    p.add_argument("--quiet", action="store_true", help="no output of the runs themselves")
    return p


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise TuneError(f"{what} {text!r}: a comma list of whole numbers") from None
    if not values or len(set(values)) != len(values) or min(values) < 0:
        raise TuneError(f"{what} {text!r}: distinct whole numbers >= 0")
    return values


def make_studies(args: argparse.Namespace) -> list[Study]:
    """The studies the command asks for, checked (bad input: TuneError) before anything
    is written."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.cli import refusal
    from fedbench.config import TEST_OBJECTIVE_WARNING, objective_on_test

    if args.federation not in federations():
        raise TuneError(
            f"unknown federation {args.federation!r}; valid: {', '.join(federations())}"
        )
    names = sorted(ALGORITHMS.names())
    algos = names if args.algos == "all" else [a for a in args.algos.split(",") if a]
    unknown = [a for a in algos if a not in names]
    if unknown or not algos:
        raise TuneError(f"unknown algo {','.join(unknown)!r}; valid: all, {', '.join(names)}")
    if args.trials < 1:
        raise TuneError(f"--trials {args.trials}: at least 1")
    if args.rounds is not None and args.rounds < 1:
        raise TuneError(f"--rounds {args.rounds}: at least 1")
    seeds = _ints(args.seeds, "--seeds")
    startup = args.trials // 3 if args.startup is None else args.startup
    if startup < 0:
        raise TuneError(f"--startup {startup}: >= 0")
    studies = []
    for algo in algos:
        probe = Study(
            federation=args.federation,
            algo=algo,
            trials=args.trials,
            seeds=seeds,
            rounds=args.rounds or 0,
            objective=args.objective,
            sampler_seed=args.sampler_seed,
            startup=startup,
            overrides=tuple(args.overrides),
            space=search_space(algo),
            folder=Path(args.out) / args.federation / algo,
            rounds_given=args.rounds is not None,
        )
        # a first run as fedbench checks it (every key and value, the overrides)
        first = {k: (d.choices[0] if d.choices else d.low) for k, d in probe.space.items()}
        line = refusal(probe.run_args(first, seeds[0]))
        if line:
            raise TuneError(line.removeprefix("fedbench: "))
        if not studies:
            cfg = compose_run(probe.run_args(first, seeds[0]))
            rounds = int(cfg.rounds)
            if objective_on_test(cfg):
                print(f"fedbench.tune: warning: {TEST_OBJECTIVE_WARNING}", file=sys.stderr)
        studies.append(replace(probe, rounds=rounds))
    return studies


def status_line(study: Study) -> str:
    if not (study.folder / STUDY_FILE).exists():
        return f"{study.algo}: not started ({study.trials} trials to run)"
    trials = load_trials(study)[: study.trials]
    done = sum(t.state == "complete" for t in trials)
    failed = sum(t.state == "failed" for t in trials)
    running = [t.number + 1 for t in trials if t.state == "running"]
    best = best_trial(trials)
    parts = [f"{done + failed}/{study.trials} trials done ({failed} failed)"]
    if running:
        parts.append(f"trial {running[0]} interrupted (resumes)")
    if best:
        parts.append(f"best {best.value:.4f} (trial {best.number + 1})")
    finished = [t for t in trials if t.state != "running"]
    times = [x for x in (trial_seconds(study, t) for t in finished) if x]
    if times:
        # a failed run wrote no summary: its time is not known, the rest is summed
        clock = "cpu" if all("cpu" in t for t in times) else "wall"
        total = sum(t.get(clock, t.get("wall", 0.0)) for t in times)
        known = f"{len(times)} trials" + (
            "" if len(times) == len(finished) else f" of {len(finished)}: a failed run has no time"
        )
        parts.append(f"runs took {total / 60:.1f} min ({clock}, {known})")
    return f"{study.algo}: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    try:
        if not args.dry_run:
            _optuna()
        studies = make_studies(args)
        if args.dry_run:
            for s in studies:
                print(status_line(s))
            return 0
        tuned_dir = Path(args.tuned_dir)
        failed = []
        for s in studies:
            winner = run_study(s, quiet=args.quiet)
            if winner is None:
                print(f"fedbench.tune: {s.algo}: every trial failed; no winner", file=sys.stderr)
                failed.append(s.algo)
                continue
            path = write_tuned(s, winner, load_trials(s)[: s.trials], tuned_dir)
            if tuned_dir.resolve() == (CONF_DIR / "tuned").resolve():
                check_applied(s, winner)
            print(
                f"{s.algo}: winner trial {winner.number + 1}, objective {winner.value:.4f}: {path}"
            )
        return EXIT_FAILED if failed else 0
    except TuneError as e:
        print(f"fedbench.tune: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Interrupted as e:
        print(f"fedbench.tune: {e}; run the same command again to continue", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("fedbench.tune: interrupted; run the same command again to continue",
              file=sys.stderr)  # fmt: skip
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
