"""What a trained USAE says about its models: reconstruction (R^2 matrix), sparsity,
which concepts they share, and stitching one model's concepts into another.

``tokens`` is always a list of M aligned token tensors [T, d_i] (``collect_tokens``);
work is done in chunks of ``batch_size`` tokens so dense codes [T, n] never all exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from fedmech_flwr.api.model import FedMechModel

from .activations import check_layer, evaluating, from_tokens
from .model import USAE

Concepts = Literal["all", "shared", "unique"] | Tensor | np.ndarray


def _residual_ss(x: Tensor, x_hat: Tensor) -> float:
    return float((x.double() - x_hat.double()).square().sum())


def _total_ss(x: Tensor) -> float:
    x = x.double()
    return float((x - x.mean(0)).square().sum())


def explained_variance(x: Tensor, x_hat: Tensor) -> float:
    """R^2 = 1 - sum((x - x_hat)^2) / sum((x - mean(x))^2), summed over all tokens and
    features, mean(x) being each feature's mean over tokens: 1 is perfect, 0 no better
    than the mean."""
    return 1.0 - _residual_ss(x, x_hat) / _total_ss(x)


def _device(usae: USAE) -> torch.device:
    return next(usae.parameters()).device


class MetricsAccumulator:
    """``r2_matrix`` and ``concept_activity`` streamed over chunks of aligned tokens (sums
    in float64), each token encoded once, so the numbers of a token set too large for
    memory are the same."""

    def __init__(self, widths: Sequence[int], dict_size: int) -> None:
        m = len(widths)
        self.sse = np.zeros((m, m))
        self.sums = [torch.zeros(w, dtype=torch.float64) for w in widths]
        self.squares = [torch.zeros(w, dtype=torch.float64) for w in widths]
        self.fired = np.zeros((m, dict_size))
        self.count = 0

    @torch.no_grad()
    def add(self, usae: USAE, tokens: Sequence[Tensor]) -> None:
        device = _device(usae)
        self.count += len(tokens[0])
        for i, t in enumerate(tokens):
            self.sums[i] += t.double().sum(0)
            self.squares[i] += t.double().square().sum(0)
            codes = usae.encode(i, t.to(device))
            self.fired[i] += (codes != 0).sum(0).cpu().numpy()
            for j, target in enumerate(tokens):
                self.sse[i, j] += _residual_ss(target, usae.decode(j, codes).cpu())

    def r2(self) -> np.ndarray:
        """The ``r2_matrix`` of the tokens added."""
        total = np.array([float((q - s.square() / self.count).sum()) for s, q in zip(self.sums, self.squares)])
        return 1.0 - self.sse / total[None, :]

    def activity(self) -> np.ndarray:
        """The ``concept_activity`` of the tokens added."""
        return self.fired / self.count

    def counts(self) -> np.ndarray:
        """[M, n] firing counts: the tokens of each model whose code uses each concept."""
        return self.fired.copy()


def _accumulate(usae: USAE, tokens: Sequence[Tensor], batch_size: int) -> MetricsAccumulator:
    acc = MetricsAccumulator([t.shape[1] for t in tokens], usae.dict_size)
    for start in range(0, len(tokens[0]), batch_size):
        acc.add(usae, [t[start : start + batch_size] for t in tokens])
    return acc


def r2_matrix(usae: USAE, tokens: Sequence[Tensor], batch_size: int = 4096) -> np.ndarray:
    """[M, M]: entry (i, j) is ``explained_variance`` of model j's tokens reconstructed
    (in its original space) from model i's codes."""
    return _accumulate(usae, tokens, batch_size).r2()


def concept_activity(usae: USAE, tokens: Sequence[Tensor], batch_size: int = 4096) -> np.ndarray:
    """[M, n] firing frequencies: the fraction of model i's tokens whose code (from model
    i's encoder) uses each concept."""
    return _accumulate(usae, tokens, batch_size).activity()


def l0(codes: Tensor) -> float:
    """Mean number of non-zero concepts per token."""
    return float((codes != 0).sum(-1).double().mean())


