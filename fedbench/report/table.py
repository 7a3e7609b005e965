"""A results table: runs grouped into cells by config keys, a metric aggregated over the
seeds of each cell (mean ± sample std), rendered as terminal text, Markdown, LaTeX or CSV.

A `Table` is format-free data: row and column key values, one `Cell` per (row, column,
stat) and, for paper presets, the paper's printed number for the same cell. `build` makes
one from runs and `--rows/--cols/--metric`; `fedbench.report.presets` makes the paper
layouts; `render` writes any of them in any format.

The numbers are pandas': one line per (run, stat) in a tidy frame, aggregated by a
groupby (mean, sample std, count); the formats are pandas' `to_string`, `to_latex` and
`to_csv` of a frame of cell texts (Markdown is written here: pandas' `to_markdown` needs
`tabulate`, which fedbench does not depend on). What a cell means is decided here:
`cell_text` (mean ± std, `n=` when a cell has another number of runs than most, failed
runs, notes such as the grid value `--best-of` chose) and the marks `—` (no run),
`failed`, `n/a`.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from fedbench.report.collect import (
    ALIASES,
    SELECT_RULES,
    ReportError,
    RunDir,
    format_value,
    hashable,
    is_accuracy,
    select_rule,
    selected,
    sort_key,
    varying_keys,
    when_text,
)

FORMATS = ("terminal", "markdown", "latex", "csv")
MAX_DIGITS = 15  # decimals a table may print (float64 has ~16 significant digits)
SELECT = SELECT_RULES  # val | last | best_test, and final / best (= last / best_test)
MISSING, FAILED, NA = "—", "failed", "n/a"
LEGEND = (
    f"{MISSING} no run; {FAILED}: every run of the cell stopped before writing summary.json "
    f"(or has unreadable files); {NA}: the runs have no such metric (e.g. no global model)"
)


@dataclass
class Cell:
    """The runs of one table cell for one metric: the values of its finished runs that
    have the metric (with their seeds, for comparisons paired by seed), and their mean and
    sample std as `aggregate` computes them."""

    values: list[float] = field(default_factory=list)  # one per finished run with the metric
    seeds: list[Any] = field(default_factory=list)  # the seed of each value
    failed: int = 0  # runs that did not finish
    absent: int = 0  # finished runs without this metric
    mean: float | None = None
    std: float | None = None  # sample standard deviation over seeds (n - 1); None for one run

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def status(self) -> str:
        if self.values:
            return "ok"
        if self.failed:
            return "failed"
        return "n/a" if self.absent else "missing"


@dataclass(frozen=True)
class PaperNumber:
    """A number as the paper prints it (strings: no rounding, percent stays percent)."""

    value: str
    std: str | None = None


CellKey = tuple[tuple, tuple, str]  # (row values, column values, stat)


@dataclass
class Table:
    title: str
    row_keys: list[str]  # names of the row label columns
    col_keys: list[str]
    rows: list[tuple]  # one tuple of values (of row_keys) per row
    cols: list[tuple]
    stats: list[str]  # what each cell shows, one sub-row each (metric names or avg/top5/...)
    metric: dict[tuple[tuple, str], str | None]  # (row, stat) -> metric read from the runs
    cells: dict[CellKey, Cell]
    groups: dict[tuple[tuple, tuple], list[RunDir]]  # the runs behind each (row, column)
    select: str = "final"
    scale: float = 100.0  # accuracies are multiplied by this (100: percent)
    digits: int = 2
    paper: dict[CellKey, PaperNumber] | None = None
    stat_labels: dict[str, str] | None = None  # sub-row labels (default: the stats)
    col_labels: list[str] | None = None  # headers (default: from the key values)
    notes: list[str] = field(default_factory=list)
    legend: list[str] = field(default_factory=list)  # lines after LEGEND (--best-of, ...)
    cell_notes: dict[CellKey, list[str]] = field(default_factory=dict)  # "(lr=0.05)"
    cell_suffix: dict[CellKey, str] = field(default_factory=dict)  # after the notes
    csv_extra: dict[CellKey, dict[str, Any]] = field(default_factory=dict)  # more CSV columns
    texts: dict[CellKey, str] = field(default_factory=dict)  # cells shown as this text (ranks)
    sections: list[Table] = field(default_factory=list)  # tables printed after this one
    # more figures for --plots / --html: (file stem, a function that draws one or None)
    figures: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)

    def col_label(self, j: int) -> str:
        if self.col_labels is not None:
            return self.col_labels[j]
        return label(self.col_keys, self.cols[j]) or (
            self.stats[0] if len(self.stats) == 1 else "value"
        )

    def row_label(self, i: int) -> tuple[str, ...]:
        return tuple(format_value(v) for v in self.rows[i])

    def stat_label(self, stat: str) -> str:
        return (self.stat_labels or {}).get(stat, stat)

    def cell(self, i: int, j: int, stat: str) -> Cell:
        return self.cells.get((self.rows[i], self.cols[j], stat), Cell())

    def runs(self) -> list[RunDir]:
        return [r for group in self.groups.values() for r in group]

    @property
    def typical_n(self) -> int:
        """The most common number of runs per cell: cells with another n say theirs."""
        ns = Counter(c.n for c in self.cells.values() if c.n)
        return ns.most_common(1)[0][0] if ns else 0


def label(keys: list[str], values: tuple) -> str:
    """'dir alpha=0.1' for (split, split.alpha): names alone, other values with their key."""
    parts = []
    for k, v in zip(keys, values):
        text = format_value(v)
        if isinstance(v, str) and (k in ALIASES or k.endswith(".name")):
            parts.append(text)
        else:
            parts.append(f"{k.rsplit('.', 1)[-1]}={text}")
    return " ".join(parts)


# --------------------------------------------------------------------------- building
def key_of(run: RunDir, keys: list[str]) -> tuple:
    return tuple(hashable(run.get(k)) for k in keys)


def _tuple_order(t: tuple) -> tuple:
    return tuple(sort_key(v) for v in t)


def check_keys(keys: list[str], runs: list[RunDir]) -> None:
    known = set().union(*(r.config for r in runs)) if runs else set()
    for k in keys:
        if k not in known:
            some = ", ".join(sorted(k for k in known if not k.startswith("hydra."))[:40])
            raise ReportError(f"unknown key {k!r}; keys in these runs: {some}")


def check_digits(digits: Any) -> None:
    if isinstance(digits, bool) or not isinstance(digits, int) or not 0 <= digits <= MAX_DIGITS:
        raise ReportError(f"digits={digits!r}: a whole number of decimals from 0 to {MAX_DIGITS}")


_RUN_COLUMNS = ["gid", "stat", "metric", "seed", "value", "failed", "absent"]


def run_values(
    groups: dict[tuple[tuple, tuple], list[RunDir]],
    metric_of: Callable[[tuple, str], str | None],
    stats: list[str],
    select: str,
) -> tuple[pd.DataFrame, list[tuple[tuple, tuple]]]:
    """The tidy frame behind the cells: one line per (group, stat, run) with the run's
    seed and its value at the selected round (NaN: failed, or no such metric); and the
    group keys, `gid` indexing them."""
    keys = list(groups)
    records = []
    for gid, (rv, _) in enumerate(keys):
        for stat in stats:
            metric = metric_of(rv, stat)
            if metric is None:
                continue
            for run in groups[keys[gid]]:
                value = None if run.failed else selected(run, metric, select)[1]
                absent = not run.failed and value is None
                seed = hashable(run.get("seed"))
                records.append((gid, stat, metric, seed, value, run.failed, absent))
    frame = pd.DataFrame.from_records(records, columns=_RUN_COLUMNS)
    frame["value"] = pd.to_numeric(frame["value"], errors="coerce").astype(float)
    return frame, keys


def aggregate(
    groups: dict[tuple[tuple, tuple], list[RunDir]],
    metric_of: Callable[[tuple, str], str | None],
    stats: list[str],
    select: str,
) -> dict[CellKey, Cell]:
    """One Cell per (row, column, stat) with runs: mean and sample std (n - 1) over the
    runs that have the metric, the failed runs and those without the metric counted."""
    frame, keys = run_values(groups, metric_of, stats, select)
    if frame.empty:
        return {}
    by = ["gid", "stat"]
    agg = frame.groupby(by, sort=False).agg(
        mean=("value", "mean"),
        std=("value", "std"),  # ddof=1; NaN for one value
        failed=("failed", "sum"),
        absent=("absent", "sum"),
    )
    ok = frame.dropna(subset=["value"])
    lists = ok.groupby(by, sort=False).agg(values=("value", list), seeds=("seed", list))
    cells = {}
    for (gid, stat), a in agg.iterrows():
        values, seeds = lists.loc[(gid, stat)] if (gid, stat) in lists.index else ([], [])
        rv, cv = keys[gid]
        cells[(rv, cv, stat)] = Cell(
            values=list(values),
            seeds=list(seeds),
            failed=int(a["failed"]),
            absent=int(a["absent"]),
            mean=_number_or_none(a["mean"]),
            std=_number_or_none(a["std"]),
        )
    return cells


def _number_or_none(x: Any) -> float | None:
    return None if x is None or pd.isna(x) else float(x)


def fill_cells(table: Table) -> None:
    """table.cells from table.groups, metric and select."""
    table.cells = aggregate(
        table.groups, lambda rv, stat: table.metric.get((rv, stat)), table.stats, table.select
    )


def group_runs(runs: list[RunDir], rows: list[str], cols: list[str]):
    groups: dict[tuple[tuple, tuple], list[RunDir]] = defaultdict(list)
    for r in runs:
        groups[(key_of(r, rows), key_of(r, cols))].append(r)
    return dict(groups)


def build(
    runs: list[RunDir],
    rows: list[str],
    cols: list[str],
    metrics: list[str],
    select: str = "final",
    scale: float = 100.0,
    digits: int = 2,
    best_of: Any = None,
) -> Table:
    """Group `runs` by the values of `rows` and `cols` keys; every metric is a sub-row.
    `best_of` (a `fedbench.report.compare.BestOf`): keep, in every cell, only the runs of
    the best value of a grid key."""
    check_digits(digits)
    check_keys(rows + cols, runs)
    groups = group_runs(runs, rows, cols)
    row_vals = sorted({k[0] for k in groups}, key=_tuple_order)
    col_vals = sorted({k[1] for k in groups}, key=_tuple_order)
    prefix = common_prefix(metrics)
    table = Table(
        title=title(metrics, select, scale),
        row_keys=rows,
        col_keys=cols,
        rows=row_vals,
        cols=col_vals,
        stats=list(metrics),
        stat_labels={m: m[len(prefix) + 1 :] for m in metrics} if prefix else None,
        metric={(rv, m): m for rv in row_vals for m in metrics},
        cells={},
        groups=groups,
        select=select,
        scale=scale,
        digits=digits,
    )
    if best_of is not None:
        best_of.apply(table)
    fill_cells(table)
    table.title += seeds_phrase(table)
    table.notes += failed_notes(table)
    table.notes += tuning_notes(table)
    warn_pooled(table, rows + cols)
    return table


def common_prefix(metrics: list[str]) -> str:
    """'personal.L' for personal.L.avg and personal.L.top5; '' unless several share one."""
    heads = {m.rsplit(".", 1)[0] for m in metrics if "." in m}
    return (
        heads.pop()
        if len(metrics) > 1 and len(heads) == 1 and all("." in m for m in metrics)
        else ""
    )


def title(metrics: list[str], select: str, scale: float) -> str:
    """'personal.L: avg, top5 (best round, accuracy in %)'."""
    prefix = common_prefix(metrics)
    short = [m[len(prefix) + 1 :] if prefix else m for m in metrics]
    what = f"{prefix}: {', '.join(short)}" if prefix else ", ".join(metrics)
    unit = ", accuracy in %" if scale == 100 and any(is_accuracy(m) for m in metrics) else ""
    return f"{what} ({when(select)}{unit})"


def when(select: str) -> str:
    return when_text(select)


def select_legend(select: str) -> list[str]:
    """The legend line that says how the round was chosen, where it is not the last."""
    rule = select_rule(select)
    if rule == "best_test":
        return [
            "best round: the evaluation with the highest test L.avg of the model shown: "
            "chosen on the test set, so OPTIMISTIC (--select val chooses by validation, "
            "for runs with split.val_frac > 0)"
        ]
    if rule == "val":
        return [
            "validation-selected round: the evaluation with the highest V.avg of the model "
            "shown (the clients' validation sets, carved from their training data: "
            "split.val_frac); n/a for a run without validation sets"
        ]
    return []


def seeds_phrase(table: Table) -> str:
    ns = [c.n for c in table.cells.values() if c.n]
    if not ns:
        return ""
    lo, hi = min(ns), max(ns)
    if hi == 1:
        return ", one run per cell"
    return f"; mean ± std over {lo}-{hi} seeds" if lo != hi else f"; mean ± std over {hi} seeds"


def failed_notes(table: Table) -> list[str]:
    runs = {str(r.path): r for r in table.runs()}
    notes = []
    bad = sorted(p for p, r in runs.items() if r.failed and not r.unreadable)
    if bad:
        notes.append(f"{len(bad)} run(s) without summary.json (failed, killed or still running):")
        notes += [f"  {p}" for p in bad[:20]] + (["  ..."] if len(bad) > 20 else [])
    unreadable = sorted(p for p, r in runs.items() if r.unreadable)
    if unreadable:
        notes.append(f"{len(unreadable)} run(s) with unreadable files (counted as failed):")
        notes += [f"  {p}: {'; '.join(runs[p].problems)}" for p in unreadable[:20]]
        notes += ["  ..."] if len(unreadable) > 20 else []
    return notes


def tuning_notes(table: Table) -> list[str]:
    """A note when runs of the table were trials of a study (an Optuna sweep) that
    maximized a test-set objective: their hyperparameters were tuned on test data."""
    metrics: Counter = Counter()
    for r in {str(r.path): r for r in table.runs()}.values():
        obj = (r.summary or {}).get("objective")
        if not r.failed and isinstance(obj, dict) and obj.get("tuning") and obj.get("on_test"):
            metrics[str(obj.get("metric"))] += 1
    if not metrics:
        return []
    what = ", ".join(f"{m} ({n} runs)" for m, n in sorted(metrics.items()))
    return [
        f"objective on the test set: {sum(metrics.values())} run(s) are trials of a study "
        f"that maximized a test-set number ({what}): tuning on test data is optimistic "
        "(split.val_frac > 0 tunes on validation)"
    ]


def warn_pooled(table: Table, keys: list[str], preset: bool = False) -> None:
    """Say on stderr when a cell averages runs that differ in more than the seed (`keys`
    aside: the rows' and columns', or a preset's layout and settings)."""
    differ: dict[str, set] = defaultdict(set)
    dup = 0
    for group in table.groups.values():
        if len(group) < 2:
            continue
        for k in varying_keys(group):
            if k not in keys and ALIASES.get(k) not in keys:
                differ[k].update(hashable(r.get(k)) for r in group)
        seeds = Counter(hashable(r.get("seed")) for r in group if not r.failed)
        dup += sum(c - 1 for c in seeds.values() if c > 1)
    for k, values in sorted(differ.items()):
        shown = ", ".join(sorted(format_value(v) for v in values))
        fix = "" if preset else "add it to --rows/--cols, "
        print(
            f"fedbench-report: warning: cells pool runs that differ in {k} ({shown}); "
            f"{fix}pick one with --filter {k}=VALUE or the best per cell with --best-of {k}",
            file=sys.stderr,
        )
    if dup:
        print(
            f"fedbench-report: warning: {dup} run(s) repeat a seed of their cell (each is counted)",
            file=sys.stderr,
        )


# --------------------------------------------------------------------------- cell texts
def number(table: Table, metric: str | None, x: float) -> str:
    if metric is not None and is_accuracy(metric):
        x *= table.scale
    return f"{x:.{table.digits}f}"


def cell_text(table: Table, i: int, j: int, stat: str, pm: str = " ± ", dash=MISSING) -> str:
    key = (table.rows[i], table.cols[j], stat)
    if key in table.texts:
        return table.texts[key]
    metric = table.metric.get((table.rows[i], stat))
    if metric is None:
        return ""
    cell = table.cell(i, j, stat)
    status = cell.status
    if status != "ok":
        return {"missing": dash, "failed": FAILED, "n/a": NA}[status]
    text = number(table, metric, cell.mean)
    if cell.std is not None:
        text += pm + number(table, metric, cell.std)
    notes = []
    if cell.n != table.typical_n:
        notes.append(f"n={cell.n}")
    if cell.failed:
        notes.append(f"{cell.failed} failed")
    notes += table.cell_notes.get(key, [])
    text += f" ({', '.join(notes)})" if notes else ""
    suffix = table.cell_suffix.get(key)
    return f"{text} {suffix}" if suffix else text


def paper_text(table: Table, i: int, j: int, stat: str, pm: str = " ± ", dash=MISSING) -> str:
    p = (table.paper or {}).get((table.rows[i], table.cols[j], stat))
    if p is None:
        return dash
    return p.value + (pm + p.std if p.std else "")


def grid(table: Table, pm: str = " ± ", dash: str = MISSING):
    """(headers, body rows, number of label columns, span of each table column): a header
    is a (top, sub) pair, sub = 'ours' / 'paper' beside the paper's numbers and '' else;
    body rows are lists of strings, a row's stats on consecutive rows."""
    with_paper = table.paper is not None
    multi = len(table.stats) > 1
    nlab = len(table.row_keys) + multi
    span = 2 if with_paper else 1
    heads = [(k, "") for k in [*table.row_keys, *(["stat"] if multi else [])]]
    for j in range(len(table.cols)):
        top = table.col_label(j)
        heads += [(top, "ours"), (top, "paper")] if with_paper else [(top, "")]
    body = []
    for i in range(len(table.rows)):
        for s, stat in enumerate(table.stats):
            labels = list(table.row_label(i)) if s == 0 else [""] * len(table.row_keys)
            line = labels + ([table.stat_label(stat)] if multi else [])
            for j in range(len(table.cols)):
                line.append(cell_text(table, i, j, stat, pm, dash))
                if with_paper:
                    line.append(paper_text(table, i, j, stat, pm, dash))
            body.append(line)
    return heads, body, nlab, span


def _columns(heads: list[tuple[str, str]], span: int):
    return pd.MultiIndex.from_tuples(heads) if span > 1 else [h[0] for h in heads]


def legend_lines(table: Table) -> list[str]:
    """The legend under a table: the marks, how its round was chosen, what else it says."""
    return [LEGEND, *select_legend(table.select), *table.legend]


# --------------------------------------------------------------------------- formats
def to_terminal(table: Table) -> str:
    heads, body, nlab, span = grid(table)
    df = pd.DataFrame(body, columns=range(len(heads)), dtype=object)
    # pandas right-aligns; the labels are left-aligned (values and header padded to one
    # width), and every column gets a second space of gap before it
    for k in range(len(heads)):
        top, sub = heads[k]
        if k < nlab:
            width = max(len(top), *(len(t) for t in df[k])) if len(df) else len(top)
            df[k] = [t.ljust(width + 1) for t in df[k]]
            heads[k] = (top.ljust(width + 1), sub)
        else:
            df[k] = [" " + t for t in df[k]]
            heads[k] = (" " + top, " " + sub if sub else "")
    df.columns = _columns(heads, span)
    lines = [line.rstrip() for line in df.to_string(index=False).splitlines()]
    nhead = 2 if span > 1 else 1
    head, rest = lines[:nhead], lines[nhead:]
    out = [table.title, "", *head, "─" * max(len(line) for line in lines)]
    multi = len(table.stats) > 1
    for n, line in enumerate(rest):
        if multi and n and n % len(table.stats) == 0:
            out.append("")
        out.append(line)
    out.append("")
    out += [*legend_lines(table), *table.notes]
    return "\n".join(out) + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(table: Table) -> str:
    heads, body, nlab, _ = grid(table)
    header = [f"{top} {sub}" if sub else top for top, sub in heads]
    df = pd.DataFrame(
        [[_md_escape(t) for t in row] for row in body], columns=range(len(header)), dtype=object
    )
    lines = [f"**{table.title}**", ""]
    lines.append("| " + " | ".join(_md_escape(h) for h in header) + " |")
    lines.append("|" + "|".join(":---" if k < nlab else "---:" for k in range(len(header))) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in df.itertuples(index=False)]
    legend = legend_lines(table)
    lines += ["", f"{legend[0]}.", *legend[1:], ""]
    lines += [f"  - {n.strip()}" if n.startswith("  ") else f"- {n}" for n in table.notes]
    return "\n".join(lines) + "\n"


_TEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "—": "---",
    "±": r"$\pm$",
}


