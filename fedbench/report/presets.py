"""Paper presets: a results table laid out as the paper prints it, with the paper's own
number beside ours in every cell.

A preset names the paper's rows (methods, each a fedbench algorithm and the model kind its
cells show) and columns (each the config values a run must have to belong there), the
stats each cell prints (PLGU: avg, then its two tail numbers) and the selection rule. A run
lands in the cell whose row and column it matches; the paper's other settings (rounds,
clients, model, optimizer...) do not decide where a run goes, but where the runs of a cell
differ from them the table says so under it. Methods not implemented or not run show as
the missing mark beside the paper's number.

The paper numbers are read from `fedbench/report/paper_tables/`, which ships with the package
(a user's clone or install has only these): the papers' printed numbers, one CSV row per
number (format, sources and reading notes: docs/paper-tables.md; tests/test_report.py
checks that every file listed there ships, with its row count).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fedbench.report.collect import (
    ReportError,
    RunDir,
    format_value,
    has_validation,
    same_value,
    when_text,
)
from fedbench.report.paper_numbers import paper_csv
from fedbench.report.table import (
    PaperNumber,
    Table,
    failed_notes,
    fill_cells,
    seeds_phrase,
    tuning_notes,
    warn_pooled,
)


@dataclass(frozen=True)
class Row:
    label: str  # the method as the paper prints it (= `method` in the paper CSV)
    algo: str  # fedbench registry name
    kind: str = "personal"  # which model the cells show: personal | global
    settings: dict[str, Any] = field(default_factory=dict)  # the paper's algorithm settings


@dataclass(frozen=True)
class Column:
    label: str
    dataset: str  # `dataset` in the paper CSV
    setting: str  # `setting` in the paper CSV (without the stat suffix)
    match: dict[str, Any]  # config values a run must have to be in this column
    settings: dict[str, Any] = field(default_factory=dict)  # the paper's, noted where runs differ


@dataclass(frozen=True)
class Preset:
    name: str
    title: str
    csv: str  # file in fedbench/report/paper_tables/
    paper_metric: str  # `metric` in the paper CSV
    rows: tuple[Row, ...]
    columns: tuple[Column, ...]
    stats: tuple[str, ...] = ("avg",)  # L-accuracy stats each cell prints, one sub-row each
    select: str = "final"
    settings: dict[str, Any] = field(default_factory=dict)  # common to every column
    notes: tuple[str, ...] = ()
    stat_in_setting: bool = False  # PLGU: the CSV's setting ends in ;avg / ;top5 / ;bottom5

    def metric(self, row: Row, stat: str) -> str:
        return f"{row.kind}.L.{stat}"

    def paper_numbers(self) -> dict[tuple[str, str, str], PaperNumber]:
        """(method, column label, stat) -> the printed number."""
        recs = {
            (r["method"], r["dataset"], r["setting"]): r
            for r in paper_csv(self.csv)
            if r["metric"] == self.paper_metric
        }
        out = {}
        for row in self.rows:
            for col in self.columns:
                for stat in self.stats:
                    setting = f"{col.setting};{stat}" if self.stat_in_setting else col.setting
                    rec = recs.get((row.label, col.dataset, setting))
                    if rec is not None:
                        out[(row.label, col.label, stat)] = PaperNumber(
                            rec["value"], rec["std"] or None
                        )
        return out

    def build(
        self,
        runs: list[RunDir],
        select: str | None = None,
        compact: bool = False,
        best_of: Any = None,
        digits: int = 2,
    ) -> tuple[Table, list[RunDir]]:
        """The table, and the runs that fit no cell of it. `best_of` (a
        `fedbench.report.compare.BestOf`): in every cell only the runs of the best value of
        a grid key (FedPG: the best lr per method and column)."""
        select = select or self.select
        groups: dict[tuple[tuple, tuple], list[RunDir]] = defaultdict(list)
        unmatched = []
        for run in runs:
            row = self._row_of(run)
            col = next((c for c in self.columns if matches(run, c.match)), None)
            if row is None or col is None:
                unmatched.append(run)
            else:
                groups[((row.label,), (col.label,))].append(run)
        rows, cols = list(self.rows), list(self.columns)
        if compact and groups:
            rows = [r for r in rows if any(k[0] == (r.label,) for k in groups)]
            cols = [c for c in cols if any(k[1] == (c.label,) for k in groups)]
        paper = {((m,), (c,), s): p for (m, c, s), p in self.paper_numbers().items()}
        when = when_text(select)
        table = Table(
            title=f"{self.title} [{self.name}] ({when}, accuracy in %",
            row_keys=["method"],
            col_keys=["column"],
            rows=[(r.label,) for r in rows],
            cols=[(c.label,) for c in cols],
            stats=list(self.stats),
            metric={((r.label,), s): self.metric(r, s) for r in rows for s in self.stats},
            cells={},
            groups=dict(groups),
            select=select,
            paper=paper,
            col_labels=[c.label for c in cols],
            digits=digits,
        )
        if best_of is not None:
            best_of.apply(table)
        fill_cells(table)
        table.title += (seeds_phrase(table) or "") + ")"
        table.notes += [
            "ours: fedbench runs (algorithm names: "
            + ", ".join(f"{r.label}={r.algo}" for r in rows)
            + "); paper: the paper's printed numbers"
        ]
        table.notes += list(self.notes)
        table.notes += self.deviations(table.groups)
        table.notes += failed_notes(table)
        table.notes += tuning_notes(table)
        carved = sorted({r.get("split.val_frac") for r in table.runs() if has_validation(r)})
        if carved:
            table.notes.append(
                f"runs hold out split.val_frac={', '.join(format_value(v) for v in carved)} of "
                "their clients' training data as validation sets: they train on less than the "
                "paper's protocol"
            )
        if unmatched:
            table.notes += self.unmatched_note(unmatched)
        # a cell's runs may differ in what the paper fixes (deviations says how), not in
        # a setting of ours beyond the seed that the layout ignores (optim.lr of a grid)
        warn_pooled(table, self.layout_keys(), preset=True)
        return table, unmatched

    def layout_keys(self) -> list[str]:
        """The keys the layout places runs by, and the paper's settings (noted apart)."""
        keys = {"algo", *self.settings}
        for c in self.columns:
            keys.update(c.match, c.settings)
        for r in self.rows:
            keys.update(r.settings)
        return sorted(keys)

    def deviations(self, groups: dict[tuple[tuple, tuple], list[RunDir]]) -> list[str]:
        """Where the runs shown differ from the paper's settings (keys a run lacks are
        not counted: an algorithm setting can only differ in runs of that algorithm)."""
        ours: dict[str, set] = defaultdict(set)
        paper: dict[str, set] = defaultdict(set)
        for (rv, cv), group in groups.items():
            row, col = self._row(rv), next(c for c in self.columns if (c.label,) == cv)
            want = {**self.settings, **col.settings, **row.settings}
            for run in group:
                for k, v in want.items():
                    if k in run.config and not same_value(run.config[k], v):
                        ours[k].add(format_value(_plain(run.config[k])))
                        paper[k].add(format_value(_plain(v)))
        if not ours:
            return []
        parts = [
            f"{k} {'/'.join(sorted(ours[k]))} (paper {'/'.join(sorted(paper[k]))})"
            for k in sorted(ours)
        ]
        return ["these runs differ from the paper's settings: " + "; ".join(parts)]

    def unmatched_note(self, runs: list[RunDir]) -> list[str]:
        """Why runs fit no cell: their algorithm is in no row, or the column whose
        requirements they come closest to wants other values."""
        algos = {format_value(r.get("algo")) for r in runs if not self._row_of(r)}
        reasons: dict[str, set] = defaultdict(set)
        for r in runs:
            if not self._row_of(r):
                continue
            best = min(self.columns, key=lambda c: len(mismatches(r, c.match)))
            for k, want in mismatches(r, best.match):
                have = format_value(_plain(r.get(k)))
                reasons[k].add(f"{have} (needs {format_value(_plain(want))})")
        out = [f"{len(runs)} run(s) fit no cell of {self.name}:"]
        if algos:
            out.append(f"  algorithms not in this table: {', '.join(sorted(algos))}")
        for k, why in sorted(reasons.items()):
            out.append(f"  {k}: {', '.join(sorted(why))}")
        return out

    def _row_of(self, run: RunDir) -> Row | None:
        return next((r for r in self.rows if same_value(run.get("algo"), r.algo)), None)

    def _row(self, key: tuple) -> Row:
        return next(r for r in self.rows if (r.label,) == key)


