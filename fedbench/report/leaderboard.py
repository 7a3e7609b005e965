"""`fedbench-report DIR --preset leaderboard`: every algorithm on the named federations,
each with its tuned values, over several seeds (scripts/leaderboard.sh; docs/leaderboard.md).

A run belongs to the cell of its algorithm and its federation (`+federation=<name>`, read from
the run's Hydra choices). The report prints:

- the overview: per algorithm, each federation's personalized test accuracy at the table's
  round (the validation-selected one by default: `--select`), mean ± std over seeds, with the
  algorithm's rank there (by that mean), and its average rank over the blocks of the Friedman
  test; sorted by average rank. Under it the Friedman test and Nemenyi's critical difference
  (fedbench/report/ranking.py). The blocks are the (federation, seed) pairs every ranked
  algorithm ran: a seed draws its own split and data of the federation, so each is one draw of
  that federation; the test's population is these federations' draws, not federated learning
  at large;
- per federation, sorted by accuracy: the accuracy, its bottom 5% of clients, the global
  model's accuracy where the algorithm has one, seconds and MB per round, the paired
  difference from FedAvg and from Local (per seed, with its 95% interval: compare.py), and
  the values of the searched keys the runs used (conf/search/<algo>.yaml; `tuned=<federation>`
  or not);
- per federation with source-paper tables of its kind (PAPER_SETTINGS), beside the papers:
  each method's accuracy there and here, as differences from training alone (Local, the
  papers' Separate), the one reference every paper and this board share;
- figures (--plots, --html): the critical-difference diagram (cd.png) and accuracy against
  communication and time (tradeoff.png: every method in the legend, each panel's Pareto
  front labelled).

An algorithm without a personalized model is scored by its global model (marked). Seconds
per round are the runs' CPU time over their rounds (training and evaluation, summary.json's
cpu_time_s: the process's, every thread's); for a run that did not record it, the median of
its wall clock per round between metrics rows (see seconds_per_round). CPU time does not
count the turns of other processes on a shared machine, but depends on the machine, and
compares only runs made alike (the same threads).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import yaml

from fedbench.paths import CONF_DIR
from fedbench.report import ranking
from fedbench.report.collect import (
    ReportError,
    RunDir,
    format_value,
    hashable,
    selected,
    sort_key,
    when_text,
)
from fedbench.report.compare import default_method, paired_interval
from fedbench.report.paper_numbers import paper_csv
from fedbench.report.table import Cell, Table, failed_notes, seeds_phrase, tuning_notes

NAME = "leaderboard"
REFERENCES = (("fedavg", "FedAvg"), ("local", "Local"))
ALPHA = 0.05
COLUMNS = (
    ("acc", "acc"),
    ("bottom5", "bottom 5%"),
    ("global", "global"),
    ("s_round", "s / round"),
    ("mb_round", "MB / round"),
    ("vs_fedavg", "vs FedAvg"),
    ("vs_local", "vs Local"),
    ("tuned", "values"),
)
PERCENT = ("acc", "bottom5", "global")


@dataclass(frozen=True)
class PaperSetting:
    """A paper table's column of the same kind of federation as a leaderboard one (the same
    data and kind of label skew; each paper on its own model, clients and budget)."""

    label: str
    csv: str  # in fedbench/report/paper_tables/
    dataset: str
    setting: str
    scale: float = 1.0  # to percent (FedPG prints fractions)


# The source papers' columns beside each federation ("beside the papers" table).
PAPER_SETTINGS: dict[str, tuple[PaperSetting, ...]] = {
    "fmnist_pat2": (
        PaperSetting("DiversiFed I: FMNIST pat-2", "diversifed_table1.csv", "FMNIST", "pat2"),
        PaperSetting("FedPG 1: FMNIST pat-2 (L)", "fedpg_table1.csv", "FMNIST", "pat2;L", 100.0),
    ),
    "fmnist_dir03": (
        PaperSetting("DiversiFed II: FMNIST Dir 0.1", "diversifed_table2.csv", "FMNIST", "dir0.1"),
        PaperSetting("DiversiFed II: FMNIST Dir 0.5", "diversifed_table2.csv", "FMNIST", "dir0.5"),
    ),
}
LOCAL_NAMES = ("separate", "local")  # the papers' names for training alone


def paper_algo(name: str) -> str:
    """A paper's method name as a registry key: lower case, letters and digits only
    ("FedMGDA+" -> fedmgda, "S-FedPG" -> sfedpg, "Separate" -> local); a variant with
    settings in its name ("FedPG (gamma=0.3)") maps to no key."""
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    return "local" if key in LOCAL_NAMES else key


def paper_values(setting: PaperSetting) -> dict[str, float]:
    """algo -> the paper's accuracy in % for one column (accuracy rows only)."""
    out = {}
    for r in paper_csv(setting.csv):
        if (r["dataset"], r["setting"], r["metric"]) == (setting.dataset, setting.setting, "acc"):
            out[paper_algo(r["method"])] = float(r["value"]) * setting.scale
    return out


