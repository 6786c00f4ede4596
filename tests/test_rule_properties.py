"""Properties every update rule must keep, drawn by Hypothesis over random small models,
client counts, sample counts and seeds.

Server side, on random named arrays (float32 parameters, an int64 buffer): the aggregate
does not depend on the order of the replies; one client gets its own model back and
identical clients leave the model where they put it (the FedAvg family); weights follow
the sample counts (a client sent twice weighs as one with twice its examples); coordinates
every client pruned stay exactly 0. Client side, on a tiny CNN: each rule at its neutral
setting trains bitwise as the plain (FedAvg) client, and FedProx's server with mu 0
aggregates bitwise as FedAvg's.

Hypothesis draws with a fixed seed (``derandomize``) and few examples, so the fast tier
stays fast and every CI run draws the same cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from flwr.clientapp import ClientApp
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmech_flwr.app.inprocess import InProcessGrid
from fedmech_flwr.builtin.clients.feddecorr import FedDecorrClient, FedDecorrConfig
from fedmech_flwr.builtin.clients.fedlc import FedLCClient, FedLCConfig
from fedmech_flwr.builtin.clients.fednova import A_NORM
from fedmech_flwr.builtin.clients.fedrs import FedRSClient, FedRSConfig
from fedmech_flwr.builtin.clients.moon import MoonClient, MoonConfig
from fedmech_flwr.builtin.clients.proximal import ProximalClient
from fedmech_flwr.builtin.clients.scaffold import CONTROL, DELTA_CONTROL, ScaffoldClient
from fedmech_flwr.builtin.strategies.fedavg import WeightedFedAvg
from fedmech_flwr.builtin.strategies.fedbabu import FedBABU
from fedmech_flwr.builtin.strategies.feddyn import FedDyn
from fedmech_flwr.builtin.strategies.fedetf import FedETF
from fedmech_flwr.builtin.strategies.fednova import FedNova
from fedmech_flwr.builtin.strategies.fedopt import ResumableFedAdam, ResumableFedAvgM
from fedmech_flwr.builtin.strategies.fedprox import WeightedFedProx
from fedmech_flwr.builtin.strategies.scaffold import Scaffold
from fedmech_flwr.contracts.client import ClientData, FedMechClient
from fedmech_flwr.contracts.strategy import OFFERED_NODES_ONLY
from fedmech_flwr.contracts.testing import train_replies
from fedmech_flwr.contracts.wire import REPORT_KEY, UPLOAD_PREFIX
from fedmech_flwr.learning.arrays import NamedArrays, cast, from_record, pack, to_record
from fedmech_flwr.learning.pruning import PruningConfig
from fedmech_flwr.learning.training import TrainConfig
from fedmech_flwr.models import build_model

CHEAP = settings(max_examples=15, deadline=None, derandomize=True, database=None)
"""Few cases, no per-case deadline (the first case pays the imports), a fixed draw, and no
example database written into the repository."""
BUFFER = "bn.num_batches_tracked"
HEAD = "head.weight"


# --- server side ----------------------------------------------------------------------------

@st.composite
def federations(draw, min_clients: int = 1, max_clients: int = 5):
    """(x, models, examples): a random model x (2-3 float32 arrays, the last the head, and an
    int64 buffer), 1-5 client models of its shapes and their sample counts."""
    shapes = draw(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple), min_size=2, max_size=3))
    names = [f"layer{i}.weight" for i in range(len(shapes) - 1)] + [HEAD]
    count = draw(st.integers(min_clients, max_clients))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def model() -> NamedArrays:
        arrays = {n: rng.normal(size=s).astype(np.float32) for n, s in zip(names, shapes)}
        return {**arrays, BUFFER: np.array(rng.integers(0, 100), np.int64)}

    examples = draw(st.lists(st.integers(1, 1000), min_size=count, max_size=count))
    return model(), [model() for _ in range(count)], examples


def float_names(x: NamedArrays) -> list[str]:
    return [k for k in x if k != BUFFER]


RULES = {
    "fedavg": lambda x, n: WeightedFedAvg(**OFFERED_NODES_ONLY),
    "fedprox": lambda x, n: WeightedFedProx(0.1, **OFFERED_NODES_ONLY),
    "fedbabu": lambda x, n: FedBABU({HEAD: x[HEAD]}, **OFFERED_NODES_ONLY),
    "fedetf": lambda x, n: FedETF({HEAD: x[HEAD]}, **OFFERED_NODES_ONLY),
    "fednova": lambda x, n: FedNova(float_names(x), **OFFERED_NODES_ONLY),
    "scaffold": lambda x, n: Scaffold({k: np.zeros_like(x[k]) for k in float_names(x)}, n + 2, **OFFERED_NODES_ONLY),
    "feddyn": lambda x, n: FedDyn({k: np.zeros_like(x[k]) for k in float_names(x)}, 0.1, n + 2, **OFFERED_NODES_ONLY),
    "fedavgm": lambda x, n: ResumableFedAvgM(model=x, buffers={BUFFER}, server_momentum=0.9, **OFFERED_NODES_ONLY),
    "fedadam": lambda x, n: ResumableFedAdam(model=x, buffers={BUFFER}, **OFFERED_NODES_ONLY),
}
"""Each rule's server as the factories build it (with a non-trivial setting where it has one)."""
FEDAVG_FAMILY = ("fedavg", "fedprox", "fedbabu", "fedetf")
"""The rules whose aggregate is FedAvg's mean (FedBABU and FedETF: of the body)."""


