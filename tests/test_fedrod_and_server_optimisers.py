"""FedRoD's client against closed forms, Flower's server optimisers (wrapped) against
hand-computed steps, their state across a resume, and one smoke run of each."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from flwr.app import ConfigRecord
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi

from conftest import killed_then_resumed, smoke_config
from fedmech_flwr.app.inprocess import InProcessGrid, run_in_process, train_replies
from fedmech_flwr.artifacts.folder import STATE_FILE, read_records, read_status
from fedmech_flwr.builtin.clients.fedrod import FedRoDClient, FedRoDConfig
from fedmech_flwr.builtin.strategies.fedavg import WeightedFedAvg
from fedmech_flwr.builtin.strategies.fedopt import FedAdagradConfig, FedAdamConfig, FedAvgMConfig, FedYogiConfig
from fedmech_flwr.contracts.client import ClientData, FedMechClient
from fedmech_flwr.contracts.strategy import STRATEGIES
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_arrays, to_record
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig
from fedmech_flwr.models import build_model

# --- FedRoD's client ----------------------------------------------------------------------

LABELS = (0, 0, 0, 1, 1, 2)
"""x 4: class counts n = (12, 8, 4, 0); class 3 is absent."""


def fedrod_client(state: NamedArrays | None = None, lr: float = 0.01, epochs: int = 1,
                  labels: tuple[int, ...] = LABELS * 4) -> FedRoDClient:
    torch.manual_seed(0)
    y = torch.tensor(labels)
    data = ClientData(torch.randn(len(y), 1, 8, 8), y, num_classes=4)
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=4, image_size=8)
    return FedRoDClient(FedRoDConfig(min_count=1e-8), model=model, data=data,
                        train=TrainConfig(epochs=epochs, batch_size=8, lr=lr), pruning=PruningConfig(mode="dense"),
                        seed=0, partition_id=0, state=state)


def test_balanced_softmax_is_cross_entropy_of_logits_plus_log_counts():
    client = fedrod_client()
    # zero logits: p(y) = n_y / sum(n) = n_y / 24, so the losses are -log(12/24) = log 2 for
    # class 0 and -log(4/24) = log 6 for class 2; with logits (0, log 2, 0, 5) the scores
    # n_c e^{z_c} are (12, 16, 4, 1e-8 e^5): class 1 has 16/32, a loss of log 2 (the absent
    # class, however high its logit, weighs ~1e-6)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, math.log(2), 0.0, 5.0]])
    y = torch.tensor([0, 2, 1])
    expected = (math.log(2) + math.log(6) + math.log(2)) / 3
    assert client.balanced_softmax(logits, y).item() == pytest.approx(expected, abs=1e-5)
    assert F.cross_entropy(logits, y).item() != pytest.approx(expected, abs=1e-2)  # not plain cross-entropy


def test_the_personal_head_steps_on_its_own_loss_and_never_moves_the_body():
    client = fedrod_client(lr=0.1)
    x, y = client.data.x[:8], client.data.y[:8]
    client.model.zero_grad(set_to_none=True)
    loss, logits = client.objective(x, y)
    # the P-head's backward reached no parameter of the model (body and G-head)
    assert all(p.grad is None for p in client.model.parameters())
    # ... and stepped the P-head from zeros: SGD-like first Adam step of -lr sign(grad)
    assert client.personal.weight.abs().max().item() == pytest.approx(0.1, rel=1e-3)
    loss.backward()
    with_personal = {n: p.grad.clone() for n, p in client.model.named_parameters()}

    # the same batch with no personal head at all: L_BSM = CE(g + log n), counts by hand
    client.model.zero_grad(set_to_none=True)
    log_n = torch.log(torch.tensor([12.0, 8.0, 4.0, 1e-8]))
    F.cross_entropy(client.model(x) + log_n, y).backward()
    for name, p in client.model.named_parameters():
        torch.testing.assert_close(with_personal[name], p.grad, rtol=0, atol=0)
    torch.testing.assert_close(logits, client.model(x))  # the generic logits, not the personalised ones


def test_the_personal_head_learns_a_residual_on_the_generic_logits():
    """L_P = CE(g + phi(f), y): from phi = 0, one SGD step of lr 1 moves phi's weight by
    -(softmax(g) - onehot(y))^T f / N and its bias by -mean(softmax(g) - onehot(y)). A
    P-head trained on its own logits, CE(phi(f), y), would use softmax(0) = 1/K instead."""
    client = fedrod_client()
    client.personal_optimizer = torch.optim.SGD(client.personal.parameters(), lr=1.0)
    x, y = client.data.x[:8], client.data.y[:8]
    with torch.no_grad():
        features = client.model.forward_features(x)
        residual = F.softmax(client.model.forward_head(features), dim=1) - F.one_hot(y, 4)
    client.objective(x, y)
    torch.testing.assert_close(client.personal.weight.detach(), -residual.T @ features / 8, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(client.personal.bias.detach(), -residual.mean(0), rtol=1e-5, atol=1e-7)


def test_the_personal_head_survives_rounds_in_the_state_and_never_leaves_in_the_weights():
    first = fedrod_client()
    assert first.personal.weight.abs().sum().item() == 0 and first.personal.bias.abs().sum().item() == 0
    names = list(first.model.state_dict())
    start = [a.copy() for a in first.get_parameters({})]
    weights, num_examples, metrics = first.fit(start, {"server-round": 1})
    assert [w.shape for w in weights] == [v.shape for v in first.model.state_dict().values()]  # the model, only
    assert len(weights) == len(names) and num_examples == len(LABELS) * 4
    state = first.state
    assert sorted(state) == ["personal-head.bias", "personal-head.weight"]
    assert state["personal-head.weight"].shape == (4, first.model.feature_dim)
    assert all(v.dtype == np.float32 for v in state.values()) and np.abs(state["personal-head.weight"]).sum() > 0
    assert 0.0 <= metrics["fedrod-personal-accuracy"] <= 1.0

    second = fedrod_client(state=state)  # next round: built afresh with the node's state
    np.testing.assert_array_equal(second.personal.weight.detach().numpy(), state["personal-head.weight"])
    np.testing.assert_array_equal(second.personal.bias.detach().numpy(), state["personal-head.bias"])
    second.fit(weights, {"server-round": 2})
    assert not np.array_equal(second.state["personal-head.weight"], state["personal-head.weight"])


def test_personal_accuracy_scores_the_generic_plus_personal_prediction():
    # with a vanishing learning rate nothing moves: the P-head stays ~0, so the
    # personalised prediction is the generic one, scored on all the round's samples
    client = fedrod_client(lr=1e-12, epochs=2)
    with torch.no_grad():
        expected = (client.model(client.data.x).argmax(1) == client.data.y).float().mean().item()
    _, _, metrics = client.fit([a.copy() for a in client.get_parameters({})], {"server-round": 1})
    assert metrics["fedrod-personal-accuracy"] == pytest.approx(expected)
    assert client.personal_seen == len(client.data.y)  # the last epoch's samples, once each


def test_personal_accuracy_of_a_one_sample_client_is_its_one_prediction():
    """One sample, predicted right (its label is the untrained model's prediction): 1."""
    probe = fedrod_client(labels=(0,))
    with torch.no_grad():
        label = int(probe.model(probe.data.x).argmax())
    client = fedrod_client(lr=1e-12, labels=(label,))
    _, _, metrics = client.fit([a.copy() for a in client.get_parameters({})], {"server-round": 1})
    assert metrics["fedrod-personal-accuracy"] == 1.0


def test_fedrod_trains_on_the_rounds_seeded_subset():
    """With ``max_samples_per_round``: the plain client's subset, drawn by the round's
    (seeded) generator, and its size, which starts each epoch of the personal accuracy."""
    client = fedrod_client()
    client.train.max_samples_per_round = 10
    x, y = client.round_data(torch.Generator().manual_seed(1))
    plain_x, plain_y = FedMechClient.round_data(client, torch.Generator().manual_seed(1))
    assert torch.equal(x, plain_x) and torch.equal(y, plain_y) and client.round_size == 10


# --- Flower's server optimisers ----------------------------------------------------------

MODEL = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(5, np.int64)}
"""x_t: a float32 weight and an integer buffer (BatchNorm's counter), in model order."""
CLIENTS = [{"w": np.array([2.0, 2.0], np.float32), "n": np.array(7, np.int64)},
           {"w": np.array([0.0, 4.0], np.float32), "n": np.array(10, np.int64)}]
