"""Any ``nn.Module`` as a FedMechModel: its head and gate points found by one traced forward pass.

``wrap_module(module, input_shape=..., head=...)`` adapts an ordinary classifier (a
torchvision ResNet, a user's MLP) to the interface diagnostics rely on:

- **head**: the ``nn.Linear`` named by its dotted module path (``fc``), else the last
  ``nn.Linear`` in module order. The model's output must be that layer's output, and its
  input ``[N, features]``: it is moved out to ``head`` and replaced by ``nn.Identity`` in
  the module, so the module returns the features (``forward_features``).
- **gates**: every ``Conv2d`` (output ``[N, C, H, W]``) and ``Linear`` (output ``[N, C]``)
  but the head that the forward pass calls exactly once; its gate point is the norm layer
  (BatchNorm, GroupNorm, LayerNorm over its C channels) called next on its output, else
  the layer itself (the built-in models' "gating after norm" rule). Layers the pass does
  not call as modules (attention's ``out_proj``), calls twice (shared weights) or applies
  to token sequences (``[N, T, C]``) are not gated.
- **channel groups** (``permutation_groups()``, for ``matched_avg``): only where they can
  be read off exactly, a chain (``torch.fx``'s graph of the model is one path) of gated
  layers, BatchNorm/LayerNorm over their channels and channel-wise steps (activations,
  pooling, dropout, a flatten from dim 1): one group per gated layer, read by the next
  layer (in blocks after a flatten). Anything else (a skip connection adds channels, a
  concatenation or reshape moves them, GroupNorm mixes them) raises NotImplementedError
  saying where, rather than a guess that would silently change the function.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from fedmech_flwr.foundation.errors import ConfigError, raised_where
from fedmech_flwr.foundation.registry import did_you_mean
from fedmech_flwr.models.base import MODELS, ChannelGroup, FedMechModel

NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)
"""Norm layers that can be a gate point (the channels they normalise are the layer's)."""

CHANNELWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Identity,
    nn.Dropout, nn.Dropout2d, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
)
"""Modules that act on each channel apart, so a chain may pass through them."""
CHANNELWISE_FUNCTIONS = (F.relu, torch.relu, F.gelu, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d)
CHANNELWISE_METHODS = ("relu",)

ModuleBuilder = Callable[..., nn.Module]
"""``builder(cfg, *, in_channels, num_classes, image_size) -> nn.Module``."""


@dataclass(eq=False)
class _Call:
    """A module's calls in the traced forward pass: its first call's inputs and output."""

    path: str
    inputs: tuple[Any, ...]
    output: Any
    calls: list[int] = field(default_factory=list)


