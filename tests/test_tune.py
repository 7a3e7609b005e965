"""Equal-budget tuning (fedbench/tune.py, scripts/tune.sh): search spaces become optuna
dimensions, a study draws from its history alone, refuses to mix settings, survives a
kill -9 and finishes its budget, and its winners are config files that tuned=<federation>
applies; the federations are configs with validation sets."""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import CLI_BACKEND, fmnist_available
from fedbench import tune
from fedbench.paths import CONF_DIR

REPO = Path(__file__).resolve().parents[1]
# this checkout's fedbench, the caller's PYTHONPATH after it (where optuna may be installed)
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, os.environ.get("PYTHONPATH", "")
                                                      .split(os.pathsep))]),
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
}  # fmt: skip
NEEDS_OPTUNA = "needs optuna: pip install 'fedbench[optuna]'"
# a tiny fmnist_pat2: 4 clients, 60 training samples each, an MLP 784-16-10
TINY = [
    "clients=4",
    "split.train_per_client=60",
    "split.test_per_client=30",
    "eval.every=1",
    "model.hidden=[16]",
    "device=cpu",
    CLI_BACKEND,
]


def optuna_or_skip():
    return pytest.importorskip("optuna", reason=NEEDS_OPTUNA)


def study(tmp_path: Path, algo: str = "ditto", **kw) -> tune.Study:
    values = dict(
        federation="fmnist_pat2",
        algo=algo,
        trials=4,
        seeds=(100,),
        rounds=2,
        objective="auto",
        sampler_seed=0,
        startup=2,
        overrides=(),
        space=tune.search_space(algo),
        folder=tmp_path / "fmnist_pat2" / algo,
    )
    values.update(kw)
    return tune.Study(**values)


class Fixed:
    """An optuna trial's suggest_* that returns what it is given."""

    def __init__(self, value):
        self.value = value

    def suggest_float(self, name, low, high, log=False):
        return self.value

    def suggest_categorical(self, name, choices):
        return choices[-1]


# --------------------------------------------------------------------------- search spaces
@pytest.mark.quick
def test_every_search_space_becomes_dimensions():
    from fedbench.algorithms import ALGORITHMS

    for algo in ALGORITHMS.names():
        space = tune.search_space(algo)
        lr = space["optim.lr"]
        assert (lr.low, lr.high, lr.log, lr.choices) == (0.001, 0.5, True, None), algo
        for d in space.values():
            assert d.choices or d.low < d.high, (algo, d)
    ditto = tune.search_space("ditto")
    assert ditto["algo.personal_epochs"].choices == (1, 2, 5)
    assert tune.search_space("apfl")["algo.adaptive"].choices == (False, True)
    with pytest.raises(tune.TuneError, match="a choice"):
        tune.Dimension.parse("optim.lr", "0.1")


@pytest.mark.quick
def test_drawn_floats_keep_three_digits_inside_the_range():
    d = tune.Dimension.parse("optim.lr", "tag(log, interval(0.001, 0.5))")
    assert d.suggest(Fixed(0.0123456)) == 0.0123
    assert d.suggest(Fixed(0.49999)) == 0.5  # rounded up to the end, not beyond it
    assert d.suggest(Fixed(0.0009996)) == 0.001
    c = tune.Dimension.parse("algo.k", "choice(1, 3, 5)")
    assert c.suggest(Fixed(None)) == 5


@pytest.mark.quick
def test_values_reach_the_command_line_exactly():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for value in (0.0123, 1e-05, 0.5, 3, True, False, None, 2.0):
        parsed = parser.parse_override(f"k={tune.override_text(value)}").value()
        assert parsed == value and type(parsed) is type(value), value


