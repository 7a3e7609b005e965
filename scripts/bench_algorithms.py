"""Every algorithm's round against FedAvg's, beside its arithmetic (issue 33, item 2).

For each registered algorithm (`fedbench.algorithms.ALGORITHMS`) and each setting, the
seconds one training round takes (`Algorithm.round`, as the runner calls it; evaluation is
not timed), divided by FedAvg's round in the same setting, measured in the same process
with the same threads, interleaved with the algorithm's rounds: F A F A F A F (F a FedAvg
round, A a timed round of the algorithm, after its warm-up rounds); each side is the median
of its rounds. Beside it the arithmetic multiple: the forward and backward passes of the
run's model per sample that the algorithm's definition needs, in FedAvg rounds (one
forward + backward per sample per epoch = 1; a forward alone is its measured share f of
the FLOPs of a forward + backward; the derivation of each is `ARITHMETIC` below and the
second table). ratio / multiple is what the implementation pays over its arithmetic; above
1.3 the "why" column says what the engines did differently from FedAvg (`Engine.backend_for`'s
choice and its logged reason, a hand-written per-client loop) and what the count leaves out.

Settings (`--quick`: tiny ones, for a smoke test of the script itself):
- mlp: FMNIST pat-2, 20 clients all sampled, 600 training samples each, MLP 784-200-200-10,
  E = 1, B = 50 (the issue's setting);
- cnn: FMNIST pat-2, 5 clients all sampled, 300 samples each, LeNet-5 CNN (`model=cnn
  model.preset=lenet`: conv 6-16, FC 120-84), E = 1, B = 25 (12 steps per client, as the
  MLP setting). Not the FedAvg CNN preset: its 0.58M parameters put pFedHN's hypernetwork
  over `hypernet.max_params`, and at 8x LeNet's FLOPs per sample a CPU run of all
  algorithms takes hours.

Rounds: `--warmup` rounds (default 2: round 0 pays first-call costs, FedDBE's initialization
period and FedPAC's round without centroids; round 1 FedALA's start phase) are not timed,
then up to `--rounds` timed rounds, fewer once the algorithm has used `--budget` FedAvg
rounds of time (at least one timed round). An algorithm whose round 0 alone exceeds the
budget (pFedHN) has that round timed instead (first-call costs are small beside it); the
"rounds" column says which rounds were timed. Runs are built through the library
(`fedbench.runner.Run` on the composed config, `engine.backend=auto`), not subprocesses.
Output: the tables on stdout and `algorithms.md`, `algorithms.csv`, `raw.json` in `--out`
(default: a new temporary directory; nothing is written into the repository).

    python scripts/bench_algorithms.py                        # all algorithms, mlp and cnn
    python scripts/bench_algorithms.py --algos fedavg,ditto --settings mlp --rounds 5
    taskset -c 0 python scripts/bench_algorithms.py --threads 1 --out /tmp/bench
    python scripts/bench_algorithms.py --device cuda           # the same on a GPU
    python scripts/bench_algorithms.py --render /tmp/bench/raw.json  # the tables again

Torch runs one CPU thread by default (`--threads`), FedAvg and every algorithm alike, so
that ratios compare like with like on a shared machine (pin the process with taskset too).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import math
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.utils.flop_counter import FlopCounterMode

from fedbench.algorithms import ALGORITHMS
from fedbench.config import task_config
from fedbench.engine import Engine
from fedbench.paths import CONF_DIR
from fedbench.runner import Run

FLAG = 1.3  # ratio / multiple above this gets a "why"
RUN_ROUNDS = 100  # the configured run length (APPLE's lambda schedule, FedSpa's prune rate)
TEST_PER_CLIENT = 50  # test samples per client: built, never evaluated here


# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Setting:
    key: str
    title: str
    model: tuple[str, ...]  # the model's overrides
    clients: int  # N, all sampled every round
    samples: int  # training samples per client
    batch: int
    epochs: int = 1

    def overrides(self, algo: str, device: str) -> list[str]:
        return [
            "data=fmnist",
            "split=pat",
            "split.classes_per_client=2",
            f"split.train_per_client={self.samples}",
            f"split.test_per_client={TEST_PER_CLIENT}",
            f"clients={self.clients}",
            "participation=1.0",
            *self.model,
            f"local_epochs={self.epochs}",
            f"batch_size={self.batch}",
            f"rounds={RUN_ROUNDS}",
            f"device={device}",
            "engine.backend=auto",
            f"algo={algo}",
        ]


SETTINGS = {
    "mlp": Setting(
        "mlp",
        "FMNIST pat-2, 20 of 20 clients x 600 samples, MLP 784-200-200-10, E = 1, B = 50",
        ("model=mlp", "model.hidden=[200,200]"),
        clients=20,
        samples=600,
        batch=50,
    ),
    "cnn": Setting(
        "cnn",
        "FMNIST pat-2, 5 of 5 clients x 300 samples, LeNet-5 CNN (conv 6-16, FC 120-84), "
        "E = 1, B = 25",
        ("model=cnn", "model.preset=lenet"),
        clients=5,
        samples=300,
        batch=25,
    ),
}
QUICK = {
    "mlp": Setting(
        "mlp", "quick: 4 clients x 40, MLP 784-16-10, B = 10", ("model=mlp", "model.hidden=[16]"),
        clients=4, samples=40, batch=10,
    ),
    "cnn": Setting(
        "cnn", "quick: 3 clients x 30, LeNet-5, B = 10", ("model=cnn", "model.preset=lenet"),
        clients=3, samples=30, batch=10,
    ),
}  # fmt: skip


def build(setting: Setting, algo: str, device: str, out: Path) -> Run:
    """The run the CLI would build for this setting and algorithm (nothing is written)."""
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(
            config_name="config",
            overrides=setting.overrides(algo, device),
            return_hydra_config=True,  # the algorithm's name is the option chosen
        )
    return Run(task_config(cfg), out / f"{setting.key}_{algo}", progress=False)


# ---------------------------------------------------------------------------- probes
BACKEND_LOG = re.compile(r"engine backend (?P<choice>\w+) \((?P<asked>\w+); (?P<why>.*)\)$")


@dataclass
class Trace:
    """What the engines did during an algorithm's timed rounds."""

    rounds: int = 0
    backends: Counter = field(default_factory=Counter)  # backend_for's choices (train, grads)
    own_steps: int = 0  # Engine.grad_at calls: steps of an algorithm's own per-client loop
    loss_passes: int = 0  # Engine.full_grads(with_grad=False) calls (S-FedPG's line search)

    def per_round(self, n: int) -> float:
        return n / max(self.rounds, 1)

    def backend(self) -> str:
        parts = [b for b, _ in self.backends.most_common()]
        if self.own_steps:
            parts.append("own loop")
        return " + ".join(parts) or "-"


