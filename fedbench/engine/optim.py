"""Optimizers on flat tensors: one fused update per step instead of a loop over tensors.

The update functions broadcast, so the same code steps one client ([P]) or a stack of
clients ([C, P]). Semantics follow `torch.optim.SGD` (momentum buffer starts at the first
gradient, coupled weight decay) and `torch.optim.Adam` (bias-corrected, coupled L2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimConfig:
    """The local optimizer's settings; a run's come from its checked `optim` keys
    (fedbench/config.py, the one place they are validated)."""

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_decay: float = 1.0  # multiplicative per round: lr_t = lr * lr_decay**t
    persist_state: bool = False  # keep momentum/Adam moments across rounds (per client)

    def lr_at(self, t: int) -> float:
        return self.lr * self.lr_decay**t

    def replace(self, **kw) -> OptimConfig:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update({k: v for k, v in kw.items() if v is not None})
        return OptimConfig(**d)


def init_state(cfg: OptimConfig, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero state shaped like `w` ([P] or [C, P]); `step` counts per row."""
    lead = w.shape[:-1]
    if cfg.name == "sgd":
        if cfg.momentum == 0:
            return {}
        return {"buf": torch.zeros_like(w)}
    return {
        "m": torch.zeros_like(w),
        "v": torch.zeros_like(w),
        "step": torch.zeros(lead + (1,), dtype=w.dtype, device=w.device),
    }


MAX_RANGES = 8  # a mask with more trained ranges than this is stepped as a product


@dataclass(frozen=True)
class Ranges:
    """A [P] 0/1 mask as the few contiguous ranges of entries it trains (`trained_ranges`):
    an SGD step then reads and writes only those, where the mask's product would pass over
    all P entries (FedRep's head epochs train 2k of the MLP's 200k; APFL's fixed alpha is
    one entry out of 400k). `mask` is the tensor form (SAM's perturbation, Adam)."""

    mask: torch.Tensor
    ranges: tuple[tuple[int, int], ...]


def trained_ranges(mask: torch.Tensor | None) -> torch.Tensor | Ranges | None:
    """`mask` as `Ranges` when it trains at most MAX_RANGES contiguous ranges (one host read:
    call it once per train call, not per step), else the mask itself (always for a
    per-client [C, P] mask: its rows are stepped as a product)."""
    if mask is None or mask.dim() != 1:
        return mask
    on = mask.detach().to("cpu", torch.int8).view(-1)
    edges = torch.diff(on, prepend=on.new_zeros(1), append=on.new_zeros(1)).nonzero()[:, 0]
    if len(edges) > 2 * MAX_RANGES:
        return mask
    bounds = edges.tolist()
    return Ranges(mask, tuple(zip(bounds[::2], bounds[1::2])))


