"""Dropout whose masks come from a key, not from torch's global generator.

`nn.Dropout` draws its masks from torch's global generator in the order forwards run, so a
batched (vmap) forward over C clients draws other masks than C forwards one after another,
and a resumed run others than an uninterrupted one. `KeyedDropout` derives its mask from a
key instead: the engine enters `dropout_key(key)` around each training forward, with the
key of the client's batch (`Schedule.keys`: a function of (seed, round, client, salt) and
the batch's position in the schedule, as augmentation's draws are), and the l-th dropout
call inside that block keeps element i where the 16-bit half (i mod 2) of

    mix32((i // 2) ^ k_l),   k_l = mix32(key ^ mix32(l))

is at least p * 2^16, i being the element's position in the input's row-major layout (batch
dimension first, so padding samples appended to a batch leave the real samples' masks
unchanged). `mix32` is a 32-bit integer hash (Wellons' lowbias32) written with int64
tensor ops that never overflow, so the mask is a deterministic function of (key, l, i):
one client's forward and the same client inside a vmapped forward (where `key` is a mapped
0-d tensor) keep the same elements, on any device. One hash serves two elements (the
hashing is most of the cost: about 2x torch's own dropout on a CPU), and p is honoured to
within 2^-16.

Which key, where:
- `Engine.train` and `Engine.client_steps` (both backends): the key of (seed, round, client,
  salt, batch). Each loss evaluation opens its own block, so SAM's second gradient (and a
  step function's second `batch.grad` on the same batch) sees the masks of the first.
- `Engine.full_grads`: keys of (seed, client, block) with round 0 and its own salt: the same
  masks at every call, so FedPG's line search compares losses of one fixed function.
- Evaluation (`model.eval()`): no dropout.
- Any other training-mode forward (an algorithm's own: FedALA's weight learning, FedSPA's
  pruning gradient through `Engine.grad_at`) runs outside a keyed block and drops as
  `nn.Dropout` does, from torch's global generator (seeded with the run's seed). Such a
  forward cannot be vmapped: vmap refuses random ops, loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads layer numbers over 32 bits


def _mul32(h, c: int):
    """(h * c) mod 2^32 for h in [0, 2^32) (an int or an int64 tensor), never overflowing
    int64 (signed overflow has no defined result): one product under 2^63 when c < 2^31,
    else two under 2^48."""
    if c < 2**31:
        return (h * c) & M32
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & M32


def mix32(h):
    """lowbias32 (Wellons, hash-prospector): a 32-bit integer hash with full avalanche, of
    an int or an int64 tensor holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def batch_keys(k0: int, k1: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The keys [n] (int64 in [0, 2^32)) of batches 0..n-1 of a stream keyed (k0, k1), two
    32-bit words (`Schedule.keys`)."""
    s = torch.arange(n, dtype=torch.long, device=device)
    return mix32(mix32(s ^ (k0 & M32)) ^ (k1 & M32))


def keep_mask(key: torch.Tensor, layer: int, shape: torch.Size, p: float) -> torch.Tensor:
    """Which elements of a tensor of `shape` the `layer`-th dropout call keyed `key` (0-d
    int64) keeps: bool, each element kept with probability 1 - p (to within 2^-16)."""
    k = mix32(key ^ mix32((_GOLDEN * (layer + 1)) & M32))
    n = 1
    for d in shape:
        n *= int(d)
    pairs = torch.arange((n + 1) // 2, dtype=torch.long, device=key.device) & M32
    h = mix32(pairs ^ k)
    half = torch.stack([h & 0xFFFF, h >> 16], dim=-1).flatten(-2)  # element 2j, 2j + 1
    return (half[..., :n] >= round(p * 2**16)).reshape(shape)


class _Stream:
    """The key of one keyed block and the dropout calls made in it so far."""

    def __init__(self, key: torch.Tensor) -> None:
        self.key = key
        self.calls = 0

    def next(self) -> int:
        self.calls += 1
        return self.calls - 1


_STREAM: ContextVar[_Stream | None] = ContextVar("fedbench_dropout_stream", default=None)


@contextmanager
def dropout_key(key: torch.Tensor | None) -> Iterator[None]:
    """Within the block, `KeyedDropout` layers draw their masks from `key` (a 0-d int64
    tensor, mapped under vmap), the l-th call its l-th mask. None leaves the surrounding
    block as it is (outside any: the global generator, as `nn.Dropout`)."""
    if key is None:
        yield
        return
    token = _STREAM.set(_Stream(key))
    try:
        yield
    finally:
        _STREAM.reset(token)


class KeyedDropout(nn.Dropout):
    """`nn.Dropout` (an `nn.Dropout` for every isinstance check, same `p`, scaling by
    1 / (1 - p) in training, identity in evaluation) whose training masks inside a
    `dropout_key` block are a function of the block's key (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        stream = _STREAM.get()
        if stream is None:  # an algorithm's own forward: torch's global generator
            return F.dropout(x, self.p, True, self.inplace)
        keep = keep_mask(stream.key, stream.next(), x.shape, self.p)
        scale = 0.0 if self.p >= 1 else 1.0 / (1.0 - self.p)
        return x * (keep.to(x.dtype) * scale)


def has_keyed_dropout(model: nn.Module) -> bool:
    """Whether `model` holds a `KeyedDropout` (its training forwards want keys)."""
    return any(isinstance(m, KeyedDropout) for m in model.modules())
