"""`fedbench`: the Hydra app. Compose -> build -> run -> write; bad input is one line, exit 2."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedbench.errors import FedbenchError
from fedbench.paths import CONF_DIR  # noqa: E402 (after the stdlib imports above)

GROUPS = (
    "data", "split", "model", "algo", "server_opt", "experiment", "paper", "search", "federation",
    "tuned",
)  # fmt: skip
EXIT_BAD_INPUT = 2

log = logging.getLogger("fedbench")

# `${fedbench.uid:}` in the default run and sweep directory names: one random token per
# process, so runs started in the same second (a job array, a joblib pool) never share one.
_UID = secrets.token_hex(4)
if not OmegaConf.has_resolver("fedbench.uid"):
    OmegaConf.register_new_resolver("fedbench.uid", lambda: _UID)


def group_options(group: str, user_dirs: tuple[str, ...] = ()) -> list[str]:
    """The options of a config group: fedbench's and those in the user's `--config-dir`s."""
    dirs = [CONF_DIR, *(Path(d).expanduser() for d in user_dirs)]
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def user_config_dirs(argv: list[str]) -> tuple[str, ...]:
    """The directories of Hydra's `--config-dir` / `-cd` flags: a user's own configs
    (an `algo/<name>.yaml`, an `experiment/<preset>.yaml`) beside fedbench's."""
    out = []
    for i, a in enumerate(argv):
        if a in ("--config-dir", "-cd") and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith("--config-dir="):
            out.append(a.partition("=")[2])
    return tuple(out)


# Launcher and sweeper presets and the Hydra plugin each needs (optional extras).
LAUNCHERS = {
    "joblib_local": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
}
SWEEPERS = {"optuna_lr": ("hydra_plugins.hydra_optuna_sweeper", "optuna")}


def plugin_installed(module: str) -> bool:
    """Whether a Hydra plugin module is importable (its namespace package may be absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_overrides(argv: list[str]) -> str | None:
    """Hydra reports an unknown group option with a multi-line message and exit 1; we want
    one line naming the valid options, and exit 2, before Hydra starts."""
    user = user_config_dirs(argv)
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        presets = {"hydra/launcher": LAUNCHERS, "hydra/sweeper": SWEEPERS}.get(key, {})
        if value in presets:
            module, extra = presets[value]
            if not plugin_installed(module):
                return (
                    f"fedbench: {key}={value} needs its Hydra plugin: "
                    f"pip install 'fedbench[{extra}]'"
                )
            continue
        if key not in GROUPS or not value:
            continue
        for v in value.split(","):
            v = v.strip()
            if v and v not in ("null",) and v not in group_options(key, user):
                if key == "algo" and _registered_algorithm(v):
                    return (
                        f"fedbench: algo {v!r} is registered by a module but conf/algo/{v}.yaml "
                        "is missing: add it, listing every hyperparameter with its default"
                    )
                valid = ", ".join(group_options(key, user))
                return f"fedbench: unknown {key} {v!r}; valid: {valid}"
    return None


def _registered_algorithm(name: str) -> bool:
    from fedbench.algorithms import ALGORITHMS

    return name in ALGORITHMS


# Hydra flags after which fedbench does not compose the config itself (Hydra prints or acts).
_HYDRA_OWN = (
    "help",
    "hydra_help",
    "cfg",
    "info",
    "shell_completion",
    "config_path",
    "config_name",
    "experimental_rerun",
)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def _unknown_key_message(
    err: Exception, overrides: list[str], user_dirs: tuple[str, ...] = ()
) -> str | None:
    """Hydra's struct error for `a.b=v` with no key a.b, as one line listing the valid keys."""
    cause = err.__cause__
    if cause is None or "is not in struct" not in str(cause):
        return None
    key = getattr(cause, "full_key", None)
    if not key:
        return None
    parent = key.rpartition(".")[0]
    rest = [o for o in overrides if o.partition("=")[0].lstrip("+~") != key]
    try:
        cfg = _compose(rest, user_dirs)
    except Exception:  # noqa: BLE001
        return f"fedbench: {key}: not a config key"
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, parent) if parent else cfg
    valid = [str(k) for k in node if k != "hydra"] if node is not None else []
    valid.sort(key=lambda k: GROUPS.index(k) if k in GROUPS else len(GROUPS))  # groups first
    if parent == "algo":
        name = cfg.algo.name
        valid = [k for k in valid if k != "name"]
        return f"fedbench: {key}: not a key of algo={name}; valid: {', '.join(valid) or 'none'}"
    where = f" of {parent}" if parent else ""
    return f"fedbench: {key}: not a config key; valid keys{where}: {', '.join(valid)}"