class WrappedModel(FedMechModel):
    """An ordinary module behind the FedMechModel interface (see the module docstring).

    ``body`` is the module with its head replaced by ``nn.Identity``; ``head`` is the head.
    Gate names are the layers' module paths in the original module (``layer1.0.conv1``);
    state_dict names are ``body.<path>`` and ``head.weight``, ``head.bias``.
    """

    def __init__(self, module: nn.Module, *, input_shape: tuple[int, ...], head: str | None = None,
                 named_by: str | None = None) -> None:
        super().__init__()
        try:
            path = head if head is not None else _last_linear(module)
            layer = _find_head(module, path)
            order, calls = _trace(module, input_shape)
            try:
                _check_head(path, layer, calls)
            except ConfigError as err:
                if head is not None:
                    raise
                raise ConfigError(f"{err.message} ('{path}' is the last nn.Linear in module order; name the head)",
                                  err.where) from err
        except ConfigError as err:
            if named_by is None or err.where != "model.head":
                raise
            raise ConfigError(f"{named_by}: {err.message}", "model") from err
        gates = _gate_points(module, path, order, calls)
        if not gates:
            raise ConfigError(
                "the module has no layer to gate besides its head (a Conv2d or Linear called once, "
                "with output [N, C, H, W] or [N, C]); circuits, probes and pruning need at least one",
                "model",
            )
        _replace(module, path, nn.Identity())
        self.body = module
        self.head = layer
        self.num_classes = layer.out_features
        self.feature_dim = layer.in_features
        self._gates = {name: (f"body.{name}", f"body.{point}") for name, point in gates.items()}

    def forward_features(self, x: Tensor) -> Tensor:
        return self.body(x)

    def permutation_groups(self) -> list[ChannelGroup]:
        """One group per gated layer when the model is a chain (see the module docstring):
        the layer's channel arrays and those of the norm layers after it, read by the next
        layer's weight, in blocks of in_features / channels after a flatten."""
        try:
            graph = fx.symbolic_trace(self).graph
        except Exception as err:
            raise _unsupported(f"torch.fx cannot trace its forward() ({type(err).__name__}: {err})") from err
        modules = dict(self.named_modules())
        groups: list[ChannelGroup] = []
        open_group: ChannelGroup | None = None
        previous = None
        for node in graph.nodes:
            if node.op in ("placeholder", "output"):
                previous = node
                continue
            if node.all_input_nodes != [previous]:
                inputs = ", ".join(repr(_label(n)) for n in node.all_input_nodes)
                raise _unsupported(f"'{_label(node)}' reads {inputs}: its forward() is not one chain of layers "
                                   "(a skip connection or a branch ties channels together)")
            previous = node
            module = modules.get(node.target) if node.op == "call_module" else None
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                if open_group is not None:
                    groups.append(_read_by(open_group, node.target, module))
                open_group = None if module is self.head else self._open_group(node.target)
            elif isinstance(module, NORMS):
                if open_group is not None:  # before the first layer a norm normalises the input: no group
                    open_group = _with_norm(open_group, node.target, module)
            elif not _channelwise(node, module):
                kind = type(module).__name__ if module is not None else getattr(node.target, "__name__", node.target)
                raise _unsupported(f"'{_label(node)}' ({kind}) is not known to keep channels apart")
        return groups

    def _open_group(self, path: str) -> ChannelGroup:
        """The group of the gated layer at ``path``, not yet read by any layer."""
        name = path.removeprefix("body.")
        if name not in self._gates:
            raise _unsupported(f"layer '{name}' is not gated (not called exactly once on [N, C, ...])")
        return ChannelGroup(name, self.gated_layers()[name], self.channel_arrays(name), (), (self._gates[name][1],))


def wrap_module(module: nn.Module, *, input_shape: tuple[int, ...], head: str | None = None,
                named_by: str | None = None) -> WrappedModel:
    """Put an ordinary classifier behind the ``FedMechModel`` interface the diagnostics rely
    on (its head and gated layers found by one forward pass; see this module's docstring).
    The module is taken over: its head is moved out of it.

    Parameters
    ----------
    module : torch.nn.Module
        A classifier whose output is its linear head's.
    input_shape : tuple of int
        One input's shape, e.g. ``(1, 28, 28)``.
    head : str, optional
        The dotted path of its linear head (``"fc"``); None: its last ``nn.Linear``.
    named_by : str, optional
        Where the head was named, for the error message (default: the calling code).

    Returns
    -------
    WrappedModel
        A ``FedMechModel``.

    Raises
    ------
    ConfigError
        When ``head`` is not the module's linear head (naming where it was named), or the
        module has no layer to gate.

    Examples
    --------
    >>> from torch import nn
    >>> mlp = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> model = wrap_module(mlp, input_shape=(1, 4, 4))
    >>> model.num_classes, model.feature_dim
    (3, 8)
    """
    if named_by is None and (caller := _code_at(sys._getframe(1))):
        named_by = f"wrap_module(head={head!r}) at {caller}"
    return WrappedModel(module, input_shape=input_shape, head=head, named_by=named_by)


def _code_at(frame: FrameType) -> str | None:
    """``module (file:line)`` of ``frame`` when it is neither fedmech's core nor a library's
    (``fedmech_flwr.foundation.errors.raised_where``): a plug-in's or the user's own code."""
    return raised_where([(frame.f_code.co_filename, frame.f_lineno)])


