"""Who holds what: the label distribution of a run's split, from its `partition.json`.

`partition.json` (written by the runner when a run starts) holds every client's train and
test indices into the pool of labels `concat(y_train, y_test)` of the dataset, the split's
`meta` (split, params, seed, num_clients, n_train, n_test) and the S/G evaluation sets. It
may also hold the per-client class counts (`class_counts`, `num_classes`: what
`partition_counts` returns, for the runner to add); without them the counts are computed
from the indices and the dataset's labels, loaded from `data.root` as the run's config names
it (never downloaded). Without the dataset on this machine, the plot shows each client's
number of samples only, and says why.

`plot_partition(run_dir, out_png)` draws it as Flower Datasets and FedLab do: a stacked
horizontal bar of train samples per client, one color per class (up to 20 classes; beyond,
each client's total), beside a clients x classes heatmap of the counts (printed in the
cells when they fit). `write_partition_plots` draws one run per distinct split: runs with
the same data, split settings, number of clients and seed have the same partition.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from fedbench.report.collect import ReportError, RunDir, hashable, read_run, write_output

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 120
MAX_STACKED = 20  # classes drawn as stacked bar segments (beyond: totals, and the heatmap)
MAX_ANNOTATED = 30  # clients whose heatmap cells print their counts (with <= 20 classes)
# data.* keys that do not change the labels (where the files are, augmentation at training)
_NOT_DATA = ("data.root", "data.download", "data.augment")


# --------------------------------------------------------------------------- counts
def class_counts(labels: np.ndarray, parts: list, num_classes: int) -> np.ndarray:
    """[clients, classes] sample counts of `parts` (index arrays into `labels`)."""
    y = np.asarray(labels, dtype=np.int64)
    out = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, idx in enumerate(parts):
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size:
            out[i] = np.bincount(y[idx], minlength=num_classes)[:num_classes]
    return out


def partition_counts(labels_pool: np.ndarray, train: list, test: list, num_classes: int) -> dict:
    """What partition.json should carry for the report to draw a split without the data:
    `{"num_classes": C, "class_counts": {"train": [[...] per client], "test": [...]}}`
    (the runner: `{**partition.to_json(), **partition_counts(labels_pool, partition.train,
    partition.test, num_classes), "eval_sets": ...}`)."""
    return {
        "num_classes": int(num_classes),
        "class_counts": {
            "train": class_counts(labels_pool, train, num_classes).tolist(),
            "test": class_counts(labels_pool, test, num_classes).tolist(),
        },
    }


def read_partition(run_dir: Path) -> dict:
    path = Path(run_dir) / "partition.json"
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file (the run wrote no partition)") from None
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise ReportError(f"{path}: not valid JSON (truncated or corrupt)") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("train"), list):
        raise ReportError(f"{path}: no per-client 'train' indices")
    return obj


def _data_config(run_dir: Path) -> dict:
    """The run's data group, interpolations (the data root's ${oc.env:...}) resolved here."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml")
        data = cfg.get("data")
        try:
            return dict(OmegaConf.to_container(data, resolve=True))
        except Exception:  # noqa: BLE001 (an interpolation that cannot be resolved here)
            plain = dict(OmegaConf.to_container(data, resolve=False))
            plain["root"] = None
            return plain
    except Exception as e:  # noqa: BLE001 (no or unreadable config: no labels, said why)
        raise LookupError(f"no readable .hydra/config.yaml ({type(e).__name__})") from None


@lru_cache(maxsize=4)
def _dataset_labels(name: str, root: str | None, params: str) -> tuple[np.ndarray, int]:
    from fedbench.data.sources import load_dataset

    data = load_dataset(name, root, download=False, **json.loads(params))
    y = np.concatenate([data.y_train.numpy(), data.y_test.numpy()]).astype(np.int64)
    return y, int(data.num_classes)


def pool_labels(run_dir: Path) -> tuple[np.ndarray, int]:
    """The run's label pool concat(y_train, y_test) and number of classes, from its dataset
    on this machine; LookupError(why) when it cannot be had."""
    cfg = _data_config(run_dir)
    name = cfg.pop("name", None)
    if not name:
        raise LookupError("the run's config names no dataset")
    root = cfg.pop("root", None)
    for k in ("download", "augment"):
        cfg.pop(k, None)
    try:
        params = json.dumps(cfg, sort_keys=True, default=str)
        return _dataset_labels(str(name), None if root is None else str(root), params)
    except Exception as e:  # noqa: BLE001 (missing data, no torch, a bad file: said why)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LookupError(f"dataset {name!r} not loadable here ({why[:160]})") from None


