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

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor

from fedmech_flwr.api._builtin import channels_last, channels_last_copy, largest_predicted_class
from fedmech_flwr.api.model import FedMechModel

from .discovery import frozen
from .gates import Position, gate_point, patched, resolve_layers
from .metrics import MaskLike, circuit_size, to_bools

Mode = Literal["sufficiency", "necessity"]
Fill = Literal["zero", "mean"]
MODES: tuple[Mode, ...] = ("sufficiency", "necessity")


def channel_means(
    model: FedMechModel,
    x: Tensor,
    layers: Sequence[str] | None = None,
    position: Position = "after_norm",
    batch_size: int = 128,
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
    batch_size: int = 128,
) -> Tensor:
    """Predicted classes [N] (CPU) with circuit ``mask`` ablated in ``mode``.

    Layers absent from ``mask`` are left alone; ``means`` (from ``channel_means`` at the
    same ``position``) is needed for ``fill="mean"``.
    """
    edits = {name: _replacer(keep, value) for name, (keep, value) in _group(model, mask, mode, fill, means).items()}
    return _predict(model, x, edits, position, batch_size)


def _group(
    model: FedMechModel, mask: MaskLike, mode: Mode, fill: Fill, means: Mapping[str, Tensor] | None
) -> dict[str, tuple[Tensor, Tensor]]:
    """One ablation as gated layer -> (channels kept [C] bool, fill value of the others [C])."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if fill not in ("zero", "mean"):
        raise ValueError(f"fill must be 'zero' or 'mean', got {fill!r}")
    if fill == "mean" and means is None:
        raise ValueError("fill='mean' needs the channel means (see channel_means)")
    sizes = model.gated_layers()
    group = {}
    for name in resolve_layers(model, list(mask)):
        keep = torch.from_numpy(to_bools(mask[name]).copy())
        if keep.numel() != sizes[name]:
            raise ValueError(f"mask of layer '{name}' has {keep.numel()} channels, the layer {sizes[name]}")
        if mode == "necessity":
            keep = ~keep
        group[name] = (keep, means[name].float() if fill == "mean" else torch.zeros(sizes[name]))
    return group


def predict(model: FedMechModel, x: Tensor, batch_size: int = 128) -> Tensor:
    """The model's own argmax predictions [N] (CPU), nothing ablated."""
    return _predict(model, x, {}, "after_norm", batch_size)


def without_channels(
    model: FedMechModel, x: Tensor, position: Position = "after_norm", batch_size: int = 128
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
    batch_size: int = 128,
) -> dict[str, Any]:
    """Sufficiency and necessity of class ``cls``'s circuit, JSON-able.

    ``{"class", "circuit_size", "images", "class_images", "baseline": scores,
    "circuit": {mode: {fill: scores}}, "random": {mode: {fill: scores}}}``, where scores are
    ``recall`` (accuracy on class-cls test images; None if there are none), ``accuracy``
    (whole test set), ``predicted_fraction`` (share of test images predicted as cls),
    ``max_predicted_fraction`` (largest share predicted as any one class) and ``ci95``: the
    half-width of each one's 95% Wilson interval, the sampling error of the ``images``
    (``class_images`` of class cls) evaluated. "random" is a circuit with as many channels
    per layer, drawn with ``generator``. Fill "mean" is reported only when ``means`` is given.
    """
    random_mask = random_like(mask, model.gated_layers(), generator)
    return ablation_reports(model, x_test, y_test, [(cls, mask, random_mask)], means, position, batch_size)[0]


def random_like(mask: MaskLike, sizes: Mapping[str, int], generator: torch.Generator) -> dict[str, Tensor]:
    """A random circuit with as many channels per layer as ``mask``, drawn with ``generator``."""
    out = {}
    for name, k in circuit_size(mask).items():
        chosen = torch.zeros(sizes[name], dtype=torch.bool)
        chosen[torch.randperm(sizes[name], generator=generator)[:k]] = True
        out[name] = chosen
    return out


def ablation_reports(
    model: FedMechModel,
    x_test: Tensor,
    y_test: Tensor,
    jobs: Sequence[tuple[int, MaskLike, MaskLike]],
    means: Mapping[str, Tensor] | None,
    position: Position = "after_norm",
    batch_size: int = 128,
) -> list[dict[str, Any]]:
    """``ablation_report`` of every (class, circuit, random circuit) in ``jobs`` on one model,
    all in one batched pass (``predict_groups``): the unablated baseline and the first gated
    layer are computed once per image batch for all of them."""
    y, n = y_test.cpu(), model.num_classes
    fills: tuple[Fill, ...] = ("zero", "mean") if means is not None else ("zero",)
    combos = [(label, mode, fill) for label in ("circuit", "random") for mode in MODES for fill in fills]
    groups = [_group(model, m, mode, fill, means)
              for _, mask, rnd in jobs for label, mode, fill in combos for m in [mask if label == "circuit" else rnd]]
    baseline, preds = predict_groups(model, x_test, groups, position, batch_size)
    reports = []
    for j, (cls, mask, _) in enumerate(jobs):
        report: dict[str, Any] = {
            "class": int(cls),
            "circuit_size": circuit_size(mask),
            "images": len(y),
            "class_images": int((y == cls).sum()),
            "baseline": _scores(baseline, y, cls, n),
            "circuit": {mode: {} for mode in MODES},
            "random": {mode: {} for mode in MODES},
        }
        for i, (label, mode, fill) in enumerate(combos):
            report[label][mode][fill] = _scores(preds[j * len(combos) + i], y, cls, n)
        reports.append(report)
    return reports


