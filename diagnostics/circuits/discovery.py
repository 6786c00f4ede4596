"""Class-circuit discovery: learn one row of channel gates per class on a frozen model.

All requested classes are optimised at once: per gated layer a logit matrix
[len(classes), channels]. Every sample in a step is gated by its own class's row, and the
loss is a sum of per-class terms (mean cross-entropy towards the class on its samples,
plus lam times the row's penalty), so each row's gradient depends only on its class.

The step's ``batch_size`` samples are shared: each of K classes draws
ceil(batch_size / K) of its own samples per step, so one pass over all classes costs
about what one class costs. Sampling is per class: each class has its own generator,
seeded from (base seed, class), where the base seed is drawn once from the caller's
generator; it draws the class's samples (without replacement, or with it when it has
fewer) and, for hard-concrete, its gate noise. So, for equal generator states,
``discover_circuits`` over K classes with ``batch_size`` B finds exactly what
``discover_one_class`` finds class by class with ``batch_size`` ceil(B / K); with early
stopping (``patience``) too, since each class stops on its own mask.

Speed: each class leaves the batch when it stops early; the passes run on a channels-last
copy of the model (about 1.2x faster on CPUs; the model itself is never touched); where the
model has a ``pooled_gate_module`` (SimpleCNN: after ReLU and max-pool), the gates act
there, on a quarter of the elements, with the same output and gradients (a closed STE gate
passes none, as before a ReLU): 1.48x faster on an unpruned CIFAR-10 model
(``benchmarks/circuits_agreement.py --sparsity 0``).
STE gates on a pruned SimpleCNN run through its ``grouped_forward``: the channels that do
not depend on the input (most of them at 99.9% sparsity), or that every class has closed,
are computed once per class instead of once per sample.
``learn_circuits(start=...)`` warm-starts from earlier gate logits; the diagnostic does
not use it (see ``diagnostics.circuits.diagnostic``: a warm start keeps the start's mask).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedmech_flwr.api._builtin import channels_last, channels_last_copy, parse_dataclass
from fedmech_flwr.api.model import FedMechModel

from .gates import (
    GateConfig,
    gated,
    hard_concrete_sample,
    l0_penalty,
    resolve_layers,
    ste_gate,
)

log = logging.getLogger(__name__)

Mask = dict[str, Tensor]
"""Gated layer name -> bool tensor [channels]: the channels in a circuit."""


@dataclass
class Discovery:
    """What one discovery learned: the circuits, the final gate logits and the steps taken."""

    masks: dict[int, Mask]
    logits: dict[int, dict[str, Tensor]]
    """Class -> gated layer -> final gate logits [channels] (CPU): a later discovery's
    warm start."""
    steps: int


def discover_circuits(
    model: FedMechModel,
    x: Tensor,
    y: Tensor,
    classes: Sequence[int],
    cfg: GateConfig,
    generator: torch.Generator,
    layers: Sequence[str] | None = None,
) -> dict[int, Mask]:
    """The circuit of each class in ``classes``, learned on the labelled data (x, y).

    ``layers`` restricts the gates to some gated layers (default: all of them). The
    model's weights, ``requires_grad`` flags and train/eval mode are restored afterwards;
    no hooks are left behind. Every class must have samples in ``y`` (callers decide what
    an absent class means). Masks are CPU bool tensors.
    """
    return learn_circuits(model, x, y, classes, cfg, generator, layers).masks


def learn_circuits(
    model: FedMechModel,
    x: Tensor,
    y: Tensor,
    classes: Sequence[int],
    cfg: GateConfig,
    generator: torch.Generator,
    layers: Sequence[str] | None = None,
    start: Mapping[int, Mapping[str, Tensor]] | None = None,
) -> Discovery:
    """``discover_circuits``, also returning the logits and steps; ``start`` warm-starts
    the classes it holds from their gate logits (e.g. a previous round's, or
    ``mask_logits`` of a circuit); the others start at ``cfg.init``."""
    cfg = _validated(cfg)
    classes = _checked_classes(classes, model.num_classes)
    names = resolve_layers(model, layers)
    if x.shape[0] != y.shape[0] or y.ndim != 1:
        raise ValueError(f"x and y must hold the same samples: x {tuple(x.shape)}, y {tuple(y.shape)}")
    pools = []
    for c in classes:
        pool = torch.nonzero(y.cpu() == c).flatten()
        if len(pool) == 0:
            raise ValueError(f"class {c} has no samples in the data given; leave it out of classes")
        pools.append(pool)
    logits, steps = _learn_gates(model, x, pools, classes, names, cfg, generator, start or {})
    return Discovery(
        masks={c: {name: (logits[name][row] > cfg.threshold).cpu() for name in names} for row, c in enumerate(classes)},
        logits={c: {name: logits[name][row].cpu() for name in names} for row, c in enumerate(classes)},
        steps=steps,
    )


def mask_logits(mask: Mapping[str, Tensor], init: float) -> dict[str, Tensor]:
    """Gate logits that open a circuit's channels (+init) and close the others (-init)."""
    return {name: torch.where(torch.as_tensor(m, dtype=torch.bool), init, -init).float() for name, m in mask.items()}


