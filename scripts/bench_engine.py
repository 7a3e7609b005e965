"""Engine speed: seconds per FedAvg round for each backend, next to two floors of the same run.

Floors, both measured by this script on the same device in the same run:
- minimal: a plain PyTorch round written here (one module, data as tensors on the device,
  batches by index, torch.optim.SGD, then the weighted average), the code a careful person
  writes by hand;
- arithmetic: the round's FLOPs (forward + backward of every step, counted by
  `torch.utils.flop_counter`, so a first layer's unneeded input gradient is not counted)
  divided by the device's float32 matmul throughput (best square `mm` measured here).

Cases: (a) DiversiFed's FMNIST round: MLP 784-64-10, 40 clients x 300 samples, all sampled,
E = 10, batch 100; (b) the FedAvg CNN (conv 64-64, FC 384-192) on 3x32x32 inputs, 100
clients x 500 samples, 10 per round, E = 5, batch 50; (c) ResNet-8 (GroupNorm) on the same,
(cbn) with BatchNorm (running statistics as per-client batched buffers under vmap; the
"runs as" column says which backend ran); (d) 500 small clients in a round (MLP 784-64-10,
40 samples each, E = 1, batch 20: two steps per client) and (d50) the same with 50
clients, which show how a round's cost grows with the number of clients.
Data are random tensors of those shapes (speed does not depend on the values). Every
implementation runs the same rounds (same sampled clients), interleaved, after one warm-up
round; the table shows the MIN over the timed rounds (shared machines are noisy). Peak
memory: CUDA, the allocator's peak during a round above what was allocated before it; CPU,
the growth of the peak RSS over one round, measured in a fresh subprocess per implementation
(`--no-rss`: not measured, n/a).

    python scripts/bench_engine.py                      # cases a, b, c, CPU (+ CUDA if present)
    python scripts/bench_engine.py --cases a --reps 10 --device cpu
    python scripts/bench_engine.py --device cuda --cases a,b,c,cbn,d50,d --md engine.md
    python scripts/bench_engine.py --quick --device cpu --no-rss   # a smoke test: tiny cases
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.utils.flop_counter import FlopCounterMode

from fedbench.algorithms.fedavg import FedAvg
from fedbench.config import load_config, task_config
from fedbench.engine import Engine
from fedbench.models import build_model
from fedbench.paths import CONF_DIR

LR = 0.01
IMPLS = ("minimal", "sequential", "vmap")


@dataclass(frozen=True)
class Case:
    title: str
    model: str
    options: dict
    shape: tuple[int, ...]
    clients: int
    per_round: int
    samples: int
    epochs: int
    batch: int
    classes: int = 10

    def make_model(self) -> torch.nn.Module:
        return build_model(self.model, self.shape, self.classes, **self.options)

    @property
    def samples_per_round(self) -> int:
        return self.per_round * self.samples * self.epochs

    def shrunk(self) -> Case:
        """The same model and shapes on a few clients and samples (`--quick`)."""
        clients = max(2, min(self.clients // 50, 10))
        per_round, samples, batch = min(self.per_round, clients), 20, 10
        title = f"{self.title.split(',')[0]} [quick: {per_round}/{clients} x {samples}, E=1]"
        return replace(
            self,
            title=title,
            clients=clients,
            per_round=per_round,
            samples=samples,
            epochs=1,
            batch=batch,
        )


CASES = {
    "a": Case("FMNIST MLP 784-64-10, 40/40 clients x 300, E=10, B=100",
              "mlp", {"hidden": [64]}, (1, 28, 28), 40, 40, 300, 10, 100),
    "b": Case("CNN 64-64-384-192, 3x32x32, 10/100 clients x 500, E=5, B=50",
              "cnn", {"preset": "fedavg"}, (3, 32, 32), 100, 10, 500, 5, 50),
    "c": Case("ResNet-8 (GroupNorm), 3x32x32, 10/100 clients x 500, E=5, B=50",
              "resnet8", {}, (3, 32, 32), 100, 10, 500, 5, 50),
    "cbn": Case("ResNet-8 (BatchNorm), 3x32x32, 10/100 clients x 500, E=5, B=50",
                "resnet8", {"norm": "batch"}, (3, 32, 32), 100, 10, 500, 5, 50),
    "d50": Case("MLP 784-64-10, 50/50 clients x 40, E=1, B=20",
                "mlp", {"hidden": [64]}, (1, 28, 28), 50, 50, 40, 1, 20),
    "d": Case("MLP 784-64-10, 500/500 clients x 40, E=1, B=20",
              "mlp", {"hidden": [64]}, (1, 28, 28), 500, 500, 40, 1, 20),
}  # fmt: skip


class SyntheticFed:
    """The slice of `Federation` the engine reads: pooled tensors and per-client indices."""

    def __init__(self, case: Case, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0)
        n = case.clients * case.samples
        self.x = torch.randn(n, *case.shape, generator=g).to(device)
        self.y = torch.randint(0, case.classes, (n,), generator=g).to(device)
        self.num_clients = case.clients
        self.input_shape = case.shape
        self.train_idx = list(torch.arange(n, device=device).view(case.clients, case.samples))
        self.train_sizes = torch.full((case.clients,), float(case.samples))

    def batch(self, idx: torch.Tensor, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


Round = Callable[[int, np.ndarray], None]


def fedbench_round(case: Case, fed: SyntheticFed, device: torch.device, backend: str) -> Round:
    """fedbench's FedAvg round (the algorithm class and the engine) on one backend."""
    torch.manual_seed(0)
    engine = Engine(fed, case.make_model(), device=device, backend=backend)
    overrides = [
        "algo=fedavg",
        "algo.weighting=samples",
        f"optim.lr={LR}",
        f"local_epochs={case.epochs}",
        f"batch_size={case.batch}",
        "rounds=1000",  # read by every algorithm (schedules over T); not by FedAvg's round
        "seed=0",
        "device=cpu",
    ]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        # the algorithm's name is the option chosen (task_config resolves it)
        cfg = task_config(
            compose(config_name="config", overrides=overrides, return_hydra_config=True)
        )
    algo = FedAvg.from_config(load_config(cfg), fed, engine, case.make_model)
    return algo.round


