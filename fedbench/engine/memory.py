"""The memory model of batched (vmap) computations: how many clients go through together.

One place for the estimate, used by vmap training and by vmap full gradients alike:

    bytes per client = rows * P * 4 + batch * (data + ACT_FACTOR * act)

- `rows`: parameter-sized float32 rows alive per client. A vmapped gradient holds
  `GRAD_ROWS` (W, its gradient and the per-view gradients it is concatenated from, the
  call's input and output rows); a training step adds `STEP_ROWS` (the optimizer's
  temporaries), one row per optimizer-state tensor (momentum; Adam's two moments) and, with
  SAM, two (eps and W + eps).
- `data`, `act`: bytes of one sample's input and of what autograd saves for it, measured
  once per model (`probe`), so functional ops inside a module's forward count as much as
  modules do.

The constants are set so that the estimate covers the peaks scripts/bench_engine.py measures
(an estimate, not a bound). Clients then go through in chunks of `chunk_size`: a chunk's size
moves peak memory and nothing else.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedbench.engine.optim import OptimConfig
from fedbench.engine.spec import ModelSpec
from fedbench.models.dropout import dropout_key

GRAD_ROWS = 6  # parameter rows of one client's vmapped gradient (see above)
STEP_ROWS = 2  # a training step's optimizer temporaries on top of the gradient's rows
# Saved activations, then their gradients and the backward's temporaries next to them.
ACT_FACTOR = 3


class MemoryModel:
    """Bytes per client of a vmapped step or gradient pass, and the chunk sizes they allow.

    `chunk_clients` fixes the chunk size; otherwise the chunk fills `memory_budget` GiB, or
    half of the device's free memory when that is None.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        fed,
        device: torch.device,
        *,
        chunk_clients: int | None = None,
        memory_budget: float | None = None,
    ) -> None:
        self.model = model
        self.spec = spec
        self.fed = fed
        self.device = device
        self.chunk_clients = chunk_clients
        self.memory_budget = memory_budget
        self._per_sample: tuple[int, int] | None = None  # see `per_sample`

    # ------------------------------------------------------------------ measurements
    def probe(self) -> tuple[int, int]:
        """Bytes of one sample's input and of what autograd saves for it in a step.

        Measured on two and on four samples of the pool with saved-tensor hooks (BatchNorm
        trains on more than one), on copies of the buffers (the module's stay as they are).
        """
        x, y = self.fed.batch(torch.zeros(4, dtype=torch.long, device=self.device), train=False)
        w = self.spec.flatten(self.model)[: self.spec.n_params].clone().requires_grad_(True)
        tensors = {n: b.clone() for n, b in self.model.named_buffers()}
        tensors.update(self.spec.param_views(w))
        key = torch.zeros((), dtype=torch.long, device=self.device)

        def saved(n: int) -> int:
            seen: dict[tuple[int, int], int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
                return t

            # a training step's forward: keyed dropout (no draw from the global generator)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dropout_key(key):
                logits = functional_call(self.model, tensors, (x[:n],))
                F.cross_entropy(logits, y[:n])
            return sum(seen.values())

        return x[0].numel() * x.element_size(), (saved(4) - saved(2)) // 2

    def per_sample(self) -> tuple[int, int]:
        """`probe`'s (data, act), measured on first use."""
        if self._per_sample is None:
            self._per_sample = self.probe()
        return self._per_sample

    # ------------------------------------------------------------------ estimates
    def client_bytes(self, rows: int, batch: int) -> int:
        """Estimated peak bytes one client adds: `rows` parameter rows, `batch` samples."""
        data, act = self.per_sample()
        return rows * self.spec.n_params * 4 + batch * (data + ACT_FACTOR * act)

    def train_bytes(self, optim: OptimConfig, batch: int, sam: bool) -> int:
        """Per client in a vmapped training step on batches of `batch` samples."""
        n_state = {"sgd": 1 if optim.momentum else 0, "adam": 2}[optim.name]
        rows = GRAD_ROWS + STEP_ROWS + n_state + (2 if sam else 0)  # SAM: eps and W + eps
        return self.client_bytes(rows, batch)

    def grad_bytes(self, block: int) -> int:
        """Per client in a vmapped full-gradient pass over blocks of `block` samples."""
        return self.client_bytes(GRAD_ROWS, block)

    def chunk_size(self, n_clients: int, per_client: int) -> int:
        """`chunk_clients` if set; else as many clients as fit the memory budget.

        Budget: `memory_budget` GiB if set, else `default_budget(device)`: a function of the
        device alone, not of the memory free at the moment, because the chunking decides the
        bits (a batched matmul sums in another order): a resumed run, or the same run on a
        busier machine, must chunk as the first did. The clients are then split into equal
        chunks (40 with room for 30 -> 2 x 20).
        """
        if self.chunk_clients is not None:
            k = self.chunk_clients
        else:
            budget = (
                self.memory_budget * 2**30 if self.memory_budget else default_budget(self.device)
            )
            k = max(1, int(budget // max(per_client, 1)))
        n_clients = max(n_clients, 1)
        n_chunks = -(-n_clients // min(k, n_clients))
        return -(-n_clients // n_chunks)


# CPU: a fixed 4 GiB (RAM that is free now varies from call to call and machine to machine).
CPU_BUDGET = 4 * 2**30


def default_budget(device: torch.device) -> float:
    """The chunk budget without `engine.memory_budget`: half of a GPU's total memory (the
    device's, the same every call), or CPU_BUDGET."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2
    return float(CPU_BUDGET)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can get on `device`, in bytes."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
