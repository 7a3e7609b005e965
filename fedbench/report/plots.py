"""Figures of the runs behind a table, one panel per table column, one color per row:

- `curves.png`: the table's (first) metric against the round, mean over seeds with a
  band of ± one std (metrics.csv); markers at the evaluations when there are few, whole
  rounds on the axis (a run evaluated once is a point with its std as an error bar);
- `clients.png`: the distribution of per-client accuracy at the selected round, every
  seed's clients pooled: a violin with one dot per client (clients.csv);
- `lsg.png`: L, S and G accuracy of each row's personalized and global models side by
  side (each where the runs have it), mean over seeds with std error bars (the FedPG
  view: own test set, a mixture, the union of all);
- `partition_<run>.png`: the label distribution of each distinct split among the runs
  (`fedbench.report.partition`).

Figures are made with matplotlib's object API (`Figure`, rendered by Agg): no pyplot, no
global backend state, nothing shown on screen.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedbench.report.collect import (
    ACC_SETS,
    SETS,
    ReportError,
    RunDir,
    is_accuracy,
    selected,
    when_text,
    write_output,
)
from fedbench.report.partition import write_partition_plots
from fedbench.report.table import Table

DPI = 120
MARKERS_UP_TO = 30  # evaluations per curve drawn with markers


def write_plots(
    table: Table, out_dir: str | Path, warn: Callable[[str], None] | None = None
) -> list[Path]:
    """Write the figures that the table's metric and runs allow; return their paths. Each
    file is written whole or not at all; a folder or file that cannot be written is a
    ReportError (one line); a partition that cannot be read is a `warn` line."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create {out}: {e.strerror or e}") from None
    written = []
    extra = [(name, lambda _, draw=draw: draw()) for name, draw in table.figures]
    for name, draw in (("curves", _curves), ("clients", _clients), ("lsg", _lsg), *extra):
        fig = draw(table)
        if fig is not None:
            path = out / f"{name}.png"
            png = io.BytesIO()
            fig.savefig(png, format="png", dpi=DPI, bbox_inches="tight")
            write_output(path, png.getvalue())
            written.append(path)
    written += write_partition_plots(table.runs(), out, warn)
    return written


# --------------------------------------------------------------------------- helpers
def _panels(table: Table) -> list[int]:
    """Columns that have at least one finished run."""
    return [
        j
        for j, cv in enumerate(table.cols)
        if any(not r.failed for (_, c), g in table.groups.items() if c == cv for r in g)
    ]


def _finished(table: Table, i: int, j: int) -> list[RunDir]:
    return [r for r in table.groups.get((table.rows[i], table.cols[j]), []) if not r.failed]


def _metric(table: Table, i: int) -> str | None:
    return table.metric.get((table.rows[i], table.stats[0]))


def _figure(panels: list[int], title: str, width: float = 5.2):
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(width * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    return fig, axes


def _color(i: int, n: int):
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return cmap(i % cmap.N)


def _panel_title(table: Table, j: int) -> str:
    return table.col_label(j) if table.col_keys or table.col_labels else ""


def _kinds(table: Table) -> set[str]:
    return {m.split(".", 1)[0] for i in range(len(table.rows)) if (m := _metric(table, i))}


def _row_name(table: Table, i: int) -> str:
    """The row's label; with the model kind when rows show different models (DiversiFed's
    FedAvg column is its global model)."""
    name = " ".join(table.row_label(i))
    metric = _metric(table, i)
    if metric and len(_kinds(table)) > 1:
        name += f" ({metric.split('.', 1)[0]})"
    return name


def _scale(table: Table, metric: str) -> float:
    return table.scale if is_accuracy(metric) else 1.0


def _unit(table: Table, metric: str) -> str:
    """Axis label: the metric, without its model kind when rows show different kinds."""
    name = metric.split(".", 1)[1] if len(_kinds(table)) > 1 and "." in metric else metric
    return f"{name} (%)" if is_accuracy(metric) and table.scale == 100 else name


def _legend(fig: Figure, axes, title: str) -> None:
    handles: dict[str, object] = {}  # one entry per label over all panels
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="outside lower center",
            ncols=min(len(handles), 6),
            title=title,
            fontsize=9,
            frameon=False,
        )