def dead_fraction(codes_by_model: Sequence[Tensor]) -> float:
    """Fraction of concepts that fire on no token of any model."""
    fired = torch.stack([(codes != 0).any(0) for codes in codes_by_model]).any(0)
    return 1.0 - float(fired.double().mean())


CALIBRATED_ALPHA = 0.05
"""Family-wise error rate of the calibrated rule: the chance that any concept of two
identical models is called unique."""


@dataclass(frozen=True)
class ConceptOverlap:
    """How the dictionary's concepts split over the models."""

    shared: int
    """Concepts active in every model."""
    unique: list[int]
    """Per model, the concepts active in it and no other."""
    dead: int
    """Concepts active in no model."""
    alive: int
    too_rare: int = 0
    """Concepts active in one model only that fire there too rarely for their silence
    elsewhere to tell them from a concept of identical models (calibrated rule; see
    ``calibrated_overlap``); counted in ``alive``, in neither ``shared`` nor ``unique``."""

    @property
    def overlap(self) -> float:
        """shared / (alive - too_rare) (the paper's 98.7% for IID vs alpha 0.05, where
        too_rare is 0)."""
        decided = self.alive - self.too_rare
        return self.shared / decided if decided else float("nan")


def active_sets(activity: np.ndarray, threshold: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bool masks from ``concept_activity``: active [M, n], shared [n] (active in every
    model) and unique [M, n] (active in that model only). A concept is active in a model
    when its firing frequency there is > ``threshold`` (0: it fires at least once, the
    fires-once rule; a concept's rare stray firings then count it as shared, a small
    threshold ignores them)."""
    active = np.asarray(activity) > threshold
    return active, active.all(0), active & (active.sum(0) == 1)


def shared_unique(activity: np.ndarray, threshold: float = 0.0) -> ConceptOverlap:
    """Counts of ``active_sets``."""
    active, shared, unique = active_sets(activity, threshold)
    alive = active.any(0)
    return ConceptOverlap(
        shared=int(shared.sum()),
        unique=[int(row.sum()) for row in unique],
        dead=int((~alive).sum()),
        alive=int(alive.sum()),
    )


def min_unique_count(num_tests: int, alpha: float = CALIBRATED_ALPHA) -> int:
    """Firings a concept needs in one model, with none in the others, to be unique to it
    under the calibrated rule.

    The models see the same tokens. If a concept fires k times in model i and never in
    model j, then under the null of equal firing rates each of those k firings is, given
    their total, equally likely to be model i's or model j's (the exact conditional
    binomial test), so the one-sided p-value is 0.5**k; asking it against every other
    model leaves it 0.5**k (an intersection-union test). Bonferroni over ``num_tests``
    hypotheses (every concept unique to every model) at ``alpha`` asks 0.5**k <= alpha /
    num_tests. Tokens of one image are correlated, so the test is lenient; the null
    control (a model against itself) shows what remains.
    """
    return max(1, math.ceil(math.log2(num_tests / alpha)))


def calibrated_overlap(counts: np.ndarray, alpha: float = CALIBRATED_ALPHA) -> tuple[ConceptOverlap, int]:
    """``shared_unique`` at "fires at least once" from firing counts [M, n] on the same
    tokens, calibrated: a concept the fires-once rule calls unique to model i stays unique
    only if it fires there at least ``min_unique_count(M * n, alpha)`` times, so that its
    silence in every other model is significant; the rest are ``too_rare`` and left out of
    the overlap. Returns the overlap and that minimum count."""
    counts = np.asarray(counts)
    minimum = min_unique_count(counts.size, alpha)
    paper = shared_unique(counts)
    _, _, unique = active_sets(counts)
    kept = unique & (counts >= minimum)
    calibrated = ConceptOverlap(shared=paper.shared, unique=[int(row.sum()) for row in kept], dead=paper.dead,
                                alive=paper.alive, too_rare=int((unique & ~kept).sum()))
    return calibrated, minimum


def concept_mask(
    concepts: Concepts, source: int, activity: np.ndarray | None = None, threshold: float = 0.0
) -> Tensor:
    """Bool mask [n] of the concepts to keep: "all" (a scalar True); "shared" or "unique"
    (to model ``source``), both ``active_sets`` of ``activity`` and ``threshold``; or a
    given mask."""
    if not isinstance(concepts, str):
        return torch.as_tensor(concepts, dtype=torch.bool)
    if concepts == "all":
        return torch.tensor(True)
    if concepts not in ("shared", "unique"):
        raise ValueError(f"concepts must be 'all', 'shared', 'unique' or a mask, got {concepts!r}")
    if activity is None:
        raise ValueError(f"concepts='{concepts}' needs the activity matrix (concept_activity)")
    _, shared, unique = active_sets(activity, threshold)
    return torch.from_numpy(shared if concepts == "shared" else unique[source])


def finish_from_layer(model: FedMechModel, layer: str, x: Tensor) -> Callable[[Tensor], Tensor]:
    """``finish(tokens) -> logits``: ``model`` run on images ``x`` with gated layer
    ``layer``'s output replaced by ``tokens`` (laid out as ``collect_tokens`` gives them),
    so the rest of the network and the head run on them. Any layer, any FedMechModel."""
    check_layer([model], layer)

    def finish(tokens: Tensor) -> Tensor:
        def replace(_module, _inputs, out: Tensor) -> Tensor:
            return from_tokens(tokens.to(out.device, out.dtype), out)

        handle = model.layer_module(layer).register_forward_hook(replace)
        try:
            with evaluating(model) as device:
                return model(x.to(device))
        finally:
            handle.remove()

    return finish


@dataclass(frozen=True)
class Stitch:
    """Counts of a stitching test; add the Stitch of each image chunk to combine them."""

    correct: int
    """Images classified right by model j finishing from the stitched activations."""
    own_correct: int
    """Images classified right by model j on its own activations."""
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    @property
    def own_accuracy(self) -> float:
        return self.own_correct / self.total

    @property
    def percent_of_own(self) -> float:
        return 100.0 * self.correct / self.own_correct if self.own_correct else float("nan")

    def __add__(self, other: Stitch) -> Stitch:
        return Stitch(
            self.correct + other.correct, self.own_correct + other.own_correct, self.total + other.total
        )


def _correct(logits: Tensor, y: Tensor) -> int:
    """Images whose largest logit is their label in ``y`` (a CPU tensor)."""
    return int((logits.argmax(1).cpu() == y).sum())


@torch.no_grad()
def stitch_all(
    usae: USAE,
    tokens: Sequence[Tensor],
    finishes: Mapping[int, Callable[[Tensor], Tensor]],
    y: Tensor,
    masks: Mapping[int, Mapping[str, Tensor]],
) -> dict[tuple[int, int, str], Stitch]:
    """Stitches of one chunk of images of labels ``y``, keyed (i, j, name): source i's
    codes, kept by ``masks[i][name]`` (``concept_mask``s), decoded into target j's space
    and classified by ``finishes[j]`` (e.g. ``finish_from_layer``); compared with
    ``finishes[j]`` on model j's own tokens.

    Each source is encoded once and each target run on its own tokens once.
    """
    device = _device(usae)
    own = {j: _correct(finish(tokens[j]), y) for j, finish in finishes.items()}
    out = {}
    for i, kept in masks.items():
        codes = usae.encode(i, tokens[i].to(device))
        for j, finish in finishes.items():
            for name, mask in kept.items():
                stitched = finish(usae.decode(j, codes * mask.to(device)))
                out[i, j, name] = Stitch(_correct(stitched, y), own[j], len(y))
    return out


def stitch_accuracy(
    usae: USAE,
    i: int,
    j: int,
    tokens: Sequence[Tensor],
    finish_j: Callable[[Tensor], Tensor],
    y: Tensor,
    concepts: Concepts = "all",
    activity: np.ndarray | None = None,
    threshold: float = 0.0,
) -> Stitch:
    """``stitch_all`` of the one pair i -> j, keeping ``concepts`` (see ``concept_mask``).

    All tokens are encoded at once: pass a chunk of images at a time and add the Stitches.
    """
    mask = concept_mask(concepts, i, activity, threshold)
    return stitch_all(usae, tokens, {j: finish_j}, y, {i: {"kept": mask}})[i, j, "kept"]
