"""Extra loss terms added to a client's cross-entropy: the one place papers differ.

A term holds tensors that are either shared ([D]) or per client, stacked in the order of
the `clients` passed to `Engine.train` ([C, D]). `value(w, *tensors)` gets one client's
parameter vector w ([P]) and that client's rows; it must be written with torch ops only so
that autograd (and vmap) can go through it. References may be full states [D]; only their
parameter part w.shape[-1] is used.
"""

from __future__ import annotations

import torch


class Term:
    per_client: tuple[bool, ...] = ()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def value(self, w: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, c: int) -> tuple[torch.Tensor, ...]:
        """Client c's tensors (position c in the train call's client list)."""
        return tuple(t[c] if pc else t for t, pc in zip(self.tensors(), self.per_client))


class Proximal(Term):
    """(mu / 2) ||w - ref||^2 (FedProx, Ditto, DiversiFed, FedAMP)."""

    def __init__(self, ref: torch.Tensor, mu: float, per_client: bool | None = None) -> None:
        self.ref = ref.detach()
        self.mu = float(mu)
        self.per_client = (ref.dim() == 2 if per_client is None else per_client,)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.ref,)

    def value(self, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        d = w - ref[..., : w.shape[-1]]
        return 0.5 * self.mu * (d * d).sum()


class Linear(Term):
    """<v, w> (FedDyn's and FedSLR's linear term, SCAFFOLD-style corrections)."""

    def __init__(self, v: torch.Tensor, per_client: bool | None = None) -> None:
        self.v = v.detach()
        self.per_client = (v.dim() == 2 if per_client is None else per_client,)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.v,)

    def value(self, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (w * v[..., : w.shape[-1]]).sum()


def dynamic(lam: torch.Tensor, ref: torch.Tensor, alpha: float) -> list[Term]:
    """-<lam_i, w> + (alpha / 2) ||w - ref||^2: the local problem of FedDyn (Acar et al.
    2021, Algorithm 1) and of FedSLR's Phase I (its -<lam_i, w - ref> differs by a constant).
    `lam` is per client ([C, P]) or shared; `ref` the model the server sent."""
    return [Linear(-lam), Proximal(ref, alpha)]


def correction(c_client: torch.Tensor, c_server: torch.Tensor) -> Term:
    """<c - c_i, w>: SCAFFOLD's control-variate correction (Karimireddy et al. 2020, eq. 3),
    whose gradient c - c_i is added to every local gradient."""
    return Linear(c_server - c_client)
