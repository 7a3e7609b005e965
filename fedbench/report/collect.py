"""Find runs under the paths given and read what each one wrote.

A run directory is one that holds `.hydra/config.yaml` (written by Hydra when the job
starts) or `summary.json` (written by the runner when the job ends). A directory with the
first and not the second is a run that failed (or is still running). A Hydra multirun
directory (`multirun.yaml` and numbered job subdirectories), a folder of such sweeps, or
any tree of runs is searched recursively; the runs are returned in path order.

Each run's config is flattened to dotted keys (`algo.name`, `split.alpha`, `optim.lr`),
with short aliases for the keys tables are usually made of: `algo`, `data`, `split`,
`model` (the `*.name` keys), `seed`, `rounds`, `clients`, `participation`, and the derived
`per_round` (clients sampled per round, the papers' C).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from fedbench.errors import FedbenchError

ALIASES = {"algo": "algo.name", "data": "data.name", "split": "split.name", "model": "model.name"}
# Keys that say where or how a run was computed, not what: never a reason to tell runs apart.
INCIDENTAL = (
    "device",
    "data.root",
    "data.download",
    "eval.batch_size",
    "engine.backend",
    "resume",
    "eval.select",  # which round a table reports is the table's --select, one for all runs
)
INCIDENTAL_PREFIXES = ("hydra.", "checkpoint.", "objective.")  # objective: what a sweeper reads


def incidental(key: str) -> bool:
    return key in INCIDENTAL or key.startswith(INCIDENTAL_PREFIXES)


class ReportError(FedbenchError):
    """Bad input to the report (a path, key, metric, preset or format): one line, exit 2."""


@dataclass
class RunDir:
    """One run directory: its flattened config, and its summary (None if the run failed).
    `problems`: the files it has that cannot be read (truncated or corrupt JSON, CSV or
    YAML, no permission); such a run counts as failed, its numbers are not used."""

    path: Path
    config: dict[str, Any]
    summary: dict | None
    problems: list[str] = field(default_factory=list)

    @property
    def unreadable(self) -> bool:
        return bool(self.problems)

    @property
    def failed(self) -> bool:
        """No results to show: no summary.json (stopped early, or still running), or a file
        that cannot be read."""
        return self.summary is None or self.unreadable

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    @cached_property
    def metrics(self) -> pd.DataFrame | None:
        """metrics.csv: one row per evaluation round (None when absent or unreadable)."""
        return read_metrics(self.path / "metrics.csv")[0]

    @cached_property
    def clients(self) -> pd.DataFrame | None:
        """clients.csv: round, client, model, metric, value (None when absent or unreadable)."""
        return _read_csv(self.path / "clients.csv")


def _why(err: OSError) -> str:
    return err.strerror or str(err)


def _read_csv(path: Path) -> pd.DataFrame | None:
    try:
        return pd.read_csv(path)
    except (OSError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError):
        return None  # ValueError: a UnicodeDecodeError, or bytes pandas cannot parse


def read_metrics(path: Path) -> tuple[pd.DataFrame | None, str | None]:
    """(metrics.csv, None); (None, None) when absent or empty; (None, why) when the file is
    there but unusable: unreadable, truncated (the writer ends every line; a cut one means
    the file was cut), not CSV, or without a numeric `round` column. Columns are numeric
    (a value that is not a number is NaN)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot read it ({_why(e)})"
    if not data.strip():
        return None, None
    if not data.endswith(b"\n"):
        return None, "truncated (its last line is cut off)"
    try:
        df = pd.read_csv(io.BytesIO(data))
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"not a readable CSV file ({first})"
    if "round" not in df.columns:
        return None, "no 'round' column"
    df = df.apply(pd.to_numeric, errors="coerce")
    rounds = df["round"]
    if rounds.isna().any() or not (rounds == rounds.round()).all():
        return None, "a 'round' that is not a whole number"
    return df, None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'split': {'alpha': 0.1}} -> {'split.alpha': 0.1}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def clients_per_round(participation: Any, clients: Any) -> int | None:
    """The runner's rule (fedbench.runner.clients_per_round) without importing torch:
    a fraction in (0, 1] of the clients, or a count."""
    try:
        p, n = float(participation), int(clients)
    except (TypeError, ValueError):
        return None
    return max(1, round(p * n)) if p <= 1.0 else int(p)


