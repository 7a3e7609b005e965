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
    hydra_own: bool = False  # --help, --cfg ...: Hydra prints and acts, nothing runs


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


def parse_args(argv: list[str]):
    """Hydra's command line, parsed by Hydra's own parser; a usage error (an unknown flag,
    a flag without its value) is BadInput, one line, instead of Hydra's usage text."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            flags = [max(a.option_strings, key=len) for a in parser._actions if a.option_strings]
            raise BadInput(
                f"fedbench: unknown flag {unknown}; valid flags: {', '.join(flags)} "
                "(fedbench --help says what each does; overrides are key=value)"
            )
        raise BadInput(f"fedbench: {message} (fedbench --help)")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def precheck(argv: list[str]) -> Plan:
    """Compose the config as Hydra will and check it before Hydra starts (and so before
    anything is written): the flags, every key, its type and range (fedbench/config.py),
    the run directory (writable; another run's only with resume=true; with resume=true, the
    checkpoint's config; never a sweep's), the sweep directory (never a run's) and in a
    sweep every job's values and directory. Raises BadInput with the one line to print.
    Hydra's own flags (--help, --cfg, ...) are left to Hydra."""
    args = parse_args(argv)
    if any(getattr(args, flag, None) for flag in _HYDRA_OWN):
        return Plan(hydra_own=True)
    if args.config_dir and not Path(args.config_dir).expanduser().is_dir():
        raise BadInput(
            f"fedbench: --config-dir {args.config_dir}: no such directory (it holds your own "
            "config groups, e.g. algo/<name>.yaml)"
        )
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
    cells: dict[Path, list[str]] = {}  # a sweep's job directories: each job its own
    for i, job in enumerate(jobs):
        # (the job's number, as Hydra's basic sweeper gives it: a subdir may name it)
        cfg = _compose_checked([*job, f"hydra.job.num={i}"] if args.multirun else job, user)
        where = f" (job {i}: {' '.join(job)})" if args.multirun and len(jobs) > 1 else ""
        _check_job(cfg, where)
        if i == 0:
            _plan_dirs(plan, cfg, overrides)
            _plan_warnings(plan, cfg)
        if plan.multirun and plan.sweep_dir is not None:
            _check_cell(plan.sweep_dir, cfg, job, cells)
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


def _check_cell(sweep: Path, cfg, job: list[str], cells: dict[Path, list[str]]) -> None:
    """A sweep job's directory (hydra.sweep.subdir): a folder below the sweep's, of names
    the file system takes, and no other job's."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from fedbench.rundir import RunDirError, check_name_length

    try:
        subdir = str(OmegaConf.select(cfg, "hydra.sweep.subdir", throw_on_missing=True))
    except (OmegaConfBaseException, ValueError):
        return  # resolved by Hydra at run time only (a user's own interpolation)
    cell = (sweep / subdir).absolute()
    if cell == sweep.absolute() or sweep.absolute() not in cell.parents:
        raise BadInput(
            f"fedbench: hydra.sweep.subdir={subdir!r} for job {' '.join(job) or '(no overrides)'}"
            f" is not a folder below the sweep directory {sweep}"
        )
    try:
        check_name_length(cell, "sweep job directory")
    except RunDirError as e:
        raise BadInput(f"fedbench: {e}") from None
    other = cells.setdefault(cell, job)
    if other is not job:
        a = " ".join(o for o in other if o not in job)
        b = " ".join(o for o in job if o not in other)
        raise BadInput(
            f"fedbench: the sweep's jobs {a} and {b} would share one directory, {cell} (they "
            "differ only in keys that make no other run: hydra.job.config.override_dirname."
            "exclude_keys); sweep each into its own hydra.sweep.dir"
        )


def refusal(argv: list[str]) -> str | None:
    """The line fedbench would refuse `argv` with (exit 2), or None: all checks pass."""
    try:
        msg = check_overrides(argv)
        if msg is None:
            precheck(argv)
        return msg
    except BadInput as e:
        return f"fedbench: {_one_line(e).removeprefix('fedbench: ')}"


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

    from fedbench.config import load_config, task_config

    try:
        rc = load_config(task_config(cfg))
        from fedbench.runner import resolve_device

        resolve_device(rc.device)
    except FedbenchError as e:
        raise BadInput(f"fedbench: {e}{where}") from None
    except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
        raise BadInput(f"fedbench: {_one_line(e)}{where}") from None


def _plan_dirs(plan: Plan, cfg, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from fedbench.config import task_config
    from fedbench.rundir import RunDirError, check_writable, holds_run, run_above, sweep_marks
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
    what = "sweep directory" if plan.multirun else "run directory"
    try:
        check_writable(where, what)
    except RunDirError as e:
        raise BadInput(f"fedbench: {e}") from None
    above = run_above(where)
    if above is not None:
        raise BadInput(
            f"fedbench: {what} {where} is inside the run directory {above}, where "
            "fedbench-report would not see it; choose another directory"
        )
    if plan.multirun:
        plan.sweep_dir, plan.created = where, _outermost_missing(where)
        taken = holds_run(where) if where.is_dir() else []
        if taken:
            raise BadInput(
                f"fedbench: sweep directory {where} holds a run ({', '.join(taken)}); the "
                "sweep's runs would be hidden from fedbench-report there: choose another "
                "hydra.sweep.dir"
            )
        return
    plan.run_dir, plan.created = where, _outermost_missing(where)
    sweep = sweep_marks(where) if where.is_dir() else []
    if sweep:
        raise BadInput(
            f"fedbench: run directory {where} holds a sweep or other runs ({', '.join(sweep)});"
            " a run there would hide them from fedbench-report: choose another one (a cell of "
            "a sweep is resumed in its own folder)"
        )
    taken = holds_run(where) if where.is_dir() else []
    if taken and not resume:
        raise BadInput(
            f"fedbench: run directory {where} holds another run ({', '.join(taken)}); "
            "resume=true to continue that run, or choose another directory"
        )
    if resume:
        task = task_config(cfg)
        try:
            check_resume(task, where, expect_run=True)
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
        sweep = Path(hc.sweep.dir) if multirun else None
        _install_handlers()  # a launcher's job never runs main()
        if _SIG.signum:  # a signal came as the sweep's previous job finished
            _SIG.stop_now = False
            with contextlib.suppress(OSError):
                out.rmdir()  # Hydra made it for this job; empty
            _say(
                f"{signal.Signals(_SIG.signum).name}: the sweep stopped before job {out.name} "
                f"(the jobs before it are complete); {_continue_sweep(sweep)}"
            )
            sys.exit(128 + _SIG.signum)
        _SIG.run, _SIG.stop_now = None, True
        files = {
            ".hydra/hydra.yaml": OmegaConf.to_yaml(HydraConfig.instance().cfg),
            ".hydra/overrides.yaml": OmegaConf.to_yaml(hc.overrides.task),
        }
        if cfg.resume:
            from fedbench.checkpoint import finished

            done = finished(cfg, out)
            if done is not None:  # a finished run: nothing loaded, nothing written
                _SIG.stop_now = False
                print(f"fedbench: {done.line}")
                return objective(done.summary, cfg.objective.metric, cfg.objective.at)
        started = False
        before = _contents(out)  # what is there before this run writes (None: a run)
        try:
            tuning = multirun and is_study(hc.sweeper.get("_target_"))
            run = Run(cfg, out, progress=sys.stderr.isatty(), tuning=tuning)
            _SIG.run = run
            started = True
            summary = run.run(files)
            _SIG.stop_now = False  # the run is complete: a signal from now on only waits
        except _Stopped as e:  # before training: nothing worth keeping
            _SIG.stop_now = False
            name = signal.Signals(e.signum).name
            cleaned = _clean_stopped(out, before, None if multirun else plan.created)
            if multirun:
                if cleaned:
                    with contextlib.suppress(OSError):
                        out.rmdir()  # the job's own folder, if empty
                what = "nothing of it kept" if cleaned else "its directory as it was"
                _say(
                    f"{name}: the sweep stopped in job {out.name} before it trained ({what}); "
                    f"{_continue_sweep(sweep)}"
                )
            elif cleaned:
                _say(f"{name} before training started: nothing kept; the same command starts "
                     "the run again")  # fmt: skip
            elif before is not None:
                _say(f"{name} before training started; resume=auto hydra.run.dir={out} starts "
                     "it again")  # fmt: skip
            else:
                _say(f"{name} before training resumed: the run directory {out} is as it was; "
                     "the same command continues it")  # fmt: skip
            sys.exit(128 + e.signum)
        except Interrupted as e:
            _SIG.stop_now = False
            if not multirun:
                _say(str(e))
                sys.exit(128 + e.signum)
            name = signal.Signals(e.signum).name
            if e.saved:
                line = f"{name}: stopped after round {e.next_round}, checkpoint saved"
            else:
                line = f"{name} again: stopped in round {e.next_round + 1} before it was saved"
            line += (
                f"; continue the sweep: the same command with resume=true hydra.sweep.dir={sweep}"
            )
            _say(line)
            _note_failed(sweep, out, line)
            if os.environ.get("SUBMITIT_EXECUTOR"):
                return None  # a SLURM job that ends cleanly: the sweep lists it as stopped
            sys.exit(128 + e.signum)
        except KeyboardInterrupt:  # SIGINT where fedbench's handler is not installed
            _SIG.stop_now = False
            cleaned = _clean_stopped(out, before, None if multirun else plan.created)
            _say("interrupted before training started" + (": nothing kept" if cleaned else ""))
            sys.exit(128 + signal.SIGINT)
        except FedbenchError as e:
            _SIG.stop_now = False
            if multirun:
                # One bad cell must not end the sweep; main() lists the failed jobs at the end.
                log.error("run %s failed: %s", out, e)
                if not started:
                    _record_failure(out, cfg, str(e))
                _note_failed(sweep, out, str(e))
                return
            _say(str(e))
            if not started:
                _remove_created(out, plan.created)
            sys.exit(EXIT_BAD_INPUT)
        except Exception as e:  # noqa: BLE001 (a bug: one line, the traceback in a file)
            _SIG.stop_now = False
            if type(e).__name__ == "UncompletedJobError":  # submitit gave up on the job
                line = f"fedbench: the job stopped uncompleted ({_one_line(e)[:200]})"
            else:
                line = _internal_error(e)
            if multirun:
                log.error("run %s failed: %s", out, line)
                if not started:
                    _record_failure(out, cfg, line)
                _note_failed(sweep, out, line)
                return
            print(line, file=sys.stderr)
            sys.exit(1)
        # a signal in the last round, or after it: the run is complete all the same
        _SIG.signum = _SIG.signum or run.stop.signum
        print(final_table(summary))
        print(f"results in {out}")
        if _SIG.signum and not multirun:
            _SIG.told = True
            _say(f"{signal.Signals(_SIG.signum).name} came as the run finished: it is complete "
                 f"(summary.json written), results in {out}")  # fmt: skip
        return objective(summary, run.config.objective.metric, run.config.objective.at)

    task.__module__ = __name__
    return task


def _say(line: str) -> None:
    """fedbench's one line on stderr (whatever the message's own line breaks)."""
    print(f"fedbench: {_one_line(line).removeprefix('fedbench: ')}", file=sys.stderr)


def _continue_sweep(sweep: Path | None) -> str:
    return f"continue it: the same command with resume=auto hydra.sweep.dir={sweep}"


# --------------------------------------------------------------------------- signals
class _Stopped(BaseException):
    """A signal where stopping loses nothing (before a run trains, between a sweep's jobs):
    raised by fedbench's handler out of whatever runs, caught by the task or main(). Not an
    Exception, so that no `except Exception` on the way takes it for an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass
class _Signals:
    signum: int = 0  # the first SIGTERM / SIGINT this process got (0: none)
    stop_now: bool = True  # raise _Stopped at once (False: the signal is only remembered)
    run: object = None  # the Run under way: its `stop` says when its own handler takes over
    told: bool = False  # its line was printed


_SIG = _Signals()


def _on_signal(signum: int, frame: object) -> None:
    """SIGTERM / SIGINT outside the round loop (the runner has its own handler there).
    Before a run trains nothing is lost: stop at once. Once a run has finished (or while it
    handles a signal of its own) the signal is only remembered: the exit status then says
    what the files say, and no exception reaches Hydra's or Python's exit handlers."""
    first = not _SIG.signum
    _SIG.signum = _SIG.signum or signum
    stop = getattr(_SIG.run, "stop", None)
    if stop is not None and (stop.signum or stop.finishing or stop.finished):
        return
    if first and _SIG.stop_now:
        raise _Stopped(signum)


def _install_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # a threads launcher's job: signals are not ours to handle
    for s in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(s) is not signal.SIG_IGN:  # nohup, a shell's background job
            signal.signal(s, _on_signal)


# What a run writes into its directory (runner.py, tracking.py): removed again when a signal
# stops a new run before it trained, so that the same command starts cleanly.
RUN_OUTPUTS = frozenset(
    {".hydra", "partition.json", "run.log", "metrics.csv", "clients.csv", "error.txt",
     "tensorboard", "wandb"}
)  # fmt: skip


def _contents(out: Path) -> set[str] | None:
    """The names in `out` before a new run writes there; None when it holds a run (a
    resume: nothing of it is ever removed)."""
    from fedbench.rundir import holds_run

    if not out.is_dir():
        return set()
    if holds_run(out):
        return None
    try:
        return set(os.listdir(out))
    except OSError:
        return None


def _clean_stopped(out: Path, before: set[str] | None, created: Path | None) -> bool:
    """Remove what a new run that a signal stopped before training wrote into `out` (under
    its lock again; never a checkpoint or a summary); True when nothing of it is left."""
    import shutil

    from fedbench.io import TMP_SUFFIX
    from fedbench.rundir import LOCK, RunDir
    from fedbench.runner import CHECKPOINT

    if before is None:
        return False
    if out.is_dir():
        try:
            with RunDir.claim(out, resume=True):
                if (out / CHECKPOINT).exists() or (out / "summary.json").exists():
                    return False
                for name in set(os.listdir(out)) - before - {LOCK}:
                    p = out / name
                    if name in RUN_OUTPUTS and p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                    elif name in RUN_OUTPUTS or name.endswith(TMP_SUFFIX):
                        p.unlink()
        except (FedbenchError, OSError):
            return False
    _remove_created(out, created)
    return True


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


def main() -> None:
    argv = sys.argv[1:]
    _install_handlers()
    plan, sweep_lock = Plan(), None
    try:
        try:
            msg = check_overrides(argv)
            if msg:
                raise BadInput(msg)
            plan = precheck(argv)
            sweep_lock = _claim_sweep(plan)
            for line in plan.warnings:
                _say(f"warning: {line}")
        except BadInput as e:
            _SIG.stop_now = False
            _say(str(e))
            sys.exit(EXIT_BAD_INPUT)
        before = _failed_notes(plan.sweep_dir)
        sys.argv = [sys.argv[0], *argv, *plan.extra]
        app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(
            _make_task(plan)
        )
        app()
    except (_Stopped, KeyboardInterrupt) as e:  # outside a job: before it, or in Hydra
        _SIG.stop_now = False
        signum = getattr(e, "signum", signal.SIGINT)
        name = signal.Signals(signum).name
        if plan.multirun and sweep_lock is not None:
            _say(f"{name}: the sweep stopped (its finished jobs are kept); "
                 f"{_continue_sweep(plan.sweep_dir)}")  # fmt: skip
        else:
            if plan.run_dir is not None:
                _remove_created(plan.run_dir, plan.created)
            _say(f"{name} before the run started: nothing written")
        sys.exit(128 + signum)
    finally:
        _SIG.stop_now = False  # from here on a signal only waits: what ran is complete
        if sweep_lock is not None:
            sweep_lock.release()
            _remove_created(plan.sweep_dir, plan.created)  # a sweep that made nothing
    failed = 0
    if plan.multirun:
        lines = sorted(p.read_text().strip() for p in _failed_notes(plan.sweep_dir) - before)
        for line in lines:
            job, _, reason = line.partition("\t")
            _say(f"job {job} failed: {reason}")
        failed = len(lines)
    if _SIG.signum and not _SIG.told:
        what = "the sweep's last job" if plan.multirun else "the run"
        _say(f"{signal.Signals(_SIG.signum).name} came as {what} finished: nothing is lost")
    if failed:
        sys.exit(1)


def _claim_sweep(plan: Plan):
    """A sweep's directory is its own for the sweep's life (rundir.SweepDir): a second sweep
    into it is refused up front, before it writes anything."""
    from fedbench.rundir import RunDirError, SweepDir

    if not plan.multirun or plan.sweep_dir is None:
        return None
    try:
        return SweepDir.claim(plan.sweep_dir)
    except RunDirError as e:
        _remove_created(plan.sweep_dir, plan.created)
        raise BadInput(f"fedbench: {e}") from None


if __name__ == "__main__":
    main()
