"""The paper's small CNN: conv3x3-ReLU-maxpool blocks and one linear head."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmech_flwr.foundation.errors import ConfigError
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

    def grouped_forward(self) -> GroupedForward | None:
        """``GroupedForward`` where pruning left static channels (else it only adds work)."""
        grouped = GroupedForward(self)
        return grouped if grouped.live_channels != self.gated_layers() else None

    def forward_features(self, x: Tensor) -> Tensor:
        for name in self._gates:
            x = self.pooled[name](F.max_pool2d(F.relu(getattr(self, name)(x)), 2))
        return x.flatten(1)


class GroupedForward:
    """SimpleCNN's forward with per-group channel edits (``FedMechModel.grouped_forward``),
    computing once per group what does not depend on the input.

    A channel whose filter reads no input-dependent channel (after 99.9% pruning, most
    channels: conv1 keeps a handful of weights) outputs the same map for every image; with
    per-group edits, the same map for every sample of a group. So does a channel that every
    group replaces (``at_conv`` scale 0) or closes (``at_end`` scale 0): a sufficiency
    ablation keeps only its circuit, and a discovery step only the channels some class
    still has open. Those "static" channels run on ``groups`` maps, the "live" ones on
    every sample; live channels add their filters' reading of static channels from their
    group's maps. Where a scale is 0 in every group, the gradient with respect to it is not
    the hooked model's; discovery's STE gates pass none through a closed gate anyway
    (``ste_gate(closed_gradient=False)``). On the paper's setting, a round's discovery
    takes about 8x and its ablations 4x less time than hooked (docs/explanation/benchmarks.md, "What the
    diagnostics cost").
    """

    def __init__(self, model: SimpleCNN) -> None:
        self.blocks = []
        self.live_channels = {}  # gate name -> channels that depend on the input, by the weights alone
        live = torch.ones(next(model.parameters()).shape[1], dtype=torch.bool, device=model.head.weight.device)
        for name in model._gates:
            conv = getattr(model, name)
            weight = conv.weight.detach()
            reads = (weight != 0).flatten(2).any(dim=2)  # [out, in]: the kernels pruning left
            self.blocks.append((name, weight, conv.bias.detach(), reads))
            live = reads[:, live].any(dim=1)
            self.live_channels[name] = int(live.sum())
        self.head_weight, self.head_bias = model.head.weight.detach(), model.head.bias.detach()
        self.side = model._side

    def __call__(
        self,
        x: Tensor,
        groups: int,
        at_conv: Mapping[str, tuple[Tensor, Tensor]] | None = None,
        at_end: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        at_conv, at_end = at_conv or {}, at_end or {}
        live = x  # the live channels, per sample
        static = x.new_zeros(groups, *x.shape[1:])  # every channel per group, 0 where live
        cols = torch.arange(x.shape[1], device=x.device)
        for name, weight, bias, reads in self.blocks:
            kept = reads[:, cols].any(dim=1)  # reads a live channel
            if name in at_conv:
                kept &= (at_conv[name][0] != 0).any(dim=0)  # and some group does not replace it
            if name in at_end:
                kept &= (at_end[name] != 0).any(dim=0)  # and some group has it open
            rows = kept.nonzero().flatten()
            per_group = F.conv2d(static, weight, bias, padding=1)
            if len(rows):
                own = F.conv2d(live, weight[rows][:, cols].contiguous(memory_format=torch.channels_last), padding=1)
            else:
                own = live.new_zeros(len(live), 0, *per_group.shape[2:])
            live = _each(per_group[:, rows], own, torch.add)
            if name in at_conv:
                scale, shift = at_conv[name]
                live = _each(_per_channel(scale[:, rows]), live, torch.mul)
                live = _each(_per_channel(shift[:, rows]), live, torch.add)
                per_group = per_group * _per_channel(scale) + _per_channel(shift)
            live, per_group = _block_end(live), _block_end(per_group)
            if name in at_end:
                live = _each(_per_channel(at_end[name][:, rows]), live, torch.mul)
                per_group = per_group * _per_channel(at_end[name])
            static = per_group.index_fill(1, rows, 0.0)
            cols = rows
        head_live = self.head_weight.view(len(self.head_weight), -1, self.side**2)[:, cols].flatten(1)
        logits = live.flatten(1) @ head_live.T
        return _each(F.linear(static.flatten(1), self.head_weight, self.head_bias), logits, torch.add)


def _each(per_group: Tensor, per_sample: Tensor, op: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``op(per_sample, per_group)`` with each group's value [groups, ...] broadcast over its
    samples (``per_sample`` [groups * n, ...], group-major)."""
    groups, samples = per_group.shape[0], per_sample.shape[0]
    out = op(per_sample.view(groups, samples // groups, *per_sample.shape[1:]), per_group.unsqueeze(1))
    return out.view(samples, *per_sample.shape[1:])


def _block_end(maps: Tensor) -> Tensor:
    """ReLU and 2x2 max-pool, also of maps with no channels (a block with no live channel)."""
    if maps.shape[1] == 0:
        return maps.new_zeros(*maps.shape[:2], maps.shape[2] // 2, maps.shape[3] // 2)
    return F.max_pool2d(F.relu(maps), 2)


def _per_channel(values: Tensor) -> Tensor:
    """Values [N, C] shaped to broadcast over maps [N, C, H, W]."""
    return values[:, :, None, None]


@MODELS.register("simple_cnn", SimpleCNNConfig)
def simple_cnn(
    cfg: SimpleCNNConfig, *, in_channels: int, num_classes: int, image_size: int
) -> SimpleCNN:
    return SimpleCNN(
        cfg.channels, in_channels=in_channels, num_classes=num_classes, image_size=image_size
    )
