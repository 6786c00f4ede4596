"""training.py on its own: the metrics every record uses, seeding, and the local loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedmech_flwr.foundation.seeds import seed_for
from fedmech_flwr.learning.training import (
    TrainConfig,
    channels_last_copy,
    cross_entropy_objective,
    evaluate,
    largest_predicted_class,
    local_steps,
    recall,
    seed_everything,
    train_epochs,
)
from fedmech_flwr.models import build_model


class FixedLogits(nn.Module):
    """Logits that are the input itself: the prediction is whatever ``x`` says."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_recall_is_accuracy_and_per_class_recall_with_absent_classes_undefined():
    pred = torch.tensor([0, 0, 1, 2, 2, 2])
    y = torch.tensor([0, 1, 1, 2, 2, 0])
    accuracy, per_class = recall(pred, y, num_classes=4)
    assert accuracy == pytest.approx(4 / 6)
    assert per_class == [pytest.approx(0.5), pytest.approx(0.5), 1.0, None]  # class 3 has no labels
    assert recall(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), 2) == (0.0, [None, None])


def test_largest_predicted_class_names_the_degenerate_share():
    assert largest_predicted_class(torch.tensor([3, 3, 3, 1]), 4) == (3, 0.75)
    assert largest_predicted_class(torch.empty(0, dtype=torch.long), 4) == (0, 0.0)


def test_evaluate_gives_cross_entropy_accuracy_and_recall_over_batches():
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    y = torch.tensor([0, 0, 1])
    res = evaluate(FixedLogits(), x, y, num_classes=2, batch_size=2)  # two batches: 2 + 1
    expected = sum(-torch.log_softmax(row, 0)[label].item() for row, label in zip(x, y)) / 3
    assert res.loss == pytest.approx(expected)
    assert (res.accuracy, res.per_class_accuracy, res.num_examples) == (pytest.approx(1 / 3), [0.5, 0.0], 3)


def test_local_steps_count_partial_batches():
    assert local_steps(100, TrainConfig(epochs=2, batch_size=32)) == 8  # 4 batches (32, 32, 32, 4) x 2
    assert local_steps(96, TrainConfig(epochs=1, batch_size=32)) == 3


def test_seed_everything_gives_one_stream_per_seed():
    def draws(seed: int) -> list[float]:
        generator = seed_everything(seed)
        return torch.rand(3, generator=generator).tolist() + torch.rand(2).tolist()  # own and global streams

    big = seed_for(0, "local-training", 1, 2)  # seeds up to 2**63 also seed NumPy's global stream
    assert draws(big) == draws(big)
    assert draws(big) != draws(seed_for(0, "local-training", 2, 1)) and draws(0) != draws(1)


def _model_and_data():
    torch.manual_seed(0)
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=3, image_size=8)
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 3, (20,))
    return model, x, y


def test_train_epochs_is_reproducible_and_counts_what_it_did():
    cfg = TrainConfig(lr=0.01, epochs=2, batch_size=8)
    runs = []
    for _ in range(2):
        model, x, y = _model_and_data()
        stats = train_epochs(model, x, y, cfg, seed_everything(5), cross_entropy_objective(model))
        runs.append((model.state_dict(), stats))
    (a, stats), (b, _) = runs
    assert all(torch.equal(a[k], b[k]) for k in a)  # same seed: bitwise the same weights
    assert (stats.num_examples, stats.steps) == (40, local_steps(20, cfg))
    assert math.isfinite(stats.loss) and len(stats.per_class_accuracy) == 3


def test_a_channels_last_copy_computes_the_same_and_leaves_the_model_alone():
    model, x, _ = _model_and_data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    copy = channels_last_copy(model)
    torch.testing.assert_close(copy(x), model(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.state_dict()["conv1.weight"].is_contiguous()  # the original keeps its layout
