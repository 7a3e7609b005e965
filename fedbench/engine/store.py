"""The optimizer state kept across rounds (`optim.persist_state`): one store per engine.

Rows of momentum / Adam moments per (slot, client), read before a client's local steps and
written back after them, by both backends (`Engine.train`, `slot=`) and by
`Engine.client_steps` for the rows a step function declares optimized (`optimized.py`, e.g.
Ditto's "personal" and "main", APPLE's "core"). A slot names one model a client trains (a
client training two models in a round keeps two states). Without `persist_state` every call starts
from a fresh (zero) state and nothing is kept. Checkpointed through `Engine.state_dict`.
The rows live off the device (`ClientRows`, `engine.rows`): a round moves its clients' rows.
"""

from __future__ import annotations

import torch

from fedbench.engine.optim import OptimConfig, init_state
from fedbench.engine.rows import ClientRows, RowsPolicy, SavedRows


class OptimStates:
    """Kept optimizer state: `slots[slot][name]` holds [N, ...] rows, one per client."""

    def __init__(
        self, n_clients: int, device: torch.device | str = "cpu", policy: RowsPolicy | None = None
    ) -> None:
        self.n_clients = n_clients
        self.device = torch.device(device)
        self.policy = policy
        self.slots: dict[str, dict[str, ClientRows]] = {}

    def _rows(self, slot: str, k: str, default: torch.Tensor) -> ClientRows:
        n, name = self.n_clients, f"optim.{slot}.{k}"
        return ClientRows(n, default, device=self.device, name=name, policy=self.policy)

    def get(
        self, cfg: OptimConfig, slot: str, clients: int | torch.Tensor, w: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The state to step `w` with: `w` is [P] for one client (`clients` an int) or [C, P]
        for an index tensor of clients. Fresh unless `cfg.persist_state`, else a copy of the
        kept rows (zeros for a client's first visit); give it back with `keep`."""
        fresh = init_state(cfg, w)
        if not cfg.persist_state:
            return fresh
        store = self.slots.setdefault(slot, {})
        for k, v in fresh.items():
            if k not in store:
                store[k] = self._rows(slot, k, torch.zeros(v.shape[-1:], dtype=v.dtype))
        return {k: store[k][clients].to(w.device) for k in fresh}

    def keep(
        self,
        cfg: OptimConfig,
        slot: str,
        clients: int | torch.Tensor,
        state: dict[str, torch.Tensor],
    ) -> None:
        """Store the state a client (or clients) ended its steps with (`cfg.persist_state`)."""
        if cfg.persist_state:
            for k, v in state.items():
                self.slots[slot][k][clients] = v

    def state_dict(self) -> dict:
        return {"persist": self.slots}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Rows of a checkpoint: `SavedRows` (sharded), or [N, ...] tensors (older ones)."""
        self.device = torch.device(device)
        self.slots = {}
        for slot, d in state["persist"].items():
            for k, v in d.items():
                if isinstance(v, SavedRows):
                    default = v.manifest["default"]
                elif isinstance(v, ClientRows):
                    default = v.default
                else:
                    default = torch.zeros(v.shape[1:], dtype=v.dtype)
                rows = self._rows(slot, k, default)
                rows.load(v)
                self.slots.setdefault(slot, {})[k] = rows