EXAMPLES = [1, 3]
"""The mean by examples: w (0.5, 3.5), so Delta = (-0.5, 1.5); n (7 + 30) / 4 = 9.25 -> 9."""


class WeightAndCounter(nn.Module):
    """MODEL's module: ``w`` a parameter, ``n`` a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.register_buffer("n", torch.zeros((), dtype=torch.int64))


def _ctx(initial: NamedArrays = MODEL, pruned: bool = False) -> SimpleNamespace:
    """The fields of the StrategyContext the wrappers read: the model (``initial``), a
    builder (which names its parameters) and whether the clients prune."""
    return SimpleNamespace(initial=initial, build_model=lambda arrays: WeightAndCounter(), pruned=pruned)


def send(strategy, arrays: NamedArrays, server_round: int = 1) -> None:
    """Send ``arrays`` as round ``server_round``'s model (in the model's order, as the run
    sends it, a resumed run's too): what ``configure_train`` keeps as x_t."""
    record = to_record(arrays)
    list(strategy.configure_train(server_round, record, ConfigRecord(), InProcessGrid(ClientApp(), 2)))


def step(strategy, models: list[NamedArrays], server_round: int = 1) -> tuple[NamedArrays, dict]:
    arrays, metrics = strategy.aggregate_train(server_round, train_replies(models, EXAMPLES))
    return from_record(arrays), dict(metrics)


