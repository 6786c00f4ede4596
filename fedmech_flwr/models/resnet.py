"""The paper's ResNet10: a stem and one BasicBlock per stage, then avg-pool and a linear head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.models.base import MODELS, ChannelGroup, FedMechModel


@dataclass
class ResNet10Config:
    widths: list[int] = field(default_factory=lambda: [64, 128, 192, 256])
    """Channels of each stage (one BasicBlock each); the stem has widths[0] channels."""
    stem: Literal["imagenet", "cifar"] = "imagenet"
    """"imagenet" (the paper's): 7x7/2 conv + BN + ReLU + 3x3/2 max-pool, a quarter of the
    input resolution; "cifar": 3x3/1 conv + BN + ReLU, full resolution."""


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut (1x1 conv + BN when the shape
    changes), then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet10(FedMechModel):
    """Gates sit after each conv's BatchNorm (a distinct module per conv). In a block the
    bn2 output is gated before it is added to the shortcut."""

    def __init__(
        self,
        widths: list[int],
        stem: Literal["imagenet", "cifar"],
        *,
        in_channels: int,
        num_classes: int,
    ) -> None:
        super().__init__()
        if not widths or min(widths) <= 0:
            raise ConfigError(
                f"widths must be a non-empty list of positive integers, got {widths}",
                "model.widths",
            )
        if stem == "imagenet":
            self.stem_conv = nn.Conv2d(in_channels, widths[0], 7, 2, 3, bias=False)
            self.stem_pool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:
            self.stem_conv = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
            self.stem_pool = nn.Identity()
        self.stem_bn = nn.BatchNorm2d(widths[0])
        self._gates = {"stem": ("stem_conv", "stem_bn")}
        self.stages = []
        previous = widths[0]
        for i, width in enumerate(widths):
            name = f"layer{i + 1}"
            block = BasicBlock(previous, width, stride=1 if i == 0 else 2)
            self.add_module(name, block)
            self.stages.append(name)
            self._gates[f"{name}.conv1"] = (f"{name}.conv1", f"{name}.bn1")
            self._gates[f"{name}.conv2"] = (f"{name}.conv2", f"{name}.bn2")
            if block.downsample is not None:
                shortcut = f"{name}.downsample"
                self._gates[shortcut] = (f"{shortcut}.0", f"{shortcut}.1")
            previous = width
        self.num_classes = num_classes
        self.feature_dim = previous
        self.head = nn.Linear(previous, num_classes)
        for module in self.modules():  # torchvision's ResNet initialisation
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def permutation_groups(self) -> list[ChannelGroup]:
        """Per block, conv1's channels (read by conv2); and the residual stream: the stem
        and the conv2 of every block without a shortcut conv are added to one another, so
        they share a group; a block with a shortcut conv starts a new stream (its conv2
        and shortcut outputs are added). A stream is read by the next block's conv1 and
        shortcut conv, the last one by the head (after pooling)."""
        groups = []
        gates, readers = ["stem"], []
        for name in self.stages:
            readers.append((f"{name}.conv1.weight", 1))
            if getattr(self, name).downsample is None:
                gates.append(f"{name}.conv2")
            else:
                readers.append((f"{name}.downsample.0.weight", 1))
                groups.append(self._group(gates, readers))
                gates, readers = [f"{name}.conv2", f"{name}.downsample"], []
            groups.append(self._group([f"{name}.conv1"], [(f"{name}.conv2.weight", 1)]))
        groups.append(self._group(gates, [*readers, ("head.weight", 1)]))
        return groups

    def _group(self, gates: list[str], readers: list[tuple[str, int]]) -> ChannelGroup:
        """The group of ``gates``' output channels; its activations are their BatchNorm
        outputs (before the addition and the ReLU, where no channel is dead)."""
        rows = tuple(key for gate in gates for key in self.channel_arrays(gate))
        points = tuple(self._gates[gate][1] for gate in gates)
        return ChannelGroup("+".join(gates), self.gated_layers()[gates[0]], rows, tuple(readers), points)

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.stem_pool(F.relu(self.stem_bn(self.stem_conv(x))))
        for name in self.stages:
            x = getattr(self, name)(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)


@MODELS.register("resnet10", ResNet10Config)
def resnet10(
    cfg: ResNet10Config, *, in_channels: int, num_classes: int, image_size: int
) -> ResNet10:
    """``image_size`` is not needed: adaptive pooling takes any resolution."""
    return ResNet10(cfg.widths, cfg.stem, in_channels=in_channels, num_classes=num_classes)
