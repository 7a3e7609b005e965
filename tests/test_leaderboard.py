"""The leaderboard: Friedman and Nemenyi statistics against Demšar (JMLR 2006) and hand
computations, the report's tables, numbers and figures from runs whose values are known
by hand, and scripts/leaderboard.sh end to end on a tiny federation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import CLI_BACKEND, fmnist_available
from fedbench.report import ranking
from fedbench.report.cli import main
from fedbench.report.compare import default_method, paired_interval

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, os.environ.get("PYTHONPATH", "")
                                                      .split(os.pathsep))]),
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
}  # fmt: skip

# Demšar (2006), Table 5a: q_alpha for the Nemenyi test, k = 2..10
DEMSAR_Q05 = (1.960, 2.343, 2.569, 2.728, 2.850, 2.949, 3.031, 3.102, 3.164)
DEMSAR_Q10 = (1.645, 2.052, 2.291, 2.459, 2.589, 2.693, 2.780, 2.855, 2.920)


# --------------------------------------------------------------------------- statistics
@pytest.mark.quick
def test_nemenyi_q_alpha_is_demsars_table():
    for k, (q05, q10) in enumerate(zip(DEMSAR_Q05, DEMSAR_Q10), start=2):
        # the table rounds the studentized range's 3 decimals divided by sqrt(2)
        assert abs(ranking.q_alpha(k, 0.05) - q05) < 1e-3, k
        assert abs(ranking.q_alpha(k, 0.10) - q10) < 1e-3, k
    # k = 2: the range of two normals over sqrt(2) is |N(0, 1)|: the normal's quantiles
    assert abs(ranking.q_alpha(2, 0.05) - 1.959964) < 1e-5
    assert abs(ranking.q_alpha(2, 0.10) - 1.644854) < 1e-5
    assert ranking.q_alpha(43) > ranking.q_alpha(10)  # the leaderboard's k, past the table


@pytest.mark.quick
def test_chi_square_and_f_tails():
    for x in (0.1, 1.0, 4.0, 30.0):  # 2 df: exp(-x / 2) exactly
        assert math.isclose(ranking.chi2_sf(x, 2), math.exp(-x / 2), rel_tol=1e-12)
    assert math.isclose(ranking.chi2_sf(3.841458820694124, 1), 0.05, rel_tol=1e-9)
    assert math.isclose(ranking.chi2_sf(7.814727903251178, 3), 0.05, rel_tol=1e-9)
    for x, d2 in ((0.5, 4), (2.0, 7), (6.0, 30)):  # F(2, d2): (1 + 2x / d2)^(-d2 / 2)
        assert math.isclose(ranking.f_sf(x, 2, d2), (1 + 2 * x / d2) ** (-d2 / 2), rel_tol=1e-10)
    # Demšar's example: F(3, 39) at alpha 0.05 is 2.85 (2.845 to three decimals)
    assert abs(ranking.f_sf(2.845, 3, 39) - 0.05) < 1e-3
    assert ranking.chi2_sf(0.0, 3) == 1.0 and ranking.f_sf(math.inf, 2, 6) == 0.0


@pytest.mark.quick
def test_friedman_on_demsars_worked_example():
    """Demšar, Section 3.2.4: four C4.5 variants on 14 data sets, average ranks 3.143,
    2.000, 2.893, 1.964: chi2_F = 9.28, F_F = 3.69, CD (alpha 0.05) = 1.25."""
    f = ranking.friedman_from_ranks([3.143, 2.000, 2.893, 1.964], 14)
    assert round(f.chi2, 2) == 9.28 and round(f.ff, 2) == 3.69
    assert (f.df1, f.df2) == (3, 39) and f.p_ff < 0.05
    assert round(f.cd(), 2) == 1.25 and round(ranking.critical_difference(4, 14), 2) == 1.25


@pytest.mark.quick
def test_friedman_from_scores_with_a_tie_by_hand():
    """3 blocks x 3 methods; block 2 ties the first two (ranks 1.5, 1.5): average ranks
    1.5, 1.5, 3; chi2_F = 12*3/(3*4) * (1.5^2 + 1.5^2 + 3^2 - 3*16/4) = 4.5, p = exp(-2.25);
    F_F = 2 * 4.5 / (3*2 - 4.5) = 6 with (2, 4) df, p = (1 + 2*6/4)^-2 = 1/16."""
    scores = np.array([[0.9, 0.8, 0.7], [0.8, 0.8, 0.6], [0.7, 0.9, 0.5]])
    assert ranking.block_ranks(scores).tolist() == [[1, 2, 3], [1.5, 1.5, 3], [2, 1, 3]]
    f = ranking.friedman(scores)
    assert f.avg_ranks == (1.5, 1.5, 3.0)
    assert math.isclose(f.chi2, 4.5) and math.isclose(f.p_chi2, math.exp(-2.25))
    assert math.isclose(f.ff, 6.0) and math.isclose(f.p_ff, 1 / 16)
    one_order = ranking.friedman(np.array([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]]))
    assert one_order.ff == math.inf and one_order.p_ff == 0.0  # every block agrees


@pytest.mark.quick
def test_cliques_join_ranks_closer_than_the_cd():
    assert ranking.cliques([1.0, 1.5, 2.9, 3.0, 4.2], 1.0) == [(0, 1), (2, 3)]
    assert ranking.cliques([1.0, 1.5, 2.9, 3.0, 4.2], 5.0) == [(0, 4)]
    assert ranking.cliques([1.0, 3.0], 1.0) == []


# --------------------------------------------------------------------------- the report
def write_run(root: Path, fed: str, algo: str, seed: int, acc: float, glob: float | None,
              tuned: str, failed: bool = False) -> None:  # fmt: skip
    """A finished run of the leaderboard's shape, its numbers chosen by hand: personal
    L.avg = `acc` at round 1 (the validation-selected round: V.avg 0.9, then 0.8) and
    acc - 0.3 at round 2; bottom 5% = acc - 0.1; the global model (where `glob` is given)
    `glob` at round 2, its own validation round; 2 rounds in 4 s, 1.5 MB per round."""
    path = root / fed / algo / f"seed={seed}"
    (path / ".hydra").mkdir(parents=True)
    cfg = {
        "seed": seed, "rounds": 2, "clients": 4, "participation": 0.5, "local_epochs": 1,
        "data": {"name": "fmnist"}, "model": {"name": "mlp"},
        "split": {"name": "pat", "classes_per_client": 2, "val_frac": 0.1},
        "algo": {"name": algo}, "optim": {"lr": 0.01 if tuned == fed else 0.05},
        "eval": {"select": "auto"},
    }  # fmt: skip
    if algo == "ditto":
        cfg["algo"].update(lam=0.5, personal_epochs="${local_epochs}")
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    choices = {"federation": fed, "tuned": tuned, "algo": algo, "tuned@_global_": f"{tuned}/{algo}"}
    lines = ["hydra:", "  runtime:", "    version: 1.3.2", "    choices:"]
    lines += [f"      {k}: {v}" for k, v in choices.items()] + ["  verbose: false"]
    (path / ".hydra" / "hydra.yaml").write_text("\n".join(lines) + "\n")
    if failed:
        return
    rows = []
    for t, (a, v) in enumerate(((acc, 0.9), (acc - 0.3, 0.8)), start=1):
        row = {"round": t, "wall_time_s": 2.0 * t, "comm_MB": 1.5,
               "personal.L.avg": a, "personal.L.bottom5": a - 0.1, "personal.V.avg": v}  # fmt: skip
        if glob is not None:
            row.update({"global.L.avg": glob - 0.1 * (2 - t), "global.V.avg": 0.5 + 0.1 * t,
                        "global.L.bottom5": glob - 0.2})  # fmt: skip
        rows.append(row)
    pd.DataFrame(rows).to_csv(path / "metrics.csv", index=False)
    summary = {"algo": algo, "seed": seed, "rounds": 2, "wall_time_s": 4.0,
               "size": {"comm_MB": 1.5}, "final": {"round": 2}}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))


# personal accuracy at the validation round: federation -> algo -> (seed 0, seed 1)
ACC = {
    "fa": {"fedavg": (0.70, 0.72), "local": (0.80, 0.78), "ditto": (0.85, 0.83)},
    "fb": {"fedavg": (0.60, 0.64), "local": (0.62, 0.58), "ditto": (0.66, 0.61)},
}


@pytest.fixture
def board(tmp_path) -> Path:
    root = tmp_path / "board"
    for fed, algos in ACC.items():
        for algo, accs in algos.items():
            for seed, acc in enumerate(accs):
                glob = None if algo == "local" else 0.5 + 0.01 * seed
                write_run(
                    root, fed, algo, seed, acc, glob, tuned="none" if algo == "local" else fed
                )
    write_run(root, "fa", "fedprox", 0, 0.0, None, tuned="fa", failed=True)
    return root


def report(board: Path, capsys, *args: str) -> str:
    code = main([str(board), "--preset", "leaderboard", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def by_method(csv_text: str, table: str) -> pd.DataFrame:
    import io

    frame = pd.read_csv(io.StringIO(csv_text), keep_default_na=False, na_values=[""])
    return frame[frame["table"] == table]


@pytest.mark.quick
def test_leaderboard_ranks_and_tests_by_hand(board, capsys):
    """Blocks (fa, 0) (fa, 1) (fb, 0) (fb, 1) rank fedavg 3 3 3 1, local 2 2 2 3, ditto
    1 1 1 2: average ranks 2.5, 2.25, 1.25; chi2_F = 12*4/(3*4) * (2.5^2 + 2.25^2 +
    1.25^2 - 12) = 3.5; F_F = 3 * 3.5 / (4*2 - 3.5) = 7/3 with (2, 6) df, p = (1 + 2 *
    (7/3) / 6)^-3; CD = q_0.05(3) sqrt(3*4 / (6*4)). fedprox (a failed run) is not ranked."""
    out = report(board, capsys)
    lines = out.splitlines()
    order = [ln.split()[0] for ln in lines[4:8]]
    assert order == ["ditto", "local", "fedavg", "fedprox"], lines[:8]
    assert lines[4].split()[-1] == "1.25" and lines[6].split()[-1] == "2.50"
    assert "84.00 ± 1.41 (#1)" in lines[4]  # fa: (85 + 83) / 2, rank 1 there
    assert "chi2_F=3.50 (p=0.174)" in out and f"p={math.exp(-1.75):.3g}" in out
    assert f"F_F=2.33 with (2, 6) df (p={(1 + 2 * (7 / 3) / 6) ** -3:.3g})" in out
    cd = ranking.q_alpha(3) * math.sqrt(12 / 24)
    assert f"CD={cd:.2f}" in out and "N=4 blocks" in out and "k=3 methods" in out
    assert "fedprox: not ranked, no finished run for fa seed 0" in out
    assert "runs not at their federation's tuned values (tuned=<federation>): local" in out


@pytest.mark.quick
def test_seconds_per_round_cpu_then_median_wall(tmp_path):
    """CPU time over rounds where recorded; else the median wall interval per round, which a
    pause in one interval does not move; else wall_time_s / rounds."""
    from fedbench.report.collect import read_run
    from fedbench.report.leaderboard import seconds_per_round

    write_run(tmp_path, "fa", "fedavg", 0, 0.8, None, tuned="fa")
    path = tmp_path / "fa" / "fedavg" / "seed=0"
    # rounds 1..5 at 2 s each, but the job stood still 100 s between rounds 3 and 4
    wall = [2.0, 4.0, 6.0, 108.0, 110.0]
    rows = [{"round": t, "wall_time_s": w, "personal.L.avg": 0.8} for t, w in enumerate(wall, 1)]
    pd.DataFrame(rows).to_csv(path / "metrics.csv", index=False)
    summary = {"rounds": 5, "wall_time_s": 110.0}
    (path / "summary.json").write_text(json.dumps(summary))
    assert seconds_per_round(read_run(path)) == 2.0  # intervals 2 2 102 2: median 2
    (path / "summary.json").write_text(json.dumps({**summary, "cpu_time_s": 9.0}))
    assert seconds_per_round(read_run(path)) == pytest.approx(1.8)
    (path / "metrics.csv").write_text("round,personal.L.avg\n5,0.8\n")
    (path / "summary.json").write_text(json.dumps(summary))
    assert seconds_per_round(read_run(path)) == 22.0


@pytest.mark.quick
def test_exported_cell_keeps_its_federation_from_overrides(board, capsys):
    """scripts/export_results.sh keeps config.yaml and overrides.yaml, not hydra.yaml: the
    federation and the tuned values come from the overrides, and the board is the same."""
    before = report(board, capsys, "--format", "csv")
    for hydra in board.glob("*/*/*/.hydra/hydra.yaml"):
        fed, algo = hydra.parents[3].name, hydra.parents[2].name
        tuned = "none" if algo == "local" else fed
        ov = [f"+federation={fed}", f"tuned={tuned}", f"algo={algo}", "seed=0"]
        (hydra.parent / "overrides.yaml").write_text(yaml.safe_dump(ov))
        hydra.unlink()
    assert report(board, capsys, "--format", "csv") == before


@pytest.mark.quick
def test_leaderboard_federation_columns_by_hand(board, capsys):
    csv_text = report(board, capsys, "--format", "csv")
    fa = by_method(csv_text, "fa").set_index(["method", "column"])
    assert fa.loc[("ditto", "acc"), "mean"] == pytest.approx(84.0)
    assert fa.loc[("ditto", "bottom 5%"), "mean"] == pytest.approx(74.0)
    assert fa.loc[("ditto", "global"), "mean"] == pytest.approx(50.5)  # its own V round: 2
    assert fa.loc[("local", "global"), "status"] == "n/a"
    assert fa.loc[("fedavg", "s / round"), "mean"] == 2.0  # 2 s between its rows
    assert fa.loc[("fedavg", "MB / round"), "mean"] == 1.5
    diffs = [0.85 - 0.70, 0.83 - 0.72]  # ditto - fedavg, per seed
    iv = paired_interval(diffs, default_method())
    row = fa.loc[("ditto", "vs FedAvg")]
    assert row["diff"] == pytest.approx(13.0) and row["pairs"] == 2
    assert row["diff_low"] == pytest.approx(100 * iv.low)
    assert fa.loc[("local", "vs FedAvg"), "diff"] == pytest.approx(8.0)
    assert fa.loc[("ditto", "values"), "values"] == "lr=0.01 lam=0.5 personal_epochs=1"
    assert fa.loc[("local", "values"), "values"] == "lr=0.05 (not tuned=fa)"
    text = report(board, capsys)
    assert "+13.00 [" in text and "(reference)" in text
    overview = by_method(csv_text, "Leaderboard").set_index(["method", "federation"])
    assert overview.loc[("ditto", "avg rank"), "avg_rank"] == 1.25
    assert overview.loc[("fedavg", "fb"), "rank"] == 2  # 62.0 between ditto 63.5 and local 60


@pytest.mark.quick
def test_leaderboard_markdown_and_figures(board, capsys):
    from fedbench.report.collect import find_runs
    from fedbench.report.presets import get

    md = report(board, capsys, "--format", "markdown")
    head = "| method | acc | bottom 5% | global | s / round | MB / round | vs FedAvg | vs Local |"
    assert md.count(head) == 2 and "| method | fa | fb | avg rank |" in md
    table, unmatched = get("leaderboard").build(find_runs([board]), "val")
    assert [name for name, _ in table.figures] == ["cd", "tradeoff"] and unmatched == []
    figures = {name: draw() for name, draw in table.figures}
    texts = [t.get_text() for ax in figures["cd"].axes for t in ax.texts]
    cd = ranking.q_alpha(3) * math.sqrt(12 / 24)
    assert f"CD = {cd:.2f}" in texts and "ditto (1.25)" in texts and "fedavg (2.50)" in texts
    panels = figures["tradeoff"].axes
    assert [ax.get_title().split(":")[0] for ax in panels] == ["fa", "fa", "fb", "fb"]
    assert sum(len(ax.lines) > 0 for ax in panels) == 4  # a point per method and panel
    assert "not shown (0): " not in " ".join(t.get_text() for ax in panels for t in ax.texts)
    (legend,) = figures["tradeoff"].legends  # every method named once, whatever is labelled
    assert sorted(t.get_text() for t in legend.get_texts()) == ["ditto", "fedavg", "local"]
    for ax in panels:  # labels: Pareto-front methods only
        assert {t.get_text() for t in ax.texts} <= {"ditto", "fedavg", "local"}


@pytest.mark.quick
def test_pareto_front_keeps_what_nothing_cheaper_beats():
    from fedbench.report.leaderboard import pareto

    pts = {"a": (1.0, 90.0), "b": (2.0, 95.0), "c": (2.0, 93.0), "d": (3.0, 94.0),
           "e": (0.5, 80.0), "f": (4.0, 96.0), "g": (1.0, 90.0)}  # fmt: skip
    assert pareto(pts) == ["e", "a", "b", "f"]  # g ties a: the first name only


@pytest.mark.quick
def test_leaderboard_refuses_what_it_cannot_show(board, tmp_path, capsys):
    assert main([str(board), "--preset", "leaderboard", "--best-of", "optim.lr"]) == 2
    assert "--best-of" in capsys.readouterr().err
    other = tmp_path / "plain"
    write_run(other, "x", "fedavg", 0, 0.5, None, tuned="none")
    (other / "x" / "fedavg" / "seed=0" / ".hydra" / "hydra.yaml").unlink()  # no federation
    assert main([str(other), "--preset", "leaderboard"]) == 2
    assert "no run of a named federation" in capsys.readouterr().err


# --------------------------------------------------------------------------- the script
def leaderboard(env: dict, *args: str) -> subprocess.CompletedProcess:
    script = str(REPO / "scripts" / "leaderboard.sh")
    return subprocess.run(["bash", script, *args], env={**ENV, **env}, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


@pytest.mark.quick
def test_leaderboard_script_plans_one_sweep_per_federation_and_method(tmp_path):
    """DRY_RUN: the sweeps it would run; with TUNED=1 a method without its conf/tuned file
    is skipped with a note, not run at its defaults."""
    env = {"DRY_RUN": "1", "OUT": str(tmp_path / "lb"), "ALGOS": "fedavg ditto", "SEEDS": "0,1"}
    r = leaderboard({**env, "TUNED": "0"})
    assert r.returncode == 0, r.stderr
    sweeps = [ln for ln in r.stdout.splitlines() if ln.startswith("+ fedbench -m")]
    assert len(sweeps) == 4 and all("seed=0,1" in s and "resume=auto" in s for s in sweeps)
    assert f"+federation=fmnist_dir03 algo=ditto seed=0,1 hydra.sweep.dir={tmp_path}/lb/" in (
        r.stdout
    )
    assert "--preset leaderboard" in r.stdout
    tuned = REPO / "conf" / "tuned"
    missing = [a for a in ("fedavg", "ditto") if not (tuned / "fmnist_pat2" / f"{a}.yaml").exists()]
    r = leaderboard({**env, "FEDERATIONS": "fmnist_pat2"})
    assert r.returncode == 0, r.stderr
    for a in missing:
        where = "conf/" + f"tuned/fmnist_pat2/{a}.yaml"  # not yet a repository path
        assert f"# skipping {a} on fmnist_pat2: no {where}" in r.stderr
    planned = [ln for ln in r.stdout.splitlines() if ln.startswith("+ fedbench -m")]
    assert len(planned) == 2 - len(missing)
    assert all("tuned=fmnist_pat2" in ln for ln in planned)


@pytest.mark.slow
@pytest.mark.long
def test_leaderboard_script_runs_and_reports_every_column(tmp_path):
    """3 methods x 2 seeds on a tiny fmnist_pat2 at their defaults: every cell finishes,
    and the report has the ranking, the tests and every column, with each method's
    accuracy the mean over its seeds of personal L.avg at the run's validation round."""
    if not fmnist_available():
        pytest.skip("Fashion-MNIST files not installed (apt-get install dataset-fashion-mnist)")
    out = tmp_path / "lb"
    extra = (f"clients=4 split.train_per_client=60 split.test_per_client=30 eval.every=1 "
             f"model.hidden=[16] device=cpu {CLI_BACKEND}")  # fmt: skip
    r = leaderboard({"TUNED": "0", "FEDERATIONS": "fmnist_pat2", "ALGOS": "fedavg local ditto",
                     "SEEDS": "0,1", "ROUNDS": "2", "OUT": str(out), "EXTRA": extra})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "leaderboard: 6 cells: 6 done" in r.stdout
    md = r.stdout.split("+ fedbench-report", 1)[1]
    assert "| method | fmnist_pat2 | avg rank |" in md and "Friedman test over N=2 blocks" in md
    assert "| method | acc | bottom 5% | global | s / round | MB / round | vs FedAvg | " in md
    for name in ("cd.png", "tradeoff.png", "curves.png"):
        data = (out / "report" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    page = (out / "leaderboard.html").read_text()
    # the overview, the federation's table, and fmnist_pat2 beside the papers
    assert page.count('<table class="results">') == 3 and 'id="fig-cd"' in page
    assert "fmnist_pat2 beside the papers" in page
    assert 'id="fig-tradeoff"' in page and "Friedman test" in page
    for algo in ("fedavg", "local", "ditto"):
        accs = []
        for m in out.glob(f"fmnist_pat2/{algo}/*/metrics.csv"):
            df = pd.read_csv(m)
            accs.append(df.loc[df["personal.V.avg"].idxmax(), "personal.L.avg"])
        assert len(accs) == 2
        row = next(ln for ln in md.splitlines() if ln.startswith(f"| {algo} | ") and "±" in ln)
        assert f"{100 * np.mean(accs):.2f} ± {100 * np.std(accs, ddof=1):.2f}" in row, row
    assert "| local |" in md and "(reference)" in md and "(not tuned=fmnist_pat2)" in md


@pytest.mark.quick
def test_paper_names_map_to_registry_keys():
    from fedbench.report.leaderboard import paper_algo

    assert [paper_algo(n) for n in ("FedMGDA+", "S-FedPG", "Separate", "FedROD", "pFedMe")] == [
        "fedmgda", "sfedpg", "local", "fedrod", "pfedme"
    ]  # fmt: skip
    assert paper_algo("FedPG (gamma=0.3)") == "fedpggamma03"  # a variant: no registry key


@pytest.mark.quick
def test_beside_the_papers_table_by_hand(tmp_path, capsys):
    """On a federation with source-paper columns (fmnist_pat2): each paper's accuracy and its
    difference from that paper's Separate/Local, and ours from Local paired by seed."""
    root = tmp_path / "board"
    accs = {"local": (0.96, 0.95), "fedrep": (0.97, 0.95), "moon": (0.90, 0.91)}
    for algo, pair in accs.items():
        for seed, acc in enumerate(pair):
            write_run(root, "fmnist_pat2", algo, seed, acc, None, tuned="fmnist_pat2")
    md = report(root, capsys, "--format", "markdown")
    section = md[md.index("fmnist_pat2 beside the papers") :]
    head = "| method | DiversiFed I: FMNIST pat-2 | FedPG 1: FMNIST pat-2 (L) | here: fmnist_pat2 |"
    assert head in section
    # DiversiFed I: FedRep 96.66, Separate 96.10; FedPG 1 (L): FedRep .992, Local .989;
    # ours: FedRep - Local = (+1, 0) points over the two seeds: +0.50, interval holds 0
    assert "| fedrep | 96.66 (+0.56) | 99.20 (+0.30) | 96.00 (+0.50) |" in section
    assert "| local | 96.10 | 98.90 | 95.50 |" in section
    assert "moon" not in section.split("\n\n")[1]  # in neither paper's table: no row