def predict_groups(
    model: FedMechModel,
    x: Tensor,
    groups: Sequence[Mapping[str, tuple[Tensor, Tensor]]],
    position: Position = "after_norm",
    batch_size: int = 128,
) -> tuple[Tensor, Tensor]:
    """The unablated predictions [N] and those under each group's edits [G, N] (CPU).

    A group maps gated layers to (channels kept [C] bool, fill of the others [C]). Groups
    run ``batch_size // images`` at a time, each sample edited by its own group's channels:
    through the model's ``grouped_forward`` where it has one; else, per image batch, the
    first edited gate point's output is computed once (in the unablated pass) and replayed
    for every group, so that only the layers after it run again.
    """
    device = next(model.parameters()).device
    sizes = model.gated_layers()
    model = channels_last_copy(model)
    grouped = model.grouped_forward()
    names = [name for name in sizes if any(name in g for g in groups)]
    keep = {name: torch.stack([g[name][0] if name in g else torch.ones(sizes[name], dtype=torch.bool)
                               for g in groups]).to(device) for name in names}
    value = {name: torch.stack([g[name][1] if name in g else torch.zeros(sizes[name])
                                for g in groups]).to(device) for name in names}
    per_image_batch = min(batch_size, max(len(x), 1))
    per_pass = max(1, batch_size // per_image_batch)
    base, preds = [], []
    with frozen(model), torch.inference_mode():
        for xb in x.split(per_image_batch):
            xb = channels_last(xb.to(device))
            first: list[Tensor] = []

            def keep_first(out: Tensor) -> Tensor:
                first.append(out.clone())  # a later in-place op must not change the replayed copy
                return out

            with patched(model, {names[0]: keep_first} if names and grouped is None else {}, position):
                base.append(model(xb).argmax(dim=1).cpu())
            rows = []
            for lo in range(0, len(groups), per_pass):
                k = min(per_pass, len(groups) - lo)
                kept = {name: keep[name][lo : lo + k] for name in names}
                if grouped is not None:
                    edits = {name: (kept[name].float(), value[name][lo : lo + k] * ~kept[name]) for name in names}
                    logits = grouped(_stacked(xb, k), k, at_conv=edits)
                else:
                    edits = {name: _group_replacer(kept[name], value[name][lo : lo + k]) for name in names}
                    with _replayed(gate_point(model, names[0], position), _stacked(first[0], k)), \
                            patched(model, edits, position):
                        logits = model(_stacked(xb, k))
                rows.append(logits.argmax(dim=1).view(k, -1).cpu())
            preds.append(torch.cat(rows) if rows else torch.zeros(0, len(xb), dtype=torch.long))
    baseline = torch.cat(base) if base else torch.zeros(0, dtype=torch.long)
    if not names:
        return baseline, baseline.expand(len(groups), -1).clone()
    return baseline, torch.cat(preds, dim=1) if preds else torch.zeros(len(groups), 0, dtype=torch.long)


def _stacked(t: Tensor, k: int) -> Tensor:
    """``k`` copies of a batch, group-major (the batch itself when k is 1: no copy)."""
    return t if k == 1 else channels_last(t.repeat(k, *[1] * (t.ndim - 1)))


@contextmanager
def _replayed(module: torch.nn.Module, output: Tensor) -> Iterator[None]:
    """While open, ``module`` returns ``output`` without computing (its hooks still run)."""
    module.forward = lambda *_args, **_kwargs: output
    try:
        yield
    finally:
        del module.forward


def _group_replacer(keep: Tensor, value: Tensor) -> Callable[[Tensor], Tensor]:
    """An output edit for ``k`` groups stacked group-major ([k * B, C, ...]): group g keeps
    channels ``keep[g]`` and sets the others to ``value[g]``."""

    def edit(out: Tensor) -> Tensor:
        k = keep.shape[0]
        grouped = out.view(k, -1, *out.shape[1:])
        shape = (k, 1, -1, *([1] * (out.ndim - 2)))
        return torch.where(keep.view(shape), grouped, value.to(out.dtype).view(shape)).view_as(out)

    return edit


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
    model = channels_last_copy(model)
    preds = []
    with frozen(model), torch.inference_mode(), patched(model, edits, position):
        for batch in x.split(batch_size):
            preds.append(model(channels_last(batch.to(device))).argmax(dim=1).cpu())
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)


def _scores(pred: Tensor, y: Tensor, cls: int, num_classes: int) -> dict[str, Any]:
    in_class = y == cls
    scores = {
        "recall": float((pred[in_class] == cls).float().mean()) if in_class.any() else None,
        "accuracy": float((pred == y).float().mean()),
        "predicted_fraction": float((pred == cls).float().mean()),
        "max_predicted_fraction": largest_predicted_class(pred, num_classes)[1],
    }
    sizes = {"recall": int(in_class.sum()), "accuracy": len(y), "predicted_fraction": len(y),
             "max_predicted_fraction": len(y)}
    scores["ci95"] = {key: wilson_half_width(scores[key], sizes[key]) for key in sizes}
    return scores


def wilson_half_width(p: float | None, n: int, z: float = 1.96) -> float | None:
    """Half-width of the Wilson score interval of a proportion ``p`` measured on ``n``
    samples (None when there is no proportion): the sampling error of an ablation score."""
    if p is None or n == 0:
        return None
    return z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
