"""torchvision's classification architectures as models: ``model: {name: torchvision, arch: resnet18}``."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.registry import did_you_mean
from fedmech_flwr.models.base import MODELS
from fedmech_flwr.models.wrapped import WrappedModel, wrap_module


def architectures() -> list[str]:
    """The classification architectures of ``torchvision.models``, sorted."""
    import torchvision  # imported when a torchvision model is asked for, not with every model

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _parse_arch(value: object, where: str) -> str:
    known = architectures()
    if value not in known:
        raise ConfigError(f"unknown torchvision architecture {value!r}; {did_you_mean(str(value), known)}"
                          f"torchvision's classification architectures: {', '.join(known)}", where)
    return str(value)


@dataclass
class TorchvisionConfig:
    arch: str = field(metadata={"parse": _parse_arch})
    """A classification architecture of ``torchvision.models``, e.g. ``resnet18``, ``vgg11_bn``,
    ``mobilenet_v3_small``."""
    head: str | None = None
    """Dotted module path of its linear head (ResNet: ``fc``); null: its last nn.Linear."""


@MODELS.register("torchvision", TorchvisionConfig)
def torchvision_model(cfg: TorchvisionConfig, *, in_channels: int, num_classes: int, image_size: int) -> WrappedModel:
    """torchvision's ``arch`` with random weights (``weights=None``: nothing is downloaded)
    and ``num_classes`` outputs, wrapped by ``wrap_module``. For images with other than 3
    channels its first Conv2d reads ``in_channels`` instead, its filters adapted as timm's
    ``adapt_input_conv`` does (summed over RGB for 1 channel, else repeated and scaled by
    3 / in_channels), so the architecture's own initialisation is kept. Architectures
    that need larger images than the dataset's (ViT's 224) are refused."""
    import torchvision

    module = torchvision.models.get_model(cfg.arch, weights=None, num_classes=num_classes)
    if in_channels != 3:
        _adapt_input_conv(module, in_channels)
    return wrap_module(module, input_shape=(in_channels, image_size, image_size), head=cfg.head)


def _adapt_input_conv(module: nn.Module, in_channels: int) -> None:
    conv = next((m for m in module.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None or conv.groups != 1:
        raise ConfigError(f"cannot adapt this architecture to {in_channels}-channel images: its first layer "
                          "is not a plain Conv2d", "model.arch")
    weight = conv.weight.detach()
    if in_channels == 1:
        weight = weight.sum(1, keepdim=True)
    else:
        repeats = -(-in_channels // weight.shape[1])
        weight = weight.repeat(1, repeats, 1, 1)[:, :in_channels] * (weight.shape[1] / in_channels)
    conv.weight = nn.Parameter(weight.contiguous())
    conv.in_channels = in_channels
