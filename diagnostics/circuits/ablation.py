"""Does a circuit suffice for its class, and is it necessary? Ablation at the gate points.

Sufficiency keeps only the circuit's channels; necessity removes them. A removed channel
is set to 0 ("zero") or to its mean activation over a reference set ("mean", the whole
feature map of the channel becomes that constant). The paper measures class-c recall;
``ablation_report`` adds whole-test accuracy and the fraction of images predicted as c
(a model that always says c has perfect recall), the largest share of images predicted as
any one class (above ``DEGENERATE_FRACTION`` the ablated model is a degenerate predictor) and a
random circuit of the same size per layer as a control. ``without_channels`` tells an empty
circuit that needs no gated channel (bias-only) from one where discovery kept nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from diagnostics.circuits.discovery import frozen
from diagnostics.circuits.gates import Position, patched, resolve_layers
from diagnostics.circuits.metrics import MaskLike, circuit_size, to_bools
from fedmech_flwr.models import FedMechModel
from fedmech_flwr.training import largest_predicted_class

Mode = Literal["sufficiency", "necessity"]
Fill = Literal["zero", "mean"]
MODES: tuple[Mode, ...] = ("sufficiency", "necessity")


def channel_means(
    model: FedMechModel,
    x: Tensor,
    layers: Sequence[str] | None = None,
    position: Position = "after_norm",
    batch_size: int = 512,
) -> dict[str, Tensor]:
    """Mean activation per channel at the gate points (over samples and spatial dims),
    as CPU float32 tensors [channels]."""
    names = resolve_layers(model, layers)
    sums: dict[str, Tensor] = {}
    counts = dict.fromkeys(names, 0)

    def record(name: str) -> Callable[[Tensor], Tensor]:
        def edit(out: Tensor) -> Tensor:
            dims = [d for d in range(out.ndim) if d != 1]
            total = out.detach().sum(dim=dims, dtype=torch.float64).cpu()
            sums[name] = sums[name] + total if name in sums else total
            counts[name] += out.numel() // out.shape[1]
            return out

        return edit

    _predict(model, x, {name: record(name) for name in names}, position, batch_size)
    return {name: (sums[name] / counts[name]).float() for name in names}


def ablate(
    model: FedMechModel,
    x: Tensor,
    mask: MaskLike,
    mode: Mode,
    fill: Fill,
    means: Mapping[str, Tensor] | None = None,
    position: Position = "after_norm",
    batch_size: int = 512,
) -> Tensor:
    """Predicted classes [N] (CPU) with circuit ``mask`` ablated in ``mode``.

    Layers absent from ``mask`` are left alone; ``means`` (from ``channel_means`` at the
    same ``position``) is needed for ``fill="mean"``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if fill not in ("zero", "mean"):
        raise ValueError(f"fill must be 'zero' or 'mean', got {fill!r}")
    if fill == "mean" and means is None:
        raise ValueError("fill='mean' needs the channel means (see channel_means)")
    sizes = model.gated_layers()
    edits = {}
    for name in resolve_layers(model, list(mask)):
        keep = torch.from_numpy(to_bools(mask[name]).copy())
        if keep.numel() != sizes[name]:
            raise ValueError(f"mask of layer '{name}' has {keep.numel()} channels, the layer {sizes[name]}")
        if mode == "necessity":
            keep = ~keep
        value = means[name] if fill == "mean" else torch.zeros(sizes[name])
        edits[name] = _replacer(keep, value)
    return _predict(model, x, edits, position, batch_size)


def predict(model: FedMechModel, x: Tensor, batch_size: int = 512) -> Tensor:
    """The model's own argmax predictions [N] (CPU), nothing ablated."""
    return _predict(model, x, {}, "after_norm", batch_size)


def without_channels(
    model: FedMechModel, x: Tensor, position: Position = "after_norm", batch_size: int = 512
) -> Tensor:
    """Predicted classes [N] (CPU) with every gated channel closed (set to 0): what the
    model predicts from its head's bias and ungated paths alone. A class it still predicts
    this way has an empty circuit that is no failure of discovery: its prediction needs no
    gated channel (bias-only)."""
    closed = {name: torch.zeros(k, dtype=torch.bool) for name, k in model.gated_layers().items()}
    return ablate(model, x, closed, "sufficiency", "zero", position=position, batch_size=batch_size)


def ablation_report(
    model: FedMechModel,
    x_test: Tensor,
    y_test: Tensor,
    cls: int,
    mask: MaskLike,
    means: Mapping[str, Tensor] | None,
    generator: torch.Generator,
    position: Position = "after_norm",
    batch_size: int = 512,
) -> dict[str, Any]:
    """Sufficiency and necessity of class ``cls``'s circuit, JSON-able.

    ``{"class", "circuit_size", "baseline": scores, "circuit": {mode: {fill: scores}},
    "random": {mode: {fill: scores}}}``, where scores are ``recall`` (accuracy on class-cls
    test images; None if there are none), ``accuracy`` (whole test set),
    ``predicted_fraction`` (share of test images predicted as cls) and
    ``max_predicted_fraction`` (largest share predicted as any one class). "random" is a circuit
    with as many channels per layer, drawn with ``generator``. Fill "mean" is reported only
    when ``means`` is given.
    """
    y, n = y_test.cpu(), model.num_classes
    sizes = model.gated_layers()
    random_mask = {}
    for name, k in circuit_size(mask).items():
        chosen = torch.zeros(sizes[name], dtype=torch.bool)
        chosen[torch.randperm(sizes[name], generator=generator)[:k]] = True
        random_mask[name] = chosen
    fills: tuple[Fill, ...] = ("zero", "mean") if means is not None else ("zero",)
    report: dict[str, Any] = {
        "class": int(cls),
        "circuit_size": circuit_size(mask),
        "baseline": _scores(predict(model, x_test, batch_size), y, cls, n),
    }
    for label, m in (("circuit", mask), ("random", random_mask)):
        report[label] = {
            mode: {
                fill: _scores(ablate(model, x_test, m, mode, fill, means, position, batch_size), y, cls, n)
                for fill in fills
            }
            for mode in MODES
        }
    return report


def _replacer(keep: Tensor, value: Tensor) -> Callable[[Tensor], Tensor]:
    """An output edit that keeps channels ``keep`` and sets the others to ``value``."""

    def edit(out: Tensor) -> Tensor:
        shape = (1, -1, *([1] * (out.ndim - 2)))
        k = keep.to(out.device).view(shape)
        v = value.to(out.device, out.dtype).view(shape)
        return torch.where(k, out, v)

    return edit


def _predict(
    model: FedMechModel,
    x: Tensor,
    edits: Mapping[str, Callable[[Tensor], Tensor]],
    position: Position,
    batch_size: int,
) -> Tensor:
    """argmax predictions [N] (CPU) of the model with ``edits`` applied, in batches."""
    device = next(model.parameters()).device
    preds = []
    with frozen(model), torch.no_grad(), patched(model, edits, position):
        for batch in x.split(batch_size):
            preds.append(model(batch.to(device)).argmax(dim=1).cpu())
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)


def _scores(pred: Tensor, y: Tensor, cls: int, num_classes: int) -> dict[str, float | None]:
    in_class = y == cls
    return {
        "recall": float((pred[in_class] == cls).float().mean()) if in_class.any() else None,
        "accuracy": float((pred == y).float().mean()),
        "predicted_fraction": float((pred == cls).float().mean()),
        "max_predicted_fraction": largest_predicted_class(pred, num_classes)[1],
    }
