"""Proximal operators on a model's flat state: the per-layer nuclear-norm prox (singular
value thresholding) and soft-thresholding (docs/papers/fedslr.md; FedSLR, Huang et al. 2023).

Matrix view of a weight tensor (the authors' code, huangtiansheng/fedslr `SVD_st_update`):
a Linear weight (out, in) is used as it is; a Conv weight (out, in, kh, kw) is permuted to
(out, kh, in, kw) and reshaped to (out·kh, in·kw); `from_matrix` inverts both. Tensors
with fewer than 2 dimensions (biases, norm scales) are left alone.

prox_{tau ||.||_*}(W) = U diag(max(s - tau, 0)) V^T for W = U diag(s) V^T. The SVDs are
exact (`torch.linalg.svd`, thin) and batched: every matrix of one shape goes through one
call (ResNet-18 has 21 weight matrices in 12 shapes), float64 where asked; `svt_gram` gets
the same result from the eigendecomposition of the smaller Gram matrix in float64, several
times faster (scripts/bench_fedslr_prox.py).

Sizes: a rank-r matrix (m, n) is sent as two factors, r·(m + n) numbers, or dense when that
is cheaper: min(r·(m + n), m·n) (the authors' count).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from fedbench.engine.spec import ModelSpec


def to_matrix(t: torch.Tensor) -> torch.Tensor:
    """The 2-D view of a weight (Linear as is; Conv (o, i, kh, kw) -> (o·kh, i·kw))."""
    if t.dim() == 2:
        return t
    if t.dim() == 4:
        o, i, kh, kw = t.shape
        return t.permute(0, 2, 1, 3).reshape(o * kh, i * kw)
    raise ValueError(f"no matrix view for a tensor of shape {tuple(t.shape)}")


def from_matrix(m: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of `to_matrix` for a weight of `shape`."""
    if len(shape) == 2:
        return m.reshape(shape)
    o, i, kh, kw = shape
    return m.reshape(o, kh, i, kw).permute(0, 2, 1, 3).reshape(shape)


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    o, i, kh, kw = shape
    return int(o * kh), int(i * kw)


def soft_threshold(x: torch.Tensor, thr: float | torch.Tensor) -> torch.Tensor:
    """sign(x) · max(|x| - thr, 0): the prox of thr·||x||_1."""
    return torch.sign(x) * (x.abs() - thr).clamp_min(0)


def svt(w: torch.Tensor, tau: float, double: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular value thresholding of a matrix or a batch [..., m, n]: (prox, rank [...]).
    `tau` = 0 returns the input unchanged (and its numerical rank)."""
    a = w.double() if double else w
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    s2 = (s - tau).clamp_min(0)
    rank = (s2 > 0).sum(-1)
    if tau == 0:
        return w.clone(), rank
    out = (u * s2.unsqueeze(-2)) @ vh
    return out.to(w.dtype), rank


def svt_gram(w: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same prox from the eigendecomposition of the smaller Gram matrix, in float64:
    W^T W = V diag(s^2) V^T, prox = W V diag(max(1 - tau / s, 0)) V^T (equal to
    U diag(max(s - tau, 0)) V^T). `eigh` of an n x n matrix is several times faster than the
    SVD of the m x n one on CPUs and GPUs; float64 keeps the small singular values that
    the squaring would lose in float32. Batched like `svt`."""
    a = w.double()
    tall = a.shape[-2] >= a.shape[-1]
    if not tall:
        a = a.mT
    ev, v = torch.linalg.eigh(a.mT @ a)
    s = ev.clamp_min(0).sqrt()
    rank = (s > tau).sum(-1)
    scale = torch.where(s > tau, 1 - tau / s.clamp_min(1e-300), torch.zeros_like(s))
    out = (a @ (v * scale.unsqueeze(-2))) @ v.mT
    if not tall:
        out = out.mT
    return out.to(w.dtype), rank


SOLVERS = ("svd", "svd64", "gram")


def factorized_size(m: int, n: int, rank: int) -> int:
    """Numbers needed to send a rank-`rank` (m, n) matrix: factors or dense, the cheaper."""
    return min(rank * (m + n), m * n)


@dataclass
class LayerRank:
    name: str
    rows: int
    cols: int
    rank: int

    @property
    def full(self) -> int:
        return min(self.rows, self.cols)

    @property
    def size(self) -> int:
        return factorized_size(self.rows, self.cols, self.rank)


def matrix_entries(spec: ModelSpec) -> list:
    """The parameter entries that have a matrix view (2-D Linear, 4-D Conv weights)."""
    return [e for e in spec.params if len(e.shape) in (2, 4)]


def nuclear_prox(
    w: torch.Tensor, spec: ModelSpec, tau: float, solver: str = "svd"
) -> tuple[torch.Tensor, list[LayerRank]]:
    """Per-layer nuclear-norm prox of the parameter part of a flat state w ([P] or [D]):
    a new tensor (other entries copied) and each matrix layer's rank after it. `solver`:
    svd (thin SVD in the state's float32, the authors' code), svd64 (SVD in float64) or
    gram (`svt_gram`, float64)."""
    if solver not in SOLVERS:
        raise ValueError(f"prox solver {solver!r}; valid: {', '.join(SOLVERS)}")
    out = w.clone()
    by_shape: dict[tuple, list] = defaultdict(list)
    for e in matrix_entries(spec):
        by_shape[tuple(e.shape)].append(e)
    ranks: dict[str, LayerRank] = {}
    for shape, entries in by_shape.items():
        mats = torch.stack([to_matrix(w[e.start : e.stop].view(shape)) for e in entries])
        if solver == "gram" and tau > 0:
            new, rank = svt_gram(mats, tau)
        else:
            new, rank = svt(mats, tau, double=solver == "svd64")
        m, n = matrix_shape(shape)
        for k, e in enumerate(entries):
            out[e.start : e.stop] = from_matrix(new[k], shape).reshape(-1)
            ranks[e.name] = LayerRank(e.name, m, n, int(rank[k]))
    return out, [ranks[e.name] for e in matrix_entries(spec)]


def matrix_ranks(w: torch.Tensor, spec: ModelSpec, rtol: float = 1e-6) -> list[LayerRank]:
    """Each matrix layer's numerical rank (singular values above rtol · the largest)."""
    out = []
    for e in matrix_entries(spec):
        s = torch.linalg.svdvals(to_matrix(w[e.start : e.stop].view(e.shape)))
        r = int((s > rtol * s.max().clamp_min(1e-30)).sum()) if s.numel() else 0
        m, n = matrix_shape(e.shape)
        out.append(LayerRank(e.name, m, n, r))
    return out


def factorized_params(spec: ModelSpec, ranks: list[LayerRank]) -> int:
    """Parameters of a model whose matrix layers are sent factorized at these ranks (the
    rest dense): the sum over layers of min(rank·(m + n), m·n), numel for the others."""
    dense = spec.n_params - sum(r.rows * r.cols for r in ranks)
    return dense + sum(r.size for r in ranks)
