"""Build: from the checked config (`fedbench.config.RunConfig`) to the parts a run trains
with, writing nothing. `build` loads the data (refusing a resume on other data: the check
of `fedbench.checkpoint.check_data`), draws the partition and the S/G evaluation sets, and
builds the federation, the model factory, the engine, the attack, the algorithm and the
client sampler, in the order that fixes their random streams (torch's seed is set just
before the first model is built). It owns the device choice (`resolve_device`) and the
warning about clients with too few test samples; nothing here touches the run directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms.base import Algorithm, RunContext, RunSettings
from fedbench.attack import Attack
from fedbench.checkpoint import Saved, check_data
from fedbench.config import RunConfig, clients_per_round
from fedbench.data.federation import Federation
from fedbench.data.sources import load_dataset
from fedbench.data.splits import Partition, eval_sets, make_partition
from fedbench.engine import Engine
from fedbench.engine.rows import GIB, RowsPolicy
from fedbench.errors import ConfigError, FedbenchError
from fedbench.models import build_model
from fedbench.provenance import provenance

log = logging.getLogger("fedbench")

# A client test set smaller than this gives accuracies in steps of more than 10 points: the
# split is warned about (clients=10000 with pat-2 on FMNIST leaves each client one sample).
MIN_TEST_SAMPLES = 10


@dataclass
class Built:
    """What a run trains with (`fedbench.runner.Run` exposes each under the same name)."""

    device: torch.device
    provenance: dict  # the data digest, versions, device (summary.json, the checkpoint)
    partition: Partition
    eval_sets: dict[str, list[list[int]]]  # every client's S and G indices (partition.json)
    fed: Federation
    labels_pool: np.ndarray  # the labels of [train; test] (the partition's class counts)
    num_classes: int
    model_fn: Callable[[], nn.Module]  # a fresh model of the run's architecture
    engine: Engine
    attack: Attack | None  # malicious clients (fedbench/attack.py), None without
    algo: Algorithm
    per_round: int  # clients sampled per round
    sampler: np.random.Generator  # the client sampler's stream (checkpointed)


def build(rc: RunConfig, out: Path, saved: Saved | None = None) -> Built:
    """The run's parts from its checked config. `saved`: the checkpoint a resume continues
    (`fedbench.checkpoint.check_resume`), whose data digest the loaded data must match.
    `out`: the run directory, where a per-client row store past `engine.host_rows_gib`
    maps its file (only once a round writes one)."""
    algo_cls = ALGORITHMS.get(rc.algo.name)
    device = resolve_device(rc.device)
    seed = rc.seed
    d = rc.data
    root = str(Path(d.root).expanduser()) if d.root else None
    data = load_dataset(d.name, root, download=d.download, **d.source_keys())
    digest = data.digest()
    check_data(saved, digest)  # a resume trains on its run's data (still nothing written)
    prov = provenance(digest, str(device))
    part = make_partition(
        data.y_train.numpy(),
        data.y_test.numpy(),
        rc.clients,
        seed,
        rc.split.name,
        rc.option_keys("split"),
    )
    _warn_small_tests(part.test)
    s_idx, g_idx = eval_sets(part, seed, rc.eval.s_frac)
    fed = Federation(
        data,
        part,
        device,
        s_idx=s_idx,
        g_idx=g_idx,
        augment=d.augment,
        normalize=d.normalize,
    )
    labels_pool = np.concatenate([data.y_train.numpy(), data.y_test.numpy()])
    model_fn = partial(
        build_model, rc.model.name, data.input_shape, data.num_classes, **rc.option_keys("model")
    )
    torch.manual_seed(seed)
    model = model_fn()
    e = rc.engine
    engine = Engine(
        fed,
        model,
        device=device,
        seed=seed,
        backend=e.backend,
        drop_last=e.drop_last,
        eval_batch_size=rc.eval.batch_size,
        chunk_clients=e.chunk_clients,
        memory_budget=e.memory_budget,
        # per-client rows off the device; a store past host_rows_gib: a mapped file here
        rows=RowsPolicy(int(e.host_rows_gib * GIB), out / "rows"),
    )
    # malicious clients (fedbench/attack.py): they act in Algorithm.receive only
    attack = Attack.from_config(rc)  # seeds its own generators, not torch's
    ctx = RunContext(fed, engine, model_fn, RunSettings.from_config(rc), attack)
    algo = algo_cls(ctx, rc.algo.params)
    return Built(
        device=device,
        provenance=prov,
        partition=part,
        eval_sets={"S": [i.tolist() for i in s_idx], "G": [i.tolist() for i in g_idx]},
        fed=fed,
        labels_pool=labels_pool,
        num_classes=data.num_classes,
        model_fn=model_fn,
        engine=engine,
        attack=attack,
        algo=algo,
        per_round=clients_per_round(rc),
        sampler=np.random.default_rng([seed, 7]),
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise FedbenchError(
                f"device={name} but no CUDA GPU is visible (torch.cuda.is_available() is "
                "False); use device=auto or device=cpu"
            )
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"device={name!r}; valid: auto, cpu, cuda, cuda:N")


def _warn_small_tests(test_idx: list) -> None:
    sizes = np.array([len(t) for t in test_idx])
    few = int((sizes < MIN_TEST_SAMPLES).sum())
    if few:
        log.warning(
            "split: %d of %d clients have fewer than %d test samples (smallest: %d), so their "
            "accuracies move in steps of %.0f points or more; use fewer clients or more data "
            "per client",
            few,
            sizes.size,
            MIN_TEST_SAMPLES,
            sizes.min(),
            100 / max(1, MIN_TEST_SAMPLES - 1),
        )
