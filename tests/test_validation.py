"""Validation sets (split.val_frac), the V metrics, eval.select and the tuning objective
(issue 34, items 1 and 2): the stratified carve by hand, the round each rule selects from
hand-made metrics, the papers' presets unchanged at val_frac=0, and the CLI end to end."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import CLI_BACKEND, compose, fmnist_available
from fedbench.data.splits import carve_validation, eval_sets, make_partition
from fedbench.errors import ConfigError, SplitError

REPO = Path(__file__).resolve().parents[1]
needs_fmnist = pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")


def _labels(n_cls: int = 5, per_class: int = 200, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(n_cls), per_class))


def _counts(y: np.ndarray, idx: np.ndarray, n_cls: int) -> np.ndarray:
    return np.bincount(y[idx], minlength=n_cls)


# --------------------------------------------------------------------------- the carve
@pytest.mark.quick
def test_carve_is_stratified_disjoint_and_removed_from_training():
    y_tr, y_te = _labels(), _labels(per_class=50, seed=1)
    params = {"test_mode": "matched", "balance": False}
    before = make_partition(y_tr, y_te, 8, 3, "pat", {**params, "val_frac": 0.0})
    part = make_partition(y_tr, y_te, 8, 3, "pat", {**params, "val_frac": 0.2})
    pool = np.concatenate([y_tr, y_te])
    for i in range(8):
        tr, va, te = part.train[i], part.val[i], part.test[i]
        assert not set(va) & set(tr) and not set(va) & set(te)
        # the carve only splits the training share: train + val is the share without it
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, va])), before.train[i])
        n = len(before.train[i])
        assert len(va) == int(np.floor(0.2 * n + 0.5))
        # stratified: each class gives its share (largest remainder: within one sample)
        share = _counts(pool, before.train[i], 5) * len(va) / n
        assert np.abs(_counts(pool, va, 5) - share).max() < 1
    # the test sets are those drawn without validation
    assert all(np.array_equal(a, b) for a, b in zip(part.test, before.test))


@pytest.mark.quick
def test_carve_by_hand():
    """Client 0: 6 of class 0 and 4 of class 1, val_frac 0.5 -> 3 + 2; client 1: 1 of
    class 0 and 3 of class 2, val_frac 0.5 -> 2 samples, shares 0.5 and 1.5: floors 0 + 1,
    the one left to the largest remainder (a tie: the class first in order) -> 1 + 1."""
    y = np.array([0] * 6 + [1] * 4 + [2] * 3 + [0])
    train = [np.arange(10), np.arange(10, 14)]
    tr, va = carve_validation(y, train, 0.5, np.random.default_rng(0))
    assert list(np.bincount(y[va[0]], minlength=3)) == [3, 2, 0]
    assert list(np.bincount(y[va[1]], minlength=3)) == [1, 0, 1]
    assert len(tr[1]) == 2
    for t, v, full in zip(tr, va, train):
        np.testing.assert_array_equal(np.sort(np.concatenate([t, v])), full)


@pytest.mark.quick
def test_carve_is_deterministic_and_seeded():
    y_tr, y_te = _labels(), _labels(per_class=50, seed=1)
    p = {"val_frac": 0.1}
    a = make_partition(y_tr, y_te, 6, 0, "iid", p)
    b = make_partition(y_tr, y_te, 6, 0, "iid", p)
    c = make_partition(y_tr, y_te, 6, 1, "iid", p)
    assert a == b
    assert not all(np.array_equal(x, z) for x, z in zip(a.val, c.val))


@pytest.mark.quick
@pytest.mark.parametrize("split", ["iid", "pat", "dir", "practical"])
def test_val_frac_zero_is_the_partition_without_the_key(split):
    """val_frac=0 consumes no random number: the partition (train, test, S, G) is the one
    made from a split config without the key (a run saved before it), and the carve
    with val_frac > 0 leaves the test sets and the S / G sets alone (its own stream)."""
    y_tr, y_te = _labels(n_cls=10, per_class=300), _labels(n_cls=10, per_class=60, seed=1)
    base = {"train_per_client": 100} if split == "practical" else {}
    old = make_partition(y_tr, y_te, 12, 5, split, base)
    zero = make_partition(y_tr, y_te, 12, 5, split, {**base, "val_frac": 0.0})
    val = make_partition(y_tr, y_te, 12, 5, split, {**base, "val_frac": 0.25})
    for a, b in ((old.train, zero.train), (old.test, zero.test), (old.test, val.test)):
        assert all(np.array_equal(x, z) for x, z in zip(a, b))
    assert zero.val == [] and "val" not in zero.to_json()
    s_old, s_zero, s_val = (eval_sets(p, 5) for p in (old, zero, val))
    for other in (s_zero, s_val):
        assert all(np.array_equal(x, z) for x, z in zip(s_old.s + s_old.g, other.s + other.g))


@pytest.mark.quick
def test_carve_in_pooled_mode_and_json_round_trip():
    y_tr, y_te = _labels(), _labels(per_class=50, seed=1)
    part = make_partition(y_tr, y_te, 5, 0, "iid", {"test_mode": "pooled", "val_frac": 0.1})
    for tr, va, te in zip(part.train, part.val, part.test):
        assert len(va) > 0 and not (set(va) & set(tr)) and not (set(va) & set(te))
    from fedbench.data.splits import Partition

    assert Partition.from_json(json.loads(json.dumps(part.to_json()))) == part


@pytest.mark.quick
def test_too_few_training_samples_is_one_line():
    y = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    with pytest.raises(SplitError, match=r"client 1 has 2 training samples, too few") as e:
        carve_validation(y, [np.arange(6), np.arange(6, 8)], 0.2, np.random.default_rng(0))
    assert "\n" not in str(e.value) and "raise val_frac to at least 0.25" in str(e.value)
    with pytest.raises(SplitError, match="lower val_frac"):
        carve_validation(y, [np.arange(2)], 0.9, np.random.default_rng(0))


@pytest.mark.quick
def test_config_checks():
    from fedbench.config import check_config, objective_on_test

    for bad, msg in (
        (["split.val_frac=1.0"], "split.val_frac=1.0 must be < 1"),
        (["split.val_frac=-0.1"], "split.val_frac=-0.1 must be >= 0"),
        (["eval.select=val"], "eval.select=val needs validation data"),
        (["objective.metric=personal.V.avg"], "needs validation data"),
        (["eval.select=best"], "eval.select"),
    ):
        with pytest.raises(ConfigError, match=msg):
            check_config(compose(bad))
    check_config(
        compose(["split.val_frac=0.1", "eval.select=val", "objective.metric=global.V.min"])
    )
    assert objective_on_test(compose([]))  # auto without validation: L
    assert not objective_on_test(compose(["split.val_frac=0.1"]))  # auto: V
    assert objective_on_test(compose(["split.val_frac=0.1", "objective.metric=personal.S.avg"]))
    assert objective_on_test(compose(["split.val_frac=0.1", "objective.metric=global.all"]))


@pytest.mark.quick
def test_runs_saved_before_the_keys_still_resume():
    from fedbench.runner import resume_differences
    from fedbench.trees import plain

    now = plain(compose([]))
    saved = json.loads(json.dumps(now))
    del saved["split"]["val_frac"], saved["eval"]["select"]
    assert resume_differences(saved, now) == []
    with_val = plain(compose(["split.val_frac=0.1"]))
    assert resume_differences(saved, with_val) == ["split.val_frac (absent -> 0.1)"]


# --------------------------------------------------------------------------- the presets
PRESETS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.quick
def test_every_preset_runs_without_validation_and_reports_as_before():
    """Every paper preset (conf/experiment, with its conf/paper settings) keeps
    split.val_frac=0: no validation set, `selected` is the last evaluation (= `final`),
    the objective is the same number as before (personal L at the last evaluation), and
    the report keeps its own rule (the DiversiFed presets' best round)."""
    from fedbench.evaluation import resolve_select

    for name in PRESETS:
        cfg = compose([f"+experiment={name}"])
        assert cfg.split.val_frac == 0, name
        assert resolve_select(str(cfg.eval.select), False) == "last", name
        assert (cfg.objective.metric, cfg.objective.at) == ("auto", "selected"), name


# Partitions (train, test, S and G indices) made by fedbench before split.val_frac existed
# (commit 8a3adfb), for the papers' FMNIST presets: the same with val_frac=0 today.
BEFORE = {
    ("diversifed_table1_fmnist", 0): "a9e77d2d04df8710",
    ("diversifed_table1_fmnist", 1): "d9c8f29c681e92b8",
    ("diversifed_table2_fmnist", 0): "0f90fd11e772fd81",
    ("diversifed_table2_fmnist", 1): "43c92a86bbe12bb9",
    ("fedpg_table1_fmnist", 0): "30fc55ae071f6994",
    ("fedpg_table1_fmnist", 1): "9444ca047e66ce66",
    ("fedpg_table3_fmnist_a1", 0): "30fc55ae071f6994",
    ("fedslr_fmnist_dir", 0): "49de60de7a065a06",
    ("fedslr_fmnist_dir", 1): "e1ac8f12e733bb8a",
}


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a, dtype=np.int64)
        h.update(np.int64(a.size).tobytes())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


