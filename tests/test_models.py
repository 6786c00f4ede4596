"""Every registered model honours the FedMechModel contract diagnostics rely on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmech_flwr.errors import ConfigError
from fedmech_flwr.models import MODELS, build_model

SMALL_CONFIGS = {
    "simple_cnn": [{"channels": [4, 8, 8]}],
    "resnet10": [
        {"widths": [8, 8, 8, 8], "stem": "imagenet"},
        {"widths": [8, 8, 8, 8], "stem": "cifar"},
    ],
}
CASES = [
    (name, cfg, in_channels, image_size)
    for name in MODELS.names()
    for cfg in SMALL_CONFIGS.get(name, [{}])
    for in_channels in (1, 3)
    for image_size in (28, 32)
]


@pytest.mark.parametrize(("name", "cfg", "in_channels", "image_size"), CASES)
def test_model_contract(name, cfg, in_channels, image_size):
    torch.manual_seed(0)
    model = build_model(
        name, cfg, in_channels=in_channels, num_classes=5, image_size=image_size
    )
    x = torch.randn(4, in_channels, image_size, image_size)
    y = torch.randint(0, 5, (4,))

    logits = model(x)
    assert logits.shape == (4, 5) and model.num_classes == 5
    assert not torch.isnan(logits).any()
    F.cross_entropy(logits, y).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname

    features = model.forward_features(x)
    assert features.shape == (4, model.feature_dim)
    assert torch.equal(model.forward_head(features, pre_logits=True), features)
    assert torch.allclose(model.forward_head(features), model(x))
    head = model.get_classifier()
    assert isinstance(head, nn.Linear) and head.in_features == model.feature_dim

    gated = model.gated_layers()
    assert gated and all(model.layer_module(n, before_norm=True) is not head for n in gated)
    assert len({id(model.layer_module(n)) for n in gated}) == len(gated)
    assert "head.weight" in model.prunable_parameters()
    assert model.head_parameter_names() == {"head.weight", "head.bias"}
    for before_norm in (False, True):
        seen = {}
        hooks = [
            model.layer_module(n, before_norm=before_norm).register_forward_hook(
                lambda m, i, out, n=n: seen.__setitem__(n, out.shape[1])
            )
            for n in gated
        ]
        model(x)
        for h in hooks:
            h.remove()
        assert seen == gated


def test_gating_after_norm_removes_channel():
    torch.manual_seed(0)
    model = build_model("resnet10", {"widths": [8, 8, 8, 8]}, in_channels=3,
                        num_classes=5, image_size=32).eval()
    seen = {}

    def gate(module, inputs, out):
        return out * torch.tensor([0.0] + [1.0] * 7).view(1, -1, 1, 1)

    model.layer_module("layer1.conv1").register_forward_hook(gate)
    model.layer1.conv2.register_forward_hook(lambda m, i, o: seen.setdefault("in", i[0]))
    model(torch.randn(2, 3, 32, 32))
    assert (seen["in"][:, 0] == 0).all()


def test_default_configs():
    torch.manual_seed(0)
    cnn = build_model("simple_cnn", None, in_channels=3, num_classes=10, image_size=32)
    assert list(cnn.gated_layers().values()) == [64, 128, 256]
    assert cnn.feature_dim == 256 * 4 * 4

    for stem, sides in (("imagenet", (16, 8)), ("cifar", (32, 32))):
        resnet = build_model("resnet10", {"stem": stem}, in_channels=3, num_classes=10,
                             image_size=32)
        gated = resnet.gated_layers()
        assert [gated[f"layer{i}.conv2"] for i in range(1, 5)] == [64, 128, 192, 256]
        assert "layer1.downsample" not in gated and "layer2.downsample" in gated
        seen = {}
        for n in ("stem", "layer1.conv1"):
            resnet.layer_module(n).register_forward_hook(
                lambda m, i, out, n=n: seen.__setitem__(n, out.shape[-1])
            )
        resnet(torch.randn(2, 3, 32, 32))
        assert (seen["stem"], seen["layer1.conv1"]) == sides


def test_unknown_model_suggests_closest():
    with pytest.raises(ConfigError) as err:
        build_model("simple_cnm", None, in_channels=1, num_classes=10, image_size=28)
    assert "did you mean 'simple_cnn'" in str(err.value)
    assert all(name in str(err.value) for name in MODELS.names())


@pytest.mark.parametrize(
    ("cfg", "image_size", "match"),
    [
        ({"channels": []}, 28, "non-empty"),
        ({"channels": [4, 0]}, 28, "positive"),
        ({"channels": [4, 4, 4]}, 4, "too small"),
        ({"channels": "64"}, 28, "expected a list"),
    ],
)
def test_simple_cnn_bad_config(cfg, image_size, match):
    with pytest.raises(ConfigError, match=match):
        build_model("simple_cnn", cfg, in_channels=1, num_classes=10, image_size=image_size)


def test_resnet_bad_config():
    with pytest.raises(ConfigError, match="choose one of"):
        build_model("resnet10", {"stem": "tiny"}, in_channels=3, num_classes=10, image_size=32)
    with pytest.raises(ConfigError, match="positive"):
        build_model("resnet10", {"widths": [8, -1]}, in_channels=3, num_classes=10,
                    image_size=32)