def test_fedadam_step_is_reddi_et_al_algorithm_2_with_flowers_bias_correction():
    strategy = STRATEGIES.get("fedadam").factory(FedAdamConfig(), _ctx())
    send(strategy, MODEL)
    got, metrics = step(strategy, CLIENTS)
    # Algorithm 2, eta 0.1, beta_1 0.9, beta_2 0.99, tau 1e-3, from m = v = 0:
    # m = 0.1 Delta = (-0.05, 0.15), v = 0.01 Delta^2 = (0.0025, 0.0225), sqrt(v) = (0.05, 0.15)
    # Flower's eta_1 = 0.1 sqrt(1 - 0.99^2) / (1 - 0.9^2) = 0.0742460
    # w = (1 - eta_1 0.05 / 0.051, 2 + eta_1 0.15 / 0.151) = (0.927210, 2.073754)
    eta_1 = 0.1 * math.sqrt(1 - 0.99**2) / (1 - 0.9**2)
    w = np.array([1 - eta_1 * 0.05 / 0.051, 2 + eta_1 * 0.15 / 0.151])
    np.testing.assert_allclose(got["w"], w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["w"], [0.927210, 2.073754], rtol=0, atol=1e-6)
    assert list(got) == ["w", "n"] and got["w"].dtype == np.float32  # Flower returns float64, in its order
    # n, a buffer, is averaged and never stepped: 9 (Flower's step would give 5.074 -> 5)
    assert got["n"].dtype == np.int64 and got["n"].item() == 9
    assert metrics["fedopt-update-norm"] == pytest.approx(np.linalg.norm(w - [1.0, 2.0]), rel=1e-5)


def test_fedavgm_steps_are_hsu_et_al_server_momentum():
    strategy = STRATEGIES.get("fedavgm").factory(FedAvgMConfig(server_learning_rate=0.5, server_momentum=0.9), _ctx())
    send(strategy, MODEL)
    got, _ = step(strategy, CLIENTS)
    # g_1 = x_1 - mean = (0.5, -1.5), v_1 = g_1, x_2 = x_1 - 0.5 v_1 = (0.75, 2.75)
    np.testing.assert_allclose(got["w"], [0.75, 2.75], rtol=0, atol=1e-6)
    # n, a buffer: the mean 9, never stepped (Flower's step: 5 + 0.5 * 4 = 7)
    assert got["n"].dtype == np.int64 and got["n"].item() == 9
    send(strategy, got, server_round=2)
    got, metrics = step(strategy, [{"w": np.array([1.0, 2.0], np.float32), "n": np.array(7, np.int64)}] * 2, 2)
    # g_2 = x_2 - (1, 2) = (-0.25, 0.75), v_2 = 0.9 v_1 + g_2 = (0.2, -0.6), x_3 = x_2 - 0.5 v_2 = (0.65, 3.05)
    np.testing.assert_allclose(got["w"], [0.65, 3.05], rtol=0, atol=1e-6)
    assert got["w"].dtype == np.float32 and list(got) == ["w", "n"]
    # n: the mean 7 (with Flower's momentum on it: 9 + 0.5 * 0.9 * 4 -> 11)
    assert got["n"].item() == 7
    assert metrics["fedopt-update-norm"] == pytest.approx(math.hypot(0.1, 0.3), rel=1e-5)


