"""The papers' printed numbers as shipped with the package (fedbench/report/paper_tables/*.csv:
one row per printed number; docs/paper-tables.md lists the files). Read by the paper presets
(presets.py), the reproduction cards and the leaderboard's beside-the-papers table, and
nothing outside the package."""

from __future__ import annotations

import csv
from functools import cache
from pathlib import Path

from fedbench.report.collect import ReportError

PACKAGED = Path(__file__).resolve().parent / "paper_tables"


@cache
def paper_csv(name: str) -> tuple[dict[str, str], ...]:
    path = PACKAGED / name
    if not path.is_file():
        raise ReportError(f"paper table {name} not found in {PACKAGED}")
    with open(path, newline="") as f:
        return tuple(csv.DictReader(f))