def tex_escape(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in text)


def to_latex(table: Table) -> str:
    """pandas' `to_latex` (booktabs rules; the paper's (ours, paper) pairs under one
    centered header), with a \\cmidrule under each pair and space between rows' stats."""
    heads, body, nlab, span = grid(table)
    df = pd.DataFrame(
        [[tex_escape(t) for t in row] for row in body], columns=range(len(heads)), dtype=object
    )
    df.columns = _columns([(tex_escape(t), tex_escape(s)) for t, s in heads], span)
    ncols = len(heads)
    tex = df.to_latex(
        index=False,
        escape=False,
        column_format="l" * nlab + "r" * (ncols - nlab),
        multicolumn=True,
        multicolumn_format="c",
    ).splitlines()
    out = ["% fedbench-report; needs \\usepackage{booktabs}", f"% {tex_escape(table.title)}"]
    mid = tex.index("\\midrule")
    if span > 1:  # a rule under each column's (ours, paper) pair
        rules = " ".join(
            f"\\cmidrule(lr){{{nlab + span * j + 1}-{nlab + span * (j + 1)}}}"
            for j in range(len(table.cols))
        )
        tex.insert(mid - 1, rules)
        mid += 1
    out += tex[: mid + 1]
    multi = len(table.stats) > 1
    for n, line in enumerate(tex[mid + 1 : mid + 1 + len(body)]):
        if multi and n and n % len(table.stats) == 0:
            out.append("\\addlinespace")
        out.append(line)
    out += tex[mid + 1 + len(body) :]
    out += [f"% {tex_escape(n)}" for n in [*legend_lines(table), *table.notes]]
    return "\n".join(out) + "\n"


