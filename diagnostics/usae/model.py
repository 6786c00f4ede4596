"""The USAE: per model a standardiser, an encoder into a shared TopK dictionary and a
decoder out of it; saving and loading as safetensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedmech_flwr.api import ConfigError
from fedmech_flwr.api._builtin import load_arrays, load_model_arrays, model_arrays, save_arrays
from fedmech_flwr.api.strategy import NamedArrays

DecoderNorm = Literal["per_model", "joint"]
Schedule = Literal["round_robin", "symmetric"]

_STD_FLOOR = 1e-3
"""Features whose std is below this fraction of their model's mean feature std are
treated as constant: divided by the floor rather than blown up to unit variance."""


@dataclass
class USAEConfig:
    """How a USAE is sized and trained.

    The defaults are the paper's settings: expansion 8, TopK 48, 100 epochs, batch 1024,
    Adam at lr 1e-3, one source model per step in turn, with each spatial position of a
    conv feature map as a token; ours, ``min_steps``, only lengthens training on token sets
    far smaller than the paper's.
    """

    expansion: int = field(default=8, metadata={"ge": 1})
    """Dictionary size = expansion x the widest model's width (unless ``dict_size``)."""
    dict_size: int | None = field(default=None, metadata={"ge": 1})
    """Concepts in the dictionary; overrides ``expansion``."""
    k: int = field(default=48, metadata={"ge": 1})
    """Concepts kept per token (TopK)."""
    epochs: int = field(default=100, metadata={"ge": 1})
    """Passes over the activation source (more if ``min_steps`` asks for them)."""
    min_steps: int = field(default=1000, metadata={"ge": 0})
    """Fewest Adam steps: passes are added after ``epochs`` until this many steps are
    taken, so that a small token set (a few batches a pass) is not left under-trained
    (the CPU preset's 10 passes over a smoke run's 10,800 tokens are 110 steps and
    reconstruct worse than the mean; 1,000 steps explain 94%). 0: exactly ``epochs``."""
    batch_size: int = field(default=1024, metadata={"ge": 1})
    """Tokens per step."""
    lr: float = field(default=1e-3, metadata={"gt": 0})
    """Adam learning rate."""
    aux_k: int = field(default=256, metadata={"ge": 0})
    """Dead concepts in the auxiliary loss (Gao et al. 2024): the top aux_k dead concepts
    reconstruct what the main reconstruction missed, so dead concepts get a gradient.
    0 turns it off."""
    aux_coef: float = field(default=1 / 32, metadata={"ge": 0})
    """Weight of the auxiliary loss."""
    decoder_norm: DecoderNorm = "per_model"
    """Which dictionary rows are kept at unit norm. "per_model" (the paper's code: each
    model's decoder l2-normalised): every concept writes a unit vector into every model,
    so a concept can never be silent in one model and firing-based counts lean towards
    "shared". "joint": each concept's rows of all models together have unit norm, so a
    concept can leave a model it does not describe (unique concepts can show up)."""
    schedule: Schedule = "round_robin"
    """Which models encode each step (``diagnostics.usae.train``). "round_robin" (the
    paper's code): one model, in turn, on ``batch_size`` tokens; each encoder learns from
    its own batches, and two copies of one model end with different encoders (1-7% of
    their concepts then fire in one copy only). "symmetric": every model encodes the same
    ceil(batch_size / M) tokens, at the same cost; identical models get identical
    encoders."""
    dead_after: int = field(default=1000, metadata={"ge": 1})
    """A concept that has not fired for this many steps is dead."""
    seed: int = 0
    """Seeds the initialisation and the batch order."""

    def dictionary_size(self, widths: Sequence[int]) -> int:
        """Concepts for models of these widths."""
        return self.dict_size or self.expansion * max(widths)


def topk(latents: Tensor, k: int) -> Tensor:
    """``latents`` [T, n] with all but each row's k largest entries set to 0 (ties as
    ``torch.topk`` breaks them)."""
    values, indices = latents.topk(k, dim=-1)
    return torch.zeros_like(latents).scatter(-1, indices, values)


class _Site(nn.Module):
    """One model's standardiser, encoder and decoder (decoder rows are its dictionary)."""

    def __init__(self, dictionary: Tensor) -> None:
        super().__init__()
        dict_size, width = dictionary.shape
        dictionary = dictionary / dictionary.norm(dim=1, keepdim=True)
        self.encoder = nn.Linear(width, dict_size)
        with torch.no_grad():
            self.encoder.weight.copy_(dictionary)  # W_enc = W_dec^T at the start (Gao et al.)
            self.encoder.bias.zero_()
        self.decoder = nn.Parameter(dictionary)
        self.decoder_bias = nn.Parameter(torch.zeros(width))
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("std", torch.ones(width))


