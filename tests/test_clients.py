"""Client plug-ins: the proximal term, FedLC's calibrated loss and FedBABU's frozen head
against closed forms, FedProx's and FedBABU's server sides against hand-computed
aggregates, and the strategy's train config reaching the client in a run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord
from flwr.clientapp import ClientApp

from fedmech_flwr.app.inprocess import InProcessGrid, run_in_process, train_replies
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.builtin.clients.fedbabu import FedBABUClient
from fedmech_flwr.builtin.clients.fedlc import FedLCClient, FedLCConfig
from fedmech_flwr.builtin.clients.proximal import ProximalClient
from fedmech_flwr.builtin.strategies.fedavg import FedAvgConfig
from fedmech_flwr.builtin.strategies.fedbabu import FedBABU
from fedmech_flwr.builtin.strategies.fedprox import FedProxConfig
from fedmech_flwr.contracts.client import ClientData, FedMechClient
from fedmech_flwr.contracts.strategy import STRATEGIES, StrategyContext
from fedmech_flwr.learning.arrays import from_record, model_arrays, to_record
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig
from fedmech_flwr.models import build_model


def make_client(cls, params=None, labels=(0, 0, 0, 1, 1, 2), pruning: PruningConfig | None = None):
    torch.manual_seed(0)
    y = torch.tensor(labels * 4)
    data = ClientData(torch.randn(len(y), 1, 8, 8), y, num_classes=4)
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=4, image_size=8)
    return cls(params, model=model, data=data, train=TrainConfig(epochs=1, batch_size=8, lr=0.01),
               pruning=pruning or PruningConfig(mode="dense"), seed=0, partition_id=0)


def test_proximal_loss_is_cross_entropy_plus_half_mu_squared_distance():
    client = make_client(ProximalClient)
    client.mu = 0.4
    client.anchor = [p.detach().clone() for p in client.model.parameters()]
    with torch.no_grad():
        for p in client.model.parameters():
            p.add_(0.1)
    logits, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0])
    count = sum(p.numel() for p in client.model.parameters())
    expected = F.cross_entropy(logits, y) + 0.5 * 0.4 * count * 0.1**2
    torch.testing.assert_close(client.loss(logits, y), expected, rtol=1e-4, atol=1e-5)


def test_proximal_client_without_mu_says_which_strategy_to_use():
    client = make_client(ProximalClient)
    with pytest.raises(RuntimeError, match="^the proximal client needs 'proximal-mu' in the train config; "
                                           "use strategy fedprox$"):
        client.fit(client.get_parameters({}), {"server-round": 1})


def test_a_large_mu_keeps_the_client_at_the_global_model():
    def drift(mu: float) -> float:
        client = make_client(ProximalClient)
        start = [a.copy() for a in client.get_parameters({})]  # get_parameters shares memory with the model
        new, _, _ = client.fit(start, {"server-round": 1, "proximal-mu": mu})
        return float(sum(np.sum((a - b) ** 2) for a, b in zip(new, start)))

    assert drift(100.0) < 0.2 * drift(0.0)


def test_fedlc_loss_is_cross_entropy_of_count_shifted_logits():
    client = make_client(FedLCClient, FedLCConfig(tau=0.5, min_count=1e-8))
    counts = torch.tensor([12.0, 8.0, 4.0, 1e-8])  # labels (0,0,0,1,1,2) x 4; class 3 absent
    logits, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    expected = F.cross_entropy(logits - 0.5 * counts.pow(-0.25), y)
    torch.testing.assert_close(client.loss(logits, y), expected)
    plain = make_client(FedLCClient, FedLCConfig(tau=0.0))
    torch.testing.assert_close(plain.loss(logits, y), F.cross_entropy(logits, y))


def test_fedbabu_client_trains_the_body_only():
    client = make_client(FedBABUClient, pruning=PruningConfig(mode="magnitude", target_sparsity=0.5))
    start = dict(zip(client.model.state_dict(), (a.copy() for a in client.get_parameters({}))))
    new = dict(zip(client.model.state_dict(), client.fit(list(start.values()), {"server-round": 1})[0]))
    for key in start:
        if key.startswith("head."):
            np.testing.assert_array_equal(new[key], start[key])
    assert not np.array_equal(new["conv1.weight"], start["conv1.weight"])


def test_fedbabu_client_refuses_a_pruned_head():
    client = make_client(FedBABUClient, pruning=PruningConfig(mode="magnitude", include_head=True))
    with pytest.raises(RuntimeError, match="^FedBABU keeps the head at its initialisation; "
                                           "set pruning.include_head=false$"):
        client.fit(client.get_parameters({}), {"server-round": 1})


def offers_every_node(strategy) -> bool:
    """The factory passed the run's sampling on (``OFFERED_NODES_ONLY``)."""
    return (strategy.fraction_train, strategy.fraction_evaluate, strategy.min_train_nodes,
            strategy.min_available_nodes) == (1.0, 0.0, 1, 1)


