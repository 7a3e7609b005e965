"""Layer-wise SAM (LWSAM) of PLGU (Qu et al., CVPR 2023, eqs. 4-6, 10): layer scores and
the per-parameter scale that turns SAM's perturbation into LWSAM's.

A model's layers (`FedModel.layers()`, docs/papers/plgu.md "What a layer is") partition its flat
parameter vector; `LayerMap` holds that partition (optionally restricted to some layers,
e.g. PLGU-GRep's body) so per-layer quantities are one `index_add_` away.

- Personalization score, eq. 6: xi_l = ||a_l - b_l||_2 / dim(l), then normalized across the
  layers (`normalize_scores`): `mean1` (RECONSTRUCTION, the default: mean 1, so LWSAM equals
  SAM when every layer is equally personalized), `sum1` (the text's "sum to 1"), or
  `uniform` (all ones: LWSAM = SAM). All-zero scores (a client's first round) are uniform.
- Perturbation, eq. 5 with p = q = 2: eps_l = rho * xi_l * g_l / ||g||_2, i.e. SAM's
  eps = rho g / ||g|| (Foret et al. 2021) with layer l scaled by xi_l. `lwsam_scale` expands
  xi to a [P] vector, zero outside the map's layers and wherever `keep` is False (PLGU-LF
  perturbs only its universal layers), so `SAM(rho, scale)` of `engine.plan` is LWSAM.
  The norm ||g|| is over whatever gradient is passed: pass the gradient restricted to the
  layers being perturbed as a whole (PLGU-GRep: the body's) where the paper's g is that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedbench.engine.plan import SAM
from fedbench.engine.spec import ModelSpec
from fedbench.errors import ConfigError
from fedbench.models.base import Layer

SCORE_NORMS = ("mean1", "sum1", "uniform")


class LayerMap:
    """Which layer each entry of a flat parameter vector [P] belongs to.

    `layers` is any subset of the model's layers (in model order); entries of parameters in
    none of them belong to no layer: they get no score and a zero scale.
    """

    def __init__(self, spec: ModelSpec, layers: Sequence[Layer], device=None) -> None:
        self.layers = list(layers)
        self.names = [layer.name for layer in self.layers]
        self.n = len(self.layers)
        self.n_params = spec.n_params
        seg = torch.full((spec.n_params,), self.n, dtype=torch.long)  # n = "no layer"
        dims = torch.zeros(self.n)
        for j, layer in enumerate(self.layers):
            for name in layer.params:
                e = spec.index[name]
                seg[e.start : e.stop] = j
                dims[j] += e.stop - e.start
        self.seg = seg.to(device)
        self.dims = dims.to(device)  # dim(w_l): parameter count of each layer

    def sums(self, v: torch.Tensor) -> torch.Tensor:
        """Per-layer sums of a [..., P] vector -> [..., n]."""
        out = torch.zeros(*v.shape[:-1], self.n + 1, dtype=v.dtype, device=v.device)
        return out.index_add_(-1, self.seg, v)[..., : self.n]

    def norms(self, v: torch.Tensor) -> torch.Tensor:
        """Per-layer l2 norms of a [..., P] vector -> [..., n]."""
        return self.sums(v * v).sqrt()

    def expand(self, per_layer: torch.Tensor) -> torch.Tensor:
        """A per-layer value [..., n] spread over the parameters [..., P] (0 outside)."""
        pad = torch.zeros(*per_layer.shape[:-1], 1, dtype=per_layer.dtype, device=per_layer.device)
        return torch.cat([per_layer, pad], dim=-1)[..., self.seg]

    def mask(self, chosen: torch.Tensor) -> torch.Tensor:
        """[P] bool: True on the parameters of the chosen layers ([n] bool)."""
        return self.expand(chosen.to(torch.float32)).bool()


def layer_scores(a: torch.Tensor, b: torch.Tensor, layers: LayerMap) -> torch.Tensor:
    """Eq. 6 (and 10): xi_l = ||a_l - b_l||_2 / dim(l) over the map's layers -> [..., n].

    `a`, `b` are parameter vectors [..., P] (full states are cut to their first P entries).
    """
    P = layers.n_params
    return layers.norms(a[..., :P] - b[..., :P]) / layers.dims


def normalize_scores(xi: torch.Tensor, how: str = "mean1") -> torch.Tensor:
    """Normalize raw scores across layers (last dim): mean1 | sum1 | uniform.

    A row of all-zero scores (nothing personalized yet) becomes uniform under any rule.
    """
    if how not in SCORE_NORMS:
        raise ConfigError(f"score_norm={how!r}; valid: {', '.join(SCORE_NORMS)}")
    n = xi.shape[-1]
    total = xi.sum(-1, keepdim=True)
    if how == "uniform":
        return torch.ones_like(xi)
    flat = total <= 0
    target = n if how == "mean1" else 1
    scaled = xi * (target / torch.where(flat, torch.ones_like(total), total))
    return torch.where(flat, torch.full_like(xi, target / n), scaled)


def lwsam_scale(
    xi: torch.Tensor, layers: LayerMap, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """The [..., P] scale of LWSAM: xi of each entry's layer, 0 where `keep` ([P] bool) is
    False and outside the map's layers. `SAM(rho, lwsam_scale(...))` is eq. 5."""
    scale = layers.expand(xi)
    return scale if keep is None else scale * keep.to(scale.dtype)


def lwsam_perturbation(
    g: torch.Tensor, xi: torch.Tensor, layers: LayerMap, rho: float, keep=None
) -> torch.Tensor:
    """eps_l = rho * xi_l * g_l / ||g||_2 (eq. 5, p = q = 2) for a gradient g [P]."""
    return SAM(rho).perturbation(g, lwsam_scale(xi, layers, keep))