# --------------------------------------------------------------------------- drawing
@pytest.mark.quick
def test_a_draw_is_a_function_of_the_history(tmp_path):
    """The same history draws the same values (so a resumed study draws what an
    uninterrupted one does); every value is inside its dimension."""
    optuna_or_skip()
    s = study(tmp_path)
    history = []
    for n in range(4):  # 2 at random, then TPE over what came before
        a, b = tune.draw(s, history), tune.draw(s, list(history))
        assert a == b
        for key, d in s.space.items():
            assert a[key] in d.choices if d.choices else d.low <= a[key] <= d.high
        history.append(tune.Trial(n, a, state="complete", value=0.1 * n))
    failed = [*history[:2], tune.Trial(2, history[2].params, state="failed")]
    assert tune.draw(s, failed) == tune.draw(s, list(failed))


@pytest.mark.quick
def test_the_winner_is_the_best_complete_trial_and_the_earlier_on_a_tie():
    trials = [
        tune.Trial(0, {}, state="complete", value=0.7),
        tune.Trial(1, {}, state="failed"),
        tune.Trial(2, {}, state="complete", value=0.8),
        tune.Trial(3, {}, state="complete", value=0.8),
        tune.Trial(4, {}, state="running"),
    ]
    assert tune.best_trial(trials).number == 2
    assert tune.best_trial(trials[:2]).number == 0
    assert tune.best_trial([trials[1], trials[4]]) is None


@pytest.mark.quick
def test_a_study_folder_refuses_other_settings(tmp_path):
    s = study(tmp_path)
    s.folder.mkdir(parents=True)
    tune.check_identity(s)
    tune.check_identity(study(tmp_path, trials=12))  # a larger budget continues it
    with pytest.raises(tune.TuneError, match="seeds"):
        tune.check_identity(study(tmp_path, seeds=(100, 101)))
    with pytest.raises(tune.TuneError, match="overrides"):
        tune.check_identity(study(tmp_path, overrides=("clients=8",)))
    tune.check_identity(study(tmp_path, overrides=("engine.backend=sequential",)))  # how, not what


@pytest.mark.quick
def test_the_loop_resumes_a_running_trial_first_and_stops_at_the_budget(tmp_path, monkeypatch):
    """A trial left `running` (a killed study) is run again with its own values before any
    new one is drawn; a study with its trials runs nothing; a larger budget draws more."""
    s = study(tmp_path, trials=3)
    s.folder.mkdir(parents=True)
    tune.check_identity(s)
    tune.write_trial(s, tune.Trial(0, {"optim.lr": 0.1}, state="complete", value=0.05))
    tune.write_trial(s, tune.Trial(1, {"optim.lr": 0.2}))  # running: was killed
    ran, drawn = [], []

    def fake_run(study_, trial, quiet=False):
        ran.append((trial.number, trial.params))
        trial.state, trial.value = "complete", trial.params["optim.lr"]
        tune.write_trial(study_, trial)
        return trial

    def fake_draw(study_, history):
        drawn.append(len(history))
        return {"optim.lr": 0.3}

    monkeypatch.setattr(tune, "run_trial", fake_run)
    monkeypatch.setattr(tune, "draw", fake_draw)
    winner = tune.run_study(s, say=lambda line: None)
    assert ran == [(1, {"optim.lr": 0.2}), (2, {"optim.lr": 0.3})] and drawn == [2]
    assert winner.number == 2 and [t.state for t in tune.load_trials(s)] == ["complete"] * 3
    ran.clear()
    assert tune.run_study(s, say=lambda line: None).number == 2 and ran == []
    more = tune.run_study(study(tmp_path, trials=4), say=lambda line: None)
    assert [n for n, _ in ran] == [3] and more.number == 2  # 0.3 again: the earlier wins


# A stand-in for `fedbench` (tune.fedbench_argv): acts as FAKE says in its hydra.run.dir.
FAKE_RUN = """
import json, os, signal, sys
where = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir="))
os.makedirs(where, exist_ok=True)
act = os.environ["FAKE"]
if act == "ok":
    obj = {"metric": "personal.V.avg", "value": 0.25 + 0.5 * ("seed=101" in sys.argv)}
    times = {"wall_time_s": 30.0, "cpu_time_s": 24.0 + 6 * ("seed=101" in sys.argv)}
    json.dump({"objective": obj, **times}, open(os.path.join(where, "summary.json"), "w"))
elif act == "fail":
    open(os.path.join(where, "error.txt"), "w").write("loss is NaN at round 3\\nmore\\n")
    sys.exit(1)
elif act == "refuse":
    print("fedbench: algo.lam=-1 must be >= 0", file=sys.stderr)
    sys.exit(2)
else:
    os.kill(os.getpid(), signal.SIGTERM)
"""


