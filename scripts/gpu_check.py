"""fedbench on a GPU against the same runs on the CPU (issue 35; docs/gpu.md).

Checks, each reported pass / fail / n/a with its numbers:

- agreement: every registered algorithm, 2 rounds on real Fashion-MNIST (6 clients, pat-2,
  60 training / 30 test samples each, batch 20, 1 epoch), with an MLP 784-32-10 and with a
  LeNet-5 CNN with BatchNorm, on each engine backend (sequential, vmap; where the engine
  falls back to sequential it says so), compared with the
  same runs on the CPU in scripts/gpu_reference.json (made in advance with
  --make-reference --device cpu);
- auto: device=auto puts the run (data, model, engine) on CUDA when a GPU is visible;
- resume: a run killed after round 1 on one device and resumed on the other (both ways)
  ends as the CPU reference does;
- eval_memory: an evaluation of 100 clients adds a few models of memory, not 100
  (torch.cuda.max_memory_allocated; on the CPU the process's peak RSS);
- chunking: vmap's memory budget (half the GPU's total memory by default) gives the chunk
  sizes the memory model says, a chunked call's peak memory stays within its estimate, and
  chunking changes no number beyond rounding.

Tolerance (agreement, resume): the GPU and the CPU sum in other orders (cuBLAS / cuDNN
against the CPU's kernels), so float32 results differ by rounding, about 1e-6 relative per
operation, and two rounds of SGD amplify that by at most ~100 on these small models. TF32
(the tensor cores' 10-bit-mantissa float32 mode, on by default for cuDNN convolutions) is
turned off for the check: its own error (~1e-3 per operation) would hide real differences.
A run agrees when
  - the training loss of each round differs by at most 1e-3 relative,
  - the algorithm's final state (every float tensor of `state_dict`, as its norm and a
    projection on a fixed random direction) differs by at most 1e-3 of its norm,
  - every accuracy average (L, S, G of each model kind) differs by at most 0.025 (3 of the
    120 local test predictions flipping on a near-tie; a real bug moves tens of points).
An algorithm that draws its random numbers from a generator on the training device (FedCP's
Gumbel noise) gets other numbers from CUDA's generator than from the CPU's for one seed: it
must run and stay finite, and is not compared. A run refused on both devices with the same
error agrees.

    python scripts/gpu_check.py --device cuda --out OUT        # what gpu_check.sh runs
    python scripts/gpu_check.py --device cpu --make-reference  # scripts/gpu_reference.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "scripts" / "gpu_reference.json"

# The federation of the agreement runs: small enough that 43 algorithms x 2 models x 2
# backends fit a few minutes, real data so that the numbers mean something.
FED = [
    "data=fmnist",
    "split=pat",
    "clients=6",
    "split.train_per_client=60",
    "split.test_per_client=30",
    "participation=1.0",
    "batch_size=20",
    "local_epochs=1",
    "rounds=2",
    "eval.every=1",
    "checkpoint.every=0",
    "seed=0",
]
MODELS = {
    "mlp": ["model=mlp", "model.hidden=[32]"],
    "bncnn": ["model=cnn", "model.preset=lenet", "model.norm=batch"],
}
BACKENDS = ("sequential", "vmap")
# Shorter inner loops where an algorithm's defaults are long (same code paths); FedALA's
# start phase stops on a loss threshold, bounded here to its first epochs.
EXTRA = {
    "pfedme": ["algo.local_rounds=4"],
    "pfedhn": ["algo.inner_steps=5"],
    "plgu_ghn": ["algo.inner_steps=5"],
    "fedrep": ["algo.head_epochs=2"],
    "fedala": ["algo.max_start_epochs=3"],
}
DEVICE_RNG = {
    "fedcp": "draws its Gumbel noise from a torch.Generator on the training device: CUDA's "
    "stream differs from the CPU's for the same seed",
}
# Algorithms resumed across devices: plain, personal rows, control variates, a hypernetwork
# with its optimizer, mixture components, cluster models.
RESUME_ALGOS = ("fedavg", "ditto", "scaffold", "pfedhn", "fedem", "ifca")
RESUME_KEY = ("mlp", "vmap")  # the reference entries the resumed runs compare with


# A run's own sensitivity: the reference also runs every case with each Linear and Conv
# layer's initial weights scaled by (1 + PERTURB * noise) on the CPU, and records how far that
# moves the numbers. Most algorithms move ~1e-6; one that makes discrete choices on float
# scores (FedCAC's critical-parameter threshold, FedSPA's top-k masks) flips a choice on a
# near-tie and moves ~1e-3, as the GPU's rounding does. A run's tolerance is the larger of
# TOL and SENSITIVITY_FACTOR times its measured sensitivity.
PERTURB = 1e-6
SENSITIVITY_FACTOR = 3.0


@dataclass(frozen=True)
class Tolerance:
    loss_rel: float = 1e-3
    state_rel: float = 1e-3
    acc_abs: float = 0.025
    chunk_rel: float = 1e-4  # the same computation chunked otherwise: rounding only


TOL = Tolerance()


# ---------------------------------------------------------------------------- helpers
def compose(overrides: list[str]):
    """The CLI's composed config for these overrides (as tests/conftest.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fedbench.cli import CONF_DIR
    from fedbench.config import task_config

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    return task_config(cfg)


