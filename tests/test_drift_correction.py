"""Drift correction: SCAFFOLD, FedDyn and FedNova against hand-computed rounds, their SGD
checks, a smoke run of each, and a SCAFFOLD run that resumes bitwise.

The client tests replace the cross-entropy with zero (``ZeroDataLoss``), so the only
gradients are the method's own term and weight decay: every parameter then follows a
recursion worked out by hand in the test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Message

from conftest import killed_then_resumed, smoke_config
from fedmech_flwr.app.inprocess import train_replies
from fedmech_flwr.builtin.clients.feddyn import ALPHA, FedDynClient
from fedmech_flwr.builtin.clients.fednova import A_NORM, STEPS, FedNovaClient, a_norm
from fedmech_flwr.builtin.clients.proximal import ProximalClient
from fedmech_flwr.builtin.clients.scaffold import CONTROL, DELTA_CONTROL, ScaffoldClient
from fedmech_flwr.builtin.strategies.fedavg import WeightedFedAvg
from fedmech_flwr.builtin.strategies.feddyn import FedDyn
from fedmech_flwr.builtin.strategies.fednova import FedNova
from fedmech_flwr.builtin.strategies.scaffold import Scaffold
from fedmech_flwr.contracts.client import ClientData, FedMechClient
from fedmech_flwr.contracts.strategy import OFFERED_NODES_ONLY, STRATEGIES, StrategyContext
from fedmech_flwr.contracts.wire import REPORT_KEY, UPLOAD_PREFIX
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import from_record, load_arrays, load_model_arrays, model_arrays, pack, to_record
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig
from fedmech_flwr.models import build_model

# --- clients ------------------------------------------------------------------------------


class ZeroDataLoss(FedMechClient):
    """The data term is 0 (its gradient too): what is left of the objective is the method's."""

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.0 * logits.sum()


class BareScaffold(ScaffoldClient, ZeroDataLoss):
    pass


class BareFedDyn(FedDynClient, ZeroDataLoss):
    pass


def make_client(cls, train: TrainConfig, state=None, received=None):
    """A SimpleCNN client on 24 samples (two steps of batch 12 per epoch)."""
    torch.manual_seed(0)
    y = torch.tensor([0, 0, 0, 1, 1, 2] * 4)
    data = ClientData(torch.randn(len(y), 1, 8, 8), y, num_classes=4)
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=4, image_size=8)
    return cls(None, model=model, data=data, train=train, pruning=PruningConfig(mode="dense"), seed=0,
               partition_id=0, state=state, received=received)


def filled(client: FedMechClient, value: float) -> dict[str, np.ndarray]:
    """Every float parameter of the client's model set to ``value``."""
    return {name: np.full(tuple(p.shape), value, np.float32) for name, p in client.model.named_parameters()}


def test_scaffold_client_takes_corrected_steps_and_updates_its_control_variate():
    """Every weight starts at 1 with local loss (wd / 2) w^2 (wd = 1), c = 0.2, c_i = -0.3:
    each step moves by lr (wd * w + c - c_i) = 0.1 (w + 0.5): w1 = 1 - 0.1 (1 + 0.5) = 0.85,
    w2 = 0.85 - 0.1 (0.85 + 0.5) = 0.715; c_i+ = c_i - c + (1 - 0.715) / (K=2 * 0.1) = -0.5 +
    1.425 = 0.925, the mean of the local gradients wd * w at w0, w1: (1 + 0.85) / 2."""
    train = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=1.0, epochs=1, batch_size=12)
    probe = make_client(BareScaffold, train)
    c, c_i = filled(probe, 0.2), filled(probe, -0.3)
    client = make_client(BareScaffold, train, state=c_i, received={CONTROL: c})
    start = filled(client, 1.0)  # SimpleCNN has no buffers: these are all its arrays
    weights, _, _ = client.fit(list(start.values()), {"server-round": 1})
    assert client.steps == 2
    for name, value in zip(start, weights):
        np.testing.assert_allclose(value, 0.715, rtol=1e-5, err_msg=name)
    for name in c:
        np.testing.assert_allclose(client.state[name], 0.925, rtol=1e-5)
        np.testing.assert_allclose(client.upload[DELTA_CONTROL][name], 0.925 + 0.3, rtol=1e-5)
        assert client.state[name].dtype == client.upload[DELTA_CONTROL][name].dtype == np.float32


