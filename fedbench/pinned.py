"""Pinned results, re-checked (`scripts/check_pinned.sh`, `python -m fedbench.pinned`).

Every cell in `results/` (a folder with `summary.json`, `metrics.csv` and `.hydra/`) is
pinned: its first recorded `metrics.csv` rows are what today's code must still compute from
its recorded config. The check re-runs each cell's first rounds and compares:

- the run: the recorded `.hydra/config.yaml` (keys added to fedbench since take today's
  defaults), with its own `rounds` and `eval.every`,
  stopped after the first recorded evaluation at or past `--rounds K` (default 3):
  `Run.run(until=...)` stops as a preempted run does, so schedules that follow `rounds`
  (APPLE's L, FedSpa's pruning) are those of the full run. DiversiFed's cells (evaluated
  every round) re-run rounds 1-3, FedPG's (every 50) rounds 1-50;
- the command: the cell's one-line command (its `.hydra/overrides.yaml`) must compose to
  the recorded config today (a changed default moves a cell without touching the code);
- the rows: every column of the recorded rows but the clocks (`wall_time_s`, `cpu_time_s`).
  Accuracies (`<model>.<set>.<stat>`, `global.all`) are judged on the means over clients
  (`avg`, `weighted`, `all`: one flipped test prediction moves them by 1 / the test samples,
  where it moves a `min` or `max` by a whole client's step), the other numbers (losses,
  bytes, sizes, counters) relatively. On the machine and torch that made a cell (its
  summary's `provenance`) every compared column must be equal to the bit; elsewhere within
  TOLERANCE, measured (docs/reproduction/README.md#pinned-results): a cell without a
  provenance block (made before fedbench recorded one) is checked within the tolerance.

A cell that drifts is a finding: today's code (or config) no longer computes what made the
published number. The pin is renewed on purpose, `--renew --reason TEXT CELL...`, which
writes the re-run's rows into `results/pins.json` (with the reason, the machine and torch),
in a commit that says why; the check compares such a cell with its renewed rows from then
on, and its card says that its full-length numbers are older code's.

Exit status: 0 every cell matches, 1 a cell drifted (each named), 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from fedbench.errors import FedbenchError

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
PINS_FILE = "pins.json"
DEFAULT_ROUNDS = 3
EXIT_DRIFT = 1
EXIT_BAD_INPUT = 2

# Measured (results/README.md): the same cells re-run with the
# sequential and the vmap backend, and with 1 and 2 threads, on this project's CPUs (AMD
# EPYC, torch 2.14.1) differ by at most these. ACC_TOL is in accuracy points on the means
# over clients; REL_TOL is relative, on every other number but wall_time_s.
ACC_TOL = 0.1
REL_TOL = 1e-3

ACC = re.compile(r"^[a-z_]+\.(?:[LSG]\.(?:avg|weighted|std|top5|bottom5|min|max)|all)$")
MEAN = re.compile(r"^[a-z_]+\.(?:[LSG]\.(?:avg|weighted)|all)$")
IGNORED = ("wall_time_s", "cpu_time_s")
# Keys of a recorded config that say where or how often a run writes, not what it computes.
INCIDENTAL = ("checkpoint", "log", "resume", "objective", "data.root", "data.download")


class PinError(FedbenchError):
    """Bad input to the check (a path, a pins file): one line, exit 2."""


# --------------------------------------------------------------------------- cells
@dataclass
class Cell:
    """One pinned cell: a results folder with summary.json, metrics.csv and .hydra/."""

    root: Path
    path: Path

    @property
    def name(self) -> str:
        return self.path.relative_to(self.root).as_posix()

    @property
    def summary(self) -> dict:
        return json.loads((self.path / "summary.json").read_text())

    @property
    def config(self) -> dict:
        return yaml.safe_load((self.path / ".hydra" / "config.yaml").read_text())

    @property
    def overrides(self) -> list[str]:
        return [
            str(o) for o in yaml.safe_load((self.path / ".hydra" / "overrides.yaml").read_text())
        ]

    @property
    def metrics(self) -> pd.DataFrame:
        return pd.read_csv(self.path / "metrics.csv")

    @property
    def provenance(self) -> dict | None:
        return self.summary.get("provenance")


def is_cell(path: Path) -> bool:
    return all(
        (path / f).is_file()
        for f in ("summary.json", "metrics.csv", ".hydra/config.yaml", ".hydra/overrides.yaml")
    )


def find_cells(root: Path, paths: list[str] | None = None) -> list[Cell]:
    """The cells under `root`, or under each of `paths` (a cell, or a folder of cells
    inside `root`), in path order."""
    root = root.resolve()
    wanted = [Path(p).resolve() for p in paths] if paths else [root]
    out: dict[Path, Cell] = {}
    for w in wanted:
        if not w.exists():
            raise PinError(f"{w}: no such cell or folder")
        try:
            w.relative_to(root)
        except ValueError:
            raise PinError(f"{w}: not under the results folder {root}") from None
        found = [w] if is_cell(w) else sorted(p.parent for p in w.rglob("summary.json"))
        found = [p for p in found if is_cell(p)]
        if not found:
            raise PinError(f"{w}: holds no cell (summary.json, metrics.csv and .hydra/)")
        for p in found:
            out[p] = Cell(root, p)
    return [out[p] for p in sorted(out)]


# --------------------------------------------------------------------------- pins
def load_pins(root: Path) -> dict:
    """{cell name: renewal} from `root/pins.json` ({} when there is none)."""
    path = root / PINS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return dict(data["renewed"])
    except (ValueError, KeyError, TypeError) as e:
        raise PinError(f"{path} cannot be read ({e})") from None


def save_pins(root: Path, renewed: dict) -> None:
    from fedbench.io import atomic_write_text

    text = json.dumps(
        {
            "about": "Pins renewed on purpose (python -m fedbench.pinned --renew): the rows "
            "today's code computes for a cell whose recorded metrics.csv it no longer "
            "reproduces, and why. Every other cell in results/ is pinned to its own "
            "metrics.csv. results/README.md",
            "renewed": dict(sorted(renewed.items())),
        },
        indent=1,
    )
    atomic_write_text(root / PINS_FILE, text + "\n")


@dataclass
class Pin:
    """What a cell's re-run must give: `rows` (the first recorded rows up to `until`, or
    the renewed ones), and whether it must be exact here."""

    cell: Cell
    until: int
    rows: pd.DataFrame
    renewed: dict | None
    exact: bool
    why_tolerance: str
    threads: int | None = None  # torch threads the recorded rows were computed with


def pin_text(root: Path, folder: Path, rounds: int = DEFAULT_ROUNDS) -> str:
    """What scripts/check_pinned.sh compares a cell's re-run with, in words (the cards)."""
    cell = Cell(Path(root).resolve(), Path(folder).resolve())
    rec = load_pins(cell.root).get(cell.name)
    rows = pd.DataFrame(rec["rows"]) if rec else cell.metrics
    later = rows[rows["round"] >= rounds]["round"]
    until = int(later.min()) if len(later) else int(rows["round"].max())
    first = int(rows["round"].min())
    rows_text = f"its row of round {until}" if first == until else f"its rows {first}-{until}"
    if rec:
        return (
            f"renewed: `scripts/check_pinned.sh` re-runs rounds 1-{until} and compares "
            f"{rows_text} with those today's code gave on {rec.get('machine')} (torch "
            f"{rec.get('torch')}, commit {rec.get('commit')}), because: {rec.get('reason')} "
            "(results/pins.json); this folder's numbers are older code's"
        )
    return (
        f"`scripts/check_pinned.sh` re-runs rounds 1-{until} and compares {rows_text} with "
        "metrics.csv's"
    )


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def here() -> dict:
    import torch

    from fedbench.provenance import machine

    return {
        "machine": machine("cpu"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def pin_of(cell: Cell, rounds: int, renewed: dict) -> Pin:
    rec = renewed.get(cell.name)
    rows = pd.DataFrame(rec["rows"]) if rec else cell.metrics
    if rows.empty:
        raise PinError(f"{cell.name}: no recorded rows")
    later = rows[rows["round"] >= rounds]["round"]
    until = int(later.min()) if len(later) else int(rows["round"].max())
    made = rec if rec else (cell.provenance or {})
    now = here()
    if not made.get("machine"):
        exact, why = False, "machine not recorded"
    elif made.get("machine") != now["machine"] or made.get("torch") != now["torch"]:
        exact, why = False, f"made on {made.get('machine')}, torch {made.get('torch')}"
    elif not made.get("threads"):
        # the same CPU model with another thread count sums in another order
        exact, why = False, "torch threads not recorded"
    else:
        exact, why = True, ""
    rows = rows[rows["round"] <= until].reset_index(drop=True)
    return Pin(cell, until, rows, rec, exact, why, made.get("threads"))


# --------------------------------------------------------------------------- the re-run
def _today(cell: Cell):
    """The config the cell's one-line command composes today."""
    from fedbench.cli import _compose
    from fedbench.config import task_config

    overrides = [o for o in cell.overrides if not o.startswith(("resume=", "hydra."))]
    return task_config(_compose(overrides))


def recorded_config(cell: Cell, backend: str | None = None):
    """The cell's recorded config, ready to run in a scratch folder (no checkpoints, a fresh
    start, on the CPU): every recorded value, over what its command composes today, so that
    a key added to fedbench since the cell was saved takes its default (command_differences
    says when that default is not the value that changes nothing)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(_today(cell), OmegaConf.create(cell.config))
    cfg.checkpoint.every = 0
    cfg.resume = False
    cfg.device = "cpu"
    if backend:
        cfg.engine.backend = backend
    return cfg


def command_differences(cell: Cell, today=None) -> list[str]:
    """'key (recorded -> today)' where the cell's one-line command composes, today, to
    another config than the recorded one (incidental keys aside). `today`: that composed
    task config, where the caller has it already (a Hydra compose costs about a second)."""
    from omegaconf import OmegaConf

    from fedbench.checkpoint import config_differences
    from fedbench.trees import plain

    now = plain(_today(cell) if today is None else today)
    return config_differences(plain(OmegaConf.create(cell.config)), now, INCIDENTAL)


def rerun(
    cell: Cell, until: int, out: Path, backend: str | None = None, threads: int | None = None
) -> pd.DataFrame:
    """The cell's first `until` rounds re-run in `out`: its metrics.csv rows."""
    import torch

    from fedbench.runner import Run

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = recorded_config(cell, backend)
        Run(cfg, out, progress=False).run(until=until)
    finally:
        torch.set_num_threads(before)
    return pd.read_csv(out / "metrics.csv")


# --------------------------------------------------------------------------- compare
@dataclass
class Diff:
    """How far a re-run's rows are from the pinned ones."""

    acc: float = 0.0  # max |difference| of the mean accuracies, in points
    acc_where: str = ""
    acc_any: float = 0.0  # the same over every accuracy column (min, max, ... included)
    rel: float = 0.0  # max relative difference of the other numbers
    rel_where: str = ""
    exact: bool = True  # every compared value equal to the bit
    problems: list[str] = field(default_factory=list)  # rows or columns missing

    def within(self, acc_tol: float, rel_tol: float) -> bool:
        return not self.problems and self.acc <= acc_tol and self.rel <= rel_tol


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def compare(pinned: pd.DataFrame, got: pd.DataFrame) -> Diff:
    d = Diff()
    rounds = [int(r) for r in pinned["round"]]
    have = {int(r): i for i, r in enumerate(got["round"])}
    lost = [r for r in rounds if r not in have]
    if lost:
        d.problems.append(f"no re-run row for round(s) {lost}")
        d.exact = False
        return d
    cols = [c for c in pinned.columns if c not in IGNORED and c != "round"]
    gone = [c for c in cols if c not in got.columns]
    if gone:
        d.problems.append(f"columns no longer written: {', '.join(gone)}")
        d.exact = False
    for c in cols:
        if c in gone:
            continue
        for i, r in enumerate(rounds):
            a, b = pinned[c].iloc[i], got[c].iloc[have[r]]
            try:
                a, b = float(a), float(b)
            except (TypeError, ValueError):
                if str(a) != str(b):
                    d.problems.append(f"{c} at round {r}: {a!r} -> {b!r}")
                    d.exact = False
                continue
            if _same(a, b):
                continue
            d.exact = False
            if math.isnan(a) or math.isnan(b):
                d.problems.append(f"{c} at round {r}: {a} -> {b}")
                continue
            if ACC.match(c):
                pts = abs(a - b) * 100
                d.acc_any = max(d.acc_any, pts)
                if MEAN.match(c) and pts > d.acc:
                    d.acc, d.acc_where = pts, f"{c} at round {r}: {a:.6g} -> {b:.6g}"
            else:
                rel = abs(a - b) / max(abs(a), abs(b), 1e-12)
                if rel > d.rel:
                    d.rel, d.rel_where = rel, f"{c} at round {r}: {a:.9g} -> {b:.9g}"
    return d


# --------------------------------------------------------------------------- check
@dataclass
class Outcome:
    cell: str
    status: str  # match | drift | error
    line: str
    diff: Diff | None = None
    rows: pd.DataFrame | None = None
    threads: int | None = None  # torch threads of the re-run


def check(
    pin: Pin,
    acc_tol: float,
    rel_tol: float,
    backend: str | None = None,
    threads: int | None = None,
    exact: bool | None = None,
) -> Outcome:
    cell = pin.cell
    # on the recorded machine, the recorded thread count (another sums in another order)
    if threads is None:
        threads = pin.threads
    elif pin.threads and threads != pin.threads and exact is None:
        exact = False
    t0 = time.perf_counter()
    try:
        config_diff = command_differences(cell)
    except Exception as e:  # noqa: BLE001 (the command no longer composes: a finding)
        config_diff = [f"the command no longer composes ({' '.join(str(e).split())[:200]})"]
    with tempfile.TemporaryDirectory(prefix="fedbench-pinned-") as tmp:
        try:
            got = rerun(cell, pin.until, Path(tmp) / "run", backend, threads)
        except Exception as e:  # noqa: BLE001 (a cell that no longer runs: a finding)
            msg = " ".join(str(e).split())[:300]
            return Outcome(cell.name, "error", f"error  {cell.name}: {type(e).__name__}: {msg}")
    secs = time.perf_counter() - t0
    d = compare(pin.rows, got)
    must_be_exact = pin.exact if exact is None else exact
    ok = d.exact if must_be_exact else d.within(acc_tol, rel_tol)
    ok = ok and not config_diff
    first, last = int(pin.rows["round"].min()), pin.until
    span = f"round {last}" if first == last else f"rounds {first}-{last}"
    what = "renewed pin" if pin.renewed else "metrics.csv"
    if d.exact:
        how = "equal to the bit"
    else:
        how = f"max |Δ| mean accuracy {d.acc:.4g} points"
        if d.acc_where:
            how += f" ({d.acc_where})"
        how += f", any accuracy {d.acc_any:.4g}, other numbers {d.rel:.2g} relative"
        if d.rel_where:
            how += f" ({d.rel_where})"
    rule = (
        "exact (same machine, torch and threads)"
        if must_be_exact
        else f"tolerance {acc_tol:g} points / {rel_tol:g} relative ({pin.why_tolerance or 'asked'})"
    )
    status = "match" if ok else "drift"
    line = f"{status:5s}  {cell.name}: {span} vs {what}: {how}; {rule}; {secs:.0f} s"
    for p in d.problems:
        line += f"\n       {p}"
    for c in config_diff:
        line += f"\n       command composes another config today: {c}"
    return Outcome(cell.name, status, line, d, got, threads or torch_threads())


def estimate_s(pin: Pin) -> float:
    """Seconds to re-run a cell: its recorded pace times the rounds, plus set-up."""
    s = pin.cell.summary
    per_round = float(s.get("wall_time_s") or 0) / max(int(s.get("rounds") or 1), 1)
    return 10.0 + per_round * pin.until


# --------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage and exits; we want one line
        raise PinError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="scripts/check_pinned.sh",
        description="Re-run the first rounds of every pinned cell in results/ from its "
        "recorded config and compare them with its recorded metrics.csv rows.",
    )
    p.add_argument("cells", nargs="*", metavar="CELL", help="cells or folders of cells "
                   "(default: every cell under --root)")  # fmt: skip
    p.add_argument("--root", default=str(RESULTS), help="the results folder (default: results/)")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, metavar="K",
                   help="re-run to the first recorded evaluation at or after round K "
                   f"(default {DEFAULT_ROUNDS})")  # fmt: skip
    p.add_argument("--sample", type=int, metavar="N", help="N cells drawn at random")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="cells drawn at random (with --sample: at most N) while their "
                   "estimated re-run times fit SECONDS (CI's sample)")  # fmt: skip
    p.add_argument("--seed", type=int, help="the draw of --sample / --budget (default: a new "
                   "one, printed)")  # fmt: skip
    p.add_argument("--tolerance", type=float, default=ACC_TOL, metavar="POINTS",
                   help=f"mean-accuracy tolerance, points (default {ACC_TOL})")  # fmt: skip
    p.add_argument("--rel-tolerance", type=float, default=REL_TOL, metavar="R",
                   help=f"relative tolerance of the other numbers (default {REL_TOL})")  # fmt: skip
    p.add_argument("--exact", action="store_true", help="require equality to the bit everywhere")
    p.add_argument("--loose", action="store_true",
                   help="the tolerance even on the cell's own machine")  # fmt: skip
    p.add_argument("--backend", choices=("sequential", "vmap", "auto"),
                   help="engine.backend for the re-run (default: the recorded one)")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch threads for the re-run")
    p.add_argument("--renew", action="store_true", help="write the re-runs' rows into "
                   f"{PINS_FILE} as the cells' new pins (needs --reason)")  # fmt: skip
    p.add_argument("--reason", help="why the pins are renewed (kept in the pins file)")
    p.add_argument("--list", action="store_true", help="list the cells, rounds and estimates")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(parser().parse_args(argv))
    except PinError as e:
        print(f"check_pinned: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _main(args: argparse.Namespace) -> int:
    logging.getLogger("fedbench").setLevel(logging.WARNING)
    root = Path(args.root).resolve()
    if not root.is_dir():
        raise PinError(f"--root {root}: no such folder")
    if args.rounds < 1:
        raise PinError(f"--rounds {args.rounds}: must be >= 1")
    if args.renew and not (args.reason and args.reason.strip()):
        raise PinError("--renew needs --reason TEXT (why today's code moves these cells)")
    if args.renew and not args.cells:
        raise PinError("--renew names the cells it renews")
    if args.budget is not None and args.budget <= 0:
        raise PinError(f"--budget {args.budget:g}: must be > 0 seconds")
    cells = find_cells(root, args.cells)
    renewed = load_pins(root)
    if args.sample is not None or args.budget is not None:
        if args.sample is not None and args.sample < 1:
            raise PinError(f"--sample {args.sample}: must be >= 1")
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
        drawn = random.Random(seed).sample(cells, len(cells))[: args.sample or len(cells)]
        if args.budget is not None:
            drawn, spent = _fit(drawn, args.budget, args.rounds, renewed)
            print(f"within --budget {args.budget:g} s: ~{spent:.0f} s")
        cells = sorted(drawn, key=lambda c: c.name)
        print(f"sample of {len(cells)} (--seed {seed})")
    # cheapest first: a drift shows as early as it can
    pins = sorted((pin_of(c, args.rounds, renewed) for c in cells), key=estimate_s)
    total = sum(estimate_s(p) for p in pins)
    print(
        f"{len(pins)} pinned cell(s), about {total / 60:.0f} min at their recorded pace; "
        f"here: {here()['machine']}, torch {here()['torch']}"
    )
    if args.list:
        for p in pins:
            print(f"  {p.cell.name}: to round {p.until}, ~{estimate_s(p):.0f} s"
                  + (" (renewed pin)" if p.renewed else ""))  # fmt: skip
        return 0
    exact = True if args.exact else (False if args.loose else None)
    outcomes = []
    for p in pins:
        o = check(p, args.tolerance, args.rel_tolerance, args.backend, args.threads, exact)
        print(o.line, flush=True)
        outcomes.append(o)
    bad = [o for o in outcomes if o.status != "match"]
    if args.renew:
        return _renew(root, renewed, outcomes, args.reason.strip())
    print(f"{len(outcomes) - len(bad)} match, {len(bad)} drifted or failed")
    if bad:
        print("drifted: " + ", ".join(o.cell for o in bad))
        return EXIT_DRIFT
    return 0


def _fit(cells: list[Cell], budget: float, rounds: int, renewed: dict) -> tuple[list[Cell], float]:
    """The cells, in the order given, whose estimates fit `budget` seconds together (one
    that does not fit is passed over; the cheapest is kept if none fits)."""
    est = {c.name: estimate_s(pin_of(c, rounds, renewed)) for c in cells}
    kept, spent = [], 0.0
    for c in cells:
        if spent + est[c.name] <= budget:
            kept.append(c)
            spent += est[c.name]
    if not kept and cells:
        kept = [min(cells, key=lambda c: est[c.name])]
        spent = est[kept[0].name]
    return kept, spent


def _plain_row(row: dict) -> dict:
    """A row with Python numbers (json writes floats by repr: every bit kept)."""
    return {k: v.item() if hasattr(v, "item") else v for k, v in row.items()}


def _renew(root: Path, renewed: dict, outcomes: list[Outcome], reason: str) -> int:
    from fedbench.provenance import code_commit

    failed = [o for o in outcomes if o.rows is None]
    if failed:
        print("not renewed (the re-run failed): " + ", ".join(o.cell for o in failed))
        return EXIT_DRIFT
    for o in outcomes:
        rows = o.rows.drop(columns=[c for c in IGNORED if c in o.rows.columns])
        until = int(o.rows["round"].max())
        renewed[o.cell] = {
            "reason": reason,
            "commit": code_commit(),
            **here(),
            "threads": o.threads,
            "until": until,
            "rows": [_plain_row(r) for r in rows.to_dict(orient="records")],
        }
    save_pins(root, renewed)
    print(f"renewed {len(outcomes)} pin(s) in {root / PINS_FILE}: commit it, saying why")
    return 0


if __name__ == "__main__":
    sys.exit(main())
