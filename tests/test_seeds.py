"""The one seeding rule: a seed per (run seed, purpose, partition-id, round)."""

import numpy as np
import torch

from fedmech_flwr.foundation.seeds import numpy_rng, seed_for, torch_generator


def test_known_answers_pin_the_rule():
    # Changing these moves every random stream: say so in the README and the commit.
    assert seed_for(0, "client-sampling", None, 1) == 955491177152712648
    assert seed_for(0, "local-training", 3, 2) == 7373061186936598861


def test_each_part_changes_the_seed():
    base = seed_for(1, "local-training", 2, 3)
    assert base == seed_for(1, "local-training", 2, 3)
    variants = [seed_for(2, "local-training", 2, 3), seed_for(1, "audit-set", 2, 3),
                seed_for(1, "local-training", 3, 3), seed_for(1, "local-training", 2, 4),
                seed_for(1, "local-training", 3, 2)]
    assert len({base, *variants}) == 6


def test_none_is_not_zero():
    seeds = {seed_for(0, "p", None, None), seed_for(0, "p", 0, None), seed_for(0, "p", None, 0), seed_for(0, "p", 0, 0)}
    assert len(seeds) == 4


def test_numpy_integers_and_generators_agree():
    assert seed_for(5, "p", np.int64(1), np.int32(2)) == seed_for(5, "p", 1, 2)
    assert 0 <= seed_for(5, "p") < 2**63
    assert numpy_rng(5, "p", 1, 2).integers(1 << 30) == np.random.default_rng(seed_for(5, "p", 1, 2)).integers(1 << 30)
    assert torch.equal(torch.rand(3, generator=torch_generator(5, "p", 1, 2)),
                       torch.rand(3, generator=torch.Generator().manual_seed(seed_for(5, "p", 1, 2))))


def test_building_a_model_leaves_the_process_wide_rngs_as_they_were(smoke_cfg):
    """Flower draws from the globals (node sampling, DP noise): a model built on the server
    (at start, every evaluation, each diagnostic's and strategy's build) must not reseed
    them, and still gets the same initial weights every time."""
    import random

    from fedmech_flwr.learning.arrays import model_arrays
    from fedmech_flwr.datasets.data import load_dataset
    from fedmech_flwr.spec.experiment import new_model

    bundle = load_dataset(smoke_cfg.data.dataset.name, smoke_cfg.data.dataset.params)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    first = model_arrays(new_model(smoke_cfg, bundle))
    again = model_arrays(new_model(smoke_cfg, bundle))
    assert random.getstate() == states[0]
    assert np.array_equal(np.random.get_state()[1], states[1]) and torch.equal(torch.get_rng_state(), states[2])
    assert all(np.array_equal(first[k], again[k]) for k in first)