def _compose(overrides: list[str], user_dirs: tuple[str, ...] = ()):
    from hydra import compose, initialize_config_dir

    if user_dirs and not any(o.startswith("hydra.searchpath=") for o in overrides):
        paths = ",".join(f"file://{Path(d).expanduser().absolute()}" for d in user_dirs)
        overrides = [*overrides, f"hydra.searchpath=[{paths}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="fedbench"):
        return compose("config", overrides=overrides, return_hydra_config=True)


@dataclass
class Plan:
    """What the checks before Hydra found: where the run (or the sweep) will write, and
    which overrides fedbench adds so that Hydra uses exactly those directories."""

    multirun: bool = False
    run_dir: Path | None = None
    # the outermost folder this command would create for the run (None: the directory
    # exists): removed again if the run is refused after Hydra made it
    created: Path | None = None
    sweep_dir: Path | None = None
    extra: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # printed once, before Hydra starts


class BadInput(Exception):
    """A check before Hydra failed: the message is the line to print (exit 2)."""


def _given(overrides: list[str], key: str) -> bool:
    return any(o.partition("=")[0].lstrip("+~") == key for o in overrides)


def _outermost_missing(path: Path) -> Path | None:
    p, missing = path.absolute(), None
    while not p.exists():
        missing, p = p, p.parent
    return missing


def _jobs(overrides: list[str]) -> list[list[str]] | None:
    """Every job's overrides of a basic sweep (None where Hydra's own sweeper cannot
    enumerate it here: an interval, or another sweeper's syntax)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        if any(o.is_sweep_override() and o.is_interval_sweep() for o in parsed):
            return None
        batches = BasicSweeper.split_arguments(parsed, None)
    except Exception:  # noqa: BLE001 (Hydra reports what it cannot parse itself)
        return None
    return [list(job) for batch in batches for job in batch]


def _fixed_overrides(overrides: list[str]) -> list[str] | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001
        return None
    return [o.input_line for o in parsed if not o.is_sweep_override()]


# A sweep larger than this has its first job's values checked here and the rest job by job
# (composing a config takes ~50 ms).
MAX_CHECKED_JOBS = 500


def precheck(argv: list[str]) -> Plan:
    """Compose the config as Hydra will and check it before Hydra starts (and so before
    anything is written): every key, its type and range (fedbench/config.py), the run
    directory (writable; another run's only with resume=true; with resume=true, the
    checkpoint's config), and in a sweep every job's values. Raises BadInput with the one
    line to print. Hydra's own flags (--help, --cfg, ...) are left to Hydra."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except (SystemExit, Exception):  # noqa: BLE001 (Hydra reports its own usage errors)
        return Plan()
    if any(getattr(args, flag, None) for flag in _HYDRA_OWN):
        return Plan()
    overrides = list(args.overrides)
    user = tuple([args.config_dir] if args.config_dir else [])
    if args.multirun:
        jobs = _jobs(overrides)
        if jobs is None:  # an interval (Optuna's search space): check the fixed values
            fixed = _fixed_overrides(overrides)
            if fixed is None:
                return Plan()  # Hydra reports what it cannot parse
            jobs = [fixed]
        elif len(jobs) > MAX_CHECKED_JOBS:
            jobs = jobs[:1]
    else:
        jobs = [overrides]
    plan = Plan(multirun=bool(args.multirun))
    for i, job in enumerate(jobs):
        cfg = _compose_checked(job, user)
        where = f" (job {i}: {' '.join(job)})" if args.multirun and len(jobs) > 1 else ""
        _check_job(cfg, where)
        if i == 0:
            _plan_dirs(plan, cfg, overrides)
            _plan_warnings(plan, cfg)
    return plan


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def is_study(sweeper_target: object) -> bool:
    """Whether a sweep's sweeper maximizes the runs' objective (Optuna, Nevergrad, Ax ...):
    any but Hydra's basic sweeper, which only enumerates the grid."""
    return bool(sweeper_target) and str(sweeper_target) != BASIC_SWEEPER


def _plan_warnings(plan: Plan, cfg) -> None:
    """A study tuned on the test set: one warning for the whole sweep."""
    from omegaconf import OmegaConf

    from fedbench.config import TEST_OBJECTIVE_WARNING, objective_on_test, task_config

    target = OmegaConf.select(cfg, "hydra.sweeper._target_")
    if plan.multirun and is_study(target) and objective_on_test(task_config(cfg)):
        plan.warnings.append(TEST_OBJECTIVE_WARNING)


def refusal(argv: list[str]) -> str | None:
    """The line fedbench would refuse `argv` with (exit 2), or None: all checks pass."""
    try:
        msg = check_overrides(argv)
        if msg is None:
            precheck(argv)
        return msg
    except BadInput as e:
        return str(e)


def _compose_checked(overrides: list[str], user_dirs: tuple[str, ...] = ()):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return _compose(overrides, user_dirs)
    except (HydraException, OmegaConfBaseException) as e:
        raise BadInput(
            _unknown_key_message(e, overrides, user_dirs)
            or _experiment_hint(e)
            or f"fedbench: {_one_line(e)}"
        ) from None


def _experiment_hint(err: Exception) -> str | None:
    text = str(err)
    if "Could not override 'experiment'" in text:
        return "fedbench: experiment is added, not overridden: write +experiment=<preset>"
    if "Multiple values for tuned" in text or "tuned appears more than once" in text:
        return "fedbench: tuned is chosen, not added: write tuned=<federation> (no +)"
    return None


def _check_job(cfg, where: str) -> None:
    from omegaconf.errors import OmegaConfBaseException

    from fedbench.config import check_config, task_config

    try:
        task = task_config(cfg)
        check_config(task)
        from fedbench.runner import resolve_device

        resolve_device(str(task.device))
    except FedbenchError as e:
        raise BadInput(f"fedbench: {e}{where}") from None
    except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
        raise BadInput(f"fedbench: {_one_line(e)}{where}") from None


def _plan_dirs(plan: Plan, cfg, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from fedbench.config import task_config
    from fedbench.rundir import RunDirError, check_writable, holds_run
    from fedbench.runner import check_resume

    resume = bool(OmegaConf.select(cfg, "resume"))  # true or auto
    key = "hydra.sweep.dir" if plan.multirun else "hydra.run.dir"
    if OmegaConf.select(cfg, "resume") is True and not _given(overrides, key):
        raise BadInput(
            f"fedbench: resume=true needs the run's directory: add {key}=<the directory "
            "it wrote> to the command"
        )
    where = Path(str(OmegaConf.select(cfg, key))).absolute()
    if not _given(overrides, key):  # Hydra resolves ${now:} again: pin what we checked
        plan.extra.append(f"{key}={where}")
    try:
        check_writable(where)
    except RunDirError as e:
        raise BadInput(f"fedbench: {e}") from None
    if plan.multirun:
        plan.sweep_dir = where
        return
    plan.run_dir, plan.created = where, _outermost_missing(where)
    taken = holds_run(where) if where.is_dir() else []
    if taken and not resume:
        raise BadInput(
            f"fedbench: run directory {where} holds another run ({', '.join(taken)}); "
            "resume=true to continue that run, or choose another directory"
        )
    if resume:
        task = task_config(cfg)
        try:
            check_resume(task, where)
        except FedbenchError as e:
            raise BadInput(f"fedbench: {e}") from None


def _record_failure(out: Path, cfg: DictConfig, message: str) -> None:
    """A sweep's job that was refused before its run started: its (new) directory gets the
    config and the error, so that fedbench-report lists it as failed. Never written into
    a directory that holds another run or is in use."""
    from omegaconf import OmegaConf

    from fedbench.io import atomic_write_text
    from fedbench.rundir import RunDir
    from fedbench.runner import ERROR_FILE

    try:
        with RunDir.claim(out, resume=False):
            atomic_write_text(out / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))
            atomic_write_text(out / ERROR_FILE, message + "\n")
    except FedbenchError:
        pass


def _internal_error(e: BaseException) -> str:
    """Save the traceback of a fedbench bug to a file; the line to print."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="fedbench-error-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(" ".join(sys.argv) + "\n\n")
        traceback.print_exception(e, file=f)
    return (
        f"fedbench: internal error ({type(e).__name__}: {_one_line(e)[:200]}); the traceback "
        f"is in {path}: please report it"
    )


def _remove_created(out: Path, created: Path | None) -> None:
    """Remove the empty folders Hydra made for a run that was then refused."""
    if created is None:
        return
    p = out.absolute()
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == created or p.parent == p:
            return
        p = p.parent


def _make_task(plan: Plan):
    def task(cfg: DictConfig) -> float | None:
        from omegaconf import OmegaConf

        from fedbench.runner import Interrupted, Run, final_table, objective

        hc = HydraConfig.get()
        cfg.algo.name = str(cfg.algo.name)  # the chosen option, saved as a plain value
        out = Path(hc.runtime.output_dir)
        multirun = hc.mode == RunMode.MULTIRUN
        files = {
            ".hydra/hydra.yaml": OmegaConf.to_yaml(HydraConfig.instance().cfg),
            ".hydra/overrides.yaml": OmegaConf.to_yaml(hc.overrides.task),
        }
        if cfg.resume == "auto":
            from fedbench.runner import finished_run

            done = finished_run(cfg, out)
            if done is not None:  # resume=auto: a finished run is skipped, nothing written
                print(f"fedbench: {out} already finished (round {done['rounds']}): skipped")
                return objective(done, str(cfg.objective.metric), str(cfg.objective.at))
        started = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _terminated)  # a launcher's job never runs main()
        try:
            tuning = multirun and is_study(hc.sweeper.get("_target_"))
            run = Run(cfg, out, progress=sys.stderr.isatty(), tuning=tuning)
            started = True
            summary = run.run(files)
        except Interrupted as e:
            if not multirun:
                print(f"fedbench: {e}", file=sys.stderr)
                sys.exit(128 + e.signum)
            sweep = Path(hc.sweep.dir)
            name = signal.Signals(e.signum).name
            line = (
                f"{name}: stopped after round {e.next_round}"
                + (", checkpoint saved" if e.saved else "")
                + f"; continue the sweep: the same command with resume=true hydra.sweep.dir={sweep}"
            )
            print(f"fedbench: {line}", file=sys.stderr)
            _note_failed(sweep, out, line)
            if os.environ.get("SUBMITIT_EXECUTOR"):
                return None  # a SLURM job that ends cleanly: the sweep lists it as stopped
            sys.exit(128 + e.signum)
        except KeyboardInterrupt:
            print("fedbench: interrupted before training started (nothing to resume)",
                  file=sys.stderr)  # fmt: skip
            if not started:
                _remove_created(out, plan.created)
            sys.exit(128 + signal.SIGINT)
        except FedbenchError as e:
            if multirun:
                # One bad cell must not end the sweep; main() lists the failed jobs at the end.
                log.error("run %s failed: %s", out, e)
                if not started:
                    _record_failure(out, cfg, str(e))
                _note_failed(Path(hc.sweep.dir), out, str(e))
                return
            print(f"fedbench: {e}", file=sys.stderr)
            if not started:
                _remove_created(out, plan.created)
            sys.exit(EXIT_BAD_INPUT)
        except Exception as e:  # noqa: BLE001 (a bug: one line, the traceback in a file)
            if type(e).__name__ == "UncompletedJobError":  # submitit gave up on the job
                line = f"fedbench: the job stopped uncompleted ({_one_line(e)[:200]})"
            else:
                line = _internal_error(e)
            if multirun:
                log.error("run %s failed: %s", out, line)
                if not started:
                    _record_failure(out, cfg, line)
                _note_failed(Path(hc.sweep.dir), out, line)
                return
            print(line, file=sys.stderr)
            sys.exit(1)
        print(final_table(summary))
        print(f"results in {out}")
        return objective(summary, str(cfg.objective.metric), str(cfg.objective.at))

    task.__module__ = __name__
    return task


# A sweep's failed jobs leave a line each here (in the sweep directory, not the run's own,
# which may be another run's); main() prints those of its sweep when every job has run.
FAILED_DIR = ".fedbench-failed"


def _note_failed(sweep: Path, out: Path, message: str) -> None:
    from fedbench.io import atomic_write_text

    line = f"{out.name}\t{message.removeprefix('fedbench: ')}\n"
    with contextlib.suppress(FedbenchError):
        atomic_write_text(sweep / FAILED_DIR / f"{secrets.token_hex(8)}.txt", line)


def _failed_notes(sweep: Path | None) -> set[Path]:
    if sweep is None or not (sweep / FAILED_DIR).is_dir():
        return set()
    return set((sweep / FAILED_DIR).glob("*.txt"))


def _terminated(signum: int, frame: object) -> None:
    # Before the run's own handler is installed (setup) and after it (writing the summary).
    print(f"fedbench: {signal.Signals(signum).name} before training started (nothing to "
          "resume)", file=sys.stderr)  # fmt: skip
    sys.exit(128 + signum)


def main() -> None:
    argv = sys.argv[1:]
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    try:
        msg = check_overrides(argv)
        if msg:
            raise BadInput(msg)
        plan = precheck(argv)
    except BadInput as e:
        print(e, file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        print("fedbench: interrupted", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    for line in plan.warnings:
        print(f"fedbench: warning: {line}", file=sys.stderr)
    before = _failed_notes(plan.sweep_dir)
    sys.argv = [sys.argv[0], *argv, *plan.extra]
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(
        _make_task(plan)
    )
    try:
        app()
    except KeyboardInterrupt:
        print("fedbench: interrupted", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    if plan.multirun:
        lines = sorted(p.read_text().strip() for p in _failed_notes(plan.sweep_dir) - before)
        for line in lines:
            job, _, reason = line.partition("\t")
            print(f"fedbench: job {job} failed: {reason}", file=sys.stderr)
        if lines:
            sys.exit(1)


if __name__ == "__main__":
    main()
