"""One seeding rule: every random stream's seed is ``seed_for(run seed, purpose,
partition-id, round)``.

The four parts are hashed together (SHA-256 of their JSON), so the seed has a fixed
arity, ``None`` differs from 0, and a purpose is a readable name rather than a numeric
salt. ``numpy.random.SeedSequence`` is not used for this: it ignores trailing zeros, so
``[a, b]`` and ``[a, b, 0]`` give the same stream.

Streams that moved with this rule (results differ from earlier versions at the same seed;
the same seed still gives bitwise-identical runs): model initialisation
(``model-init``), client sampling (``client-sampling``), the audit set (``audit-set``),
local training (``local-training``), the circuits diagnostic (``circuits-local``,
``circuits-global``, ``circuits-audit``, ``circuits-ablation-set``,
``circuits-ablation``), the misalignment diagnostic (``misalignment-split``,
``misalignment-head``, ``misalignment-probe``, ``misalignment-ccvr``), the realigning
strategies (``head-realign-split``, ``head-realign``, ``ccvr``) and
``circuit_masked_avg``'s random control (``circuit-masked-random/<layer>``), and what a strategy of the round protocol draws from the
process-wide RNGs (``flower-sampling``: Flower's own node sampling). Data partitioning
and synthetic data still use the run seed directly: they are drawn once per run. Circuit
discovery splits the generator it is handed into per-class streams; that split is not a
run-level seed and is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def seed_for(run_seed: int, purpose: str, partition_id: int | None = None, server_round: int | None = None) -> int:
    """The seed of the stream named ``purpose``: a plug-in's randomness comes from the
    run's seed through a named stream, never from the process-wide generators, so a run
    replays exactly whatever else draws numbers.

    Parameters
    ----------
    run_seed : int
        The experiment's seed (``ctx.seed``, ``cfg.seed``).
    purpose : str
        The stream's name, unique to its use (``"my_probe.split"``): two purposes never share
        a stream.
    partition_id, server_round : int or None
        The client and round the stream is for, where it has them.

    Returns
    -------
    int
        A seed, ``0 <= seed < 2**63``, the same for the same arguments on every machine.

    Examples
    --------
    >>> seed_for(0, "my_probe.split", partition_id=3) == seed_for(0, "my_probe.split", partition_id=3)
    True
    """
    key = json.dumps([int(run_seed), purpose, *(None if v is None else int(v) for v in (partition_id, server_round))])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def numpy_rng(
    run_seed: int, purpose: str, partition_id: int | None = None, server_round: int | None = None
) -> np.random.Generator:
    """A NumPy generator of the stream named ``purpose`` (seeded by ``seed_for``).

    Parameters
    ----------
    run_seed : int
        The experiment's seed (``ctx.seed``, ``cfg.seed``).
    purpose : str
        The stream's name, unique to its use (``"my_probe.split"``): two purposes never share
        a stream.
    partition_id, server_round : int or None
        The client and round the stream is for, where it has them.

    Returns
    -------
    numpy.random.Generator

    Examples
    --------
    >>> rng = numpy_rng(0, "my_diagnostic.sample", server_round=2)
    >>> picked = rng.choice(10, size=3, replace=False)
    """
    return np.random.default_rng(seed_for(run_seed, purpose, partition_id, server_round))


def torch_generator(
    run_seed: int, purpose: str, partition_id: int | None = None, server_round: int | None = None
) -> torch.Generator:
    """A CPU torch generator of the stream named ``purpose`` (seeded by ``seed_for``).

    Parameters
    ----------
    run_seed : int
        The experiment's seed (``ctx.seed``, ``cfg.seed``).
    purpose : str
        The stream's name, unique to its use (``"my_probe.split"``): two purposes never share
        a stream.
    partition_id, server_round : int or None
        The client and round the stream is for, where it has them.

    Returns
    -------
    torch.Generator

    Examples
    --------
    >>> import torch
    >>> order = torch.randperm(100, generator=torch_generator(0, "my_probe.order"))
    """
    return torch.Generator().manual_seed(seed_for(run_seed, purpose, partition_id, server_round))


def seed_globals(seed: int) -> None:
    """Seed Python's, NumPy's and torch's process-wide RNGs with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def seeded_globals(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's process-wide RNGs seeded with ``seed`` inside the
    block, and as they were before it after: code that draws from the globals (a model's
    initialisers, Flower's node sampling) gets a seeded stream, and nobody else's stream
    moves. Only a client's own training seeds the globals for good
    (``training.seed_everything``)."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        seed_globals(seed)
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)
