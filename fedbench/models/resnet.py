"""CIFAR-style ResNets: 3x3 stem conv, no stem max-pool, global average pool -> head.

- resnet8: BasicBlock, 3 stages [1, 1, 1], widths 16-32-64 by default (84k parameters on
  CIFAR-100). DiversiFed's CIFAR-100 net (Table VIII: 1.26M parameters) is PFLlib's resnet8:
  widths 64-128-256 and the ImageNet stem (`stem: imagenet`, 1,258,404 parameters; with the
  CIFAR stem 1,250,724). Its flops fit too: ~29.2M per forward pass of a 32x32 image, Table
  VIII's 438.24G client flops / (500 samples x 10 epochs x 3 for forward + backward).
- resnet18: BasicBlock [2, 2, 2, 2], widths 64-128-256-512 (PLGU, FedSLR, FedSAM).
- resnet50: Bottleneck [3, 4, 6, 3], expansion 4 (PLGU's TinyImageNet net).
`norm`: `group` (default; PLGU/FedSAM/FedSLR use GroupNorm), `batch`, or `none`: FedPG's
normalizer-free ResNet, every conv weight-standardized (`WSConv2d`, with bias) and no norm.
`stem`: `cifar` (default: one 3x3 conv, stride 1, no pooling) or `imagenet` (7x7 conv with
stride 2, then a 3x3 max-pool with stride 2: torchvision's, and PFLlib's for every depth).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedbench.errors import ConfigError
from fedbench.models.base import FedModel, check_choice, image_shape, make_conv, make_norm
from fedbench.models.registry import MODELS


def _shortcut(cin: int, cout: int, stride: int, norm: str, gn_groups: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(
        OrderedDict(
            conv=make_conv(cin, cout, 1, stride, 0, norm), norm=make_norm(norm, cout, gn_groups)
        )
    )


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, norm: str, gn_groups: int) -> None:
        super().__init__()
        # registration order = forward order: `FedModel.layers` pairs each conv with its norm
        self.conv1 = make_conv(cin, width, 3, stride, 1, norm)
        self.norm1 = make_norm(norm, width, gn_groups)
        self.conv2 = make_conv(width, width, 3, 1, 1, norm)
        self.norm2 = make_norm(norm, width, gn_groups)
        self.shortcut = _shortcut(cin, width, stride, norm, gn_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, norm: str, gn_groups: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = make_conv(cin, width, 1, 1, 0, norm)
        self.norm1 = make_norm(norm, width, gn_groups)
        self.conv2 = make_conv(width, width, 3, stride, 1, norm)
        self.norm2 = make_norm(norm, width, gn_groups)
        self.conv3 = make_conv(width, cout, 1, 1, 0, norm)
        self.norm3 = make_norm(norm, cout, gn_groups)
        self.shortcut = _shortcut(cin, cout, stride, norm, gn_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = F.relu(self.norm2(self.conv2(out)))
        out = self.norm3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


STEMS = ("cifar", "imagenet")


class ResNet(FedModel):
    def __init__(
        self,
        name: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        block: type[BasicBlock] | type[Bottleneck],
        blocks: Sequence[int],
        widths: Sequence[int],
        norm: str,
        gn_groups: int,
        stem: str = "cifar",
    ) -> None:
        cin = image_shape(name, input_shape)[0]
        check_choice("model norm", norm, ("group", "batch", "none"))
        check_choice("model stem", stem, STEMS)
        if len(widths) != len(blocks) or any(int(w) < 1 for w in widths):
            raise ConfigError(
                f"model widths={list(widths)}: {name} needs {len(blocks)} positive widths"
            )
        big = stem == "imagenet"
        mods: OrderedDict[str, nn.Module] = OrderedDict(
            conv1=make_conv(
                cin, widths[0], 7 if big else 3, 2 if big else 1, 3 if big else 1, norm
            ),
            norm1=make_norm(norm, widths[0], gn_groups),
            relu=nn.ReLU(),
        )
        if big:
            mods["maxpool"] = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = widths[0]
        for i, (n, width) in enumerate(zip(blocks, widths), 1):
            stage = []
            for j in range(n):
                stride = 2 if i > 1 and j == 0 else 1
                stage.append(block(cin, width, stride, norm, gn_groups))
                cin = width * block.expansion
            mods[f"layer{i}"] = nn.Sequential(*stage)
        mods["pool"] = nn.AdaptiveAvgPool2d(1)
        mods["flatten"] = nn.Flatten()
        super().__init__(nn.Sequential(mods), cin, num_classes)


@MODELS.register("resnet8")
def resnet8(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: str = "group",
    gn_groups: int = 2,
    widths: Sequence[int] = (16, 32, 64),
    stem: str = "cifar",
) -> ResNet:
    return ResNet(
        "resnet8",
        input_shape,
        num_classes,
        BasicBlock,
        (1, 1, 1),
        tuple(int(w) for w in widths),
        norm,
        gn_groups,
        stem,
    )


@MODELS.register("resnet18")
def resnet18(
    input_shape: tuple[int, ...], num_classes: int, *, norm: str = "group", gn_groups: int = 2
) -> ResNet:
    return ResNet(
        "resnet18",
        input_shape,
        num_classes,
        BasicBlock,
        (2, 2, 2, 2),
        (64, 128, 256, 512),
        norm,
        gn_groups,
    )


@MODELS.register("resnet50")
def resnet50(
    input_shape: tuple[int, ...], num_classes: int, *, norm: str = "group", gn_groups: int = 2
) -> ResNet:
    return ResNet(
        "resnet50",
        input_shape,
        num_classes,
        Bottleneck,
        (3, 4, 6, 3),
        (64, 128, 256, 512),
        norm,
        gn_groups,
    )