SAME = [{"w": np.array([1.0, 2.0], np.float32), "n": np.array(5, np.int64)}] * 2
"""Round 2's replies: both clients return (1, 2), so Delta_2 = (1, 2) - x_2."""


def test_fedyogi_steps_are_reddi_et_al_algorithm_2_with_yogis_second_moment():
    strategy = STRATEGIES.get("fedyogi").factory(FedYogiConfig(), _ctx())
    send(strategy, MODEL)
    got, _ = step(strategy, CLIENTS)
    # eta 0.01 (no bias correction in Flower's FedYogi), beta_1 0.9, beta_2 0.99, tau 1e-3, from m = v = 0:
    # Delta_1 = (-0.5, 1.5), m_1 = (-0.05, 0.15), v_1 = 0 - 0.01 Delta^2 sign(0 - Delta^2) = (0.0025, 0.0225)
    # x_2 = (1 - 0.01 * 0.05 / 0.051, 2 + 0.01 * 0.15 / 0.151) = (0.990196, 2.009934)
    x_2 = np.array([1 - 0.01 * 0.05 / 0.051, 2 + 0.01 * 0.15 / 0.151])
    np.testing.assert_allclose(got["w"], x_2, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["w"], [0.990196, 2.009934], rtol=0, atol=1e-6)
    x_2 = got["w"].astype(np.float64)  # as sent: in float32
    send(strategy, got, 2)
    got, _ = step(strategy, SAME, 2)
    # Delta_2 = (1, 2) - x_2, m_2 = 0.9 m_1 + 0.1 Delta_2; Yogi: v_2 = v_1 - 0.01 Delta_2^2 sign(v_1 - Delta_2^2),
    # v_1 > Delta_2^2 so v_2 = v_1 - 0.01 Delta_2^2 (Adam's 0.99 v_1 + 0.01 Delta_2^2 gives x_3 4e-5 away)
    d_2 = np.array([1.0, 2.0]) - x_2
    m_2 = 0.9 * np.array([-0.05, 0.15]) + 0.1 * d_2
    v_2 = np.array([0.0025, 0.0225]) - 0.01 * d_2**2
    np.testing.assert_allclose(got["w"], x_2 + 0.01 * m_2 / (np.sqrt(v_2) + 1e-3), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["w"], [0.981563, 2.018809], rtol=0, atol=1e-6)


def test_fedadagrad_steps_are_reddi_et_al_algorithm_2_with_adagrads_sum():
    strategy = STRATEGIES.get("fedadagrad").factory(FedAdagradConfig(), _ctx())
    send(strategy, MODEL)
    got, _ = step(strategy, CLIENTS)
    # eta 0.1, tau 1e-3, beta_1 = 0 (m_t = Delta_t), v_1 = Delta_1^2 = (0.25, 2.25):
    # x_2 = (1 - 0.1 * 0.5 / 0.501, 2 + 0.1 * 1.5 / 1.501) = (0.900200, 2.099933)
    x_2 = np.array([1 - 0.1 * 0.5 / 0.501, 2 + 0.1 * 1.5 / 1.501])
    np.testing.assert_allclose(got["w"], x_2, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["w"], [0.900200, 2.099933], rtol=0, atol=1e-6)
    x_2 = got["w"].astype(np.float64)  # as sent: in float32
    send(strategy, got, 2)
    got, _ = step(strategy, SAME, 2)
    # Delta_2 = (1, 2) - x_2 = (0.0998, -0.0999); v_2 = v_1 + Delta_2^2 (a sum, not a decaying mean)
    d_2 = np.array([1.0, 2.0]) - x_2
    v_2 = np.array([0.25, 2.25]) + d_2**2
    np.testing.assert_allclose(got["w"], x_2 + 0.1 * d_2 / (np.sqrt(v_2) + 1e-3), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got["w"], [0.919735, 2.093290], rtol=0, atol=1e-6)


SERVER_OPTIMISERS = [("fedadam", FedAdamConfig()), ("fedyogi", FedYogiConfig()), ("fedadagrad", FedAdagradConfig()),
                     ("fedavgm", FedAvgMConfig(server_learning_rate=0.5, server_momentum=0.9))]
