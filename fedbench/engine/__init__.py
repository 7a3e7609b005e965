"""Local training of many clients through one API (see docs/design.md, "The engine").

One engine interface, two equal backends:

- `core.py`       `Engine`: the front the algorithms call (`train`, `full_grads`,
                  `client_steps`, `batches`, evaluation, hand-written steps); builds a
                  plan, picks a backend (`Engine.backend_for`), owns the pieces below and
                  the checkpointed state.
- `plan.py`       `TrainPlan` / `GradPlan` (what a call asks for), `TrainResult` /
                  `GradResult`, `SAM`, `StepPlan` / `StepsResult` / `ClientStep` (the
                  client-step vocabulary), and `Backend`: `train`, `full_grads` and
                  `client_steps`, the interface both backends implement.
- `sequential.py` `SequentialBackend`: client after client on one module (`flat.py`).
- `vmap.py`       `VmapBackend`: all clients of a call in one batched computation per step.
- `flat.py`       `FlatModule`: the module whose parameters, grads and buffers are views of
                  flat vectors (sequential training, evaluation, hand-written steps).
- `schedule.py`   `Schedule`: a client's batches, from (seed, round, client, salt) only.
- `store.py`      `OptimStates`: optimizer state kept across rounds, per slot and client.
- `optimized.py`  `Optimized`: rows a step function moves with an optimizer (`batch.step`),
                  their optimizer state loaded, carried and kept by the engine.
- `rows.py`       `ClientRows`: one row per client off the device (host memory or a
                  memory-mapped file), a round's rows moved; incremental checkpoint shards.
- `memory.py`     `MemoryModel`: bytes per client and chunk sizes of the vmap backend.
- `optim.py`, `terms.py`, `spec.py`: fused optimizers, loss terms, the flat state layout;
  `lwsam.py` (PLGU's layer-wise SAM), `prox.py` (FedSLR's proximal operators).

Modules import downwards only (tests/test_engine_imports.py): the backends get what they
need when the engine builds them and import neither the engine nor each other.
"""

from fedbench.engine.core import Engine
from fedbench.engine.optim import OptimConfig
from fedbench.engine.optimized import Optimized
from fedbench.engine.plan import (
    SAM,
    ClientStep,
    GradResult,
    StepBatch,
    StepsResult,
    TrainPlan,
    TrainResult,
    client_row,
    sequential_objective,
)
from fedbench.engine.rows import ClientRows, RowsPolicy
from fedbench.engine.server import fit_on_server
from fedbench.engine.spec import ModelSpec
from fedbench.engine.terms import Linear, Proximal, Term

__all__ = [
    "SAM",
    "ClientRows",
    "ClientStep",
    "Engine",
    "GradResult",
    "Linear",
    "ModelSpec",
    "OptimConfig",
    "Optimized",
    "Proximal",
    "RowsPolicy",
    "StepBatch",
    "StepsResult",
    "Term",
    "TrainPlan",
    "TrainResult",
    "client_row",
    "fit_on_server",
    "sequential_objective",
]