class _Reasons(logging.Handler):
    """Collects the backend choices the engine logs (once per engine and reason)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: dict[str, set[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = BACKEND_LOG.match(record.getMessage())
        if m:
            self.reasons.setdefault(m["choice"], set()).add(m["why"])


class Probes:
    """Counts what the engines do without changing it: wraps `Engine.backend_for`,
    `Engine.grad_at` and `Engine.full_grads` (restored on exit) and reads the reasons
    `backend_for` logs. Records into `trace` while it is set."""

    NAMES = ("backend_for", "grad_at", "full_grads")

    def __init__(self) -> None:
        self.trace: Trace | None = None
        self.handler = _Reasons()

    def __enter__(self) -> Probes:
        self.saved = {n: getattr(Engine, n) for n in self.NAMES}
        backend_for, grad_at, full_grads = self.saved.values()
        probes = self

        def traced_backend_for(eng, n_clients, objective=None, **kw):
            choice = backend_for(eng, n_clients, objective, **kw)
            if probes.trace is not None:
                probes.trace.backends[choice] += 1
            return choice

        def traced_grad_at(eng, *args, **kw):
            if probes.trace is not None:
                probes.trace.own_steps += 1
            return grad_at(eng, *args, **kw)

        def traced_full_grads(eng, states, clients, *, with_grad=True, block=None):
            if probes.trace is not None and not with_grad:
                probes.trace.loss_passes += 1
            return full_grads(eng, states, clients, with_grad=with_grad, block=block)

        Engine.backend_for = traced_backend_for
        Engine.grad_at = traced_grad_at
        Engine.full_grads = traced_full_grads
        logger = logging.getLogger("fedbench")
        self.level = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        for n, f in self.saved.items():
            setattr(Engine, n, f)
        logger = logging.getLogger("fedbench")
        logger.removeHandler(self.handler)
        logger.setLevel(self.level)

    def reset_reasons(self) -> dict[str, set[str]]:
        self.handler.reasons = {}
        return self.handler.reasons

    @contextmanager
    def recording(self, trace: Trace) -> Iterator[None]:
        self.trace = trace
        try:
            yield
        finally:
            self.trace = None
            trace.rounds += 1


# ---------------------------------------------------------------------------- arithmetic
@dataclass(frozen=True)
class Ctx:
    """What a multiple is computed from: the setting and the run model's FLOPs."""

    E: int  # local epochs
    n: int  # training samples per client
    B: int  # batch size
    N: int  # clients
    C: int  # clients per round
    P: int  # the run model's parameters
    pass_flops: float  # forward + backward FLOPs per sample (the unit)
    f: float  # a forward's share of a forward + backward

    @property
    def steps(self) -> int:
        """Local steps per client per round."""
        return math.ceil(self.n / self.B) * self.E