"""FedAvgM at eta 0.5: at eta 1, x_{t+1} = mean - beta v_{t-1}, whatever x_t it steps from."""


@pytest.mark.parametrize(("name", "params"), SERVER_OPTIMISERS)
def test_a_server_optimiser_over_pruned_clients_keeps_fedavgs_zeros(name, params):
    """Three rounds of replies from clients that prune (a shared random support per round,
    each client zeroing more): each aggregate is 0 exactly where FedAvg's mean of the same
    replies is, the optimiser's state is 0 there, and the buffer is the mean, never stepped.
    Flower's own step moved such weights to about 0.27 (FedAdam) in three rounds."""
    rng = np.random.default_rng(0)
    initial = {"w": rng.normal(size=(40,)).astype(np.float32), "n": np.array(5, np.int64)}
    strategy = STRATEGIES.get(name).factory(params, _ctx(initial, pruned=True))
    x = initial
    for server_round in (1, 2, 3):
        send(strategy, x, server_round)
        support = rng.random(40) < 0.5
        replies = [{"w": np.where(support & (rng.random(40) < 0.8), rng.normal(size=40), 0).astype(np.float32),
                    "n": np.array(10 * server_round + i, np.int64)} for i in range(2)]
        x, _ = step(strategy, replies, server_round)
        fedavg = from_record(WeightedFedAvg().aggregate_train(server_round, train_replies(replies, EXAMPLES))[0])
        assert (fedavg["w"] == 0).sum() >= 8  # the test prunes
        np.testing.assert_array_equal(x["w"] == 0, fedavg["w"] == 0, err_msg=f"round {server_round}")
        assert x["n"] == fedavg["n"]
        state = strategy.state_arrays()
        for key in ("m_t/w", "v_t/w", "momentum_vector/w"):
            if key in state:
                assert not state[key][fedavg["w"] == 0].any(), key
    assert not np.allclose(x["w"], fedavg["w"])  # the coordinates some client kept were stepped


@pytest.mark.parametrize(("name", "params"), SERVER_OPTIMISERS)
def test_a_server_optimiser_over_dense_clients_steps_every_weight(name, params):
    """Without pruning, a weight whose mean is 0 two rounds running is stepped as Flower
    steps it (the rule holds the zeros of pruned clients only)."""
    strategy = STRATEGIES.get(name).factory(params, _ctx())
    got = MODEL
    for server_round in (1, 2):
        send(strategy, got, server_round)
        got, _ = step(strategy, [{"w": np.array([0.0, 2.0], np.float32), "n": np.array(5, np.int64)}] * 2,
                      server_round)
    assert got["w"][0] != 0


@pytest.mark.parametrize(("name", "params"), SERVER_OPTIMISERS)
def test_a_strategy_rebuilt_from_its_state_takes_the_same_next_step(name, params):
    factory = STRATEGIES.get(name).factory
    again = [{"w": np.array([3.0, -1.0], np.float32), "n": np.array(2, np.int64)}, CLIENTS[0]]
    original = factory(params, _ctx())
    send(original, MODEL)
    after_one, _ = step(original, CLIENTS)
    saved = {k: v.copy() for k, v in original.state_arrays().items()}
    assert saved and all(isinstance(v, np.ndarray) for v in saved.values())
    # round 2 sends a model other than the aggregate, as pruning.server_reprune does: FedAvgM steps from its own
    sent = {**after_one, "w": after_one["w"] * np.array([1, 0], np.float32)}
    send(original, sent, 2)
    expected, _ = step(original, again, 2)

    resumed = factory(params, _ctx())
    resumed.load_state_arrays(dict(sorted(saved.items())))  # as the state file gives them back: in name order
    send(resumed, sent, 2)
    got, _ = step(resumed, again, 2)
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k])
    fresh = factory(params, _ctx())  # without the state the step differs: the test can fail
    fresh.load_state_arrays({})  # an empty state is no state
    send(fresh, sent, 2)
    assert not np.array_equal(step(fresh, again, 2)[0]["w"], expected["w"])