@pytest.mark.quick
@needs_fmnist
def test_presets_partitions_are_those_before_validation_existed():
    from fedbench.data.sources import load_dataset
    from fedbench.trees import plain

    data = load_dataset("fmnist", None, download=False)
    y_tr, y_te = data.y_train.numpy(), data.y_test.numpy()
    for (name, seed), want in BEFORE.items():
        cfg = compose([f"+experiment={name}", f"seed={seed}"])
        scfg = plain(cfg.split)
        part = make_partition(y_tr, y_te, int(cfg.clients), seed, scfg.pop("name"), scfg)
        s, g = eval_sets(part, seed, float(cfg.eval.s_frac))
        assert _digest([*part.train, *part.test, *s, *g]) == want, (name, seed)


# --------------------------------------------------------------------------- V metrics
class FakeFed:
    num_clients = 2

    def __init__(self, val: bool = True):
        self.y = torch.arange(12)
        self.test_idx = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5])]
        self.s_idx = self.g_idx = None
        self.val_idx = [torch.tensor([6, 7, 8]), torch.tensor([9, 10])] if val else None


class FakeAlgo:
    """Personal model i is right exactly on pool samples `right[i]`; global on even ones."""

    has_personal = True
    has_global = True
    extra_kinds = ()
    right = [{0, 6, 7}, {5, 9, 10}]

    def personal_correct(self, i, idx):
        return torch.tensor([int(j) in self.right[i] for j in idx])

    def global_correct(self, idx):
        return idx % 2 == 0


