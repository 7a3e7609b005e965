"""A results table: runs grouped into cells by config keys, a metric aggregated over the
seeds of each cell (mean ± sample std), rendered as terminal text, Markdown, LaTeX or CSV.

A `Table` is format-free data: row and column key values, one `Cell` per (row, column,
stat) and, for paper presets, the paper's printed number for the same cell. `build` makes
one from runs and `--rows/--cols/--metric`; `fedbench.report.presets` makes the paper
layouts; `render` writes any of them in any format.
"""

from __future__ import annotations

import csv
import io
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fedbench.report.collect import (
    ALIASES,
    ReportError,
    RunDir,
    format_value,
    hashable,
    is_accuracy,
    selected,
    sort_key,
    varying_keys,
)

FORMATS = ("terminal", "markdown", "latex", "csv")
MAX_DIGITS = 15  # decimals a table may print (float64 has ~16 significant digits)
SELECT = ("final", "best")
MISSING, FAILED, NA = "—", "failed", "n/a"
LEGEND = (
    f"{MISSING} no run; {FAILED}: every run of the cell stopped before writing summary.json "
    f"(or has unreadable files); {NA}: the runs have no such metric (e.g. no global model)"
)


@dataclass
class Cell:
    """The runs of one table cell for one metric."""

    values: list[float] = field(default_factory=list)  # one per finished run with the metric
    failed: int = 0  # runs that did not finish
    absent: int = 0  # finished runs without this metric

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        """Sample standard deviation over seeds (n - 1); None for a single run."""
        return statistics.stdev(self.values) if len(self.values) > 1 else None

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


@dataclass
class Table:
    title: str
    row_keys: list[str]  # names of the row label columns
    col_keys: list[str]
    rows: list[tuple]  # one tuple of values (of row_keys) per row
    cols: list[tuple]
    stats: list[str]  # what each cell shows, one sub-row each (metric names or avg/top5/...)
    metric: dict[tuple[tuple, str], str | None]  # (row, stat) -> metric read from the runs
    cells: dict[tuple[tuple, tuple, str], Cell]
    groups: dict[tuple[tuple, tuple], list[RunDir]]  # the runs behind each (row, column)
    select: str = "final"
    scale: float = 100.0  # accuracies are multiplied by this (100: percent)
    digits: int = 2
    paper: dict[tuple[tuple, tuple, str], PaperNumber] | None = None
    stat_labels: dict[str, str] | None = None  # sub-row labels (default: the stats)
    col_labels: list[str] | None = None  # headers (default: from the key values)
    notes: list[str] = field(default_factory=list)

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

    @cached_property
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


def fill(cell: Cell, runs: list[RunDir], metric: str, select: str) -> None:
    for run in runs:
        if run.failed:
            cell.failed += 1
            continue
        _, value = selected(run, metric, select)
        if value is None:
            cell.absent += 1
        else:
            cell.values.append(value)


def build(
    runs: list[RunDir],
    rows: list[str],
    cols: list[str],
    metrics: list[str],
    select: str = "final",
    scale: float = 100.0,
    digits: int = 2,
) -> Table:
    """Group `runs` by the values of `rows` and `cols` keys; every metric is a sub-row."""
    check_digits(digits)
    check_keys(rows + cols, runs)
    groups: dict[tuple[tuple, tuple], list[RunDir]] = defaultdict(list)
    for r in runs:
        groups[(key_of(r, rows), key_of(r, cols))].append(r)
    row_vals = sorted({k[0] for k in groups}, key=_tuple_order)
    col_vals = sorted({k[1] for k in groups}, key=_tuple_order)
    cells = {}
    for (rv, cv), group in groups.items():
        for m in metrics:
            cell = cells[(rv, cv, m)] = Cell()
            fill(cell, group, m, select)
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
        cells=cells,
        groups=dict(groups),
        select=select,
        scale=scale,
        digits=digits,
    )
    table.title += seeds_phrase(table)
    table.notes += failed_notes(table)
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
    when = "last evaluation" if select == "final" else "best round"
    unit = ", accuracy in %" if scale == 100 and any(is_accuracy(m) for m in metrics) else ""
    return f"{what} ({when}{unit})"


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