@pytest.mark.parametrize(("name", "params"), SERVER_OPTIMISERS)
def test_a_checkpoint_before_the_first_step_gives_the_uninterrupted_step(name, params):
    """A checkpoint of a round whose replies all failed holds no moments (FedAvgM: its x_t
    only; the others nothing, as an empty state): the resumed first step is the uninterrupted one's."""
    factory = STRATEGIES.get(name).factory
    original = factory(params, _ctx())
    send(original, MODEL)
    saved = original.state_arrays()
    expected, _ = step(original, CLIENTS)
    for state in (saved, {}):
        resumed = factory(params, _ctx())
        resumed.load_state_arrays(state)
        send(resumed, MODEL)
        got, _ = step(resumed, CLIENTS)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k])


@pytest.mark.parametrize(("name", "flower"), [
    ("fedadam", FedAdam), ("fedyogi", FedYogi), ("fedadagrad", FedAdagrad), ("fedavgm", FedAvgM)])
def test_configs_hold_flowers_arguments_and_defaults(name, flower):
    entry = STRATEGIES.get(name)
    ours = {k: v for k, v in vars(entry.config_cls()).items() if k != "weighting"}
    theirs = inspect.signature(flower).parameters
    assert ours == {k: theirs[k].default for k in ours}
    strategy = entry.factory(entry.config_cls(weighting="uniform"), _ctx())
    assert isinstance(strategy, flower) and strategy.weighting == "uniform"
    assert strategy.fraction_train == 1.0 and strategy.fraction_evaluate == 0.0 and strategy.min_train_nodes == 1
    assert "eta_l" not in ours  # Flower's client learning rate, only logged: refused (below), Flower's default kept
    if "eta_l" in theirs:
        assert strategy.eta_l == theirs["eta_l"].default


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_flowers_unused_client_learning_rate_is_refused(name):
    """Flower only logs ``eta_l``; the clients train with ``train.lr``: accepting it would
    let a user believe it set their learning rate."""
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['eta_l'\]; .*allowed keys: ") as err:
        smoke_config([f"strategy={{name: {name}, eta_l: 0.01}}"])
    assert err.value.where.endswith("strategy"), err.value.where


# --- runs ------------------------------------------------------------------------------------



@pytest.mark.parametrize(("strategy", "state_key"), [
    ("{name: fedadam}", "strategy/v_t/conv1.weight"),
    ("{name: fedavgm, server_momentum: 0.9}", "strategy/momentum_vector/conv1.weight"),
])
def test_a_killed_run_resumes_with_the_server_optimisers_state(tmp_path, strategy, state_key):
    """Killed in round 2, resumed from round 1's state: without the optimiser's state
    the resumed round 2 would step from fresh moments and differ."""
    state = killed_then_resumed([f"strategy={strategy}"], tmp_path, 1, 2)
    assert state["round"] == 1 and state_key in state


@pytest.mark.parametrize(("strategy", "client"), [
    ("fedrod", "fedrod"), ("fedadam", "plain"), ("fedyogi", "plain"), ("fedadagrad", "plain"),
    ("fedavgm", "plain")])
def test_smoke_run_records_the_declared_metrics(tmp_path, strategy, client):
    cfg = smoke_config([f"strategy={{name: {strategy}}}", f"client={{name: {client}}}", "data.audit_per_class=15",
                        "diagnostics=[{name: misalignment, head_samples: 20, probe: {epochs: 5}, head: {epochs: 1}}]"])
    run = run_in_process(cfg, tmp_path)
    assert read_status(run)["status"] == "completed"
    declared = STRATEGIES.get(strategy).outputs.metrics
    records = read_records(run, "strategy")
    assert [r["round"] for r in records] == [1, 2]
    for key, metric in declared.items():
        assert all(isinstance(r[metric.path[0]], float) for r in records), key
    assert [r["round"] for r in read_records(run, "diagnostic") if r["name"] == "misalignment"] == [1, 2]
    final = load_arrays(run / "model_final.safetensors")
    assert all(v.dtype == np.float32 for v in final.values())  # as the model's, not Flower's float64
    state = load_arrays(run / STATE_FILE)
    held = sorted(k for k in state if k.startswith("clients/"))
    if client == "fedrod":  # each client's P-head stays in its state, never in the model
        assert held == [f"clients/{partition_id}/personal-head.{p}"
                        for partition_id in range(3) for p in ("bias", "weight")]
        assert not any("personal" in k for k in final)
    else:
        assert held == []