@pytest.mark.quick
def test_v_metrics_by_hand():
    from fedbench.evaluation import evaluate, summaries

    r = evaluate(FakeAlgo(), FakeFed(), tail=0.05)
    np.testing.assert_allclose(r["personal"]["V"]["acc"], [2 / 3, 2 / 2])
    np.testing.assert_allclose(r["personal"]["L"]["acc"], [1 / 4, 1 / 2])
    np.testing.assert_allclose(r["global"]["V"]["acc"], [2 / 3, 1 / 2])  # 6, 8 even; 10 even
    assert r["global"]["all"] == pytest.approx(3 / 6)  # `all`: the test sets only
    s = summaries(r)
    assert s["personal"]["V"]["avg"] == pytest.approx(5 / 6)
    assert list(s["personal"]) == ["L", "V"]
    assert "V" not in evaluate(FakeAlgo(), FakeFed(val=False))["personal"]


# --------------------------------------------------------------------------- selection
def _ev(rnd: int, L: float, V: float | None = None, personal: bool = True) -> dict:
    sets = {"L": {"avg": L}} | ({"V": {"avg": V}} if V is not None else {})
    kind = "personal" if personal else "global"
    return {"round": rnd, "personal": None, "global": None, kind: sets}


@pytest.mark.quick
def test_runner_selection_rules():
    """The loop's trackers (evaluation.better, as runner.py uses it) over hand-made
    evaluations: best V at round 2 (a tie at round 4 keeps round 2), best L at round 3."""
    from fedbench.evaluation import VAL, better, resolve_select, selected

    evs = [_ev(1, 0.5, 0.4), _ev(2, 0.6, 0.7), _ev(3, 0.9, 0.5), _ev(4, 0.8, 0.7)]
    best_val = best_test = None
    for ev in evs:
        best_val = ev if better(ev, best_val, VAL) else best_val
        best_test = ev if better(ev, best_test, "L") else best_test
    assert selected("val", evs[-1], best_test, best_val)["round"] == 2
    assert selected("last", evs[-1], best_test, best_val) == {"by": "last", **evs[-1]}
    assert selected("best_test", evs[-1], best_test, best_val)["round"] == 3
    assert not better(_ev(5, 0.1, float("nan")), best_val, VAL)
    g = [_ev(1, 0.2, 0.9, personal=False), _ev(2, 0.3, 0.1, personal=False)]
    assert better(g[0], None, VAL) and not better(g[1], g[0], VAL)  # the global model's V
    assert resolve_select("auto", True) == "val" and resolve_select("auto", False) == "last"
    assert resolve_select("best_test", True) == "best_test"