def aggregate(rule: str, x: NamedArrays, models: list[NamedArrays], examples: list[int],
              a_norms: list[float] | None = None, strategy=None, order: list[int] | None = None) -> NamedArrays:
    """One round of ``rule`` (or of ``strategy``): x sent, ``models`` back with their
    examples, in ``order`` (default: as given). Client i's SCAFFOLD delta_c is 0.1 (i + 1)
    and its FedNova ||a_i||_1 ``a_norms[i]`` (default 1 + i): they go with their client."""
    strategy = strategy or RULES[rule](x, len(models))
    order = order or list(range(len(models)))
    list(strategy.configure_train(1, to_record(x), ConfigRecord(), InProcessGrid(ClientApp(), len(models))))
    replies = train_replies([models[i] for i in order], [examples[i] for i in order])
    for i, msg in zip(order, replies):
        delta = {k: np.full_like(x[k], 0.1 * (i + 1)) for k in float_names(x)}
        msg.content[REPORT_KEY] = ConfigRecord({"partition-id": i, "details": "{}",
                                                UPLOAD_PREFIX + DELTA_CONTROL: pack(delta)})
        msg.content["metrics"][A_NORM] = a_norms[i] if a_norms else 1.0 + i
    return from_record(strategy.aggregate_train(1, replies)[0])


def assert_models_close(got: NamedArrays, want: NamedArrays, exact: bool = False) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        if exact:
            assert got[k].tobytes() == want[k].tobytes(), k
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("rule", sorted(RULES))
@CHEAP
@given(federations(min_clients=2), st.randoms(use_true_random=False))
def test_the_aggregate_does_not_depend_on_the_order_of_the_replies(rule, federation, random):
    """The same replies in another order: the same aggregate (to float rounding: the mean's
    sum runs in the replies' order), and the same server state (SCAFFOLD's c, FedDyn's h)."""
    x, models, examples = federation
    order = list(range(len(models)))
    random.shuffle(order)
    first, shuffled = RULES[rule](x, len(models)), RULES[rule](x, len(models))
    want = aggregate(rule, x, models, examples, strategy=first)
    assert_models_close(aggregate(rule, x, models, examples, strategy=shuffled, order=order), want)
    if rule in ("scaffold", "feddyn"):
        assert_models_close(shuffled.state_arrays(), first.state_arrays())