def code_digest() -> str:
    """SHA-256 of fedbench's code and configs: a reference made from other code is stale."""
    h = hashlib.sha256()
    files = sorted((ROOT / "fedbench").rglob("*.py")) + sorted((ROOT / "conf").rglob("*.yaml"))
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def settings() -> dict:
    """What the reference depends on besides the code."""
    return {
        "fed": FED,
        "models": MODELS,
        "backends": list(BACKENDS),
        "extra": EXTRA,
    }


def setup_worker(device: str, threads: int) -> None:
    """Every process: float32 without TF32, quiet logs, memoized data loading."""
    import torch

    import fedbench.run.build as build

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(max(1, threads))
    logging.getLogger("fedbench").setLevel(logging.ERROR)
    # one decode of the data per process (the check measures devices, not loading)
    if not hasattr(build.load_dataset, "cache_info"):
        load = build.load_dataset
        build.load_dataset = functools.lru_cache(maxsize=2)(
            lambda name, root, download=True, **kw: load(name, root, download=download, **kw)
        )


def state_fingerprint(state) -> dict:
    """Norm and a projection on a fixed random direction (seeded by each tensor's key) of
    every float tensor in a nested state: a change of any entry moves the projection."""
    import torch

    sq, proj, numel = 0.0, 0.0, 0

    def walk(key: str, v) -> None:
        nonlocal sq, proj, numel
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() and v.numel():
                t = v.detach().to("cpu", torch.float64).reshape(-1)
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                r = torch.randn(t.numel(), generator=g, dtype=torch.float64)
                sq += float(t @ t)
                proj += float(t @ r)
                numel += t.numel()
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{key}.{k}", v[k])
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                walk(f"{key}.{i}", x)

    walk("", state)
    return {"norm": math.sqrt(sq), "proj": proj, "numel": numel}


def run_record(run, summary: dict, out: Path, seconds: float) -> dict:
    """The numbers of a finished run that the comparison reads."""
    import pandas as pd

    metrics = pd.read_csv(out / "metrics.csv")
    acc = {}
    for kind, sets in summary["final"].items():
        if isinstance(sets, dict):
            for s, stats in sets.items():
                if isinstance(stats, dict) and "avg" in stats:
                    acc[f"{kind}.{s}"] = stats["avg"]
    return {
        "status": "ok",
        "train_loss": [float(x) for x in metrics["train_loss"]],
        "acc": acc,
        "state": state_fingerprint(run.algo.state_dict()),
        "backend_used": run.engine.backend_for(run.per_round),
        "device": summary["device"],
        "seconds": round(seconds, 2),
    }


def error_record(e: BaseException) -> dict:
    return {"status": "error", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}


