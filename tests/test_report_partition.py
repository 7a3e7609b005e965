"""The label distribution of a run's split (fedbench.report.partition): counts from the
class counts partition.json may carry, else from its indices and the dataset's labels, else
samples only; one plot per distinct split with --plots."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_report import assert_png, run_cli, write_run

from fedbench.data.sources import load_dataset
from fedbench.data.splits import make_partition
from fedbench.report.partition import (
    partition_counts,
    partition_figure,
    partition_frame,
    plot_partition,
)

pytestmark = pytest.mark.quick

SYNTH = dict(num_samples=600, num_classes=5, groups=3, dim=8)


def synthetic_run(path, clients=8, seed=0, alpha=0.5, counts=False, **overrides):
    """A run on the small synthetic dataset with the partition.json the runner writes
    (optionally with the class counts partition_counts adds)."""
    data = {f"data__{k}": v for k, v in SYNTH.items()}
    write_run(path, [0.5], data__name="synthetic", clients=clients, seed=seed,
              split__name="dir", split__alpha=alpha, **data, **overrides)  # fmt: skip
    ds = load_dataset("synthetic", None, download=False, **SYNTH)
    ytr, yte = ds.y_train.numpy(), ds.y_test.numpy()
    part = make_partition(ytr, yte, clients, seed, "dir", {"alpha": alpha})
    obj = {**part.to_json(), "eval_sets": {"S": [], "G": []}}
    if counts:
        obj.update(partition_counts(np.concatenate([ytr, yte]), part.train, part.test, 5))
    (path / "partition.json").write_text(json.dumps(obj))
    return part, np.concatenate([ytr, yte])


def test_counts_from_the_indices_and_the_datasets_labels(tmp_path):
    part, pool = synthetic_run(tmp_path / "run")
    out = tmp_path / "partition.png"
    counts = plot_partition(tmp_path / "run", out)
    assert_png(out)
    assert counts.shape == (8, 5) and counts.attrs["why"] is None
    assert counts.sum(axis=1).tolist() == [len(t) for t in part.train]
    for i in (0, 7):
        assert counts.loc[i].tolist() == np.bincount(pool[part.train[i]], minlength=5).tolist()


def test_class_counts_in_partition_json_are_used_as_they_are(tmp_path):
    part, pool = synthetic_run(tmp_path / "run", counts=True)
    obj = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert obj["num_classes"] == 5 and len(obj["class_counts"]["test"]) == 8
    obj["class_counts"]["train"][0] = [1, 2, 3, 4, 5]  # read, not recomputed
    (tmp_path / "run" / "partition.json").write_text(json.dumps(obj))
    counts, meta, why = partition_frame(tmp_path / "run")
    assert why is None and counts.loc[0].tolist() == [1, 2, 3, 4, 5]
    assert meta["num_clients"] == 8 and meta["test_sizes"] == [len(t) for t in part.test]


def test_a_hundred_clients_and_a_hundred_classes(tmp_path):
    """Readable at 100 clients (ticks every 5th client, a color scale instead of the
    counts) and at 100 classes (totals and the heatmap)."""
    import pandas as pd

    rng = np.random.default_rng(0)
    for n, c in ((100, 10), (20, 100)):
        values = rng.integers(0, 50, size=(n, c)) * (rng.random((n, c)) < 0.3)
        counts = pd.DataFrame(values)
        fig = partition_figure(counts, {"test_sizes": [5] * n}, "t", None)
        bars = fig.axes[0]
        stacked = c <= 20
        assert len(bars.patches) == (n * c if stacked else n)
        assert len(bars.get_yticks()) == (n // 5 if n > 30 else n)
        assert len(fig.axes) == (3 if n > 30 or c > 20 else 2)  # + a colorbar


def test_without_the_dataset_the_plot_shows_sample_counts(tmp_path):
    synthetic_run(tmp_path / "run")
    cfg = tmp_path / "run" / ".hydra" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("name: synthetic", "name: nosuchdata"))
    counts = plot_partition(tmp_path / "run", tmp_path / "p.png")
    assert list(counts.columns) == ["samples"] and len(counts) == 8
    assert "dataset 'nosuchdata' not loadable here" in counts.attrs["why"]
    assert_png(tmp_path / "p.png")


def test_cli_plots_one_partition_per_distinct_split(tmp_path, capsys):
    runs = tmp_path / "runs"
    for algo in ("fedavg", "local"):
        for seed in (0, 1):
            synthetic_run(runs / f"{algo}{seed}", seed=seed, algo__name=algo)
    (runs / "local1" / "partition.json").write_text("{")  # never read: fedavg1 comes first
    code, out, err = run_cli(runs, "--plots", tmp_path / "figs", capsys=capsys)
    assert code == 0, err
    made = sorted(p.name for p in (tmp_path / "figs").glob("partition_*.png"))
    assert made == ["partition_fedavg0.png", "partition_fedavg1.png"]  # seeds 0 and 1
    assert "wrote " + str(tmp_path / "figs" / "partition_fedavg1.png") in err
    # a partition that cannot be read is a warning, not a failure
    (runs / "fedavg1" / "partition.json").write_text("{")
    code, out, err = run_cli(runs, "--plots", tmp_path / "figs2", capsys=capsys)
    assert code == 0 and "Traceback" not in err
    assert "warning: no partition plot for" in err and "not valid JSON" in err
    made = sorted(p.name for p in (tmp_path / "figs2").glob("partition_*.png"))
    assert made == ["partition_fedavg0.png"]