# --------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RunValues:
    """What one finished run contributes (accuracies as fractions)."""

    seed: Any
    kind: str  # the model its accuracy is of: personal, or global without personal models
    acc: float | None
    bottom5: float | None
    glob: float | None
    s_round: float | None
    mb_round: float | None


def _number(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def run_values(run: RunDir, select: str) -> RunValues:
    kind = "personal"
    acc = selected(run, "personal.L.avg", select)[1]
    if acc is None and selected(run, "personal.L.avg", "last")[1] is None:
        kind = "global"  # no personalized model at all (not: no validation round)
        acc = selected(run, "global.L.avg", select)[1]
    summary = run.summary or {}
    mb = _number((summary.get("size") or {}).get("comm_MB"))
    if mb is None and run.metrics is not None and "comm_MB" in run.metrics:
        mb = (
            _number(run.metrics["comm_MB"].dropna().iloc[-1])
            if run.metrics["comm_MB"].notna().any()
            else None
        )
    return RunValues(
        seed=hashable(run.get("seed")),
        kind=kind,
        acc=acc,
        bottom5=selected(run, f"{kind}.L.bottom5", select)[1],
        glob=selected(run, "global.L.avg", select)[1],
        s_round=seconds_per_round(run),
        mb_round=mb,
    )


def seconds_per_round(run: RunDir) -> float | None:
    """CPU seconds per round where the run recorded them (summary.json's cpu_time_s: what the
    run cost whatever else shared the machine); else the median over its metrics.csv rows of
    wall seconds per round between two rows, so that a pause (a suspended job, another
    process on its core) moves one interval, not the figure; else wall_time_s / rounds."""
    summary = run.summary or {}
    rounds = _number(summary.get("rounds"))
    cpu = _number(summary.get("cpu_time_s"))
    if cpu is not None and rounds:
        return cpu / rounds
    m = run.metrics
    if m is not None and {"round", "wall_time_s"} <= set(m.columns):
        rows = m[["round", "wall_time_s"]].dropna().drop_duplicates("round").sort_values("round")
        dr, dt = rows["round"].diff().iloc[1:], rows["wall_time_s"].diff().iloc[1:]
        rates = (dt[dr > 0] / dr[dr > 0]).tolist()
        if rates:
            return float(statistics.median(rates))
    wall = _number(summary.get("wall_time_s"))
    return None if wall is None or not rounds else wall / rounds


@cache
def searched_keys(algo: str) -> tuple[str, ...]:
    """The keys of the algorithm's search space (conf/search/<algo>.yaml), () if none."""
    try:
        params = yaml.safe_load((CONF_DIR / "search" / f"{algo}.yaml").read_text())
        return tuple(params["hydra"]["sweeper"]["params"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return ()


def _resolved(run: RunDir, key: str, depth: int = 0) -> Any:
    """The run's value of `key`, a plain `${other.key}` reference followed (the saved config
    keeps the YAML's: personal_epochs: ${local_epochs})."""
    value = run.get(key)
    if isinstance(value, str) and value.startswith("${") and value.endswith("}") and depth < 5:
        ref = value[2:-1]
        if ref and all(c.isalnum() or c in "._" for c in ref):
            return _resolved(run, ref, depth + 1)
    return value


def _short(key: str) -> str:
    return key.split(".", 1)[1] if key.startswith(("optim.", "algo.")) else key


# --------------------------------------------------------------------------- cells
@dataclass
class Group:
    """The runs of one (algorithm, federation)."""

    runs: list[RunDir]
    values: list[RunValues]

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.runs)

    def seeds(self, field_: str) -> dict[Any, float]:
        """field's value per seed (runs repeating a seed: their mean)."""
        acc: dict[Any, list[float]] = defaultdict(list)
        for v in self.values:
            x = getattr(v, field_)
            if x is not None:
                acc[v.seed].append(x)
        return {s: float(np.mean(xs)) for s, xs in acc.items()}

    def cell(self, field_: str, scale: float = 1.0) -> Cell:
        per = self.seeds(field_)
        seeds = sorted(per, key=sort_key)
        values = [per[s] * scale for s in seeds]
        return Cell(
            values=values,
            seeds=seeds,
            failed=self.failed,
            absent=sum(1 for v in self.values if getattr(v, field_) is None),
            mean=float(np.mean(values)) if values else None,
            std=float(np.std(values, ddof=1)) if len(values) > 1 else None,
        )

    def kinds(self) -> set[str]:
        return {v.kind for v in self.values if v.acc is not None}

    def tuned_text(self, algo: str, federation: str) -> str:
        """The searched keys' values the runs used; whether tuned=<federation> gave them."""
        done = [r for r in self.runs if not r.failed]
        if not done:
            return "—"
        parts = []
        for key in searched_keys(algo):
            vals = {hashable(_resolved(r, key)) for r in done}
            shown = format_value(vals.pop()) if len(vals) == 1 else "varies"
            parts.append(f"{_short(key)}={shown}")
        tuned = {r.get("tuned") for r in done}
        text = " ".join(parts) or "—"
        if tuned != {federation}:
            text = f"{text} (not tuned={federation})"
        return text


def _pct(x: float | None, digits: int) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}"


def _mean_std(cell: Cell, digits: int, std: bool = True) -> str:
    if cell.mean is None:
        return "failed" if cell.failed else "n/a"
    text = f"{cell.mean:.{digits}f}"
    return text + (f" ± {cell.std:.{digits}f}" if std and cell.std is not None else "")


# --------------------------------------------------------------------------- the preset
def federation_of(run: RunDir) -> str | None:
    f = run.get("federation")
    return None if f in (None, "", "null") else str(f)


def describe(run: RunDir) -> str:
    """'fmnist pat classes_per_client=2, 20 clients, 50% per round, 100 rounds, val 10%'."""
    split = str(run.get("split"))
    detail = {
        "pat": f" {run.get('split.classes_per_client')} classes/client",
        "dir": f" alpha={format_value(run.get('split.alpha'))}",
    }.get(split, "")
    part = run.get("participation")
    val = _number(run.get("split.val_frac")) or 0
    return (
        f"{run.get('data')} {split}{detail}, {run.get('clients')} clients, "
        f"{format_value(part)} per round, {run.get('model')}, {run.get('rounds')} rounds, "
        f"validation {100 * val:g}% of train"
    )


@dataclass(frozen=True)
class Ranking:
    algos: list[str]  # ranked, best first
    blocks: list[tuple[str, Any]]  # (federation, seed)
    test: ranking.Friedman | None
    left_out: dict[str, list[tuple[str, Any]]]  # algo -> the blocks it lacks


def rank(groups: dict[tuple[str, str], Group], algos: list[str], feds: list[str]) -> Ranking:
    """Average ranks over the (federation, seed) blocks that every ranked algorithm has;
    an algorithm lacking a block (a failed or missing run) is left out of the ranking, not
    the block (a shared set of runs is what the test needs)."""
    per = {
        a: {(f, s): v for f in feds for s, v in groups.get((a, f), _EMPTY).seeds("acc").items()}
        for a in algos
    }
    blocks = sorted({b for p in per.values() for b in p}, key=lambda b: (b[0], sort_key(b[1])))
    ranked = [a for a in algos if all(b in per[a] for b in blocks)]
    left_out = {a: [b for b in blocks if b not in per[a]] for a in algos if a not in ranked}
    if len(ranked) < 2 or len(blocks) < 1:
        return Ranking(sorted(ranked), blocks, None, left_out)
    scores = np.array([[per[a][b] for a in ranked] for b in blocks])
    avg = ranking.block_ranks(scores).mean(axis=0)
    mean = scores.mean(axis=0)  # equal average ranks: the higher mean accuracy first
    order = sorted(range(len(ranked)), key=lambda j: (avg[j], -mean[j], ranked[j]))
    test = ranking.friedman(scores) if len(blocks) >= 2 else None
    if test is not None:  # in the ranking's order
        test = ranking.Friedman(
            **{**test.__dict__, "avg_ranks": tuple(float(avg[j]) for j in order)}
        )
    return Ranking([ranked[j] for j in order], blocks, test, left_out)


_EMPTY = Group([], [])


@dataclass(frozen=True)
class LeaderboardPreset:
    """The leaderboard as a `fedbench-report --preset` (the interface of presets.Preset)."""

    name: str = NAME
    title: str = "Leaderboard: the algorithms on named federations, several seeds"
    select: str = "val"

    def build(
        self,
        runs: list[RunDir],
        select: str | None = None,
        compact: bool = False,
        best_of: Any = None,
        digits: int = 2,
    ) -> tuple[Table, list[RunDir]]:
        if best_of is not None:
            raise ReportError(
                "--best-of: the leaderboard's values are chosen per method by its study "
                "(tuned=<federation>); drop --best-of"
            )
        select = select or self.select
        by_cell: dict[tuple[str, str], list[RunDir]] = defaultdict(list)
        unmatched = []
        for r in runs:
            fed, algo = federation_of(r), r.get("algo")
            if fed is None or algo is None:
                unmatched.append(r)
            else:
                by_cell[(str(algo), fed)].append(r)
        if not by_cell:
            raise ReportError(
                "--preset leaderboard: no run of a named federation (+federation=<name>, "
                "scripts/leaderboard.sh)"
            )
        groups = {
            k: Group(rs, [run_values(r, select) for r in rs if not r.failed])
            for k, rs in by_cell.items()
        }
        feds = sorted({f for _, f in groups})
        algos = sorted({a for a, _ in groups})
        ranks = rank(groups, algos, feds)
        order = ranks.algos + sorted(a for a in algos if a not in ranks.algos)
        overview = self._overview(groups, order, feds, ranks, select, digits)
        overview.sections = [self._federation(groups, algos, fed, select, digits) for fed in feds]
        overview.sections += [
            t for fed in feds if (t := self._papers(groups, fed, select, digits)) is not None
        ]
        overview.notes += self._notes(groups, ranks, unmatched, feds)
        overview.figures = [
            ("cd", lambda: draw_cd(ranks)),
            ("tradeoff", lambda: draw_tradeoff(groups, feds, digits)),
        ]
        return overview, unmatched

    # ------------------------------------------------------------------ tables
    def _overview(self, groups, order, feds, ranks: Ranking, select, digits) -> Table:
        rows = [(a,) for a in order]
        cols = [(f,) for f in feds] + [("avg rank",)]
        table = Table(
            title="",
            row_keys=["method"],
            col_keys=["federation"],
            rows=rows,
            cols=cols,
            stats=["acc"],
            metric={(r, "acc"): "personal.L.avg" for r in rows},
            cells={},
            groups={((a,), (f,)): g.runs for (a, f), g in groups.items()},
            select=select,
            digits=digits,
            col_labels=[*feds, "avg rank"],
        )
        fed_rank = {f: _ranks_by_mean(groups, order, f) for f in feds}
        avg = dict(zip(ranks.algos, ranks.test.avg_ranks)) if ranks.test else {}
        if ranks.test is None and len(ranks.algos) >= 2:  # one block: its ranks
            avg = _single_block_ranks(groups, ranks)
        for a in order:
            for f in feds:
                g = groups.get((a, f))
                if g is None:
                    continue
                cell = g.cell("acc")
                table.cells[((a,), (f,), "acc")] = cell
                notes = [f"#{fed_rank[f][a]}"] if a in fed_rank[f] else []
                if g.kinds() == {"global"}:
                    notes.append("global model")
                if notes:
                    table.cell_notes[((a,), (f,), "acc")] = notes
            r = avg.get(a)
            table.texts[((a,), ("avg rank",), "acc")] = "—" if r is None else f"{r:.2f}"
            table.csv_extra[((a,), ("avg rank",), "acc")] = {"avg_rank": r}
            for f in feds:
                if a in fed_rank[f]:
                    table.csv_extra[((a,), (f,), "acc")] = {"rank": fed_rank[f][a]}
        table.title = (
            f"{self.title}: personalized test accuracy at the {when_text(select)} "
            f"(accuracy in %{seeds_phrase(table)}); #n: rank on the federation, avg rank: "
            "over the (federation, seed) blocks"
        )
        return table

    def _federation(self, groups, algos, fed: str, select: str, digits: int) -> Table:
        present = [a for a in algos if (a, fed) in groups]
        means = {a: groups[(a, fed)].cell("acc").mean for a in present}
        present.sort(key=lambda a: (means[a] is None, -(means[a] or 0.0), a))
        rows = [(a,) for a in present]
        cols = [(label,) for _, label in COLUMNS]
        table = Table(
            title="",
            row_keys=["method"],
            col_keys=["column"],
            rows=rows,
            cols=cols,
            stats=["value"],
            metric={(r, "value"): "leaderboard" for r in rows},
            cells={},
            groups={},
            select=select,
            digits=digits,
            col_labels=[label for _, label in COLUMNS],
        )
        method = default_method()
        refs = {key: groups.get((key, fed)) for key, _ in REFERENCES}
        for a in present:
            g = groups[(a, fed)]
            for field_, label in COLUMNS:
                key = ((a,), (label,), "value")
                if field_ in ("acc", "bottom5", "global", "s_round", "mb_round"):
                    name = "glob" if field_ == "global" else field_
                    cell = g.cell(name, 100.0 if field_ in PERCENT else 1.0)
                    table.cells[key] = cell
                    table.texts[key] = _mean_std(cell, digits)
                    if field_ in ("s_round", "mb_round") and cell.mean is not None:
                        table.texts[key] = f"{cell.mean:.{digits}f}"
                    if field_ == "acc" and g.kinds() == {"global"}:
                        table.texts[key] += " (global model)"
                elif field_ == "tuned":
                    text = g.tuned_text(a, fed)
                    table.texts[key] = text
                    table.csv_extra[key] = {"values": text}
                else:
                    ref_algo = "fedavg" if field_ == "vs_fedavg" else "local"
                    table.texts[key], extra = _difference(g, refs[ref_algo], a == ref_algo,
                                                          method, digits)  # fmt: skip
                    table.csv_extra[key] = extra
        first = next((r for (a, f), g in groups.items() if f == fed for r in g.runs
                      if not r.failed), None)  # fmt: skip
        where = f" ({describe(first)})" if first is not None else ""
        n = {len(groups[(a, fed)].values) for a in present}
        seeds = f"{max(n)} seeds" if len(n) == 1 else f"{min(n)}-{max(n)} seeds"
        table.title = (
            f"{fed}{where}: at the {when_text(select)}, mean ± std over {seeds}; accuracy "
            "in %, bottom 5% of clients, global model, s and MB per round, the paired "
            "difference from FedAvg and Local in points [95% interval] (* excludes 0), and "
            "the searched keys' values"
        )
        how = (
            "paired t-test over seeds, scipy"
            if method == "t"
            else "paired bootstrap over seeds (scipy not installed)"
        )
        table.notes.append(f"vs FedAvg / vs Local: {how}; '—' where a seed has no pair")
        runs = [r for (a, f), g in groups.items() if f == fed for r in g.runs if not r.failed]
        cpu = sum("cpu_time_s" in (r.summary or {}) for r in runs)
        table.notes.append(
            "s / round: CPU seconds per round (summary.json's cpu_time_s over the rounds: "
            "what a run costs whatever else shared the machine)"
            + ("" if cpu == len(runs) else f"; {len(runs) - cpu} of {len(runs)} runs recorded "
               "no CPU time: for them the median over their metrics rows of wall seconds per "
               "round (a pause moves one interval, not the median)")
        )  # fmt: skip
        return table

    def _papers(self, groups, fed: str, select: str, digits: int) -> Table | None:
        """Each method's accuracy and its difference from training alone (Local, the papers'
        Separate) in the source papers' tables of the same kind of federation, beside ours:
        a sign the papers and this board share, or not. None without such a table."""
        settings = PAPER_SETTINGS.get(fed, ())
        papers = [(st, paper_values(st)) for st in settings]
        present = [a for a, f in groups if f == fed]
        rows_algos = [a for a in present if any(a in v for _, v in papers)]
        if not rows_algos:
            return None
        means = {a: groups[(a, fed)].cell("acc").mean for a in rows_algos}
        rows_algos.sort(key=lambda a: (means[a] is None, -(means[a] or 0.0), a))
        labels = [st.label for st, _ in papers] + [f"here: {fed}"]
        table = Table(
            title="",
            row_keys=["method"],
            col_keys=["source"],
            rows=[(a,) for a in rows_algos],
            cols=[(lab,) for lab in labels],
            stats=["value"],
            metric={((a,), "value"): "personal.L.avg" for a in rows_algos},
            cells={},
            groups={},
            select=select,
            digits=digits,
            col_labels=labels,
        )
        method = default_method()
        local = groups.get(("local", fed))
        for a in rows_algos:
            for (_st, values), lab in zip(papers, labels):
                key = ((a,), (lab,), "value")
                if a not in values:
                    table.texts[key] = "—"
                    continue
                v = values[a]
                ref = values.get("local")
                diff = None if ref is None or a == "local" else v - ref
                table.texts[key] = f"{v:.{digits}f}" + (
                    "" if diff is None else f" ({diff:+.{digits}f})"
                )
                table.csv_extra[key] = {"acc": v, "vs_local": diff}
            key = ((a,), (labels[-1],), "value")
            cell = groups[(a, fed)].cell("acc", 100.0)
            text = _mean_std(cell, digits, std=False)
            extra: dict[str, Any] = {"acc": cell.mean}
            if a != "local" and local is not None:
                _, d = _difference(groups[(a, fed)], local, False, method, digits)
                extra.update(d)
                if "diff" in d:
                    text += f" ({d['diff']:+.{digits}f}{'*' if d.get('significant') else ''})"
            if groups[(a, fed)].kinds() == {"global"}:
                text += " (global model)"
            table.texts[key] = text
            table.csv_extra[key] = extra
        table.title = (
            f"{fed} beside the papers: accuracy in % (its difference from Local, the papers' "
            "Separate, in points) in the source papers' tables of the same data and kind of "
            f"label skew, and here (mean over seeds at the {when_text(select)}; * the paired "
            "95% interval excludes 0)"
        )
        table.notes.append(
            "each paper on its own model, clients, rounds and hyperparameters (DiversiFed's "
            "FMNIST: an MLP with 64 hidden units, 40 clients, 500 rounds of E = 10 with Adam; "
            "FedPG's: an MLP 784-200-200-10, 2000 rounds, L = each client's own test set) and "
            "one number per method; FedAvg there is the global model (DiversiFed) or as good as "
            "Local (FedPG), here FedAvg's fine-tuned personal models: compare the differences "
            "from Local, not from FedAvg"
        )
        return table

    def _notes(self, groups, ranks: Ranking, unmatched, feds) -> list[str]:
        notes = []
        t = ranks.test
        if t is not None:
            cd = t.cd(ALPHA)
            verdict = "differ" if t.p_ff < ALPHA else "do not differ significantly"
            notes.append(
                f"Friedman test over N={t.n} blocks ({', '.join(feds)} x seeds) and k={t.k} "
                f"methods: chi2_F={t.chi2:.2f} (p={t.p_chi2:.3g}), Iman-Davenport "
                f"F_F={t.ff:.2f} with ({t.df1}, {t.df2}) df (p={t.p_ff:.3g}): the methods "
                f"{verdict} at {ALPHA:g} (Demšar, JMLR 2006)"
            )
            notes.append(
                f"Nemenyi post-hoc test: average ranks at least CD={cd:.2f} apart differ "
                f"significantly at {ALPHA:g} (q_alpha={ranking.q_alpha(t.k, ALPHA):.3f}); "
                "cd.png draws the groups with no significant difference inside"
            )
        elif len(ranks.algos) >= 2:
            notes.append(f"one block ({len(ranks.blocks)}): ranks only, no test (run more seeds)")
        for a, missing in sorted(ranks.left_out.items()):
            shown = ", ".join(f"{f} seed {format_value(s)}" for f, s in missing[:6])
            notes.append(f"{a}: not ranked, no finished run for {shown}")
        untuned = sorted(
            {a for (a, f), g in groups.items()
             if any(r.get("tuned") != f for r in g.runs if not r.failed)}
        )  # fmt: skip
        if untuned:
            notes.append(
                "runs not at their federation's tuned values (tuned=<federation>): "
                + ", ".join(untuned)
            )
        if unmatched:
            notes.append(
                f"{len(unmatched)} run(s) of no named federation (+federation=<name>) left out"
            )
        runs = [r for g in groups.values() for r in g.runs]
        stub = Table("", [], [], [], [], [], {}, {}, {("", ""): runs})
        return notes + failed_notes(stub) + tuning_notes(stub)


def _ranks_by_mean(groups, algos, fed) -> dict[str, int]:
    """1 = the highest mean accuracy on `fed` (equal means share the better rank)."""
    means = {a: groups[(a, fed)].cell("acc").mean for a in algos if (a, fed) in groups}
    means = {a: m for a, m in means.items() if m is not None}
    ordered = sorted(means.values(), reverse=True)
    return {a: ordered.index(m) + 1 for a, m in means.items()}


def _single_block_ranks(groups, ranks: Ranking) -> dict[str, float]:
    ((fed, seed),) = ranks.blocks
    scores = np.array([[groups[(a, fed)].seeds("acc")[seed] for a in ranks.algos]])
    return dict(zip(ranks.algos, ranking.block_ranks(scores)[0]))


def _difference(g: Group, ref: Group | None, is_ref: bool, method: str, digits: int):
    """The paired difference in points, as a cell text and its CSV columns."""
    if is_ref:
        return "(reference)", {}
    if ref is None:
        return "—", {}
    a, b = g.seeds("acc"), ref.seeds("acc")
    common = sorted(set(a) & set(b), key=sort_key)
    iv = paired_interval([a[s] - b[s] for s in common], method)
    if iv.pairs == 0:
        return "—", {"pairs": 0}
    extra = {
        "diff": 100 * iv.mean,
        "diff_low": None if iv.low is None else 100 * iv.low,
        "diff_high": None if iv.high is None else 100 * iv.high,
        "pairs": iv.pairs,
        "significant": iv.significant if iv.pairs > 1 else None,
    }
    text = f"{100 * iv.mean:+.{digits}f}"
    if iv.pairs == 1:
        return text + " (1 seed)", extra
    text += f" [{100 * iv.low:.{digits}f}, {100 * iv.high:.{digits}f}]"
    return text + ("*" if iv.significant else ""), extra


# --------------------------------------------------------------------------- figures
def draw_cd(ranks: Ranking):
    """The critical-difference diagram (Demšar's Figure 1): the average ranks on an axis
    (1 = best, left), each method's name tied to its rank, a bar over each group of
    methods whose ranks differ by less than CD (no significant difference inside), and
    the CD itself above the axis. None without a test."""
    from matplotlib.figure import Figure

    t = ranks.test
    if t is None:
        return None
    names, avg = ranks.algos, list(t.avg_ranks)
    k = len(names)
    cd = t.cd(ALPHA)
    groups = ranking.cliques(avg, cd)
    half = math.ceil(k / 2)
    step = 0.32  # inches per label line
    height = 1.3 + step * (half + 1) + 0.12 * len(groups)
    fig = Figure(figsize=(10, height), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0.5 - 0.35 * k, k + 0.5 + 0.35 * k)
    top, bottom = 0.0, -(0.3 + 0.12 * len(groups) + step * (half + 1))
    ax.set_ylim(bottom, 0.9)
    ax.axis("off")
    ax.plot([1, k], [top, top], color="black", lw=1.2)
    for r in range(1, k + 1):
        ax.plot([r, r], [top, top + 0.08], color="black", lw=1)
        if k <= 20 or r % 5 == 0 or r in (1, k):
            ax.text(r, top + 0.12, str(r), ha="center", va="bottom", fontsize=8)
    ax.plot([1, 1 + cd], [0.55, 0.55], color="black", lw=2)
    ax.text(1 + cd / 2, 0.6, f"CD = {cd:.2f}", ha="center", va="bottom", fontsize=9)
    for n, (i, j) in enumerate(groups):  # bars: no significant difference inside
        y = -0.15 - 0.12 * n
        ax.plot(
            [avg[i] - 0.05, avg[j] + 0.05], [y, y], color="tab:red", lw=3, solid_capstyle="round"
        )
    y0 = -0.3 - 0.12 * len(groups)
    for idx, (name, r) in enumerate(zip(names, avg)):
        left = idx < half
        line = idx if left else k - 1 - idx
        y = y0 - step * line
        x_end = 0.5 - 0.05 * k if left else k + 0.5 + 0.05 * k
        ax.plot([r, r, x_end], [top, y, y], color="0.35", lw=0.8)
        ax.text(x_end + (-0.1 if left else 0.1), y, f"{name} ({r:.2f})",
                ha="right" if left else "left", va="center", fontsize=8)  # fmt: skip
    fig.suptitle(
        f"average ranks over {t.n} blocks; methods joined by a bar do not differ "
        f"significantly (Nemenyi, alpha {ALPHA:g})",
        fontsize=10,
    )
    return fig


def pareto(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names whose (cost, accuracy) no other point beats: none as cheap or cheaper that
    is more accurate, nor cheaper and as accurate. Cheapest first."""
    front, best = [], -math.inf
    for name, (_cost, acc) in sorted(points.items(), key=lambda kv: (kv[1][0], -kv[1][1], kv[0])):
        if acc > best:
            front.append(name)
            best = acc
    return front


def _label_without_overlap(fig, ax, names: list[str], points: dict[str, tuple[float, float]]):
    """Annotate `names` in order, each only where its label overlaps no label placed before
    (a crowded cluster of 40 methods would otherwise be unreadable; the legend names every
    point)."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for name in names:
        text = ax.annotate(name, points[name], textcoords="offset points", xytext=(4, 3),
                           fontsize=7)  # fmt: skip
        box = text.get_window_extent(renderer).expanded(1.05, 1.1)
        if any(box.overlaps(b) for b in placed):
            text.remove()
        else:
            placed.append(box)


def draw_tradeoff(groups: dict[tuple[str, str], Group], feds: list[str], digits: int):
    """Accuracy against MB per round and against seconds per round, one row of panels per
    federation: a point per algorithm (mean over seeds, bar ± std of the accuracy), each
    method with its own colour and marker (the legend), and the methods on each panel's
    Pareto front (no method cheaper and more accurate) labelled on the plot."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter

    algos = sorted({a for a, _ in groups})
    fig = Figure(figsize=(12, 4.6 * len(feds) + 0.25 * math.ceil(len(algos) / 8) + 0.4),
                 layout="constrained")  # fmt: skip
    FigureCanvasAgg(fig)  # a renderer to measure the labels with
    axes = fig.subplots(len(feds), 2, squeeze=False)
    cmap = colormaps["tab20"]
    style = {a: (cmap(i % cmap.N), "osD^v"[(i // cmap.N) % 5]) for i, a in enumerate(algos)}
    shown: set[str] = set()
    panels = []
    for row, fed in zip(axes, feds):
        for ax, field_, label in zip(
            row, ("mb_round", "s_round"), ("MB per round", "seconds per round")
        ):
            none: list[str] = []
            points: dict[str, tuple[float, float]] = {}
            for a in algos:
                g = groups.get((a, fed))
                if g is None:
                    continue
                acc, x = g.cell("acc", 100.0), g.cell(field_)
                if acc.mean is None or x.mean is None:
                    continue
                if x.mean <= 0:  # Local sends nothing: no place on a log axis
                    none.append(a)
                    continue
                color, marker = style[a]
                ax.errorbar(x.mean, acc.mean, yerr=acc.std or 0.0, fmt=marker, ms=5,
                            color=color, capsize=2)  # fmt: skip
                points[a] = (x.mean, acc.mean)
                shown.add(a)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # no crowded labels inside a decade
            if none:
                ax.text(0.01, 0.01, f"not shown (0): {', '.join(none)}", transform=ax.transAxes,
                        fontsize=7, va="bottom")  # fmt: skip
            ax.set_xlabel(f"{label} (log scale)")
            ax.set_ylabel("personalized accuracy (%)")
            ax.set_title(f"{fed}: labelled, the Pareto front", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            panels.append((ax, points))
    if not shown:
        return None
    handles = [
        Line2D([], [], color=style[a][0], marker=style[a][1], linestyle="", label=a)
        for a in algos
        if a in shown
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=8, fontsize=7, frameon=False)
    fig.suptitle("accuracy against communication and time (mean over seeds; bar: ± std)",
                 fontsize=11)  # fmt: skip
    fig.draw_without_rendering()  # the final layout, before the labels are measured
    for ax, points in panels:
        _label_without_overlap(fig, ax, pareto(points), points)
    return fig
