"""Memory and checkpoint bytes against the number of clients (issue 33, item 3).

For each algorithm and each client count, one fresh process runs `rounds` rounds of the FMNIST
MLP 784-200-200-10 (Dirichlet label skew, `dir_mode=per_client` so that 10,000 clients of ~5
samples each exist; `participation` clients per round; sequential backend; a checkpoint every
round) and prints:

- `rss_gb`: the process's peak resident memory (ru_maxrss), data and everything included;
- `cuda_gb`: the peak CUDA memory allocated (where a GPU runs it; "-" on CPU);
- `ckpt_mb`: the bytes each round's checkpoint wrote (the process's write() bytes during
  `RunCheckpoint.save`, /proc/self/io wchar), one number per round;
- `disk_mb`: the run directory's bytes on disk at the end (allocated blocks: a sparse
  memory-mapped file counts what was written, not its length).

A child that needs more than `--max-gb` of address space is stopped (RLIMIT_AS) and printed as
"over": the code before this item kept every [N, D] row on the device and wrote all of them at
each checkpoint, which at 10,000 clients is 8 GB per row store (more than this machine can lend).

    python scripts/bench_clients.py                         # this checkout
    PYTHONPATH=/work/main python scripts/bench_clients.py   # another checkout, the same table
    python scripts/bench_clients.py --clients 1000 --algos fedavg local --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ALGOS = ("fedavg", "ditto", "fedrep", "local", "scaffold", "fedavg+persist")


def overrides(algo: str, clients: int, rounds: int, per_round: int, extra: list[str]) -> list[str]:
    name, _, flag = algo.partition("+")
    out = [
        f"algo={name}",
        "data=fmnist",
        "model=mlp",
        "split=dir",
        "split.dir_mode=per_client",
        "split.train_per_client=5",
        "split.test_per_client=2",
        f"clients={clients}",
        f"participation={per_round}",
        f"rounds={rounds}",
        f"eval.every={rounds}",
        "eval.s_frac=0.0",
        "checkpoint.every=1",
        "engine.backend=sequential",
        "device=auto",
    ]
    if flag == "persist":  # per-client optimizer state (momentum kept across rounds)
        out += ["optim.momentum=0.9", "optim.persist_state=true"]
    return out + extra


def child(args: argparse.Namespace) -> None:
    """One run in this process; prints one JSON line."""
    import torch

    from fedbench.runner import Run
    from fedbench.tune import compose_run

    if args.max_gb > 0:  # CUDA reserves far more address space than it uses: 0 sets no cap there
        cap = int(args.max_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    ckpt: list[int] = []
    try:  # the checkpoint's save: fedbench/run/checkpoint.py; Run._checkpoint before the split
        from fedbench.run.checkpoint import RunCheckpoint as saver

        name = "save"
    except ImportError:
        saver, name = Run, "_checkpoint"
    original = getattr(saver, name)

    def wchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
        return 0

    def counted(self, *a, **kw):
        before = wchar()
        original(self, *a, **kw)
        ckpt.append(wchar() - before)

    setattr(saver, name, counted)
    cfg = compose_run(overrides(args.algo, args.clients, args.rounds, args.per_round, args.set))
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        Run(cfg, Path(d) / "run", progress=False).run()
        disk = sum(p.stat().st_blocks * 512 for p in Path(d).rglob("*") if p.is_file())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    print(json.dumps({"rss": rss, "cuda": cuda, "ckpt": ckpt, "disk": disk}))


def measure(algo: str, clients: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--algo", algo, "--clients", str(clients)]
    cmd += ["--rounds", str(args.rounds), "--per-round", str(args.per_round)]
    cmd += ["--max-gb", str(args.max_gb), "--tmp", args.tmp]
    for s in args.set:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        over = "MemoryError" in p.stderr or "alloc" in tail.lower() or p.returncode < 0
        return {"error": f"over {args.max_gb:g} GB" if over else tail[:120]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--algos", nargs="+", default=list(ALGOS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=20, help="clients sampled per round")
    ap.add_argument(
        "--max-gb", type=float, default=6.0, help="address-space cap per child (0: none, for CUDA)"
    )
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the run dirs go")
    ap.add_argument("--set", action="append", default=[], help="an extra config override")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--algo", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.clients = args.clients[0]
        child(args)
        return
    import fedbench

    print(f"# fedbench from {Path(fedbench.__file__).parent}")
    print(f"# {args.rounds} rounds, {args.per_round} clients per round, checkpoint every round")
    rows = []
    hdr = f"{'algo':16s} {'clients':>7s} {'rss_gb':>7s} {'cuda_gb':>7s} {'disk_mb':>8s}  ckpt_mb"
    print(hdr)
    for n in args.clients:
        for algo in args.algos:
            r = {"algo": algo, "clients": n, **measure(algo, n, args)}
            rows.append(r)
            if "error" in r:
                print(f"{algo:16s} {n:7d} {r['error']}", flush=True)
                continue
            cuda = "-" if r["cuda"] is None else f"{r['cuda'] / 2**30:.2f}"
            ck = " ".join(f"{b / 1e6:.1f}" for b in r["ckpt"])
            print(
                f"{algo:16s} {n:7d} {r['rss'] / 2**30:7.2f} {cuda:>7s} "
                f"{r['disk'] / 1e6:8.1f}  {ck}",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