def matches(run: RunDir, want: dict[str, Any]) -> bool:
    return not mismatches(run, want)


def mismatches(run: RunDir, want: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in want.items() if not same_value(run.get(k), v)]


def _plain(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


# --------------------------------------------------------------------------- the presets
# Paper method name -> fedbench registry name (conf/algo/<name>.yaml).
ALGO = {
    "FedAvg": "fedavg",
    "FedProx": "fedprox",
    "Separate": "local",
    "FedSAM": "fedsam",
    "Ditto": "ditto",
    "pFedMe": "pfedme",
    "FedRep": "fedrep",
    "pFedHN": "pfedhn",
    "PLGU-LF": "plgu_lf",
    "PLGU-GRep": "plgu_grep",
    "PLGU-GHN": "plgu_ghn",
    "Per-FedAvg": "perfedavg",
    "FedAMP": "fedamp",
    "FedFomo": "fedfomo",
    "APPLE": "apple",
    "FedProto": "fedproto",
    "FedRoD": "fedrod",
    "FedCAC": "fedcac",
    "DiversiFed": "diversifed",
}


def _rows(labels: str, kind: str = "personal", **row_settings: dict) -> tuple[Row, ...]:
    return tuple(Row(m, ALGO[m], kind, row_settings.get(ALGO[m], {})) for m in labels.split(", "))


# PLGU (CVPR 2023), docs/papers/plgu.md: 100 clients (TinyImageNet 20), pat with 3 / 10 /
# 30 classes per client, C clients per round, E = 5, batch 50, SGD lr 0.01 momentum 0.9 and
# 500 rounds (ours), ResNet-18 / WRN-28-10 / ResNet-50 with GroupNorm.
PLGU_SETTINGS = {
    "local_epochs": 5,
    "batch_size": 50,
    "optim.name": "sgd",
    "optim.lr": 0.01,
    "optim.momentum": 0.9,
    "rounds": 500,
}


def _plgu_columns() -> tuple[Column, ...]:
    data = [
        ("CIFAR10", "cifar10", 3, 100, "resnet18", (10, 100)),
        ("CIFAR100", "cifar100", 10, 100, "wrn28_10", (10, 100)),
        ("TmgNet", "tinyimagenet", 30, 20, "resnet50", (20,)),
    ]
    return tuple(
        Column(
            label=f"{name} C={c}",
            dataset=name,
            setting=f"C={c}",
            match={
                "data": data_name,
                "split": "pat",
                "split.classes_per_client": k,
                "per_round": c,
            },
            settings={"clients": n, "model": model, "model.norm": "group"},
        )
        for name, data_name, k, n, model, cs in data
        for c in cs
    )


PLGU_NOTES = (
    "PLGU prints each cell as the average over clients with the lowest and highest 5% "
    "beneath (read as bottom5, top5: docs/paper-tables.md); its rounds, lr and runs are "
    "not stated (ours: 500 rounds, SGD 0.01 momentum 0.9)",
)

# DiversiFed, docs/papers/diversifed.md: 40 clients all taking part, 500 rounds, E = 10,
# batch 100, Adam 1e-3, FMNIST 300 / CIFAR 500 train and 100 test samples per client.
DIVERSIFED_SETTINGS = {
    "clients": 40,
    "rounds": 500,
    "local_epochs": 10,
    "batch_size": 100,
    "optim.name": "adam",
    "optim.lr": 0.001,
    "optim.persist_state": False,
    "split.test_mode": "matched",
    "split.test_per_client": 100,
}
DIVERSIFED_DATA = {
    "FMNIST": ("fmnist", {"model": "mlp", "model.hidden": [64], "split.train_per_client": 300}),
    "CIFAR-10": (
        "cifar10",
        {"model": "cnn", "model.preset": "lenet", "split.train_per_client": 500},
    ),
    "CIFAR-100": (
        "cifar100",
        # PFLlib's resnet8 (1.26M parameters, Table VIII)
        {
            "model": "resnet8",
            "model.widths": [64, 128, 256],
            "model.stem": "imagenet",
            "split.train_per_client": 500,
        },
    ),
}
DIVERSIFED_METHODS = (
    "Separate, Per-FedAvg, pFedMe, FedAMP, FedFomo, APPLE, FedRep, FedProto, FedRoD, FedCAC, "
    "DiversiFed"
)
# FedAvg's column is its global model; pFedMe takes E epochs of mini-batches per visit (the
# code DiversiFed ran, PFLlib) and is scored by its personalized model theta_i (the paper's
# number is theta's, docs/reproduction/diversifed.md), FedRoD as PFLlib scores it
# (aggregated body and generic head, personal head); DiversiFed's tau is not stated for
# Tables I-III (ours 1.0). The presets set these (conf/paper_algo/diversifed/<algo>.yaml).
DIVERSIFED_ALGO_SETTINGS = {
    "pfedme": {"algo.eval_model": "theta", "algo.local_rounds": None},
    "fedrod": {"algo.eval_model": "aggregated"},
    "diversifed": {"algo.tau": 1.0},
}
DIVERSIFED_ROWS = (
    Row("FedAvg", "fedavg", "global"),
    *_rows(DIVERSIFED_METHODS, **DIVERSIFED_ALGO_SETTINGS),
)
DIVERSIFED_NOTES = (
    "DiversiFed: best accuracy over rounds, uniform mean over clients, mean ± std over 5 "
    "seeds; FedAvg's cells are its global model, every other method's its personalized "
    "model; the paper does not say which tau its Tables I-III use (ours 1.0)",
)


def _pat2(name: str, participation: float = 1.0, label: str | None = None) -> Column:
    data, settings = DIVERSIFED_DATA[name]
    setting = "pat2" if label is None else f"pat2;participation={label}"
    return Column(
        label=name if label is None else f"{name} {label}",
        dataset=name,
        setting=setting,
        match={
            "data": data,
            "split": "pat",
            "split.classes_per_client": 2,
            "participation": participation,
        },
        settings={**settings, "split.balance": True},
    )


def _dir(name: str, alpha: float) -> Column:
    data, settings = DIVERSIFED_DATA[name]
    return Column(
        label=f"{name} Dir({alpha})",
        dataset=name,
        setting=f"dir{alpha}",
        match={"data": data, "split": "dir", "split.alpha": alpha, "participation": 1.0},
        settings={**settings, "split.dir_mode": "per_client", "split.dir_prior": "ones"},
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="plgu_table1",
            title="PLGU Table 1: global model accuracy (avg, bottom 5%, top 5%)",
            csv="plgu_table1.csv",
            paper_metric="acc_global",
            rows=_rows("FedAvg, FedSAM, Ditto, pFedMe, PLGU-LF", kind="global"),
            columns=_plgu_columns(),
            stats=("avg", "bottom5", "top5"),
            settings=PLGU_SETTINGS,
            notes=PLGU_NOTES,
            stat_in_setting=True,
        ),
        Preset(
            name="plgu_table2",
            title="PLGU Table 2: personalized model accuracy (avg, bottom 5%, top 5%)",
            csv="plgu_table2.csv",
            paper_metric="acc_personalized",
            rows=_rows("Ditto, pFedMe, FedRep, pFedHN, PLGU-LF, PLGU-GRep, PLGU-GHN"),
            columns=_plgu_columns(),
            stats=("avg", "bottom5", "top5"),
            settings=PLGU_SETTINGS,
            notes=PLGU_NOTES,
            stat_in_setting=True,
        ),
        Preset(
            name="diversifed_table1",
            title="DiversiFed Table I: pathological non-IID (pat-2)",
            csv="diversifed_table1.csv",
            paper_metric="acc",
            rows=DIVERSIFED_ROWS,
            columns=tuple(_pat2(d) for d in DIVERSIFED_DATA),
            select="best",
            settings=DIVERSIFED_SETTINGS,
            notes=DIVERSIFED_NOTES,
        ),
        Preset(
            name="diversifed_table2",
            title="DiversiFed Table II: Dirichlet non-IID",
            csv="diversifed_table2.csv",
            paper_metric="acc",
            rows=DIVERSIFED_ROWS,
            columns=tuple(
                _dir(d, a)
                for d, alphas in (
                    ("FMNIST", (0.1, 0.5, 1.0)),
                    ("CIFAR-10", (0.1, 0.5, 1.0)),
                    ("CIFAR-100", (0.01, 0.1, 0.5)),
                )
                for a in alphas
            ),
            select="best",
            settings=DIVERSIFED_SETTINGS,
            notes=DIVERSIFED_NOTES,
        ),
        Preset(
            name="diversifed_table3",
            title="DiversiFed Table III: practical non-IID on PathMNIST (20 clients, 6/6/8)",
            csv="diversifed_table3.csv",
            paper_metric="acc",
            rows=DIVERSIFED_ROWS,
            columns=(
                Column(
                    label="PathMNIST",
                    dataset="PathMNIST",
                    setting="practical",
                    match={"data": "pathmnist", "split": "practical", "participation": 1.0},
                    settings={
                        "clients": 20,
                        "split.groups": 3,
                        "split.dominant_frac": 0.8,
                        "split.train_per_client": 500,
                        "model": "cnn",
                        "model.preset": "lenet",
                    },
                ),
            ),
            select="best",
            settings={**DIVERSIFED_SETTINGS, "clients": 20},
            notes=DIVERSIFED_NOTES,
        ),
        Preset(
            name="diversifed_table7",
            title="DiversiFed Table VII: partial participation, CIFAR-10 pat-2",
            csv="diversifed_table7.csv",
            paper_metric="acc",
            rows=(
                Row("FedAvg", "fedavg", "global"),
                *_rows(
                    "Per-FedAvg, pFedMe, FedAMP, FedFomo, APPLE, DiversiFed",
                    **DIVERSIFED_ALGO_SETTINGS,
                ),
            ),
            columns=tuple(_pat2("CIFAR-10", p / 100, f"{p}%") for p in (100, 90, 70, 50)),
            select="best",
            settings=DIVERSIFED_SETTINGS,
            notes=(
                *DIVERSIFED_NOTES,
                "the paper also prints each accuracy's change from the 100% column "
                "(acc_change_vs_100% in the CSV), left out here",
            ),
        ),
    )
}


