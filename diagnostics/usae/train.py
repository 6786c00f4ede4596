"""Training a USAE the paper's way: each step encodes one model's tokens and reconstructs
every model's activations from that one code.

The source model is chosen round-robin. The loss is the MSE in standardised space summed
over models (self and cross reconstruction), plus ``aux_coef`` times Gao et al.'s
auxiliary loss: the top ``aux_k`` dead concepts reconstruct each model's residual. After
each Adam step the dictionary rows are renormalised to unit norm (per model or jointly,
``USAEConfig.decoder_norm``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from diagnostics.usae.activations import ActivationSource
from diagnostics.usae.model import USAE, USAEConfig, topk

log = logging.getLogger(__name__)


def token_stats(
    source: ActivationSource, batch_size: int, generator: torch.Generator
) -> tuple[list[Tensor], list[Tensor]]:
    """Each model's feature mean and std over one pass of ``source`` (float64 sums)."""
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
    return [m.float() for m in means], [s.float() for s in stds]


def usae_loss(
    usae: USAE, i: int, z: list[Tensor], dead: Tensor, aux_k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(reconstruction MSE summed over models, auxiliary loss, concepts that fired) for
    standardised aligned tokens ``z`` encoded by model i; ``dead`` marks dead concepts."""
    latents = usae.latents(i, z[i])
    codes = topk(latents, usae.k)
    recons = [usae.decode_standardised(j, codes) for j in range(usae.num_models)]
    mse = sum(F.mse_loss(r, t) for r, t in zip(recons, z))
    aux = latents.new_zeros(())
    n_dead = int(dead.sum())
    if aux_k and n_dead:
        aux_codes = topk(latents.masked_fill(~dead, 0.0), min(aux_k, n_dead))
        aux = sum(
            F.mse_loss(aux_codes @ site.decoder, t - r.detach())
            for site, r, t in zip(usae.sites, recons, z)
        )
    return mse, aux, (codes > 0).any(0)


def train_usae(
    source: ActivationSource, cfg: USAEConfig, device: str | torch.device = "cpu"
) -> tuple[USAE, dict[str, list[float]]]:
    """A USAE trained on ``source``'s aligned tokens for ``cfg.epochs`` passes, or more
    until ``cfg.min_steps`` steps are taken, and its per-epoch history: mean ``loss``,
    ``mse`` and ``aux``, and the ``dead_fraction`` and ``steps`` taken at the end of each
    epoch."""
    generator = torch.Generator().manual_seed(cfg.seed)
    means, stds = token_stats(source, cfg.batch_size, generator)
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
    while epoch < cfg.epochs or step < cfg.min_steps:
        totals, batches = torch.zeros(3), 0
        for batch in source.batches(cfg.batch_size, generator):
            z = [usae.standardise(j, t.to(device)) for j, t in enumerate(batch)]
            dead = idle >= cfg.dead_after
            mse, aux, fired = usae_loss(usae, step % usae.num_models, z, dead, cfg.aux_k)
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
