"""WideResNet (Zagoruyko & Komodakis 2016): pre-activation blocks, widths 16, 16k, 32k, 64k.

`wrn28_10` is PLGU's CIFAR-100 net (GroupNorm by default). Pre-activation means each norm
precedes its conv (norm -> ReLU -> conv), so `FedModel.layers("op_norm")` groups a norm
with the op after it (`norm_first`); the final norm (before pooling) has no op after it in
the body and joins the last conv. `norm="none"`: weight-standardized convs, no norms.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from fedbench.errors import ConfigError
from fedbench.models.base import FedModel, check_choice, image_shape, make_conv, make_norm
from fedbench.models.dropout import KeyedDropout
from fedbench.models.registry import MODELS


class PreActBlock(nn.Module):
    def __init__(
        self, cin: int, cout: int, stride: int, dropout: float, norm: str, gn_groups: int
    ) -> None:
        super().__init__()
        self.norm1 = make_norm(norm, cin, gn_groups)
        self.conv1 = make_conv(cin, cout, 3, stride, 1, norm)
        self.norm2 = make_norm(norm, cout, gn_groups)
        # keyed masks (the same on both backends); no module at p=0 (nothing to draw)
        self.drop = KeyedDropout(dropout) if dropout > 0 else nn.Identity()
        self.conv2 = make_conv(cout, cout, 3, 1, 1, norm)
        # projection on the pre-activated input when the shape changes (as the original code)
        self.shortcut = (
            make_conv(cin, cout, 1, stride, 0, norm) if stride != 1 or cin != cout else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(act)
        out = self.conv1(act)
        out = self.conv2(self.drop(F.relu(self.norm2(out))))
        return out + skip


@MODELS.register("wrn28_10")
class WideResNet(FedModel):
    norm_first = True

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        depth: int = 28,
        widen: int = 10,
        dropout: float = 0.0,
        norm: str = "group",
        gn_groups: int = 2,
    ) -> None:
        cin = image_shape("wrn28_10", input_shape)[0]
        check_choice("model norm", norm, ("group", "batch", "none"))
        if depth < 10 or (depth - 4) % 6 or widen < 1:
            raise ConfigError(f"wrn: need depth = 6n+4 >= 10, widen >= 1; got {depth}, {widen}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        mods: OrderedDict[str, nn.Module] = OrderedDict(conv1=make_conv(cin, 16, 3, 1, 1, norm))
        cin = 16
        for i, (width, stride) in enumerate(zip(widths[1:], (1, 2, 2)), 1):
            stage = []
            for j in range(n):
                stage.append(
                    PreActBlock(cin, width, stride if j == 0 else 1, dropout, norm, gn_groups)
                )
                cin = width
            mods[f"layer{i}"] = nn.Sequential(*stage)
        mods["norm"] = make_norm(norm, cin, gn_groups)
        mods["relu"] = nn.ReLU()
        mods["pool"] = nn.AdaptiveAvgPool2d(1)
        mods["flatten"] = nn.Flatten()
        super().__init__(nn.Sequential(mods), cin, num_classes)