def warn_pooled(table: Table, keys: list[str]) -> None:
    """Say on stderr when a cell averages runs that differ in more than the seed."""
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
        print(
            f"fedbench-report: warning: cells pool runs that differ in {k} ({shown}); "
            f"add it to --rows/--cols or pick one with --filter {k}=VALUE",
            file=sys.stderr,
        )
    if dup:
        print(
            f"fedbench-report: warning: {dup} run(s) repeat a seed of their cell (each is counted)",
            file=sys.stderr,
        )


# --------------------------------------------------------------------------- formatting
def number(table: Table, metric: str | None, x: float) -> str:
    if metric is not None and is_accuracy(metric):
        x *= table.scale
    return f"{x:.{table.digits}f}"


def cell_text(table: Table, i: int, j: int, stat: str, pm: str = " ± ", dash=MISSING) -> str:
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
    return text + (f" ({', '.join(notes)})" if notes else "")


def paper_text(table: Table, i: int, j: int, stat: str, pm: str = " ± ", dash=MISSING) -> str:
    p = (table.paper or {}).get((table.rows[i], table.cols[j], stat))
    if p is None:
        return dash
    return p.value + (pm + p.std if p.std else "")


def grid(table: Table, pm: str = " ± ", dash: str = MISSING):
    """(header rows, body rows, number of label columns, span of each column).
    Body rows are lists of strings; a row's stats are consecutive rows."""
    with_paper = table.paper is not None
    multi = len(table.stats) > 1
    nlab = len(table.row_keys) + multi
    span = 2 if with_paper else 1
    head1 = [*table.row_keys, *(["stat"] if multi else [])]
    head1 += [table.col_label(j) for j in range(len(table.cols))]
    heads = [head1]
    if with_paper:
        heads.append([""] * nlab + ["ours", "paper"] * len(table.cols))
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


