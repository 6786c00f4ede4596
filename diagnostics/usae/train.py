"""Training a USAE: each step encodes tokens of one or every model and reconstructs every
model's activations from those codes.

``USAEConfig.schedule`` says which models encode: "round_robin" (the paper's code) takes
one source model per step, in turn, on ``batch_size`` tokens; "symmetric" has every
model encode the same ceil(batch_size / M) tokens each step. A symmetric step costs what
a round-robin step costs, the steps and each encoder's tokens per epoch are the same, and
the training treats the models alike: identical models get identical encoders, so a
concept unique to one model is a difference between the models, not between the batches
their encoders happened to see.

The loss is the MSE in standardised space summed over models (self and cross
reconstruction), plus ``aux_coef`` times Gao et al.'s auxiliary loss: the top ``aux_k``
dead concepts reconstruct each model's residual. After each Adam step the dictionary rows
are renormalised to unit norm (per model or jointly, ``USAEConfig.decoder_norm``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .activations import ActivationSource
from .model import USAE, USAEConfig, topk

log = logging.getLogger(__name__)


def token_stats(
    source: ActivationSource, batch_size: int, generator: torch.Generator
) -> tuple[list[Tensor], list[Tensor], int]:
    """Each model's feature mean and std over one pass of ``source`` (float64 sums), and
    the number of tokens."""
    sums: list[Tensor] = []
    squares: list[Tensor] = []
    count = 0
    for batch in source.batches(batch_size, generator):
        if not sums:
            sums = [torch.zeros(t.shape[1], dtype=torch.float64) for t in batch]
            squares = [torch.zeros(t.shape[1], dtype=torch.float64) for t in batch]
        for s, q, t in zip(sums, squares, batch):
            s += t.double().sum(0)
            q += t.double().square().sum(0)
        count += len(batch[0])
    if count == 0:
        raise ValueError("the activation source yielded no tokens")
    means = [s / count for s in sums]
    stds = [(q / count - m.square()).clamp_min(0).sqrt() for q, m in zip(squares, means)]
    return [m.float() for m in means], [s.float() for s in stds], count


def usae_loss(
    usae: USAE, sources: Sequence[int], z: list[Tensor], dead: Tensor, aux_k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(reconstruction MSE summed over models, auxiliary loss, concepts that fired) for
    standardised aligned tokens ``z`` encoded by each model in ``sources``; ``dead`` marks
    dead concepts.

    The sources' codes are stacked and every decoder reads the stack in one product, so
    the gradient of each model's dictionary is one sum over the same rows whatever the
    model: identical models stay bitwise identical.
    """
    latents = torch.cat([usae.latents(i, z[i]) for i in sources])
    codes = topk(latents, usae.k)
    targets = [t.repeat(len(sources), 1) for t in z]
    recons = [usae.decode_standardised(j, codes) for j in range(usae.num_models)]
    mse = sum(F.mse_loss(r, t) for r, t in zip(recons, targets))
    aux = latents.new_zeros(())
    n_dead = int(dead.sum())
    if aux_k and n_dead:
        aux_codes = topk(latents.masked_fill(~dead, 0.0), min(aux_k, n_dead))
        aux = sum(
            F.mse_loss(aux_codes @ site.decoder, t - r.detach())
            for site, r, t in zip(usae.sites, recons, targets)
        )
    return mse, aux, (codes > 0).any(0)


def _epochs(source: ActivationSource, cfg: USAEConfig, num_models: int, count: int,
            generator: torch.Generator) -> Iterator[Iterator[list[Tensor]]]:
    """Endless epochs of step batches: a round-robin epoch is one pass over ``source`` in
    ``batch_size`` batches; a symmetric epoch is as many steps (ceil(count / batch_size)),
    of ceil(batch_size / M) tokens each, from passes drawn one after another."""
    if cfg.schedule == "round_robin":
        while True:
            yield source.batches(cfg.batch_size, generator)
    per_model = -(-cfg.batch_size // num_models)
    stream = itertools.chain.from_iterable(source.batches(per_model, generator) for _ in itertools.count())
    while True:
        yield itertools.islice(stream, -(-count // cfg.batch_size))


def train_usae(
    source: ActivationSource, cfg: USAEConfig, device: str | torch.device = "cpu"
) -> tuple[USAE, dict[str, list[float]]]:
    """A USAE trained on ``source``'s aligned tokens for ``cfg.epochs`` passes, or more
    until ``cfg.min_steps`` steps are taken, and its per-epoch history: mean ``loss``,
    ``mse`` and ``aux``, and the ``dead_fraction`` and ``steps`` taken at the end of each
    epoch."""
    generator = torch.Generator().manual_seed(cfg.seed)
    means, stds, count = token_stats(source, cfg.batch_size, generator)
    widths = [len(m) for m in means]
    usae = USAE(widths, cfg.dictionary_size(widths), cfg.k, generator)
    for i, (mean, std) in enumerate(zip(means, stds)):
        usae.set_standardiser(i, mean, std)
    usae.to(device)
    usae.normalise_decoders(cfg.decoder_norm)
    optimizer = torch.optim.Adam(usae.parameters(), lr=cfg.lr)
    idle = torch.zeros(usae.dict_size, dtype=torch.long, device=device)
    history: dict[str, list[float]] = {"loss": [], "mse": [], "aux": [], "dead_fraction": [], "steps": []}
    step = epoch = 0
    epochs = _epochs(source, cfg, usae.num_models, count, generator)
    everyone = range(usae.num_models)
    while epoch < cfg.epochs or step < cfg.min_steps:
        totals, batches = torch.zeros(3), 0
        for batch in next(epochs):
            z = [usae.standardise(j, t.to(device)) for j, t in enumerate(batch)]
            dead = idle >= cfg.dead_after
            sources = everyone if cfg.schedule == "symmetric" else [step % usae.num_models]
            mse, aux, fired = usae_loss(usae, sources, z, dead, cfg.aux_k)
            loss = mse + cfg.aux_coef * aux
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            usae.normalise_decoders(cfg.decoder_norm)
            idle = torch.where(fired, 0, idle + 1)
            totals += torch.stack([loss, mse, aux]).detach().cpu()
            step += 1
            batches += 1
        for key, value in zip(("loss", "mse", "aux"), (totals / batches).tolist()):
            history[key].append(value)
        history["dead_fraction"].append(float((idle >= cfg.dead_after).float().mean()))
        history["steps"].append(step)
        epoch += 1
        log.info(
            "usae epoch %d (step %d): loss %.4f, mse %.4f, aux %.4f, dead %.1f%%",
            epoch, step, history["loss"][-1], history["mse"][-1],
            history["aux"][-1], 100 * history["dead_fraction"][-1],
        )
    usae.eval()
    return usae, history