def tidy(table: Table) -> pd.DataFrame:
    """One line per (row, column, stat) with the unrounded mean and std in the table's
    unit (percent unless --fraction), n, failed runs, status (and the paper's, and what
    --best-of and --reference add)."""
    col_keys = table.col_keys or ["column"]
    extra = list(dict.fromkeys(k for d in table.csv_extra.values() for k in d))
    records = []
    for i, rv in enumerate(table.rows):
        for j, cv in enumerate(table.cols):
            cvals = [format_value(v) for v in cv] if table.col_keys else [table.col_label(j)]
            for stat in table.stats:
                metric = table.metric.get((rv, stat))
                if metric is None:
                    continue
                cell = table.cell(i, j, stat)
                k = table.scale if is_accuracy(metric) else 1.0
                rec = dict(zip(table.row_keys, table.row_label(i)))
                rec.update(zip(col_keys, cvals))
                rec.update(stat=table.stat_label(stat), metric=metric, select=table.select)
                rec.update(
                    mean=np.nan if cell.mean is None else cell.mean * k,
                    std=np.nan if cell.std is None else cell.std * k,
                    n=cell.n,
                    failed=cell.failed,
                    status=cell.status,
                )
                if table.paper is not None:
                    p = table.paper.get((rv, cv, stat))
                    rec.update(paper=p.value if p else "", paper_std=(p.std or "") if p else "")
                rec.update(table.csv_extra.get((rv, cv, stat), {}))
                records.append([rec.get(c) for c in [*_tidy_head(table, col_keys), *extra]])
    return pd.DataFrame(records, columns=[*_tidy_head(table, col_keys), *extra])