def partition_frame(run_dir: str | Path) -> tuple[pd.DataFrame, dict, str | None]:
    """(train counts: clients x classes, or one `samples` column when the classes are not
    known; the partition's meta with `test_sizes`; why the classes are not known)."""
    run_dir = Path(run_dir)
    part = read_partition(run_dir)
    meta = dict(part.get("meta") or {})
    train, test = part["train"], part.get("test") or []
    meta["test_sizes"] = [len(t) for t in test]
    meta.setdefault("num_clients", len(train))
    counts = (part.get("class_counts") or {}).get("train")
    if counts is not None:
        df = pd.DataFrame(np.asarray(counts, dtype=np.int64))
    else:
        try:
            labels, num_classes = pool_labels(run_dir)
            n_pool = meta.get("n_train", 0) + meta.get("n_test", 0)
            if n_pool and n_pool != len(labels):
                raise LookupError(
                    f"the dataset here has {len(labels)} samples, the run's had {n_pool}"
                )
            top = max((max(t) for t in train if len(t)), default=-1)
            if top >= len(labels):
                raise LookupError("the partition indexes past the dataset here")
            df = pd.DataFrame(class_counts(labels, train, num_classes))
        except LookupError as e:
            sizes = [len(t) for t in train]
            return _named(pd.DataFrame({"samples": sizes})), meta, str(e)
    return _named(df), meta, None


def _named(df: pd.DataFrame) -> pd.DataFrame:
    df.index.name = "client"
    df.columns.name = "class"
    return df


# --------------------------------------------------------------------------- the figure
def _split_text(meta: dict, run: RunDir | None) -> str:
    params = meta.get("params") or {}
    shown = [
        f"{k}={params[k]}"
        for k in ("alpha", "classes_per_client", "groups", "dominant_frac")
        if params.get(k) is not None
    ]
    data = run.get("data") if run is not None else None
    parts = [str(data)] if data else []
    parts.append(" ".join([str(meta.get("split", "?")), *shown]))
    parts.append(f"{meta.get('num_clients', '?')} clients")
    if meta.get("seed") is not None:
        parts.append(f"seed {meta['seed']}")
    return ", ".join(parts)


def partition_figure(counts: pd.DataFrame, meta: dict, title: str, why: str | None) -> Figure:
    from matplotlib import colormaps  # here: the runner may import partition_counts
    from matplotlib.colors import PowerNorm
    from matplotlib.figure import Figure

    n, c = counts.shape
    by_class = why is None
    tall = 1.6 + (0.26 * n if n <= MAX_ANNOTATED else 0.12 * n)
    height = min(max(tall, 3.2), 16.0)
    wide_map = by_class and c > 1
    width = 6.0 + (min(0.42 * c, 9.0) if wide_map else 0.0)
    fig = Figure(figsize=(width, height), layout="constrained")
    if wide_map:
        ax_bar, ax_map = fig.subplots(
            1, 2, sharey=True, gridspec_kw={"width_ratios": [5.0, min(0.42 * c, 9.0)]}
        )
    else:
        ax_bar, ax_map = fig.subplots(1, 1), None
    y = np.arange(n)
    values = counts.to_numpy()
    if by_class and c <= MAX_STACKED:
        cmap = colormaps["tab10" if c <= 10 else "tab20"]
        left = np.zeros(n)
        for k in range(c):
            ax_bar.barh(y, values[:, k], left=left, height=0.8, color=cmap(k % cmap.N),
                        label=str(counts.columns[k]), lw=0)  # fmt: skip
            left += values[:, k]
        fig.legend(loc="outside lower center", ncols=min(c, 10), title="class", fontsize=8,
                   frameon=False)  # fmt: skip
    else:
        ax_bar.barh(y, values.sum(axis=1), height=0.8, color="#4c72b0", lw=0)
    totals = values.sum(axis=1)
    if n <= 2 * MAX_ANNOTATED:
        for i, t in enumerate(totals):
            ax_bar.text(t, i, f" {t}", va="center", ha="left", fontsize=7 if n > 20 else 8)
        ax_bar.set_xlim(0, totals.max() * 1.12 if totals.size and totals.max() > 0 else 1)
    ax_bar.set_xlabel("train samples")
    ax_bar.set_ylabel("client")
    step = 1 if n <= MAX_ANNOTATED else (5 if n <= 150 else 10)
    ax_bar.set_yticks(y[::step], [str(i) for i in counts.index[::step]])
    ax_bar.tick_params(axis="y", labelsize=8 if n <= MAX_ANNOTATED else 7)
    ax_bar.set_ylim(n - 0.5, -0.5)  # client 0 on top
    ax_bar.grid(axis="x", alpha=0.3)
    if ax_map is not None:
        norm = PowerNorm(0.5, vmin=0, vmax=max(int(values.max()), 1))
        im = ax_map.imshow(values, aspect="auto", cmap="Blues", norm=norm, interpolation="nearest")
        if n > MAX_ANNOTATED or c > MAX_STACKED:  # no counts in the cells: a color scale
            fig.colorbar(im, ax=ax_map, shrink=0.5, pad=0.01, label="train samples")
        else:
            for i in range(n):
                for k in range(c):
                    v = values[i, k]
                    if v:
                        dark = norm(v) > 0.6
                        ax_map.text(k, i, str(v), ha="center", va="center", fontsize=6.5,
                                    color="white" if dark else "black")  # fmt: skip
        step_c = 1 if c <= MAX_STACKED else (5 if c <= 100 else 20)
        ax_map.set_xticks(np.arange(c)[::step_c], [str(k) for k in counts.columns[::step_c]])
        ax_map.tick_params(axis="x", labelsize=8)
        ax_map.set_xlabel("class")
        ax_map.set_title("train samples per class", fontsize=9)
    tests = meta.get("test_sizes") or []
    sub = "train samples per client" + (" and class" if by_class else "")
    if tests:
        sub += f"; test set sizes min/median/max {min(tests)}/{np.median(tests):g}/{max(tests)}"
    if why:
        sub += f"\nclasses not shown: {why}"
    fig.suptitle(f"{title}\n{sub}", fontsize=10)
    return fig