def _run(tmp_path, rows: list[dict], config: dict | None = None, summary: dict | None = None):
    from fedbench.report.collect import RunDir

    run = RunDir(tmp_path, {"seed": 0, **(config or {})}, summary or {"final": {}})
    run.__dict__["metrics"] = pd.DataFrame(rows)
    return run


@pytest.mark.quick
def test_report_selects_the_round_of_each_rule(tmp_path):
    from fedbench.report.collect import selected

    rows = [
        {"round": 1, "personal.L.avg": 0.5, "personal.V.avg": 0.4, "global.L.avg": 0.3},
        {"round": 2, "personal.L.avg": 0.6, "personal.V.avg": 0.7, "global.L.avg": 0.9},
        {"round": 3, "personal.L.avg": 0.9, "personal.V.avg": 0.5, "global.L.avg": 0.2},
        {"round": 4, "personal.L.avg": 0.8, "personal.V.avg": 0.7, "global.L.avg": 0.1},
    ]
    run = _run(tmp_path, rows)
    assert selected(run, "personal.L.avg", "val") == (2, 0.6)  # best V (tie: the first)
    assert selected(run, "personal.L.avg", "last") == (4, 0.8)
    assert selected(run, "personal.L.avg", "final") == (4, 0.8)
    assert selected(run, "personal.L.avg", "best_test") == (3, 0.9)
    assert selected(run, "personal.L.avg", "best") == (3, 0.9)
    assert selected(run, "global.L.avg", "best_test") == (2, 0.9)  # the global model's round
    assert selected(run, "global.L.avg", "val") == (None, None)  # no global.V: n/a
    no_val = _run(tmp_path, [{k: v for k, v in r.items() if ".V." not in k} for r in rows])
    assert selected(no_val, "personal.L.avg", "val") == (None, None)


@pytest.mark.quick
def test_report_default_select(tmp_path):
    from fedbench.report.collect import default_select

    val = _run(tmp_path, [], {"split.val_frac": 0.1, "eval.select": "auto"})
    val_last = _run(tmp_path, [], {"split.val_frac": 0.1, "eval.select": "last"})
    plain_run = _run(tmp_path, [], {"split.val_frac": 0.0, "eval.select": "auto"})
    old = _run(tmp_path, [], {})
    said: list[str] = []
    assert default_select([val, val], "final", said.append) == "val"
    assert default_select([val_last], "final", said.append) == "last"
    assert default_select([plain_run, old], "best", said.append) == "best"  # a preset's rule
    assert not said
    assert default_select([val, plain_run], "final", said.append) == "final"
    assert len(said) == 1 and "choose with --select" in said[0]


@pytest.mark.quick
def test_objective_resolves_auto_and_the_selected_round():
    from fedbench.runner import objective, objective_record

    s = {
        "final": _ev(4, 0.8, 0.7),
        "best": _ev(3, 0.9, 0.5),
        "selected": {"by": "val", **_ev(2, 0.6, 0.75)},
    }
    assert objective(s, "auto", "selected") == 0.75  # personal.V.avg at the val round
    assert objective(s, "auto", "final") == 0.7
    assert objective(s, "personal.L.avg", "best") == 0.9
    rec = objective_record(s, "auto", "selected", tuning=True)
    assert rec == {"metric": "personal.V.avg", "at": "selected", "value": 0.75,
                   "on_test": False, "tuning": True}  # fmt: skip
    assert objective_record(s, "personal.L.avg", "selected", False)["on_test"] is True
    # a summary from before `selected` and V: auto = personal L at the final round, as before
    old = {"final": _ev(4, 0.8), "best": _ev(3, 0.9)}
    assert objective(old, "auto", "selected") == objective(old, "personal.L.avg", "final")
    glob = {"final": _ev(4, 0.8, personal=False)}  # no personal model: the global one's
    assert objective_record(glob, "auto", "selected", False)["metric"] == "global.L.avg"