def to_terminal(table: Table) -> str:
    heads, body, nlab, span = grid(table)
    ncols = nlab + span * len(table.cols)
    widths = [0] * ncols
    for line in [heads[-1], *body] if span > 1 else [heads[0], *body]:
        for k, text in enumerate(line):
            widths[k] = max(widths[k], len(text))
    for k in range(nlab):
        widths[k] = max(widths[k], len(heads[0][k]))
    # a column label over its (ours, paper) pair may be wider than the pair
    for j in range(len(table.cols)):
        first = nlab + span * j
        need = len(heads[0][nlab + j]) - (sum(widths[first : first + span]) + 2 * (span - 1))
        if need > 0:
            widths[first + span - 1] += need
    gap = "  "

    def fmt(line: list[str]) -> str:
        out = [t.ljust(widths[k]) if k < nlab else t.rjust(widths[k]) for k, t in enumerate(line)]
        return gap.join(out).rstrip()

    lines = [table.title, ""]
    top = [h.ljust(widths[k]) for k, h in enumerate(heads[0][:nlab])]
    for j in range(len(table.cols)):
        first = nlab + span * j
        w = sum(widths[first : first + span]) + len(gap) * (span - 1)
        top.append(heads[0][nlab + j].center(w) if span > 1 else heads[0][nlab + j].rjust(w))
    lines.append(gap.join(top).rstrip())
    if span > 1:
        lines.append(fmt(heads[1]))
    lines.append(gap.join("─" * w for w in widths))
    multi = len(table.stats) > 1
    for n, line in enumerate(body):
        if multi and n and n % len(table.stats) == 0:
            lines.append("")
        lines.append(fmt(line))
    lines.append("")
    lines += [LEGEND, *table.notes]
    return "\n".join(lines) + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(table: Table) -> str:
    heads, body, nlab, span = grid(table)
    header = heads[0]
    if span > 1:
        subs = ("ours", "paper")
        header = header[:nlab] + [f"{h} {s}" for h in header[nlab:] for s in subs]
    lines = [f"**{table.title}**", ""]
    lines.append("| " + " | ".join(_md_escape(h) for h in header) + " |")
    lines.append("|" + "|".join(":---" if k < nlab else "---:" for k in range(len(header))) + "|")
    for line in body:
        lines.append("| " + " | ".join(_md_escape(t) for t in line) + " |")
    lines += ["", f"{LEGEND}.", ""]
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
    heads, body, nlab, span = grid(table, pm=" ± ", dash=MISSING)
    ncols = nlab + span * len(table.cols)
    lines = [
        "% fedbench-report; needs \\usepackage{booktabs}",
        f"% {tex_escape(table.title)}",
        f"\\begin{{tabular}}{{{'l' * nlab}{'r' * (ncols - nlab)}}}",
        "\\toprule",
    ]
    top = [tex_escape(h) for h in heads[0][:nlab]]
    rules = []
    for j in range(len(table.cols)):
        text = tex_escape(heads[0][nlab + j])
        if span > 1:
            first = nlab + span * j + 1
            top.append(f"\\multicolumn{{{span}}}{{c}}{{{text}}}")
            rules.append(f"\\cmidrule(lr){{{first}-{first + span - 1}}}")
        else:
            top.append(text)
    lines.append(" & ".join(top) + r" \\")
    if span > 1:
        lines.append(" ".join(rules))
        lines.append(" & ".join(tex_escape(h) for h in heads[1]) + r" \\")
    lines.append("\\midrule")
    multi = len(table.stats) > 1
    for n, line in enumerate(body):
        if multi and n and n % len(table.stats) == 0:
            lines.append("\\addlinespace")
        lines.append(" & ".join(tex_escape(t) for t in line) + r" \\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    lines += [f"% {tex_escape(n)}" for n in [LEGEND, *table.notes]]
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    """Tidy: one line per (row, column, stat) with the unrounded mean and std in the
    table's unit (percent unless --fraction), n, failed runs, status (and the paper's)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    col_keys = table.col_keys or ["column"]
    head = [*table.row_keys, *col_keys, "stat", "metric", "select", "mean", "std", "n", "failed"]
    head += ["status"] + (["paper", "paper_std"] if table.paper is not None else [])
    w.writerow(head)
    for i, rv in enumerate(table.rows):
        for j, cv in enumerate(table.cols):
            cvals = [format_value(v) for v in cv] if table.col_keys else [table.col_label(j)]
            for stat in table.stats:
                metric = table.metric.get((rv, stat))
                if metric is None:
                    continue
                cell = table.cell(i, j, stat)
                k = table.scale if is_accuracy(metric) else 1.0
                mean = "" if cell.mean is None else f"{cell.mean * k:.10g}"
                std = "" if cell.std is None else f"{cell.std * k:.10g}"
                line = [*table.row_label(i), *cvals, table.stat_label(stat), metric, table.select]
                line += [mean, std]
                line += [cell.n, cell.failed, cell.status]
                if table.paper is not None:
                    p = table.paper.get((rv, cv, stat))
                    line += [p.value if p else "", (p.std or "") if p else ""]
                w.writerow(line)
    return buf.getvalue()


RENDER = {"terminal": to_terminal, "markdown": to_markdown, "latex": to_latex, "csv": to_csv}
EXTENSION = {"terminal": "txt", "markdown": "md", "latex": "tex", "csv": "csv"}


def render(table: Table, fmt: str) -> str:
    if fmt not in RENDER:
        raise ReportError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    return RENDER[fmt](table)


def values_of(table: Table, row: Any, col: Any, stat: str) -> Cell:
    """The cell at row/column key values (plain values or tuples): for tests and scripts."""
    rv = row if isinstance(row, tuple) else (row,)
    cv = col if isinstance(col, tuple) else (col,)
    return table.cells.get((rv, cv, stat), Cell())
