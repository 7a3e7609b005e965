"""FedBN (Li, Jiang, Zhang, Kamp, Dou: "FedBN: Federated Learning on Non-IID Features via
Local Batch Normalization", ICLR 2021, arXiv:2102.07623, Algorithm 1).

Each client keeps its batch-normalization layers, their affine parameters and running
statistics; the server averages every other parameter. Round t, each sampled client i:
start from (W^t, BN_i) (the shared weights with its own BN layers), train E epochs of the
run's optimizer on its data, keep BN_i, upload the rest; the server sets
W^{t+1} = sum_i w_i W_i with w_i = n_i / n (Algorithm 1's FedAvg weights; `weighting=
uniform` for 1/C). Client i deploys (W^{t+1}, BN_i); a client never sampled deploys the
initial BN layers. This is FedPer's round (fedbench/algorithms/fedper.py) with the
normalization layers, not the last layers, as the part each client keeps.

RECONSTRUCTION (the paper is about BatchNorm only):
- `norm=batch` (the default, the paper's): the BatchNorm layers stay local; `norm=all` also
  keeps GroupNorm / LayerNorm / InstanceNorm layers local (fedbench's ResNets normalize with
  GroupNorm unless `model.norm=batch`);
- a model with no such layer (an MLP, a GroupNorm ResNet under `norm=batch`) leaves nothing
  local: the run is FedAvg whose clients deploy the global model (logged).
Uploads: each client's trained state, of which the server uses the shared entries (kind
"model", ref = the W^t it trained from). Communication: the shared entries, each way.
Buffers: a normalization layer's running statistics stay with the client, with its affine
parameters; every other buffer is averaged with the shared weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from torch import nn

from fedbench.algorithms.base import ALGORITHMS
from fedbench.algorithms.fedper import FedPer
from fedbench.algorithms.params import Weighting

log = logging.getLogger("fedbench")

NORMS = {
    "batch": (nn.modules.batchnorm._BatchNorm,),
    "all": (
        nn.modules.batchnorm._BatchNorm,
        nn.GroupNorm,
        nn.LayerNorm,
        nn.modules.instancenorm._InstanceNorm,
    ),
}


@dataclass
class FedBNParams:
    norm: Literal["batch", "all"]  # which normalization layers stay with each client
    weighting: Weighting  # average of the shared weights: samples (n_i / n) | uniform (1/C)


@ALGORITHMS.register()
class FedBN(FedPer):
    Params = FedBNParams

    def personal_params(self, engine) -> list[str]:
        """The parameters of the model's normalization layers (`norm`)."""
        kinds = NORMS[self.hp.norm]
        modules = {n for n, m in engine.model.named_modules() if isinstance(m, kinds)}
        names = [e.name for e in engine.spec.params if e.name.rsplit(".", 1)[0] in modules]
        if not modules:
            log.warning(
                "fedbn: the model has no %s normalization layer: nothing stays local, the run "
                "is FedAvg whose clients deploy the global model",
                "batch" if self.hp.norm == "batch" else "",
            )
        return names
