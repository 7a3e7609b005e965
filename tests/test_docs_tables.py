"""Tables that cannot go stale (fedbench/report/doctables.py): every paper table in README.md
and docs/ is what its marked `fedbench-report` command prints from results/ today, and every
algorithm table is what the registry and the classes' `about` give today
(fedbench/algorithms/_about.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms._about import TABLES, About, about_of
from fedbench.algorithms._libraries import FL_BENCH, PFLLIB
from fedbench.report import doctables
from fedbench.report.collect import ReportError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.quick
def test_docs_tables_equal_the_report_on_results():
    files = doctables.docs_files(REPO)
    found = [b for f in files for b in doctables.blocks(f) if b.tool == "fedbench-report"]
    assert found, "no marked fedbench-report table in README.md or docs/"
    stale = doctables.stale(files, REPO, tool="fedbench-report")
    assert not stale, (
        "tables that differ from the report (python scripts/update_docs_tables.py):\n"
        + ("\n".join(f"{b.path.relative_to(REPO)}:{b.line}: {b.command}" for b, _ in stale))
    )


PAGE = """# A page

Some text.

<!-- fedbench-report RUNS --preset diversifed_table2 --compact --format markdown -->
old table
<!-- end -->

More text.
"""


@pytest.mark.quick
def test_update_rewrites_only_between_the_markers(tmp_path):
    runs = REPO / "results" / "diversifed" / "table2_fmnist"
    page = tmp_path / "page.md"
    page.write_text(PAGE.replace("RUNS", str(runs)))
    (b,) = doctables.blocks(page)
    assert b.text == "old table\n" and b.line == 5
    assert b.command.startswith("fedbench-report ") and "--preset diversifed_table2" in b.command
    assert [s[0].line for s in doctables.stale([page], tmp_path)] == [5]
    assert [c.line for c in doctables.update([page], tmp_path)] == [5]
    text = page.read_text()
    assert text.startswith("# A page\n\nSome text.\n\n<!-- fedbench-report ")
    assert text.endswith("<!-- end -->\n\nMore text.\n")
    assert "| DiversiFed | 93.42 | 95.13 ± 1.37 |" in text
    assert doctables.stale([page], tmp_path) == []
    assert doctables.update([page], tmp_path) == []  # nothing to rewrite


@pytest.mark.quick
@pytest.mark.parametrize(
    "text,says",
    [
        ("<!-- fedbench-report results --preset x --format markdown -->\nno end\n", "without"),
        ("<!-- fedbench-report results --preset x -->\n<!-- end -->\n", "--format markdown"),
    ],
)
def test_bad_markers_are_one_clear_error(tmp_path, text, says):
    page = tmp_path / "p.md"
    page.write_text(text)
    with pytest.raises(ReportError, match=says):
        doctables.blocks(page)


@pytest.mark.quick
def test_a_command_that_fails_names_itself(tmp_path):
    with pytest.raises(ReportError, match="fedbench-report nowhere --format markdown exited 2"):
        doctables.output(("nowhere", "--format", "markdown"), tmp_path)


@pytest.mark.quick
def test_registry_tables_are_current():
    """README.md's algorithm table and list of the other libraries' methods we lack, and
    docs/README.md's algorithm rows, are what the registry gives today."""
    files = doctables.docs_files(REPO)
    found = {b.args[0] for f in files for b in doctables.blocks(f) if b.tool == doctables.REGISTRY}
    assert found == set(TABLES), f"marked registry tables: {sorted(found)}, want {sorted(TABLES)}"
    stale = doctables.stale(files, REPO, tool=doctables.REGISTRY)
    assert not stale, (
        "algorithm tables that differ from the registry (python scripts/update_docs_tables.py):\n"
        + "\n".join(f"{b.path.relative_to(REPO)}:{b.line}: {b.command}" for b, _ in stale)
    )


@pytest.mark.quick
def test_every_algorithm_says_what_it_is():
    """Every registered class declares its own `about` (not inherited: a subclass is another
    method), with a name, a paper and a summary, and a docs section that exists."""
    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name)
        a = about_of(name, cls)
        assert "about" in vars(cls), f"{name}: `about` inherited from a base class"
        assert a.name and a.paper and a.summary, name
        if a.docs is not None:
            assert (REPO / "docs" / a.docs.split("#")[0]).is_file(), f"{name}: docs={a.docs}"


class _New:
    """A new module's class, as the registry would hand it over."""

    __module__ = "fedbench.algorithms.fedper"
    about = About(name="FedNew", paper="Doe, 2031", summary="a || b", pfllib="FedGC")


@pytest.mark.quick
def test_a_new_algorithm_brings_its_own_rows(tmp_path):
    algos = {n: ALGORITHMS.get(n) for n in ALGORITHMS.names()}
    page = REPO / "README.md"
    before = TABLES["algorithms"](algos, page)
    after = TABLES["algorithms"]({**algos, "fednew": _New}, page)
    (row,) = set(after.splitlines()) - set(before.splitlines())
    link = "fedbench/algorithms/fedper.py"
    assert row == f"| `fednew` | [FedNew]({link}) | Doe, 2031 | a \\|\\| b | ✓ | — |"
    assert "FedGC" in TABLES["not-yet"](algos, page)
    assert "FedGC" not in TABLES["not-yet"]({**algos, "fednew": _New}, page)
    index = TABLES["docs-index"]({"fednew": _New}, REPO / "docs" / "README.md")
    assert (
        "| `fednew` | FedNew | [fedper.py, its docstring](../fedbench/algorithms/fedper.py) |"
        in index
    )
    bad = type("Bad", (), {"about": About(name="X", paper="p", summary="s", fl_bench="FedNope")})
    with pytest.raises(ValueError, match="'bad': About: fl_bench='FedNope' is not in its list"):
        about_of("bad", bad)
    assert set(PFLLIB) and set(FL_BENCH)