def step_(
    cfg: OptimConfig,
    w: torch.Tensor,
    g: torch.Tensor | tuple[torch.Tensor, ...],
    state: dict[str, torch.Tensor],
    lr: float | torch.Tensor,
    active: torch.Tensor | None = None,
    mask: torch.Tensor | Ranges | None = None,
    *,
    consume_grad: bool = False,
) -> None:
    """In-place update of `w` with gradient `g`.

    `mask` ([P] of 0/1) freezes entries: a frozen entry and its optimizer state (momentum,
    Adam moments) stay exactly as they are, as `torch.optim` skips a parameter without a
    gradient, so momentum kept from a phase that trained it (`optim.persist_state`) never
    moves it. (Adam's step count is one per row: a frozen entry's bias correction, when it
    trains again, counts the steps it sat out.)

    `active` ([C, 1] of 0/1, for stacked clients) freezes rows whose client has no step left:
    their parameters and optimizer state stay exactly as they are.

    In place: `w` and the state are updated where they are, and the step's intermediate
    vectors are written into as few fresh tensors as its arithmetic needs (none for SGD with
    or without momentum and a number as lr; Adam's direction takes two), each operation the
    one the out-of-place form ran, in the same order (the same bits). `consume_grad`: `g`
    is the caller's to overwrite (a fresh gradient it reads no more): it holds the
    temporaries (weight decay, Nesterov, a tensor lr, Adam's denominator) instead.

    A mask given as `Ranges` steps SGD on its trained ranges only (views of w, g and the
    state): the same bits on every trained entry, and a frozen entry is not touched at all
    (the product form adds lr * 0 to it). Adam counts its steps per row, once per call, so
    it takes the product form. With `Ranges`, `g` may also be the gradient of the trained
    ranges alone, one tensor per range (what a backward over those ranges gives: no [P]
    gradient of zeros is assembled).
    """
    if isinstance(g, tuple) and not (isinstance(mask, Ranges) and cfg.name == "sgd"):
        raise ValueError("a gradient per trained range needs an SGD step on `Ranges`")
    if isinstance(mask, Ranges):
        if cfg.name != "sgd":
            mask = mask.mask
        else:
            P = w.shape[-1]
            for j, (a, b) in enumerate(mask.ranges):
                part = (..., slice(a, b))
                lr_part = lr[part] if isinstance(lr, torch.Tensor) and lr.shape[-1:] == (P,) else lr
                step_(
                    cfg, w[part], g[j] if isinstance(g, tuple) else g[part],
                    {k: v[part] for k, v in state.items()}, lr_part, active,
                    consume_grad=consume_grad,
                )  # fmt: skip
            return
    keep = active
    if mask is not None:
        keep = mask if keep is None else keep * mask
    # a tensor shaped like w the step may overwrite: g if given up, else its first temporary
    own = g if consume_grad and g.shape == w.shape else None
    if cfg.weight_decay:
        g = _add(g, w, cfg.weight_decay, own)
        own = g if g.shape == w.shape else None
    if cfg.name == "sgd":
        if cfg.momentum:
            buf = state["buf"]
            if keep is None:
                buf.mul_(cfg.momentum).add_(g)
            else:
                new_buf = buf.mul(cfg.momentum).add_(g)
                buf.copy_(torch.where(keep.bool(), new_buf, buf))
            if cfg.nesterov:
                d = _add(g, buf, cfg.momentum, own)
                own = d if d.shape == w.shape else None
            else:
                d = buf
        else:
            d = g
        if keep is not None:
            d = d.mul_(keep) if d is own else d * keep
            own = d if d.shape == w.shape else None
        _descend(w, d, lr, own)
        return
    b1, b2 = cfg.betas
    m, v, step = state["m"], state["v"], state["step"]
    if keep is None:
        step.add_(1)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
    else:
        a = keep.bool()
        step.add_(1 if active is None else active)
        m.copy_(torch.where(a, m * b1 + g * (1 - b1), m))
        v.copy_(torch.where(a, v * b2 + g * g * (1 - b2), v))
    s = step.clamp(min=1)
    bc1 = 1 - b1**s
    bc2 = 1 - b2**s
    # d = (m / bc1) / ((v / bc2).sqrt() + eps), in two tensors (g, no more read, is one if own)
    den = torch.div(v, bc2) if own is None else torch.div(v, bc2, out=own)
    den.sqrt_().add_(cfg.eps)
    d = torch.div(m, bc1).div_(den)
    if keep is not None:
        d.mul_(keep)
    _descend(w, d, lr, d)


def _add(t: torch.Tensor, x: torch.Tensor, alpha: float, own: torch.Tensor | None) -> torch.Tensor:
    """t + alpha x: written into t when t is `own` (the step's to overwrite), else fresh."""
    return t.add_(x, alpha=alpha) if t is own else t.add(x, alpha=alpha)


def _descend(
    w: torch.Tensor, d: torch.Tensor, lr: float | torch.Tensor, own: torch.Tensor | None
) -> None:
    """w -= lr * d; one pass and no temporary when lr is a number (as torch.optim), d * lr
    written into `own` (a tensor of the step's that it may overwrite, d itself included)
    when lr is a tensor."""
    if not isinstance(lr, torch.Tensor):
        w.add_(d, alpha=-lr)
    elif own is not None and torch.broadcast_shapes(d.shape, lr.shape) == own.shape:
        w.sub_(torch.mul(d, lr, out=own))
    else:
        w.sub_(d * lr)