class USAE(nn.Module):
    """A universal sparse autoencoder over M >= 2 models of widths ``widths``.

    ``encode(i, x)`` = TopK(ReLU(W_enc_i (standardise_i(x) - b_dec_i) + b_enc_i)) gives
    codes in the shared dictionary; ``decode(j, codes)`` = (codes W_dec_j + b_dec_j) in
    model j's standardised space, mapped back to its original space. Decoder rows have
    unit norm (see ``USAEConfig.decoder_norm``).
    """

    def __init__(
        self, widths: Sequence[int], dict_size: int, k: int, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        if len(widths) < 2:
            raise ConfigError(f"a USAE needs at least 2 models, got widths {list(widths)}", "usae")
        if k > dict_size:
            raise ConfigError(
                f"k={k} exceeds the dictionary size {dict_size}; lower k or raise "
                "expansion / dict_size",
                "usae.k",
            )
        self.widths = list(widths)
        self.dict_size = dict_size
        self.k = k
        # One random draw for all models: models of equal width start from the same
        # dictionary, so identical models start out interchangeable. Trained with the
        # "symmetric" schedule they stay identical (every concept shared); with the
        # paper's "round_robin" their encoders drift apart, and two copies of a
        # Fashion-MNIST SimpleCNN at conv3 (1,000 images) share 93-99% of alive concepts
        # at the fires-once rule and 97.7-99.2% under the calibrated one. ``fedmech usae``
        # measures this null control next to every comparison.
        start = torch.randn(dict_size, max(widths), generator=generator)
        self.sites = nn.ModuleList(_Site(start[:, :width]) for width in widths)

    @property
    def num_models(self) -> int:
        return len(self.widths)

    @torch.no_grad()
    def set_standardiser(self, i: int, mean: Tensor, std: Tensor) -> None:
        """Model i's feature mean and std, fitted from its activations."""
        site = self.sites[i]
        site.mean.copy_(mean)
        site.std.copy_(std.clamp_min(_STD_FLOOR * float(std.mean())))

    def standardise(self, i: int, x: Tensor) -> Tensor:
        if x.shape[-1] != self.widths[i]:
            raise ValueError(f"model {i} has width {self.widths[i]}, got tokens of width {x.shape[-1]}")
        site = self.sites[i]
        return (x - site.mean) / site.std

    def latents(self, i: int, z: Tensor) -> Tensor:
        """Dense ReLU latents [T, n] of model i's standardised tokens ``z``."""
        site = self.sites[i]
        return torch.relu(site.encoder(z - site.decoder_bias))

    def encode(self, i: int, x: Tensor) -> Tensor:
        """Codes [T, n] of model i's tokens ``x`` [T, d_i]: at most k non-zeros per token
        (exactly k unless fewer latents are positive)."""
        return topk(self.latents(i, self.standardise(i, x)), self.k)

    def decode_standardised(self, j: int, codes: Tensor) -> Tensor:
        """Model j's activations from ``codes``, in its standardised space."""
        site = self.sites[j]
        return codes @ site.decoder + site.decoder_bias

    def decode(self, j: int, codes: Tensor) -> Tensor:
        """Model j's activations [T, d_j], in its original space, from shared ``codes``."""
        site = self.sites[j]
        return self.decode_standardised(j, codes) * site.std + site.mean

    def decoder_norms(self, decoder_norm: DecoderNorm) -> Tensor:
        """Row norms of the dictionary: [M, n] per model, or [1, n] over all models."""
        norms = torch.stack([site.decoder.norm(dim=1) for site in self.sites])
        return norms.norm(dim=0, keepdim=True) if decoder_norm == "joint" else norms

    @torch.no_grad()
    def normalise_decoders(self, decoder_norm: DecoderNorm) -> None:
        """Rescale the dictionary rows to unit norm, per model or jointly."""
        norms = self.decoder_norms(decoder_norm).clamp_min(1e-12).expand(self.num_models, -1)
        for site, row_norms in zip(self.sites, norms):
            site.decoder /= row_norms[:, None]


def usae_arrays(usae: USAE) -> NamedArrays:
    """``usae``'s weights and standardisers (``model_arrays``) and its k: all that
    ``load_usae`` needs."""
    return {**model_arrays(usae), "k": np.asarray(usae.k)}


def save_usae(path: str | Path, usae: USAE) -> None:
    """Write ``usae_arrays`` as safetensors."""
    save_arrays(path, usae_arrays(usae))


def load_usae(path: str | Path) -> USAE:
    """A USAE written by ``save_usae``; widths and dictionary size come from its shapes
    (``decoder_norm`` constrains training only and is not stored)."""
    arrays = load_arrays(path, expected=["k", "sites.0.decoder"])
    decoders = {int(name.split(".")[1]): a for name, a in arrays.items() if name.endswith(".decoder")}
    widths = [decoders[i].shape[1] for i in range(len(decoders))]
    usae = USAE(widths, decoders[0].shape[0], int(arrays.pop("k")))
    load_model_arrays(usae, arrays)
    return usae