@pytest.mark.quick
@pytest.mark.parametrize("act", ["ok", "fail", "refuse", "killed"])
def test_a_trials_runs_end_as_complete_failed_refused_or_interrupted(tmp_path, monkeypatch, act):
    """The mean over the seeds; a run's error.txt fails the trial (the study goes on); a
    refusal before the run stops the study (one line); a signal stops it to resume."""
    monkeypatch.setattr(tune, "fedbench_argv", lambda: [sys.executable, "-c", FAKE_RUN])
    monkeypatch.setenv("FAKE", act)
    s = study(tmp_path, seeds=(100, 101))
    trial = tune.Trial(0, {"optim.lr": 0.01})
    if act == "ok":
        done = tune.run_trial(s, trial, quiet=True)
        assert (done.state, done.value) == ("complete", 0.5)
        assert done.values == {"100": 0.25, "101": 0.75}
        assert json.loads((s.folder / "trial_000" / "trial.json").read_text())["value"] == 0.5
        # what its runs took, summed over the seeds, in the record and the status line
        assert done.seconds == {"wall": 60.0, "cpu": 54.0}
        tune.check_identity(s)  # writes study.json
        assert "runs took 0.9 min (cpu, 1 trials)" in tune.status_line(s)
    elif act == "fail":
        done = tune.run_trial(s, trial, quiet=True)
        assert done.state == "failed" and done.value is None
        assert done.error == "seed 100: loss is NaN at round 3; seed 101: loss is NaN at round 3"
    elif act == "refuse":
        with pytest.raises(tune.TuneError, match=r"trial 1 seed 100 was refused: algo.lam=-1"):
            tune.run_trial(s, trial, quiet=True)
    else:
        with pytest.raises(tune.Interrupted) as e:
            tune.run_trial(s, trial, quiet=True)
        assert e.value.code == 128 + signal.SIGTERM
    if act != "ok" and act != "fail":
        assert not (s.folder / "trial_000" / "trial.json").exists()  # still to run


# --------------------------------------------------------------------------- the winners
def compose_with(conf: Path, overrides: list[str]):
    return tune.compose_run([*overrides, f"hydra.searchpath=[file://{conf}]"])


@pytest.mark.quick
def test_the_winner_file_is_applied_by_tuned_federation(tmp_path):
    """A winner written for a federation is what tuned=<federation> composes. The federation
    is a copy of fmnist_pat2 under another name in the test's own conf: fedbench's conf/tuned
    holds real winners for fmnist_pat2, and fedbench's conf comes first on the search path."""
    conf = tmp_path / "conf"
    (conf / "federation").mkdir(parents=True)
    (conf / "federation" / "tiny_pat2.yaml").write_text(
        (CONF_DIR / "federation" / "fmnist_pat2.yaml").read_text()
    )
    s = study(tmp_path, trials=3, federation="tiny_pat2")
    winner = tune.Trial(
        1,
        {"optim.lr": 0.0123, "algo.lam": 0.442, "algo.personal_epochs": 2},
        state="complete",
        value=0.875,
        metric="personal.V.avg",
    )
    trials = [tune.Trial(0, {}, state="failed"), winner, tune.Trial(2, {}, state="complete")]
    path = tune.write_tuned(s, winner, trials, conf / "tuned")
    assert path == conf / "tuned" / "tiny_pat2" / "ditto.yaml"
    text = path.read_text()
    assert text.startswith("# @package _global_\n")
    for words in (
        "3 trials (2 complete, 1 failed)",
        "2 rounds",
        "seed(s) 100",
        "personal.V.avg",
        "validation-selected",
        "trial 2 of 3, objective 0.875",
        "conf/search/ditto.yaml",
    ):
        assert words in text, words  # fmt: skip
    base = ["+federation=tiny_pat2", "algo=ditto"]
    cfg = compose_with(conf, [*base, "tuned=tiny_pat2"])
    assert (cfg.optim.lr, cfg.algo.lam, cfg.algo.personal_epochs) == (0.0123, 0.442, 2)
    assert cfg.split.val_frac == 0.1 and cfg.clients == 20  # the federation's
    default = compose_with(conf, base)
    assert (default.optim.lr, default.algo.lam) == (0.05, 0.1)  # tuned=none: the defaults
    assert compose_with(conf, [*base, "tuned=tiny_pat2", "optim.lr=0.3"]).optim.lr == 0.3
    # an algorithm without a winner runs at its defaults under tuned=<federation>
    assert compose_with(conf, [*base[:1], "algo=fedavg", "tuned=tiny_pat2"]).optim.lr == 0.05