def with_head(model: NamedArrays, x: NamedArrays, rule: str) -> NamedArrays:
    """What the rule's aggregate holds where ``model`` is the mean: FedBABU and FedETF keep x's head."""
    return {**model, HEAD: x[HEAD]} if rule in ("fedbabu", "fedetf") else model


@pytest.mark.parametrize("rule", FEDAVG_FAMILY)
@CHEAP
@given(federations(max_clients=1))
def test_one_client_gets_its_own_model_back(rule, federation):
    x, [model], examples = federation
    assert_models_close(aggregate(rule, x, [model], examples), with_head(model, x, rule), exact=True)


@pytest.mark.parametrize("rule", FEDAVG_FAMILY)
@CHEAP
@given(federations(), st.sampled_from(["examples", "uniform"]))
def test_identical_clients_leave_the_model_where_they_put_it(rule, federation, weighting):
    x, models, examples = federation
    strategy = RULES[rule](x, len(models))
    strategy.weighting = weighting
    same = [models[0]] * len(models)
    assert_models_close(aggregate(rule, x, same, examples, strategy=strategy), with_head(models[0], x, rule),
                        exact=True)


@pytest.mark.parametrize("rule", [*FEDAVG_FAMILY, "fednova", "scaffold"])
@CHEAP
@given(federations())
def test_weights_follow_the_sample_counts(rule, federation):
    """Weighted by examples (the default): the hand-computed mean sum n_i y_i / sum n_i (FedAvg's
    family; FedNova and SCAFFOLD at equal a_i and eta_g 1), and a client sent twice weighs as
    one with twice its examples."""
    x, models, examples = federation
    norms = [3.0] * (len(models) + 1)
    got = aggregate(rule, x, models, examples, norms)
    total = sum(examples)
    want = {k: cast(sum(m[k].astype(np.float64) * n for m, n in zip(models, examples)) / total, x[k].dtype)
            for k in x}
    assert_models_close(got, with_head(want, x, rule))
    twice = aggregate(rule, x, [*models, models[0]], [*examples, examples[0]], norms)
    assert_models_close(twice, aggregate(rule, x, models, [2 * examples[0], *examples[1:]], norms))


@pytest.mark.parametrize("rule", [*FEDAVG_FAMILY, "fedavgm", "fedadam"])
@CHEAP
@given(federations(), st.integers(0, 2**32 - 1))
def test_coordinates_every_client_pruned_stay_zero(rule, federation, seed):
    """A shared random support: the aggregate is exactly 0 off it, x's value there
    notwithstanding (the server optimisers told the clients prune)."""
    x, models, examples = federation
    rng = np.random.default_rng(seed)
    masks = {k: rng.random(x[k].shape) < 0.5 for k in float_names(x)}
    pruned = [{k: np.where(masks[k], 0.0, v).astype(v.dtype) if k in masks else v for k, v in m.items()}
              for m in models]
    strategy = RULES[rule](x, len(models))
    if rule in ("fedavgm", "fedadam"):
        strategy.pruned = True
    got = aggregate(rule, x, pruned, examples, strategy=strategy)
    for k, mask in masks.items():
        if rule in ("fedbabu", "fedetf") and k == HEAD:
            continue  # the fixed head is the server's, never pruned by these clients
        assert not got[k][mask].any(), k


SERVER_NEUTRAL = {
    "fedprox at mu 0": (lambda x, n: WeightedFedProx(0.0, **OFFERED_NODES_ONLY), True),
    "scaffold at eta_g 1": (lambda x, n: Scaffold({k: np.zeros_like(x[k]) for k in float_names(x)}, n,
                                                  **OFFERED_NODES_ONLY), False),
    "fednova at equal a_i": (lambda x, n: FedNova(float_names(x), **OFFERED_NODES_ONLY), False),
    "fedavgm at momentum 0, eta 1": (lambda x, n: ResumableFedAvgM(model=x, buffers={BUFFER}, **OFFERED_NODES_ONLY),
                                     False),
}
"""Each server rule at its neutral setting, and whether it is FedAvg bitwise (else to float
rounding: these step from x, x + (mean - x), where FedAvg takes the mean itself)."""


