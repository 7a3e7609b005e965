"""Peak memory of one evaluation (issue 14.3): an evaluation scores one client at a time and
must never build all N personal models, whatever N.

For each algorithm in turn, in this process: a random federation of N clients
(a few test samples each; the numbers of correct predictions do not matter), the algorithm
built on `--model`, every client marked as visited (so each deploys its own row), then the
process's peak RSS is reset (/proc/self/clear_refs: 5, which VmHWM follows) and
`evaluation.evaluate` runs. Printed:
the extra peak (VmHWM after minus before) in models of D floats, and in GB.

    python scripts/bench_eval_memory.py     # WRN-28-10, 100 clients, FedRep and PLGU-GRep
    python scripts/bench_eval_memory.py --model mlp --hidden 2048 512 --input 1 28 28 \
        --classes 10 --clients 64 --algos fedrep ditto pfedme fedrep:all_rows --json

Algorithms that store every client's full state ([N, D]: Ditto, pFedMe, PLGU-LF, FedAvg's
personal rows) need N models of memory to exist at all; the WRN default runs the ones that
do not (FedRep, PLGU-GRep keep one body and N heads), where an [N, D] temporary (14.6 GB for
WRN-28-10 and 100 clients) would be the whole cost.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class RandomFed:
    """The slice of `Federation` that training and evaluation read, over random data."""

    def __init__(self, n_clients: int, input_shape, classes: int, train: int, test: int):
        import torch

        g = torch.Generator().manual_seed(0)
        total = n_clients * (train + test)
        self.x = torch.randn(total, *input_shape, generator=g)
        self.y = torch.randint(0, classes, (total,), generator=g)
        self.num_clients, self.num_classes = n_clients, classes
        self.input_shape = tuple(input_shape)
        per = train + test
        self.train_idx = [torch.arange(i * per, i * per + train) for i in range(n_clients)]
        self.test_idx = [torch.arange(i * per + train, (i + 1) * per) for i in range(n_clients)]
        self.s_idx = self.g_idx = None
        self.train_sizes = torch.full((n_clients,), float(train))

    def batch(self, idx, train=True):
        return self.x[idx], self.y[idx]


def trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that a later allocation shows in
    RSS instead of reusing pages a previous algorithm left resident."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_kb() -> int:
    """The address space's peak RSS in KiB: VmHWM, which clear_refs resets. (ru_maxrss also
    keeps the peak of exited threads' accounting, so it may not come down after a reset.)"""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def reset_peak() -> bool:
    """Reset the process's peak RSS to its current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(args) -> list[dict]:
    """Each algorithm of `args.algos` in turn, in this process: the evaluation's extra peak
    (the previous algorithm is freed and the heap trimmed, then the peak is reset).
    `NAME:all_rows` is the control: NAME evaluated through personal_states()[i] (as before
    the fix), on two clients (each call builds all N rows already)."""
    import numpy as np
    import torch
    from hydra import compose, initialize_config_dir

    sys.path.insert(0, str(ROOT))
    from fedbench.algorithms import ALGORITHMS
    from fedbench.cli import CONF_DIR
    from fedbench.config import load_config, task_config
    from fedbench.engine import Engine
    from fedbench.evaluation import evaluate
    from fedbench.models import build_model

    torch.set_num_threads(max(1, args.threads))
    fed = RandomFed(args.clients, args.input, args.classes, args.train, args.test)
    opts = {"hidden": list(args.hidden)} if args.model == "mlp" else {}

    def model_fn():
        return build_model(args.model, fed.input_shape, fed.num_classes, **opts)

    rows = []
    for spec in args.algos:
        name, _, mode = spec.partition(":")
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            cfg = compose(
                config_name="config",
                overrides=[f"algo={name}", "device=cpu"],
                return_hydra_config=True,  # the algorithm's name is the option chosen
            )
        cfg = task_config(cfg)
        torch.manual_seed(0)
        engine = Engine(fed, model_fn(), device="cpu", eval_batch_size=args.test)
        algo = ALGORITHMS.get(name).from_config(load_config(cfg), fed, engine, model_fn)
        if hasattr(algo, "seen"):
            algo.seen[:] = True  # every client deploys its own row
        honest = None
        if mode == "all_rows":  # the control: the evaluation before issue 14.3's fix
            algo.personal_state = lambda i, a=algo: a.personal_states()[i]
            honest = np.arange(args.clients) < 2  # two clients show the peak, in less time
        D = engine.n_state
        trim()
        ok = reset_peak()
        before = peak_kb()
        t0 = time.perf_counter()
        evaluate(algo, fed, honest=honest)
        seconds = time.perf_counter() - t0
        extra = (peak_kb() - before) * 1024
        rows.append(
            {
                "algo": spec,
                "model": args.model,
                "clients": args.clients,
                "params": engine.n_params,
                "state_floats": D,
                "model_gb": D * 4 / 1e9,
                "rss_before_gb": before * 1024 / 1e9,
                "extra_peak_gb": extra / 1e9,
                "extra_peak_models": extra / (D * 4),
                "full_nd_gb": args.clients * D * 4 / 1e9,
                "peak_reset": ok,
                "eval_seconds": seconds,
            }
        )
        del algo, engine
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wrn28_10")
    p.add_argument("--hidden", type=int, nargs="*", default=[2048, 512], help="mlp widths")
    p.add_argument("--input", type=int, nargs="+", default=[3, 32, 32])
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--train", type=int, default=2, help="training samples per client")
    p.add_argument("--test", type=int, default=2, help="test samples per client")
    p.add_argument(
        "--algos",
        nargs="+",
        default=["fedrep", "plgu_grep"],
        help="algorithms in turn; NAME:all_rows evaluates NAME through personal_states()[i]",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON line per algorithm")
    args = p.parse_args(argv)
    for row in measure(args):
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        print(
            f"{row['algo']:10s} {args.model} x {args.clients} clients: model "
            f"{row['model_gb']:.3f} GB ({row['params'] / 1e6:.1f}M params); evaluation's extra "
            f"peak RSS {row['extra_peak_gb']:.3f} GB = {row['extra_peak_models']:.2f} models "
            f"(all N rows: {row['full_nd_gb']:.1f} GB); process RSS before "
            f"{row['rss_before_gb']:.2f} GB; {row['eval_seconds']:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