# --------------------------------------------------------------------------- FedSLR
# FedSLR (Huang et al. 2023), docs/papers/fedslr.md: 100 clients, 10
# per round, ResNet-18 GroupNorm, SGD lr 0.1 decay 0.998, E = 2, batch 20, weight decay 1e-3
# for every method, 100 matched test samples per client. One FedSLR run fills two rows:
# its GKR (global model) and its mixed model GKR + p_i (personal).
FEDSLR_SETTINGS = {
    "clients": 100,
    "per_round": 10,
    "local_epochs": 2,
    "batch_size": 20,
    "optim.name": "sgd",
    "optim.lr": 0.1,
    "optim.lr_decay": 0.998,
    "optim.weight_decay": 0.001,
    "model": "resnet18",
    "model.norm": "group",
    "split.test_mode": "matched",
    "split.test_per_client": 100,
}
FEDSLR_DATA = (("CIFAR-10", "cifar10"), ("CIFAR-100", "cifar100"), ("TinyImagenet", "tinyimagenet"))
FEDSLR_GLOBAL = (("SCAFFOLD", "scaffold"), ("FedDyn", "feddyn"), ("FedAvg", "fedavg"))
FEDSLR_NOTES = (
    "FedSLR: the global methods' cells (SCAFFOLD, FedDyn, FedAvg, FedSLR (GKR)) are their "
    "global models, the others' their personalized models; FedSLR (GKR) and FedSLR (mixed) "
    "are the GKR and GKR + p_i of the same runs; rounds and number of runs are not stated "
    "(ours: 1000 rounds, the authors' code)",
)


