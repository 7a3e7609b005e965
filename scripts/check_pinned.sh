#!/usr/bin/env bash
# Pinned results, re-checked: re-run the first rounds of every cell in results/ (or the
# CELLs named: cells or folders of cells) from its recorded config and compare them with
# its recorded metrics.csv rows; exit 1 naming the cells that drifted.
#
#   scripts/check_pinned.sh                        # every cell (about an hour here)
#   scripts/check_pinned.sh --sample 3             # 3 cells at random (the draw is printed)
#   scripts/check_pinned.sh --budget 300           # cells at random while ~300 s fit (CI)
#   scripts/check_pinned.sh --rounds 5 results/diversifed/table1_fmnist
#   scripts/check_pinned.sh --list                 # the cells, rounds to re-run, estimates
#   scripts/check_pinned.sh --renew --reason "why" CELL...   # renew pins, on purpose
#
# Exact on the machine and torch that made a cell (its summary's provenance), within the
# measured tolerance elsewhere: fedbench/pinned.py, results/README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python}" -m fedbench.pinned "$@"