def _load_yaml(path: Path) -> tuple[dict | None, str | None]:
    """(mapping, None); (None, None) when absent; (None, why) when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = yaml.safe_load(f)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot read it ({_why(e)})"
    except (ValueError, yaml.YAMLError) as e:  # ValueError: UnicodeDecodeError
        return None, f"not readable YAML ({type(e).__name__})"
    if not isinstance(obj, dict):
        return None, "not a YAML mapping"
    return obj, None


def _load_json(path: Path) -> tuple[dict | None, str | None]:
    """(object, None); (None, None) when absent; (None, why) when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot read it ({_why(e)})"
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None, "not valid JSON (truncated or corrupt)"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    return obj, None


def read_run(path: str | os.PathLike) -> RunDir:
    """Read one run directory (it need not have finished). Files it has but that cannot be
    read are listed in `problems` (the run then counts as failed)."""
    path = Path(path)
    problems: list[str] = []
    cfg, why = _load_yaml(path / ".hydra" / "config.yaml")
    if why:
        problems.append(f".hydra/config.yaml: {why}")
    summary, why = _load_json(path / "summary.json")
    if why:
        problems.append(f"summary.json: {why}")
    config = flatten(cfg) if isinstance(cfg, dict) else {}
    for alias, key in ALIASES.items():
        if key in config:
            config[alias] = config[key]
    if summary is not None:
        # summary.json's key facts win: they are what the run actually used
        for k in ("algo", "data", "split", "model", "seed", "rounds", "clients", "participation"):
            if k in summary:
                config[k] = summary[k]
                if k in ALIASES:
                    config[ALIASES[k]] = summary[k]
    choices = {**override_choices(path / ".hydra" / "overrides.yaml"),
               **hydra_choices(path / ".hydra" / "hydra.yaml")}  # fmt: skip
    for group, option in choices.items():
        config.setdefault(group, option)  # the named federation and tuned values chosen
    per_round = clients_per_round(config.get("participation"), config.get("clients"))
    if per_round is not None:
        config["per_round"] = per_round
    run = RunDir(path, config, summary, problems)
    if summary is not None:
        # a finished run's metrics.csv is complete: check it now (a running one's may end in
        # a line being written; it is not used: the run has no summary yet)
        metrics, why = read_metrics(path / "metrics.csv")
        if why:
            problems.append(f"metrics.csv: {why}")
        run.__dict__["metrics"] = metrics  # the cached_property's value
    return run


# Config groups whose chosen option is a fact of the run that its values do not name: the
# federation preset (+federation=<name>) and the tuned values applied (tuned=<federation>).
CHOICE_KEYS = ("federation", "tuned")
_CHOICE = re.compile(r"^      ([A-Za-z_][\w@/]*): (.*)$")


