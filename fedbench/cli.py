"""`fedbench`: the Hydra app. Compose -> build -> run -> write; bad input is one line, exit 2."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fedbench.errors import FedbenchError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("data", "split", "model", "algo", "experiment", "paper")
EXIT_BAD_INPUT = 2

log = logging.getLogger("fedbench")


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# Launcher presets and the Hydra plugin each needs (optional extras of the package).
LAUNCHERS = {
    "joblib_local": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
}


def plugin_installed(module: str) -> bool:
    """Whether a Hydra plugin module is importable (its namespace package may be absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_overrides(argv: list[str]) -> str | None:
    """Hydra reports an unknown group option with a multi-line message and exit 1; we want
    one line naming the valid options, and exit 2, before Hydra starts."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        if key == "hydra/launcher" and value in LAUNCHERS:
            module, extra = LAUNCHERS[value]
            if not plugin_installed(module):
                return (
                    f"fedbench: hydra/launcher={value} needs its Hydra plugin: "
                    f"pip install -e '.[{extra}]'"
                )
            continue
        if key not in GROUPS or not value:
            continue
        for v in value.split(","):
            v = v.strip()
            if v and v not in ("null",) and v not in group_options(key):
                valid = ", ".join(group_options(key))
                return f"fedbench: unknown {key} {v!r}; valid: {valid}"
    return None


# Hydra flags after which fedbench does not compose the config itself (Hydra prints or acts).
_HYDRA_OWN = (
    "help",
    "hydra_help",
    "cfg",
    "info",
    "shell_completion",
    "config_path",
    "config_name",
    "config_dir",
    "experimental_rerun",
)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def _first_overrides(overrides: list[str], multirun: bool) -> list[str] | None:
    """The overrides of a single run: in a multirun each sweep's first value (the first job
    stands for the sweep); None where a sweep cannot be expanded here (glob, interval)."""
    if not multirun:
        return overrides
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    try:
        for o in OverridesParser.create().parse_overrides(overrides):
            if o.is_sweep_override():
                out.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
            else:
                out.append(o.input_line)
    except Exception:  # noqa: BLE001 (Hydra reports what it cannot parse itself)
        return None
    return out


def _unknown_key_message(err: Exception, overrides: list[str]) -> str | None:
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
        cfg = _compose(rest)
    except Exception:  # noqa: BLE001
        return f"fedbench: {key}: not a config key"
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, parent) if parent else cfg
    valid = [str(k) for k in node if k != "hydra"] if node is not None else []
    if parent == "algo":
        name = cfg.algo.name
        valid = [k for k in valid if k != "name"]
        return f"fedbench: {key}: not a key of algo={name}; valid: {', '.join(valid) or 'none'}"
    where = f" of {parent}" if parent else ""
    return f"fedbench: {key}: not a config key; valid keys{where}: {', '.join(valid)}"


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="fedbench"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def precheck(argv: list[str]) -> str | None:
    """Compose the config as Hydra will and check it before Hydra starts (and so before it
    writes anything): a mistyped key, a hyperparameter of the wrong type or out of range,
    and (resume=true) a config that differs from the run directory's checkpoint are one line
    (exit 2) instead of Hydra's multi-line error or a run that starts. A multirun has its
    first job composed (a mistyped key); its values are checked job by job (Run). None: all
    good, or nothing fedbench can check here (Hydra's own flags; Hydra then reports)."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except (SystemExit, Exception):  # noqa: BLE001 (Hydra reports its own usage errors)
        return None
    if any(getattr(args, flag, None) for flag in _HYDRA_OWN):
        return None
    overrides = _first_overrides(list(args.overrides), bool(args.multirun))
    if overrides is None:
        return None
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = _compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        return _unknown_key_message(e, overrides) or f"fedbench: {_one_line(e)}"
    if args.multirun:
        # A value a job cannot run with fails that job only (its directory has no
        # summary.json; the sweep goes on), as in Run; a composition error ends every sweep.
        return None
    from fedbench.algorithms import ALGORITHMS
    from fedbench.algorithms.params import check_params
    from fedbench.runner import check_resume, validate

    run_dir = OmegaConf.select(cfg, "hydra.run.dir", throw_on_resolution_failure=False)
    task = OmegaConf.create({k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"})
    try:
        validate(task)
        name = str(task.algo.name)
        check_params(task.algo, ALGORITHMS.get(name).Params, name)
        if task.resume and run_dir:
            check_resume(task, run_dir)
    except FedbenchError as e:
        return f"fedbench: {e}"
    except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve
        return f"fedbench: {_one_line(e)}"
    return None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _app(cfg: DictConfig) -> None:
    from fedbench.runner import Run, final_table

    hc = HydraConfig.get()
    out = hc.runtime.output_dir
    try:
        summary = Run(cfg, out, progress=sys.stderr.isatty()).run()
    except FedbenchError as e:
        print(f"fedbench: {e}", file=sys.stderr)
        if hc.mode == RunMode.MULTIRUN:
            # One bad cell must not end the sweep: its directory has no summary.json, and
            # fedbench-report marks it as failed.
            log.error("run %s failed: %s", out, e)
            return
        sys.exit(EXIT_BAD_INPUT)
    print(final_table(summary))
    print(f"results in {out}")


def main() -> None:
    msg = check_overrides(sys.argv[1:]) or precheck(sys.argv[1:])
    if msg:
        print(msg, file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    _app()


if __name__ == "__main__":
    main()