def test_scaffold_client_starts_from_a_zero_control_variate():
    """No state (the client's first round): c_i = 0, so each step moves by 0.1 (w + 0.2):
    w1 = 1 - 0.12 = 0.88, w2 = 0.88 - 0.108 = 0.772; c_i+ = -0.2 + (1 - 0.772) / (2 * 0.1) =
    0.94, the mean of the local gradients at w0, w1: (1 + 0.88) / 2; delta_c_i = c_i+."""
    train = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=1.0, epochs=1, batch_size=12)
    client = make_client(BareScaffold, train, received={CONTROL: filled(make_client(BareScaffold, train), 0.2)})
    start = filled(client, 1.0)
    weights, _, _ = client.fit(list(start.values()), {"server-round": 1})
    for name, value in zip(start, weights):
        np.testing.assert_allclose(value, 0.772, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(client.state[name], 0.94, rtol=1e-5)
        np.testing.assert_allclose(client.upload[DELTA_CONTROL][name], 0.94, rtol=1e-5)


def test_scaffold_client_at_two_epochs_divides_by_every_local_step():
    """Two epochs of two steps each, from the first test's start: each step moves by
    0.1 (w + 0.5), w = 1, 0.85, 0.715, 0.5935, 0.48415. Algorithm 1's option II divides by
    K = 4, every local step of the round (NIID-Bench counts them so too):
    c_i+ = -0.5 + (1 - 0.48415) / (4 * 0.1) = 0.789625, the mean of the local gradients
    wd * w at w0 to w3. K counted over one epoch (2) would give 2.07925."""
    train = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=1.0, epochs=2, batch_size=12)
    probe = make_client(BareScaffold, train)
    c, c_i = filled(probe, 0.2), filled(probe, -0.3)
    client = make_client(BareScaffold, train, state=c_i, received={CONTROL: c})
    start = filled(client, 1.0)
    weights, _, _ = client.fit(list(start.values()), {"server-round": 1})
    assert client.steps == 4
    for name, value in zip(start, weights):
        np.testing.assert_allclose(value, 0.48415, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(client.state[name], 0.789625, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(client.upload[DELTA_CONTROL][name], 0.789625 + 0.3, rtol=1e-5, err_msg=name)


def anchored_losses(client, step: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """On random logits: the cross-entropy, the client's loss with its weights at its anchor
    (the model it was sent), the loss once every weight moved by ``step``, and the number
    of weights."""
    params = dict(client.model.named_parameters())
    client.anchor = {name: p.detach().clone() for name, p in params.items()}
    logits, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0])
    at_anchor = client.loss(logits, y)
    with torch.no_grad():
        for p in params.values():
            p.add_(step)
    return F.cross_entropy(logits, y), at_anchor, client.loss(logits, y), sum(p.numel() for p in params.values())


def test_scaffold_loss_is_cross_entropy_plus_the_correction_term():
    """<y - x, c - c_i>: 0 at y = x (the recorded loss starts at the cross-entropy); with every
    weight 0.1 from x and c - c_i = 0.5, 0.05 per weight."""
    client = make_client(ScaffoldClient, TrainConfig(optimizer="sgd"))
    client.correction = {name: torch.full_like(p, 0.5) for name, p in client.model.named_parameters()}
    ce, at_anchor, moved, count = anchored_losses(client, 0.1)
    torch.testing.assert_close(at_anchor, ce)
    torch.testing.assert_close(moved, ce + 0.05 * count, rtol=1e-4, atol=1e-5)


def test_scaffold_client_without_the_control_variate_says_which_strategy_to_use():
    client = make_client(ScaffoldClient, TrainConfig(optimizer="sgd"))
    with pytest.raises(RuntimeError, match="'scaffold-c' in the train message; use strategy scaffold$"):
        client.fit(client.get_parameters({}), {"server-round": 1})


def test_feddyn_client_minimises_the_dynamic_objective_and_updates_h():
    """theta0 = 1, h_k = 0.5, alpha = 0.1, lr = 0.5; the gradient is -h_k + alpha (theta - theta0):
    theta1 = 1 + 0.5 * 0.5 = 1.25; theta2 = 1.25 - 0.5 (-0.5 + 0.1 * 0.25) = 1.4875;
    h_k <- 0.5 - 0.1 (1.4875 - 1) = 0.45125."""
    train = TrainConfig(optimizer="sgd", lr=0.5, momentum=0.0, epochs=1, batch_size=12)
    client = make_client(BareFedDyn, train)
    client.state = filled(client, 0.5)
    start = filled(client, 1.0)
    weights, _, _ = client.fit(list(start.values()), {"server-round": 1, ALPHA: 0.1})
    for name, value in zip(start, weights):
        np.testing.assert_allclose(value, 1.4875, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(client.state[name], 0.45125, rtol=1e-5)
    with pytest.raises(RuntimeError, match="use strategy feddyn"):
        make_client(FedDynClient, train).fit(list(start.values()), {"server-round": 1})


def test_feddyn_client_starts_from_h_zero():
    """No state (the client's first round): h_k = 0. theta0 = 1, alpha = 0.1, lr = 0.5 and
    weight decay 1, so the gradient is theta + 0.1 (theta - theta0): theta1 = 1 - 0.5 = 0.5;
    theta2 = 0.5 - 0.5 (0.5 - 0.05) = 0.275; h_k <- 0 - 0.1 (0.275 - 1) = 0.0725."""
    client = make_client(BareFedDyn, TrainConfig(optimizer="sgd", lr=0.5, momentum=0.0, weight_decay=1.0, epochs=1,
                                                 batch_size=12))
    start = filled(client, 1.0)
    weights, _, _ = client.fit(list(start.values()), {"server-round": 1, ALPHA: 0.1})
    for name, value in zip(start, weights):
        np.testing.assert_allclose(value, 0.275, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(client.state[name], 0.0725, rtol=1e-5)


def test_feddyn_loss_is_cross_entropy_minus_the_linear_plus_the_quadratic_term():
    """-<h_k, theta - theta^{t-1}> + (alpha / 2) ||theta - theta^{t-1}||^2: 0 at theta^{t-1};
    with h_k = 0.5, alpha = 0.1 and every weight 0.2 away, -0.1 + 0.002 = -0.098 per weight."""
    client = make_client(FedDynClient, TrainConfig(optimizer="sgd", momentum=0.0))
    client.alpha = 0.1
    client.h = {name: torch.full_like(p, 0.5) for name, p in client.model.named_parameters()}
    ce, at_anchor, moved, count = anchored_losses(client, 0.2)
    torch.testing.assert_close(at_anchor, ce)
    torch.testing.assert_close(moved, ce - 0.098 * count, rtol=1e-4, atol=1e-4)


def test_feddyn_client_at_two_epochs_keeps_its_anchor_and_updates_h_once():
    """The first FedDyn test's recursion over four steps (two epochs of two): theta =
    1, 1.25, 1.4875, 1.713125, 1.92746875, every step anchored at theta^{t-1} = 1; h_k is
    updated once, after the round: 0.5 - 0.1 (1.92746875 - 1) = 0.407253125."""
    train = TrainConfig(optimizer="sgd", lr=0.5, momentum=0.0, epochs=2, batch_size=12)
    client = make_client(BareFedDyn, train)
    client.state = filled(client, 0.5)
    start = filled(client, 1.0)
    weights, _, _ = client.fit(list(start.values()), {"server-round": 1, ALPHA: 0.1})
    for name, value in zip(start, weights):
        np.testing.assert_allclose(value, 1.92746875, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(client.state[name], 0.407253125, rtol=1e-5, err_msg=name)


class BareProximal(ProximalClient, ZeroDataLoss):
    pass


def test_proximal_client_at_two_epochs_stays_anchored_at_the_global_model():
    """mu = 1, weight decay 1, lr 0.1, from w = 1 (the global model, the anchor): each step
    moves by 0.1 (w + (w - 1)), w = 0.9, 0.82, 0.756, 0.7048 over two epochs of two steps.
    An anchor that followed the live weights (no proximal pull) would give 0.9^4 = 0.6561."""
    train = TrainConfig(optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=1.0, epochs=2, batch_size=12)
    client = make_client(BareProximal, train)
    start = filled(client, 1.0)
    weights, _, _ = client.fit(list(start.values()), {"server-round": 1, "proximal-mu": 1.0})
    assert client.steps == 4
    for name, value in zip(start, weights):
        np.testing.assert_allclose(value, 0.7048, rtol=1e-5, err_msg=name)


def test_fednova_a_norm_of_momentum_sgd():
    assert a_norm(1, 0.9) == pytest.approx(1.0)
    assert a_norm(5, 0.0) == 5.0
    # a = [1 - 0.5^3, 1 - 0.5^2, 1 - 0.5] / (1 - 0.5) = [1.75, 1.5, 1]
    assert a_norm(3, 0.5) == pytest.approx(4.25)
    # PyTorch's SGD on a loss of gradient 1 moves lr * ||a||_1 in tau steps
    for tau, rho in [(1, 0.9), (3, 0.5), (7, 0.9)]:
        p = torch.zeros(1, requires_grad=True)
        optimizer = torch.optim.SGD([p], lr=0.1, momentum=rho)
        for _ in range(tau):
            optimizer.zero_grad()
            p.sum().backward()
            optimizer.step()
        assert -p.item() / 0.1 == pytest.approx(a_norm(tau, rho), rel=1e-5)


def test_fednova_client_reports_its_steps_and_a_norm():
    client = make_client(FedNovaClient, TrainConfig(optimizer="sgd", momentum=0.5, epochs=1, batch_size=8))
    _, _, metrics = client.fit(client.get_parameters({}), {"server-round": 1})
    assert metrics[STEPS] == 3 and metrics[A_NORM] == pytest.approx(4.25)  # 24 samples, batch 8


class UnitGradient(FedMechClient):
    """The loss is the sum of the float parameters: every gradient is 1, so SGD's
    displacement counts the gradients its steps add up to (lr ||a||_1 per weight)."""

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.0 * logits.sum() + sum(p.sum() for p in self.model.parameters())


class UnitGradientFedNova(FedNovaClient, UnitGradient):
    pass


@pytest.mark.parametrize(("epochs", "momentum", "expected"), [
    # 6 steps at rho = 0.5: (6 - 0.5 (1 - 0.5^6) / 0.5) / 0.5 = 10.03125 (one epoch's 3 steps: 4.25)
    (2, 0.5, 10.03125),
    # 9 steps at rho = 0.9: (9 - 0.9 (1 - 0.9^9) / 0.1) / 0.1 = 36.874204...
    (3, 0.9, (9 - 0.9 * (1 - 0.9**9) / 0.1) / 0.1),
    (2, 0.0, 6.0),
])
def test_fednova_a_norm_counts_every_local_step_of_the_round(epochs, momentum, expected):
    """Over several epochs tau is every step of the round and the momentum runs on across
    the epochs (one optimiser per round): the reported ||a_i||_1 is what the weights moved,
    in gradients, as the authors' code accumulates it (local_normalizing_vec)."""
    client = make_client(UnitGradientFedNova, TrainConfig(optimizer="sgd", lr=0.1, momentum=momentum, epochs=epochs,
                                                          batch_size=8))
    start = filled(client, 1.0)
    weights, _, metrics = client.fit(list(start.values()), {"server-round": 1})
    assert metrics[STEPS] == 3 * epochs
    assert metrics[A_NORM] == pytest.approx(expected, rel=1e-12)
    for name, value in zip(start, weights):
        np.testing.assert_allclose((1.0 - value) / 0.1, expected, rtol=1e-4, err_msg=name)


# --- strategies ---------------------------------------------------------------------------

X = {"w": np.array([1.0, 2.0], np.float32), "bn.running_mean": np.array([0.0], np.float32)}
"""The global model: one float parameter ``w`` and a buffer."""
CLIENTS = [{"w": np.array([2.0, 2.0], np.float32), "bn.running_mean": np.array([1.0], np.float32)},
           {"w": np.array([0.0, 4.0], np.float32), "bn.running_mean": np.array([3.0], np.float32)}]
EXAMPLES = [10, 30]
N = 4
"""Clients in the federation; two of them reply."""


class FakeGrid:
    def __init__(self, node_ids) -> None:
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return list(self.node_ids)


def replies(uploads=None, metrics=None) -> list[Message]:
    """``train_replies`` of ``CLIENTS`` with a report holding each one's ``uploads`` and
    extra ``metrics``, as the ClientApp sends them."""
    msgs = train_replies(CLIENTS, EXAMPLES)
    for i, msg in enumerate(msgs):
        packed = {UPLOAD_PREFIX + k: pack(v) for k, v in (uploads[i] if uploads else {}).items()}
        msg.content[REPORT_KEY] = ConfigRecord({"partition-id": i, "details": "{}", **packed})
        for key, value in (metrics[i] if metrics else {}).items():
            msg.content["metrics"][key] = value
    return msgs


@pytest.mark.parametrize(("weighting", "w", "buffer"), [
    # uniform: x + 0.5 * mean([1, 0], [-1, 2]) = [1, 2] + 0.5 * [0, 1]
    ("uniform", [1.0, 2.5], 2.0),
    # examples: x + 0.5 * (0.25 * [1, 0] + 0.75 * [-1, 2]) = [1, 2] + 0.5 * [-0.5, 1.5]
    ("examples", [0.75, 2.75], 2.5),
])
@pytest.mark.usefixtures("flower_identity")
def test_scaffold_server_steps_the_model_and_updates_c(weighting, w, buffer):
    """c = [0.1, -0.2], eta_g = 0.5, N = 4; delta_c = [0.4, 0], [0.8, -0.4]:
    c <- c + (1/4) [1.2, -0.4] = [0.4, -0.3], of norm 0.5."""
    strategy = Scaffold({"w": np.array([0.1, -0.2], np.float32)}, N, server_lr=0.5, weighting=weighting,
                        **OFFERED_NODES_ONLY)
    sent = list(strategy.configure_train(1, to_record(X), ConfigRecord(), FakeGrid([1000, 1001])))
    for msg in sent:
        np.testing.assert_allclose(from_record(msg.content[CONTROL])["w"], [0.1, -0.2], rtol=1e-6)
    deltas = [{DELTA_CONTROL: {"w": np.array([0.4, 0.0], np.float32)}},
              {DELTA_CONTROL: {"w": np.array([0.8, -0.4], np.float32)}}]
    arrays, metrics = strategy.aggregate_train(1, replies(uploads=deltas))
    got = from_record(arrays)
    np.testing.assert_allclose(got["w"], w, rtol=1e-6)
    np.testing.assert_allclose(got["bn.running_mean"], [buffer], rtol=1e-6)  # the weighted mean, no server step
    np.testing.assert_allclose(strategy.state_arrays()["w"], [0.4, -0.3], rtol=1e-6)
    assert got["w"].dtype == strategy.state_arrays()["w"].dtype == np.float32  # the model's, and c's
    assert metrics["scaffold-control-norm"] == pytest.approx(0.5)
    resumed = Scaffold({"w": np.zeros(2, np.float32)}, N, **OFFERED_NODES_ONLY)
    resumed.load_state_arrays(strategy.state_arrays())
    sent = list(resumed.configure_train(2, to_record(X), ConfigRecord(), FakeGrid([1000])))
    np.testing.assert_allclose(from_record(sent[0].content[CONTROL])["w"], [0.4, -0.3], rtol=1e-6)


@pytest.mark.usefixtures("flower_identity")
def test_scaffold_server_names_the_client_to_pair_when_a_reply_uploads_nothing():
    strategy = Scaffold({"w": np.zeros(2, np.float32)}, N, **OFFERED_NODES_ONLY)
    list(strategy.configure_train(1, to_record(X), ConfigRecord(), FakeGrid([1000, 1001])))
    with pytest.raises(RuntimeError, match="client 0 uploaded no 'scaffold-delta-c' arrays: the strategy needs the "
                                           "client it pairs with"):
        strategy.aggregate_train(1, replies())


@pytest.mark.usefixtures("flower_identity")
def test_scaffold_with_unit_server_lr_aggregates_the_model_as_fedavg():
    strategy = Scaffold({"w": np.zeros(2, np.float32)}, N, **OFFERED_NODES_ONLY)
    list(strategy.configure_train(1, to_record(X), ConfigRecord(), FakeGrid([1000, 1001])))
    deltas = [{DELTA_CONTROL: {"w": np.zeros(2, np.float32)}}] * 2
    got = from_record(strategy.aggregate_train(1, replies(uploads=deltas))[0])
    fedavg = from_record(WeightedFedAvg().aggregate_train(1, replies())[0])
    for name in X:
        np.testing.assert_allclose(got[name], fedavg[name], rtol=1e-7)


@pytest.mark.usefixtures("flower_identity")
def test_feddyn_server_updates_h_and_corrects_the_mean():
    """alpha = 0.1, m = 4, h = [0.1, -0.2]; sum(theta_k - theta) = [1, 0] + [-1, 2] = [0, 2]:
    h <- h - (0.1 / 4) [0, 2] = [0.1, -0.25]; theta <- mean [1, 3] - h / 0.1 = [0, 5.5].
    Uniform over the clients whatever their examples; the buffer's plain mean is 2."""
    strategy = FedDyn({"w": np.array([0.1, -0.2], np.float32)}, alpha=0.1, num_clients=N, **OFFERED_NODES_ONLY)
    sent = list(strategy.configure_train(1, to_record(X), ConfigRecord(), FakeGrid([1000, 1001])))
    assert [m.content["config"][ALPHA] for m in sent] == [0.1, 0.1]
    arrays, metrics = strategy.aggregate_train(1, replies())
    got = from_record(arrays)
    np.testing.assert_allclose(got["w"], [0.0, 5.5], atol=1e-6)
    np.testing.assert_allclose(got["bn.running_mean"], [2.0])
    np.testing.assert_allclose(strategy.state_arrays()["h/w"], [0.1, -0.25], rtol=1e-6)
    assert got["w"].dtype == strategy.h["w"].dtype == np.float32  # the model's, and h's
    assert metrics["feddyn-h-norm"] == pytest.approx(math.sqrt(0.1**2 + 0.25**2), rel=1e-6)
    # what the authors report, and the run evaluates: the plain mean, not theta
    reported = strategy.reported(got)
    np.testing.assert_allclose(reported["w"], [1.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(reported["bn.running_mean"], [2.0])
    resumed = FedDyn({"w": np.zeros(2, np.float32)}, alpha=0.1, num_clients=N, **OFFERED_NODES_ONLY)
    assert resumed.reported(X) is X  # before any aggregation: the model sent, and a state of h only
    assert list(resumed.state_arrays()) == ["h/w"]
    resumed.load_state_arrays(strategy.state_arrays())
    np.testing.assert_array_equal(resumed.reported(got)["w"], reported["w"])
    np.testing.assert_array_equal(resumed.h["w"], strategy.h["w"])


@pytest.mark.usefixtures("flower_identity")
def test_fednova_normalises_the_updates_by_the_clients_steps():
    """p = [0.25, 0.75]; ||a|| = [1, 4]: d = (x - y_i) / ||a_i|| = [-1, 0] / 1 and [1, -2] / 4;
    tau_eff = 0.25 * 1 + 0.75 * 4 = 3.25;
    x - 3.25 (0.25 [-1, 0] + 0.75 [0.25, -0.5]) = [1, 2] - 3.25 [-0.0625, -0.375] = [1.203125, 3.21875].
    FedAvg would give 0.25 [2, 2] + 0.75 [0, 4] = [0.5, 3.5]."""
    strategy = FedNova(["w"], **OFFERED_NODES_ONLY)
    list(strategy.configure_train(1, to_record(X), ConfigRecord(), FakeGrid([1000, 1001])))
    arrays, metrics = strategy.aggregate_train(1, replies(metrics=[{A_NORM: 1.0}, {A_NORM: 4.0}]))
    got = from_record(arrays)
    np.testing.assert_allclose(got["w"], [1.203125, 3.21875], rtol=1e-6)
    assert got["w"].dtype == np.float32
    np.testing.assert_allclose(got["bn.running_mean"], [2.5])  # the examples-weighted mean
    assert metrics["fednova-tau-eff"] == pytest.approx(3.25)
    # equal steps: FedAvg's aggregate
    equal = from_record(strategy.aggregate_train(1, replies(metrics=[{A_NORM: 3.0}, {A_NORM: 3.0}]))[0])
    np.testing.assert_allclose(equal["w"], [0.5, 3.5], rtol=1e-6)
    with pytest.raises(RuntimeError, match="^a client reported no 'fednova-a-norm': fednova needs the fednova client$"):
        strategy.aggregate_train(1, replies())


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "fednova"])
def test_registered_factory_trains_every_offered_node_with_the_weighting_asked(name):
    """The factories pass the run's sampling and ``weighting`` on (FedDyn is uniform, its paper's mean)."""
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=4, image_size=8)
    ctx = StrategyContext(num_classes=4, num_rounds=2, seed=0, round_timeout_s=60.0, initial=model_arrays(model),
                          build_model=lambda arrays: model, audit=None, num_clients=N)
    entry = STRATEGIES.get(name)
    params = entry.config_cls() if name == "feddyn" else entry.config_cls(weighting="uniform")
    strategy = entry.factory(params, ctx)
    assert strategy.weighting == "uniform"
    assert (strategy.fraction_train, strategy.fraction_evaluate, strategy.min_train_nodes,
            strategy.min_available_nodes) == (1.0, 0.0, 1, 1)


def test_fednova_refuses_another_optimizer_at_load():
    with pytest.raises(ConfigError, match=r"^fednova .*, but train.optimizer is adam; set train.optimizer=sgd in "):
        smoke_config(["strategy={name: fednova}", "client={name: fednova}", "train.optimizer=adam"])


# --- runs ---------------------------------------------------------------------------------

DENSE_SGD = ["pruning.mode=dense", "train.optimizer=sgd", "train.lr=0.05", "train.momentum=0"]


@pytest.mark.parametrize(("method", "server_state"), [("scaffold", "strategy/"), ("feddyn", "strategy/h/")])
def test_a_dropped_reply_leaves_no_state_on_its_node(tmp_path, method, server_state):
    """Client 1's round-1 reply has NaN weights and is dropped (policy continue), but its
    node kept the c_1 (h_1) its training computed. Its round-2 message carries the state
    the server accepted (none: zeros), so after round 2, where every reply is accepted,
    the server's state is still the mean of the clients' accepted states: c = (1/N) sum c_i,
    h = (1/m) sum h_k. Had the node kept its moved state, round 2's update of client 1
    would start from it and the server's c (h) would miss that move."""
    from faults import Fault, faulty_app
    from fedmech_flwr.app.inprocess import run_in_process
    from fedmech_flwr.artifacts.folder import STATE_FILE, read_records

    cfg = smoke_config([*DENSE_SGD, f"strategy={{name: {method}}}", f"client={{name: {method}}}",
                        "federation.on_client_failure=continue"])
    run = run_in_process(cfg, tmp_path, faulty_app(Fault("nan", 1, 1)))
    assert [r["clients_succeeded"] for r in read_records(run, "eval")] == [[], [0, 2], [0, 1, 2]]
    state = load_arrays(run / STATE_FILE)
    names = [k.removeprefix(server_state) for k in state if k.startswith(server_state)]
    assert names and all(f"clients/{partition_id}/{name}" in state
                         for partition_id in range(3) for name in names)
    for name in names:
        mean = sum(state[f"clients/{partition_id}/{name}"].astype(np.float64) for partition_id in range(3)) / 3
        np.testing.assert_allclose(state[server_state + name], mean, rtol=1e-4, atol=1e-7, err_msg=name)

def test_feddyn_run_evaluates_the_plain_mean_and_records_the_sent_model(tmp_path):
    """The eval records and the final model are the clients' plain mean (the authors'
    avg_model); theta = mean - h / alpha, which the clients get, is the resume point's model
    and its accuracy the strategy metric sent_model_accuracy."""
    from fedmech_flwr.app.inprocess import run_in_process
    from fedmech_flwr.spec.experiment import load_data, new_model
    from fedmech_flwr.artifacts.folder import STATE_FILE, read_records
    from fedmech_flwr.learning.training import evaluate

    cfg = smoke_config([*DENSE_SGD, "strategy={name: feddyn, alpha: 0.1}", "client={name: feddyn}"])
    run = run_in_process(cfg, tmp_path)
    final, state = load_arrays(run / "model_final.safetensors"), load_arrays(run / STATE_FILE)
    bundle = load_data(cfg)
    model = new_model(cfg, bundle, torch.device("cpu"))

    def tested(arrays):
        load_model_arrays(model, {k: arrays[k] for k in model.state_dict()})
        return evaluate(model.eval(), bundle.x_test, bundle.y_test, bundle.num_classes, cfg.eval_batch_size)

    for name in final:
        np.testing.assert_array_equal(final[name], state[f"strategy/mean/{name}"])
    assert not np.array_equal(final["conv1.weight"], state["model/conv1.weight"])  # theta differs from the mean
    last_eval = read_records(run, "eval")[-1]
    assert last_eval["accuracy"] == tested(final).accuracy
    sent = [r for r in read_records(run, "strategy") if "sent_model_accuracy" in r]
    assert [r["round"] for r in sent] == [1, 2]
    assert sent[-1]["sent_model_accuracy"] == tested({k.removeprefix("model/"): v for k, v in state.items()
                                                       if k.startswith("model/")}).accuracy


def test_scaffold_feddyn_and_fednova_refuse_pruning_with_the_reason():
    for method in ("scaffold", "feddyn", "fednova"):
        with pytest.raises(ConfigError, match=rf"{method} updates .* pruning.mode=magnitude count the weights the "
                                              r"pruner set to 0 .*; set pruning.mode=dense"):
            smoke_config([*DENSE_SGD[1:], f"strategy={{name: {method}}}", f"client={{name: {method}}}"])
        smoke_config([*DENSE_SGD, f"strategy={{name: {method}}}", f"client={{name: {method}}}"])


@pytest.mark.parametrize(("method", "evidence"), [
    ("feddyn", r"as its paper and its authors' code do \(at SGD momentum 0.9 every client returned non-finite "
               r"weights by round 9 of 15 on Fashion-MNIST, Dirichlet 0.05\)"),
    ("scaffold", r"as option II of its paper assumes \(at SGD momentum 0.9 it diverged within 20 rounds on "
                 r"Fashion-MNIST in all three Dirichlet 0.05 seeds\)"),
])
@pytest.mark.parametrize("optimizer", ["train.momentum=0.9", "train.optimizer=adam"])
def test_plain_sgd_methods_refuse_momentum_and_other_optimizers_with_the_evidence(method, evidence, optimizer):
    """FedDyn and SCAFFOLD diverged at the leaderboard's SGD with momentum 0.9; their papers
    take plain SGD steps."""
    with pytest.raises(ConfigError, match=rf"^{method} takes plain SGD steps, {evidence}, but train.optimizer is "
                                          r"\w+ with train.momentum [\d.]+; set train.optimizer=sgd and "
                                          r"train.momentum=0 in .*smoke.yaml: strategy$"):
        smoke_config([*DENSE_SGD, optimizer, f"strategy={{name: {method}}}", f"client={{name: {method}}}"])


def test_scaffold_state_survives_a_resume(tmp_path):
    """The issue's test: killed after round 2, resumed, it ends bitwise as the uninterrupted run."""
    scaffold = [*DENSE_SGD, "federation.num_rounds=3", "federation.checkpoint_every=2",
                "strategy={name: scaffold}", "client={name: scaffold}"]
    state = killed_then_resumed(scaffold, tmp_path, 1, 3)
    assert state["round"] == 2 and np.any(state["strategy/conv1.weight"] != 0)
    for client in range(3):  # every client's c_i, moved from zero
        assert np.any(state[f"clients/{client}/conv1.weight"] != 0)