def hydra_choices(path: Path) -> dict[str, str]:
    """CHOICE_KEYS' options as Hydra recorded them (`hydra.runtime.choices` in the run's
    .hydra/hydra.yaml, which the runner writes): a scan of that block only, not a parse of
    the whole file. {} when the file or the block is absent."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    out: dict[str, str] = {}
    lines = text.splitlines()
    try:
        start = lines.index("    choices:") + 1
    except ValueError:
        return {}
    for line in lines[start:]:
        m = _CHOICE.match(line)
        if m is None:
            break
        key, value = m.group(1), m.group(2).strip()
        if key in CHOICE_KEYS and value not in ("null", "''"):
            out[key] = value
    return out


def override_choices(path: Path) -> dict[str, str]:
    """CHOICE_KEYS' options from the run's command-line overrides (`.hydra/overrides.yaml`:
    `+federation=fmnist_pat2`, `tuned=fmnist_pat2`), for a run copied without its hydra.yaml
    (scripts/export_results.sh keeps config and overrides only). {} when absent or unreadable."""
    try:
        items = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    out: dict[str, str] = {}
    for item in items if isinstance(items, list) else ():
        key, sep, value = str(item).lstrip("+~").partition("=")
        if sep and key in CHOICE_KEYS and value not in ("null", ""):
            out[key] = value
    return out


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / ".hydra" / "config.yaml").is_file()


# Config keys that make no other run (where and how it ran, what it logged): two runs that
# differ only in these are one run twice (an old sweep's `<n>_<overrides>` cell and a later
# sweep's `<overrides>` cell of the same job, a run copied elsewhere).
SAME_RUN_IGNORES = ("engine.chunk_clients", "engine.memory_budget")
SAME_RUN_IGNORES_PREFIXES = ("log.",)


def run_identity(run: RunDir) -> tuple | None:
    """What makes `run` the run it is: its config less incidental keys (None: no readable
    config, never taken for another run)."""
    saved = run.path / ".hydra" / "config.yaml"
    if not saved.is_file() or any(p.startswith(".hydra/config.yaml") for p in run.problems):
        return None  # (a config from summary.json's few keys alone tells too little)
    return tuple(
        sorted(
            (k, hashable(v))
            for k, v in run.config.items()
            if not incidental(k)
            and k not in SAME_RUN_IGNORES
            and not k.startswith(SAME_RUN_IGNORES_PREFIXES)
        )
    )


def dedupe(runs: list[RunDir], warn) -> list[RunDir]:
    """Each finished run once: of finished runs with the same identity (`run_identity`) the
    first in path order is kept and `warn` names the others; a table would otherwise count
    one seed twice ("6 seeds" of 4). Unfinished runs are all kept (each is a failure to
    list, with its own reason; none adds a number)."""
    first: dict[tuple, RunDir] = {}
    copies: dict[tuple, list[RunDir]] = {}
    for r in runs:
        key = None if r.failed else run_identity(r)
        if key is None:
            continue
        if key in first:
            copies.setdefault(key, []).append(r)
        else:
            first[key] = r
    for key, others in copies.items():
        warn(
            f"{', '.join(str(r.path) for r in others)}: the same run as {first[key].path} "
            "(the same config): counted once"
        )
    drop = {id(r) for others in copies.values() for r in others}
    return [r for r in runs if id(r) not in drop]


def find_runs(paths: Iterable[str | os.PathLike], warn=None) -> list[RunDir]:
    """Every run directory at or under `paths` (in path order, each once, and each run once:
    `dedupe`). A folder that cannot be listed is skipped; `warn(message)` (default: a line
    on stderr) says so, and names the copies of a run that are left out."""
    if warn is None:
        warn = _warn
    found: dict[Path, Path] = {}  # resolved -> as found (to print), each run once

    def unlisted(err: OSError) -> None:
        warn(f"cannot list {err.filename}: {_why(err)} (skipped)")

    for p in paths:
        root = Path(p)
        if not root.exists():
            raise ReportError(f"no such file or directory: {root}")
        if not root.is_dir():
            raise ReportError(f"{root} is not a directory (give run or multirun directories)")
        for dirpath, dirnames, _ in os.walk(root, onerror=unlisted):
            here = Path(dirpath)
            # .hydra, .submitit and other hidden folders hold no runs of their own
            dirnames[:] = sorted((d for d in dirnames if not d.startswith(".")), key=_natural_key)
            if is_run_dir(here):
                found.setdefault(here.resolve(), here)
                dirnames[:] = []  # a run directory does not contain other runs
    return dedupe([read_run(p) for p in found.values()], warn)


def _warn(message: str) -> None:
    print(f"fedbench-report: warning: {message}", file=sys.stderr)


def write_output(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a temporary file beside it, renamed into place):
    a full disk or a read-only folder leaves no half-written file. An OSError (full disk,
    read-only file system, no permission, a directory in the way) is a ReportError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ReportError(f"cannot write {path}: {_why(e)}") from None


def _natural_key(name: str) -> tuple:
    """'10_algo=x' sorts after '9_algo=y' (Hydra numbers jobs without zero padding)."""
    head, _, rest = name.partition("_")
    return (0, int(head), rest) if head.isdigit() else (1, 0, name)


# --------------------------------------------------------------------------- metrics
# The names metrics.csv uses (docs/metrics.md; fedbench.evaluation, not imported: it needs torch)
# head / trained: per-client predictors reported beside the personalized one (FedProto's
# classifier head; FedCAC's model after local training, before the server's mix)
KINDS = ("personal", "global", "head", "trained")
SETS = ("L", "S", "G")  # the test sets (FedPG's L / S / G)
VAL = "V"  # the clients' validation sets (split.val_frac > 0)
ACC_SETS = (*SETS, VAL)
STATS = ("avg", "weighted", "std", "top5", "bottom5", "min", "max")
RUN_METRICS = ("train_loss", "bytes_up", "bytes_down", "wall_time_s", "cpu_time_s")
_ACCURACY = re.compile(
    rf"^({'|'.join(KINDS)})\.({'|'.join(ACC_SETS)})\.({'|'.join(STATS)})$|^global\.all$"
    rf"|^({'|'.join(KINDS)})\.LSG$"
)
# KIND.LSG: (L.avg + S.avg + G.avg) / 3 of one model kind, FedPG's criterion for its best lr
_LSG = re.compile(rf"^({'|'.join(KINDS)})\.LSG$")
METRIC_HELP = (
    f"KIND.SET.STAT with KIND {'|'.join(KINDS)}, SET {'|'.join(ACC_SETS)} (V: validation), "
    f"STAT {'|'.join(STATS)}; "
    f"KIND.LSG = (L.avg + S.avg + G.avg) / 3; global.all; {', '.join(RUN_METRICS)}; or any "
    f"other column of metrics.csv"
)


def on_validation(metric: str) -> bool:
    """Whether a metric is a validation-set number (KIND.V.STAT), not a test-set one."""
    return metric.split(".")[1:2] == [VAL]


def is_accuracy(metric: str) -> bool:
    """Accuracies are fractions in the files; tables may print them as percentages."""
    return bool(_ACCURACY.match(metric))


def check_metric(metric: str, runs: list[RunDir]) -> None:
    if is_accuracy(metric) or metric in RUN_METRICS:
        return
    if any(r.metrics is not None and metric in r.metrics.columns for r in runs):
        return
    raise ReportError(f"unknown metric {metric!r}; valid: {METRIC_HELP}")


def _best_kind(run: RunDir, kind: str | None) -> str:
    """Which model's L.avg picks the best round: the metric's own model kind, else the
    runner's rule (personal when the algorithm has personal models)."""
    if kind in KINDS:
        return kind
    m = run.metrics
    has_personal = m is not None and "personal.L.avg" in m and m["personal.L.avg"].notna().any()
    return "personal" if has_personal else "global"


