"""Representation and classifier methods: MOON, FedRS, FedDecorr and FedETF.

Each rule against a hand-computed case, the clients' wiring on a tiny model, and one
in-process smoke run per method with the misalignment diagnostic."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Message

from conftest import killed_then_resumed, smoke_config
from fedmech_flwr.app.inprocess import run_in_process, train_replies
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.builtin.clients.etf import ETFClient, ETFConfig, check_etf_client, etf_logits
from fedmech_flwr.builtin.clients.feddecorr import FedDecorrClient, FedDecorrConfig, decorrelation_loss
from fedmech_flwr.builtin.clients.fedrs import FedRSClient, FedRSConfig, restricted_logits
from fedmech_flwr.builtin.clients.moon import MoonClient, MoonConfig, model_contrastive_loss
from fedmech_flwr.builtin.strategies.fedavg import FedAvgConfig
from fedmech_flwr.builtin.strategies.fedetf import check_fedetf, simplex_etf
from fedmech_flwr.contracts.client import ClientData, FedMechClient
from fedmech_flwr.contracts.strategy import STRATEGIES, StrategyContext
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.foundation.seeds import numpy_rng, seed_for
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_arrays, load_model_arrays, model_arrays, to_record
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig, evaluate, seed_everything
from fedmech_flwr.models import build_model
from fedmech_flwr.spec.experiment import load_data, new_model

LABELS = (0, 0, 0, 1, 1, 2)
"""x 4: 12, 8 and 4 samples of classes 0-2; class 3 absent."""


def tiny_model():
    return build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=4, image_size=8)


def make_client(cls, params, state: NamedArrays | None = None, labels: tuple[int, ...] = LABELS * 4,
                train: TrainConfig | None = None):
    torch.manual_seed(0)
    y = torch.tensor(labels)
    data = ClientData(torch.randn(len(y), 1, 8, 8), y, num_classes=4)
    return cls(params, model=tiny_model(), data=data, train=train or TrainConfig(epochs=1, batch_size=8, lr=0.01),
               pruning=PruningConfig(mode="dense"), seed=0, partition_id=0, state=state)


def params_of(client) -> list[np.ndarray]:
    return [a.copy() for a in client.get_parameters({})]  # get_parameters shares memory with the model


# --- MOON -------------------------------------------------------------------------------

def test_model_contrastive_loss_known_answers():
    # z = z_glob, z orthogonal to z_prev: logits [1, 0] / 0.5 = [2, 0]
    one = model_contrastive_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), 0.5)
    torch.testing.assert_close(one, torch.tensor(-math.log(math.e**2 / (math.e**2 + math.e**0))))
    # cos(z, z_glob) = 1/sqrt(2), cos(z, z_prev) = -1/sqrt(2): logits [sqrt(2), -sqrt(2)] / 0.5; magnitudes do not count
    two = model_contrastive_loss(torch.tensor([[3.0, 3.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[-1.0, 0.0]]), 0.5)
    torch.testing.assert_close(two, torch.tensor(math.log(1 + math.exp(-4 * math.sqrt(0.5)))))
    batch = model_contrastive_loss(torch.tensor([[1.0, 0.0], [3.0, 3.0]]), torch.tensor([[1.0, 0.0], [2.0, 0.0]]),
                                   torch.tensor([[0.0, 1.0], [-1.0, 0.0]]), 0.5)
    torch.testing.assert_close(batch, (one + two) / 2)  # the batch's mean


def test_moon_first_round_is_cross_entropy_and_keeps_its_weights_as_state():
    client = make_client(MoonClient, MoonConfig(mu=5.0))
    start = params_of(client)
    client.set_parameters(start)
    x, y = client.data.x[:8], client.data.y[:8]
    loss, logits = client.objective(x, y)
    torch.testing.assert_close(loss, F.cross_entropy(client.model(x), y))
    weights, _, metrics = client.fit(start, {"server-round": 1})
    assert metrics["moon-contrastive-loss"] == 0.0
    assert list(client.state) == list(client.model.state_dict())
    for key, w in zip(client.state, weights):
        assert client.state[key].tobytes() == w.tobytes()
    assert not np.array_equal(client.state["conv1.weight"], start[0])  # it trained
    kept = {k: v.copy() for k, v in client.state.items()}
    client.set_parameters(start)  # the model moves on (the weights fit returned are its own memory) ...
    for key, w in kept.items():  # ... and the state stays what it returned
        assert client.state[key].tobytes() == w.tobytes()


def test_moon_contrasts_with_the_global_and_the_previous_model():
    global_params = params_of(make_client(MoonClient, MoonConfig()))
    x, y = torch.randn(8, 1, 8, 8), torch.tensor([0, 1, 2, 3] * 2)

    # previous model = global model: both similarities equal, l_con = -log(1/2) whatever the features
    same = make_client(MoonClient, MoonConfig(mu=2.0), state=dict(zip(tiny_model().state_dict(), global_params)))
    same.set_parameters(global_params)
    assert not any(p.requires_grad for m in (same.global_model, same.previous) for p in m.parameters())  # frozen
    loss, logits = same.objective(x, y)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y) + 2.0 * math.log(2))

    # a different previous model; the model being trained starts at the global one, so
    # sim(z, z_glob) = 1 and l_con = log(1 + exp((sim(z, z_prev) - 1) / tau)) < log 2
    previous = tiny_model()
    other = make_client(MoonClient, MoonConfig(mu=2.0, temperature=0.5), state=model_arrays(previous))
    other.set_parameters(global_params)
    loss, logits = other.objective(x, y)
    with torch.no_grad():
        cos_prev = F.cosine_similarity(other.model.forward_features(x), previous.forward_features(x), dim=1)
    l_con = torch.log1p(torch.exp((cos_prev - 1) / 0.5)).mean()
    torch.testing.assert_close(loss, F.cross_entropy(logits, y) + 2.0 * l_con, rtol=1e-5, atol=1e-6)
    assert l_con < math.log(2) - 1e-3  # swapping global and previous would give more than log 2


def test_moon_contrasts_with_the_frozen_global_model_after_the_live_one_moved():
    """Mid-round the model being trained has left the global one: z_glob is still the
    received model's features (a frozen copy), never the live model's (sim 1)."""
    received = tiny_model()
    client = make_client(MoonClient, MoonConfig(mu=2.0), state=model_arrays(tiny_model()))
    client.set_parameters(params_of(make_client(MoonClient, MoonConfig())))
    load_model_arrays(received, model_arrays(client.model))
    with torch.no_grad():
        for p in client.model.parameters():  # as if it had taken some local steps
            p.add_(0.1 * torch.randn_like(p))
    x, y = torch.randn(8, 1, 8, 8), torch.tensor([0, 1, 2, 3] * 2)
    loss, logits = client.objective(x, y)
    with torch.no_grad():
        z = client.model.forward_features(x)
        l_con = model_contrastive_loss(z, received.forward_features(x), client.previous.forward_features(x), 0.5)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y) + 2.0 * l_con, rtol=1e-5, atol=1e-6)
    live = model_contrastive_loss(z, z, client.previous.forward_features(x), 0.5)
    assert abs(l_con - live) > 1e-3  # the test can tell the two apart


def test_moon_reports_the_round_mean_of_the_contrastive_loss():
    """Previous model = global model: sim(z, z_glob) = sim(z, z_prev) on every batch however
    the model trains, so each batch's l_con is log 2, and so is the mean over the round."""
    global_params = params_of(make_client(MoonClient, MoonConfig()))
    client = make_client(MoonClient, MoonConfig(), state=dict(zip(tiny_model().state_dict(), global_params)))
    _, _, metrics = client.fit(global_params, {"server-round": 2})
    assert metrics["moon-contrastive-loss"] == pytest.approx(math.log(2), rel=1e-5)


