"""Per-channel gates on a model's gated layers, and the hooks that apply them.

Two gate kinds share one parametrisation (a real logit per channel):

- ``ste`` (the paper's): the forward pass uses the hard gate 1[g > 0]; the backward pass
  uses the gradient of sigmoid(g) (straight-through estimator). Penalty
  lam * sum(sigmoid(g)).
- ``hard_concrete`` (Louizos et al. 2018, "Learning sparse neural networks through L0
  regularization"): g is log(alpha); training uses a reparametrised stochastic gate
  stretched to (gamma, zeta) and clamped to [0, 1]; the penalty is the expected L0 norm
  lam * sum(sigmoid(g - beta * log(-gamma / zeta))).

Gates act through forward hooks that edit a gate point's output while a context manager
is open, so the model's code and weights are never touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from fedmech_flwr.api import ConfigError
from fedmech_flwr.api.model import FedMechModel

Position = Literal["after_norm", "before_norm"]

_UNIFORM_EPS = 1e-6
"""Keeps hard-concrete's uniform noise away from 0 and 1, where its logit is infinite."""


@dataclass
class GateConfig:
    """How circuits are discovered."""

    kind: Literal["ste", "hard_concrete"] = "ste"
    """"ste": the paper's hard gate with a straight-through sigmoid gradient;
    "hard_concrete": Louizos et al.'s stochastic L0 gate."""
    init: float = 2.0
    """Initial gate logit of every channel (positive: the search starts with all channels
    in)."""
    lr: float = field(default=0.1, metadata={"gt": 0})
    """Adam learning rate of the gate logits."""
    lam: float = field(default=0.01, metadata={"ge": 0})
    """Weight of the L0-style sparsity penalty (per open channel)."""
    steps: int = field(default=300, metadata={"ge": 1})
    """Optimisation steps (at most, with ``patience``)."""
    patience: int | None = field(default=30, metadata={"ge": 1})
    """A class stops early once its hard mask has not changed for this many steps (but
    never before ``min_steps``). null: every class runs all ``steps``, the paper's
    protocol. With 30 and ``min_steps`` 100, a CIFAR-10 SimpleCNN's classes stopped after
    137-176 of 300 steps with masks of mean IoU 0.995-1.0 with the full run's; patience
    20 and 50 stopped at 80-140 but at IoU 0.89 (benchmarks/circuits_agreement.py)."""
    min_steps: int = field(default=100, metadata={"ge": 1})
    """With ``patience``: the fewest steps a class takes. From the cold start (``init``
    2.0, Adam 0.1) a channel needs about 20 steps to close at all."""
    batch_size: int = field(default=256, metadata={"ge": 1})
    """Samples per step, shared by the classes discovered together: each class draws
    ceil(batch_size / len(classes)) of its own samples per step. So discovering all
    classes at once costs about as much as one class (the paper: 256 samples of one
    class per step); to give every class the paper's 256 per step, set
    batch_size = 256 x classes (ten times the cost for ten classes)."""
    max_batch: int = field(default=256, metadata={"ge": 1})
    """At most this many samples per forward pass (but always one class's batch): a step
    runs the classes in chunks and sums their gradients, which bounds memory and gives
    the same result. On CPUs larger passes stop paying off (memory-bound element-wise
    ops) around a few hundred samples; on a GPU raise it."""
    position: Position = "after_norm"
    """"after_norm" gates the layer's output after its normalisation (BatchNorm), so a
    closed gate really removes the channel; "before_norm" reproduces the paper's code,
    which gates the conv output before BN, leaving BN's constant shift. The same for
    models without normalisation."""
    beta: float = field(default=2 / 3, metadata={"gt": 0})
    """Hard-concrete temperature."""
    gamma: float = field(default=-0.1, metadata={"lt": 0})
    """Hard-concrete stretch: lower end of the stretched interval."""
    zeta: float = field(default=1.1, metadata={"gt": 1})
    """Hard-concrete stretch: upper end of the stretched interval."""
    threshold: float = 0.0
    """A channel is in the circuit if its gate logit is > threshold. At 0 this is the
    hard gate for "ste" and a deterministic hard-concrete gate > 0.5."""