def _fedslr_rows(table: int) -> tuple[Row, ...]:
    lg = "LGFedAvg" if table == 1 else "LG-FedAvg"
    if table == 1:
        glob = [Row(label, algo, "global") for label, algo in FEDSLR_GLOBAL]
        glob.append(Row("FedSLR (GKR)", "fedslr", "global"))
        pers = [
            ("Per-FedAvg", "perfedavg"),
            (lg, "lg_fedavg"),
            ("FedRep", "fedrep"),
            ("Ditto", "ditto"),
            ("APFL", "apfl"),
            ("Local", "local"),
            ("FedSpa", "fedspa"),
            ("FedSLR (mixed)", "fedslr"),
        ]
    else:
        glob = [
            Row("FedAvg (*)", "fedavg", "global"),
            Row("SCAFFOLD", "scaffold", "global"),
            Row("FedSLR (GKR)", "fedslr", "global"),
        ]
        pers = [
            ("APFL", "apfl"),
            ("FedSpa", "fedspa"),
            (lg, "lg_fedavg"),
            ("FedRep", "fedrep"),
            ("FedSLR (mixed)", "fedslr"),
        ]
    return (*glob, *(Row(label, algo, "personal") for label, algo in pers))


# Table 1's method names -> Table 2's
FEDSLR_T2_LABELS = {"FedAvg": ("FedAvg (*)",), "LGFedAvg": ("LG-FedAvg",)}


