"""Model size and communication for every algorithm (FedSLR Table 2): `Algorithm.model_size`,
the runner's size columns in metrics.csv and summary.json, and the fedslr_table2 report."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from conftest import make_algo, run_small
from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.base import FLOAT_BYTES
from fedbench.report import presets
from fedbench.report.collect import find_runs
from fedbench.runner import SIZE_KEYS, size_columns


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(ALGORITHMS.names()))
def test_every_algorithm_reports_sizes(name):
    """Every registered algorithm: its model kinds' sizes, the parameters it sent (from its
    bytes_down) and the MB per round."""
    _check_sizes(name)


def _check_sizes(name: str) -> None:
    algo, eng, fed = make_algo(name)
    clients = np.array([0, 2])
    info = algo.round(0, clients)
    sizes = algo.model_size()
    assert ("params_personal" in sizes) == algo.has_personal, name
    assert ("params_global" in sizes) == algo.has_global, name
    assert all(0 < v <= 4 * eng.n_params for v in sizes.values()), (name, sizes)
    comm = {"bytes_up": info.comm.bytes_up, "bytes_down": info.comm.bytes_down}
    cols = size_columns(algo, comm, 1, info, len(clients))
    sent = info.comm.bytes_down / FLOAT_BYTES / len(clients)
    assert cols["params_sent_M"] == pytest.approx(sent / 1e6)
    assert cols["comm_MB"] == pytest.approx((comm["bytes_up"] + comm["bytes_down"]) / 1e6)


@pytest.mark.quick
def test_the_issue_algorithms_are_registered():
    assert {"fedslr", "scaffold", "feddyn", "lg_fedavg", "fedspa"} <= set(ALGORITHMS.names())


@pytest.mark.quick
def test_partial_models_send_part_of_the_model():
    for name, part in (("lg_fedavg", "head"), ("fedrep", "body")):
        algo, eng, fed = make_algo(name)
        D = eng.n_state
        info = algo.round(0, np.array([0, 1]))
        sent = info.comm.bytes_down / FLOAT_BYTES / 2
        head = len(eng.model.head_params()) and int(eng.spec.mask(eng.model.head_params()).sum())
        assert sent == (head if part == "head" else D - head), name
    algo, eng, _ = make_algo("scaffold")
    info = algo.round(0, np.array([0, 1]))
    assert info.comm.bytes_up == 2 * (eng.n_state + eng.n_params) * FLOAT_BYTES  # y and c_i


def _as_paper_run(run_dir, cfg, data="cifar10"):
    """A finished run directory as the report reads it, relabelled as a FedSLR Table 2
    column (CIFAR-10 Dir 0.1): the files of a real FMNIST run."""
    c = OmegaConf.to_container(cfg, resolve=True)
    c["data"]["name"] = data
    c["split"] = {"name": "dir", "alpha": 0.1}
    (run_dir / ".hydra").mkdir(exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(c))
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(data=data, split="dir")
    (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.mark.slow
def test_sizes_in_metrics_summary_and_fedslr_table2(tmp_path, capsys):
    runs = {}
    for name, extra in (
        ("fedslr", ["algo.rank_penalty=0.05"]),
        ("fedavg", []),
        ("lg_fedavg", []),
    ):
        out = tmp_path / name
        summary, run = run_small(out, [f"algo={name}", "optim.lr=0.05", *extra], rounds=2)
        m = pd.read_csv(out / "metrics.csv")
        assert set(summary["size"]) <= set(SIZE_KEYS)
        for k, v in summary["size"].items():
            assert m[k].iloc[-1] == pytest.approx(v), (name, k)
        runs[name] = (summary, run, m.iloc[-1])
        _as_paper_run(out, run.cfg)
    P, D = runs["fedavg"][1].engine.n_params, runs["fedavg"][1].engine.n_state
    C = runs["fedavg"][1].per_round
    fa = runs["fedavg"][0]["size"]
    assert fa["comm_MB"] == pytest.approx(2 * C * D * FLOAT_BYTES / 1e6)
    assert fa["params_global_M"] == pytest.approx(P / 1e6)
    assert fa["params_sent_M"] == pytest.approx(D / 1e6)
    lg = runs["lg_fedavg"][0]["size"]
    assert lg["comm_MB"] < fa["comm_MB"] / 10
    slr_sum, slr_run, slr_row = runs["fedslr"]
    assert slr_sum["size"]["params_global_M"] == pytest.approx(slr_row["gkr_params"] / 1e6)
    assert slr_row["gkr_params"] < P
    assert slr_sum["size"]["params_personal_M"] == pytest.approx(slr_row["mixed_params"] / 1e6)

    table, unmatched = presets.get("fedslr_table2").build(find_runs([tmp_path]))
    assert not unmatched
    cell = table.cells[(("FedSLR (GKR)",), ("CIFAR-10 Dir(0.1)",), "params_M")]
    assert cell.mean == pytest.approx(slr_row["gkr_params"] / 1e6)
    cell = table.cells[(("FedSLR (mixed)",), ("CIFAR-10 Dir(0.1)",), "params_M")]
    assert cell.mean == pytest.approx(slr_row["mixed_params"] / 1e6)
    cell = table.cells[(("FedAvg (*)",), ("CIFAR-10 Dir(0.1)",), "comm_cost")]
    assert cell.mean == pytest.approx(fa["comm_MB"])
    cell = table.cells[(("FedSLR (mixed)",), ("CIFAR-10 Dir(0.1)",), "acc")]
    assert cell.mean == pytest.approx(slr_sum["final"]["personal"]["L"]["avg"])

    from fedbench.report.cli import main

    code = main([str(tmp_path), "--preset", "fedslr_table2"])
    out = capsys.readouterr().out
    assert code in (0, None)
    assert "FedSLR (mixed)" in out and "893.92" in out  # the paper's FedAvg comm cost beside ours
    t1, _ = presets.get("fedslr_table1").build(find_runs([tmp_path]))
    gkr = t1.cells[(("FedSLR (GKR)",), ("CIFAR-10 Dir(0.1)",), "avg")]
    assert gkr.mean == pytest.approx(slr_sum["final"]["global"]["L"]["avg"])