@pytest.mark.quick
def test_tuned_and_federation_mistakes_are_one_line():
    from fedbench.cli import refusal

    assert refusal(["+tuned=none"]) == (
        "fedbench: tuned is chosen, not added: write tuned=<federation> (no +)"
    )
    line = refusal(["tuned=nowhere"])
    assert line.startswith("fedbench: unknown tuned 'nowhere'; valid: ") and "none" in line
    assert refusal(["+federation=nowhere"]).startswith(
        "fedbench: unknown federation 'nowhere'; valid: fmnist_dir03, fmnist_pat2"
    )


@pytest.mark.quick
@pytest.mark.parametrize("name", tune.federations())
def test_a_federation_holds_validation_sets_and_leaves_methods_alone(name):
    from fedbench.config import check_config

    text = (CONF_DIR / "federation" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    keys = yaml.safe_load(text)
    assert not {"optim", "algo", "seed"} & set(keys)  # tuned=<federation> decides those
    cfg = tune.compose_run([f"+federation={name}", "algo=ditto"])
    check_config(cfg)
    assert cfg.split.val_frac == 0.1 and cfg.data.name == "fmnist" and cfg.clients == 20
    assert cfg.eval.select == "auto" and cfg.objective.metric == "auto"  # validation, then


@pytest.mark.quick
@pytest.mark.parametrize(
    "args, words",
    [
        (["nowhere"], "unknown federation 'nowhere'"),
        (["fmnist_pat2", "--algos", "fedavg,nope"], "unknown algo 'nope'"),
        (["fmnist_pat2", "--seeds", "1,x"], "--seeds '1,x'"),
        (["fmnist_pat2", "--algos", "fedavg", "clients=-1"], "clients=-1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, words):
    code = tune.main([*args, "--dry-run", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_without_optuna_the_line_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna fails
    assert tune.main(["fmnist_pat2", "--algos", "fedavg"]) == 2
    assert "pip install 'fedbench[optuna]'" in capsys.readouterr().err


# --------------------------------------------------------------------------- end to end
def tune_cmd(out: Path, tuned: Path) -> list[str]:
    return [sys.executable, "-m", "fedbench.tune", "fmnist_pat2", "--algos", "fedavg,ditto",
            "--trials", "2", "--rounds", "2", "--out", str(out), "--tuned-dir", str(tuned),
            "--quiet", *TINY]  # fmt: skip


def trials_of(out: Path) -> dict[str, dict]:
    found = {}
    for p in sorted(out.glob("fmnist_pat2/*/trial_*/trial.json")):
        found[f"{p.parent.parent.name}/{p.parent.name}"] = json.loads(p.read_text())
    return found


def lock_free(run: Path) -> bool:
    """No process holds the run directory's lock (the run stopped)."""
    try:
        fd = os.open(run / ".fedbench.lock", os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_study_killed_mid_trial_finishes_its_budget_when_run_again(tmp_path):
    """kill -9 of the tuning process while a trial's run is under way: the run stops with
    it; the same command again resumes that trial with its own values and ends with
    exactly 2 complete trials per algorithm and each winner in tuned/, which tuned=
    applies."""
    optuna_or_skip()
    if not fmnist_available():
        pytest.skip("Fashion-MNIST files not installed (apt-get install dataset-fashion-mnist)")
    out, conf = tmp_path / "tune", tmp_path / "conf"
    p = subprocess.Popen(tune_cmd(out, conf / "tuned"), env=ENV, cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip

    def running_run() -> Path | None:
        for name, t in trials_of(out).items():
            run = out / "fmnist_pat2" / name / "seed_100"
            if t["state"] == "running" and (run / ".hydra" / "config.yaml").exists():
                return run
        return None

    t0 = time.monotonic()
    while (run := running_run()) is None:
        assert p.poll() is None, p.communicate()[1][-2000:]
        assert time.monotonic() - t0 < 300, "no trial started"
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    while not lock_free(run):  # the run got SIGTERM when its parent died (PR_SET_PDEATHSIG)
        assert time.monotonic() - t0 < 300, "the trial's run outlived the study"
        time.sleep(0.1)
    before = trials_of(out)
    cut = {k: t["params"] for k, t in before.items() if t["state"] == "running"}

    # the same study through the script: its arguments must make the same study
    script_env = {**ENV, "ALGOS": "fedavg ditto", "TRIALS": "2", "ROUNDS": "2", "SEEDS": "100",
                  "OUT": str(out), "TUNED_DIR": str(conf / "tuned"), "EXTRA": " ".join(TINY),
                  "PYTHON": sys.executable}  # fmt: skip
    r = subprocess.run(["bash", str(REPO / "scripts" / "tune.sh"), "fmnist_pat2"], env=script_env,
                       cwd=tmp_path, text=True, capture_output=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    after = trials_of(out)
    assert sorted(after) == [f"{a}/trial_00{n}" for a in ("ditto", "fedavg") for n in (0, 1)]
    assert all(t["state"] == "complete" and t["value"] > 0 for t in after.values())
    for key, params in cut.items():  # the interrupted trial kept its values
        assert after[key]["params"] == params
        assert "(resumed)" in r.stdout
    for key, t in before.items():  # finished trials are kept as they were
        if t["state"] == "complete":
            assert after[key] == t
    for algo in ("fedavg", "ditto"):
        trials = [t for k, t in after.items() if k.startswith(f"{algo}/")]
        best = max(trials, key=lambda t: (t["value"], -t["number"]))
        text = (conf / "tuned" / "fmnist_pat2" / f"{algo}.yaml").read_text()
        assert f"best: trial {best['number'] + 1} of 2" in text
        # the winner's values (that tuned=<federation> applies a file: the test above; here
        # fedbench's own conf/tuned winners for fmnist_pat2 would come first)
        body = yaml.safe_load(text)
        for key, value in best["params"].items():
            section, name = key.split(".", 1)
            assert body[section][name] == value
        # each trial's run is the one-line command in its trial.json
        assert trials[0]["commands"][0].startswith(f"fedbench +federation=fmnist_pat2 algo={algo}")


@pytest.mark.quick
def test_exported_records_give_the_winner_and_resume(tmp_path):
    """scripts/export_studies.sh keeps study.json and each trial.json (no run folders),
    writes the winner of a study with all its trials from the copied records (its header
    naming the copy: results/tune/... inside the repository), none for a study still short
    of trials; a study copied back resumes from its records alone."""
    optuna_or_skip()
    src = tmp_path / "tune"
    done = study(src, algo="fedavg", trials=2, rounds=100)
    half = study(src, algo="ditto", trials=2, rounds=100)
    for s, values in ((done, [0.5, 0.75]), (half, [0.25])):
        s.folder.mkdir(parents=True)
        tune.check_identity(s)
        for n, v in enumerate(values):
            tune.write_trial(s, tune.Trial(n, {"optim.lr": 0.01 * (n + 1)}, "complete", v))
            (tune.trial_dir(s, n) / "seed_100").mkdir()  # a run folder: not exported
    dest, tuned = tmp_path / "results" / "tune", tmp_path / "tuned"
    env = {**ENV, "TRIALS": "2", "TUNED_DIR": str(tuned), "PYTHON": sys.executable}
    script = REPO / "scripts" / "export_studies.sh"
    r = subprocess.run(["bash", str(script), str(src), str(dest)], env=env, cwd=tmp_path,
                       text=True, capture_output=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == [
        "fmnist_pat2/ditto/study.json", "fmnist_pat2/ditto/trial_000/trial.json",
        "fmnist_pat2/fedavg/study.json", "fmnist_pat2/fedavg/trial_000/trial.json",
        "fmnist_pat2/fedavg/trial_001/trial.json",
    ]  # fmt: skip
    assert not (tuned / "fmnist_pat2" / "ditto.yaml").exists()
    text = (tuned / "fmnist_pat2" / "fedavg.yaml").read_text()
    assert "best: trial 2 of 2" in text and f"the study: {dest}/fmnist_pat2/fedavg\n" in text
    assert yaml.safe_load(text) == {"optim": {"lr": 0.02}}
    back = study(dest, algo="ditto", trials=2, rounds=100)
    assert [t.value for t in tune.load_trials(back)] == [0.25]  # resumes from the record


@pytest.mark.quick
def test_a_failed_trial_steers_the_sampler_away_from_its_region(tmp_path):
    """A diverged trial counts as worse than every finished one (tune.FAILED_AS). On a toy
    objective whose runs diverge for lr > 0.15 (else 1 - |log10 lr - log10 0.05| / 3), at
    most 2 of the 8 TPE draws after 4 random ones diverge (measured: 0-2 over sampler seeds
    0-4; with Optuna's FAIL state, which TPE ignores, 6-8 of 8 did: it kept drawing where
    runs had just diverged)."""
    optuna_or_skip()
    for seed in (1, 3):  # 0 each (seed 0 draws 2: at the bound, so not used)
        s = study(tmp_path, algo="fedavg", trials=12, startup=4, sampler_seed=seed)
        history: list[tune.Trial] = []
        for n in range(12):
            lr = tune.draw(s, history)["optim.lr"]
            if lr > 0.15:
                history.append(tune.Trial(n, {"optim.lr": lr}, state="failed"))
            else:
                value = 1 - abs(math.log10(lr) - math.log10(0.05)) / 3
                history.append(tune.Trial(n, {"optim.lr": lr}, state="complete", value=value))
        assert sum(t.state == "failed" for t in history[4:]) <= 2, seed


@pytest.mark.quick
def test_a_study_from_before_the_failed_rule_is_upgraded_or_refused(tmp_path):
    """study.json without sampler.failed: its draws are today's where no trial failed (the
    file is upgraded); trials drawn after a failed one are named, not silently kept."""
    s = study(tmp_path)
    s.folder.mkdir(parents=True)
    tune.check_identity(s)
    path = s.folder / tune.STUDY_FILE
    old = json.loads(path.read_text())
    del old["identity"]["sampler"]["failed"]
    path.write_text(json.dumps(old))
    for n, state in enumerate(("complete", "complete")):
        tune.write_trial(s, tune.Trial(n, {"optim.lr": 0.01}, state=state, value=0.5))
    tune.check_identity(s)  # no failure: upgraded
    assert json.loads(path.read_text())["identity"]["sampler"]["failed"] == tune.FAILED_AS
    path.write_text(json.dumps(old))
    with pytest.raises(tune.TuneError, match="seeds"):  # another study: refused, unwritten
        tune.check_identity(study(tmp_path, seeds=(100, 101)))
    assert json.loads(path.read_text()) == old
    tune.write_trial(s, tune.Trial(1, {"optim.lr": 0.4}, state="failed"))
    tune.write_trial(s, tune.Trial(2, {"optim.lr": 0.3}, state="complete", value=0.6))
    tune.write_trial(s, tune.Trial(3, {"optim.lr": 0.2}, state="running"))
    with pytest.raises(tune.TuneError, match="trial 2 failed, so trial_002 to trial_003"):
        tune.check_identity(s)
