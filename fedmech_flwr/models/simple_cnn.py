"""The paper's small CNN: conv3x3-ReLU-maxpool blocks and one linear head."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor, nn

from fedmech_flwr.errors import ConfigError
from fedmech_flwr.models.base import MODELS, ChannelGroup, FedMechModel


@dataclass
class SimpleCNNConfig:
    channels: list[int] = field(default_factory=lambda: [64, 128, 256])
    """Output channels of each conv block; the paper's later variant (its earlier one is
    [32, 64, 128])."""


class SimpleCNN(FedMechModel):
    """Per block: conv3x3 (padding 1) + ReLU + 2x2 max-pool; then flatten and a linear head.

    Gates sit at the conv outputs (before ReLU); there is no normalisation. Each block ends
    in an identity module (``pooled.<gate>``), where a gate acts as at the conv output.
    """

    def __init__(
        self, channels: list[int], *, in_channels: int, num_classes: int, image_size: int
    ) -> None:
        super().__init__()
        if not channels or min(channels) <= 0:
            raise ConfigError(
                f"channels must be a non-empty list of positive integers, got {channels}",
                "model.channels",
            )
        side = image_size // 2 ** len(channels)
        if side == 0:
            raise ConfigError(
                f"image_size {image_size} is too small for {len(channels)} conv blocks "
                f"(each max-pool halves it); use at most {image_size.bit_length() - 1} "
                "channels entries or larger images",
                "model.channels",
            )
        self._gates = {}
        self.pooled = nn.ModuleDict()
        previous = in_channels
        for i, width in enumerate(channels):
            name = f"conv{i + 1}"
            self.add_module(name, nn.Conv2d(previous, width, 3, padding=1))
            self._gates[name] = (name, name)
            self.pooled[name] = nn.Identity()
            previous = width
        self.num_classes = num_classes
        self.feature_dim = channels[-1] * side * side
        self.head = nn.Linear(self.feature_dim, num_classes)
        self._side = side

    def permutation_groups(self) -> list[ChannelGroup]:
        """One group per conv: its filters, read by the next conv, or by the head in
        blocks of side x side flattened positions."""
        names = list(self._gates)
        groups = []
        for i, name in enumerate(names):
            reader = (f"{names[i + 1]}.weight", 1) if i + 1 < len(names) else ("head.weight", self._side**2)
            groups.append(ChannelGroup(name, getattr(self, name).out_channels, self.channel_arrays(name), (reader,), (name,)))
        return groups

    def pooled_gate_module(self, name: str) -> nn.Module:
        """The block's end: ReLU and max-pool commute with a per-channel gate g >= 0."""
        return self.pooled[name]

    def forward_features(self, x: Tensor) -> Tensor:
        for name in self._gates:
            x = self.pooled[name](F.max_pool2d(F.relu(getattr(self, name)(x)), 2))
        return x.flatten(1)


@MODELS.register("simple_cnn", SimpleCNNConfig)
def simple_cnn(
    cfg: SimpleCNNConfig, *, in_channels: int, num_classes: int, image_size: int
) -> SimpleCNN:
    return SimpleCNN(
        cfg.channels, in_channels=in_channels, num_classes=num_classes, image_size=image_size
    )
