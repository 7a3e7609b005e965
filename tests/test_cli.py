"""The `fedbench` command end to end, in a temp dir, on real FMNIST."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import zygote

from conftest import CLI_BACKEND, compose, fmnist_available, needs

REPO = Path(__file__).resolve().parents[1]
# This checkout's fedbench, whatever the environment's editable install points at; then the
# caller's PYTHONPATH (where a Hydra plugin the tests look for may be installed).
PATH = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(PATH)}

SMALL = [
    "clients=10",
    "rounds=2",
    "split.train_per_client=100",
    "split.test_per_client=50",
    "model.hidden=[32]",
    "eval.every=1",
    "device=cpu",
]


def fedbench(*args: str, cwd) -> subprocess.CompletedProcess:
    """`fedbench ARGS` as a new process, forked with fedbench imported (tests/zygote.py)."""
    return zygote.run(args, cwd=cwd, env=ENV, timeout=300)


needs_fmnist = pytest.mark.skipif(not fmnist_available(), reason="FMNIST not installed")


@pytest.mark.slow
@needs_fmnist
def test_run_writes_everything(tmp_path):
    out = tmp_path / "run"
    r = fedbench(*SMALL, f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for k in ("L.avg", "L.top5", "L.bottom5", "S.avg", "G.avg", "personal", "global"):
        assert k in r.stdout
    s = json.loads((out / "summary.json").read_text())
    assert (s["algo"], s["data"], s["split"], s["model"], s["clients"]) == (
        "fedavg",
        "fmnist",
        "pat",
        "mlp",
        10,
    )
    assert s["final"]["round"] == 2
    for kind in ("personal", "global"):
        for name in ("L", "S", "G"):
            stats = s["final"][kind][name]
            assert set(stats) == {"avg", "weighted", "std", "top5", "bottom5", "min", "max"}
            assert 0.0 <= stats["bottom5"] <= stats["avg"] <= stats["top5"] <= 1.0
    assert 0.0 <= s["final"]["global"]["all"] <= 1.0
    m = pd.read_csv(out / "metrics.csv")
    assert list(m["round"]) == [1, 2] and "personal.L.avg" in m and "bytes_up" in m
    c = pd.read_csv(out / "clients.csv")
    assert set(c.columns) == {"round", "client", "model", "metric", "value"}
    assert len(c) == 2 * 10 * 2 * 3  # rounds x clients x models x {L,S,G}
    part = json.loads((out / "partition.json").read_text())
    assert len(part["train"]) == 10 and len(part["eval_sets"]["S"]) == 10
    assert not list(out.glob(".*.tmp"))  # no temp file left behind
    assert (out / ".hydra" / "config.yaml").exists()
    # no terminal (a pipe, a SLURM log): one progress line per evaluation
    lines = [ln for ln in r.stdout.splitlines() if "] - round " in ln]
    assert len(lines) == 2 and "round 2/2 | personal L " in lines[1] and "s/round" in lines[1]


@pytest.mark.slow
@needs_fmnist
@pytest.mark.parametrize("mode", ["per_class", "per_client"])
def test_a_huge_dirichlet_alpha_is_the_limit_without_a_warning(tmp_path, mode):
    """split.alpha=1e308 (a "near IID" request at the float maximum): the alpha -> infinity
    limit, every client holding every class; no numpy warning, exit 0."""
    out = tmp_path / "run"
    r = fedbench("split=dir", "split.alpha=1e308", f"split.dir_mode={mode}", *SMALL,
                 "rounds=1", CLI_BACKEND, f"hydra.run.dir={out}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and "overflow" not in r.stderr, r.stderr
    assert "#train 100/100/100, #test 50/50/50, #classes 10/10/10" in r.stdout
    if mode == "per_class":  # each class divided equally: 10 of each of the 10 classes
        from fedbench.data.sources import load_dataset

        labels = load_dataset("fmnist", None, download=False).y_train.numpy()
        train = json.loads((out / "partition.json").read_text())["train"]
        assert all(sorted(labels[idx].tolist()) == sorted(list(range(10)) * 10) for idx in train)


@pytest.mark.slow
@needs_fmnist
def test_multirun_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    r = fedbench(
        "-m",
        "algo=fedavg,local",
        "seed=0,1",
        *SMALL,
        "rounds=1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    runs = sorted(sweep.glob("*/summary.json"))
    assert len(runs) == 4
    algos = sorted(json.loads(p.read_text())["algo"] for p in runs)
    assert algos == ["fedavg", "fedavg", "local", "local"]


@pytest.mark.quick
def test_help_lists_groups(tmp_path):
    r = fedbench("--help", cwd=tmp_path)
    assert r.returncode == 0
    for group in ("algo: ", "data: ", "model: ", "split: "):
        assert group in r.stdout
    assert "fedprox" in r.stdout and "cifar10" in r.stdout and "dir" in r.stdout


@pytest.mark.quick
@pytest.mark.parametrize(
    "args,needle",
    [
        (["data=cifar10", "data.root=/nonexistent", "data.download=false"], "/nonexistent"),
        (["algo=nope"], "valid:"),
        (["model=nope"], "valid:"),
        (["data=nope"], "valid:"),
        (["device=cuda"], "no CUDA"),
        (["rounds=abc"], "rounds"),
        (["split.classes_per_client=12"], "classes"),
        (["optim.name=rmsprop"], "sgd | adam"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    if "cuda" in args[0]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    if "classes_per_client" in args[0] and not fmnist_available():
        pytest.skip("FMNIST not installed")
    r = fedbench(*args, f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "[INFO]" not in ln]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("fedbench:") and needle in lines[0]


@pytest.mark.slow
@needs_fmnist
def test_failed_job_does_not_stop_the_sweep(tmp_path):
    """The other jobs run; the sweep then exits 1 with one line per failed job, and the
    failed job's directory holds its config and error (fedbench-report lists it)."""
    sweep = tmp_path / "sweep"
    r = fedbench(
        "-m",
        "split.classes_per_client=12,2",
        *SMALL,
        "rounds=1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert r.returncode == 1, r.stderr
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("fedbench: job ")]
    assert len(failed) == 1 and "classes" in failed[0], r.stderr
    assert "Traceback" not in r.stderr
    assert len(list(sweep.glob("*/summary.json"))) == 1
    assert len(list(sweep.glob("*/.hydra/config.yaml"))) == 2
    (err,) = sweep.glob("*/error.txt")
    assert "classes" in err.read_text()


