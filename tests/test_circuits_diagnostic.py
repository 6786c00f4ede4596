"""The ``circuits`` diagnostic plug-in: IoU bookkeeping against hand-made masks, the
post-aggregation client round trip, what lands in the run folder, and that observing
never changes training."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

from conftest import as_killed, assert_same_run
from faults import Fault, SimulatedCrash, faulty_app
from fedmech_flwr.app.inprocess import resume_in_process, run_in_process
from fedmech_flwr.artifacts.folder import STATE_FILE, read_records
from fedmech_flwr.builtin.diagnostics.circuits.diagnostic import Circuits, CircuitsConfig
from fedmech_flwr.contracts import plugins
from fedmech_flwr.contracts.hooks import ClientUpdate, RoundState, decode_results, encode_results
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import load_arrays, model_arrays
from fedmech_flwr.learning.masks import pack_masks, unpack_masks
from fedmech_flwr.models import build_model
from fedmech_flwr.spec.experiment import load_experiment

REPO = Path(__file__).resolve().parents[1]

CIRCUITS_SMOKE = REPO / "experiments" / "circuits_smoke.yaml"
LAYERS = {"conv1": 4, "conv2": 8}


def mask(conv1: list[int], conv2: list[int]) -> dict[str, np.ndarray]:
    out = {"conv1": np.zeros(4, bool), "conv2": np.zeros(8, bool)}
    out["conv1"][conv1] = True
    out["conv2"][conv2] = True
    return out


def state(server_round: int, local: dict, glob: dict) -> RoundState:
    model = build_model("simple_cnn", {"channels": [4, 8]}, in_channels=1, num_classes=3, image_size=12)
    arrays = model_arrays(model)
    clients = {
        partition_id: ClientUpdate(partition_id, arrays, 10, {},
                                   {"circuits": {"masks": pack_masks(local[partition_id])}},
                                   {"circuits": {"masks": pack_masks(glob[partition_id])}})
        for partition_id in local
    }

    def build(a):
        return model

    x = torch.zeros(30, 1, 12, 12)
    return RoundState(server_round, arrays, arrays, clients, {"test": (x, torch.arange(30) % 3)}, 3, build, torch.device("cpu"), 0)


def test_iou_bookkeeping_matches_hand_computed_values():
    diag = Circuits(CircuitsConfig(ablations=[]))
    a, b = mask([0, 1], [0, 1, 2, 3]), mask([2, 3], [4, 5, 6, 7])  # disjoint
    half = mask([0, 1], [0, 1, 4, 5])  # conv1 IoU 1, conv2 IoU 2/6
    empty = mask([], [])
    local = {0: {0: a, 1: b}, 1: {0: a}}
    glob = {0: {0: a, 1: a}, 1: {0: b}}
    round1 = state(1, local, glob)
    before = {k: v.tobytes() for k, v in round1.global_arrays.items()}
    r1 = diag.server_side(round1).metrics
    assert {k: v.tobytes() for k, v in round1.global_arrays.items()} == before  # observe only
    cls0 = r1["per_class"]["0"]
    assert cls0["clients"] == [0, 1]
    assert cls0["inter_client"] == pytest.approx(1.0)  # both clients share mask a
    assert cls0["local_to_global"] == pytest.approx(0.5)  # client 0: a vs a, client 1: a vs b
    assert cls0["intra_client"] is None  # no previous participation yet
    assert r1["per_class"]["1"]["inter_client"] is None  # one holder only
    assert r1["per_class"]["2"]["clients"] == []  # nobody holds class 2: absent, not filled
    assert r1["mean"]["inter_class_local"] == pytest.approx(0.0)  # client 0: a vs b
    assert r1["mean"]["inter_class_global"] == pytest.approx(1.0)  # client 0's global: a vs a
    assert r1["sizes"]["local"]["conv1"] == pytest.approx(2.0)

    r2 = diag.server_side(state(2, {0: {0: half, 1: empty}, 1: {0: a}}, {0: {0: half, 1: empty}, 1: {0: a}})).metrics
    assert r2["per_class"]["0"]["intra_client"] == pytest.approx(np.mean([(1 + 2 / 6) / 2, 1.0]))
    assert r2["per_class"]["1"]["intra_client"] == pytest.approx(0.0)  # b vs empty
    assert r2["per_class"]["1"]["intra_client_empty"] == 1  # the collapse is counted, not hidden
    assert r2["per_class"]["1"]["local_to_global"] is None  # empty vs empty: undefined, not 1.0
    assert r2["per_class"]["1"]["local_to_global_undefined"] == 1
    assert r2["per_class"]["1"]["local_to_global_empty"] == 2
    assert r2["empty_iou"] is None


def test_empty_vs_empty_is_left_out_of_means_and_counted_unless_a_convention_is_asked_for():
    a, b, empty = mask([0, 1], [0, 1, 2, 3]), mask([0, 1], [0, 1]), mask([], [])
    local, glob = {0: {0: a}, 1: {0: empty}}, {0: {0: b}, 1: {0: empty}}  # conv1 IoU 1, conv2 2/4
    r = Circuits(CircuitsConfig(ablations=[])).server_side(state(1, local, glob)).metrics
    assert r["per_class"]["0"]["local_to_global"] == pytest.approx(0.75)  # client 0 only
    assert (r["per_class"]["0"]["local_to_global_pairs"], r["per_class"]["0"]["local_to_global_undefined"]) == (1, 1)
    assert r["mean"]["local_to_global"] == pytest.approx(0.75)
    assert (r["pairs"]["local_to_global"], r["undefined"]["local_to_global"], r["empty"]["local_to_global"]) == (1, 1, 2)
    # the untrained model says class 0 for every (blank) image, gates open or closed
    assert r["circuit_counts"]["local"] == {"circuits": 2, "empty": 1, "bias_only": 1}
    paper = Circuits(CircuitsConfig(ablations=[], empty_iou=1.0)).server_side(state(1, local, glob)).metrics
    assert paper["per_class"]["0"]["local_to_global"] == pytest.approx((0.75 + 1.0) / 2)  # the paper's convention
    assert (paper["pairs"]["local_to_global"], paper["undefined"]["local_to_global"]) == (2, 0)
    assert paper["empty_iou"] == 1.0
    zero = Circuits(CircuitsConfig(ablations=[], empty_iou=0.0)).server_side(state(1, local, glob)).metrics
    assert zero["per_class"]["0"]["local_to_global"] == pytest.approx(0.75 / 2)


def test_results_keep_bytes_through_a_config_record():
    packed = pack_masks({3: mask([1], [2, 5])})
    record = ConfigRecord(encode_results({"circuits": {"held": [3], "masks": packed, "seconds": 0.5}}))
    assert isinstance(record["bytes:circuits:masks"], bytes)
    back = decode_results(record)["circuits"]
    assert back["held"] == [3] and back["seconds"] == 0.5
    np.testing.assert_array_equal(unpack_masks(back["masks"], LAYERS)[3]["conv2"], mask([1], [2, 5])["conv2"])


@pytest.fixture(scope="module")
def circuits_run(tmp_path_factory):
    plugins.load()
    torch.set_num_threads(1)
    return run_in_process(load_experiment(CIRCUITS_SMOKE), tmp_path_factory.mktemp("circuits"))


def test_run_records_circuits_every_round(circuits_run):
    records = [r for r in read_records(circuits_run, "diagnostic") if r["name"] == "circuits"]
    assert [r["round"] for r in records] == [1, 2]
    assert records[0]["mean"]["intra_client"] is None and records[1]["mean"]["intra_client"] is not None
    for r in records:
        # class_map {0: [0, 1], 1: [1, 2], 2: [2, 3]}: class 1 is held by clients 0 and 1 only
        assert r["per_class"]["1"]["clients"] == [0, 1]
        assert r["per_class"]["3"]["clients"] == [2]
        assert r["mean"]["local_to_global"] is not None and r["mean"]["inter_client"] is not None
        for variant in ("global", "cross", "local"):
            report = r["ablation"][variant]["1"]
            assert set(report) == {"baseline", "circuit", "random", "clients", "degenerate_sufficiency", "images",
                                   "class_images"}
            assert report["circuit"]["sufficiency"]["zero"]["ci95"]["accuracy"] > 0  # the sampling interval
            assert set(report["circuit"]) == {"sufficiency", "necessity"}
            assert set(report["circuit"]["sufficiency"]) == {"zero", "mean"}
        assert all(s["local"] is not None and s["global"] is not None for s in r["client_seconds"].values())
    masks = load_arrays(circuits_run / "diagnostics" / "circuits" / "round_002.safetensors")
    assert "local/0/1/conv1" in masks and "global/2/3/conv2" in masks
    assert "local/0/3/conv1" not in masks  # client 0 never held class 3
    for r in records:
        assert set(r["circuit_counts"]) == {"local", "global"} and r["empty_iou"] is None
        assert set(r["predictions"]["clients"]) == {"0", "1", "2"}
        assert r["pairs"]["inter_client"] >= 1 and r["ablation"]["cross"]["1"]["degenerate_sufficiency"] >= 0
    for name in ("circuits_iou.png", "circuits_local_to_global.png", "circuits_size.png", "circuits_empty.png"):
        assert (circuits_run / "plots" / name).stat().st_size > 0


def test_observing_circuits_never_changes_training(circuits_run, tmp_path):
    plugins.load()
    without = run_in_process(load_experiment(CIRCUITS_SMOKE, ["diagnostics=[]"]), tmp_path)
    strip = lambda rs: [{k: v for k, v in r.items() if not re.search(r"seconds|per-s|rss_mb", k)} for r in rs]  # noqa: E731
    assert strip(read_records(circuits_run, "eval")) == strip(read_records(without, "eval"))
    final = load_arrays(circuits_run / "model_final.safetensors")
    other = load_arrays(without / "model_final.safetensors")
    assert all(np.array_equal(final[k], other[k]) for k in final)


@pytest.mark.parametrize(
    "override, message",
    [
        ("diagnostics=[{name: circuits, gates: {lam: -1}}]", "lam must be >= 0, got -1"),
        ("diagnostics=[{name: circuits, gates: {steps: 0}}]", "steps must be >= 1, got 0"),
        ("diagnostics=[{name: circuits, ablations: [everything]}]", "choose one of 'global', 'cross', 'local'"),
        ("diagnostics=[{name: circuits, gate: {}}]", "unknown key(s) ['gate']"),
    ],
)
def test_bad_circuits_config_fails_at_load(override, message):
    plugins.load()
    with pytest.raises(ConfigError) as err:
        load_experiment(CIRCUITS_SMOKE, [override])
    assert message in str(err.value)


def test_audit_set_is_held_out_from_every_client_and_used_for_global_circuits(tmp_path):
    from fedmech_flwr.spec.experiment import audit_indices, client_partitions, load_data

    plugins.load()
    cfg = load_experiment(CIRCUITS_SMOKE, [
        "data.audit_per_class=5", "federation.num_rounds=1",
        "diagnostics=[{name: circuits, audit: true, ablations: [], gates: {steps: 10, batch_size: 16}, min_class_samples: 5}]",
    ])
    bundle = load_data(cfg)
    audit = audit_indices(cfg, bundle)
    assert np.bincount(bundle.y_train.numpy()[audit]).tolist() == [5, 5, 5, 5]
    assert not set(audit) & set(np.concatenate(client_partitions(cfg, bundle)))
    run = run_in_process(cfg, tmp_path)
    (rec,) = [r for r in read_records(run, "diagnostic") if r["name"] == "circuits"]
    assert rec["mean"]["audit_vs_client_context"] is not None
    assert set(rec["ablation"]["audit"]) == {"0", "1", "2", "3"}
    assert "audit/0/conv1" in load_arrays(run / "diagnostics" / "circuits" / "round_001.safetensors")


def test_audit_without_an_audit_set_is_a_clear_error(tmp_path):
    plugins.load()
    with pytest.raises(ConfigError, match="data.audit_per_class > 0"):  # before the run starts
        run_in_process(load_experiment(CIRCUITS_SMOKE, ["diagnostics=[{name: circuits, audit: true}]"]), tmp_path)
    assert not any(tmp_path.iterdir())


def test_ablations_leave_every_model_untouched():
    a, b = mask([0, 1], [0, 1, 2, 3]), mask([2, 3], [4, 5, 6, 7])
    round1 = state(1, {0: {0: a, 1: b}}, {0: {0: b, 1: a}})
    model = round1.build_model(round1.global_arrays)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diag = Circuits(CircuitsConfig(ablations=["global", "cross", "local"], ablation_samples=30))
    report = diag.server_side(round1).metrics["ablation"]
    assert set(report) == {"global", "cross", "local"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks for m in model.modules())


def test_resumed_run_keeps_each_clients_previous_circuits(circuits_run, tmp_path):
    """Killed in round 2, resumed: round 2's intra-client IoU needs round 1's circuits,
    which only the resume point holds (the diagnostic is ``Resumable``)."""
    plugins.load()
    with pytest.raises(SimulatedCrash):
        run_in_process(load_experiment(CIRCUITS_SMOKE), tmp_path, faulty_app(Fault("crash", 1, 2)))
    [run] = list(tmp_path.iterdir())
    as_killed(run)
    assert any(k.startswith("diagnostic/0.circuits/") for k in load_arrays(run / STATE_FILE))
    assert resume_in_process(run) == run
    assert_same_run(circuits_run, run)