# --------------------------------------------------------------------------- report marks
@pytest.mark.quick
def test_report_marks_best_on_test_and_test_objectives(tmp_path):
    from fedbench.report.compare import BestOf, default_best_by
    from fedbench.report.table import build, render

    rows = [{"round": 1, "personal.L.avg": 0.5, "personal.S.avg": 0.5, "personal.G.avg": 0.5}]
    summ = {"final": {}, "objective": {"metric": "personal.L.avg", "on_test": True,
                                       "tuning": True}}  # fmt: skip
    runs = [
        _run(tmp_path / str(lr), rows, {"algo": "fedavg", "optim.lr": lr}, summ)
        for lr in (0.1, 0.01)
    ]
    assert default_best_by(runs) == "personal.LSG"
    text = render(build(runs, ["algo"], [], ["personal.L.avg"], "best"), "terminal")
    assert "chosen on the test set, so OPTIMISTIC" in text
    assert "objective on the test set: 2 run(s) are trials of a study" in text
    text = render(
        build(runs, ["algo"], [], ["personal.L.avg"], "final", best_of=BestOf("optim.lr")),
        "markdown",
    )
    assert "so OPTIMISTIC (runs with split.val_frac > 0 are chosen by personal.V.avg)" in text
    val_runs = [_run(tmp_path, rows, {"split.val_frac": 0.1})]
    assert default_best_by(val_runs) == "personal.V.avg"


# --------------------------------------------------------------------------- end to end
# this checkout's fedbench first, then what the caller's path adds (a plugin's folder)
PATH = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(PATH)}
SMALL = [
    "clients=10",
    "split.train_per_client=100",
    "split.test_per_client=50",
    "model.hidden=[32]",
    "eval.every=1",
    "device=cpu",
    CLI_BACKEND,
]


def _cli(*args: str, cwd, module: str = "fedbench.cli") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", f"from {module} import main; main()", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV)