Multiple = Callable[[object, Ctx, Trace], float]  # (algorithm, setting, trace) -> multiple


@dataclass(frozen=True)
class Arith:
    """An algorithm's forward + backward passes per sample per round, in FedAvg rounds."""

    formula: str  # the count and its derivation
    value: Multiple
    approx: bool = False  # "~": an estimate (variable or modelled work)
    left_out: str = ""  # work the count leaves out (server, optimizer steps, an
    # implementation's own extras); quoted in "why" when the ratio is flagged


def _one(a, c, tr) -> float:
    return 1.0


def _forward_flops(model: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return float(counter.get_total_flops())


def fedcp_extra(a, c: Ctx) -> float:
    """FedCP's trained module (body, CPN, both heads) over the run model, in forward FLOPs."""
    eng = a.engine
    x = eng.fed.batch(eng.fed.train_idx[0][: c.B])[0]
    base = _forward_flops(eng.model, x)
    return _forward_flops(a.trainer.model, x) / base - 1.0


def hypernet_flops(a) -> float:
    """FLOPs of one generate h(v_i; phi): the heads' Linear(hidden, G) over the generated G."""
    return 2.0 * a.hp.hypernet.hidden * float(a.gen_mask.sum())


def pfedhn_steps(a, c: Ctx) -> float:
    """Inner forward + backward passes per sample of the round, in FedAvg rounds."""
    if a.hp.inner_epochs:
        return a.hp.inner_epochs / c.E
    return a.hp.inner_steps * c.B / (c.E * c.n)


FROZEN = (
    "frozen layers: no backward through them and the step on the trained ranges only, but "
    "each step's gradient is still assembled over all P entries (the backward of the flat "
    "state's split writes zeros for the frozen ones: one [C, P] write per step)"
)
TERMS = (
    "loss terms: in closed form, but each step still passes over the clients' [C, P] "
    "parameters a few times (the terms' values for the reported loss, their gradient, its "
    "add): memory-bound vector work the pass count does not see"
)
HYPERNET = "the hypernetwork's VJP and SGD step over all its H G entries per client (memory-bound)"

ARITHMETIC: dict[str, Arith] = {
    "fedavg": Arith("1: E epochs, one forward + backward per sample per epoch (the unit)", _one),
    "fedprox": Arith(
        "1: FedAvg's passes; the proximal term is a vector op per step", _one, left_out=TERMS
    ),
    "local": Arith("1: FedAvg's passes on each client's own model", _one),
    "fedper": Arith("1: FedAvg's passes; the personal layers change what is averaged", _one),
    "fedbn": Arith("1: FedAvg's passes; the BN layers stay local", _one),
    "lg_fedavg": Arith("1: FedAvg's passes; only the head is averaged", _one),
    "fedbabu": Arith(
        "1: FedAvg's passes, head frozen (the body's backward is still needed); the "
        "fine-tuning runs at evaluation (not timed)",
        _one,
    ),
    "scaffold": Arith(
        "1: the control-variate correction is a vector op per step", _one, left_out=TERMS
    ),
    "feddyn": Arith(
        "1: the linear and proximal terms are vector ops per step", _one, left_out=TERMS
    ),
    "fedamp": Arith(
        "1: the proximal term to u_i", _one, left_out=TERMS + "; server: N x N Gram of the models"
    ),
    "diversifed": Arith(
        "1: the proximal term to z_i", _one, left_out=TERMS + "; server: N x N Gram of the models"
    ),
    "fedcac": Arith("1: FedAvg's passes", _one, left_out="server: masks, C x C overlaps"),
    "fedmgda": Arith(
        "1: FedAvg's passes", _one, left_out="server: min-norm QP on the C x C Gram (host)"
    ),
    "cfl": Arith("1: FedAvg's passes", _one, left_out="server: update norms and similarities"),
    "pfedla": Arith(
        "1: FedAvg's passes",
        _one,
        left_out="server: each client's layer-wise mix of N models and hypernetwork VJP",
    ),
    "fedsam": Arith("2: a forward + backward at w and one at w + eps per step", lambda a, c, t: 2),
    "ditto": Arith(
        "1 + personal_epochs/E: E epochs of the global copy, then personal_epochs of theta_i "
        "(+ a proximal term)",
        lambda a, c, t: 1 + a.personal_epochs / c.E,
        left_out=TERMS,
    ),
    "apfl": Arith(
        "2: per step a forward + backward of w and of theta = alpha v + (1 - alpha) w",
        lambda a, c, t: 2,
        left_out=(
            "per step the mixed model alpha v + (1 - alpha) w built elementwise over every "
            "client's parameters, and its gradient split back (profiled: 10% of its MLP round); "
            "per round the column gathers between the trainer's layout and the model's"
        ),
    ),
    "apple": Arith(
        "1 + 4NP/(B pass): the mixture's forward + backward, and per step two N x P products "
        "(the mixture p @ cores, the p-gradient cores @ g)",
        lambda a, c, t: 1 + 4 * c.N * c.P / (c.B * c.pass_flops),
        approx=True,
        left_out=(
            "per step six elementwise passes over [k, P] (<c_i, g>'s product and sum, "
            "p_i g, the core's step, the mixture's own-row add and its copy into theta): "
            "memory-bound, each about a third of a FedAvg step on the MLP (profiled)"
        ),
    ),
    "perfedavg": Arith(
        "2 floor(S/2)/S + N B/(C E n): batches in pairs (D, D'), one forward + backward each "
        "(an odd last batch unused; S steps), then one personalization step on one batch for "
        "every client",
        lambda a, c, t: 2 * (c.steps // 2) / c.steps + c.N * c.B / (c.C * c.E * c.n),
    ),
    "pfedme": Arith(
        "R K B/(E n): R = local_rounds batches (20), K = inner_steps (5) forward + backward on "
        "each (R = E epochs of batches when local_rounds is null); w's step is a vector op",
        lambda a, c, t: (
            ((a.hp.local_rounds * c.B / (c.E * c.n)) if a.hp.local_rounds else 1.0)
            * a.hp.inner_steps
        ),
    ),
    "plgu_lf": Arith(
        "2: per step theta_i's gradient and w_i's at w_i + eps (3 with ascent_grad universal)",
        lambda a, c, t: 3 if a.hp.ascent_grad == "universal" else 2,
    ),
    "plgu_grep": Arith(
        "head_epochs f/E + 3 body_steps B/(E n): head epochs with the body frozen (a forward; "
        "the head's backward ~0), then body_steps batches of three forward + backward "
        "(eqs. 11-13)",
        lambda a, c, t: a.hp.head_epochs * c.f / c.E + 3 * a.hp.body_steps * c.B / (c.E * c.n),
        left_out=FROZEN,
    ),
    "pfedhn": Arith(
        "S B/(E n) + 8 H G/(E n pass): S = inner_steps (50) forward + backward on B samples; "
        "per client one generate (2HG FLOPs: hidden H, G generated entries) and one VJP (6HG)",
        lambda a, c, t: pfedhn_steps(a, c) + 4 * hypernet_flops(a) / (c.E * c.n * c.pass_flops),
        approx=True,
        left_out=HYPERNET,
    ),
    "plgu_ghn": Arith(
        "S B/(E n) + 14 H G/(E n pass): pFedHN's passes and a second VJP at phi + eps (LWSAM)",
        lambda a, c, t: pfedhn_steps(a, c) + 7 * hypernet_flops(a) / (c.E * c.n * c.pass_flops),
        approx=True,
        left_out=HYPERNET,
    ),
    "fedrep": Arith(
        "(head_epochs f + body_epochs)/E: head epochs (10) with the body frozen (a forward; "
        "the head's backward ~0), then the body epochs (1)",
        lambda a, c, t: (a.hp.head_epochs * c.f + a.hp.body_epochs) / c.E,
        left_out=FROZEN,
    ),
    "fedpac": Arith(
        "(head_epochs f + body_epochs + 2f)/E: a forward over the data for the statistics "
        "before training and the centroids after, the head epoch (body frozen: a forward), "
        "the body epochs",
        lambda a, c, t: (a.hp.head_epochs * c.f + a.hp.body_epochs + 2 * c.f) / c.E,
        left_out=FROZEN + "; server: one QP per client (cvxopt, host)",
    ),
    "fedproto": Arith(
        "1 + f/E: local training, then a forward over the data for the prototypes",
        lambda a, c, t: 1 + c.f / c.E,
    ),
    "fedrod": Arith("~1: body and generic head; the personal head on detached features ~0", _one),
    "splitgp": Arith(
        "~1: body, server head and the auxiliary head (~0)",
        _one,
        left_out=(
            "per round the column gathers and scatters of the [C, D] rows between the "
            "trainer's layout (with the auxiliary head) and the model's, and the body mix "
            "gamma own + (1 - gamma) mean (profiled: a quarter of its MLP round)"
        ),
    ),
    "moon": Arith(
        "1 + 2f: per step two frozen feature forwards (global and previous model)",
        lambda a, c, t: 1 + 2 * c.f,
    ),
    "fedcp": Arith(
        "1 + x + f: the CPModel's forward + backward (body, CPN Linear K -> 2K + LayerNorm, two "
        "heads; x = its forward FLOPs beyond the run model's, measured) and the frozen global "
        "body's forward for the MMD",
        lambda a, c, t: 1 + fedcp_extra(a, c) + c.f,
        approx=True,
    ),
    "gpfl": Arith(
        "~1: the model's passes; CoV acts on one conditional vector per client, the GCE "
        "cosine logits are B x U x K (~0)",
        _one,
        left_out=(
            "CoV's weights per client (2 K x K: 40% of the MLP's P): per step each is applied "
            "to p_i and g, its gradient two outer products summed, plus mu's decay: "
            "memory-bound passes over 2K^2 entries per client"
        ),
    ),
    "feddbe": Arith(
        "~1: PRBM and the mean regularizer are vector ops (the initialization period is in "
        "round 0, not timed)",
        _one,
    ),
    "fedala": Arith(
        "1 + (s/100) f/E: after the start phase (round 1, not timed) one ALA epoch on s% of "
        "the data, head only (p = 1): the body's forward once, head steps ~0",
        lambda a, c, t: 1 + a.hp.rand_percent / 100 * c.f / c.E,
        left_out="the ALA weight steps (autograd through functional_call per batch)",
    ),
    "fedem": Arith(
        "M + M f/E: the E-step's M forwards over the data, then M components trained E epochs",
        lambda a, c, t: a.hp.components * (1 + c.f / c.E),
        left_out=(
            "the engine's objective recomputes q per batch: M frozen forwards in each of the M "
            "components' steps (+M^2 f: 9 forwards at M = 3)"
        ),
    ),
    "fedfomo": Arith(
        "(1 - v) + (1 + M) v f/E: training on the non-validation 1 - v, validation forwards of "
        "its own and M received models (M = min(m, C - 1))",
        lambda a, c, t: (
            (1 - a.hp.val_frac) + (1 + min(a.hp.m or c.C, c.C - 1)) * a.hp.val_frac * c.f / c.E
        ),
    ),
    "ifca": Arith(
        "1 + k f/E: the k cluster models' forwards over the client's data pick its cluster",
        lambda a, c, t: 1 + a.hp.k * c.f / c.E,
    ),
    "knnper": Arith(
        "1 - v: FedAvg on the training part (datastore and lambda at evaluation, not timed)",
        lambda a, c, t: 1 - a.hp.val_frac,
    ),
    "fedpg": Arith(
        "1/E: one forward + backward over the client's data at w^t (client_grad full)",
        lambda a, c, t: 1 / c.E if a.hp.client_grad == "full" else 1 + c.f / c.E,
        left_out="server: the C x C Gram and the QP (host)",
    ),
    "sfedpg": Arith(
        "(1 + q f)/E: FedPG's gradient and q loss-only passes of the line search (q counted "
        "in the timed rounds)",
        lambda a, c, t: (1 + t.per_round(t.loss_passes) * c.f) / c.E,
        approx=True,
        left_out="server: the C x C Gram and the QP (host)",
    ),
    "fedslr": Arith(
        "1 + fusion_epochs/E: Phase I (FedDyn's local problem), then Phase II's epochs on p_i",
        lambda a, c, t: 1 + a.hp.fusion_epochs / c.E,
        left_out=TERMS + "; server: the per-layer SVD of the nuclear prox",
    ),
    "fedgh": Arith(
        "1 + f/E: FedAvg's passes from the global header, then a forward over the data for "
        "the per-class mean representations",
        lambda a, c, t: 1 + c.f / c.E,
        left_out="server: the header's fit on the uploaded representations (C x K rows)",
    ),
    "fedspa": Arith(
        "1 + B/(E n): masked training, then one batch's gradient for prune-and-grow",
        lambda a, c, t: 1 + c.B / (c.E * c.n),
        left_out=(
            "the masked step (a [C, P] product each step) and prune-and-grow: per layer two "
            "selections of k of its entries per client (kthvalue and masks: several passes "
            "over [C, P]) and a one-batch gradient per client, one client at a time"
        ),
    ),
}


def model_ctx(run: Run, setting: Setting) -> Ctx:
    """The setting's Ctx, with the FLOPs of the run model measured on one batch."""
    model = run.engine.model
    fed = run.fed
    x, y = fed.batch(fed.train_idx[0][: setting.batch])
    was = model.training
    model.train()
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    total = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    fwd = _forward_flops(model, x)
    model.train(was)
    b = x.shape[0]
    return Ctx(
        E=setting.epochs,
        n=setting.samples,
        B=setting.batch,
        N=setting.clients,
        C=setting.clients,
        P=run.engine.n_params,
        pass_flops=total / b,
        f=fwd / total,
    )


# ---------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_round(run: Run, t: int) -> float:
    clients = run.sample()
    sync(run.device)
    t0 = time.perf_counter()
    run.algo.round(t, clients)
    sync(run.device)
    return time.perf_counter() - t0


class Reference:
    """FedAvg's round in one setting, run beside every algorithm (its own Run)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.t = 0
        self.times: list[float] = []

    def round(self) -> float:
        dt = timed_round(self.run, self.t)
        self.t += 1
        self.times.append(dt)
        return dt

    def typical(self) -> float:
        return statistics.median(self.times[-5:])


@dataclass
class Measurement:
    algo: str
    setting: str
    seconds: float | None = None  # median s/round over the timed rounds
    fedavg: float | None = None  # median FedAvg s/round beside them
    timed: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    fedavg_times: list[float] = field(default_factory=list)
    warmup_times: list[float] = field(default_factory=list)
    trace: Trace = field(default_factory=Trace)
    reasons: dict[str, list[str]] = field(default_factory=dict)
    multiple: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        if self.seconds is None or not self.fedavg:
            return None
        return self.seconds / self.fedavg

    @property
    def over(self) -> float | None:
        r = self.ratio
        return None if r is None or not self.multiple else r / self.multiple

    def rounds_text(self) -> str:
        if not self.timed:
            return "-"
        lo, hi = self.timed[0], self.timed[-1]
        return str(lo) if lo == hi else f"{lo}-{hi}"


def measure(
    name: str, setting: Setting, ref: Reference, ctx: Ctx, probes: Probes, args, out: Path
) -> Measurement:
    """Warm-up rounds, then timed rounds interleaved with FedAvg's: F A F A ... F."""
    m = Measurement(name, setting.key)
    reasons = probes.reset_reasons()
    try:
        run = build(setting, name, args.device, out)
    except Exception as e:  # one algorithm's failure leaves the others' numbers
        m.error = f"build: {type(e).__name__}: {e}".splitlines()[0]
        return m
    try:
        budget = args.budget * ref.typical()
        t, elapsed = 0, 0.0
        first_fedavg = ref.round()  # beside round 0, in case round 0 is the timed one
        trace0 = Trace()
        while t < args.warmup:
            if t == 0:
                with probes.recording(trace0):
                    dt = timed_round(run, t)
            else:
                dt = timed_round(run, t)
            t += 1
            elapsed += dt
            if t == 1 and dt > budget:  # too slow to repeat: round 0 is the measurement
                m.timed, m.times, m.trace = [0], [dt], trace0
                m.fedavg_times = [first_fedavg, ref.round()]
                break
            m.warmup_times.append(dt)
        if not m.timed:
            m.fedavg_times.append(ref.round())
            while len(m.times) < args.rounds and not (m.times and elapsed > budget):
                with probes.recording(m.trace):
                    dt = timed_round(run, t)
                m.timed.append(t)
                m.times.append(dt)
                m.fedavg_times.append(ref.round())
                elapsed += dt
                t += 1
        m.seconds = statistics.median(m.times)
        m.fedavg = statistics.median(m.fedavg_times)
        m.reasons = {k: sorted(v) for k, v in reasons.items()}
        arith = ARITHMETIC.get(name)
        if arith is not None:
            m.multiple = float(arith.value(run.algo, ctx, m.trace))
    except Exception as e:
        m.error = f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        del run
        gc.collect()
    return m


# ---------------------------------------------------------------------------- report
def why(m: Measurement, ref_backend: str) -> str:
    """What the engines did otherwise than for FedAvg, and what the count leaves out."""
    parts = []
    for choice in m.trace.backends:
        if choice != ref_backend:
            said = "; ".join(m.reasons.get(choice, [])) or "reason not logged"
            parts.append(f"{choice}: {said}")
    if m.trace.own_steps:
        per = m.trace.per_round(m.trace.own_steps)
        parts.append(f"own per-client loop: {per:.0f} one-client steps per round (Engine.grad_at)")
    arith = ARITHMETIC.get(m.algo)
    if arith is not None and arith.left_out:
        parts.append(f"not counted: {arith.left_out}")
    if not parts:
        parts.append(f"{ref_backend} as FedAvg; the cost is outside the counted passes")
    return "; ".join(parts)


def _num(x: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def multiple_text(name: str, m: Measurement) -> str:
    arith = ARITHMETIC.get(name)
    if m.multiple is None:
        return "?" if arith is None else "-"
    return ("~" if arith is not None and arith.approx else "") + f"{m.multiple:.2f}"


def rows(
    results: dict[str, dict[str, Measurement]], settings: list[str], ref_backend: dict[str, str]
) -> list[dict[str, str]]:
    """One row per algorithm: each setting's numbers, then the backend and why."""
    out = []
    for name, per in results.items():
        row = {"algorithm": name}
        whys, backends = [], []
        for s in settings:
            m = per[s]
            S = s.upper()
            row[f"{S} s/round"] = _num(m.seconds, ".3f")
            row[f"{S} ratio"] = _num(m.ratio, ".2f", "x")
            row[f"{S} multiple"] = multiple_text(name, m)
            row[f"{S} ratio/multiple"] = _num(m.over, ".2f")
            row[f"{S} rounds"] = m.rounds_text()
            backends.append(f"{S} {m.trace.backend()}" if len(settings) > 1 else m.trace.backend())
            if m.error:
                whys.append(f"{S}: error: {m.error}")
            elif m.over is not None and m.over > FLAG:
                text = why(m, ref_backend[s])
                whys.append(f"{S}: {text}" if len(settings) > 1 else text)
            elif m.multiple is None:
                whys.append(f"{S}: no arithmetic entry in scripts/bench_algorithms.py")
        row["backend"] = "; ".join(backends)
        row["why (ratio/multiple > 1.3)"] = " / ".join(whys)
        out.append(row)
    return out


def markdown(table: list[dict[str, str]]) -> str:
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in table:
        lines.append("| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines)


def arithmetic_table(
    results: dict[str, dict[str, Measurement]], settings: list[str]
) -> list[dict[str, str]]:
    out = []
    for name, per in results.items():
        arith = ARITHMETIC.get(name)
        row = {"algorithm": name}
        for s in settings:
            row[f"{s.upper()} multiple"] = multiple_text(name, per[s])
        row["derivation (f: a forward's share of a forward + backward)"] = (
            arith.formula if arith else "no entry: add one to ARITHMETIC"
        )
        row["left out"] = arith.left_out if arith else ""
        out.append(row)
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {platform.system()} {platform.release()}"


def header(raw: dict) -> str:
    """The run's circumstances: machine, torch, threads, date, rounds, each setting's FedAvg."""
    a = raw["args"]
    lines = [
        f"Machine: {raw['machine']}; torch {raw['torch']}; {raw['threads']} CPU thread(s) for "
        f"FedAvg and every algorithm; device {raw['device']}; {raw['date']}; the whole "
        f"benchmark took {raw['wall_s'] / 60:.1f} min.",
        f"Rounds: {a['warmup']} warm-up, then up to {a['rounds']} timed, fewer past a budget of "
        f"{a['budget']:g} FedAvg rounds; each timed round between two FedAvg rounds; medians.",
    ]
    for s in a["settings"]:
        c, backend = raw["ctx"][s], raw["fedavg_backend"][s]
        why = "; ".join(raw["fedavg_reasons"][s]) or "-"
        lines.append(
            f"{s}: {raw['titles'][s]}. FedAvg {statistics.median(raw['fedavg_times'][s]):.3f} "
            f"s/round (median of its {len(raw['fedavg_times'][s])} rounds after warm-up), backend "
            f"{backend} ({why}); {c['pass_flops'] / 1e6:.2f} MFLOP forward + backward per "
            f"sample, f = {c['f']:.2f}."
        )
    return "\n\n".join(lines)


def to_raw(args, table, results, ref, wall: float) -> dict:
    """Everything measured, as JSON: the tables are rendered from it (`render`)."""
    dev = torch.device(args.device)
    gpu = f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "machine": machine() + gpu,
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "wall_s": wall,
        "args": dict(vars(args)),
        "titles": {s: table[s].title for s in args.settings},
        **ref,
        "results": [
            {
                **{k: v for k, v in vars(m).items() if k != "trace"},
                "trace": {**vars(m.trace), "backends": dict(m.trace.backends)},
            }
            for per in results.values()
            for m in per.values()
        ],
    }


def render(raw: dict) -> tuple[str, list[dict[str, str]]]:
    """(the markdown: circumstances, timings, arithmetic; the timings' rows) of a raw.json."""
    settings = raw["args"]["settings"]
    fields = set(Measurement.__dataclass_fields__)
    results: dict[str, dict[str, Measurement]] = {a: {} for a in raw["args"]["algos"]}
    for r in raw["results"]:
        t = r["trace"]
        trace = Trace(t["rounds"], Counter(t["backends"]), t["own_steps"], t["loss_passes"])
        m = Measurement(**{k: v for k, v in r.items() if k in fields and k != "trace"})
        m.trace = trace
        results[m.algo][m.setting] = m
    main_rows = rows(results, settings, raw["fedavg_backend"])
    arith_rows = arithmetic_table(results, settings)
    text = "\n\n".join([header(raw), markdown(main_rows), markdown(arith_rows)]) + "\n"
    return text, main_rows


def write(raw: dict, out: Path) -> str:
    """algorithms.md and algorithms.csv in `out`, rendered from `raw`; returns the markdown."""
    text, main_rows = render(raw)
    (out / "algorithms.md").write_text(text)
    with open(out / "algorithms.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(main_rows[0]))
        w.writeheader()
        w.writerows(main_rows)
    return text


# ---------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algos", default="all", help="comma-separated algorithm names, or all")
    ap.add_argument("--settings", default="mlp,cnn", help="comma-separated: mlp, cnn")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per algorithm (most)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before them")
    ap.add_argument(
        "--budget", type=float, default=12.0, help="FedAvg rounds of time per algorithm"
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: as set)")
    ap.add_argument("--quick", action="store_true", help="tiny settings: a smoke test")
    ap.add_argument("--out", help="output folder (default: a new temporary directory)")
    ap.add_argument("--render", metavar="RAW_JSON", help="only render the tables of a raw.json")
    args = ap.parse_args(argv)
    names = ALGORITHMS.names()
    args.algos = names if args.algos == "all" else [a.strip() for a in args.algos.split(",")]
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [a for a in args.algos if a not in names]
    if bad:
        ap.error(f"unknown algorithm(s) {', '.join(bad)}; valid: {', '.join(names)}")
    bad = [s for s in args.settings if s not in SETTINGS]
    if bad or not args.settings:
        ap.error(f"unknown setting(s) {', '.join(bad) or '(none)'}; valid: mlp, cnn")
    if args.rounds < 1 or args.warmup < 0 or args.budget <= 0 or args.threads < 0:
        ap.error("--rounds >= 1, --warmup >= 0, --budget > 0 and --threads >= 0")
    if args.render and not Path(args.render).is_file():
        ap.error(f"--render {args.render}: no such file")
    if args.render:
        return args
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        ap.error(f"--device {args.device}: cpu, cuda or cuda:N")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse(argv)
    if args.render:  # the tables again from a raw.json (e.g. after editing ARITHMETIC's notes)
        raw = json.loads(Path(args.render).read_text())
        out = Path(args.out) if args.out else Path(args.render).parent
        out.mkdir(parents=True, exist_ok=True)
        print(write(raw, out))
        return out
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedbench-algos-"))
    out.mkdir(parents=True, exist_ok=True)
    table = QUICK if args.quick else SETTINGS
    start = time.perf_counter()
    results: dict[str, dict[str, Measurement]] = {a: {} for a in args.algos}
    ref: dict[str, dict] = {"fedavg_backend": {}, "fedavg_reasons": {}, "fedavg_times": {}}
    ref["ctx"] = {}
    with tempfile.TemporaryDirectory() as tmp, Probes() as probes:
        for s in args.settings:
            setting = table[s]
            reasons = probes.reset_reasons()
            fedavg = Reference(build(setting, "fedavg", args.device, Path(tmp) / "reference"))
            trace = Trace()
            for _ in range(args.warmup + 3):  # warm, then rounds for `typical`
                with probes.recording(trace):
                    fedavg.round()
            backend = ref["fedavg_backend"][s] = trace.backend()
            ref["fedavg_reasons"][s] = sorted(reasons.get(backend, ()))
            ctx = model_ctx(fedavg.run, setting)
            ref["ctx"][s] = vars(ctx)
            print(f"{s}: {setting.title}; FedAvg {fedavg.typical():.3f} s/round", file=sys.stderr)
            for name in args.algos:
                m = measure(name, setting, fedavg, ctx, probes, args, Path(tmp))
                results[name][s] = m
                print(
                    f"  {s} {name}: {_num(m.seconds, '.3f')} s/round, ratio "
                    f"{_num(m.ratio, '.2f')}, multiple {multiple_text(name, m)}, "
                    f"{m.trace.backend()}, rounds {m.rounds_text()}"
                    + (f", error: {m.error}" if m.error else ""),
                    file=sys.stderr,
                    flush=True,
                )
            ref["fedavg_times"][s] = fedavg.times[args.warmup :]
            del fedavg
            gc.collect()
    raw = to_raw(args, table, results, ref, time.perf_counter() - start)
    (out / "raw.json").write_text(json.dumps(raw, indent=1))
    print(write(raw, out))
    print(f"written: {out}/algorithms.md, algorithms.csv, raw.json", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
