"""Rules that read class counts read the client's shard, never the batch.

FedRS's held classes, FedLC's calibration, FedRoD's balanced softmax and FedETF's balanced
loss each depend on how many samples of each class the client holds. On a batch whose
classes are those of the shard the two readings agree, so each rule is tried here on a
batch that lacks classes its shard holds and on one that holds a class its shard lacks.
Training never draws the second (batches come from the shard), so the objective is called
with it directly: a rule that read the batch would change its loss there too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedmech_flwr.builtin.clients.etf import ETFClient, ETFConfig
from fedmech_flwr.builtin.clients.fedlc import FedLCClient, FedLCConfig
from fedmech_flwr.builtin.clients.fedrod import FedRoDClient, FedRoDConfig
from fedmech_flwr.builtin.clients.fedrs import FedRSClient, FedRSConfig
from fedmech_flwr.contracts.client import ClientData
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig
from fedmech_flwr.models import build_model

SHARD = torch.tensor([0, 0, 0, 1, 1, 2] * 4)
"""12, 8 and 4 samples of classes 0-2; class 3 absent."""
COUNTS = torch.tensor([12.0, 8.0, 4.0, 0.0])


def client_of(cls, params, train: TrainConfig | None = None):
    torch.manual_seed(0)
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=4, image_size=8)
    data = ClientData(torch.randn(len(SHARD), 1, 8, 8), SHARD, num_classes=4)
    return cls(params, model=model, data=data, train=train or TrainConfig(epochs=1, batch_size=8, lr=0.01),
               pruning=PruningConfig(mode="dense"), seed=0, partition_id=0)


def batches(client) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A batch of class 0 only (it lacks classes 1 and 2, which the shard holds), and one
    holding class 3, which the shard lacks."""
    only_zero = client.data.x[client.data.y == 0][:8]
    with_absent = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    return {"lacks held classes": (only_zero, torch.zeros(8, dtype=torch.long)),
            "holds an absent class": (with_absent, torch.tensor([3, 0, 1, 2, 3, 3, 0, 1]))}


def fedrs_loss(client, x, y):
    """alpha = 0.25 on class 3, the one the shard lacks: o_c = alpha_c w_c^T h + b_c."""
    h, head = client.model.forward_features(x), client.model.head
    scale = torch.tensor([1.0, 1.0, 1.0, 0.25])
    return F.cross_entropy((h @ head.weight.T) * scale + head.bias, y)


def fedlc_loss(client, x, y):
    """logits - tau n_c^(-1/4), n_3 = min_count."""
    shift = 0.5 * COUNTS.clamp_min(1e-2).pow(-0.25)
    return F.cross_entropy(client.model(x) - shift, y)


def fedrod_loss(client, x, y):
    """L_BSM = CE(logits + log n), n_3 = min_count."""
    return F.cross_entropy(client.model(x) + COUNTS.clamp_min(1e-3).log(), y)


def etf_loss(client, x, y):
    """CE(w_c^T h / (T ||h||) + log n_c), n_3 = 1."""
    scores = F.normalize(client.model.forward_features(x), dim=1) @ client.model.head.weight.T / 0.5
    return F.cross_entropy(scores + COUNTS.clamp_min(1).log(), y)


RULES = {
    "fedrs": (FedRSClient, FedRSConfig(alpha=0.25), fedrs_loss),
    "fedlc": (FedLCClient, FedLCConfig(tau=0.5, min_count=1e-2), fedlc_loss),
    "fedrod": (FedRoDClient, FedRoDConfig(min_count=1e-3), fedrod_loss),
    "etf": (ETFClient, ETFConfig(temperature=0.5), etf_loss),
}


@pytest.mark.parametrize("batch", ["lacks held classes", "holds an absent class"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_loss_reads_the_shards_class_counts_not_the_batchs(rule, batch):
    cls, params, expected = RULES[rule]
    client = client_of(cls, params)
    x, y = batches(client)[batch]
    with torch.no_grad():
        want = expected(client, x, y)
    loss, _ = client.objective(x, y)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_a_round_on_a_subset_leaves_the_shards_counts_in_place():
    """After a round on 6 of the shard's 24 samples (``max_samples_per_round``), in batches
    of 2, each rule still reads the shard's counts."""
    train = TrainConfig(epochs=2, batch_size=2, lr=0.01, max_samples_per_round=6)
    for rule, (cls, params, expected) in RULES.items():
        client = client_of(cls, params, train)
        client.fit(client.get_parameters({}), {"server-round": 1})
        x, y = batches(client)["lacks held classes"]
        with torch.no_grad():
            want = expected(client, x, y)
        torch.testing.assert_close(client.objective(x, y)[0], want, rtol=1e-5, atol=1e-6, msg=rule)
