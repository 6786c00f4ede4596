"""Tokens from models' layers, and the sources that feed them to the trainer in aligned
batches.

A token is one spatial position of a conv feature map ([B, C, H, W] -> [B*H*W, C], row
b*H*W + h*W + w) or one sample of a linear output ([B, C]). Tokens of several models are
aligned: row t of every model comes from the same image and position.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import Tensor

from fedmech_flwr.api import ConfigError
from fedmech_flwr.api.model import FedMechModel


def to_tokens(output: Tensor) -> Tensor:
    """A layer output [B, C, *spatial] as tokens [B * prod(spatial), C]."""
    return output.movedim(1, -1).reshape(-1, output.shape[1])


def from_tokens(tokens: Tensor, like: Tensor) -> Tensor:
    """Inverse of ``to_tokens`` for an output shaped like ``like``."""
    return tokens.reshape(like.shape[0], *like.shape[2:], like.shape[1]).movedim(-1, 1)


def check_layer(models: Sequence[FedMechModel], layer: str) -> None:
    """ConfigError naming the model and its gated layers when one lacks ``layer``."""
    for index, model in enumerate(models):
        valid = list(model.gated_layers())
        if layer not in valid:
            raise ConfigError(
                f"model {index} has no gated layer '{layer}'; its gated layers are: {', '.join(valid)}",
                "usae layer",
            )


@contextmanager
def evaluating(model: FedMechModel) -> Iterator[torch.device]:
    """Eval mode without gradients (training mode restored on exit); yields the model's
    device."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters()).device
    finally:
        model.train(was_training)


def collect_tokens(
    models: Sequence[FedMechModel], layer: str, x: Tensor, batch_size: int = 256
) -> list[Tensor]:
    """Each model's tokens [T, d_i] at gated layer ``layer`` on images ``x`` (on the CPU,
    aligned across models; widths may differ)."""
    if not models:
        raise ValueError("collect_tokens needs at least one model")
    if len(x) == 0:
        raise ValueError("no images to collect tokens from: x is empty")
    check_layer(models, layer)
    tokens = []
    for model in models:
        captured: list[Tensor] = []

        def capture(_module, _inputs, out) -> None:
            captured.append(to_tokens(out).cpu())

        handle = model.layer_module(layer).register_forward_hook(capture)
        try:
            with evaluating(model) as device:
                for start in range(0, len(x), batch_size):
                    model(x[start : start + batch_size].to(device))
        finally:
            handle.remove()
        tokens.append(torch.cat(captured))
    return tokens


class ActivationSource(Protocol):
    """Aligned token batches of M models, what ``train_usae`` reads."""

    def batches(self, batch_size: int, generator: torch.Generator) -> Iterator[list[Tensor]]:
        """One epoch: lists of M aligned batches [<= batch_size, d_i], in an order drawn
        from ``generator``."""
        ...


class InMemorySource:
    """An ActivationSource over tokens already in memory (``collect_tokens``' output)."""

    def __init__(self, tokens: Sequence[Tensor]) -> None:
        counts = {len(t) for t in tokens}
        if not tokens or counts == {0}:
            raise ValueError("the activation set is empty: no tokens for any model")
        if len(counts) > 1:
            raise ValueError(f"tokens are not aligned: the models have {[len(t) for t in tokens]} rows")
        self.tokens = list(tokens)

    def batches(self, batch_size: int, generator: torch.Generator) -> Iterator[list[Tensor]]:
        order = torch.randperm(len(self.tokens[0]), generator=generator)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            yield [t[rows] for t in self.tokens]


class StreamingSource:
    """An ActivationSource that runs the models on ``images``, a chunk at a time, so the
    activations are never all in memory.

    Each epoch shuffles the images, then the tokens within each chunk (plus the previous
    chunk's left-overs): larger chunks mix tokens from more images.
    """

    def __init__(
        self, models: Sequence[FedMechModel], layer: str, images: Tensor, images_per_chunk: int = 256
    ) -> None:
        if len(images) == 0:
            raise ValueError("no images to stream tokens from: images is empty")
        check_layer(models, layer)
        self.models = list(models)
        self.layer = layer
        self.images = images
        self.images_per_chunk = images_per_chunk

    def batches(self, batch_size: int, generator: torch.Generator) -> Iterator[list[Tensor]]:
        order = torch.randperm(len(self.images), generator=generator)
        left: list[Tensor] = []
        for start in range(0, len(order), self.images_per_chunk):
            chunk = self.images[order[start : start + self.images_per_chunk]]
            tokens = collect_tokens(self.models, self.layer, chunk, self.images_per_chunk)
            if left:
                tokens = [torch.cat(pair) for pair in zip(left, tokens)]
            rows = torch.randperm(len(tokens[0]), generator=generator)
            full = len(rows) - len(rows) % batch_size
            for s in range(0, full, batch_size):
                yield [t[rows[s : s + batch_size]] for t in tokens]
            left = [t[rows[full:]] for t in tokens]
        if left and len(left[0]):
            yield left
