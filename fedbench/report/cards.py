"""Reproduction cards: one per finished cell of `results/` (or any run directory).

A card says how to make the cell again and what it is worth beside its paper:

- the one-line command: `fedbench` with the cell's own overrides (`.hydra/overrides.yaml`)
  and a fresh run directory under `reruns/`;
- the wall time (summary.json) and the machine, fedbench version and commit, torch and the
  data digest the run recorded (`summary.json["provenance"]`); for a cell made before runs
  recorded them, what is known and how (`results/provenance.yaml`: the data digest computed
  after the run, the commit that first put the cell into results/), never a guess shown as
  a record;
- every paper table (preset) the cell lands in: its row and column, our number at the
  preset's round (best or last), the paper's printed number and the difference in points;
- where an accuracy is more than GAP points from the paper, the reason, and the runs that
  checked it (curated text, `results/reasons.yaml`, keyed by cell or by a folder of cells);
- what `scripts/check_pinned.sh` compares the cell's re-run with (fedbench.pinned).

`fedbench-report results --cards` writes `card.json` and `card.md` into every cell folder
(tests/test_cards.py fails when a committed card differs from what the files give);
`fedbench-report PATH --html page.html` shows the cards of the runs it reads.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from fedbench.report import presets
from fedbench.report.collect import ReportError, RunDir, find_runs, is_accuracy, selected
from fedbench.report.paper_numbers import paper_csv

GAP = 2.0  # points from the paper beyond which a card must give the reason
REASONS_FILE = "reasons.yaml"
PROVENANCE_FILE = "provenance.yaml"
CARD_JSON, CARD_MD = "card.json", "card.md"
RERUN_ROOT = "reruns"
NOT_RECORDED = "not recorded"


# --------------------------------------------------------------------------- curated text
@dataclass(frozen=True)
class Curated:
    """What a results folder says of its cells beyond their files: reasons for gaps
    (reasons.yaml) and what is known of cells made before runs recorded their provenance
    (provenance.yaml). Keys are cell names (paths under the results folder) or folders of
    cells; the longest key that matches a cell is its entry."""

    reasons: dict[str, dict] = field(default_factory=dict)
    data: dict[str, dict] = field(default_factory=dict)  # data name -> {digest, note}
    added: dict[str, str] = field(default_factory=dict)  # cell or folder -> commit

    @classmethod
    def load(cls, root: Path) -> Curated:
        reasons = _yaml(root / REASONS_FILE).get("cells") or {}
        prov = _yaml(root / PROVENANCE_FILE)
        for key, entry in reasons.items():
            if not isinstance(entry, dict) or not (entry.get("reason") or entry.get("note")):
                raise ReportError(f"{root / REASONS_FILE}: {key}: needs a 'reason' or a 'note'")
        return cls(
            reasons=dict(reasons),
            data=dict(prov.get("data") or {}),
            added={str(k): str(v) for k, v in (prov.get("added") or {}).items()},
        )

    def all_keys(self) -> list[str]:
        return [*self.reasons, *self.added]


def _yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ReportError(f"{path} cannot be read ({' '.join(str(e).split())[:200]})") from None
    return data if isinstance(data, dict) else {}


def lookup(table: dict[str, Any], cell: str, field: str | None = None) -> Any:
    """The entry of the longest key that is `cell` or a folder above it (with `field`: the
    longest whose entry has that field, and the field's value)."""
    best, found = -1, None
    for key, entry in table.items():
        k = key.rstrip("/")
        if not (cell == k or cell.startswith(k + "/")) or len(k) <= best:
            continue
        if field is not None:
            if not isinstance(entry, dict) or entry.get(field) in (None, ""):
                continue
            entry = entry[field]
        best, found = len(k), entry
    return found


# --------------------------------------------------------------------------- the card
@dataclass
class StatLine:
    stat: str
    metric: str
    ours: float | None  # percent for accuracies
    paper: str | None  # as printed
    difference: float | None  # ours - paper, in points (accuracies only)


@dataclass
class Comparison:
    """Where the cell lands in one paper table."""

    preset: str
    title: str
    row: str
    column: str
    select: str  # best | final
    round: int | None
    stats: list[StatLine]
    deviations: list[str]


@dataclass
class Card:
    cell: str
    command: str
    algo: str
    data: str
    seed: Any
    rounds: int | None
    wall_time_s: float | None
    machine: str
    version: str
    commit: str
    torch: str
    data_digest: str
    data_digest_note: str
    provenance_recorded: bool
    comparisons: list[Comparison]
    max_gap: float | None  # the largest |ours - paper| of an accuracy, in points
    reason: str | None
    checks: list[str]
    note: str | None
    pin: str

    @property
    def needs_reason(self) -> bool:
        return self.max_gap is not None and self.max_gap > GAP

    def to_json(self) -> dict:
        return asdict(self)

    def markdown(self) -> str:
        return card_markdown(self)


def rerun_dir(cell: str, cells: list[str]) -> str:
    """`reruns/<cell>`, its last folder dropped where that is the overrides Hydra named the
    cell by and the rest still tells it from every other cell."""
    parts = cell.split("/")
    if len(parts) > 1 and "=" in parts[-1]:
        short = "/".join(parts[:-1])
        if sum(1 for c in cells if c == short or c.startswith(short + "/")) == 1:
            return f"{RERUN_ROOT}/{short}"
    return f"{RERUN_ROOT}/{cell}"


_HYDRA_PLAIN = re.compile(r"^[\w./@-]+$")


def command(overrides: list[str], run_dir: str) -> str:
    """The one-line command: fedbench, the overrides, the run directory (quoted for Hydra
    where it holds = , or +, then for the shell)."""
    value = run_dir if _HYDRA_PLAIN.match(run_dir) else f'"{run_dir}"'
    words = ["fedbench", *overrides, f"hydra.run.dir={value}"]
    return " ".join(shlex.quote(w) for w in words)


def overrides_of(run: RunDir) -> list[str]:
    path = Path(run.path) / ".hydra" / "overrides.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


@cache
def _fractions(csv_name: str) -> bool:
    """Whether a paper prints accuracies as fractions (FedPG: .989)."""
    values = []
    for r in paper_csv(csv_name):
        try:
            values.append(float(r["value"]))
        except ValueError:
            continue
    return bool(values) and max(values) <= 1.0


def comparisons(run: RunDir) -> list[Comparison]:
    """Every preset table the run lands in, with our number, the paper's and the gap."""
    out = []
    for name, preset in presets.PRESETS.items():
        if preset._row_of(run) is None or not any(
            presets.matches(run, c.match) for c in preset.columns
        ):
            continue
        table, _ = preset.build([run])
        for (rv, cv), _group in table.groups.items():
            lines, rnd = [], None
            for stat in table.stats:
                metric = table.metric.get((rv, stat))
                if metric is None:
                    continue
                cell = table.cells.get((rv, cv, stat))
                acc = is_accuracy(metric)
                ours = None
                if cell is not None and cell.mean is not None:
                    ours = cell.mean * (100.0 if acc else 1.0)
                if rnd is None:
                    rnd = selected(run, metric, table.select)[0]
                p = (table.paper or {}).get((rv, cv, stat))
                paper = None if p is None else p.value + (f" ± {p.std}" if p.std else "")
                diff = None
                if acc and ours is not None and p is not None:
                    try:
                        value = float(p.value) * (100.0 if _fractions(preset.csv) else 1.0)
                        diff = round(ours - value, 6)
                    except ValueError:
                        pass  # "-": the paper prints no number
                lines.append(StatLine(stat, metric, _r(ours), paper, diff))
            out.append(
                Comparison(
                    preset=name,
                    title=preset.title,
                    row=str(rv[0]),
                    column=str(cv[0]),
                    select=table.select,
                    round=rnd,
                    stats=lines,
                    deviations=preset.deviations({(rv, cv): [run]}),
                )
            )
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def card_for(run: RunDir, root: Path, name: str, cells: list[str], curated: Curated) -> Card:
    """The card of a finished run called `name` (its path under the results folder
    `root`); `cells`: every cell's name (the re-run directories must differ)."""
    from fedbench.pinned import pin_text

    s = run.summary or {}
    prov = s.get("provenance") if isinstance(s.get("provenance"), dict) else None
    data = str(s.get("data") or run.get("data") or "")
    if prov:
        machine = prov.get("machine") or NOT_RECORDED
        commit = prov.get("commit") or "unknown (not a git checkout when it ran)"
        torch_v = prov.get("torch") or NOT_RECORDED
        digest = prov.get("data_digest") or NOT_RECORDED
        digest_note = "recorded by the run"
    else:
        machine, torch_v = NOT_RECORDED, NOT_RECORDED
        added = lookup(curated.added, name)
        commit = "unknown (not recorded: the run predates fedbench's provenance record)"
        if added:
            commit += f"; the cell was first committed to results/ in {added}"
        known = curated.data.get(data) or {}
        digest = str(known.get("digest") or NOT_RECORDED)
        digest_note = str(known.get("note") or "not recorded")
    comps = comparisons(run)
    gaps = [abs(line.difference) for c in comps for line in c.stats if line.difference is not None]
    reason = lookup(curated.reasons, name, "reason")
    checks = lookup(curated.reasons, name, "checks") if reason else None
    note = lookup(curated.reasons, name, "note")
    wall = s.get("wall_time_s")
    return Card(
        cell=name,
        command=command(overrides_of(run), rerun_dir(name, cells)),
        algo=str(s.get("algo") or run.get("algo")),
        data=data,
        seed=s.get("seed", run.get("seed")),
        rounds=s.get("rounds"),
        wall_time_s=None if wall is None else float(wall),
        machine=str(machine),
        version=str((prov or {}).get("version") or s.get("version") or NOT_RECORDED),
        commit=str(commit),
        torch=str(torch_v),
        data_digest=str(digest),
        data_digest_note=digest_note,
        provenance_recorded=bool(prov),
        comparisons=comps,
        max_gap=_r(max(gaps)) if gaps else None,
        reason=" ".join(str(reason).split()) if reason else None,
        checks=[str(c) for c in checks or []],
        note=" ".join(str(note).split()) if note else None,
        pin=pin_text(root, Path(run.path)),
    )


def results_root(path: Path) -> Path:
    """The results folder a path belongs to: the nearest folder at or above it with a
    reasons.yaml or provenance.yaml; else the path itself."""
    path = path.resolve()
    for p in [path, *path.parents]:
        if (p / REASONS_FILE).is_file() or (p / PROVENANCE_FILE).is_file():
            return p
    return path


def build_cards(
    paths: list[str | Path], runs: list[RunDir] | None = None
) -> list[tuple[Path, Card]]:
    """(folder, card) of every finished run under `paths` (or of `runs`), each named by
    its path under its results folder (`results_root`)."""
    if runs is None:
        runs = find_runs([str(p) for p in paths])
    roots = [results_root(Path(p)) for p in paths] or [Path.cwd()]
    named = []
    for run in runs:
        if run.failed:
            continue
        where = Path(run.path).resolve()
        root = next((r for r in roots if where == r or r in where.parents), where.parent)
        named.append((run, root, where.relative_to(root).as_posix() or where.name))
    by_root: dict[Path, Curated] = {r: Curated.load(r) for _, r, _ in named}
    names = [n for _, _, n in named]
    return [
        (Path(run.path), card_for(run, root, name, names, by_root[root]))
        for run, root, name in named
    ]


def stale_keys(root: Path, cards: list[tuple[Path, Card]]) -> list[str]:
    """Keys of reasons.yaml / provenance.yaml that name no cell (a moved or removed cell)."""
    names = [c.cell for _, c in cards]
    cur = Curated.load(root)
    return [
        k
        for k in cur.all_keys()
        if not any(n == k.rstrip("/") or n.startswith(k.rstrip("/") + "/") for n in names)
    ]


def write_cards(cards: list[tuple[Path, Card]]) -> list[Path]:
    """card.json and card.md into each cell's folder; the paths written."""
    from fedbench.report.collect import write_output

    out = []
    for folder, card in cards:
        write_output(folder / CARD_JSON, (card_json_text(card)).encode())
        write_output(folder / CARD_MD, card.markdown().encode())
        out += [folder / CARD_JSON, folder / CARD_MD]
    return out


def card_json_text(card: Card) -> str:
    return json.dumps(card.to_json(), indent=1, ensure_ascii=False) + "\n"


# --------------------------------------------------------------------------- rendering
def _num(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _signed(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}"


def _minutes(s: float | None) -> str:
    if s is None:
        return NOT_RECORDED
    return f"{s / 60:.1f} min ({s:.0f} s)"


def card_markdown(card: Card) -> str:
    """The card as a Markdown page (card.md)."""
    lines = [
        f"# Reproduction card: `{card.cell}`",
        "",
        "Generated by `fedbench-report results --cards` from this folder's files, "
        "results/reasons.yaml and results/provenance.yaml; do not edit by hand.",
        "",
        "The one-line command (from `.hydra/overrides.yaml`; run it from anywhere, it writes "
        "a new run directory):",
        "",
        "```bash",
        card.command,
        "```",
        "",
        "| | |",
        "| --- | --- |",
        f"| run | `algo={card.algo}` on {card.data}, seed {card.seed}, {card.rounds} rounds |",
        f"| wall time | {_minutes(card.wall_time_s)} |",
        f"| machine | {card.machine} |",
        f"| fedbench | version {card.version}; commit {card.commit} |",
        f"| torch | {card.torch} |",
        f"| data digest | `{card.data_digest}`: {card.data_digest_note} |",
        f"| pinned | {card.pin} |",
    ]
    if card.note:
        lines.append(f"| note | {card.note} |")
    lines += ["", "## Beside the paper", ""]
    if not card.comparisons:
        lines.append("In no paper table (no preset places this run).")
    for c in card.comparisons:
        when = "best round" if c.select == "best" else "last evaluation"
        at = f", round {c.round}" if c.round is not None else ""
        lines += [
            f"`fedbench-report <folder> --preset {c.preset}`: {c.title}; row {c.row}, "
            f"column {c.column} ({when}{at}).",
            "",
            "| stat | ours | paper | ours − paper (points) |",
            "| --- | ---: | ---: | ---: |",
        ]
        for s in c.stats:
            lines.append(
                f"| {s.stat} | {_num(s.ours)} | {s.paper or '—'} | {_signed(s.difference)} |"
            )
        for d in c.deviations:
            lines.append(f"\n{d[0].upper()}{d[1:]}.")
        lines.append("")
    if card.needs_reason:
        lines += [f"## Why more than {GAP:g} points from the paper", ""]
        lines.append(card.reason or "NO REASON GIVEN (add one to results/reasons.yaml).")
        if card.checks:
            lines += ["", "Checked by: " + ", ".join(f"`{c}`" for c in card.checks) + "."]
        lines.append("")
    elif card.reason:
        lines += ["## Notes on the gap", "", card.reason, ""]
        if card.checks:
            lines += ["Checked by: " + ", ".join(f"`{c}`" for c in card.checks) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"
