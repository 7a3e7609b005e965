"""Choosing and comparing cells: the best value of a grid per cell (`--best-of`) and
differences from a reference row, paired by seed (`--reference`).

**Best of a grid.** The papers tune a hyperparameter per method and report the best value
only (FedPG: "the best learning rate of {0.01, 0.05, 0.1} per method"). `BestOf(key, by)`
keeps, in every (row, column) cell, the runs of the value of `key` whose mean over seeds of
the metric `by` (at the table's selection round) is best, and notes which value it chose.
The default criterion is FedPG's: the personalized model's (L + S + G) / 3.

**Paired differences.** Runs that share a seed share their split (and their sampling of
clients), so two rows of a column are compared seed by seed: the mean of the per-seed
differences and its 95% interval, from a paired t-test (scipy, when installed) or else a
paired bootstrap (10,000 resamples of the differences, a fixed seed). A difference is
marked significant when its interval excludes 0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from fedbench.report.collect import (
    RUN_METRICS,
    ReportError,
    format_value,
    has_validation,
    hashable,
    is_accuracy,
    on_validation,
    parse_value,
    same_value,
    selected,
    sort_key,
)
from fedbench.report.table import Cell, Table, when

DEFAULT_BEST_BY = "personal.LSG"  # FedPG's criterion, on the test sets: without validation
VAL_BEST_BY = "personal.V.avg"  # the criterion where every run has validation sets
RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
LEVEL = 0.95
_LOWER_IS_BETTER = re.compile(r"loss|time|bytes|_MB$|^comm|^params")


def lower_is_better(metric: str) -> bool:
    """Losses, times, sizes and traffic: the best value is the lowest."""
    return not is_accuracy(metric) and (
        metric in RUN_METRICS or bool(_LOWER_IS_BETTER.search(metric))
    )


def describe(metric: str) -> str:
    """The metric with what it is, for legends: personal.LSG is not a metrics.csv column."""
    if metric.endswith(".LSG"):
        kind = metric.split(".", 1)[0]
        what = "personalized" if kind == "personal" else kind
        return f"{metric} ((L.avg + S.avg + G.avg) / 3 of the {what} model)"
    return metric


# --------------------------------------------------------------------------- best of a grid
def default_best_by(runs: list) -> str:
    """--best-of's criterion when --best-by is not given: the validation accuracy where
    every finished run has validation sets, else FedPG's (L + S + G) / 3 (test sets)."""
    done = [r for r in runs if not r.failed]
    return VAL_BEST_BY if done and all(has_validation(r) for r in done) else DEFAULT_BEST_BY