def discover_one_class(
    model: FedMechModel,
    x: Tensor,
    y: Tensor,
    cls: int,
    cfg: GateConfig,
    generator: torch.Generator,
    layers: Sequence[str] | None = None,
) -> Mask:
    """The circuit of one class: ``discover_circuits`` with a single gate row."""
    return discover_circuits(model, x, y, [cls], cfg, generator, layers)[int(cls)]


@contextmanager
def frozen(model: FedMechModel) -> Iterator[None]:
    """Eval mode and no weight gradients while open; both restored on exit."""
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


def _learn_gates(
    model: FedMechModel,
    x: Tensor,
    pools: list[Tensor],
    classes: list[int],
    names: list[str],
    cfg: GateConfig,
    generator: torch.Generator,
    start: Mapping[int, Mapping[str, Tensor]],
) -> tuple[dict[str, Tensor], int]:
    """Adam on the gate logits only; returns the final logits [classes, channels] per layer
    and the steps taken.

    A step runs the classes in chunks of at most ``cfg.max_batch`` samples and sums their
    gradients before the update. Rows are independent, so chunking changes nothing but
    memory and speed. With ``cfg.patience``, a row stops (keeps its logits, leaves the
    batch) once its hard mask has not changed for that many steps, never before
    ``cfg.min_steps``; the steps returned are those of the last row to stop.
    """
    device = next(model.parameters()).device
    sizes = model.gated_layers()
    model = channels_last_copy(model)
    grouped = model.grouped_forward() if cfg.kind == "ste" else None  # hard-concrete noise is per sample
    base_seed = int(torch.randint(2**62, (1,), generator=generator))
    class_generators = [
        torch.Generator().manual_seed(int(np.random.SeedSequence([base_seed, c]).generate_state(1)[0]))
        for c in classes
    ]
    logits = {}
    for name in names:
        rows = [start[c][name].to(device, torch.float32) if c in start else torch.full((sizes[name],), cfg.init, device=device)
                for c in classes]
        logits[name] = torch.stack(rows).requires_grad_(True)
    optimizer = torch.optim.Adam(logits.values(), lr=cfg.lr)
    per_class = per_class_batch(cfg.batch_size, len(classes))
    per_chunk = max(1, cfg.max_batch // per_class)
    active, unchanged, held = list(range(len(classes))), [0] * len(classes), _hard(logits, cfg)
    stopped: dict[str, Tensor] = {name: g.detach().clone() for name, g in logits.items()}
    began, step = time.perf_counter(), 0
    with frozen(model), torch.enable_grad():
        while active and step < cfg.steps:
            optimizer.zero_grad(set_to_none=True)
            loss = sum(
                _chunk_loss(model, grouped, x, pools, classes, class_generators, logits, active[lo : lo + per_chunk],
                            per_class, cfg, device)
                for lo in range(0, len(active), per_chunk)
            )
            optimizer.step()
            step += 1
            if cfg.patience is None:
                continue
            done = [row for row in range(len(classes)) if row not in active]
            now = _hard(logits, cfg)
            with torch.no_grad():
                for name, g in logits.items():
                    g[done] = stopped[name][done]  # Adam's momentum would still move a stopped row
            for row in list(active):
                same = all(torch.equal(now[name][row], held[name][row]) for name in names)
                unchanged[row] = unchanged[row] + 1 if same else 0
                if step >= cfg.min_steps and unchanged[row] >= cfg.patience:
                    active.remove(row)
                    for name, g in logits.items():
                        stopped[name][row] = g.detach()[row]
            held = now
    log.debug(
        "circuits of classes %s: %d steps in %.2fs, final loss %.4f",
        classes, step, time.perf_counter() - began, loss,
    )
    return {name: g.detach() for name, g in logits.items()}, step


def _hard(logits: Mapping[str, Tensor], cfg: GateConfig) -> dict[str, Tensor]:
    return {name: g.detach() > cfg.threshold for name, g in logits.items()}


def _chunk_loss(
    model: FedMechModel,
    grouped: Callable[..., Tensor] | None,
    x: Tensor,
    pools: list[Tensor],
    classes: list[int],
    class_generators: list[torch.Generator],
    logits: dict[str, Tensor],
    chunk: list[int],
    n: int,
    cfg: GateConfig,
    device: torch.device,
) -> float:
    """Back-propagate the loss of the gate rows in ``chunk`` (``n`` samples per class, drawn
    from its own generator) through the model's ``grouped`` forward if given, else through
    gate hooks; returns the loss."""
    picks, noise = [], {name: [] for name in logits}
    for row in chunk:
        picks.append(_draw(pools[row], n, class_generators[row]))
        if cfg.kind == "hard_concrete":
            for name, g in logits.items():
                noise[name].append(torch.rand(n, g.shape[1], generator=class_generators[row]))
    xb = channels_last(x[torch.cat(picks).to(x.device)].to(device))
    rows = torch.arange(len(chunk), device=device).repeat_interleave(n)
    targets = torch.tensor([classes[row] for row in chunk], device=device).repeat_interleave(n)
    own = {name: g[chunk] for name, g in logits.items()}
    if grouped is not None:
        out = grouped(xb, len(chunk), at_end={name: ste_gate(g, closed_gradient=False) for name, g in own.items()})
    else:
        if cfg.kind == "ste":
            values = {name: ste_gate(g, model.pooled_gate_module(name) is None)[rows] for name, g in own.items()}
        else:
            values = {
                name: hard_concrete_sample(g[rows], torch.cat(noise[name]).to(device), cfg)
                for name, g in own.items()
            }
        with gated(model, values, cfg.position, pooled=True):
            out = model(xb)
    ce = F.cross_entropy(out, targets, reduction="none").view(len(chunk), n).mean(dim=1)
    penalty = sum(l0_penalty(g, cfg) for g in own.values())
    loss = (ce + cfg.lam * penalty).sum()
    loss.backward()
    return loss.item()


def per_class_batch(batch_size: int, num_classes: int) -> int:
    """Samples each class draws per step when ``num_classes`` share ``batch_size``."""
    return -(-batch_size // num_classes)


def _draw(pool: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """``n`` entries of ``pool``: without replacement if it has enough, else with."""
    if len(pool) >= n:
        return pool[torch.randperm(len(pool), generator=generator)[:n]]
    return pool[torch.randint(len(pool), (n,), generator=generator)]


def _validated(cfg: GateConfig) -> GateConfig:
    """Re-check a config built directly (not through parse_dataclass) for ranges and choices."""
    raw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return parse_dataclass(GateConfig, raw, "circuit gates")


def _checked_classes(classes: Sequence[int], num_classes: int) -> list[int]:
    classes = [int(c) for c in classes]
    if not classes:
        raise ValueError("classes is empty; give at least one class index")
    if len(set(classes)) != len(classes):
        raise ValueError(f"classes has duplicates: {classes}")
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise ValueError(
            f"class index(es) {bad} out of range: the model has {num_classes} classes "
            f"(0..{num_classes - 1})"
        )
    return classes
