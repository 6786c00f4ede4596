"""Strategies with mocked replies against hand-computed results: FedBABU, FedProx, the
head-realigning FedAvgs (schedule, tau-norm, head finetuning, NCM and CCVR from client
statistics), and client/strategy pairing errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from conftest import rolled_head, small_cnn
from fedmech_flwr.builtin.strategies.fedavg import FedAvgConfig
from fedmech_flwr.builtin.strategies.fedprox import FedProxConfig
from fedmech_flwr.builtin.strategies.realign import CCVRConfig, HeadRealignConfig, RealignConfig, TauNormConfig
from fedmech_flwr.contracts.strategy import STRATEGIES, StrategyContext
from fedmech_flwr.datasets.data import DataInfo
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import NamedArrays, from_record, load_model_arrays, model_arrays, to_record, weighted_mean
from fedmech_flwr.learning.heads import ClassStats, LinearHead, class_stats, features, ncm_head, score

NUM_CLASSES = 4
EXAMPLES = [10, 30, 60]
HEAD = ("head.weight", "head.bias")


@pytest.fixture(scope="module")
def data(separable_cnn):
    return separable_cnn[1]


@pytest.fixture(scope="module")
def trained(separable_cnn) -> NamedArrays:
    """Features that separate the classes, a head that reads them wrong."""
    return rolled_head(model_arrays(separable_cnn[0]))


def build(arrays: NamedArrays):
    model = small_cnn()
    load_model_arrays(model, arrays)
    return model.eval()


def context(data, num_rounds: int = 5, audit_per_class: int = 40) -> StrategyContext:
    torch.manual_seed(1)
    audit = (data.x_train[: audit_per_class * NUM_CLASSES], data.y_train[: audit_per_class * NUM_CLASSES])
    return StrategyContext(num_classes=NUM_CLASSES, num_rounds=num_rounds, seed=0, round_timeout_s=60.0,
                           initial=model_arrays(small_cnn()), build_model=build, audit=audit, num_clients=3)


def perturbed(arrays: NamedArrays, seed: int) -> NamedArrays:
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(scale=0.05, size=v.shape)).astype(v.dtype) for k, v in arrays.items()}


@pytest.fixture
def replies(messages, trained):
    models = [perturbed(trained, i) for i in range(3)]
    return models, [messages.train(1000 + i, models[i], EXAMPLES[i]) for i in range(3)]


def mean_of(models) -> NamedArrays:
    return weighted_mean(models, EXAMPLES)


def make(name: str, params, ctx):
    return STRATEGIES.get(name).factory(params, ctx)


def test_fedbabu_averages_the_body_and_keeps_the_initial_head(replies, data):
    models, msgs = replies
    ctx = context(data)
    got = from_record(make("fedbabu", FedAvgConfig(), ctx).aggregate_train(1, msgs)[0])
    expected = mean_of(models)
    for key in expected:
        want = ctx.initial[key] if key in HEAD else expected[key]
        np.testing.assert_array_equal(got[key], want)


def test_fedprox_sends_mu_and_averages_like_fedavg(replies, data, messages):
    models, msgs = replies
    strategy = make("fedprox", FedProxConfig(proximal_mu=0.3), context(data))
    out = list(strategy.configure_train(1, to_record(models[0]), ConfigRecord(), FakeGrid([1000, 1001])))
    assert [m.content["config"]["proximal-mu"] for m in out] == [0.3, 0.3]
    got = from_record(strategy.aggregate_train(1, msgs)[0])
    for key, value in mean_of(models).items():
        np.testing.assert_array_equal(got[key], value)


def test_realignment_follows_its_schedule(replies, data):
    models, msgs = replies
    ctx = context(data, num_rounds=5)
    every2 = make("tau_norm", TauNormConfig(every=2), ctx)
    final_only = make("tau_norm", TauNormConfig(every=None), ctx)
    assert [r for r in range(1, 6) if every2.due(r)] == [2, 4, 5]
    assert [r for r in range(1, 6) if final_only.due(r)] == [5]
    untouched = from_record(every2.aggregate_train(1, msgs)[0])
    for key, value in mean_of(models).items():
        np.testing.assert_array_equal(untouched[key], value)


def test_tau_norm_normalises_the_averaged_head(replies, data):
    models, msgs = replies
    got = from_record(make("tau_norm", TauNormConfig(tau=1.0), context(data)).aggregate_train(1, msgs)[0])
    mean = mean_of(models)
    w = mean["head.weight"].astype(np.float64)
    np.testing.assert_allclose(got["head.weight"], w / np.linalg.norm(w, axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(got["head.bias"], mean["head.bias"])
    for key in mean:
        if key not in HEAD:
            np.testing.assert_array_equal(got[key], mean[key])


def test_head_realignment_recovers_a_scrambled_head_and_keeps_the_body(replies, data):
    models, msgs = replies
    params = HeadRealignConfig(head_samples=40)
    params.head.lr, params.head.epochs = 0.05, 20
    got = from_record(make("fedavg_head_realign", params, context(data)).aggregate_train(1, msgs)[0])
    mean = mean_of(models)
    for key in mean:
        if key not in HEAD:
            np.testing.assert_array_equal(got[key], mean[key])
    accuracy = lambda arrays: score(LinearHead.of(build(arrays)), features(build(arrays), data.x_test), data.y_test,  # noqa: E731
                                    NUM_CLASSES).accuracy
    assert accuracy(mean) < 0.1 and accuracy(got) > 0.9


def test_head_realignment_needs_an_audit_set_of_the_right_size():
    check = STRATEGIES.get("fedavg_head_realign").check

    def data(audit_per_class: int) -> DataInfo:
        return DataInfo(torch.arange(400) % NUM_CLASSES, 100, NUM_CLASSES, (1, 8, 8), audit_per_class)

    with pytest.raises(ConfigError, match="set data.audit_per_class.* in x.yaml: strategy$"):
        check(HeadRealignConfig(), None, data(0), "x.yaml: strategy")
    with pytest.raises(ConfigError, match="3 samples must be at least the number of classes \\(4\\).* in x.yaml: strategy.head_samples$"):
        check(HeadRealignConfig(head_samples=3), None, data(40), "x.yaml: strategy")
    with pytest.raises(ConfigError, match="audit set has 39 per class to spare"):
        check(HeadRealignConfig(head_samples=200), None, data(40), "x.yaml: strategy")
    check(HeadRealignConfig(head_samples=156), None, data(40), "x.yaml: strategy")  # 39 per class fit


class FakeGrid:
    """Answers ``query.class_stats`` with fixed statistics per node; records what it got."""

    def __init__(self, node_ids, stats: dict[int, ClassStats] | None = None) -> None:
        self.node_ids, self.stats, self.sent = list(node_ids), stats or {}, []

    def get_node_ids(self):
        return list(self.node_ids)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def send_and_receive(self, messages, *, timeout=None):
        self.sent.extend(messages)
        return [Message(RecordDict({"stats": to_record(self.stats[m.metadata.dst_node_id].to_arrays())}), reply_to=m)
                for m in messages]


def client_stats(trained, data, covariance: str) -> dict[int, ClassStats]:
    """Node 1000 holds classes 0-1, nodes 1001-1002 split classes 2-3."""
    f = features(build(trained), data.x_train)
    y = data.y_train
    masks = {1000: y < 2, 1001: (y >= 2) & (torch.arange(len(y)) % 2 == 0), 1002: (y >= 2) & (torch.arange(len(y)) % 2 == 1)}
    return {node: class_stats(f[m], y[m], NUM_CLASSES, covariance) for node, m in masks.items()}


def test_ncm_head_is_built_from_the_summed_client_statistics(replies, data, trained, messages):
    models, msgs = replies
    stats = client_stats(trained, data, "diagonal")
    grid = FakeGrid(stats, stats)
    strategy = make("ncm", RealignConfig(), context(data))
    list(strategy.configure_train(1, to_record(models[0]), ConfigRecord({"fedmech-config": "{}"}), grid))
    got = from_record(strategy.aggregate_train(1, msgs)[0])
    mean = mean_of(models)
    expected = ncm_head(ClassStats.sum(list(stats.values())), LinearHead.of(build(mean)))
    np.testing.assert_allclose(got["head.weight"], expected.weight.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got["head.bias"], expected.bias.numpy(), rtol=1e-6)
    query = grid.sent[0]
    assert query.metadata.message_type == "query.class_stats" and query.content["config"]["covariance"] == "diagonal"
    assert query.content["config"]["server-round"] == 1 and "fedmech-config" in query.content["config"]
    for key, value in from_record(query.content["arrays"]).items():  # the stats are of the new aggregate
        np.testing.assert_array_equal(value, mean[key])


def test_ccvr_calibrates_the_head_on_virtual_features(replies, data, trained):
    models, msgs = replies
    stats = client_stats(trained, data, "full")
    grid = FakeGrid(stats, stats)
    strategy = make("ccvr", CCVRConfig(ccvr_covariance="full", ccvr_virtual_per_class=500), context(data))
    list(strategy.configure_train(1, to_record(models[0]), ConfigRecord(), grid))
    got = from_record(strategy.aggregate_train(1, msgs)[0])
    assert grid.sent[0].content["config"]["covariance"] == "full"
    model = build(got)
    assert score(LinearHead.of(model), features(model, data.x_test), data.y_test, NUM_CLASSES).accuracy > 0.9


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["strategy={name: fedprox}"], "strategy 'fedprox' needs client 'proximal', got 'plain'.* client.name"),
        (["client={name: proximal}"], "client 'proximal' needs strategy 'fedprox', got 'fedavg'.* strategy.name"),
        (["strategy={name: fedbabu}"], "strategy 'fedbabu' needs client 'fedbabu', got 'plain'"),
        (["client={name: fedbabu}", "strategy={name: ncm}"], "client 'fedbabu' needs strategy 'fedbabu', got 'ncm'"),
    ],
)
def test_a_strategy_paired_with_the_wrong_client_is_refused(make_cfg, overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_cfg(*overrides)


def test_matching_pairs_validate(make_cfg):
    assert make_cfg("strategy={name: fedprox}", "client={name: proximal}").strategy.params.proximal_mu == 0.01
    assert make_cfg("strategy={name: fedbabu}", "client={name: fedbabu}").client.name == "fedbabu"
    assert make_cfg("strategy={name: ccvr}", "client={name: fedlc}").client.params.tau == 1.0


@pytest.mark.parametrize("old, new", [
    ("{name: fedavg_head_realign, samples: 40}", "head_samples"),
    ("{name: ccvr, covariance: full}", "ccvr_covariance"),
    ("{name: ccvr, virtual_per_class: 10}", "ccvr_virtual_per_class"),
])
def test_the_realigning_strategies_take_the_misalignment_diagnostics_names(make_cfg, old, new):
    """One name per setting: the old strategy-only names are refused with the new one."""
    with pytest.raises(ConfigError, match=f"did you mean '{new}'"):
        make_cfg("data.audit_per_class=15", f"strategy={old}")
