"""Wall time of one column of a paper's table: each method run as a user runs it, for as many
rounds as the time allows, then extrapolated to the preset's rounds (issue 36; docs/gpu.md).

For each method: `fedbench +experiment=PRESET algo=METHOD seed=0 device=DEVICE` in a new
process, in a temporary run directory. After `--seconds` it gets SIGTERM, on which fedbench
finishes the round under way, saves a checkpoint and exits (a round that outlasts a grace
period as long again is killed). The preset evaluates every round (DiversiFed's protocol), so
metrics.csv holds the wall time of every round done. The time of all rounds:

    total = overhead + wall(1) + (rounds - 1) * s_per_round
    s_per_round = (wall(r) - wall(1)) / (r - 1)      (wall(1) alone when r = 1)

where r is the rounds done, wall(k) the run's clock at round k (metrics.csv, from the start
of the round loop: round 1 carries first-call costs, kept out of s_per_round), and overhead
the process's time outside the round loop (start, data, model; the exit). A method that
finished all rounds is `measured`; the others are `extrapolated from r rounds`.

    python scripts/bench_column.py --device cuda --seconds 15 --md column.md --json column.json
    python scripts/bench_column.py --device cpu --methods fedavg --seconds 30 \\
        --extra clients=4 local_epochs=1            # a smoke test on a small federation
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# DiversiFed Table I (FMNIST column): its 12 methods, in the paper's order
DIVERSIFED_T1 = (
    "fedavg local perfedavg pfedme fedamp fedfomo apple fedrep fedproto fedrod fedcac diversifed"
)


def rounds_done(run_dir: Path) -> list[tuple[int, float]]:
    """(round, wall_time_s) of every evaluated round in run_dir/metrics.csv."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [(int(r["round"]), float(r["wall_time_s"])) for r in csv.DictReader(f)]


def estimate(done: list[tuple[int, float]], process_s: float, target: int, finished: bool) -> dict:
    """The time of `target` rounds from the rounds `done` ((round, wall_time_s), from the
    round loop's start) in a process that ran `process_s` seconds (module docstring)."""
    r, last = done[-1]
    first = done[0][1]
    per_round = (last - first) / (r - 1) if r > 1 else first
    overhead = max(process_s - last, 0.0)
    total = process_s if finished else overhead + first + (target - 1) * per_round
    return {
        "status": "measured" if finished else f"extrapolated from {r} rounds",
        "rounds_done": r,
        "first_round_s": round(first, 3),
        "s_per_round": round(per_round, 4),
        "overhead_s": round(overhead, 2),
        "total_s": round(total, 1),
    }


def one_method(args, method: str, work: Path) -> dict:
    run_dir = work / method
    cmd = [
        sys.executable,
        "-c",
        "from fedbench.cli import main; main()",
        f"+experiment={args.preset}",
        f"algo={method}",
        "seed=0",
        f"device={args.device}",
        f"hydra.run.dir={run_dir}",
        *args.extra,
    ]
    log = open(work / f"{method}.log", "w")  # noqa: SIM115 (closed below)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    stopped = killed = False
    try:
        proc.wait(timeout=args.seconds)
    except subprocess.TimeoutExpired:
        stopped = True
        proc.send_signal(signal.SIGTERM)  # finish the round, checkpoint, exit
        try:
            proc.wait(timeout=max(args.seconds, 30))
        except subprocess.TimeoutExpired:
            killed = True
            proc.kill()
            proc.wait()
    total = time.perf_counter() - t0
    log.close()
    done = rounds_done(run_dir)
    row = {"method": method, "returncode": proc.returncode, "process_s": round(total, 2)}
    if not done:
        tail = (work / f"{method}.log").read_text(errors="replace").strip().splitlines()[-3:]
        return {**row, "status": "no round finished", "log_tail": tail}
    target = int(args.rounds)
    finished = not stopped and proc.returncode == 0 and done[-1][0] >= target
    return {**row, **estimate(done, total, target, finished), "killed": killed}


def markdown(rows: list[dict], args, device_name: str) -> str:
    lines = [
        f"{args.preset} column on {device_name}: {len(rows)} methods, seed 0, "
        f"{args.seconds:g} s each, extrapolated to {args.rounds} rounds"
        + (f" (overrides: {' '.join(args.extra)})" if args.extra else ""),
        "",
        "| method | rounds run | s/round | first round s | overhead s | "
        f"{args.rounds} rounds s | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "total_s" not in r:
            lines.append(f"| {r['method']} | 0 | | | | | {r['status']} |")
            continue
        lines.append(
            f"| {r['method']} | {r['rounds_done']} | {r['s_per_round']:.3f} | "
            f"{r['first_round_s']:.2f} | {r['overhead_s']:.1f} | {r['total_s']:.0f} | "
            f"{r['status']} |"
        )
    timed = [r["total_s"] for r in rows if "total_s" in r]
    if timed:
        lines += [
            "",
            f"column: {sum(timed):.0f} s for {len(timed)} methods (estimated; "
            f"{sum(timed) / len(timed):.0f} s per method, the target is 180)",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--preset", default="diversifed_table1_fmnist")
    ap.add_argument("--methods", default=DIVERSIFED_T1, help="space- or comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0, help="per method, then SIGTERM")
    ap.add_argument("--rounds", type=int, default=500, help="rounds to extrapolate to")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--json", help="write the rows here (after each method)")
    ap.add_argument("--md", help="write the table here (after each method)")
    args = ap.parse_args(argv)
    methods = args.methods.replace(",", " ").split()
    args.extra = [*args.extra, f"rounds={args.rounds}"]
    device_name = args.device
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"bench_column.py: --device {args.device}: no CUDA GPU visible", file=sys.stderr)
            return 2
        device_name = torch.cuda.get_device_name(args.device)
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    os.environ.update(env)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in methods:
            row = one_method(args, m, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
            if args.md:
                Path(args.md).write_text(markdown(rows, args, device_name))
    print(markdown(rows, args, device_name))
    return 0 if all("total_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