def _tidy_head(table: Table, col_keys: list[str]) -> list[str]:
    head = [*table.row_keys, *col_keys, "stat", "metric", "select", "mean", "std", "n"]
    head += ["failed", "status"]
    return head + (["paper", "paper_std"] if table.paper is not None else [])


def to_csv(table: Table) -> str:
    """The tidy frame as CSV (numbers unrounded: 10 significant digits)."""
    return tidy(table).to_csv(index=False, lineterminator="\n", float_format="%.10g")


RENDER = {"terminal": to_terminal, "markdown": to_markdown, "latex": to_latex, "csv": to_csv}
EXTENSION = {"terminal": "txt", "markdown": "md", "latex": "tex", "csv": "csv"}


def _short_title(table: Table) -> str:
    """A table's name in a CSV of several: its title up to the first ' (' or ':'."""
    return table.title.split(" (", 1)[0].split(":", 1)[0]


def render(table: Table, fmt: str) -> str:
    """The table in `fmt`, its sections after it (CSV: one frame, a `table` column saying
    whose line each is)."""
    if fmt not in RENDER:
        raise ReportError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if not table.sections:
        return RENDER[fmt](table)
    if fmt == "csv":
        frames = [tidy(t).assign(table=_short_title(t)) for t in (table, *table.sections)]
        frame = pd.concat(frames, ignore_index=True)
        return frame.to_csv(index=False, lineterminator="\n", float_format="%.10g")
    return "\n".join(RENDER[fmt](t) for t in (table, *table.sections))


def values_of(table: Table, row: Any, col: Any, stat: str) -> Cell:
    """The cell at row/column key values (plain values or tuples): for tests and scripts."""
    rv = row if isinstance(row, tuple) else (row,)
    cv = col if isinstance(col, tuple) else (col,)
    return table.cells.get((rv, cv, stat), Cell())