def test_moon_over_two_epochs_with_momentum_is_the_papers_rule_step_by_step():
    """MOON's local training written out from the paper (frozen copies of the global and the
    previous model, CE + mu l_con per batch, one SGD optimiser with momentum for the whole
    round, the client's batch order): after 2 epochs the weights and the reported round
    mean of l_con agree with the client's. A global copy refreshed each epoch, a previous
    model replaced mid-round or a metric over the last epoch only would part them."""
    train = TrainConfig(optimizer="sgd", lr=0.05, momentum=0.9, epochs=2, batch_size=8)
    previous = tiny_model()
    client = make_client(MoonClient, MoonConfig(mu=2.0), state=model_arrays(previous), train=train)
    start = params_of(client)
    model = tiny_model()
    load_model_arrays(model, dict(zip(model.state_dict(), start)))
    frozen = [m.eval().requires_grad_(False) for m in (copy.deepcopy(model), previous)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = seed_everything(seed_for(0, "local-training", 0, 2))
    l_con_sum, seen = 0.0, 0
    for _ in range(2):
        order = torch.randperm(len(client.data.y), generator=generator)
        for i in range(0, len(order), 8):
            x, y = client.data.x[order[i:i + 8]], client.data.y[order[i:i + 8]]
            z = model.forward_features(x)
            z_glob, z_prev = (m.forward_features(x) for m in frozen)
            l_con = model_contrastive_loss(z, z_glob, z_prev, 0.5)
            optimizer.zero_grad()
            (F.cross_entropy(model.forward_head(z), y) + 2.0 * l_con).backward()
            optimizer.step()
            l_con_sum, seen = l_con_sum + l_con.item() * len(y), seen + len(y)
    weights, _, metrics = client.fit(start, {"server-round": 2})
    for got, want in zip(weights, model.state_dict().values(), strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    assert metrics["moon-contrastive-loss"] == pytest.approx(l_con_sum / seen, rel=1e-5)


def test_moon_says_whether_it_applied_the_term():
    """No previous model (the client's first round): the term is left out and the client
    says so (``moon-contrasted`` 0); with one, 1."""
    first = make_client(MoonClient, MoonConfig())
    _, _, metrics = first.fit(params_of(first), {"server-round": 1})
    assert metrics["moon-contrasted"] == 0.0 and metrics["moon-contrastive-loss"] == 0.0
    second = make_client(MoonClient, MoonConfig(), state=first.state)
    _, _, metrics = second.fit(params_of(second), {"server-round": 2})
    assert metrics["moon-contrasted"] == 1.0 and metrics["moon-contrastive-loss"] > 0


# --- FedRS ------------------------------------------------------------------------------

def test_restricted_logits_known_answer():
    h = torch.tensor([[1.0, 2.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    bias = torch.tensor([0.5, 0.4, -1.0])
    scale = torch.tensor([1.0, 0.5, 1.0])  # class 1 absent, alpha = 0.5
    # w.h = [1, 2, 3] -> [1, 0.5 * 2, 3] + b = [1.5, 1.4, 2.0]; the bias is not scaled
    torch.testing.assert_close(restricted_logits(h, weight, bias, scale), torch.tensor([[1.5, 1.4, 2.0]]))
    torch.testing.assert_close(restricted_logits(h, weight, None, scale), torch.tensor([[1.0, 1.0, 3.0]]))


def test_fedrs_client_restricts_the_classes_it_does_not_hold():
    client = make_client(FedRSClient, FedRSConfig(alpha=0.25))
    torch.testing.assert_close(client.scale, torch.tensor([1.0, 1.0, 1.0, 0.25]))  # class 3 absent
    x, y = client.data.x[:8], client.data.y[:8]
    loss, logits = client.objective(x, y)
    with torch.no_grad():
        h, head = client.model.forward_features(x), client.model.head
    wh = h @ head.weight.T
    expected = torch.cat([wh[:, :3], 0.25 * wh[:, 3:]], dim=1) + head.bias
    torch.testing.assert_close(loss, F.cross_entropy(expected, y))
    torch.testing.assert_close(logits, client.model(x))  # the model's own prediction, for train accuracy
    plain = make_client(FedRSClient, FedRSConfig(alpha=1.0))
    torch.testing.assert_close(plain.objective(x, y)[0], F.cross_entropy(plain.model(x), y))
    one = make_client(FedRSClient, FedRSConfig(alpha=0.25), labels=(0, 0, 2))
    torch.testing.assert_close(one.scale, torch.tensor([1.0, 0.25, 1.0, 0.25]))  # one sample of class 2 holds it


def test_fedrs_client_holding_every_class_trains_bitwise_as_the_plain_client(monkeypatch):
    """Every scale 1 (every class held, or alpha 1): the plain client's linear path, so an
    IID cell ends bitwise as FedAvg's. (h @ W.T) * 1 + b is another GEMM call than
    F.linear's fused one, equal here only where the BLAS happens to round both alike (the
    leaderboard's runs differed by up to 3e-8), so the restricted path must not run at all."""
    from fedmech_flwr.builtin.clients import fedrs

    def restricted(*args):
        raise AssertionError("restricted logits computed although no class is restricted")

    monkeypatch.setattr(fedrs, "restricted_logits", restricted)
    y = torch.arange(24) % 4

    def trained(cls, params):
        torch.manual_seed(0)
        data = ClientData(torch.randn(len(y), 1, 8, 8), y, num_classes=4)
        client = cls(params, model=tiny_model(), data=data, train=TrainConfig(epochs=3, batch_size=8, lr=0.05),
                     pruning=PruningConfig(mode="dense"), seed=0, partition_id=0)
        return client.fit(params_of(client), {"server-round": 1})[0]

    plain = trained(FedMechClient, None)
    for params in (FedRSConfig(alpha=0.5), FedRSConfig(alpha=1.0)):
        for a, b in zip(trained(FedRSClient, params), plain):
            assert a.tobytes() == b.tobytes()


# --- FedDecorr --------------------------------------------------------------------------

@pytest.mark.parametrize(("columns", "expected"), [
    # K = [[1, 1], [1, 1]]: ||K||^2 / d^2 = 4 / 4
    ([[1, 2, 3, 4], [3, 5, 7, 9]], 1.0),
    # anti-correlated, K = [[1, -1], [-1, 1]]: the sign does not count
    ([[1, 2, 3, 4], [4, 3, 2, 1]], 1.0),
    # orthogonal centred columns, K = I: 2 / 4
    ([[1, -1, 1, -1], [1, 1, -1, -1]], 0.5),
    # two equal columns and one orthogonal: ||K||^2 = 4 + 1 = 5, over 9
    ([[1, -1, 1, -1], [1, -1, 1, -1], [1, 1, -1, -1]], 5 / 9),
])
def test_decorrelation_loss_known_answers(columns, expected):
    features = torch.tensor(columns, dtype=torch.float32).T  # [N, d]
    torch.testing.assert_close(decorrelation_loss(features), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    scaled = features * torch.tensor([10.0] + [0.1] * (features.shape[1] - 1)) + 7.0  # per-dimension affine maps
    torch.testing.assert_close(decorrelation_loss(scaled), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_feddecorr_client_adds_beta_times_the_term_and_reports_it():
    client = make_client(FedDecorrClient, FedDecorrConfig(beta=0.3))
    x, y = client.data.x[:8], client.data.y[:8]
    loss, logits = client.objective(x, y)
    with torch.no_grad():
        decorr = decorrelation_loss(client.model.forward_features(x))
    torch.testing.assert_close(loss, F.cross_entropy(logits, y) + 0.3 * decorr)
    _, _, metrics = make_client(FedDecorrClient, FedDecorrConfig()).fit(params_of(client), {"server-round": 1})
    assert 1 / client.model.feature_dim <= metrics["feddecorr-loss"] <= 1


def test_feddecorr_term_reaches_the_body():
    """The body's gradient is that of CE + beta * L_decorr, not the cross-entropy's alone:
    a term computed on detached features would be recorded and never trained on."""
    client = make_client(FedDecorrClient, FedDecorrConfig(beta=0.3))
    x, y = client.data.x[:8], client.data.y[:8]
    client.objective(x, y)[0].backward()
    got = client.model.conv1.weight.grad.clone()
    client.model.zero_grad(set_to_none=True)
    features = client.model.forward_features(x)
    (F.cross_entropy(client.model.forward_head(features), y) + 0.3 * decorrelation_loss(features)).backward()
    torch.testing.assert_close(got, client.model.conv1.weight.grad)
    client.model.zero_grad(set_to_none=True)
    F.cross_entropy(client.model(x), y).backward()
    assert not torch.allclose(got, client.model.conv1.weight.grad, rtol=1e-3, atol=1e-6)  # the term's own share counts


def test_feddecorr_reports_the_round_mean_of_the_term():
    """Two epochs of one batch (the whole shard) at a learning rate that moves nothing: each
    batch's L_decorr is that of the shard's features (whatever their order), and so is the mean."""
    train = TrainConfig(optimizer="sgd", lr=1e-12, momentum=0.0, epochs=2, batch_size=24)
    client = make_client(FedDecorrClient, FedDecorrConfig(), train=train)
    with torch.no_grad():
        expected = decorrelation_loss(client.model.forward_features(client.data.x)).item()
    _, _, metrics = client.fit(params_of(client), {"server-round": 1})
    assert metrics["feddecorr-loss"] == pytest.approx(expected, rel=1e-5)


# --- FedETF -----------------------------------------------------------------------------

@pytest.mark.parametrize(("classes", "dim"), [(2, 2), (4, 10), (10, 64)])
def test_simplex_etf_geometry(classes, dim):
    w = simplex_etf(classes, dim, seed=3)
    assert w.shape == (classes, dim)
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0, atol=1e-12)
    cosines = w @ w.T
    np.testing.assert_allclose(cosines[~np.eye(classes, dtype=bool)], -1 / (classes - 1), atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=0), 0.0, atol=1e-12)
    np.testing.assert_array_equal(simplex_etf(classes, dim, seed=3), w)  # seeded, from the seed's etf stream:
    u, _ = np.linalg.qr(numpy_rng(3, "etf").standard_normal((dim, classes)))
    np.testing.assert_allclose(w @ u @ u.T, w, atol=1e-12)  # in the span of its draw
    assert not np.allclose(simplex_etf(classes, dim, seed=4), w)


def test_etf_logits_known_answer():
    w = torch.from_numpy(simplex_etf(4, 6, seed=0)).float()
    h = 3 * w[:1]  # along class 0: cosines [1, -1/3, -1/3, -1/3], divided by T = 0.1
    logits = etf_logits(h, w, 0.1)
    torch.testing.assert_close(logits, torch.tensor([[10.0, -10 / 3, -10 / 3, -10 / 3]]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.cross_entropy(logits, torch.tensor([0])),
                               torch.tensor(-math.log(math.e**10 / (math.e**10 + 3 * math.e ** (-10 / 3)))))


class _Grid:
    """What FedAvg's configure_train asks of a grid."""

    def get_node_ids(self):
        return [1000, 1001]

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)


def test_fedetf_sends_and_keeps_the_etf_head(flower_identity):
    model = tiny_model()
    initial = model_arrays(model)

    def build(arrays: NamedArrays):
        built = tiny_model()
        load_model_arrays(built, arrays)
        return built.eval()

    ctx = StrategyContext(num_classes=4, num_rounds=2, seed=7, round_timeout_s=60.0, initial=initial,
                          build_model=build, audit=None, num_clients=2)
    strategy = STRATEGIES.get("fedetf").factory(FedAvgConfig(weighting="uniform"), ctx)
    assert strategy.weighting == "uniform"
    assert (strategy.fraction_train, strategy.fraction_evaluate, strategy.min_train_nodes,
            strategy.min_available_nodes) == (1.0, 0.0, 1, 1)
    etf = simplex_etf(4, model.feature_dim, seed=7).astype(np.float32)
    [sent, _] = strategy.configure_train(1, to_record(initial), ConfigRecord(), _Grid())
    arrays = from_record(sent.content["arrays"])
    assert arrays["head.weight"].tobytes() == etf.tobytes()
    assert not arrays["head.bias"].any() and arrays["head.bias"].dtype == np.float32
    assert arrays["conv1.weight"].tobytes() == initial["conv1.weight"].tobytes()

    # the client trains the body under the frozen head ...
    client = make_client(ETFClient, ETFConfig())
    weights, _, _ = client.fit([arrays[k].copy() for k in client.model.state_dict()], {"server-round": 1})
    trained = dict(zip(client.model.state_dict(), (w.copy() for w in weights)))
    assert trained["head.weight"].tobytes() == etf.tobytes() and not trained["head.bias"].any()
    assert not np.array_equal(trained["conv1.weight"], arrays["conv1.weight"])
    # ... and the aggregate's head is the ETF even where a reply's head moved
    moved = {**trained, "head.weight": trained["head.weight"] + 1, "head.bias": trained["head.bias"] - 1}
    got = from_record(strategy.aggregate_train(1, train_replies([trained, moved], [10, 30]))[0])
    assert got["head.weight"].tobytes() == etf.tobytes() and not got["head.bias"].any()
    np.testing.assert_allclose(got["conv1.weight"], trained["conv1.weight"], rtol=1e-6)


@pytest.mark.parametrize("balanced", [True, False])
def test_etf_client_trains_on_the_etf_logits_plus_log_counts(balanced):
    """The balanced loss is the cross-entropy of w_c^T h / (T ||h||) + log n_c: a class the
    client holds many of gets a higher score while training (Ren et al.'s balanced softmax),
    so its bias is not learned into the body."""
    client = make_client(ETFClient, ETFConfig(temperature=0.5, balanced=balanced))
    x, y = client.data.x[:8], client.data.y[:8]
    loss, logits = client.objective(x, y)
    with torch.no_grad():
        scores = F.normalize(client.model.forward_features(x), dim=1) @ client.model.head.weight.T / 0.5
    log_n = torch.log(torch.tensor([12.0, 8.0, 4.0, 1.0])) if balanced else torch.zeros(4)
    torch.testing.assert_close(loss, F.cross_entropy(scores + log_n, y), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, scores, rtol=1e-5, atol=1e-6)  # the accuracy is the ETF's own


def test_etf_client_balanced_shift_and_refusals():
    balanced = make_client(ETFClient, ETFConfig())
    torch.testing.assert_close(balanced.shift, torch.log(torch.tensor([12.0, 8.0, 4.0, 1.0])))  # absent: n = 1
    assert not make_client(ETFClient, ETFConfig(balanced=False)).shift.any()
    data = DataInfo(torch.arange(100) % 10, 10, 10, (1, 12, 12))
    narrow = smoke_config(["model.channels=[1, 1]"])  # 1 x 3 x 3 = 9 features < 10 classes
    with pytest.raises(ConfigError, match="only 9 penultimate features.*at least 10 features in x.yaml: strategy$"):
        check_fedetf(FedAvgConfig(), narrow, data, "x.yaml: strategy")
    check_fedetf(FedAvgConfig(), narrow, DataInfo(torch.arange(90) % 9, 9, 9, (1, 12, 12)), "x.yaml: strategy")  # 9 = 9
    check_fedetf(FedAvgConfig(), smoke_config(["model.channels=[1, 2]"]), data, "x.yaml: strategy")  # 18 >= 10
    pruned_head = smoke_config(["pruning.include_head=true"])
    with pytest.raises(ConfigError, match="^client etf keeps the head at the simplex ETF, which pruning it would "
                                          "break; set pruning.include_head=false in x.yaml: client$"):
        check_etf_client(ETFConfig(), pruned_head, data, "x.yaml: client")


# --- smoke runs -------------------------------------------------------------------------

METHODS = {"moon": "moon", "fedrs": "fedrs", "feddecorr": "feddecorr", "etf": "fedetf"}
"""client -> strategy."""
MISALIGNMENT = ["data.audit_per_class=15", "diagnostics=[{name: misalignment, head_samples: 20}]"]


@pytest.mark.parametrize("client", sorted(METHODS))
def test_smoke_run_records_the_method_and_the_misalignment_diagnostic(client, tmp_path):
    strategy = METHODS[client]
    cfg = smoke_config([f"client={{name: {client}}}", f"strategy={{name: {strategy}}}", *MISALIGNMENT])
    run = run_in_process(cfg, tmp_path)
    assert [r["round"] for r in read_records(run, "diagnostic")] == [1, 2]
    records = read_records(run, "strategy")
    outputs = STRATEGIES.get(strategy).outputs
    for key, metric in (outputs.metrics.items() if outputs else ()):
        assert all(metric.path[0] in r for r in records), key
    if client == "moon":  # no previous model in round 1; the node kept one for round 2
        assert [r["moon_contrastive_loss"] > 0 for r in records] == [False, True]
        assert [r["moon_contrasted"] for r in records] == [0.0, 1.0]
    if client == "etf":
        final = load_arrays(run / "model_final.safetensors")
        assert final["head.weight"].tobytes() == simplex_etf(4, 72, cfg.seed).astype(np.float32).tobytes()
        assert not final["head.bias"].any()
        # round 0 is the initial body under the ETF head, the model the method starts from
        bundle = load_data(cfg)
        model = new_model(cfg, bundle, torch.device("cpu"))
        load_model_arrays(model, {**model_arrays(model), "head.weight": final["head.weight"],
                                  "head.bias": final["head.bias"]})
        start = evaluate(model.eval(), bundle.x_test, bundle.y_test, bundle.num_classes, cfg.eval_batch_size)
        [round_0] = [r for r in read_records(run, "eval") if r["round"] == 0]
        assert round_0["loss"] == pytest.approx(start.loss, rel=1e-6)


def test_moon_previous_models_survive_a_resume(tmp_path):
    """Killed in round 3, resumed: the server sends each client the state it kept, so round
    3 contrasts with the same previous models and the run is the uninterrupted one."""
    killed_then_resumed(["client={name: moon}", "strategy={name: moon}", "federation.num_rounds=3"], tmp_path, 1, 3)