def ste_gate(logits: Tensor, closed_gradient: bool = True) -> Tensor:
    """1[logits > 0] in the forward pass, with the gradient of sigmoid(logits); with
    ``closed_gradient`` False, none through a closed gate, as a gate before a ReLU has
    (relu(0 * x) passes none), for gating after the ReLU instead (``pooled_gate_module``)."""
    soft = torch.sigmoid(logits)
    hard = (logits > 0).to(soft.dtype)
    if not closed_gradient:
        soft = soft * hard
    return hard + (soft - soft.detach())  # exactly `hard`: soft - soft is 0


def hard_concrete_sample(log_alpha: Tensor, uniform: Tensor, cfg: GateConfig) -> Tensor:
    """A reparametrised hard-concrete gate in [0, 1] for noise ``uniform`` ~ U(0, 1)."""
    u = uniform.clamp(_UNIFORM_EPS, 1 - _UNIFORM_EPS)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / cfg.beta)
    return (s * (cfg.zeta - cfg.gamma) + cfg.gamma).clamp(0.0, 1.0)


def l0_penalty(logits: Tensor, cfg: GateConfig) -> Tensor:
    """Unweighted penalty per row of ``logits`` [rows, channels]: the soft count of open
    channels (STE) or the expected number of non-zero gates (hard-concrete)."""
    if cfg.kind == "ste":
        return torch.sigmoid(logits).sum(dim=-1)
    shift = cfg.beta * math.log(-cfg.gamma / cfg.zeta)
    return torch.sigmoid(logits - shift).sum(dim=-1)


def resolve_layers(model: FedMechModel, layers: Sequence[str] | None) -> list[str]:
    """The gated layers named in ``layers`` (None: all), in forward order; an unknown name
    is a ConfigError listing the model's gated layers."""
    valid = list(model.gated_layers())
    if layers is None:
        return valid
    unknown = [name for name in layers if name not in valid]
    if unknown or not layers:
        raise ConfigError(
            f"unknown gated layer(s) {unknown or '(none given)'}; "
            f"the model's gated layers are: {', '.join(valid)}",
            "circuit layers",
        )
    return [name for name in valid if name in layers]


def gate_point(model: FedMechModel, name: str, position: Position, pooled: bool = False) -> torch.nn.Module:
    """The module whose output gate ``name`` edits at ``position`` (with ``pooled``, the
    model's ``pooled_gate_module`` where it has one)."""
    module = model.pooled_gate_module(name) if pooled else None
    return module if module is not None else model.layer_module(name, before_norm=position == "before_norm")


def channel_view(values: Tensor, output: Tensor) -> Tensor:
    """Per-sample channel values [B, C] shaped to broadcast over ``output`` [B, C, ...]."""
    return values.view(*values.shape, *([1] * (output.ndim - 2)))


@contextmanager
def patched(
    model: FedMechModel,
    edits: Mapping[str, Callable[[Tensor], Tensor]],
    position: Position = "after_norm",
    pooled: bool = False,
) -> Iterator[None]:
    """While open, gate point ``name``'s output is replaced by ``edits[name](output)``
    (``gate_point``'s ``pooled`` says where).

    The hooks are removed on exit, also when the block raises.
    """
    handles = []
    try:
        for name, edit in edits.items():
            module = gate_point(model, name, position, pooled)
            handles.append(module.register_forward_hook(lambda _m, _i, out, edit=edit: edit(out)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def gated(
    model: FedMechModel, gate_values: Mapping[str, Tensor], position: Position = "after_norm", pooled: bool = False
) -> AbstractContextManager[None]:
    """Context manager: multiply each gate point's output by its per-sample gate vector
    ``gate_values[name]`` [B, C] (broadcast over the remaining dims); with ``pooled``, at
    the model's ``pooled_gate_module`` where it has one (the values must be in [0, 1])."""
    return patched(
        model,
        {name: lambda out, g=g: out * channel_view(g, out) for name, g in gate_values.items()},
        position,
        pooled,
    )
