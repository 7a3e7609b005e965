"""Every algorithm at two code versions, on one fixed seed: equal to the bit, or which differ.

    python scripts/compare_versions.py c6962d1                  # that commit against this tree
    python scripts/compare_versions.py c6962d1 --algos fedrep,apple --extra model=cnn \
        model.preset=lenet model.norm=batch optim.momentum=0.9

Each algorithm runs 2 rounds of a small FMNIST federation (6 clients, pat-2, the MLP 784-32-10,
`engine.backend=sequential` unless --extra says otherwise) once from `git archive <rev>` and
once from this working tree, each in its own process; then every tensor of the two
checkpoints is compared bit for bit (`torch.equal` on the bytes), every file of their
per-client rows (`checkpoint.rows/`) by digest, and every metrics.csv cell but the wall
times. Exit 1 naming the algorithms that differ. It is how a refactor shows that the
sequential path kept its numbers (issue 33: "results of the sequential path stay
bit-identical"); a deliberate change shows up here with the tensors it moved.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "data=fmnist", "split=pat", "clients=6", "split.train_per_client=120",
    "split.test_per_client=40", "participation=1.0", "batch_size=40", "rounds=2",
    "eval.every=1", "seed=3", "engine.backend=sequential", "model=mlp", "model.hidden=[32]",
]  # fmt: skip
SKIP_COLUMNS = ("time",)  # wall times differ run to run


def run(code: Path, algo: str, out: Path, extra: list[str]) -> bool:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "import sys; from fedbench.cli import main; sys.exit(main())"]
    base = BASE
    if any(e.startswith("model=") for e in extra):  # another model: the MLP's keys go
        base = [b for b in BASE if not b.startswith("model")]
    cmd += [f"algo={algo}", *base, *extra, f"hydra.run.dir={out}"]
    with open(f"{out}.log", "w") as log:
        return subprocess.run(cmd, cwd=code, env=env, stdout=log, stderr=log).returncode == 0


def differences(a: Path, b: Path) -> list[str]:
    """What differs between two run directories (empty: equal to the bit)."""
    out: list[str] = []

    def walk(x, y, path: str) -> None:
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
            if same:
                xb = x.contiguous().view(-1).view(torch.uint8) if x.numel() else x
                yb = y.contiguous().view(-1).view(torch.uint8) if y.numel() else y
                same = torch.equal(xb, yb)
            if not same:
                out.append(path)
        elif isinstance(x, dict):
            if not isinstance(y, dict) or x.keys() != y.keys():
                out.append(f"{path} (keys)")
                return
            for k in x:
                if not any(s in str(k) for s in SKIP_COLUMNS):
                    walk(x[k], y[k], f"{path}.{k}")
        elif isinstance(x, list | tuple):
            if not isinstance(y, list | tuple) or len(x) != len(y):
                out.append(f"{path} (length)")
                return
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")

    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (a, b))
    walk(ca, cb, "checkpoint")
    rows_a = sorted(p.relative_to(a) for p in (a / "checkpoint.rows").glob("**/*") if p.is_file())
    rows_b = sorted(p.relative_to(b) for p in (b / "checkpoint.rows").glob("**/*") if p.is_file())
    if rows_a != rows_b:
        out.append("checkpoint.rows (files)")
    for r in rows_a:
        if r in rows_b:
            da, db = (hashlib.sha256((d / r).read_bytes()).digest() for d in (a, b))
            if da != db:
                out.append(str(r))
    ma, mb = (list(csv.DictReader((d / "metrics.csv").read_text().splitlines())) for d in (a, b))
    if len(ma) != len(mb):
        out.append("metrics.csv (rows)")
    for i, (x, y) in enumerate(zip(ma, mb)):
        for k in x:
            if not any(s in k for s in SKIP_COLUMNS) and x[k] != y.get(k):
                out.append(f"metrics.csv row {i} {k}: {x[k]} vs {y.get(k)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="the git revision to compare this working tree with")
    ap.add_argument("--algos", default="all", help="comma-separated names, or all")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for both runs")
    ap.add_argument("--out", help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from fedbench.algorithms import ALGORITHMS

    algos = ALGORITHMS.names() if args.algos == "all" else args.algos.split(",")
    work = Path(args.out or tempfile.mkdtemp(prefix="fedbench-compare-"))
    old = work / "code"
    old.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", args.rev], capture_output=True, check=False
    )
    if archive.returncode:
        print(f"cannot archive {args.rev}: {archive.stderr.decode().strip()}", file=sys.stderr)
        return 2
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(old, filter="data")
    bad = []
    for algo in algos:
        a, b = work / "old" / algo, work / "new" / algo
        a.parent.mkdir(exist_ok=True)
        b.parent.mkdir(exist_ok=True)
        if not (run(old, algo, a, args.extra) and run(REPO, algo, b, args.extra)):
            print(f"failed  {algo}: see {a}.log / {b}.log")
            bad.append(algo)
            continue
        diff = differences(a, b)
        print(f"{'equal ' if not diff else 'DIFFER'}  {algo}" + (f": {diff[:5]}" if diff else ""))
        if diff:
            bad.append(algo)
    print(f"{len(algos) - len(bad)} of {len(algos)} equal to the bit; runs in {work}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