def plot_partition(run_dir: str | Path, out_png: str | Path) -> pd.DataFrame:
    """Draw the label distribution of the run's split into `out_png` (written whole or not
    at all); return the counts it drew (clients x classes; one `samples` column when the
    classes are not known). A missing or unreadable partition.json is a ReportError."""
    run_dir = Path(run_dir)
    counts, meta, why = partition_frame(run_dir)
    _write(run_dir, counts, meta, why, Path(out_png))
    return counts


def _write(run_dir: Path, counts: pd.DataFrame, meta: dict, why: str | None, out: Path) -> None:
    title = f"partition: {_split_text(meta, read_run(run_dir))}"
    fig = partition_figure(counts, meta, title, why)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI, bbox_inches="tight")
    write_output(out, png.getvalue())
    counts.attrs["why"] = why


# --------------------------------------------------------------------------- one per split
def split_key(run: RunDir) -> tuple:
    """What decides a run's partition: its data (less where it is read from), split
    settings, number of clients and seed."""
    keys = sorted(
        k
        for k in run.config
        if (k.startswith(("data.", "split.")) and k not in _NOT_DATA) or k in ("clients", "seed")
    )
    return tuple((k, hashable(run.config[k])) for k in keys)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._,=+-]+", "_", name).strip("._") or "run"


def write_partition_plots(
    runs: list[Any], out_dir: str | Path, warn: Callable[[str], None] | None = None
) -> list[Path]:
    """partition_<run>.png for the first run (in path order) of each distinct split that
    has a partition.json. A partition that cannot be read or drawn is a warning."""
    out = Path(out_dir)
    seen: set[tuple] = set()
    names: set[str] = set()
    written = []
    by_path = {}
    for r in runs:  # each run once (a FedSLR run can show in two rows)
        by_path.setdefault(str(r.path), r)
    for r in by_path.values():
        path = Path(r.path)
        key = split_key(r)
        if key in seen or not (path / "partition.json").is_file():
            continue
        name = _safe(path.name)
        if name in names:
            name = _safe(f"{path.parent.name}_{path.name}")
        png = out / f"partition_{name}.png"
        try:
            counts, meta, why = partition_frame(path)
        except ReportError as e:
            if warn:
                warn(f"no partition plot for {path}: {e}")
            continue
        _write(path, counts, meta, why, png)  # a file that cannot be written: ReportError
        seen.add(key)
        names.add(name)
        written.append(png)
        if counts.attrs.get("why") and warn:
            warn(f"{png.name}: sample counts only, {counts.attrs['why']}")
    return written