@dataclass(frozen=True)
class BestOf:
    """In every cell, only the runs of the best value of `key` by the mean over seeds of
    `by` (highest; lowest for losses, times and sizes; a tie goes to the value first in
    sort order). Values none of whose runs has `by` are not candidates; a cell without a
    candidate keeps all its runs."""

    key: str
    by: str = DEFAULT_BEST_BY

    @property
    def short(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    def apply(self, table: Table) -> None:
        """Replace table.groups by the chosen runs; note the choice in each cell (its first
        stat), in the CSV (a column named by the key, and `best_by` = the criterion), in the
        legend, and every value's criterion under the table."""
        lower = lower_is_better(self.by)
        grid = sorted(
            {hashable(r.get(self.key)) for g in table.groups.values() for r in g}, key=sort_key
        )
        k = table.scale if is_accuracy(self.by) else 1.0
        chosen_groups, lines = {}, []
        rpos = {rv: i for i, rv in enumerate(table.rows)}
        cpos = {cv: j for j, cv in enumerate(table.cols)}
        order = sorted(table.groups, key=lambda g: (rpos.get(g[0], 1 << 30), cpos.get(g[1], 0)))
        for rv, cv in order:
            runs = table.groups[(rv, cv)]
            frame = pd.DataFrame(
                {
                    "value": [grid.index(hashable(r.get(self.key))) for r in runs],
                    "score": [
                        np.nan if r.failed else selected(r, self.by, table.select)[1] for r in runs
                    ],
                    "failed": [r.failed for r in runs],
                }
            )
            frame["score"] = pd.to_numeric(frame["score"], errors="coerce").astype(float)
            per_value = frame.groupby("value").agg(
                mean=("score", "mean"), n=("score", "count"), failed=("failed", "sum")
            )
            scored = per_value.dropna(subset=["mean"])
            if scored.empty:  # no value has the criterion: the cell shows what its runs are
                chosen_groups[(rv, cv)] = runs
                continue
            best = int(scored["mean"].idxmin() if lower else scored["mean"].idxmax())
            chosen_groups[(rv, cv)] = [r for r, v in zip(runs, frame["value"]) if int(v) == best]
            value = format_value(grid[best])
            first = next((s for s in table.stats if table.metric.get((rv, s))), None)
            if first is not None:
                table.cell_notes.setdefault((rv, cv, first), []).append(f"{self.short}={value}")
            for stat in table.stats:
                table.csv_extra.setdefault((rv, cv, stat), {}).update(
                    {self.key: value, "best_by": float(scored.loc[best, "mean"]) * k}
                )
            parts, nmax = [], int(per_value["n"].max())
            for v, row in per_value.iterrows():
                mean, n, failed = row["mean"], int(row["n"]), int(row["failed"])
                text = "-" if math.isnan(mean) else f"{mean * k:.{table.digits}f}"
                text += "*" if v == best else ""
                extra = ([f"n={n}"] if n != nmax else []) + ([f"{failed} failed"] if failed else [])
                text += f" ({', '.join(extra)})" if extra else ""
                parts.append(f"{format_value(grid[int(v)])}: {text}")
            lines.append(f"  {_where(table, rv, cv)}: {'; '.join(parts)}")
        table.groups = chosen_groups
        sign = "lowest" if lower else "highest"
        table.legend.append(
            f"{self.short}=V: the {self.key} chosen per cell from "
            f"{{{', '.join(format_value(v) for v in grid)}}}: the one with the {sign} mean over "
            f"seeds of {describe(self.by)} at the {when(table.select)}; only its runs are "
            f"in the cell"
            + (
                ""
                if on_validation(self.by)
                else "; chosen on the test set, so OPTIMISTIC (runs with split.val_frac > 0 "
                f"are chosen by {VAL_BEST_BY})"
            )
        )
        if lines:
            unit = " in %" if k == 100 else ""
            table.notes.append(
                f"--best-of {self.key}: the mean over seeds of {self.by}{unit} per value "
                f"(* chosen):"
            )
            table.notes += lines


def _where(table: Table, rv: tuple, cv: tuple) -> str:
    row = " ".join(format_value(v) for v in rv)
    if not (table.col_keys or table.col_labels):
        return row
    try:
        col = table.col_label(table.cols.index(cv))
    except ValueError:
        col = " ".join(format_value(v) for v in cv)
    return f"{row} | {col}" if col else row


# --------------------------------------------------------------------------- paired tests
@dataclass(frozen=True)
class Interval:
    """The mean of paired differences with its 95% interval (None below 2 pairs)."""

    pairs: int
    mean: float | None
    low: float | None = None
    high: float | None = None
    p: float | None = None  # the t-test's two-sided p-value (None for the bootstrap)
    method: str = ""

    @property
    def significant(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)


def default_method() -> str:
    """'t' (paired t-test) with scipy installed, else 'bootstrap'."""
    try:
        import scipy.stats  # noqa: F401
    except ImportError:
        return "bootstrap"
    return "t"


def paired_interval(
    diffs: Any, method: str | None = None, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> Interval:
    """The mean of `diffs` (paired differences, one per seed) and its 95% interval: the
    t interval of a paired t-test (method 't', scipy), or the percentile interval of the
    mean over `resamples` bootstrap resamples of the differences (method 'bootstrap',
    numpy's default_rng(seed)). Equal differences: the interval is that value."""
    d = np.asarray(diffs, dtype=float)
    n = d.size
    if n == 0:
        return Interval(0, None)
    mean = float(d.mean())
    if n < 2:
        return Interval(n, mean)
    method = method or default_method()
    sd = float(d.std(ddof=1))
    if sd <= 1e-12 * max(1.0, abs(mean)):  # equal differences (up to rounding)
        p = (0.0 if mean else 1.0) if method == "t" else None
        return Interval(n, mean, mean, mean, p, method)
    if method == "t":  # the paired t-test: a one-sample t-test of the differences
        from scipy import stats

        se = sd / math.sqrt(n)
        half = float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * se
        p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
        return Interval(n, mean, mean - half, mean + half, p, method)
    if method == "bootstrap":
        rng = np.random.default_rng(seed)
        means = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
        tail = 100 * (1 - LEVEL) / 2
        low, high = np.percentile(means, [tail, 100 - tail])
        return Interval(n, mean, float(low), float(high), None, method)
    raise ValueError(f"unknown method {method!r}")


def per_seed(cell: Cell) -> pd.Series:
    """The cell's values by seed (runs repeating a seed: their mean)."""
    s = pd.Series(cell.values, index=pd.Index(cell.seeds, dtype=object), dtype=float)
    return s.groupby(level=0, dropna=False).mean()


def pair(cell: Cell, ref: Cell) -> np.ndarray:
    """cell - ref for the seeds both have, in seed order."""
    a, b = per_seed(cell), per_seed(ref)
    common = sorted(set(a.index) & set(b.index), key=sort_key)
    return np.array([a[s] - b[s] for s in common], dtype=float)


def find_row(table: Table, text: str) -> int:
    """The row `--reference TEXT` names: its label (the row key values, space-separated),
    exactly, else ignoring case, else (one row key) as a value ('0.1' = 0.1)."""
    labels = [" ".join(table.row_label(i)) for i in range(len(table.rows))]
    for match in (
        lambda i: labels[i] == text,
        lambda i: labels[i].lower() == text.lower(),
        lambda i: len(table.rows[i]) == 1 and same_value(table.rows[i][0], parse_value(text)),
    ):
        found = [i for i in range(len(table.rows)) if match(i)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            break
    shown = ", ".join(labels[:40]) + (", ..." if len(labels) > 40 else "")
    raise ReportError(f"--reference {text!r}: not one row of the table; rows: {shown}")


def compare_to(table: Table, reference: str, method: str | None = None) -> None:
    """Mark every cell's difference from the reference row's cell of its column and stat,
    paired by seed: '+1.20 [0.40, 2.00]*' after the cell (in the table's unit: percentage
    points for accuracies in %), CSV columns diff, diff_low, diff_high, p, pairs,
    significant, and a legend line."""
    method = method or default_method()
    r = find_row(table, reference)
    ref_row = table.rows[r]
    ref_name = " ".join(table.row_label(r))
    d = table.digits
    for i, rv in enumerate(table.rows):
        if i == r:
            continue
        for cv in table.cols:
            for stat in table.stats:
                metric = table.metric.get((rv, stat))
                cell = table.cells.get((rv, cv, stat))
                if metric is None or cell is None or not cell.values:
                    continue
                ref = table.cells.get((ref_row, cv, stat), Cell())
                iv = paired_interval(pair(cell, ref), method)
                k = table.scale if is_accuracy(metric) else 1.0
                if iv.pairs == 0:
                    text = "(no seed paired with the reference)"
                elif iv.pairs == 1:
                    text = f"{iv.mean * k:+.{d}f} (1 paired seed: no test)"
                else:
                    text = f"{iv.mean * k:+.{d}f} [{iv.low * k:.{d}f}, {iv.high * k:.{d}f}]"
                    text += "*" if iv.significant else ""
                table.cell_suffix[(rv, cv, stat)] = text
                table.csv_extra.setdefault((rv, cv, stat), {}).update(
                    diff=None if iv.mean is None else iv.mean * k,
                    diff_low=None if iv.low is None else iv.low * k,
                    diff_high=None if iv.high is None else iv.high * k,
                    p=iv.p,
                    pairs=iv.pairs,
                    significant=iv.significant if iv.pairs > 1 else None,
                )
    how = (
        "paired t-test over seeds, scipy"
        if method == "t"
        else f"paired bootstrap over seeds: percentiles of {RESAMPLES:,} resampled means, "
        f"seed {BOOTSTRAP_SEED}"
    )
    unit = "percentage points" if table.scale == 100 else "the table's unit"
    table.legend.append(
        f"+d [lo, hi]: the difference from {ref_name} (same column and stat) in {unit}, mean "
        f"over the seeds both have, with its 95% interval ({how}); * the interval excludes 0 "
        f"(significant at 5%); cells with fewer than 2 paired seeds say so"
    )