@pytest.mark.quick
def test_missing_launcher_plugin_is_one_line(tmp_path):
    from fedbench.cli import plugin_installed

    if plugin_installed("hydra_plugins.hydra_joblib_launcher"):
        pytest.skip("the joblib launcher is installed")
    r = fedbench("-m", "hydra/launcher=joblib_local", "seed=0,1", cwd=tmp_path)
    assert r.returncode == 2 and "pip install" in r.stderr


# --------------------------------------------------------------------------- one cell = one command
def script_cells(script: str, *tables: str) -> list[list[str]]:
    """The fedbench commands a reproduce script runs (DRY_RUN), one seed, as argument lists."""
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / script), *tables],
        capture_output=True,
        text=True,
        env={**ENV, "DRY_RUN": "1", "SEEDS": "0"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [ln.split()[3:] for ln in r.stdout.splitlines() if ln.startswith("+ fedbench -m ")]


# The keys a table script may sweep (its columns); anything else would be a per-method
# setting the one-cell command lacks.
SWEEP_KEYS = {"split.alpha", "participation", "local_epochs", "algo.rho", "algo.personal_layers"}


# What a table script adds to every sweep beside its cells' overrides: where (a fixed
# directory per cell) and resume=auto (a finished cell is skipped, an interrupted one resumes).
CELL_SUBDIR = "'hydra.sweep.subdir=${fedbench.cell:}'"
PLACEMENT = ("hydra.sweep.dir=", CELL_SUBDIR, "resume=auto")


def first_job(args: list[str]) -> list[str]:
    """A sweep's first cell: each comma list's first value, without its placement."""
    return [a.split(",")[0] for a in args if not a.startswith(PLACEMENT)]


@pytest.mark.quick
@pytest.mark.parametrize(
    "script", ["reproduce_diversifed.sh", "reproduce_plgu.sh", "reproduce_fedslr.sh"]
)
def test_table_scripts_only_sweep(script):
    cells = script_cells(script)
    assert len(cells) > 40
    for args in cells:
        keys = [a.split("=")[0] for a in args]
        assert keys[:3] == ["+experiment", "algo", "seed"], args
        assert all(any(a.startswith(p) for a in args) for p in PLACEMENT), args
        extra = {k for a, k in zip(args[3:], keys[3:], strict=True) if not a.startswith(PLACEMENT)}
        assert extra <= SWEEP_KEYS, f"{script} adds {extra - SWEEP_KEYS} to {args}"


@pytest.mark.quick
@pytest.mark.parametrize(
    "script,table,preset,algo,cell",
    [
        ("reproduce_diversifed.sh", "table1_fmnist", "diversifed_table1_fmnist", "pfedme", []),
        (
            "reproduce_diversifed.sh",
            "table2_cifar100",
            "diversifed_table2_cifar100",
            "fedcac",
            ["split.alpha=0.01"],
        ),
        ("reproduce_diversifed.sh", "table1_cifar10", "diversifed_table1_cifar10", "fedrod", []),
        ("reproduce_plgu.sh", "t2_tinyimagenet", "plgu_t2_tinyimagenet", "pfedhn", []),
        ("reproduce_plgu.sh", "t3", "plgu_t3_cifar10", "plgu_ghn", ["local_epochs=1"]),
        ("reproduce_fedslr.sh", "t1_cifar10_dir", "fedslr_t1_cifar10_dir", "ditto", []),
        ("reproduce_fedslr.sh", "t1_cifar100_iid", "fedslr_t1_cifar100_iid", "perfedavg", []),
        ("reproduce_fedslr.sh", "t1_tinyimagenet_dir", "fedslr_t1_tinyimagenet_dir", "fedslr", []),
    ],
)
def test_one_cell_command_is_the_table_scripts_run(script, table, preset, algo, cell):
    """`fedbench +experiment=<preset> algo=<algo>` (+ the column) composes exactly the config
    the table script runs for that cell."""
    runs = [a for a in script_cells(script, table) if f"algo={algo}" in a]
    assert len(runs) == 1
    ours = compose([f"+experiment={preset}", f"algo={algo}", "seed=0", *cell])
    theirs = compose(first_job(runs[0]))
    assert ours == theirs


@pytest.mark.quick
def test_every_named_check_composes_and_lists():
    """scripts/reproduce_checks.sh: --list names every check; each check's sweeps (DRY_RUN)
    compose as fedbench configs (their first cells), into the check's own folder; an unknown
    check is one line and exit 2."""
    r = subprocess.run(["bash", str(REPO / "scripts" / "reproduce_checks.sh"), "--list"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    checks = [ln.split()[0] for ln in r.stdout.splitlines()]
    assert r.returncode == 0 and {"compare_methods", "method_settings"} <= set(checks)
    for check in checks:
        cells = script_cells("reproduce_checks.sh", check)
        assert cells, check
        for args in cells:
            assert any(a.startswith("hydra.sweep.dir=") and check in a for a in args), args
            compose(first_job(args))
    r = subprocess.run(["bash", str(REPO / "scripts" / "reproduce_checks.sh"), "nope"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown check nope" in r.stderr


@pytest.mark.quick
def test_paper_method_settings_come_with_the_preset():
    from omegaconf import OmegaConf

    from fedbench.report.presets import DIVERSIFED_ALGO_SETTINGS

    def algo(*over):
        return OmegaConf.to_container(compose(list(over)).algo, resolve=True)

    for preset in (
        "diversifed_table1_fmnist",
        "diversifed_table2_cifar100",
        "diversifed_table3_pathmnist",
        "diversifed_table7_cifar10",
    ):
        for name, settings in DIVERSIFED_ALGO_SETTINGS.items():  # the report's rows agree
            a = algo(f"+experiment={preset}", f"algo={name}")
            for key, value in settings.items():
                assert a[key.removeprefix("algo.")] == value, (preset, name, key)
    assert algo("algo=pfedme")["eval_model"] == "theta"  # the paper's default without a preset
    assert algo("algo=fedrod")["eval_model"] == "trained"
    for preset, tau, beta in (
        ("diversifed_table1_cifar100", 0.4, 170),
        ("diversifed_table2_cifar100", 0.4, 170),
        ("diversifed_table1_cifar10", 0.5, 100),
    ):
        a = algo(f"+experiment={preset}", "algo=fedcac")
        assert (a["tau"], a["beta"]) == (tau, beta)
    assert algo("+experiment=diversifed_table1_cifar100", "algo=pfedme")["eval_model"] == "theta"
    # PLGU: E epochs of local work for every method; the hypernetwork generates the classifier
    a = algo("+experiment=plgu_t1_tinyimagenet", "algo=pfedme")
    assert a["local_rounds"] is None
    for name in ("pfedhn", "plgu_ghn"):
        a = algo("+experiment=plgu_t2_tinyimagenet", f"algo={name}", "local_epochs=3")
        assert a["inner_epochs"] == 3 and (a["hypernet"]["generate"], a["hypernet"]["k"]) == (
            "last_k",
            1,
        )
    assert algo("+experiment=plgu_t2_cifar10", "algo=fedrep")["head_epochs"] == 5
    assert algo("+experiment=plgu_t1_cifar10", "algo=fedavg") == {
        "name": "fedavg",
        "weighting": "samples",
    }
    a = algo("+experiment=plgu_ghn_layerwise_cifar10")
    assert a["name"] == "plgu_ghn" and a["hypernet"]["k"] == 2


@pytest.mark.quick
def test_layerwise_preset_scores_two_layers():
    """plgu_ghn_layerwise_cifar10 generates two target layers (PLGU's presets one, where the
    scores are all 1)."""
    from omegaconf import OmegaConf

    from fedbench.models import build_model
    from fedbench.models.hypernet import select_targets

    for preset, n_layers in (("plgu_ghn_layerwise_cifar10", 2), ("plgu_t2_cifar10", 1)):
        cfg = compose([f"+experiment={preset}", "algo=plgu_ghn"])
        m = OmegaConf.to_container(cfg.model, resolve=True)
        model = build_model(m.pop("name"), (3, 32, 32), 10, **m)
        hn = cfg.algo.hypernet
        gen = set(select_targets(model, hn.generate, hn.k).generated)
        layers = [lay for lay in model.layers() if set(lay.params) & gen]
        assert len(layers) == n_layers


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", ["reproduce_diversifed.sh", "reproduce_plgu.sh", "reproduce_fedslr.sh"]
)
@pytest.mark.long
def test_every_table_cell_passes_the_checks(script):
    """Every cell of the tables composes and passes the Params schema (no key of one method
    leaks into another's config)."""
    from fedbench.cli import refusal

    for args in script_cells(script):
        assert refusal(first_job(args)) is None, args


@pytest.mark.slow
@needs_fmnist
def test_layerwise_preset_scores_differ_and_k1_scores_are_one(tmp_path, monkeypatch):
    """PLGU-GHN's first hypernetwork update on the two presets' hypernetwork settings (FMNIST
    and ResNet-8 for speed): one generated layer scores [1.0] (SAM); the layer-wise preset's
    two layers score differently (seen: [0.69, 1.31])."""
    import fedbench.algorithms.plgu as plgu
    from fedbench.runner import Run

    seen = []
    real = plgu.normalize_scores

    def spy(xi, rule):
        out = real(xi, rule)
        seen.append(out.detach().cpu().tolist())
        return out

    monkeypatch.setattr(plgu, "normalize_scores", spy)
    small = [
        "data=fmnist",
        "model=resnet8",
        "clients=4",
        "participation=2",
        "rounds=1",
        "split.classes_per_client=2",
        "split.train_per_client=50",
        "split.test_per_client=20",
        "local_epochs=1",
        "device=cpu",
    ]
    for preset, extra, n in (
        ("plgu_ghn_layerwise_cifar10", [], 2),
        ("plgu_t2_cifar10", ["+model.layer_unit=module"], 1),
    ):
        seen.clear()
        cfg = compose([f"+experiment={preset}", "algo=plgu_ghn", *small, *extra])
        Run(cfg, tmp_path / preset, progress=False).run()
        assert len(seen[0]) == n
        if n == 1:
            assert seen[0] == pytest.approx([1.0])
        else:
            assert abs(seen[0][0] - seen[0][1]) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,algo",
    [("fedslr_t1_cifar10_dir", "fedslr"), ("fedpg_table1_cifar10", "fedpg")],
)
@pytest.mark.long
def test_paper_cell_runs_on_cifar_format_files(tmp_path, preset, algo):
    """A FedSLR / FedPG Table 1 cell (ResNet-18 GN with FedSLR's prox; FedPG's CNN) runs a
    round on CIFAR-10 files in their own pickle format, shrunk to 4 clients."""
    from test_plgu import fake_cifar10

    from fedbench.runner import Run

    # few test images: ResNet-18's evaluation of every client on L, S and G is the cost
    fake_cifar10(tmp_path / "data", n_train=200, n_test=40)
    cfg = compose(
        [f"+experiment={preset}", f"algo={algo}", f"data.root={tmp_path / 'data'}"]
        + ["data.download=false", "clients=4", "participation=2", "rounds=1", "device=cpu"]
        + ["split.test_per_client=5", "local_epochs=1", "batch_size=50"]
    )
    s = Run(cfg, tmp_path / "run", progress=False).run()
    assert s["data"] == "cifar10" and s["final"]["round"] == 1
    assert s["size"]["params_global_M"] > 0 and s["size"]["comm_MB"] > 0


# --------------------------------------------------------------------------- tuning
@pytest.mark.quick
def test_objective_reads_the_summary():
    from fedbench.runner import objective

    s = {"final": {"personal": {"L": {"avg": 0.8}}, "global": {"all": 0.5}},
         "best": {"personal": {"L": {"avg": 0.9}}}}  # fmt: skip
    assert objective(s, "personal.L.avg") == 0.8
    assert objective(s, "personal.L.avg", "best") == 0.9
    assert objective(s, "global.all") == 0.5
    assert objective(s, "global.L.avg") != objective(s, "global.L.avg")  # NaN: no such set


@pytest.mark.slow
@needs_fmnist
def test_optuna_study_tunes_the_learning_rate(tmp_path):
    """Hydra's Optuna sweeper drives fedbench: each trial returns its final personal L
    accuracy; the study's best is the best trial's."""
    needs("hydra_plugins.hydra_optuna_sweeper", "optuna")
    sweep = tmp_path / "study"
    r = fedbench("-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.n_trials=3", *SMALL,
                 f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    import yaml

    res = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    trials = {}
    for p in sweep.glob("*/summary.json"):
        lr = yaml.safe_load((p.parent / ".hydra" / "config.yaml").read_text())["optim"]["lr"]
        trials[lr] = json.loads(p.read_text())["final"]["personal"]["L"]["avg"]
    assert len(trials) == 3
    assert res["best_value"] == max(trials.values())
    assert trials[res["best_params"]["optim.lr"]] == res["best_value"]


@pytest.mark.slow
@needs_fmnist
def test_joblib_launcher_runs_the_sweep_in_parallel_processes(tmp_path):
    """Hydra's joblib launcher (the joblib_local preset): two jobs in two worker processes,
    each its own run directory, and a failed job still listed by the sweep."""
    needs("hydra_plugins.hydra_joblib_launcher", "joblib")
    sweep = tmp_path / "sweep"
    r = fedbench("-m", "hydra/launcher=joblib_local", "hydra.launcher.n_jobs=2",
                 "algo=fedavg,local", *SMALL, CLI_BACKEND, f"hydra.sweep.dir={sweep}",
                 cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    algos = sorted(json.loads(p.read_text())["algo"] for p in sweep.glob("*/summary.json"))
    assert algos == ["fedavg", "local"]
    assert not list(sweep.glob("*/.fedbench.lock"))  # each worker released its directory
    r = fedbench("-m", "hydra/launcher=joblib_local", "split.classes_per_client=2,12", *SMALL,
                 CLI_BACKEND, f"hydra.sweep.dir={tmp_path / 'bad'}", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("fedbench: job ")]) == 1
