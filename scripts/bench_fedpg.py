"""FedPG's extra server work beside FedAvg's local training, on the same rounds.

For the FedPG appendix's FMNIST setting (fedpg_table1_fmnist: 100 clients, pat-2, MLP
784-200-200-10, E = 5, batch 50) this prints, per round, the seconds FedPG and S-FedPG spend in
the clients' full gradients (one `Engine.full_grads` call), in the server's direction (the
normalization, history, fairness row, the min-norm QP from the Gram matrix and the rescaling,
plus the personalized coefficients r_i and directions p_i; of which the float64 Gram matrix of
the QP's rows and the cvxopt solve on it, with the number of rows) and in S-FedPG's line
search (its loss queries), next to a whole FedAvg round (E local epochs) on the same sampled
clients. Participation 10% (the tables) and 100% (100 clients online: the largest QP). Each
number is the median over the timed rounds after one warm-up round (shared machines are
noisy). The times come from FedPG's opt-in profiler (`fedpg.SectionTimer`, which synchronizes
the device at each section's ends; a run without it pays no such synchronization).

    python scripts/bench_fedpg.py                       # CPU (CUDA if present: device=auto)
    (from the repository root; PYTHONPATH=. if another fedbench checkout is installed)
    python scripts/bench_fedpg.py --reps 3 --participation 0.1 1.0 --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from fedbench.algorithms.fedpg import SectionTimer
from fedbench.config import task_config
from fedbench.runner import Run

CONF = Path(__file__).resolve().parents[1] / "conf"


def build(algo: str, participation: float, device: str, tmp: Path) -> Run:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(
            config_name="config",
            overrides=[
                "+experiment=fedpg_table1_fmnist",
                f"algo={algo}",
                f"participation={participation}",
                f"device={device}",
                "optim.lr=0.05",
            ],
            return_hydra_config=True,  # the algorithm's name is the option chosen
        )
    return Run(task_config(cfg), tmp / f"{algo}_{participation}", progress=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# FedPG's profiler sections: "direction" = steps 2-6 (with "gram" and "qp_solve" inside it),
# "personal" = r_i and p_i; "rows" = the QP's rows (a note). "qp" below: direction + personal.
SECTIONS = ("grads", "direction", "gram", "qp_solve", "rows", "line_search", "personal")


def bench(algo: str, participation: float, device: str, reps: int, tmp: Path) -> dict:
    run = build(algo, participation, device, tmp)
    timer = None
    if hasattr(run.algo, "profiler"):  # FedPG, S-FedPG: opt in
        timer = run.algo.profiler = SectionTimer(run.device)
    rows: dict[str, list[float]] = {"round": [], "qp": [], **{k: [] for k in SECTIONS}}
    for t in range(reps + 1):
        clients = run.sample()
        if timer is not None:
            timer.times.clear()
        sync(run.device)
        t0 = time.perf_counter()
        run.algo.round(t, clients)
        sync(run.device)
        if t == 0:
            continue  # warm-up
        rows["round"].append(time.perf_counter() - t0)
        # a section a round skipped (no online client, no line search) took 0 s
        got = {k: timer.times.get(k, 0.0) if timer is not None else float("nan") for k in SECTIONS}
        got["qp"] = got["direction"] + got["personal"]
        for k, v in got.items():
            rows[k].append(v)
    return {k: statistics.median(v) for k, v in rows.items()} | {"device": str(run.device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--participation", type=float, nargs="+", default=[0.1, 1.0])
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.participation:
            res = {
                a: bench(a, p, args.device, args.reps, Path(tmp))
                for a in ("fedavg", "fedpg", "sfedpg")
            }
            n = round(p * 100)
            print(
                f"\nFMNIST pat-2, MLP 784-200-200-10, {n} of 100 clients per round, "
                f"device {res['fedpg']['device']} (seconds, median of {args.reps} rounds)"
            )
            print(
                f"{'':10s} {'round':>8s} {'grads':>8s} {'QP+dir':>8s} {'(gram':>8s} "
                f"{'solve)':>8s} {'rows':>5s} {'search':>8s} {'QP+dir/round':>13s}"
            )
            for a, r in res.items():
                qp = r["qp"] / r["round"] if r["qp"] == r["qp"] else float("nan")
                print(
                    f"{a:10s} {r['round']:8.3f} {r['grads']:8.3f} {r['qp']:8.3f} "
                    f"{r['gram']:8.3f} {r['qp_solve']:8.3f} {r['rows']:5.0f} "
                    f"{r['line_search']:8.3f} {qp:13.1%}"
                )
            print(
                f"FedAvg local training (whole round): {res['fedavg']['round']:.3f} s; "
                f"FedPG's QP + direction / FedAvg's round: "
                f"{res['fedpg']['qp'] / res['fedavg']['round']:.1%}"
            )


if __name__ == "__main__":
    main()
