"""FedBN (Li, Jiang, Zhang, Kamp, Dou: "FedBN: Federated Learning on Non-IID Features via
Local Batch Normalization", ICLR 2021, arXiv:2102.07623, Algorithm 1).

Each client keeps its batch-normalization layers, their affine parameters and running
statistics; the server averages every other parameter. Round t, each sampled client i:
start from (W^t, BN_i) (the shared weights with its own BN layers), train E epochs of the
run's optimizer on its data, keep BN_i, upload the rest; the server sets
W^{t+1} = sum_i w_i W_i with w_i = 1/C (`weighting=uniform`, the default: the authors' code,
`client_weights = [1/client_num ...]` in federated/fed_{digits,office,domainnet}.py) or
n_i / n (`weighting=samples`, FedAvg's, PFLlib's; the authors' Office-Caltech and DomainNet
clients' training sets are cut to one size, where the two coincide). Client i deploys
(W^{t+1}, BN_i). This is FedPer's round (fedbench/algorithms/fedper.py) with the
normalization layers, not the last layers, as the part each client keeps.

RECONSTRUCTION:
- the weights: we could not read the paper's Algorithm 1; uniform is the authors' code in
  all three of its scripts;
- a client never sampled deploys (W^{t+1}, the initial BN layers: weight 1, bias 0, running
  mean 0, variance 1): every client trains every round in the paper and the authors' code;
  FL-bench and PFLlib likewise leave an unsampled client its initial BN layers;
- `norm=batch` (the default, the paper's, which is about BatchNorm only): the BatchNorm
  layers stay local; `norm=all` also keeps GroupNorm / LayerNorm / InstanceNorm layers local
  (fedbench's ResNets normalize with GroupNorm unless `model.norm=batch`);
- a model with no such layer (an MLP, a GroupNorm ResNet under `norm=batch`) leaves nothing
  local: the run is FedAvg whose clients deploy the global model (logged).
Uploads: each client's trained state, of which the server uses the shared entries (kind
"model", ref = the W^t it trained from). Communication: the shared entries, each way.
Buffers: a normalization layer's running statistics stay with the client, with its affine
parameters (also a BatchNorm without them); every other buffer is averaged with the shared
weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from torch import nn

from fedbench.algorithms._about import About
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
    about = About(
        name="FedBN",
        paper="Li et al., ICLR 2021 (arXiv:2102.07623)",
        summary=(
            "each client keeps its BatchNorm layers (affine parameters and running "
            "statistics), the rest averaged (`algo.norm=all`: every normalization "
            "layer)"
        ),
        docs="algorithms.md#fedbn-fedbn",
        pfllib="FedBN",
        fl_bench="FedBN",
    )
    Params = FedBNParams

    def setup(self) -> None:
        super().setup()
        # FedPer keeps the buffers of the modules that own a personal parameter; a BatchNorm
        # without affine parameters owns none, and its statistics stay local all the same
        modules = self.norm_modules(self.engine)
        for e in self.engine.spec.buffers:
            if e.name.rsplit(".", 1)[0] in modules:
                self.personal_entries[e.start : e.stop] = True
        self.personal = self.base[self.personal_entries].repeat(self.N, 1)  # [N, K]

    def norm_modules(self, engine) -> set[str]:
        """The names of the model's normalization modules (`norm`)."""
        kinds = NORMS[self.hp.norm]
        return {n for n, m in engine.model.named_modules() if isinstance(m, kinds)}

    def personal_params(self, engine) -> list[str]:
        """The parameters of the model's normalization layers (`norm`)."""
        modules = self.norm_modules(engine)
        names = [e.name for e in engine.spec.params if e.name.rsplit(".", 1)[0] in modules]
        if not modules:
            log.warning(
                "fedbn: the model has no %s layer: nothing stays local, the run is FedAvg "
                "whose clients deploy the global model",
                "BatchNorm" if self.hp.norm == "batch" else "normalization",
            )
        return names
