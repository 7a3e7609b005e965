#!/usr/bin/env python3
"""Regenerate what README.md, docs/ and results/ derive from results/: every paper table
pasted between `<!-- fedbench-report ... -->` and `<!-- end -->` markers (the marked command's
output, fedbench/report/doctables.py) and every cell's reproduction card (card.json, card.md:
fedbench/report/cards.py, as `fedbench-report results --cards`).

    python scripts/update_docs_tables.py            # rewrite what is stale
    python scripts/update_docs_tables.py --check    # exit 1 naming what is stale, write nothing

Run it after adding cells to results/ (scripts/export_results.sh) or editing
results/reasons.yaml; tests/test_docs_tables.py and tests/test_cards.py fail until then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedbench.report import cards, doctables
from fedbench.report.collect import ReportError

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="name what is stale, write nothing")
    args = p.parse_args()
    files = doctables.docs_files(REPO)
    made = cards.build_cards([REPO / "results"])
    stale_cards = [
        folder / name
        for folder, card in made
        for name, text in ((cards.CARD_JSON, cards.card_json_text(card)),
                           (cards.CARD_MD, card.markdown()))
        if not (folder / name).is_file() or (folder / name).read_text(encoding="utf-8") != text
    ]  # fmt: skip
    if args.check:
        tables = doctables.stale(files, REPO)
        for b, _ in tables:
            print(f"stale table: {b.path.relative_to(REPO)}:{b.line}: {b.command}")
        for path in stale_cards:
            print(f"stale card: {path.relative_to(REPO)}")
        return 1 if tables or stale_cards else 0
    for b in doctables.update(files, REPO):
        print(f"updated table: {b.path.relative_to(REPO)}:{b.line}: {b.command}")
    if stale_cards:
        cards.write_cards(made)
        print(f"rewrote {len(stale_cards)} card file(s) (of {2 * len(made)})")
    missing = [c.cell for _, c in made if c.needs_reason and not c.reason]
    for cell in missing:
        print(f"needs a reason in results/reasons.yaml (> {cards.GAP:g} points): {cell}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ReportError as e:  # a marked command that fails, an algorithm's wrong `about`
        print(f"update_docs_tables: {e}", file=sys.stderr)
        sys.exit(2)
