"""The leaderboard's budget on this machine: CPU seconds per round of a few algorithms on the
leaderboard's federations (conf/federation/<name>.yaml), one thread, and what the equal-budget
tuning (scripts/tune.sh) and the leaderboard (scripts/leaderboard.sh) then cost.

Each (federation, algorithm) is one real fedbench run of --rounds rounds (evaluations every
eval.every rounds, as the federation sets), in this process, with torch on one thread. The time
is the process's CPU time (time.process_time), not the wall clock: on a shared machine the wall
clock counts the other jobs' turns too, the CPU time is what the run would take alone on one
core (up to cache contention, which makes it an upper bound). Setup (data, split, model) is
measured apart, and so is a fresh `fedbench` process's start (imports), paid by every cell.

    python scripts/bench_leaderboard.py                       # both federations, the default algos
    python scripts/bench_leaderboard.py --federations fmnist_pat2 --algos fedavg,ditto --rounds 10

The budget printed: per federation, tuning = trials x tune seeds x (rounds x s/round + setup +
start) summed over the algorithms, leaderboard = seeds x the same; algorithms not measured
are counted at the median of those measured (said under the table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedbench.algorithms import ALGORITHMS  # noqa: E402
from fedbench.runner import Run  # noqa: E402
from fedbench.tune import compose_run  # noqa: E402

DEFAULT_ALGOS = "fedavg,local,ditto,fedrep,fedproto,pfedme,fedfomo,knnper,pfedhn,apple"


def start_seconds() -> float:
    """CPU seconds of a fresh process that imports what `fedbench` imports before a run."""
    code = (
        "import time, resource; import fedbench.cli, fedbench.runner; "
        "u = resource.getrusage(resource.RUSAGE_SELF); print(u.ru_utime + u.ru_stime)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return float(out.strip().splitlines()[-1])


def measure(federation: str, algo: str, rounds: int, backend: str) -> tuple[float, float, float]:
    """(setup CPU s, the first round's CPU s, CPU s per later round) of one run of `rounds`
    rounds; a round's time includes its evaluation when one is due (every eval.every), and
    the first round's the engine's warm-up (vmap's compilation)."""
    cfg = compose_run(
        [
            f"+federation={federation}",
            f"algo={algo}",
            f"rounds={rounds}",
            f"engine.backend={backend}",
            "device=cpu",
            "checkpoint.every=0",
        ]
    )
    with tempfile.TemporaryDirectory(prefix="fedbench-bench-") as tmp:
        t0 = time.process_time()
        run = Run(cfg, Path(tmp) / "run", progress=False)
        t1 = time.process_time()
        marks = []  # CPU time as each round starts (the runner samples its clients first)
        sample = run.sample

        def timed():
            marks.append(time.process_time())
            return sample()

        run.sample = timed
        run.run()
        marks.append(time.process_time())
    steps = np.diff(marks)
    return t1 - t0, float(steps[0]), float(steps[1:].mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--federations", default="fmnist_pat2,fmnist_dir03")
    p.add_argument("--algos", default=DEFAULT_ALGOS, help="comma list, or all")
    p.add_argument("--rounds", type=int, default=10, help="rounds measured per run")
    p.add_argument("--backend", default="auto", help="engine.backend of the runs (auto)")
    p.add_argument("--trials", type=int, default=12, help="trials per study (budget)")
    p.add_argument("--tune-seeds", type=int, default=1, help="seeds per trial (budget)")
    p.add_argument("--seeds", type=int, default=5, help="leaderboard seeds (budget)")
    p.add_argument("--full-rounds", type=int, default=None, help="rounds of the real runs "
                   "(default: the federation's)")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(1)
    start = start_seconds()
    n_algos = len(ALGORITHMS.names())
    print(f"fedbench process start (imports): {start:.1f} CPU s; {n_algos} algorithms")
    for fed in args.federations.split(","):
        full = args.full_rounds or int(compose_run([f"+federation={fed}"]).rounds)
        print(f"\n{fed}: {args.rounds} rounds measured, {full} rounds budgeted")
        print(f"{'algo':12s} {'setup s':>8s} {'round 1':>8s} {'s/round':>8s} {'run s':>8s}")
        per_run = {}
        algos = sorted(ALGORITHMS.names()) if args.algos == "all" else args.algos.split(",")
        for algo in algos:
            setup, first, spr = measure(fed, algo, args.rounds, args.backend)
            per_run[algo] = start + setup + first + (full - 1) * spr
            print(
                f"{algo:12s} {setup:8.2f} {first:8.2f} {spr:8.3f} {per_run[algo]:8.1f}", flush=True
            )
        median = statistics.median(per_run.values())
        total_run = sum(per_run.values()) + median * (n_algos - len(per_run))
        tune = args.trials * args.tune_seeds * total_run
        board = args.seeds * total_run
        print(
            f"one run of each of the {n_algos} algorithms: {total_run / 3600:.2f} h "
            f"({n_algos - len(per_run)} not measured, counted at the median {median:.0f} s)"
        )
        print(
            f"tuning ({args.trials} trials x {args.tune_seeds} seed): {tune / 3600:.1f} h; "
            f"leaderboard ({args.seeds} seeds): {board / 3600:.1f} h; one core, CPU time"
        )


if __name__ == "__main__":
    main()