def test_fedprox_server_sends_mu_and_averages_as_fedavg():
    """mu = 0.3 in every train config; uniform mean of (2, 2) and (0, 4): (1, 3)."""
    strategy = STRATEGIES.get("fedprox").factory(FedProxConfig(proximal_mu=0.3, weighting="uniform"), None)
    assert offers_every_node(strategy)
    sent = strategy.configure_train(1, to_record({"w": np.array([1.0, 2.0], np.float32)}), ConfigRecord(),
                                    InProcessGrid(ClientApp(), 2))
    assert [m.content["config"]["proximal-mu"] for m in sent] == [0.3, 0.3]
    replies = train_replies([{"w": np.array([2.0, 2.0], np.float32)}, {"w": np.array([0.0, 4.0], np.float32)}],
                            [10, 30])
    np.testing.assert_allclose(from_record(strategy.aggregate_train(1, replies)[0])["w"], [1.0, 3.0])


def test_fedbabu_server_averages_the_body_and_keeps_the_initial_head():
    """Replies of every array + 1 and + 3: the uniform mean is the initial body + 2, and the
    head the initial one exactly, whatever the replies' heads."""
    model = make_client(FedBABUClient).model
    initial = model_arrays(model)
    ctx = StrategyContext(num_classes=4, num_rounds=2, seed=0, round_timeout_s=60.0, initial=initial,
                          build_model=lambda arrays: model, audit=None, num_clients=2)
    strategy = STRATEGIES.get("fedbabu").factory(FedAvgConfig(weighting="uniform"), ctx)
    assert isinstance(strategy, FedBABU) and offers_every_node(strategy)
    replies = train_replies([{k: v + 1 for k, v in initial.items()}, {k: v + 3 for k, v in initial.items()}], [10, 30])
    got = from_record(strategy.aggregate_train(1, replies)[0])
    for name, value in initial.items():
        expected = value if name in model.head_parameter_names() else value + 2
        np.testing.assert_allclose(got[name], expected, rtol=1e-6, err_msg=name)


def test_fedprox_mu_reaches_the_client_through_flower_messages(make_cfg, tmp_path):
    """End to end: the same round with mu = 0 and a huge mu; the proximal pull is visible
    in how far the clients move (weight_divergence's update norm)."""
    def update_norm(mu: float) -> float:
        cfg = make_cfg("strategy={name: fedprox, proximal_mu: %s}" % mu, "client={name: proximal}",
                       "federation.num_rounds=1", "pruning.mode=dense")
        run = run_in_process(cfg, tmp_path / str(mu))
        clients = read_records(run, "diagnostic")[0]["clients"]
        return float(np.mean([c["update_norm"] for c in clients.values()]))

    assert update_norm(1000.0) < 0.2 * update_norm(0.0)


@pytest.mark.parametrize("method", [(), ("strategy={name: scaffold}", "client={name: scaffold}", "train.optimizer=sgd",
                                     "train.momentum=0", "pruning.mode=dense"),
                                    ("strategy={name: feddyn}", "client={name: feddyn}", "train.optimizer=sgd",
                                     "train.momentum=0", "pruning.mode=dense")],
                         ids=["plain", "scaffold", "feddyn"])
def test_a_train_message_loads_the_global_weights_into_the_client_once(make_cfg, tmp_path, monkeypatch, method):
    """The ClientApp leaves loading the global weights to the client's ``fit``: once a round,
    also for a client that keeps an anchor of them (``start_round``)."""
    loads, load = [], FedMechClient.set_parameters

    def counted(client, parameters):
        loads.append(client.partition_id)
        load(client, parameters)

    monkeypatch.setattr(FedMechClient, "set_parameters", counted)
    run_in_process(make_cfg("federation.num_rounds=1", *method), tmp_path)
    assert loads and sorted(loads) == sorted(set(loads))