def minimal_round(case: Case, fed: SyntheticFed, device: torch.device) -> Round:
    """The floor a hand-written PyTorch FedAvg round sets."""
    torch.manual_seed(0)
    model = case.make_model().to(device)
    params = list(model.parameters())
    glob = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=LR)
    gen = torch.Generator(device=device)

    def run(t: int, clients: np.ndarray) -> None:
        gen.manual_seed(t)
        total = float(fed.train_sizes[clients].sum())
        avg = [torch.zeros_like(p) for p in params]
        for c in clients:
            idx = fed.train_idx[c]
            with torch.no_grad():
                for p, g in zip(params, glob):
                    p.copy_(g)
            for _ in range(case.epochs):
                perm = idx[torch.randperm(len(idx), device=device, generator=gen)]
                for s in range(0, len(perm), case.batch):
                    b = perm[s : s + case.batch]
                    x, y = fed.batch(b)
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            with torch.no_grad():
                for a, p in zip(avg, params):
                    a.add_(p, alpha=len(idx) / total)
        glob[:] = avg

    return run


def make_round(impl: str, case: Case, fed: SyntheticFed, device: torch.device) -> Round:
    if impl == "minimal":
        return minimal_round(case, fed, device)
    return fedbench_round(case, fed, device, impl)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops_per_s(device: torch.device, reps: int = 5) -> float:
    """The best float32 square-matmul throughput over a few sizes (FLOP/s)."""
    sizes = (256, 512, 1024, 2048) + ((4096, 8192) if device.type == "cuda" else ())
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        inner = max(1, int(2e10 // (2 * n**3))) if device.type == "cuda" else 1
        a @ b  # warm-up
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            for _ in range(inner):
                a @ b
            sync(device)
            best = max(best, inner * 2 * n**3 / (time.perf_counter() - t))
    return best


def round_flops(case: Case, device: torch.device) -> float:
    """FLOPs of one round: every sample of every epoch through a forward and a backward."""
    model = case.make_model().to(device)
    x = torch.randn(case.batch, *case.shape, device=device)
    y = torch.randint(0, case.classes, (case.batch,), device=device)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / case.batch * case.samples_per_round


def sampled(case: Case, t: int) -> np.ndarray:
    if case.per_round == case.clients:
        return np.arange(case.clients)
    rng = np.random.default_rng([0, t])
    return np.sort(rng.choice(case.clients, case.per_round, replace=False))


def peak_rss_growth(case_key: str, impl: str, quick: bool) -> float:
    """MiB the RSS rises by during one round, in a fresh process (CPU only)."""
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", case_key, impl, *(["--quick"] if quick else [])],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def rss_child(case_key: str, impl: str) -> None:
    """Prints the RSS peak of one round above the RSS before it, sampled every 0.5 ms.

    PyTorch keeps no statistics of CPU allocations, and the process's high-water mark
    (`ru_maxrss`) is set by imports, so: hand freed heap back to the OS (`malloc_trim`),
    then sample the RSS from a thread (tensor ops release the GIL).
    """
    case, device = CASES[case_key], torch.device("cpu")
    fed = SyntheticFed(case, device)
    run = make_round(impl, case, fed, device)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base = peak = rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.0005):
            peak = max(peak, rss())

    sys.setswitchinterval(1e-4)  # let the sampler in between Python-level steps
    sampler = threading.Thread(target=sample)
    sampler.start()
    run(0, sampled(case, 0))
    done.set()
    sampler.join()
    print((max(peak, rss()) - base) / 2**20)


def runs_as(case: Case, fed: SyntheticFed, device: torch.device) -> dict[str, str]:
    """The backend each implementation's training runs on (vmap falls back to sequential
    where `Engine.backend_for` says), and auto's choice."""
    out = {"minimal": "hand-written"}
    for backend in ("sequential", "vmap", "auto"):
        eng = Engine(fed, case.make_model(), device=device, backend=backend)
        out[backend] = eng.backend_for(case.per_round)
    return out


def bench_case(
    case_key: str, device: torch.device, reps: int, budget: float, rss: bool, quick: bool
) -> dict:
    """Times every implementation on interleaved rounds; returns the case's row data."""
    case = CASES[case_key]
    fed = SyntheticFed(case, device)
    rounds = {impl: make_round(impl, case, fed, device) for impl in IMPLS}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    peak: dict[str, float] = {}
    for run in rounds.values():  # warm-up: first-call costs, allocator, lazy init
        run(0, sampled(case, 0))
        sync(device)
    for t in range(1, reps + 1):
        for impl, run in rounds.items():
            # after two timed rounds, stop an implementation that has used its time budget
            if len(times[impl]) >= 2 and sum(times[impl]) > budget:
                continue
            clients = sampled(case, t)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            sync(device)
            t0 = time.perf_counter()
            run(t, clients)
            sync(device)
            times[impl].append(time.perf_counter() - t0)
            print(f"  ({case_key}) {impl} round {t}: {times[impl][-1]:.3f} s", file=sys.stderr)
            if device.type == "cuda":
                used = (torch.cuda.max_memory_allocated(device) - base) / 2**20
                peak[impl] = max(peak.get(impl, 0.0), used)
    if device.type == "cpu" and rss:
        peak = {impl: peak_rss_growth(case_key, impl, quick) for impl in IMPLS}
    flops = round_flops(case, device)
    backends = runs_as(case, fed, device)
    return {
        "case": case_key,
        "title": case.title,
        "device": str(device),
        "times": times,
        "peak_mib": peak,
        "round_gflop": flops / 1e9,
        "auto": backends.pop("auto"),
        "runs_as": backends,
        "clients": case.clients,
        "per_round": case.per_round,
    }


def report(row: dict, matmul: float) -> str:
    floor = row["round_gflop"] * 1e9 / matmul
    best = {impl: min(ts) for impl, ts in row["times"].items()}
    lines = [
        f"({row['case']}) {row['title']} on {row['device']}: {row['round_gflop']:.1f} GFLOP "
        f"per round; matmul {matmul / 1e9:.0f} GFLOP/s -> arithmetic floor {floor:.3f} s",
        f"  {'implementation':<22}{'s/round':>9}{'x minimal':>11}{'x floor':>9}"
        f"{'peak MiB':>10}{'rounds':>8}",
    ]
    for impl in IMPLS:
        name = impl + (" (auto)" if impl == row["auto"] else "")
        lines.append(
            f"  {name:<22}{best[impl]:>9.3f}{best[impl] / best['minimal']:>11.2f}"
            f"{best[impl] / floor:>9.2f}{row['peak_mib'].get(impl, float('nan')):>10.1f}"
            f"{len(row['times'][impl]):>8}"
        )
    lines.append(f"  vmap speed-up over sequential: {best['sequential'] / best['vmap']:.1f}x")
    if row.get("runs_as", {}).get("vmap", "vmap") != "vmap":
        lines.append("  (vmap's clients ran on the sequential backend: float buffers in the model)")
    return "\n".join(lines)


def markdown(rows: list[dict], header: str) -> str:
    """One table of every case and implementation (seconds per round: the best timed)."""
    lines = [
        header,
        "",
        "| case | implementation | runs as | s/round | x minimal | x floor | floor s | "
        "peak MiB | rounds |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        floor = row["round_gflop"] * 1e9 / (row["matmul_gflops"] * 1e9)
        best = {impl: min(ts) for impl, ts in row["times"].items() if ts}
        for impl in IMPLS:
            if impl not in best:
                continue
            peak = row["peak_mib"].get(impl)
            lines.append(
                f"| ({row['case']}) {row['title']} | {impl} | "
                f"{row.get('runs_as', {}).get(impl, '')} | {best[impl]:.4f} | "
                f"{best[impl] / best['minimal']:.2f} | {best[impl] / floor:.2f} | {floor:.4f} | "
                f"{'n/a' if peak is None else f'{peak:.1f}'} | {len(row['times'][impl])} |"
            )
    speed = [
        f"({r['case']}) {min(r['times']['sequential']) / min(r['times']['vmap']):.1f}x"
        for r in rows
    ]
    lines += ["", "vmap over sequential: " + ", ".join(speed)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="a,b,c", help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--device", default="all", help="cpu, cuda, or all (cpu + cuda if present)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per implementation")
    ap.add_argument(
        "--budget", type=float, default=120.0, help="seconds per implementation and case"
    )
    ap.add_argument("--json", help="also write the raw timings here (after each case)")
    ap.add_argument("--md", help="also write the table as markdown here (after each case)")
    ap.add_argument("--no-rss", action="store_true", help="CPU: no peak-RSS subprocesses")
    ap.add_argument("--quick", action="store_true", help="tiny cases: a smoke test")
    ap.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [k for k in args.cases.split(",") if k.strip() not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(CASES)}")
    if args.quick:
        CASES.update({k: c.shrunk() for k, c in CASES.items()})
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d != "cuda" or torch.cuda.is_available()]
    rows = []
    env = f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    print(env)
    for name in devices:
        device = torch.device(name)
        matmul = matmul_flops_per_s(device)
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        header = (
            f"Engine, seconds per FedAvg round on {what} ({env}{', quick cases' * args.quick}); "
            f"float32 matmul {matmul / 1e12:.2f} TFLOP/s"
        )
        for key in args.cases.split(","):
            row = bench_case(key.strip(), device, args.reps, args.budget, not args.no_rss,
                             args.quick)  # fmt: skip
            row["matmul_gflops"] = matmul / 1e9
            row["device_name"] = what
            rows.append(row)
            print(report(row, matmul), flush=True)
            # written after each case: a run stopped by a time limit keeps what it measured
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
            if args.md:
                mine = [r for r in rows if r["device"] == str(device)]
                Path(args.md).write_text(markdown(mine, header))


if __name__ == "__main__":
    main()
