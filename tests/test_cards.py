"""Reproduction cards (fedbench/report/cards.py): one per cell of results/, current with the
cell's files, every gap of more than 2 points explained, every command runnable as printed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from fedbench.report import cards
from fedbench.report.collect import read_run

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"


@pytest.fixture(scope="module")
def made():
    return cards.build_cards([RESULTS])


@pytest.mark.quick
def test_every_cell_has_its_current_card(made):
    """The committed card.json / card.md of every cell are what its files give today
    (`fedbench-report results --cards` rewrites them)."""
    cells = sorted(p.parent for p in RESULTS.rglob("summary.json"))
    assert sorted(folder for folder, _ in made) == cells
    stale = []
    for folder, card in made:
        for name, text in (
            (cards.CARD_JSON, cards.card_json_text(card)),
            (cards.CARD_MD, card.markdown()),
        ):
            path = folder / name
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(REPO)))
    assert not stale, f"stale cards (run `fedbench-report results --cards`): {stale}"


@pytest.mark.quick
def test_every_gap_of_more_than_2_points_has_a_reason_and_its_checks_exist(made):
    missing = [c.cell for _, c in made if c.needs_reason and not c.reason]
    assert not missing, f"more than {cards.GAP} points from the paper, no reason: {missing}"
    for _, c in made:
        for check in c.checks:
            assert (REPO / check).exists(), f"{c.cell}: check {check} does not exist"
    assert not cards.stale_keys(RESULTS, made), "reasons.yaml/provenance.yaml name no cell"


@pytest.mark.quick
def test_provenance_is_the_runs_own_or_marked_as_recorded_after(made):
    for folder, c in made:
        recorded = "provenance" in json.loads((folder / "summary.json").read_text())
        assert c.provenance_recorded == recorded
        if not recorded:
            assert c.machine == cards.NOT_RECORDED and c.torch == cards.NOT_RECORDED
            assert c.commit.startswith("unknown (not recorded")
            assert "recorded after the run" in c.data_digest_note
            assert len(c.data_digest) == 64


@pytest.mark.slow
@pytest.mark.long
def test_every_command_is_accepted_as_printed_and_gives_the_recorded_config(made, tmp_path):
    """Each card's command passes fedbench's own checks (run in an empty folder, where its
    run directory does not exist yet) and composes to the cell's recorded config."""
    from omegaconf import OmegaConf

    from fedbench.cli import _compose, refusal
    from fedbench.config import task_config
    from fedbench.pinned import Cell, command_differences

    for folder, c in made:
        words = shlex.split(c.command)
        assert words[0] == "fedbench"
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(tmp_path)
            assert refusal(words[1:]) is None, c.command
            composed = _compose(words[1:])
        hydra_dir = OmegaConf.select(composed, "hydra.run.dir")
        assert hydra_dir.startswith(cards.RERUN_ROOT + "/"), hydra_dir
        today = task_config(composed)
        assert today.algo.name == c.algo
        assert command_differences(Cell(RESULTS, folder), today) == [], c.cell


@pytest.mark.quick
def test_rerun_dirs_are_short_where_they_stay_unique_and_quoted_where_hydra_needs_it():
    cells = ["a/x/algo=f,seed=0", "b/algo=f,seed=0", "b/algo=f,seed=1"]
    assert cards.rerun_dir(cells[0], cells) == "reruns/a/x"
    assert cards.rerun_dir(cells[1], cells) == "reruns/b/algo=f,seed=0"
    cmd = cards.command(["algo=f", "seed=0"], cards.rerun_dir(cells[1], cells))
    assert cmd == "fedbench algo=f seed=0 'hydra.run.dir=\"reruns/b/algo=f,seed=0\"'"
    assert cards.command(["model.hidden=[64]"], "reruns/a") == (
        "fedbench 'model.hidden=[64]' hydra.run.dir=reruns/a"
    )


@pytest.mark.quick
def test_lookup_takes_the_longest_key_per_field():
    table = {
        "fedpg": {"note": "shared machine"},
        "fedpg/t1/ditto": {"reason": "why", "checks": ["c"]},
    }
    cell = "fedpg/t1/ditto/lr0.1/algo=ditto"
    assert cards.lookup(table, cell, "reason") == "why"
    assert cards.lookup(table, cell, "note") == "shared machine"
    assert cards.lookup(table, "fedpg/t1/fedavg", "reason") is None
    assert cards.lookup(table, "fedpgx/t1", "note") is None  # a folder, not a name prefix


@pytest.mark.quick
def test_a_card_compares_with_the_paper_in_points():
    """FedPG prints fractions (.989), DiversiFed percent: both give a difference in points."""
    fedpg = next(RESULTS.glob("fedpg/table1_fmnist/fedavg/lr0.1/*"))
    comps = {c.preset: c for c in cards.comparisons(read_run(fedpg))}
    t1 = comps["fedpg_table1"]
    lines = {s.stat: s for s in t1.stats}
    assert t1.row == "FedAvg" and t1.column == "FMNIST" and t1.select == "final"
    assert lines["L"].paper == ".989 ± .019"
    assert lines["L"].difference == pytest.approx(lines["L"].ours - 98.9)
    div = next(RESULTS.glob("diversifed/table2_fmnist/fedavg/*"))
    (c,) = cards.comparisons(read_run(div))
    assert c.preset == "diversifed_table2" and c.select == "best"
    assert c.stats[0].paper == "84.53 ± 1.59"
    assert c.stats[0].difference == pytest.approx(c.stats[0].ours - 84.53)


@pytest.mark.quick
def test_html_page_shows_the_cards(made):
    from argparse import Namespace

    from fedbench.report import cli
    from fedbench.report.html import page

    folder = next(RESULTS.glob("fedpg/table1_fmnist/ditto/lr0.1/*"))
    runs = [read_run(folder)]
    args = cli.parser().parse_args([str(folder)])
    table = cli.make_table(args, runs)
    card = dict((f, c) for f, c in made)[folder]
    text = page(table, runs, [str(folder)], cards=[card])
    assert '<section id="cards">' in text
    assert "hydra.run.dir=reruns/fedpg/table1_fmnist/ditto/lr0.1" in text
    assert "Why more than 2 points from the paper" in text
    assert "results/checks/ditto_lam0.01" in text
    assert isinstance(args, Namespace)
