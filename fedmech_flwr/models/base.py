"""The interface every model shares, and the model registry.

Diagnostics (circuit gates, hooks, pruning) rely only on this interface and never branch
on model class (timm's idea): penultimate features, a linear head and named gate points.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fedmech_flwr.foundation.registry import Registry
from fedmech_flwr.foundation.typed import parse_dataclass

ModelFactory = Callable[..., "FedMechModel"]
"""``factory(cfg, *, in_channels, num_classes, image_size) -> FedMechModel``."""

MODELS: Registry[ModelFactory] = Registry("model")


@dataclass(frozen=True)
class ChannelGroup:
    """Channels that one permutation must move together (Git Re-Basin's permutation spec).

    Permuting axis 0 of every ``rows`` array and axis 1 of every ``columns`` array (in
    blocks) with one permutation leaves the model's function unchanged. Gated layers tied
    by a skip connection (their outputs are added) share one group.
    """

    name: str
    size: int
    rows: tuple[str, ...]
    """state_dict names whose axis 0 are these channels: the producing layers' weights and
    biases, their norm layers' parameters and running statistics."""
    columns: tuple[tuple[str, int], ...]
    """(state_dict name, block) of the weights whose axis 1 reads these channels, ``block``
    consecutive entries per channel (the positions a flatten puts behind a channel; 1 for
    a conv or a pooled head)."""
    activations: tuple[str, ...]
    """Modules whose outputs carry these channels (for matching on activations)."""


class FedMechModel(nn.Module):
    """Base class of all models (an ordinary ``nn.Module`` becomes one with ``wrap_module``).

    Subclasses set ``num_classes``, ``feature_dim``, the classifier ``self.head`` and
    ``self._gates`` (gate name -> (path of the conv/linear layer, path of the module whose
    output is the gated activation)), and implement ``forward_features``.
    """

    num_classes: int
    feature_dim: int
    head: nn.Linear
    _gates: dict[str, tuple[str, str]]

    def forward_features(self, x: Tensor) -> Tensor:
        """The penultimate features, what probes, head realignment, NCM and CCVR read: every
        model implements it (the head reads them).

        Parameters
        ----------
        x : torch.Tensor
            The inputs, ``[N, C, H, W]``.

        Returns
        -------
        torch.Tensor
            ``[N, feature_dim]``, after the last body layer (pooled).

        Examples
        --------
        >>> import torch
        >>> class Flat(FedMechModel):
        ...     def forward_features(self, x):
        ...         return torch.relu(self.fc1(x.flatten(1)))
        """
        raise NotImplementedError

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        """Logits, or with ``pre_logits`` the features fed to the classifier, unchanged."""
        return features if pre_logits else self.head(features)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Linear:
        return self.head

    def gated_layers(self) -> dict[str, int]:
        """Gate name -> output channels, for every conv/linear layer but the head, in
        forward order."""
        return {
            name: _out_channels(self.get_submodule(layer))
            for name, (layer, _) in self._gates.items()
        }

    def layer_module(self, name: str, before_norm: bool = False) -> nn.Module:
        """The module whose output is gate ``name``'s activation.

        That is after normalisation, so zeroing a channel really removes it; with
        ``before_norm`` it is the conv/linear layer itself (where the paper's code gated).
        """
        if name not in self._gates:
            raise KeyError(f"no gated layer '{name}'; gated layers: {', '.join(self._gates)}")
        layer, gate_point = self._gates[name]
        return self.get_submodule(layer if before_norm else gate_point)

    def pooled_gate_module(self, name: str) -> nn.Module | None:
        """A module after gate ``name``'s point that its channels reach through ReLU and
        pooling only, or None. Scaling a channel there by a gate in [0, 1] gives the same
        output as scaling it at the gate point (either position: such a model has no norm
        in between), on fewer elements: circuit discovery gates there."""
        return None

    def grouped_forward(self) -> Callable[..., Tensor] | None:
        """A faster forward for passes that edit channels per group of samples, or None.

        Called as ``forward(x, groups, at_conv=None, at_end=None)``: ``x`` holds ``groups``
        groups of equally many samples, one group after the other. ``at_conv[name] = (scale,
        shift)`` [groups, C] replaces gate ``name``'s output (either position) by ``output *
        scale + shift``; ``at_end[name] = scale`` [groups, C] scales it at
        ``pooled_gate_module(name)``. It returns the logits the model gives with those edits
        hooked in (to float rounding), for the weights the model had when it was built.
        Circuit discovery (STE gates) and the ablations use it where the model has one
        (SimpleCNN)."""
        return None

    def channel_arrays(self, name: str) -> tuple[str, ...]:
        """state_dict names whose axis 0 is gate ``name``'s output channels: its layer's
        weight and bias and, where a norm layer is the gate point, that layer's parameters
        and running statistics."""
        layer, point = self._gates[name]
        paths = [layer] if point == layer else [layer, point]
        return tuple(f"{path}.{key}" for path in paths
                     for key, value in self.get_submodule(path).state_dict().items() if value.ndim)

    def permutation_groups(self) -> list[ChannelGroup]:
        """The model's channel groups, every permutable channel in exactly one (what
        weight matching permutes). Models carry no pruning masks (pruned weights are
        zeros), so permuting the weights moves the sparsity pattern with them."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its channel groups (permutation_groups)")

    def prunable_parameters(self) -> dict[str, nn.Parameter]:
        """Weights (no biases, no norms) of all conv/linear layers, head included, keyed
        by their state_dict names."""
        return {
            f"{name}.weight": module.weight
            for name, module in self.named_modules()
            if isinstance(module, (nn.Conv2d, nn.Linear))
        }

    def head_parameter_names(self) -> set[str]:
        """state_dict names of the head's parameters (so pruning can leave them out)."""
        return {f"head.{name}" for name, _ in self.head.named_parameters()}


def _out_channels(module: nn.Module) -> int:
    if isinstance(module, nn.Conv2d):
        return module.out_channels
    if isinstance(module, nn.Linear):
        return module.out_features
    raise TypeError(f"gated layers must be Conv2d or Linear, got {type(module).__name__}")


def build_model(
    name: str, cfg: Any, *, in_channels: int, num_classes: int, image_size: int
) -> FedMechModel:
    """Build the registered model ``name``, as a run does: for a strategy that needs a model
    of the run's architecture, or a model plug-in's test.

    Parameters
    ----------
    name : str
        A name registered in ``MODELS``.
    cfg : dataclass, mapping or None
        Its config dataclass, or a mapping (None: the defaults) validated into it.
    in_channels, num_classes, image_size : int
        The data's shape.

    Returns
    -------
    FedMechModel

    Raises
    ------
    ConfigError
        For an unknown name or a config its dataclass refuses.

    Examples
    --------
    >>> model = build_model("simple_cnn", None, in_channels=1, num_classes=10, image_size=28)
    >>> model.num_classes
    10
    """
    entry = MODELS.get(name)
    if not isinstance(cfg, entry.config_cls):
        cfg = parse_dataclass(entry.config_cls, cfg, "model")
    return entry.factory(
        cfg, in_channels=in_channels, num_classes=num_classes, image_size=image_size
    )