# --------------------------------------------------------------------------- figures
def _curves(table: Table) -> Figure | None:
    panels = _panels(table)
    if not panels:
        return None
    what = ", ".join(sorted({m for i in range(len(table.rows)) if (m := _metric(table, i))}))
    fig, axes = _figure(panels, f"{what} over rounds (mean over seeds; band or bar: ± std)")
    dodge = 0.5 / max(len(table.rows), 1)  # one-evaluation points side by side
    drawn = False
    for ax, j in zip(axes, panels):
        rounds: set[int] = set()
        for i in range(len(table.rows)):
            metric = _metric(table, i)
            frames = [
                r.metrics[["round", metric]]
                for r in _finished(table, i, j)
                if metric and r.metrics is not None and metric in r.metrics
            ]
            if not frames:
                continue
            df = pd.concat(frames).dropna()
            if df.empty:
                continue
            k = _scale(table, metric)
            g = df.groupby("round")[metric]
            mean, std = g.mean() * k, g.std(ddof=1).fillna(0.0) * k
            color = _color(i, len(table.rows))
            name = _row_name(table, i)
            if len(mean) == 1:  # one evaluation: a point with its std, rows side by side
                x = mean.index + (i - (len(table.rows) - 1) / 2) * dodge
                ax.errorbar(x, mean.values, yerr=std.values, fmt="o", color=color, capsize=3,
                            label=name, ms=6)  # fmt: skip
            else:
                marker = "o" if len(mean) <= MARKERS_UP_TO else None
                ax.plot(mean.index, mean.values, color=color, label=name, lw=1.6,
                        marker=marker, ms=3.5)  # fmt: skip
                ax.fill_between(mean.index, mean - std, mean + std, color=color, alpha=0.2, lw=0)
            rounds.update(int(r) for r in mean.index)
            ax.set_ylabel(_unit(table, metric))
            drawn = True
        ax.set_title(_panel_title(table, j), fontsize=10)
        ax.set_xlabel("round")
        _round_axis(ax, rounds)
        ax.grid(alpha=0.3)
    if not drawn:
        return None
    _legend(fig, axes, " ".join(table.row_keys))
    return fig


def _round_axis(ax, rounds: set[int]) -> None:
    """Whole rounds only; the evaluated rounds themselves when few; room around one."""
    if not rounds:
        return
    lo, hi = min(rounds), max(rounds)
    if len(rounds) <= 8:
        ax.set_xticks(sorted(rounds))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    pad = 1.0 if lo == hi else max(0.3, 0.04 * (hi - lo))
    ax.set_xlim(lo - pad, hi + pad)


def _client_values(run: RunDir, metric: str, select: str) -> np.ndarray:
    """Per-client accuracies of `metric`'s model kind and set at the selected round."""
    kind, acc_set = metric.split(".")[:2]
    rnd, _ = selected(run, metric, select)
    c = run.clients
    if rnd is None or c is None or not {"round", "model", "metric", "value"} <= set(c.columns):
        return np.empty(0)
    sel = c[(c["round"] == rnd) & (c["model"] == kind) & (c["metric"] == acc_set)]
    return pd.to_numeric(sel["value"], errors="coerce").dropna().to_numpy(dtype=float)


def _is_client_metric(metric: str | None) -> bool:
    parts = (metric or "").split(".")
    return len(parts) == 3 and is_accuracy(metric) and parts[1] in ACC_SETS


