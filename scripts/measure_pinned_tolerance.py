#!/usr/bin/env python3
"""Measure how far re-runs of pinned cells move when only the arithmetic's order changes:
the same cell re-run with the recorded backend, with `sequential`, with `vmap`, and with one
thread, each compared with the first re-run (the last bits differ, not the code). The
largest difference is the floor under fedbench.pinned's tolerance (ACC_TOL, REL_TOL) for
re-checking a cell on another machine than the one that made it.

    python scripts/measure_pinned_tolerance.py                       # the default cells
    python scripts/measure_pinned_tolerance.py results/diversifed/table2_fmnist

Prints one line per (cell, variant): max |Δ| of the mean accuracies (points), of any
accuracy column (points), and the max relative difference of the other numbers, against
the first re-run and against the recorded rows; then the maxima over all.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from fedbench.pinned import DEFAULT_ROUNDS, RESULTS, compare, find_cells, pin_of, rerun

DEFAULT_CELLS = [
    "diversifed/table2_fmnist",
    "diversifed/table1_fmnist/fedcac",
    "diversifed/table1_fmnist/diversifed",
    "fedpg/table1_fmnist/fedpg@0.3/lr0.01",
    "fedpg/table1_fmnist/fedavg/lr0.1",
]
# (name, engine.backend or None for the recorded one, torch threads or None for the default)
VARIANTS = [("recorded", None, None), ("sequential", "sequential", None), ("vmap", "vmap", None),
            ("1 thread", None, 1)]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cells", nargs="*", help="cells or folders under results/")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    args = p.parse_args()
    threads = torch.get_num_threads()
    cells = find_cells(RESULTS, args.cells or [str(RESULTS / c) for c in DEFAULT_CELLS])
    worst = {"first": [0.0, 0.0, 0.0], "recorded": [0.0, 0.0, 0.0]}
    for cell in cells:
        pin = pin_of(cell, args.rounds, {})
        base = None
        for name, backend, nthreads in VARIANTS:
            torch.set_num_threads(nthreads or threads)
            with tempfile.TemporaryDirectory(prefix="fedbench-tol-") as tmp:
                try:
                    rows = rerun(cell, pin.until, Path(tmp) / "run", backend)
                except Exception as e:  # noqa: BLE001 (a backend the algorithm refuses)
                    print(f"{cell.name} [{name}]: not run ({type(e).__name__}: {e})"[:300])
                    continue
            if base is None:
                base = rows
            for what, ref in (("first", base), ("recorded", pin.rows)):
                d = compare(ref, rows)
                w = worst[what]
                w[0], w[1], w[2] = max(w[0], d.acc), max(w[1], d.acc_any), max(w[2], d.rel)
                print(
                    f"{cell.name} [{name}] vs {what}: mean acc {d.acc:.4g} pts, any acc "
                    f"{d.acc_any:.4g} pts, other {d.rel:.3g} rel"
                    + (" (equal to the bit)" if d.exact else "")
                    + (f"; {'; '.join(d.problems)}" if d.problems else ""),
                    flush=True,
                )
        torch.set_num_threads(threads)
    for what, (a, b, c) in worst.items():
        print(f"max vs {what}: mean acc {a:.4g} points, any acc {b:.4g} points, other {c:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
