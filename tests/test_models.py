"""Every registered model honours the FedMechModel contract diagnostics rely on
(``check_model``), and the models' own rules: defaults, bad configs, ``wrap_module``."""

from __future__ import annotations

import copy
import importlib.util
import inspect
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmech_flwr.contracts.conformance import check_model
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.models import MODELS, WrappedModel, build_model, wrap_module


@dataclass
class UserMLPConfig:
    hidden: list[int] = field(default_factory=lambda: [16, 8])


@MODELS.register("user_mlp", UserMLPConfig)
def user_mlp(cfg: UserMLPConfig, *, in_channels: int, num_classes: int, image_size: int) -> WrappedModel:
    """A user's MLP, registered as a plug-in would: flatten, Linear + BatchNorm1d + ReLU,
    then Linear + ReLU per further hidden layer, a linear head."""
    widths = [in_channels * image_size**2, *cfg.hidden]
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b), *([nn.BatchNorm1d(b)] if i == 0 else []), nn.ReLU()]
    module = nn.Sequential(*layers, nn.Linear(widths[-1], num_classes))
    return wrap_module(module, input_shape=(in_channels, image_size, image_size))


SMALL_CONFIGS = {
    "simple_cnn": [{"channels": [4, 8, 8]}],
    "resnet10": [
        {"widths": [8, 8, 8, 8], "stem": "imagenet"},
        {"widths": [8, 8, 8, 8], "stem": "cifar"},
    ],
    "torchvision": [{"arch": "resnet18", "head": "fc"}],
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
    check_model(name, cfg, in_channels=in_channels, image_size=image_size)


@pytest.mark.parametrize("name", MODELS.names())
def test_only_a_wrapped_model_that_is_no_chain_lacks_channel_groups(name):
    """``check_model`` checks the groups where a model has them; every model has them but a
    wrapped module whose layers are no chain (torchvision's ResNet), which says why."""
    model = build_model(name, SMALL_CONFIGS.get(name, [{}])[0], in_channels=3, num_classes=5, image_size=32)
    try:
        model.permutation_groups()
    except NotImplementedError as err:
        assert isinstance(model, WrappedModel) and "only for a chain of layers, which this is not" in str(err)


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


# --- any nn.Module: wrap_module ----------------------------------------------------------

class HandBuilt(nn.Module):
    """Gate points by the rule: conv1 -> bn1, conv2 (no norm) -> itself, fc1 -> ln; the
    shared conv (called twice) and the unused linear get none; the last Linear is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.shared = nn.Conv2d(6, 6, 1)
        self.fc1, self.ln = nn.Linear(6, 8), nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 3)
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.act(self.conv2(self.act(self.bn1(self.conv1(x)))))
        x = F.adaptive_avg_pool2d(self.shared(self.shared(x)), 1).flatten(1)
        return self.fc(self.act(self.ln(self.fc1(x))))


def gate_paths(model) -> dict[str, tuple[str, str]]:
    """Gate name -> (path of its layer, path of its gate point)."""
    path = {id(m): p for p, m in model.named_modules()}
    return {n: (path[id(model.layer_module(n, before_norm=True))], path[id(model.layer_module(n))])
            for n in model.gated_layers()}


def test_wrapping_finds_the_gates_by_the_norm_rule_and_keeps_the_function():
    module = HandBuilt().eval()
    original, head = copy.deepcopy(module), module.fc
    model = wrap_module(module, input_shape=(1, 8, 8), head="fc")
    assert gate_paths(model) == {"conv1": ("body.conv1", "body.bn1"), "conv2": ("body.conv2", "body.conv2"),
                                 "fc1": ("body.fc1", "body.ln")}
    assert model.gated_layers() == {"conv1": 4, "conv2": 6, "fc1": 8}
    assert model.get_classifier() is head and model.feature_dim == 8
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(model.eval()(x), original(x))
    nested = nn.Sequential(nn.Sequential(nn.Conv2d(1, 4, 3)), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 3))
    assert gate_paths(wrap_module(nested, input_shape=(1, 8, 8))) == {"0.0": ("body.0.0", "body.1")}
    assert model.channel_arrays("conv1") == ("body.conv1.weight", "body.conv1.bias", "body.bn1.weight",
                                             "body.bn1.bias", "body.bn1.running_mean", "body.bn1.running_var")


def test_the_head_is_the_last_linear_unless_named():
    model = build_model("user_mlp", {"hidden": [6, 5]}, in_channels=1, num_classes=3, image_size=4)
    assert list(model.gated_layers()) == ["1", "4"] and model.feature_dim == 5
    assert gate_paths(model)["1"] == ("body.1", "body.2") and isinstance(model.body[6], nn.Identity)
    with pytest.raises(ConfigError, match="'spare' must be called exactly once per forward pass, was called 0 times "
                                          r"\('spare' is the last nn.Linear in module order; name the head\)"):
        wrap_module(HandBuilt(), input_shape=(1, 8, 8))  # the last Linear in module order is unused


def test_a_closed_gate_removes_its_channel():
    torch.manual_seed(0)
    model = wrap_module(HandBuilt(), input_shape=(1, 8, 8), head="fc").eval()
    x = torch.randn(4, 1, 8, 8)
    open_features = model.forward_features(x)
    k = int(open_features.sum(0).argmax())  # a channel the ReLU lets through
    kept = torch.ones(8).index_fill(0, torch.tensor([k]), 0.0)
    model.layer_module("fc1").register_forward_hook(lambda m, i, out: out * kept)
    features = model.forward_features(x)
    assert (features[:, k] == 0).all() and (open_features[:, k] > 0).any()
    assert torch.equal(features * kept, open_features * kept)  # the head reads the zero, nothing else moves
    assert torch.allclose(model(x), model.head(features))


@pytest.mark.parametrize(("head", "match"), [
    ("fc2", "no submodule 'fc2'; did you mean 'fc'"),
    ("bn1", "'bn1' is a BatchNorm2d, not an nn.Linear; its linear layers: fc1, fc, spare"),
    ("fc1", "the head 'fc1' must give the model's output"),
])
def test_a_bad_head_names_the_code_that_named_it(head, match):
    """Named in a user's call of wrap_module: the error names that file and line, not a
    ``model.head`` key that no experiment holds."""
    with pytest.raises(ConfigError, match=match) as err:
        wrap_module(HandBuilt(), input_shape=(1, 8, 8), head=head)
    line = inspect.currentframe().f_lineno - 1
    assert err.value.message.startswith(f"wrap_module(head={head!r}) at {__name__} ({__file__}:{line}): ")
    assert err.value.where == "model"


def test_a_bad_head_of_a_registered_module_names_the_registration(tmp_path):
    """A plug-in's ``wrap_module(..., head=...)`` in its registered builder: its file and
    line; the torchvision model's ``head`` is a key of the experiment: ``model.head``."""
    source = tmp_path / "lab_models.py"
    source.write_text("from torch import nn\n\nfrom fedmech_flwr.api.model import MODELS, wrap_module\n\n\n"
                      "@MODELS.register('lab_bad_head')\n"
                      "def lab_bad_head(cfg, *, in_channels, num_classes, image_size):\n"
                      "    module = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, num_classes))\n"
                      "    return wrap_module(module, input_shape=(in_channels, image_size, image_size), head='fcc')\n")
    spec = importlib.util.spec_from_file_location("lab_models", source)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    try:
        with pytest.raises(ConfigError) as err:
            build_model("lab_bad_head", {}, in_channels=1, num_classes=3, image_size=4)
    finally:
        MODELS._entries.pop("lab_bad_head")
    assert err.value.message.startswith(f"wrap_module(head='fcc') at lab_models ({source}:9): "
                                        "the module has no submodule 'fcc'"), err.value.message
    assert err.value.where == "model"
    with pytest.raises(ConfigError, match="no submodule 'fcc'; did you mean 'fc'") as err:
        build_model("torchvision", {"arch": "resnet18", "head": "fcc"}, in_channels=1, num_classes=10, image_size=28)
    assert err.value.where == "model.head"


def test_torchvision_models_are_checked_and_adapted_to_the_images():
    with pytest.raises(ConfigError, match="unknown torchvision architecture 'resnet81'; did you mean 'resnet18'") as e:
        build_model("torchvision", {"arch": "resnet81"}, in_channels=1, num_classes=10, image_size=28)
    assert e.value.where == "model.arch"
    with pytest.raises(ConfigError, match="missing required key 'arch'"):
        build_model("torchvision", {}, in_channels=1, num_classes=10, image_size=28)
    with pytest.raises(ConfigError, match="cannot run on inputs of shape"):
        build_model("torchvision", {"arch": "vit_b_16"}, in_channels=3, num_classes=10, image_size=32)
    model = build_model("torchvision", {"arch": "resnet18"}, in_channels=1, num_classes=10, image_size=28)
    assert model.state_dict()["body.conv1.weight"].shape == (64, 1, 7, 7) and model.num_classes == 10
    assert list(model.gated_layers())[:3] == ["conv1", "layer1.0.conv1", "layer1.0.conv2"]
    assert gate_paths(model)["layer2.0.downsample.0"] == ("body.layer2.0.downsample.0", "body.layer2.0.downsample.1")


def test_a_registered_module_comes_from_the_module_that_registered_it():
    """``fedmech list`` names the user's module, not the wrapper's, as ``user_mlp``'s origin."""
    assert MODELS.get("user_mlp").module == __name__
    assert MODELS.get("torchvision").module == "fedmech_flwr.models.torchvision_models"