class _InRow:
    """A run shown in one named row (a FedSLR run is two rows: GKR and mixed)."""

    def __init__(self, run: RunDir, label: str) -> None:
        self._run = run
        self.row_label = label

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)


@dataclass(frozen=True)
class FedSLRPreset(Preset):
    """FedSLR's tables: a run belongs to every row of its algorithm; Table 2's cells show
    accuracy, the deployed model's parameters (M) and the communication per round (MB,
    uplink + downlink over the round's clients) from metrics.csv (`runner.size_columns`)."""

    stat_metrics: tuple[tuple[str, str], ...] = ()  # stat -> metric template ({kind})
    acc_csv: str = ""  # where the paper's accuracy of a table without one is printed

    def metric(self, row: Row, stat: str) -> str:
        templates = dict(self.stat_metrics)
        if stat in templates:
            return templates[stat].format(kind=row.kind)
        return super().metric(row, stat)

    def paper_numbers(self) -> dict[tuple[str, str, str], PaperNumber]:
        if not self.stat_metrics:
            return super().paper_numbers()
        recs = {(r["method"], r["dataset"], r["metric"]): r for r in paper_csv(self.csv)}
        if self.acc_csv:  # Table 2 prints no accuracy: Table 1's Dir(0.1) column of the method
            for r in paper_csv(self.acc_csv):
                if r["metric"] == "acc" and r["setting"] == "dir0.1":
                    for label in [r["method"], *FEDSLR_T2_LABELS.get(r["method"], ())]:
                        recs[(label, r["dataset"], "acc")] = r
        out = {}
        for row in self.rows:
            for col in self.columns:
                for stat in self.stats:
                    rec = recs.get((row.label, col.dataset, stat))
                    if rec is not None:
                        out[(row.label, col.label, stat)] = PaperNumber(
                            rec["value"], rec["std"] or None
                        )
        return out

    def build(
        self,
        runs: list[RunDir],
        select: str | None = None,
        compact: bool = False,
        best_of: Any = None,
        digits: int = 2,
    ):
        expanded: list[Any] = []
        for run in runs:
            rows = [r for r in self.rows if same_value(run.get("algo"), r.algo)]
            if len(rows) > 1:
                expanded += [_InRow(run, r.label) for r in rows]
            else:
                expanded.append(run)
        return super().build(expanded, select, compact, best_of, digits)

    def _row_of(self, run: RunDir) -> Row | None:
        label = getattr(run, "row_label", None)
        if label is not None:
            return self._row((label,))
        return super()._row_of(run)