@pytest.mark.parametrize("neutral", sorted(SERVER_NEUTRAL))
@CHEAP
@given(federations())
def test_each_server_rule_at_its_neutral_setting_is_fedavg(neutral, federation):
    x, models, examples = federation
    build, bitwise = SERVER_NEUTRAL[neutral]
    norms = [2.0] * len(models)
    got = aggregate("", x, models, examples, norms, strategy=build(x, len(models)))
    assert_models_close(got, aggregate("fedavg", x, models, examples, norms), exact=bitwise)


# --- client side ----------------------------------------------------------------------------

class ZeroControlScaffold(ScaffoldClient):
    """SCAFFOLD with c = c_i = 0 (its neutral setting), as the server's first round sends it."""

    def fit(self, parameters, config):
        self.received = {CONTROL: {n: np.zeros(tuple(p.shape), np.float32) for n, p in self.model.named_parameters()}}
        return super().fit(parameters, config)


CLIENT_NEUTRAL = {
    "proximal at mu 0": (ProximalClient, None, {"proximal-mu": 0.0}),
    "fedlc at tau 0": (FedLCClient, FedLCConfig(tau=0.0), {}),
    "fedrs at alpha 1": (FedRSClient, FedRSConfig(alpha=1.0), {}),
    "moon at mu 0": (MoonClient, MoonConfig(mu=0.0), {}),
    "feddecorr at beta 0": (FedDecorrClient, FedDecorrConfig(beta=0.0), {}),
    "scaffold at c = c_i = 0": (ZeroControlScaffold, None, {}),
}
"""Each client rule at its neutral setting (MOON with a previous model, so its term runs at 0)."""


def trained(cls, params, config: dict, seed: int, samples: int, epochs: int, momentum: float,
            state: NamedArrays | None = None) -> list[np.ndarray]:
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model("simple_cnn", {"channels": [2, 4]}, in_channels=1, num_classes=3, image_size=8)
    y = torch.randint(0, 3, (samples,), generator=generator)
    data = ClientData(torch.randn(samples, 1, 8, 8, generator=generator), y, num_classes=3)
    client = cls(params, model=model, data=data, train=TrainConfig(optimizer="sgd", lr=0.05, momentum=momentum,
                                                                  epochs=epochs, batch_size=4),
                 pruning=PruningConfig(mode="dense"), seed=seed, partition_id=0, state=state)
    weights, _, _ = client.fit(client.get_parameters({}), {"server-round": 1, **config})
    return [w.copy() for w in weights]


@pytest.mark.parametrize("neutral", sorted(CLIENT_NEUTRAL))
@settings(CHEAP, max_examples=4)
@given(st.integers(0, 2**31 - 1), st.integers(3, 13), st.integers(1, 2), st.sampled_from([0.0, 0.9]))
def test_each_client_rule_at_its_neutral_setting_trains_bitwise_as_the_plain_client(neutral, seed, samples, epochs,
                                                                                   momentum):
    cls, params, config = CLIENT_NEUTRAL[neutral]
    state = None
    if cls is MoonClient:  # a previous model: another draw's trained weights
        model = build_model("simple_cnn", {"channels": [2, 4]}, in_channels=1, num_classes=3, image_size=8)
        state = dict(zip(model.state_dict(), trained(FedMechClient, None, {}, seed + 1, samples, 1, momentum)))
    plain = trained(FedMechClient, None, {}, seed, samples, epochs, momentum)
    for got, want in zip(trained(cls, params, config, seed, samples, epochs, momentum, state), plain, strict=True):
        assert got.tobytes() == want.tobytes()
