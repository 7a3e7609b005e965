"""Malicious clients (FedPG appendix B.3, Table 3), for any algorithm that routes its uploads
through `Algorithm.receive`.

`attack.fraction` of the N clients (round(fraction N), at least 1) are malicious, drawn once
from the run's seed. Whatever a malicious client uploads is replaced where the server
receives it; honest rows pass unchanged. With xi ~ N(0, I) drawn fresh per upload:

- kind="model" (a state trained from `ref`, the model the server sent), parameters only
  (the first `n_params` columns; buffers pass unchanged):
    A1: xi                                   (zero-mean Gaussian parameters)
    A2: 100 (w_i - ref) + ref                (the update scaled 100 times)
- kind="grad" (a gradient or pseudo-gradient g_i, taken at `ref` if given):
    A1 `a1_grad: scaled` (default, the FedPG authors' code): (ref - xi) / ||ref - xi|| ||g_i||,
       a random direction at the honest norm (without `ref`: xi / ||xi|| ||g_i||);
    A1 `a1_grad: gaussian`: xi (a raw N(0, I) gradient, norm ~ sqrt(P));
    A2: 100 g_i
- kind="other" (anything else a client sends that the server mixes: prototypes, scores,
  head or body pieces in their own layout): A1 xi of the same shape, A2 100 times the value.
  The appendix defines its attacks on parameters and gradients only; this is our extension,
  so that an algorithm uploading only such tensors is still attacked, not silently spared.
- kind="loss" (a scalar report of a client's loss: FedPG's L_i, S-FedPG's line-search
  queries): passed unchanged. The paper's attacks alter the model or gradient a client
  sends, not its loss reports (our reading; a lying loss report is outside its threat model).

Metrics are then computed over honest clients only (`evaluation.evaluate(honest=...)`) and
`summary.json` records `malicious` (how many).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedbench.errors import ConfigError

KINDS = ("none", "a1", "a2")
A1_GRAD = ("scaled", "gaussian")
UPLOAD_KINDS = ("model", "grad", "other", "loss")
A2_SCALE = 100.0


class Attack:
    def __init__(
        self, kind: str, fraction: float, n_clients: int, seed: int, a1_grad: str = "scaled"
    ) -> None:
        if kind not in KINDS:
            raise ConfigError(f"attack.kind={kind!r}; valid: {', '.join(KINDS)}")
        if a1_grad not in A1_GRAD:
            raise ConfigError(f"attack.a1_grad={a1_grad!r}; valid: {', '.join(A1_GRAD)}")
        fraction = float(fraction)
        if not 0 < fraction <= 1:
            raise ConfigError(f"attack.fraction={fraction} must be in (0, 1]")
        self.kind = kind
        self.a1_grad = a1_grad
        self.n_clients = int(n_clients)
        k = max(1, round(fraction * self.n_clients))
        rng = np.random.default_rng([int(seed), 0xA77AC])
        ids = np.sort(rng.choice(self.n_clients, k, replace=False))
        self.malicious = np.zeros(self.n_clients, dtype=bool)
        self.malicious[ids] = True
        # the Gaussian draws: one stream per run (CPU generator, moved to the device)
        self._gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)

    @classmethod
    def from_config(cls, rc: Any) -> Attack | None:
        """The run's attack (None for attack.kind=none), from its checked config (a
        fedbench.config.RunConfig, not imported here: the config sits above this module)."""
        a = rc.attack
        if a.kind == "none":
            return None
        return cls(a.kind, a.fraction, rc.clients, rc.seed, a.a1_grad)

    def rng_state(self) -> torch.Tensor:
        """The Gaussian stream's state, for checkpoints (a resumed A1 run draws the same)."""
        return self._gen.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._gen.set_state(state.cpu())

    @property
    def count(self) -> int:
        return int(self.malicious.sum())

    @property
    def honest(self) -> np.ndarray:
        return ~self.malicious

    def _gauss(self, shape, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(shape, generator=self._gen).to(device=like.device, dtype=like.dtype)

    def apply(
        self,
        uploads: torch.Tensor,
        clients,
        *,
        ref: torch.Tensor | None = None,
        kind: str = "model",
        n_params: int | None = None,
    ) -> torch.Tensor:
        """`uploads` [C, ...] from `clients` as the server receives them (a new tensor when a
        row changes; the input is never modified)."""
        if kind not in UPLOAD_KINDS:
            raise ValueError(f"upload kind {kind!r}; valid: {', '.join(UPLOAD_KINDS)}")
        clients = np.asarray(clients, dtype=np.int64).reshape(-1)
        rows = np.flatnonzero(self.malicious[clients])
        if self.kind == "none" or kind == "loss" or rows.size == 0:
            return uploads
        out = uploads.clone()
        if kind == "other":
            for r in rows:
                u = uploads[r]
                out[r] = self._gauss(u.shape, u) if self.kind == "a1" else A2_SCALE * u
            return out
        P = uploads.shape[1] if n_params is None else min(int(n_params), uploads.shape[1])
        for r in rows:
            u = uploads[r, :P]
            base = None
            if ref is not None:
                base = (ref[r] if ref.dim() == 2 else ref)[:P].to(u.dtype)
            if kind == "model":
                if self.kind == "a1":
                    out[r, :P] = self._gauss(u.shape, u)
                else:
                    b = torch.zeros_like(u) if base is None else base
                    out[r, :P] = A2_SCALE * (u - b) + b
            else:  # grad
                if self.kind == "a2":
                    out[r, :P] = A2_SCALE * u
                elif self.a1_grad == "gaussian":
                    out[r, :P] = self._gauss(u.shape, u)
                else:
                    xi = self._gauss(u.shape, u)
                    v = xi if base is None else base - xi
                    out[r, :P] = v / v.norm().clamp_min(1e-12) * u.norm()
        return out
