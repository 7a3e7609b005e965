"""A model's state as one flat vector: parameters first, then floating-point buffers.

Algorithms keep every model (global, personal, auxiliary) as a row of a [N, D] tensor; the
engine turns a row back into named views for `torch.func.functional_call`. Views are free, so
the same module instance serves every client, and averaging, distances and proximal terms are
plain tensor arithmetic on rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Entry:
    name: str
    shape: torch.Size
    start: int
    stop: int


class ModelSpec:
    """Layout of a model's flat state: `n_params` trainable entries, then float buffers."""

    def __init__(self, model: nn.Module) -> None:
        self.params: list[Entry] = []
        self.buffers: list[Entry] = []
        offset = 0
        for name, p in model.named_parameters():
            self.params.append(Entry(name, p.shape, offset, offset + p.numel()))
            offset += p.numel()
        self.n_params = offset
        for name, b in model.named_buffers():
            if b.is_floating_point():  # running stats travel with the model; counters do not
                self.buffers.append(Entry(name, b.shape, offset, offset + b.numel()))
                offset += b.numel()
        self.n_state = offset
        self._sizes = [e.stop - e.start for e in self.params + self.buffers]
        self._names = [e.name for e in self.params + self.buffers]
        self._shapes = [e.shape for e in self.params + self.buffers]
        self.index = {e.name: e for e in self.params + self.buffers}

    @property
    def has_buffers(self) -> bool:
        return self.n_state > self.n_params

    def flatten(self, model: nn.Module) -> torch.Tensor:
        tensors = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        return torch.cat([tensors[n].detach().reshape(-1).float() for n in self._names])

    def views(self, w: torch.Tensor, buffers: torch.Tensor | None = None) -> dict:
        """Named views of a parameter vector w [P] and, if given, a buffer vector [D - P]."""
        out = self.param_views(w)
        if buffers is not None and self.has_buffers:
            out.update(self.buffer_views(buffers))
        return out

    def param_views(self, w: torch.Tensor) -> dict:
        chunks = torch.split(w, self._sizes[: len(self.params)], dim=-1)
        return {n: c.view(s) for n, c, s in zip(self._names, chunks, self._shapes)}

    def buffer_views(self, b: torch.Tensor) -> dict:
        k = len(self.params)
        chunks = torch.split(b, self._sizes[k:], dim=-1)
        return {n: c.view(s) for n, c, s in zip(self._names[k:], chunks, self._shapes[k:])}

    def load_into(self, model: nn.Module, state: torch.Tensor) -> nn.Module:
        """Copy a flat state into a module (for users who want an `nn.Module`)."""
        tensors = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        with torch.no_grad():
            for e in self.params + self.buffers:
                tensors[e.name].copy_(state[e.start : e.stop].view(e.shape))
        return model

    def mask(self, names: list[str] | set[str], *, device=None) -> torch.Tensor:
        """Boolean mask over the parameter part [P] that is True on the named parameters."""
        wanted = set(names)
        unknown = wanted - {e.name for e in self.params}
        if unknown:
            raise KeyError(f"not parameters of the model: {sorted(unknown)}")
        m = torch.zeros(self.n_params, dtype=torch.bool, device=device)
        for e in self.params:
            if e.name in wanted:
                m[e.start : e.stop] = True
        return m

    def frozen(self, mask: torch.Tensor | None) -> frozenset[str]:
        """The parameters a [P] 0/1 `mask` freezes whole (every entry 0): their gradient is
        never read (the step leaves them as they are), so a training step need not compute
        it, nor backpropagate through them where nothing upstream trains. Empty without a
        mask, or where the mask freezes every parameter (a step then has nothing to do); empty
        for a per-client [C, P] mask too (each client's own entries train)."""
        if mask is None or mask.dim() != 1:
            return frozenset()
        trains = torch.stack([mask[e.start : e.stop].amax() for e in self.params]).tolist()
        if not any(trains):
            return frozenset()
        return frozenset(e.name for e, on in zip(self.params, trains) if not on)

    def range_of(self, ranges: tuple[tuple[int, int], ...]) -> list[int | None] | None:
        """For each parameter, the index of the trained range (`optim.Ranges`) that holds it
        whole, or None where no range touches it (frozen whole); None in all when a range
        cuts through a parameter (a gradient per range would then split a tensor)."""
        where: list[int | None] = []
        for e in self.params:
            j = next((j for j, (a, b) in enumerate(ranges) if a < e.stop and e.start < b), None)
            if j is not None and not (ranges[j][0] <= e.start and e.stop <= ranges[j][1]):
                return None
            where.append(j)
        return where

    def segment_ids(self, groups: list[list[str]], *, device=None) -> torch.Tensor:
        """Index [P] mapping each parameter entry to its group (e.g. the model's layers)."""
        ids = torch.full((self.n_params,), -1, dtype=torch.long, device=device)
        for g, names in enumerate(groups):
            for n in names:
                e = self.index[n]
                ids[e.start : e.stop] = g
        if (ids < 0).any():
            raise ValueError("groups do not cover every parameter")
        return ids