# --select's rules: final = last, best = best_test (the older names, kept), val
SELECT_RULES = ("val", "last", "best_test", "final", "best")
_BLOCK = {"final": "final", "last": "final", "best": "best", "best_test": "best"}
_SELECT_SET = {"best": "L", "best_test": "L", "val": VAL}


def select_rule(select: str) -> str:
    """The canonical rule of a --select value: final -> last, best -> best_test."""
    return {"final": "last", "best": "best_test"}.get(select, select)


def has_validation(run: RunDir) -> bool:
    """Whether the run carved validation sets (split.val_frac > 0)."""
    try:
        return float(run.get("split.val_frac") or 0) > 0
    except (TypeError, ValueError):
        return False


def run_select(run: RunDir) -> str | None:
    """The round rule the run asked for (eval.select; auto: val with validation data),
    or None where it leaves the choice to the report (auto without validation, or a run
    from before the key)."""
    rule = run.get("eval.select")
    if rule in ("val", "last", "best_test"):
        return rule
    return "val" if has_validation(run) else None


def default_select(runs: list[RunDir], fallback: str, warn=None) -> str:
    """--select when not given: the rule the finished runs asked for (`run_select`) when
    they agree, else `fallback` (the report's own default: final, or a preset's rule);
    runs that ask for different rules are warned about."""
    rules = {run_select(r) for r in runs if not r.failed}
    if len(rules) == 1 and None not in rules:
        return rules.pop()
    asked = sorted(r for r in rules if r is not None)
    if asked:
        (warn or _warn)(
            f"the runs ask for different rounds (eval.select: {', '.join(asked)}"
            f"{', unset' if None in rules else ''}); the table reports the "
            f"{when_text(fallback)}: choose with --select"
        )
    return fallback


def when_text(select: str) -> str:
    """What a --select rule reports, as tables say it."""
    rule = select_rule(select)
    if rule == "val":
        return "validation-selected round"
    return "last evaluation" if rule == "last" else "best round"


