"""Extra loss terms added to a client's cross-entropy: the one place papers differ.

A term holds tensors that are either shared ([D]) or per client, stacked in the order of
the `clients` passed to `Engine.train` ([C, D]). `value(w, *tensors)` gets one client's
parameter vector w ([P]) and that client's rows; it must be written with torch ops only so
that autograd (and vmap) can go through it. References may be full states [D]; only their
parameter part w.shape[-1] is used.

A term whose gradient is known in closed form also gives `value_and_grad(w, *tensors)`,
batched over w's leading client axis ([k, P], rows [k, D] or shared [D]). The engines then
take the model's gradient without the term and add the term's in one vector operation: the
autograd route costs a forward and a backward elementwise over all [k, P] parameters per
step, more than the batched matmuls of an MLP's step on a CPU (docs/performance.md). Both
routes give the same bits (`closed_form`'s order; tests/test_terms.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Scratch = Callable[[int], torch.Tensor]  # slot j -> a buffer shaped like w, reused


def _fresh(w: torch.Tensor) -> Scratch:
    return lambda j: torch.empty_like(w)


class Workspace:
    """Buffers the closed-form terms write into, kept across a train call's steps: on a CPU a
    fresh [k, P] tensor costs its page faults on every step (a multiply into a new 13 MB
    tensor took 4x the multiply into a kept one), and a step makes several. `scratch(w, key)`
    hands out, per slot, a view shaped like w (k shrinks as clients finish: a prefix)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def scratch(self, w: torch.Tensor, key: tuple = ()) -> Scratch:
        def get(j: int) -> torch.Tensor:
            buf = self._bufs.get((*key, j))
            if (
                buf is None
                or buf.numel() < w.numel()
                or buf.dtype != w.dtype
                or buf.device != w.device
            ):
                buf = self._bufs[(*key, j)] = torch.empty(w.numel(), dtype=w.dtype, device=w.device)
            return buf[: w.numel()].view(w.shape)

        return get


class Term:
    per_client: tuple[bool, ...] = ()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def value(self, w: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def value_and_grad(
        self, w: torch.Tensor, *tensors: torch.Tensor, scratch: Scratch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(value [...], gradient [..., P]) at w [..., P], in closed form; a term without one
        leaves this out and goes through autograd (`has_closed_form`). `scratch(j)` gives
        buffers shaped like w to compute in (the gradient may be one of them: the caller
        reads it before the next call; None: fresh tensors)."""
        raise NotImplementedError

    @classmethod
    def has_closed_form(cls) -> bool:
        return cls.value_and_grad is not Term.value_and_grad

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

    def value_and_grad(self, w: torch.Tensor, ref: torch.Tensor, scratch: Scratch | None = None):
        scratch = scratch or _fresh(w)
        d = torch.sub(w, ref[..., : w.shape[-1]], out=scratch(0))
        value = 0.5 * self.mu * torch.mul(d, d, out=scratch(1)).sum(-1)
        # autograd's mu/2 d + mu/2 d: mu d to the bit (halving and doubling are exact)
        return value, d.mul_(self.mu)


class Linear(Term):
    """<v, w> (FedDyn's and FedSLR's linear term, SCAFFOLD-style corrections)."""

    def __init__(self, v: torch.Tensor, per_client: bool | None = None) -> None:
        self.v = v.detach()
        self.per_client = (v.dim() == 2 if per_client is None else per_client,)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.v,)

    def value(self, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (w * v[..., : w.shape[-1]]).sum()

    def value_and_grad(self, w: torch.Tensor, v: torch.Tensor, scratch: Scratch | None = None):
        scratch = scratch or _fresh(w)
        v = v[..., : w.shape[-1]]
        value = torch.mul(w, v, out=scratch(0)).sum(-1)
        return value, v.expand_as(w)  # a view: read, never written


def closed_form(terms: Sequence[Term]) -> bool:
    """Every term has its gradient in closed form (`Term.value_and_grad`)."""
    return all(t.has_closed_form() for t in terms)


def values_and_grad(
    w: torch.Tensor,
    terms: Sequence[Term],
    rows: Sequence[Sequence[torch.Tensor]],
    workspace: Workspace | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The terms' values at w [..., P] (one per term, for the caller to add in its order) and
    the sum of their gradients in closed form, summed as autograd accumulates the gradient of
    sum(values) into w: the last term's first (later nodes run first in its backward). The
    caller adds the sum to the model's gradient, which autograd too adds last. The sum may be
    a buffer of `workspace` (or a term's own tensor, with one term): read it, then let go."""
    ws = workspace or Workspace()
    values, grads = [], []
    for i, (t, r) in enumerate(zip(terms, rows)):
        v, g = t.value_and_grad(w, *r, scratch=ws.scratch(w, ("term", i)))
        values.append(v)
        grads.append(g)
    total = grads[-1]
    if len(grads) > 1:  # (g_n + g_{n-1}) + ... into a buffer of its own
        total = torch.add(grads[-1], grads[-2], out=ws.scratch(w, ("sum",))(0))
        for g in reversed(grads[:-2]):
            total.add_(g)
    return values, total


def dynamic(lam: torch.Tensor, ref: torch.Tensor, alpha: float) -> list[Term]:
    """-<lam_i, w> + (alpha / 2) ||w - ref||^2: the local problem of FedDyn (Acar et al.
    2021, Algorithm 1) and of FedSLR's Phase I (its -<lam_i, w - ref> differs by a constant).
    `lam` is per client ([C, P]) or shared; `ref` the model the server sent."""
    return [Linear(-lam), Proximal(ref, alpha)]


def correction(c_client: torch.Tensor, c_server: torch.Tensor) -> Term:
    """<c - c_i, w>: SCAFFOLD's control-variate correction (Karimireddy et al. 2020, eq. 3),
    whose gradient c - c_i is added to every local gradient."""
    return Linear(c_server - c_client)
