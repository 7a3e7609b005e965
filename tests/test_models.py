"""Models: shapes, layer lists, hand-checked parameter counts and FLOPs, functional/vmap safety."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from fedbench.errors import ConfigError
from fedbench.models import (
    FedModel,
    Layer,
    WSConv2d,
    build_model,
    count_params,
    model_flops,
    model_names,
    model_options,
)

pytestmark = pytest.mark.quick

IMG = (3, 32, 32)

# (name, options, input shape): small configs so the whole file stays fast on CPU
CASES = [
    ("mlp", {}, (1, 28, 28)),
    ("mlp", {"hidden": [64]}, (60,)),
    ("mlp", {"hidden": []}, (60,)),
    ("cnn", {"preset": "fedavg"}, IMG),
    ("cnn", {"preset": "lenet", "norm": "group"}, IMG),
    ("cnn", {"preset": "lenet", "norm": "batch", "padding": 2}, (1, 28, 28)),
    ("resnet8", {}, IMG),
    ("resnet8", {"norm": "batch"}, IMG),
    ("resnet8", {"norm": "none"}, (1, 28, 28)),
    ("resnet18", {}, IMG),
    ("resnet50", {}, (3, 16, 16)),
    ("wrn28_10", {"depth": 10, "widen": 2}, IMG),
    ("wrn28_10", {"depth": 10, "widen": 1, "norm": "none", "dropout": 0.3}, IMG),
]


def _ids(case: tuple) -> str:
    name, opts, _ = case
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.fixture(params=CASES, ids=[_ids(c) for c in CASES])
def case(request: pytest.FixtureRequest) -> tuple[FedModel, tuple[int, ...]]:
    torch.manual_seed(0)
    name, opts, shape = request.param
    return build_model(name, shape, 7, **opts), shape


def test_registry_names() -> None:
    assert model_names() == ["cnn", "mlp", "resnet18", "resnet50", "resnet8", "wrn28_10"]
    assert model_options("resnet18") == ["norm", "gn_groups"]


def test_shapes(case: tuple[FedModel, tuple[int, ...]]) -> None:
    model, shape = case
    x = torch.randn(2, *shape)
    assert model(x).shape == (2, 7)
    assert model.features(x).shape == (2, model.feature_dim)
    assert model.head.in_features == model.feature_dim
    model.eval()  # dropout
    assert torch.allclose(model.head(model.features(x)), model(x))


def test_layers_cover_every_parameter_in_order(case: tuple[FedModel, tuple[int, ...]]) -> None:
    model, _ = case
    names = [n for n, _ in model.named_parameters()]
    for unit in ("op_norm", "module"):
        layers = model.layers(unit)
        assert all(isinstance(layer, Layer) and layer.params for layer in layers)
        assert [p for layer in layers for p in layer.params] == names
        assert len({layer.name for layer in layers}) == len(layers)
        assert layers[-1] == Layer("head", ("head.weight", "head.bias"))
    assert all(n.startswith(("body.", "head.")) for n in names)
    assert model.head_params() == ["head.weight", "head.bias"]
    assert model.body_params() + model.head_params() == names


def test_op_norm_groups_conv_with_its_norm() -> None:
    model = build_model("resnet18", IMG, 10, norm="group")
    layers = model.layers()
    assert layers[0] == Layer(
        "body.conv1", ("body.conv1.weight", "body.norm1.weight", "body.norm1.bias")
    )
    assert layers[1].params == (
        "body.layer1.0.conv1.weight",
        "body.layer1.0.norm1.weight",
        "body.layer1.0.norm1.bias",
    )
    # shortcut projection (1x1 conv + its norm) is one layer
    assert (
        Layer(
            "body.layer2.0.shortcut.conv",
            (
                "body.layer2.0.shortcut.conv.weight",
                "body.layer2.0.shortcut.norm.weight",
                "body.layer2.0.shortcut.norm.bias",
            ),
        )
        in layers
    )
    # 1 stem + 16 block convs + 3 shortcuts + head; `module` splits off the 20 norms
    assert len(layers) == 21
    assert len(model.layers("module")) == 41
    assert model.layers("module")[0] == Layer("body.conv1", ("body.conv1.weight",))


def test_op_norm_pre_activation_wrn() -> None:
    model = build_model("wrn28_10", IMG, 100)
    layers = model.layers()
    assert layers[0].params == ("body.conv1.weight",)
    # pre-activation: the norm joins the conv after it
    assert layers[1] == Layer(
        "body.layer1.0.conv1",
        ("body.layer1.0.norm1.weight", "body.layer1.0.norm1.bias", "body.layer1.0.conv1.weight"),
    )
    # the final norm has no op after it in the body: it joins the last conv, not the head
    assert layers[-2].params[-2:] == ("body.norm.weight", "body.norm.bias")
    assert len(layers) == 1 + 12 * 2 + 3 + 1


def test_op_norm_generic_rules() -> None:
    # a leading norm (no op before it) joins the next op; a norm after an op joins that op
    body = nn.Sequential(
        nn.LayerNorm(5), nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3)
    )
    model = FedModel(body, 3, 2)
    assert [layer.params for layer in model.layers()] == [
        ("body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias")
        + ("body.2.weight", "body.2.bias"),
        ("body.4.weight", "body.4.bias"),
        ("head.weight", "head.bias"),
    ]
    with pytest.raises(ConfigError, match="op_norm, module"):
        model.layers("conv")


def test_layer_unit_option() -> None:
    model = build_model("resnet8", IMG, 10)
    assert model.layers() == model.layers("op_norm")
    per_module = build_model("resnet8", IMG, 10, layer_unit="module")
    assert per_module.layers() == per_module.layers("module") != per_module.layers("op_norm")
    with pytest.raises(ConfigError, match="op_norm, module"):
        build_model("resnet8", IMG, 10, layer_unit="block")


def test_mlp_param_count_and_flops() -> None:
    model = build_model("mlp", (1, 28, 28), 10, hidden=[200, 200])
    assert count_params(model) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10 == 199210
    assert model_flops(model, (1, 28, 28)) == 2 * (784 * 200 + 200 * 200 + 200 * 10)
    logreg = build_model("mlp", (1, 28, 28), 10, hidden=[])
    assert logreg.feature_dim == 784 and count_params(logreg) == 7850
    assert [layer.name for layer in logreg.layers()] == ["head"]


def test_cnn_presets_param_counts() -> None:
    # fedavg, padding 0: 32 -conv5-> 28 -pool-> 14 -conv5-> 10 -pool-> 5: flatten 64*5*5 = 1600
    fedavg = build_model("cnn", IMG, 10, preset="fedavg")
    expected = (3 * 25 * 64 + 64) + (64 * 25 * 64 + 64) + (1600 * 384 + 384)
    expected += (384 * 192 + 192) + (192 * 10 + 10)
    assert expected == 797962
    assert count_params(fedavg) == expected
    assert fedavg.body.fc1.in_features == 1600
    assert build_model("cnn", IMG, 10).body.fc1.in_features == 1600  # fedavg is the default
    # padding 2 ("same", the TF tutorial): 32 -> 16 -> 8: flatten 64*8*8
    assert build_model("cnn", IMG, 10, preset="fedavg", padding=2).body.fc1.in_features == 4096
    # lenet: flatten 16*5*5 = 400 -> 120 -> 84 -> 10
    lenet = build_model("cnn", IMG, 10, preset="lenet")
    expected = (3 * 25 * 6 + 6) + (6 * 25 * 16 + 16) + (400 * 120 + 120) + (120 * 84 + 84)
    expected += 84 * 10 + 10
    assert expected == 62006
    assert count_params(lenet) == expected
    assert lenet.feature_dim == 84
    # explicit options override the preset
    wide = build_model("cnn", IMG, 10, preset="lenet", channels=[8, 8], fc=[32])
    assert wide.body.fc1.in_features == 8 * 5 * 5 and wide.feature_dim == 32


def test_cnn_flops_by_hand() -> None:
    lenet = build_model("cnn", IMG, 10, preset="lenet")
    macs = 28 * 28 * 6 * (3 * 25) + 10 * 10 * 16 * (6 * 25) + 400 * 120 + 120 * 84 + 84 * 10
    assert model_flops(lenet, IMG) == 2 * macs


def test_known_architecture_sizes() -> None:
    assert count_params(build_model("resnet18", IMG, 10)) == 11173962
    assert build_model("resnet50", IMG, 10).feature_dim == 2048
    assert build_model("resnet8", IMG, 100).feature_dim == 64
    # NF variant: every conv weight-standardized, no norm layer at all
    nf = build_model("resnet18", IMG, 100, norm="none")
    assert all(isinstance(m, WSConv2d) for m in nf.modules() if isinstance(m, nn.Conv2d))
    assert not any(isinstance(m, (nn.GroupNorm, nn.BatchNorm2d)) for m in nf.modules())


def test_construction_leaves_batchnorm_stats_untouched() -> None:
    model = build_model("cnn", IMG, 10, preset="lenet", norm="batch")
    assert model.training
    assert torch.equal(model.body.norm1.running_var, torch.ones(6))
    model_flops(model, IMG)
    assert model.training and torch.equal(model.body.norm1.running_mean, torch.zeros(6))


def test_wsconv_standardizes_weight() -> None:
    torch.manual_seed(0)
    conv = WSConv2d(4, 6, 3, padding=1)
    x = torch.randn(2, 4, 8, 8)
    w = conv.weight
    fan_in = 4 * 9
    w_hat = (w - w.mean((1, 2, 3), keepdim=True)) / (
        w.std((1, 2, 3), unbiased=False, keepdim=True) * fan_in**0.5
    )
    ref = torch.nn.functional.conv2d(x, w_hat, conv.bias, padding=1)
    assert torch.allclose(conv(x), ref, atol=1e-5)
    # the standardized weight is recomputed from whatever weight functional_call supplies
    params = dict(conv.named_parameters())
    params["weight"] = 3 * params["weight"] + 1
    assert torch.allclose(functional_call(conv, params, (x,)), ref, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "opts", "shape"),
    [
        ("mlp", {}, (1, 28, 28)),
        ("cnn", {"preset": "lenet"}, IMG),
        ("resnet8", {"norm": "group"}, IMG),
        ("resnet8", {"norm": "none"}, (3, 16, 16)),
    ],
)
def test_vmap_over_stacked_parameters(name: str, opts: dict, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    models = [build_model(name, shape, 5, **opts) for _ in range(3)]
    params, buffers = stack_module_state(models)
    x = torch.randn(3, 2, *shape)

    def call(p: dict, b: dict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(models[0], (p, b), (xb,))

    out = vmap(call)(params, buffers, x)
    ref = torch.stack([m(xi) for m, xi in zip(models, x)])
    assert out.shape == (3, 2, 5)
    assert torch.allclose(out, ref, atol=1e-5)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="none, batch, group"):
        build_model("cnn", IMG, 10, norm="foo")
    with pytest.raises(ConfigError, match="none, batch, group|group, batch, none"):
        build_model("resnet18", IMG, 10, norm="layer")
    with pytest.raises(ConfigError, match="fedavg, lenet"):
        build_model("cnn", IMG, 10, preset="vgg")
    for name in ("cnn", "resnet8", "resnet18", "resnet50", "wrn28_10"):
        with pytest.raises(ConfigError, match="image input"):
            build_model(name, (60,), 10)
    with pytest.raises(ConfigError, match="unknown option.*widht.*valid: depth"):
        build_model("wrn28_10", IMG, 10, widht=4)
    with pytest.raises(ConfigError, match="unknown model"):
        build_model("vgg16", IMG, 10)
    with pytest.raises(ConfigError, match="gn_groups"):
        build_model("resnet8", IMG, 10, gn_groups=3)
    with pytest.raises(ConfigError, match="depth"):
        build_model("wrn28_10", IMG, 10, depth=20)
    with pytest.raises(ConfigError, match="too small"):
        build_model("cnn", (3, 8, 8), 10)
    with pytest.raises(ConfigError, match="hidden"):
        build_model("mlp", (60,), 10, hidden=[0])


# --------------------------------------------------------------------------- paper presets
# Input shape and classes of each dataset (no files needed), as fedbench.data.sources loads it.
DATA_SHAPES = {
    "fmnist": ((1, 28, 28), 10),
    "cifar10": ((3, 32, 32), 10),
    "cifar100": ((3, 32, 32), 100),
    "pathmnist": ((3, 28, 28), 9),
}
# DiversiFed Table VIII: parameters of each dataset's model as printed (FMNIST MLP 50.89K,
# CIFAR-10 CNN 62.01K, CIFAR-100 ResNet-8 1.26M); PathMNIST's CNN is not listed.
DIVERSIFED_PARAMS = {"fmnist": (50.89, 1e3), "cifar10": (62.01, 1e3), "cifar100": (1.26, 1e6)}
DIVERSIFED_PRESETS = [
    "diversifed_table1_fmnist",
    "diversifed_table1_cifar10",
    "diversifed_table1_cifar100",
    "diversifed_table2_fmnist",
    "diversifed_table2_cifar10",
    "diversifed_table2_cifar100",
    "diversifed_table7_cifar10",
]


def preset_model(preset: str) -> tuple[nn.Module, str, tuple[int, ...]]:
    """The model a `fedbench +experiment=<preset>` run builds (the runner's call)."""
    from omegaconf import OmegaConf

    from conftest import compose

    cfg = compose([f"+experiment={preset}"])
    shape, classes = DATA_SHAPES[str(cfg.data.name)]
    mcfg = OmegaConf.to_container(cfg.model, resolve=True)
    return build_model(mcfg.pop("name"), shape, classes, **mcfg), str(cfg.data.name), shape


@pytest.mark.parametrize("preset", DIVERSIFED_PRESETS)
def test_diversifed_preset_models_have_the_papers_parameter_counts(preset):
    model, data, _ = preset_model(preset)
    printed, unit = DIVERSIFED_PARAMS[data]
    assert round(count_params(model) / unit, 2) == printed


def test_diversifed_resnet8_is_pfllibs():
    """1,258,404 parameters; its forward FLOPs fit Table VIII's client flops (438.24G for 500
    samples x 10 epochs x 3, forward + backward = 29.2M a sample; norms/pooling not counted
    here), where the CIFAR stem would need 153M."""
    model, _, shape = preset_model("diversifed_table2_cifar100")
    assert count_params(model) == 1_258_404
    flops = model_flops(model, shape)
    assert abs(flops / (438.24e9 / (500 * 10 * 3)) - 1) < 0.02
    cifar_stem = build_model("resnet8", shape, 100, widths=[64, 128, 256])
    assert count_params(cifar_stem) == 1_250_724
    assert model_flops(cifar_stem, shape) > 5 * flops


def test_resnet8_widths_and_stem_are_checked():
    with pytest.raises(ConfigError, match="stem"):
        build_model("resnet8", IMG, 10, stem="tiny")
    with pytest.raises(ConfigError, match="3 positive widths"):
        build_model("resnet8", IMG, 10, widths=[16, 32])
    assert build_model("resnet8", IMG, 10, stem="imagenet")(torch.zeros(2, *IMG)).shape == (2, 10)
