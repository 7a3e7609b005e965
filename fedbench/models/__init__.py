"""fedbench models: every one a `FedModel` = `body` (input -> [B, feature_dim]) + linear `head`.

Build one with `build_model(name, input_shape, num_classes, **options)`; `model_names()`
lists them. `FedModel.layers(unit)` is the one layer list of every layer-wise algorithm
(PLGU scores, personalized layers); `head_params`/`body_params` give the FedRep-style split.
Dropout in a model is `KeyedDropout` (masks keyed by seed, round, client, batch and layer:
the same on both engine backends; `dropout.py`).
Forwards are `torch.func.functional_call`/`vmap` safe (BatchNorm in train mode updates
running stats in place, so vmapped training wants `norm="group"` or `"none"`).
"""

from fedbench.models import cnn, mlp, resnet, wrn  # noqa: F401  (registers the models)
from fedbench.models.base import (
    LAYER_UNITS,
    NORMS,
    FedModel,
    Layer,
    WSConv2d,
    count_params,
    model_flops,
)
from fedbench.models.dropout import KeyedDropout
from fedbench.models.registry import MODELS, build_model, model_names, model_options

__all__ = [
    "LAYER_UNITS",
    "MODELS",
    "NORMS",
    "FedModel",
    "KeyedDropout",
    "Layer",
    "WSConv2d",
    "build_model",
    "count_params",
    "model_flops",
    "model_names",
    "model_options",
]
