"""FedSAM (Qu et al., ICML 2022 "Generalized Federated Learning via Sharpness Aware
Minimization"; the PLGU paper's baseline, docs/papers/plgu.md): FedAvg whose local optimizer is
SAM (Foret et al., ICLR 2021, p = 2).

Each local step on batch b: g = grad F_b(w); eps = rho g / ||g||_2;
w <- w - eta grad F_b(w + eps) (the second gradient, taken at the perturbed point, applied
to the unperturbed w). Server: FedAvg of the clients' models. rho = 0.05.

Reports the global model w and, as FedAvg does (docs/metrics.md), each client's model after
its last local training as its personal model. Nothing here is a reconstruction.
Uploads and buffers as FedAvg. Buffers: averaged (weights >= 0) with the parameters; both
SAM forwards of a step (at w and at w + eps) update them, as `Engine.train` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedbench.algorithms._about import About
from fedbench.algorithms.base import ALGORITHMS
from fedbench.algorithms.fedavg import FedAvg, FedAvgParams
from fedbench.algorithms.params import nonneg
from fedbench.engine import SAM


@dataclass
class FedSAMParams(FedAvgParams):
    rho: float = nonneg()  # SAM radius, >= 0 (0: FedAvg)


@ALGORITHMS.register("fedsam")
class FedSAM(FedAvg):
    about = About(
        name="FedSAM",
        paper="Qu et al., ICML 2022",
        summary="FedAvg with SAM local steps (rho 0.05)",
        docs="papers/plgu.md#fedsam-fedsam",
    )
    Params = FedSAMParams

    def local_train(self, states, clients, t, **kw):
        """FedAvg's local training with the SAM step (`Engine.train(sam=...)`)."""
        return super().local_train(states, clients, t, sam=SAM(self.hp.rho), **kw)