def one_run(overrides: list[str], device: str) -> dict:
    """Run `overrides` for FED's rounds on `device` in a temporary directory."""
    from fedbench.runner import Run

    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as d:
            run = Run(compose([*FED, *overrides, f"device={device}"]), d, progress=False)
            summary = run.run()
            return run_record(run, summary, Path(d), time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 (reported, compared with the reference's)
        return error_record(e)


@contextlib.contextmanager
def perturbed_init(rel: float = PERTURB):
    """Every kaiming_uniform_ initialization (nn.Linear, nn.Conv2d) scaled by (1 + rel * n),
    n standard normal from a fixed seed: a perturbation of the size of float32 rounding."""
    import torch

    original = torch.nn.init.kaiming_uniform_

    def noisy(t, *a, **kw):
        out = original(t, *a, **kw)
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            t.mul_(1 + rel * torch.randn(t.shape, generator=g).to(t.device, t.dtype))
        return out

    torch.nn.init.kaiming_uniform_ = noisy
    try:
        yield
    finally:
        torch.nn.init.kaiming_uniform_ = original


def key_of(algo: str, model: str, backend: str) -> str:
    return f"{algo}/{model}/{backend}"


def algo_of(key: str) -> str:
    return key.split("/")[0]


def agreement_task(
    algo: str, device: str, threads: int, deadline: float, perturb: bool = False
) -> dict:
    """The four runs of one algorithm (2 models x 2 backends); `perturb`: with
    perturbed_init (the reference's sensitivity runs)."""
    setup_worker(device, threads)
    out = {}
    for model, mo in MODELS.items():
        for backend in BACKENDS:
            k = key_of(algo, model, backend)
            if time.time() > deadline:
                out[k] = {"status": "skipped", "error": "time budget spent"}
                continue
            over = [f"algo={algo}", *mo, f"engine.backend={backend}", *EXTRA.get(algo, [])]
            with perturbed_init() if perturb else contextlib.nullcontext():
                out[k] = one_run(over, device)
    return out


def resume_task(algo: str, first: str, second: str, threads: int, deadline: float) -> dict:
    """Round 1 on `first`, killed as round 2 starts (checkpoint of round 1), resumed with
    resume=true on `second`."""
    setup_worker(first, threads)
    if time.time() > deadline:
        return {"status": "skipped", "error": "time budget spent"}
    from fedbench.runner import Run

    model, backend = RESUME_KEY
    over = [f"algo={algo}", *MODELS[model], f"engine.backend={backend}", *EXTRA.get(algo, [])]
    over += ["checkpoint.every=1"]
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as d:
            run = Run(compose([*FED, *over, f"device={first}"]), d, progress=False)
            real = run.algo.round

            def dies(t, clients):
                if t == 1:
                    raise KeyboardInterrupt  # killed as round 2 starts
                return real(t, clients)

            run.algo.round = dies
            with contextlib.suppress(KeyboardInterrupt):
                run.run()
            again = Run(compose([*FED, *over, "resume=true", f"device={second}"]), d, False)
            summary = again.run()
            return run_record(again, summary, Path(d), time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001
        return error_record(e)


# ---------------------------------------------------------------------------- comparison
def compare(algo: str, got: dict, ref: dict | None) -> tuple[str, str, dict]:
    """(status, note, deltas) of a run against its reference."""
    if ref is None:
        return "fail", "no reference entry: regenerate scripts/gpu_reference.json", {}
    if got["status"] == "skipped":
        return "skipped", got["error"], {}
    if got["status"] == "error" or ref["status"] == "error":
        if got["status"] == ref["status"] == "error":
            same = got["error"].split(":")[0] == ref["error"].split(":")[0]
            return ("pass" if same else "fail"), f"refused on both: {got['error']}", {}
        which = "here" if got["status"] == "error" else "on the reference's CPU"
        return "fail", f"failed {which}: {got.get('error') or ref.get('error')}", {}
    finite = all(math.isfinite(x) for x in got["train_loss"]) and math.isfinite(
        got["state"]["norm"]
    )
    if not finite:
        return "fail", "non-finite loss or state", {}
    if algo in DEVICE_RNG:
        return "pass", f"ran, finite; not compared: {DEVICE_RNG[algo]}", {}
    d, why = deltas(got, ref)
    if why:
        return "fail", why, d
    sens = ref.get("sensitivity") or {}
    tol = {k: max(getattr(TOL, k), SENSITIVITY_FACTOR * sens.get(k, 0.0)) for k in d}
    over = [f"{k} {v:.2g} > {tol[k]:.2g}" for k, v in d.items() if v > tol[k]]
    wide = [f"{k} {tol[k]:.2g}" for k in d if tol[k] > getattr(TOL, k)]
    note = "; ".join(over)
    if wide:  # say so: this run's own sensitivity, measured on the CPU, set its tolerance
        note += ("; " if note else "") + "tolerance from its sensitivity: " + ", ".join(wide)
    return ("fail" if over else "pass"), note, d


def deltas(got: dict, ref: dict) -> tuple[dict, str]:
    """The largest differences of two finished runs (loss_rel, state_rel, acc_abs), and why
    they cannot be compared ('' when they can)."""
    d = {}
    a, b = got["train_loss"], ref["train_loss"]
    if len(a) != len(b):
        return {}, f"{len(a)} evaluated rounds, the reference {len(b)}"
    d["loss_rel"] = max((abs(x - y) / max(abs(y), 1e-3) for x, y in zip(a, b)), default=0.0)
    n = max(ref["state"]["norm"], 1e-12)
    d["state_rel"] = max(
        abs(got["state"]["norm"] - ref["state"]["norm"]) / n,
        abs(got["state"]["proj"] - ref["state"]["proj"]) / n,
    )
    if set(got["acc"]) != set(ref["acc"]):
        return d, f"accuracies {sorted(got['acc'])} vs {sorted(ref['acc'])}"
    d["acc_abs"] = max((abs(got["acc"][k] - ref["acc"][k]) for k in ref["acc"]), default=0.0)
    return d, ""


# ---------------------------------------------------------------------------- the checks
class Report:
    """Checks as they finish, written to OUT/report.json and OUT/report.md each time, so
    that a run stopped by its time limit still leaves what it did."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.out = out
        self.meta = meta
        self.checks: list[dict] = []
        self.agreement: dict = {}

    def add(self, name: str, status: str, seconds: float, summary: str, **details) -> None:
        self.checks.append(
            {
                "check": name,
                "status": status,
                "seconds": round(seconds, 1),
                "summary": summary,
                **details,
            }
        )
        print(f"[{status:>7}] {name}: {summary} ({seconds:.0f} s)", flush=True)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"meta": self.meta, "checks": self.checks, "agreement": self.agreement}
        (self.out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
        (self.out / "report.md").write_text(self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = [
            f"# gpu_check: fedbench on {m['device_name']}",
            "",
            f"device `{m['device']}`, torch {m['torch']}, Python {m['python']}, "
            f"{m['when']}; reference: torch {m['reference_torch']} on {m['reference_machine']}"
            f"{' (STALE: made from other code)' if m['reference_stale'] else ''}",
            "",
            "| check | status | seconds | summary |",
            "| --- | --- | ---: | --- |",
        ]
        for c in self.checks:
            lines.append(f"| {c['check']} | {c['status']} | {c['seconds']} | {c['summary']} |")
        if self.agreement:
            lines += [
                "",
                f"## Agreement with the CPU (tolerance: loss {TOL.loss_rel:g} rel., state "
                f"{TOL.state_rel:g} rel., accuracy {TOL.acc_abs:g} abs.)",
                "",
                "| run | status | backend used | loss rel | state rel | acc abs | note |",
                "| --- | --- | --- | ---: | ---: | ---: | --- |",
            ]
            for k, r in sorted(self.agreement.items()):
                d = r.get("deltas", {})
                cells = [f"{d[x]:.1e}" if x in d else "" for x in ("loss_rel", "state_rel")]
                cells.append(f"{d['acc_abs']:.3f}" if "acc_abs" in d else "")
                lines.append(
                    f"| {k} | {r['status']} | {r.get('backend_used', '')} | "
                    + " | ".join(cells)
                    + f" | {r.get('note', '')} |"
                )
        return "\n".join(lines) + "\n"


def check_auto(device: str) -> tuple[str, str, dict]:
    """device=auto: the run, its data and its engine on CUDA when a GPU is visible."""
    import torch

    from fedbench.runner import Run

    want = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as d:
        run = Run(compose([*FED, "algo=fedavg", *MODELS["mlp"], "device=auto"]), d, False)
        where = {
            "run": run.device.type,
            "engine": run.engine.device.type,
            "data": run.fed.x.device.type,
            "indices": run.fed.train_idx[0].device.type,
            "model": next(run.engine.model.parameters()).device.type,
        }
        summary = run.run()
        where["summary"] = torch.device(summary["device"]).type
    ok = set(where.values()) == {want}
    return ("pass" if ok else "fail"), f"auto -> {where['run']} (want {want}): {where}", where


def make_eval_fed(n: int, device: str, train: int = 2, test: int = 2):
    """A random federation of `n` clients on `device` (values do not matter for memory)."""
    import torch

    class RandomFed:
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            per = train + test
            self.x = torch.randn(n * per, 1, 28, 28, generator=g).to(device)
            self.y = torch.randint(0, 10, (n * per,), generator=g).to(device)
            self.num_clients, self.num_classes, self.input_shape = n, 10, (1, 28, 28)
            ar = torch.arange(n * per, device=device).view(n, per)
            self.train_idx = list(ar[:, :train])
            self.test_idx = list(ar[:, train:])
            self.s_idx = self.g_idx = None
            self.train_sizes = torch.full((n,), float(train))

        def batch(self, idx, train=True):
            return self.x.index_select(0, idx), self.y.index_select(0, idx)

    return RandomFed()


def check_eval_memory(device: str) -> tuple[str, str, dict]:
    """Extra peak memory of evaluating 100 clients, in models of D floats."""
    import torch

    from fedbench.algorithms import ALGORITHMS
    from fedbench.config import load_config
    from fedbench.engine import Engine
    from fedbench.evaluation import evaluate
    from fedbench.models import build_model

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_eval_memory as bem  # noqa: E402 (the CPU's peak-RSS measurement)

    n, cuda = 100, device.startswith("cuda")
    fed = make_eval_fed(n, device)

    def model_fn():
        return build_model("mlp", fed.input_shape, 10, hidden=[1024, 512])

    rows, worst = {}, 0.0
    limit = 8 if cuda else 16  # models; the CPU's RSS counts allocator slack
    for name in ("fedavg", "ditto", "fedrep", "plgu_grep"):
        torch.manual_seed(0)
        engine = Engine(fed, model_fn(), device=device, eval_batch_size=64)
        algo = ALGORITHMS.get(name).from_config(
            load_config(compose([f"algo={name}"])), fed, engine, model_fn
        )
        if hasattr(algo, "seen"):
            algo.seen[:] = True  # every client deploys its own row
        D = engine.n_state
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            evaluate(algo, fed)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
        else:
            bem.trim()
            if not bem.reset_peak():
                return "n/a", "peak RSS cannot be reset here (/proc/self/clear_refs)", {}
            before = bem.peak_kb()
            evaluate(algo, fed)
            extra = (bem.peak_kb() - before) * 1024
        models = extra / (D * 4)
        rows[name] = {"extra_mib": round(extra / 2**20, 1), "models": round(models, 2)}
        worst = max(worst, models)
        del algo, engine
    what = "torch.cuda.max_memory_allocated" if cuda else "peak RSS (VmHWM)"
    summary = (
        f"{n} clients, MLP {D / 1e6:.2f}M floats: extra peak {worst:.2f} models at most "
        f"(limit {limit}; all rows would be {n}); {what}"
    )
    return ("pass" if worst < limit else "fail"), summary, rows


def check_chunking(device: str) -> tuple[str, str, dict]:
    """The memory budget and vmap's chunks: sizes, peak memory against the estimate, and the
    same numbers whatever the chunking."""
    import torch

    from fedbench.engine import Engine, OptimConfig
    from fedbench.engine.memory import CPU_BUDGET, default_budget
    from fedbench.models import build_model

    cuda = device.startswith("cuda")
    dev = torch.device(device)
    n, batch = 24, 32
    fed = make_eval_fed(n, device, train=64, test=1)
    optim = OptimConfig(name="sgd", lr=0.05)
    info: dict = {}
    problems = []

    budget = default_budget(dev)
    want = torch.cuda.get_device_properties(dev).total_memory / 2 if cuda else float(CPU_BUDGET)
    info["default_budget_gib"] = round(budget / 2**30, 2)
    if budget != want:
        problems.append(f"default budget {budget} != {want}")

    def engine(**kw) -> Engine:
        torch.manual_seed(0)
        model = build_model("mlp", fed.input_shape, 10, hidden=[256])
        return Engine(fed, model, device=device, backend="vmap", **kw)

    ref_eng = engine()
    per = ref_eng.memory.train_bytes(optim, batch, False)
    info["estimate_mib_per_client"] = round(per / 2**20, 3)
    if ref_eng.memory.chunk_size(n, per) != n:
        problems.append("the default budget does not hold 24 small clients in one chunk")
    small = 6.5 * per / 2**30  # GiB: room for 6 clients -> 4 chunks of 6
    results = {}
    for label, kw in (
        ("one chunk", {}),
        ("budget for 6", {"memory_budget": small}),
        ("chunk_clients=1", {"chunk_clients": 1}),
    ):
        eng = engine(**kw)
        k = eng.memory.chunk_size(n, per)
        states = eng.initial_state()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        res = eng.train(states, list(range(n)), optim=optim, lr=0.05, batch_size=batch, epochs=1)
        row = {"chunk": k}
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            out_bytes = res.states.numel() * 4  # the call's result, not a chunk's working set
            row["peak_mib"] = round(peak / 2**20, 2)
            row["estimate_mib"] = round((k * per + out_bytes) / 2**20, 2)
            if peak > k * per + out_bytes:
                problems.append(f"{label}: peak {row['peak_mib']} MiB > {row['estimate_mib']}")
        results[label] = res.states.detach().to("cpu", torch.float64)
        info[label] = row
    if info["budget for 6"]["chunk"] != 6:
        problems.append(f"budget for 6 clients gave chunks of {info['budget for 6']['chunk']}")
    ref = results["one chunk"]
    for label in ("budget for 6", "chunk_clients=1"):
        rel = float((results[label] - ref).norm() / ref.norm())
        info[f"{label} rel diff"] = rel
        if rel > TOL.chunk_rel:
            problems.append(f"{label}: states differ by {rel:.1e} (> {TOL.chunk_rel:g})")
    peak_note = "" if cuda else "; peak memory n/a on the CPU"
    summary = "; ".join(problems) or (
        f"chunks {[info[k]['chunk'] for k in ('one chunk', 'budget for 6', 'chunk_clients=1')]}"
        f", default budget {info['default_budget_gib']} GiB, same states within "
        f"{TOL.chunk_rel:g}{peak_note}"
    )
    return ("fail" if problems else "pass"), summary, info


def tests_check(status: str, rc: str, seconds: str, xml: str, log: str):
    """The quick tests' outcome (run by gpu_check.sh before this script): counts and the
    failed tests with their first message line, from the JUnit XML, or from the verbose log
    when a time limit stopped pytest before it wrote the XML."""
    import re
    import xml.etree.ElementTree as ET

    counts: dict[str, int] = {}
    failed: dict[str, str] = {}
    try:
        root = ET.parse(xml).getroot()
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    if tag != "skipped":
                        failed[name] = (el.get("message") or "").splitlines()[0][:200]
                    break
            counts[outcome] = counts.get(outcome, 0) + 1
        source = "tests.xml"
    except (OSError, ET.ParseError):
        text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
        for outcome, name in re.findall(r"\b(PASSED|FAILED|ERROR|SKIPPED)\s+(tests/\S+)", text):
            counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
            if outcome in ("FAILED", "ERROR"):
                failed[name] = outcome
        source = "tests.log (no XML: stopped by the time limit?)"
    timed_out = rc in ("124", "137")
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no test ran"
    summary = f"pytest -m quick: {summary} (from {source})"
    if timed_out:
        summary += "; stopped at its time limit"
    if failed:
        summary += "; failed: " + ", ".join(list(failed)[:8]) + (" ..." if len(failed) > 8 else "")
    ok = status == "pass" and not failed and counts.get("passed", 0) > 0
    return ("pass" if ok else "fail"), summary, {"counts": counts, "failed": failed}, seconds


# ---------------------------------------------------------------------------- main
def pool_map(fn, tasks: list[tuple], workers: int) -> list:
    """fn(*task) for each task, in `workers` fresh processes (CUDA needs spawn) or here; a
    task whose process died (a CUDA fault can kill it) gives its exception instead."""
    if workers <= 1:
        return [fn(*t) for t in tasks]
    import multiprocessing as mp

    out = []
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        futures = [ex.submit(fn, *t) for t in tasks]
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 (BrokenProcessPool and the like)
                out.append(e)
    return out


def warm_data_cache() -> None:
    """Decode Fashion-MNIST once before workers start (they would race to write its cache)."""
    from fedbench.data.sources import load_dataset

    load_dataset("fmnist", None)


def run_agreement(args, algos: list[str], deadline: float, perturb: bool = False) -> dict:
    threads = max(1, (os.cpu_count() or 2) // max(args.workers, 1))
    tasks = [(a, args.device, threads, deadline, perturb) for a in algos]
    out = {}
    for (algo, *_), part in zip(tasks, pool_map(agreement_task, tasks, args.workers)):
        if isinstance(part, BaseException):
            part = {key_of(algo, m, b): error_record(part) for m in MODELS for b in BACKENDS}
        out.update(part)
    return out


def make_reference(args) -> int:
    import torch

    if args.device != "cpu":
        print("--make-reference runs on the CPU: add --device cpu", file=sys.stderr)
        return 2
    from fedbench.algorithms import ALGORITHMS

    setup_worker("cpu", max(1, (os.cpu_count() or 2) // max(args.workers, 1)))
    warm_data_cache()
    t0 = time.perf_counter()
    algos = args.algos.split(",") if args.algos else ALGORITHMS.names()
    runs = run_agreement(args, algos, deadline=float("inf"))
    perturbed = run_agreement(args, algos, deadline=float("inf"), perturb=True)
    for k, r in runs.items():  # each run's own sensitivity to rounding-sized changes
        p = perturbed.get(k, {})
        if r["status"] == "ok" and p.get("status") == "ok" and algo_of(k) not in DEVICE_RNG:
            d, why = deltas(p, r)
            r["sensitivity"] = {x: float(f"{v:.3g}") for x, v in d.items()} if not why else None
    ref = {
        "made_with": {
            "torch": torch.__version__,
            "machine": _machine(),
            "code_digest": code_digest(),
            "seconds": round(time.perf_counter() - t0),
        },
        "settings": settings(),
        "runs": runs,
    }
    text = "{\n"
    text += f' "made_with": {json.dumps(ref["made_with"])},\n'
    text += f' "settings": {json.dumps(ref["settings"])},\n'
    text += ' "runs": {\n'
    text += ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(runs.items()))
    text += "\n }\n}\n"
    args.reference.write_text(text)
    bad = {k: v["error"] for k, v in runs.items() if v["status"] != "ok"}
    print(f"{args.reference}: {len(runs)} runs in {ref['made_with']['seconds']} s")
    for k, e in bad.items():
        print(f"  {k}: {e}")
    return 0


def _machine() -> str:
    import platform

    return f"{platform.machine()} {platform.processor() or platform.platform()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--out", type=Path, help="report folder (report.md, report.json)")
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    ap.add_argument("--make-reference", action="store_true", help="write --reference (CPU)")
    ap.add_argument(
        "--checks",
        default="auto,agreement,resume,eval_memory,chunking",
        help="comma-separated subset of auto, agreement, resume, eval_memory, chunking",
    )
    ap.add_argument("--algos", help="comma-separated algorithms (default: every registered)")
    ap.add_argument("--workers", type=int, help="processes for the runs (default: cuda 6, cpu 1)")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds; later runs skipped")
    ap.add_argument(
        "--tests",
        nargs=5,
        metavar=("STATUS", "RC", "SECONDS", "XML", "LOG"),
        help="the quick tests' outcome, for the report (gpu_check.sh)",
    )
    args = ap.parse_args(argv)
    if args.workers is None:
        args.workers = 6 if args.device.startswith("cuda") else 1
    t_start = time.time()
    deadline = t_start + args.budget

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check.py: --device {args.device} but no CUDA GPU is visible", file=sys.stderr)
        return 2
    if args.make_reference:
        return make_reference(args)
    if args.out is None:
        print("gpu_check.py: --out OUTDIR is required", file=sys.stderr)
        return 2
    try:
        reference = json.loads(args.reference.read_text())
    except (OSError, ValueError) as e:
        print(f"gpu_check.py: cannot read {args.reference}: {e}", file=sys.stderr)
        return 2
    from fedbench.algorithms import ALGORITHMS

    algos = args.algos.split(",") if args.algos else ALGORITHMS.names()
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    setup_worker(args.device, os.cpu_count() or 1)
    cuda = args.device.startswith("cuda")
    made = reference["made_with"]
    meta = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if cuda else _machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "reference_torch": made["torch"],
        "reference_machine": made["machine"],
        "reference_stale": made["code_digest"] != code_digest(),
        "settings_match": reference["settings"] == json.loads(json.dumps(settings())),
        "tolerance": asdict(TOL),
        "tf32": False,
    }
    report = Report(args.out, meta)
    if meta["reference_stale"]:
        print(
            "warning: scripts/gpu_reference.json was made from other fedbench code: "
            "differences may be the code's; regenerate it with "
            "`python scripts/gpu_check.py --make-reference --device cpu`",
            file=sys.stderr,
        )
    if not meta["settings_match"]:
        report.add("reference", "fail", 0, "made with other settings: regenerate it")
        return 1
    if args.tests:
        status, summary, details, seconds = tests_check(*args.tests)
        report.add("quick tests", status, float(seconds), summary, details=details)
    warm_data_cache()

    def timed(name: str, fn, *a) -> None:
        t0 = time.perf_counter()
        try:
            status, summary, details = fn(*a)
        except Exception as e:  # noqa: BLE001 (a check that crashes is a failed check)
            status, summary, details = "fail", f"{type(e).__name__}: {e}", {}
            traceback.print_exc()
        report.add(name, status, time.perf_counter() - t0, summary, details=details)

    if "auto" in checks:
        timed("auto", check_auto, args.device)
    if "agreement" in checks:
        t0 = time.perf_counter()
        runs = run_agreement(args, algos, deadline)
        counts: dict[str, int] = {}
        for k, got in runs.items():
            algo = k.split("/")[0]
            status, note, d = compare(algo, got, reference["runs"].get(k))
            report.agreement[k] = {
                "status": status,
                "note": note,
                "deltas": d,
                "backend_used": got.get("backend_used", ""),
                "device": got.get("device", ""),
                "seconds": got.get("seconds"),
            }
            counts[status] = counts.get(status, 0) + 1
        worst = {
            x: max((r["deltas"].get(x, 0.0) for r in report.agreement.values()), default=0.0)
            for x in ("loss_rel", "state_rel", "acc_abs")
        }
        status = "fail" if counts.get("fail") else ("pass" if counts.get("pass") else "n/a")
        summary = (
            f"{len(runs)} runs ({len(algos)} algorithms x 2 models x 2 backends): "
            + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            + f"; largest differences: loss {worst['loss_rel']:.1e}, state "
            f"{worst['state_rel']:.1e}, accuracy {worst['acc_abs']:.3f}"
        )
        report.add("agreement", status, time.perf_counter() - t0, summary, worst=worst)
    if "resume" in checks:
        t0 = time.perf_counter()
        other = "cpu"
        tasks = []
        resumed = [a for a in RESUME_ALGOS if a in algos]
        for a in resumed:
            tasks += [(a, args.device, other, 1, deadline), (a, other, args.device, 1, deadline)]
        got = pool_map(resume_task, tasks, args.workers)
        rows, bad = {}, []
        for (a, first, second, *_), g in zip(tasks, got):
            if isinstance(g, BaseException):
                g = error_record(g)
            status, note, d = compare(a, g, reference["runs"].get(key_of(a, *RESUME_KEY)))
            rows[f"{a} {first}->{second}"] = {"status": status, "note": note, "deltas": d}
            if status != "pass":
                bad.append(f"{a} {first}->{second}: {note or status}")
        summary = "; ".join(bad) or (
            f"{len(tasks)} runs killed after round 1 and resumed on the other device "
            f"({', '.join(resumed)}) agree with the CPU reference"
        )
        report.add("resume", "fail" if bad else "pass", time.perf_counter() - t0, summary,
                   details=rows)  # fmt: skip
    if "eval_memory" in checks:
        timed("eval_memory", check_eval_memory, args.device)
    if "chunking" in checks:
        timed("chunking", check_chunking, args.device)
    failed = [c["check"] for c in report.checks if c["status"] == "fail"]
    print(f"gpu_check.py: {len(report.checks)} checks, failed: {failed or 'none'}; "
          f"{time.time() - t_start:.0f} s; report in {args.out}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
