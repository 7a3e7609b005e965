"""Tables that cannot go stale (fedbench/report/doctables.py): every paper table in README.md
and docs/ is what its marked `fedbench-report` command prints from results/ today."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedbench.report import doctables
from fedbench.report.collect import ReportError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.quick
def test_docs_tables_equal_the_report_on_results():
    files = doctables.docs_files(REPO)
    found = [b for f in files for b in doctables.blocks(f)]
    assert found, "no marked fedbench-report table in README.md or docs/"
    stale = doctables.stale(files, REPO)
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