def _clients(table: Table) -> Figure | None:
    panels = _panels(table)
    if not panels or not any(_is_client_metric(_metric(table, i)) for i in range(len(table.rows))):
        return None
    when = when_text(table.select)
    fig, axes = _figure(
        panels, f"per-client accuracy at the {when} (dots: clients of all seeds; line: mean)"
    )
    drawn = False
    rng = np.random.default_rng(0)
    for ax, j in zip(axes, panels):
        names, pos = [], 0
        for i in range(len(table.rows)):
            metric = _metric(table, i)
            if not _is_client_metric(metric):
                continue
            runs = _finished(table, i, j)
            vals = [_client_values(r, metric, table.select) for r in runs]
            v = np.concatenate(vals) * _scale(table, metric) if vals else np.empty(0)
            if v.size == 0:
                continue
            color = _color(i, len(table.rows))
            if v.size > 1 and np.ptp(v) > 0:
                parts = ax.violinplot([v], positions=[pos], widths=0.8, showextrema=False)
                for body in parts["bodies"]:
                    body.set_facecolor(color)
                    body.set_alpha(0.35)
            jitter = rng.uniform(-0.12, 0.12, v.size)
            ax.scatter(pos + jitter, v, s=7, color=color, alpha=0.8, lw=0)
            ax.hlines(v.mean(), pos - 0.3, pos + 0.3, color="black", lw=1.2)
            names.append(_row_name(table, i))
            kind, acc_set = metric.split(".")[:2]
            what = f"{acc_set} accuracy" + ("" if len(_kinds(table)) > 1 else f", {kind} model")
            ax.set_ylabel(what + (" (%)" if table.scale == 100 else ""))
            pos += 1
            drawn = True
        ax.set_xticks(
            range(len(names)),
            names,
            rotation=30 if len(names) > 4 else 0,
            ha="right" if len(names) > 4 else "center",
        )
        ax.set_title(_panel_title(table, j), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    return fig if drawn else None


LSG_KINDS = ("personal", "global")
SET_COLORS = {"L": "#4c72b0", "S": "#dd8452", "G": "#55a868"}


def _lsg(table: Table) -> Figure | None:
    """Per row, the personalized and the global model (each where the runs have it):
    three bars L, S, G each, the global model's hatched."""
    panels = _panels(table)
    if not panels or not any(_is_client_metric(_metric(table, i)) for i in range(len(table.rows))):
        return None
    stat = next(
        _metric(table, i).split(".")[2]
        for i in range(len(table.rows))
        if _is_client_metric(_metric(table, i))
    )
    fig, axes = _figure(
        panels, f"L / S / G {stat} accuracy, personalized and global model (mean ± std over "
        "seeds)", width=max(5.2, 1.0 + 1.1 * len(table.rows))
    )  # fmt: skip
    drawn = False
    width = 0.8 / len(SETS)
    pct = " (%)" if table.scale == 100 else ""
    for ax, j in zip(axes, panels):
        ticks, names, pos = [], [], 0.0
        for i in range(len(table.rows)):
            runs = _finished(table, i, j)
            if not runs:
                continue
            for kind in LSG_KINDS:
                bars = []
                for acc_set in SETS:
                    m = f"{kind}.{acc_set}.{stat}"
                    v = [x for r in runs if (x := selected(r, m, table.select)[1]) is not None]
                    bars.append(v)
                if not any(bars):
                    continue
                for s_, (acc_set, v) in enumerate(zip(SETS, bars)):
                    if not v:
                        continue
                    k = _scale(table, f"{kind}.{acc_set}.{stat}")
                    err = np.std(v, ddof=1) * k if len(v) > 1 else 0.0
                    ax.bar(
                        pos + (s_ - 1) * width,
                        np.mean(v) * k,
                        width,
                        yerr=err,
                        capsize=2,
                        color=SET_COLORS[acc_set],
                        hatch="//" if kind == "global" else None,
                        edgecolor="white" if kind == "global" else None,
                        lw=0,
                        label=f"{acc_set}" if kind == "personal" else f"{acc_set}, global",
                    )
                    drawn = True
                ticks.append(pos)
                names.append(f"{' '.join(table.row_label(i))}\n{kind}")
                pos += 1.0
            pos += 0.4  # a gap between rows
        ax.set_xticks(ticks, names, fontsize=8, rotation=30 if len(names) > 6 else 0,
                      ha="right" if len(names) > 6 else "center")  # fmt: skip
        ax.set_ylabel(f"accuracy, {stat}{pct}")
        ax.set_title(_panel_title(table, j), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if not drawn:
        return None
    _legend(fig, axes, "test set (hatched: the global model)")
    return fig