@pytest.mark.slow
@needs_fmnist
def test_run_with_validation_end_to_end(tmp_path):
    """V metrics in metrics.csv, clients.csv, summary.json; `selected` by val; the report
    reports the validation-selected round by default."""
    out = tmp_path / "run"
    r = _cli(*SMALL, "rounds=3", "split.val_frac=0.2", f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    m = pd.read_csv(out / "metrics.csv")
    for kind in ("personal", "global"):
        assert {f"{kind}.V.avg", f"{kind}.V.bottom5"} <= set(m.columns)
        assert set(s["final"][kind]) >= {"L", "S", "G", "V"}
    sel = s["selected"]
    assert sel["by"] == "val"
    assert sel["round"] == int(m.loc[m["personal.V.avg"].idxmax(), "round"])
    assert s["objective"]["metric"] == "personal.V.avg" and not s["objective"]["on_test"]
    assert s["objective"]["value"] == sel["personal"]["V"]["avg"]
    c = pd.read_csv(out / "clients.csv")
    assert len(c[(c["metric"] == "V") & (c["round"] == 1)]) == 2 * 10
    part = json.loads((out / "partition.json").read_text())
    assert [len(v) for v in part["val"]] == [20] * 10
    assert [len(t) for t in part["train"]] == [80] * 10
    rep = _cli(str(out), "--metric", "personal.L.avg", cwd=tmp_path, module="fedbench.report.cli")
    assert rep.returncode == 0, rep.stderr
    assert "(validation-selected round" in rep.stdout
    want = 100 * sel["personal"]["L"]["avg"]
    assert f"{want:.2f}" in rep.stdout


@pytest.mark.slow
@needs_fmnist
def test_too_few_samples_for_validation_is_exit_2(tmp_path):
    out = tmp_path / "run"
    r = _cli(*SMALL, "rounds=1", "split.train_per_client=4", "split.val_frac=0.1",
             f"hydra.run.dir={out}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "too few to carve a validation set" in lines[0]
    assert not out.exists()


@pytest.mark.slow
@needs_fmnist
def test_study_on_the_test_set_warns_once(tmp_path):
    """An Optuna study whose objective is a test-set number runs, warns once for the whole
    sweep, and its trials say so in summary.json and in the report; with validation data
    the default objective is on validation and nothing is said."""
    from fedbench.cli import plugin_installed

    if not plugin_installed("hydra_plugins.hydra_optuna_sweeper"):
        pytest.skip("pip install 'fedbench[optuna]'")
    warning = "objective on the test set: tuning on test data is optimistic"
    sweep = tmp_path / "study"
    r = _cli("-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.n_trials=2", *SMALL, "rounds=1",
             f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (r.stdout + r.stderr).count(warning) == 1
    objs = [json.loads(p.read_text())["objective"] for p in sweep.glob("*/summary.json")]
    assert len(objs) == 2
    assert all(o["on_test"] and o["tuning"] and o["metric"] == "personal.L.avg" for o in objs)
    rep = _cli(str(sweep), "--rows", "algo", "--cols", "", cwd=tmp_path,
               module="fedbench.report.cli")  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    assert "objective on the test set: 2 run(s) are trials of a study" in rep.stdout
    val_sweep = tmp_path / "val_study"
    r = _cli("-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.n_trials=1", *SMALL, "rounds=1",
             "split.val_frac=0.2", f"hydra.sweep.dir={val_sweep}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert warning not in r.stdout + r.stderr
    (o,) = [json.loads(p.read_text())["objective"] for p in val_sweep.glob("*/summary.json")]
    assert o["metric"] == "personal.V.avg" and not o["on_test"] and o["tuning"]


@pytest.mark.slow
@needs_fmnist
def test_a_grid_sweep_does_not_warn(tmp_path):
    """Hydra's basic sweeper maximizes nothing: no warning, and its runs are not trials."""
    sweep = tmp_path / "grid"
    r = _cli("-m", *SMALL, "rounds=1", "optim.lr=0.05,0.1", f"hydra.sweep.dir={sweep}",
             cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "objective on the test set" not in r.stdout + r.stderr
    objs = [json.loads(p.read_text())["objective"] for p in sweep.glob("*/summary.json")]
    assert len(objs) == 2 and not any(o["tuning"] for o in objs)


@pytest.mark.slow
@needs_fmnist
@pytest.mark.long
def test_extended_run_selects_as_an_uninterrupted_one(tmp_path):
    """The validation-selected round rides in the checkpoint: a run extended from 2 to 4
    rounds (resume=true) ends with the summary of a 4-round run."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    args = [*SMALL, "split.val_frac=0.2", "checkpoint.every=1"]
    for extra in (["rounds=4", f"hydra.run.dir={whole}"], ["rounds=2", f"hydra.run.dir={part}"],
                  ["rounds=4", "resume=true", f"hydra.run.dir={part}"]):  # fmt: skip
        r = _cli(*args, *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    a, b = (json.loads((d / "summary.json").read_text()) for d in (whole, part))
    for key in ("final", "best", "selected", "objective"):
        assert a[key] == b[key], key
    clocks = ["wall_time_s", "cpu_time_s"]
    ma, mb = (pd.read_csv(d / "metrics.csv").drop(columns=clocks) for d in (whole, part))
    pd.testing.assert_frame_equal(ma, mb)


@pytest.mark.quick
def test_a_preset_notes_runs_that_hold_out_validation(tmp_path):
    from fedbench.report import presets

    preset = presets.get("diversifed_table1")
    col, row = preset.columns[0], preset.rows[0]
    rows = [{"round": 1, "personal.L.avg": 0.5, "personal.V.avg": 0.4, "global.L.avg": 0.5}]
    run = _run(tmp_path, rows, {**col.match, "algo": row.algo, "split.val_frac": 0.1})
    table, unmatched = preset.build([run])
    assert not unmatched
    assert any("hold out split.val_frac=0.1" in n for n in table.notes)
    assert "best round" in table.title  # the preset's rule unless --select says otherwise