def selected(run: RunDir, metric: str, select: str) -> tuple[int | None, float | None]:
    """(round, value) of `metric` in a finished run at the selected evaluation round:
    `final`/`last` = the last evaluation; `best`/`best_test` = the evaluation with the
    highest L.avg of the model kind the metric is about (personal.* -> personal.L.avg,
    global.* -> global.L.avg: the best round of the model the cell shows, as the papers
    report it; chosen on the test set, so optimistic); `val` = the one with the highest
    V.avg (validation) of that model kind, None for a run without validation sets.
    Values come from metrics.csv, summary.json when it is missing. (None, None) for a
    failed run; value None when the run has no such metric (e.g. `local` has no global
    model). `KIND.LSG` is the mean of KIND.L.avg, KIND.S.avg and KIND.G.avg at that round."""
    if run.failed:
        return None, None
    if _LSG.match(metric):
        kind = metric.split(".", 1)[0]
        parts = [selected(run, f"{kind}.{s}.avg", select) for s in SETS]
        if any(v is None for _, v in parts):
            return parts[0][0], None
        return parts[0][0], sum(v for _, v in parts) / len(parts)
    kind = metric.split(".", 1)[0]
    m = run.metrics
    if m is not None and not m.empty and "round" in m:
        if select in ("final", "last"):
            row = m.loc[m["round"].idxmax()]
        else:
            key = f"{_best_kind(run, kind)}.{_SELECT_SET[select]}.avg"
            if key not in m or m[key].isna().all():
                return None, None
            row = m.loc[m[key].idxmax()]  # the first of equal rounds, as the runner
        value = row.get(metric)
        return int(row["round"]), _finite(value)
    if select == "val":  # summary.json's `selected`, when it was chosen by validation
        block = run.summary.get("selected")
        if not isinstance(block, dict) or block.get("by") != "val":
            return None, None
    else:
        block = run.summary.get(_BLOCK.get(select, select))
    if not isinstance(block, dict):
        block = {}
    if metric in RUN_METRICS:
        return block.get("round"), _finite(run.summary.get(metric))
    node: Any = block
    for part in metric.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return block.get("round"), _finite(node)


def _finite(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# --------------------------------------------------------------------------- key values
def parse_value(text: str) -> Any:
    """A command-line value as YAML reads it: '0.1' -> 0.1, 'null' -> None, '[32]' -> [32]."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def same_value(a: Any, b: Any) -> bool:
    """Config values compared as a person would: 1 == 1.0, '0.1' == 0.1, [32] == (32,)."""
    if isinstance(a, str) and not isinstance(b, str):
        a = parse_value(a)
    if isinstance(b, str) and not isinstance(a, str):
        b = parse_value(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def hashable(value: Any) -> Any:
    """A config value usable as a dict key and sortable against its peers."""
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def sort_key(value: Any) -> tuple:
    """Numbers in numeric order, then strings, then None; tuples element-wise."""
    if value is None:
        return (3,)
    if isinstance(value, bool):
        return (1, str(value))
    if isinstance(value, (int, float)):
        return (0, float(value))
    if isinstance(value, tuple):
        return (2, tuple(sort_key(v) for v in value))
    return (1, str(value))


def varying_keys(runs: list[RunDir]) -> list[str]:
    """Config keys whose value differs between runs, aliases first: the sweep's axes.
    Left out: `seed`, incidental keys, the long form of an alias, and keys that only some
    runs have (an algorithm's own settings, keys added to the config since a run)."""
    if not runs:
        return []
    common = set.intersection(*(set(r.config) for r in runs))
    shadowed = set(ALIASES.values())
    out = []
    for k in sorted(common, key=lambda k: (k not in ALIASES, "." in k, k)):
        if k in shadowed or k == "seed" or incidental(k):
            continue
        if len({hashable(r.config[k]) for r in runs}) > 1:
            out.append(k)
    # participation and per_round say the same thing; keep the one that was set
    if "participation" in out and "per_round" in out:
        out.remove("per_round")
    return out


def follows(key: str, by: list[str], runs: list[RunDir]) -> bool:
    """Whether `key`'s value is a function of the values of `by` over `runs`: every group
    of runs sharing their `by` values has one value of `key` (a key that differs between
    runs only because another one does, e.g. `algo.weighting` between algorithms whose
    YAMLs set it differently). False without `by`."""
    if not by:
        return False
    seen: dict[tuple, Any] = {}
    for r in runs:
        group = tuple(hashable(r.get(k)) for k in by)
        value = hashable(r.get(key))
        if seen.setdefault(group, value) != value:
            return False
    return True