def register_module(
    name: str, config_cls: type | None = None, *, head: str | None = None, check: Callable[..., None] | None = None
) -> Callable[[ModuleBuilder], ModuleBuilder]:
    """Deprecated (goes in the next release; reached only as ``fedmech_flwr.api.register_module``,
    which warns): ``MODELS.register(name, config_cls)`` on a builder that returns
    ``wrap_module(...)`` does the same. Decorator: register ``builder(cfg, *, in_channels,
    num_classes, image_size) -> nn.Module`` as model ``name`` (``model: {name: ...}`` in an experiment), each module
    it builds wrapped by ``wrap_module`` with ``head``. ``config_cls`` and ``check`` as in
    ``Registry.register``; the entry's module is the caller's. A ``head`` that is not the
    module's linear head is an error naming this registration's file and line."""
    frame = sys._getframe(1)
    caller = frame.f_globals.get("__name__", "?")
    at = _code_at(frame) or f"{caller} ({frame.f_code.co_filename}:{frame.f_lineno})"
    named_by = f"model '{name}' registered with head={head!r} at {at}"

    def decorator(builder: ModuleBuilder) -> ModuleBuilder:
        @functools.wraps(builder)
        def factory(cfg: Any, *, in_channels: int, num_classes: int, image_size: int) -> WrappedModel:
            module = builder(cfg, in_channels=in_channels, num_classes=num_classes, image_size=image_size)
            return wrap_module(module, input_shape=(in_channels, image_size, image_size), head=head, named_by=named_by)

        MODELS.register(name, config_cls, check=check, module=caller)(factory)
        return builder

    return decorator


def _unsupported(why: str) -> NotImplementedError:
    return NotImplementedError(f"a wrapped module gives channel groups (permutation_groups) only for a chain of "
                               f"layers, which this is not: {why}; subclass FedMechModel and implement "
                               "permutation_groups() to use it")


def _label(node: fx.Node) -> str:
    """A module's path, else fx's name of the step (``add``, ``cat``)."""
    return node.target if node.op == "call_module" else node.name


def _read_by(group: ChannelGroup, path: str, layer: nn.Module) -> ChannelGroup:
    """``group`` read by ``layer``'s weight: a conv's input channels, or a linear layer's
    inputs in blocks (a flatten puts each channel's positions side by side)."""
    if isinstance(layer, nn.Conv2d):
        if layer.groups != 1:
            raise _unsupported(f"'{path}' is a grouped convolution")
        block = 1
    elif layer.in_features % group.size:
        raise _unsupported(f"'{path}' reads {layer.in_features} inputs, not a multiple of {group.size} channels")
    else:
        block = layer.in_features // group.size
    return ChannelGroup(group.name, group.size, group.rows, ((f"{path}.weight", block),), group.activations)


def _with_norm(group: ChannelGroup, path: str, norm: nn.Module) -> ChannelGroup:
    """``group`` with the arrays of the BatchNorm or LayerNorm at ``path`` over its channels."""
    size = norm.normalized_shape[0] if isinstance(norm, nn.LayerNorm) else getattr(norm, "num_features", None)
    if size != group.size:
        raise _unsupported(f"'{path}' ({type(norm).__name__}) does not normalise each of {group.size} channels apart")
    rows = [f"{path}.{key}" for key, value in norm.state_dict().items() if value.ndim]
    return ChannelGroup(group.name, group.size, tuple(dict.fromkeys([*group.rows, *rows])), (), group.activations)


def _channelwise(node: fx.Node, module: nn.Module | None) -> bool:
    """``node`` acts on each channel apart: an activation, pooling, dropout, a flatten from dim 1."""
    if isinstance(module, nn.Flatten):
        return module.start_dim == 1
    if module is not None:
        return isinstance(module, CHANNELWISE_MODULES)
    flatten = (node.op == "call_function" and node.target is torch.flatten) or (
        node.op == "call_method" and node.target == "flatten")
    if flatten:
        return node.args[1:2] == (1,) or node.kwargs.get("start_dim") == 1
    return (node.op == "call_function" and node.target in CHANNELWISE_FUNCTIONS) or (
        node.op == "call_method" and node.target in CHANNELWISE_METHODS)


def _last_linear(module: nn.Module) -> str:
    linears = [path for path, m in module.named_modules() if isinstance(m, nn.Linear) and path]
    if not linears:
        raise ConfigError("the module has no nn.Linear submodule to be its head; name one", "model.head")
    return linears[-1]