def _fedslr_presets() -> tuple[Preset, ...]:
    t1_cols = tuple(
        Column(
            label=f"{name} {'IID' if split == 'iid' else 'Dir(0.1)'}",
            dataset=name,
            setting="iid" if split == "iid" else "dir0.1",
            match={
                "data": data,
                "split": split,
                **({"split.alpha": 0.1} if split == "dir" else {}),
            },
        )
        for name, data in FEDSLR_DATA
        for split in ("iid", "dir")
    )
    t2_cols = tuple(
        Column(
            label=f"{name} Dir(0.1)",
            dataset=name,
            setting="",
            match={"data": data, "split": "dir", "split.alpha": 0.1},
        )
        for name, data in FEDSLR_DATA
    )
    return (
        FedSLRPreset(
            name="fedslr_table1",
            title="FedSLR Table 1: top-1 accuracy, IID and Dir(0.1)",
            csv="fedslr_table1.csv",
            paper_metric="acc",
            rows=_fedslr_rows(1),
            columns=t1_cols,
            settings=FEDSLR_SETTINGS,
            notes=FEDSLR_NOTES,
        ),
        FedSLRPreset(
            name="fedslr_table2",
            title="FedSLR Table 2: accuracy, model size (# params, M) and communication "
            "(MB per round)",
            csv="fedslr_table2.csv",
            paper_metric="comm_cost",
            rows=_fedslr_rows(2),
            columns=t2_cols,
            stats=("acc", "params_M", "comm_cost"),
            acc_csv="fedslr_table1.csv",
            stat_metrics=(
                ("acc", "{kind}.L.avg"),
                ("params_M", "params_{kind}_M"),
                ("comm_cost", "comm_MB"),
            ),
            settings=FEDSLR_SETTINGS,
            notes=(
                *FEDSLR_NOTES,
                "Table 2: params_M = parameters of the deployed model (FedSLR (GKR): the GKR "
                "factorized per layer, min(rank (m + n), m n); FedSLR (mixed): GKR + nonzeros "
                "of p_i, mean over clients); comm_cost = uplink + downlink MB per round over "
                "the round's clients, averaged over the run (FedSLR: GKR sent factorized); "
                "the paper prints no accuracy in Table 2 (its acc beside ours is Table 1's "
                "Dir(0.1) column) and does not state the split (ours: Dir 0.1, whose FedSLR "
                "numbers equal its Tables 3-5 default rows)",
            ),
        ),
    )