def _find_head(module: nn.Module, path: str) -> nn.Linear:
    """The ``nn.Linear`` at ``path``; anything else is an error suggesting a close name."""
    modules = dict(module.named_modules())
    linears = [p for p, m in modules.items() if isinstance(m, nn.Linear) and p]
    if path not in modules or not path:
        raise ConfigError(f"the module has no submodule '{path}'; {did_you_mean(path, modules)}"
                          f"its linear layers: {', '.join(linears) or '(none)'}", "model.head")
    if not isinstance(modules[path], nn.Linear):
        raise ConfigError(f"'{path}' is a {type(modules[path]).__name__}, not an nn.Linear; "
                          f"{did_you_mean(path, linears)}its linear layers: {', '.join(linears) or '(none)'}",
                          "model.head")
    return modules[path]


def _trace(module: nn.Module, input_shape: tuple[int, ...]) -> tuple[list[_Call], dict[str, _Call]]:
    """Every call of a leaf module (one without submodules) in one forward pass of zeros
    (eval mode, no gradient), in call order, and per module path its first call with the
    indices of all its calls; ``""`` holds the model's output."""
    order: list[_Call] = []
    calls: dict[str, _Call] = {}

    def record(path: str) -> Callable[..., None]:
        def hook(_module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            call = calls.setdefault(path, _Call(path, inputs, output))
            call.calls.append(len(order))
            order.append(call)
        return hook

    handles = [m.register_forward_hook(record(path)) for path, m in module.named_modules()
               if path and next(m.children(), None) is None]
    was_training = module.training
    parameter = next(module.parameters(), None)
    x = torch.zeros(2, *input_shape, device=parameter.device if parameter is not None else "cpu")
    try:
        with torch.no_grad():
            module.eval()
            calls[""] = _Call("", (), module(x))
    except Exception as err:
        raise ConfigError(f"the module cannot run on inputs of shape {list(input_shape)}: "
                          f"{type(err).__name__}: {err}", "model") from err
    finally:
        module.train(was_training)
        for handle in handles:
            handle.remove()
    return order, calls


def _check_head(path: str, layer: nn.Linear, calls: dict[str, _Call]) -> None:
    """The head must be called once on ``[N, features]`` and give the model's output."""
    call = calls.get(path)
    if call is None or len(call.calls) != 1:
        raise ConfigError(f"the head '{path}' must be called exactly once per forward pass, "
                          f"was called {0 if call is None else len(call.calls)} times", "model.head")
    if call.output is not calls[""].output:
        raise ConfigError(f"the head '{path}' must give the model's output, but the forward pass changes "
                          "its output afterwards (the model returns another tensor)", "model.head")
    if call.inputs[0].ndim != 2:
        raise ConfigError(f"the head '{path}' must read features [N, {layer.in_features}], "
                          f"got {list(call.inputs[0].shape)}", "model.head")


def _gate_points(module: nn.Module, head: str, order: list[_Call], calls: dict[str, _Call]) -> dict[str, str]:
    """Gate name (the layer's path) -> the path of its gate point, in call order."""
    modules = dict(module.named_modules())
    gates = {}
    for call in dict.fromkeys(order):  # each module once, at its first call
        layer = modules[call.path]
        if call.path == head or not isinstance(layer, (nn.Conv2d, nn.Linear)) or len(call.calls) != 1:
            continue
        if call.output.ndim != (4 if isinstance(layer, nn.Conv2d) else 2):
            continue
        after = order[call.calls[0] + 1] if call.calls[0] + 1 < len(order) else None
        norm = after is not None and _normalises(modules[after.path], call, after)
        gates[call.path] = after.path if norm else call.path
    return gates


def _normalises(norm: nn.Module, layer: _Call, after: _Call) -> bool:
    """``after`` is a norm layer called once, on ``layer``'s output, over its channels."""
    if not isinstance(norm, NORMS) or len(after.calls) != 1 or after.inputs[0] is not layer.output:
        return False
    channels = layer.output.shape[1]
    if isinstance(norm, nn.LayerNorm):
        return layer.output.ndim == 2 and tuple(norm.normalized_shape) == (channels,)
    return (norm.num_channels if isinstance(norm, nn.GroupNorm) else norm.num_features) == channels


def _replace(module: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(module.get_submodule(parent), name, new)