PRESETS.update({p.name: p for p in _fedslr_presets()})


# --------------------------------------------------------------------------- FedPG
# FedPG appendix Tables 1-3 (docs/papers/fedpg.md): pat-2, 100 clients, 10% online (Table 2:
# 10/50/100%), batch 50, E = 5, 2000 rounds, SGD lr in {0.01, 0.05, 0.1} decay 0.999 (the best
# lr per method, scripts/reproduce_fedpg.sh). Every cell prints four numbers, one sub-row each:
# L, S, G of the personalized model (mean over honest clients) and GM, the global model's
# accuracy on the union of the test sets.
FEDPG_SETTINGS = {
    "clients": 100,
    "rounds": 2000,
    "local_epochs": 5,
    "batch_size": 50,
    "optim.name": "sgd",
    "optim.lr_decay": 0.999,
    "split.test_mode": "pooled",
}
FEDPG_DATA = {
    "FMNIST": ("fmnist", {"model": "mlp", "model.hidden": [200, 200]}),
    "CIFAR-10": ("cifar10", {"model": "cnn", "model.preset": "fedavg"}),
    "CIFAR-100": ("cifar100", {"model": "resnet18", "model.norm": "none"}),
}
FEDPG_AMP = {
    "algo.alpha_k": 0.005,
    "algo.sigma": 0.1,
    "algo.lam": 0.1,
    "algo.detach_prox": True,
}
FEDPG_ROWS = (
    Row("Local", "local"),
    Row("FedAvg", "fedavg"),
    Row("FedProx", "fedprox"),
    Row("APFL", "apfl", settings={"algo.alpha": 0.1, "algo.adaptive": True}),
    Row("pFedMe", "pfedme"),
    Row("Ditto", "ditto"),
    Row("FedAMP", "fedamp", settings=FEDPG_AMP),
    Row("FedFomo", "fedfomo", settings={"algo.m": None}),
    Row("FedRep", "fedrep"),
    Row("FedROD", "fedrod"),
    Row("SplitGP", "splitgp"),
    Row("FedMGDA+", "fedmgda"),
    Row("FedPG", "fedpg", settings={"algo.gamma": None}),
    Row("S-FedPG", "sfedpg", settings={"algo.gamma": None}),
    *(
        Row(f"FedPG (gamma={g})", "fedpg", settings={"algo.gamma": g})
        for g in ("0.3", "0.6", "1.0")
    ),
)
FEDPG_T3_ROWS = tuple(
    r
    for r in FEDPG_ROWS
    if r.label
    in (
        "FedAvg",
        "FedProx",
        "APFL",
        "pFedMe",
        "Ditto",
        "FedRep",
        "FedROD",
        "SplitGP",
        "FedMGDA+",
        "FedPG",
    )
)
FEDPG_NOTES = (
    "FedPG: L/S/G = the personalized model on the client's own test set, on the mix with "
    "other clients' test sets, on the global mix (mean over clients); GM = the global "
    "model on all test sets; the paper prints fractions (.989 = 98.9%) and the best lr of "
    "{0.01, 0.05, 0.1} per method, mean of 5 runs; FedAvg/FedProx/FedMGDA+'s personalized "
    "model is the local model after training (appendix L317); the FedPG gamma rows are "
    "algo=fedpg algo.gamma=g (RECONSTRUCTION of gamma's role: algo.gamma_mode=floor)",
)


@dataclass(frozen=True)
class FedPGPreset(Preset):
    """FedPG's tables: the sub-rows are L, S, G (personalized model) and GM (global model);
    rows of one algorithm are told apart by `algo.gamma` (the FedPG gamma rows)."""

    stats: tuple[str, ...] = ("L", "S", "G", "GM")
    stat_in_setting: bool = True

    def metric(self, row: Row, stat: str) -> str:
        return "global.all" if stat == "GM" else f"personal.{stat}.avg"

    def paper_numbers(self) -> dict[tuple[str, str, str], PaperNumber]:
        """The CSV's numbers; a method the paper prints without a GM (Local, FedAMP: "-",
        left out of the CSV) shows "-" as the paper does."""
        out = super().paper_numbers()
        for row in self.rows:
            for col in self.columns:
                if (row.label, col.label, "L") in out:
                    out.setdefault((row.label, col.label, "GM"), PaperNumber("-"))
        return out

    def _row_of(self, run: RunDir) -> Row | None:
        for r in self.rows:
            if not same_value(run.get("algo"), r.algo):
                continue
            if "algo.gamma" in r.settings and not same_value(
                run.get("algo.gamma"), r.settings["algo.gamma"]
            ):
                continue
            return r
        return None


def _fedpg_col(name: str, setting: str, label: str, **match: Any) -> Column:
    data, settings = FEDPG_DATA[name]
    return Column(
        label=label,
        dataset=name,
        setting=setting,
        match={"data": data, "split": "pat", "split.classes_per_client": 2, **match},
        settings=settings,
    )


def _fedpg_presets() -> tuple[Preset, ...]:
    return (
        FedPGPreset(
            name="fedpg_table1",
            title="FedPG appendix Table 1: pat-2, 10% of 100 clients online",
            csv="fedpg_table1.csv",
            paper_metric="acc",
            rows=FEDPG_ROWS,
            columns=tuple(
                _fedpg_col(d, "pat2", d, participation=0.1, **{"attack.kind": "none"})
                for d in FEDPG_DATA
            ),
            settings=FEDPG_SETTINGS,
            notes=FEDPG_NOTES,
        ),
        FedPGPreset(
            name="fedpg_table2",
            title="FedPG appendix Table 2: CIFAR-10 pat-2, 10/50/100% of 100 clients online",
            csv="fedpg_table2.csv",
            paper_metric="acc",
            rows=FEDPG_ROWS,
            columns=tuple(
                _fedpg_col(
                    "CIFAR-10",
                    f"pat2;participation={p}%",
                    f"CIFAR-10 {p}%",
                    participation=p / 100,
                    **{"attack.kind": "none"},
                )
                for p in (10, 50, 100)
            ),
            settings=FEDPG_SETTINGS,
            notes=FEDPG_NOTES,
        ),
        FedPGPreset(
            name="fedpg_table3",
            title="FedPG appendix Table 3: FMNIST, 10% malicious clients (clean, A1, A2)",
            csv="fedpg_table3.csv",
            paper_metric="acc",
            rows=FEDPG_T3_ROWS,
            columns=tuple(
                _fedpg_col("FMNIST", setting, setting, participation=0.1, **{"attack.kind": k})
                for setting, k in (("clean", "none"), ("A1", "a1"), ("A2", "a2"))
            ),
            settings={**FEDPG_SETTINGS, "attack.fraction": 0.1},
            notes=(
                *FEDPG_NOTES,
                "Table 3: metrics over honest clients only; A1 on gradient uploads is a random "
                "direction at the honest norm (attack.a1_grad=scaled, the authors' code); the "
                "split and participation are not stated (ours: Table 1's)",
            ),
        ),
    )


PRESETS.update({p.name: p for p in _fedpg_presets()})


# --------------------------------------------------------------------------- not a paper's
# Layouts with the presets' interface (name, title, select, build) and no paper numbers: the
# leaderboard (fedbench/report/leaderboard.py). PRESETS holds the papers' tables only.
from fedbench.report.leaderboard import LeaderboardPreset  # noqa: E402 (after the papers')

TABLES: dict[str, Any] = {LeaderboardPreset.name: LeaderboardPreset()}


def names() -> list[str]:
    """Every --preset name: the papers' tables, then the others."""
    return [*PRESETS, *TABLES]


def get(name: str) -> Preset:
    if name in TABLES:
        return TABLES[name]
    if name not in PRESETS:
        raise ReportError(f"unknown preset {name!r}; valid: {', '.join(names())}")
    return PRESETS[name]
