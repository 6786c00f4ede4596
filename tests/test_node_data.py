"""Edge nodes that bring their own data: checks before the first round (fast, no Flower),
then whole runs with own-data nodes in this process (seconds each); the real Deployment
Engine runs are in test_deploy_node_data.py."""

from __future__ import annotations

import io
import json
import logging
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, smoke_config, without_measured
from fedmech_flwr.app.inprocess import run_in_process
from fedmech_flwr.app.node_data import NodeDataError, NodeDataSpec, class_index, load_node_data, write_node_data
from fedmech_flwr.artifacts.folder import CLIENT_FAILURES_LOG, FINAL_MODEL_FILE, LOGS_DIR, read_records, read_status
from fedmech_flwr.datasets.data import Pixels, _normalise
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.learning.arrays import load_arrays
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, main
from fedmech_flwr.tools.deployment import node_configs

FASHION = ("T-shirt/top", "Trouser", "Pullover")
PIXELS = Pixels("uint8", (0.2860,), (0.3530,))
GREY = NodeDataSpec("fashion_mnist", FASHION, (1, 8, 8), PIXELS)
"""A greyscale 8x8 three-class experiment, as the server would describe it."""


def images(n: int = 12, size: int = 8, channels: int | None = None) -> np.ndarray:
    shape = (n, size, size) if channels is None else (n, size, size, channels)
    return np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)


def npz(path, **arrays):
    np.savez(path, **arrays)
    return path


# --- pixels -----------------------------------------------------------------------------

def test_node_pixels_become_bitwise_the_datasets_tensors_and_back():
    x = images(5, channels=1)
    shard = _normalise(x[..., 0], PIXELS.mean, PIXELS.std)  # as the dataset normalised its shard
    tensors = PIXELS.to_tensor(x)
    assert torch.equal(tensors, shard) and tensors.stride() == shard.stride()
    assert np.array_equal(PIXELS.from_tensor(shard), x)
    with pytest.raises(ValueError, match="do not map back bitwise"):
        PIXELS.from_tensor(shard + 1e-3)


# --- checks before the first round --------------------------------------------------------

def test_a_good_npz_is_read_with_its_validation_split(tmp_path):
    y = np.array([0, 1, 2, 2] * 3)
    data = load_node_data(npz(tmp_path / "d.npz", x=images(), y=y, x_val=images(4), y_val=y[:4]), GREY)
    assert data.x.shape == (12, 1, 8, 8) and data.y.dtype == torch.int64
    assert data.label_histogram == [3, 3, 6]
    assert data.x_val.shape == (4, 1, 8, 8) and data.y_val.tolist() == [0, 1, 2, 2]


LABELS = np.arange(12) % 3


@pytest.mark.parametrize("make, message", [
    (lambda p: npz(p, x=images(size=10), y=LABELS), "images are 10x10 pixels, expected 8x8"),
    (lambda p: npz(p, x=images(channels=3), y=LABELS), "images have 3 channel(s), expected 1"),
    (lambda p: npz(p, x=images(), y=np.array([0, 1, 2, 3] * 3)), "y holds label 3, outside the 3 classes 0..2"),
    (lambda p: npz(p, x=images(), y=LABELS - 1), "y holds label -1, outside the 3 classes 0..2"),
    (lambda p: (p.write_bytes(b""), p)[1], "is empty (0 bytes)"),
    (lambda p: (p.write_text("x,y\n1,2\n"), p)[1], "is not an npz file"),
    (lambda p: npz(p, x=images()), "has no array(s) ['y']"),
    (lambda p: (np.save(p.with_suffix(".npy"), images()), p.with_suffix(".npy"))[1], "is a single .npy array"),
    (lambda p: npz(p, x=images().astype(np.float32), y=LABELS), "x is float32; expected x: uint8 [N,8,8]"),
    (lambda p: npz(p, x=images(5), y=LABELS[:5]), "holds 5 training sample(s); a node needs at least 10"),
    (lambda p: npz(p, x=images(0), y=LABELS[:0]), "holds 0 training sample(s)"),
    (lambda p: npz(p, x=images(), y=LABELS, x_val=images(2)), "only one of x_val and y_val"),
    (lambda p: npz(p, x=images(), y=LABELS, x_val=images(2, size=9), y_val=LABELS[:2]), "x_val: images are 9x9"),
    (lambda p: p.with_suffix(".missing"), "does not exist"),
])
def test_bad_npz_is_refused_with_the_reason(tmp_path, make, message):
    path = make(tmp_path / "node.npz")
    with pytest.raises(NodeDataError) as err:
        load_node_data(path, GREY)
    assert message in str(err.value) and str(path) in str(err.value)


def npz_with_header(path, x_shape: tuple[int, ...], x_bytes: bytes):
    """An npz whose ``x`` header claims ``x_shape`` but holds ``x_bytes`` (a damaged or
    hostile file: numpy would allocate the claimed shape first)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": x_shape})
    labels = io.BytesIO()
    np.save(labels, LABELS)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue() + x_bytes)
        archive.writestr("y.npy", labels.getvalue())
    return path


def test_an_npz_header_is_checked_before_anything_is_loaded(tmp_path):
    huge = npz_with_header(tmp_path / "huge.npz", (10**12, 8, 8), bytes(12 * 64))
    with pytest.raises(NodeDataError) as err:
        load_node_data(huge, GREY)
    assert str(err.value) == (f"{huge}: x claims shape (1000000000000, 8, 8) uint8 = 64,000,000,000,000 bytes but the "
                              "member holds 768 bytes; the file is damaged or cut short: get a good copy")
    wide = npz_with_header(tmp_path / "wide.npz", (12, 800, 800), bytes(12 * 800 * 800))
    with pytest.raises(NodeDataError, match="x: images are 800x800 pixels, expected 8x8"):
        load_node_data(wide, GREY)
    assert load_node_data(npz_with_header(tmp_path / "ok.npz", (12, 8, 8), images().tobytes()), GREY).x.shape[0] == 12


def test_deploy_local_checks_each_node_files_headers_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Not the node, mid-run: ``fedmech deploy-local`` exits 2 with one line naming the file."""
    import fedmech_flwr.tools.cli as cli

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(cli, "deploy_local", lambda *args, **kwargs: pytest.fail("deploy-local started Flower"))
    (nodes := tmp_path / "nodes").mkdir()
    npz(nodes / "a.npz", x=images(), y=LABELS)
    huge = npz_with_header(nodes / "b.npz", (10**12, 8, 8), bytes(12 * 64))
    command = ["deploy-local", "experiments/smoke.yaml", "--node-data", str(nodes), "--out", str(tmp_path / "runs")]
    assert main(command) == EXIT_BAD_INPUT
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"error: {huge}: x claims shape (1000000000000, 8, 8) uint8 = 64,000,000,000,000 bytes but the "
                    "member holds 768 bytes; the file is damaged or cut short: get a good copy")


def save_image(path, mode: str = "L", size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (size, size), 100).save(path)


def png_header(path, size: int) -> None:
    """A greyscale PNG that claims ``size`` x ``size`` pixels and holds none (no image data)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 0, 0, 0, 0))
                     + chunk(b"IEND", b""))


def test_class_folders_map_to_the_experiments_classes():
    assert class_index("t-shirt_top", FASHION) == 0 and class_index("PULLOVER", FASHION) == 2
    assert class_index("1", FASHION) == 1 and class_index("3", FASHION) is None and class_index("Dress", FASHION) is None


def test_an_image_folder_is_read_in_class_then_file_order(tmp_path):
    for name, files in (("Trouser", ["b.png", "a.jpg"]), ("t-shirt_top", [f"{i}.png" for i in range(10)])):
        for f in files:
            save_image(tmp_path / name / f)
    (tmp_path / "Trouser" / "notes.txt").write_text("not an image: left out")
    data = load_node_data(tmp_path, GREY)
    assert data.y.tolist() == [0] * 10 + [1, 1] and data.label_histogram == [10, 2, 0]
    assert torch.equal(data.x[0], PIXELS.to_tensor(np.full((1, 8, 8), 100, np.uint8))[0])


@pytest.mark.parametrize("make, message", [
    (lambda root: save_image(root / "Trousers" / "a.png"), "unknown class folder 'Trousers'; did you mean 'Trouser'?"),
    (lambda root: save_image(root / "Trouser" / "a.png", size=28), "image is 28x28 pixels, expected 8x8"),
    (lambda root: save_image(root / "Trouser" / "a.png", mode="RGB"), "image has 3 channel(s) (mode RGB), expected 1"),
    (lambda root: root.mkdir(), "holds no class folders"),
    # checked from the header, before the pixels are decoded
    (lambda root: png_header(root / "Trouser" / "a.png", 5000), "image is 5000x5000 pixels, expected 8x8"),
    (lambda root: png_header(root / "Trouser" / "a.png", 20000), "is not a readable image (Image size (400000000 "
                                                                 "pixels) exceeds limit"),
])
def test_bad_image_folder_is_refused_with_the_reason(tmp_path, make, message):
    root = tmp_path / "images"
    make(root)
    with pytest.raises(NodeDataError, match=None) as err:
        load_node_data(root, GREY)
    assert message in str(err.value)


def test_the_spec_travels_as_json():
    assert NodeDataSpec.from_json(GREY.to_json()) == GREY


def test_deploy_local_node_configs_put_shard_nodes_first(tmp_path):
    own = [tmp_path / "site_a.npz", tmp_path / "site b"]
    assert node_configs(3, own) == [
        "partition-id=0 num-partitions=3",
        f'data-path="{own[0]}" node-name="site_a"',
        f'data-path="{own[1]}" node-name="site b"',
    ]
    with pytest.raises(ValueError, match="--node-data holds 2 entries but federation.num_clients is 1"):
        node_configs(1, own)


# --- runs with own-data nodes (in this process) ----------------------------------------------

TWO = ["federation.num_clients=2"]


@pytest.fixture(scope="module")
def node_files(tmp_path_factory):
    """The smoke experiment's two shards (2 clients) written as per-node files."""
    out = tmp_path_factory.mktemp("nodes")
    return write_node_data(smoke_config(TWO), out)


def own(path, name: str | None = None) -> dict:
    return {"data-path": str(path), "node-name": name or path.stem}


def test_nodes_on_the_shards_files_run_bitwise_as_the_shard_nodes(tmp_path, node_files):
    cfg = smoke_config(TWO)
    shards = run_in_process(cfg, tmp_path / "shards")
    owned = run_in_process(cfg, tmp_path / "own", node_configs=[own(p) for p in node_files])
    ref, new = load_arrays(shards / FINAL_MODEL_FILE), load_arrays(owned / FINAL_MODEL_FILE)
    assert all(np.array_equal(ref[k], new[k]) for k in ref)
    assert without_measured(read_records(owned)) == without_measured(read_records(shards))
    ref_parts, own_parts = (json.loads((run / "partitions.json").read_text()) for run in (shards, owned))
    assert [c.pop("source") for c in ref_parts["clients"]] == ["shard", "shard"]
    assert [(c.pop("source"), c.pop("node")) for c in own_parts["clients"]] == [
        ("node-provided", "node_000"), ("node-provided", "node_001")]
    assert own_parts == ref_parts  # the same counts and histograms, only the source differs


def bad_node(tmp_path):
    return npz(tmp_path / "bad.npz", x=np.zeros((20, 28, 28), np.float32), y=np.arange(20) % 4)


def test_a_node_with_bad_data_is_refused_before_training_and_the_run_goes_on(tmp_path, node_files, caplog):
    cfg = smoke_config(["federation.num_clients=3", "federation.num_rounds=1", "federation.on_client_failure=continue"])
    nodes = [own(node_files[0]), own(bad_node(tmp_path), "lab"), {"partition-id": 1, "num-partitions": 3}]
    with caplog.at_level(logging.ERROR, logger="fedmech_flwr.app.client_app"):
        run = run_in_process(cfg, tmp_path / "runs", node_configs=nodes)
    assert "node 'lab' refuses to take part" in caplog.text and "images are 28x28 pixels, expected 12x12" in caplog.text
    assert read_status(run)["status"] == "completed"
    (failure,) = read_records(run, "failure")
    assert failure["round"] == 0 and failure["partition_id"] is None and failure["node"] == 1001
    assert failure["reason"].startswith("raised: NodeDataError: node 'lab': ")
    assert "images are 28x28 pixels, expected 12x12" in failure["reason"]
    assert "node 1001" in (run / LOGS_DIR / CLIENT_FAILURES_LOG).read_text()
    # the shard node keeps partition-id 1; the good own-data node takes the first free id
    assert sorted(r["partition_id"] for r in read_records(run, "client")) == [0, 1]
    parts = json.loads((run / "partitions.json").read_text())["clients"]
    assert [(c["partition_id"], c["source"], c.get("node")) for c in parts] == [
        (0, "node-provided", "node_000"), (1, "shard", None)]


def test_with_the_fail_policy_a_refused_node_stops_the_run_before_training(tmp_path, node_files):
    cfg = smoke_config(TWO)
    with pytest.raises(Exception, match="was refused before the first round"):
        run_in_process(cfg, tmp_path / "runs", node_configs=[own(node_files[0]), own(bad_node(tmp_path), "lab")])
    (run,) = list((tmp_path / "runs").iterdir())
    assert read_status(run)["status"] == "failed"
    assert [r["kind"] for r in read_records(run)] == ["failure"]  # nothing trained


def test_own_data_with_a_validation_split_reports_its_numbers(tmp_path, node_files):
    z = np.load(node_files[0])
    path = npz(tmp_path / "val.npz", x=z["x"], y=z["y"], x_val=z["x"][:10], y_val=z["y"][:10])
    cfg = smoke_config(["federation.num_clients=1", "federation.num_rounds=1"])
    run = run_in_process(cfg, tmp_path / "runs", node_configs=[own(path)])
    (record,) = read_records(run, "client")
    assert 0.0 <= record["val_accuracy"] <= 1.0 and record["val_loss"] > 0


def test_a_node_with_both_a_partition_and_own_data_is_refused():
    from flwr.app import Context, RecordDict

    from fedmech_flwr.app.client_app import own_data

    context = Context(run_id=1, node_id=7, node_config={"data-path": "/x.npz", "partition-id": 0}, state=RecordDict(),
                      run_config={})
    with pytest.raises(ConfigError, match="has both data-path and partition-id"):
        own_data(context, GREY.to_json())


def test_synthetic_data_has_no_image_form(tmp_path):
    with pytest.raises(ValueError, match="dataset 'synthetic' has no image form"):
        write_node_data(smoke_config(TWO), tmp_path, fmt="images")


@pytest.mark.integration
def test_a_fashion_mnist_shard_written_as_pngs_reads_back_as_the_same_images(tmp_path):
    from fedmech_flwr.spec.experiment import client_partitions, load_data

    cfg = smoke_config(["data.dataset={name: fashion_mnist}", "federation.num_clients=300", "data.partition={name: iid}"])
    (folder,) = write_node_data(cfg, tmp_path, partition_ids=[7], fmt="images")
    bundle = load_data(cfg)
    data = load_node_data(folder, NodeDataSpec.of(bundle))
    idx = torch.from_numpy(client_partitions(cfg, bundle)[7])
    order = torch.argsort(bundle.y_train[idx], stable=True)  # the folder is read in class order
    assert torch.equal(data.y, bundle.y_train[idx][order]) and torch.equal(data.x, bundle.x_train[idx][order])


def test_deploy_local_refuses_bad_node_data_folders_before_flower_starts(tmp_path, monkeypatch, capsys):
    from fedmech_flwr.tools import cli

    monkeypatch.setattr(cli, "deploy_local", lambda *a, **k: pytest.fail("Flower was started"))
    command = ["deploy-local", "experiments/smoke.yaml", "--out", str(tmp_path / "runs"), "--node-data"]
    monkeypatch.chdir(REPO)
    assert cli.main([*command, str(tmp_path / "missing")]) == cli.EXIT_BAD_INPUT
    assert "is not a folder" in capsys.readouterr().err
    for i in range(4):
        npz(tmp_path / f"node_{i}.npz", x=images(), y=LABELS)
    assert cli.main([*command, str(tmp_path)]) == cli.EXIT_BAD_INPUT
    assert "--node-data holds 4 entries but federation.num_clients is 3" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_client_side_diagnostics_and_class_statistics_run_unchanged_on_node_data(tmp_path):
    """circuits (on the client's data, after training and on the aggregate) and NCM's class
    statistics: a node on its shard's file reports what the shard node reports."""
    from fedmech_flwr.contracts import plugins
    from fedmech_flwr.spec.experiment import load_experiment

    plugins.load()
    cfg = load_experiment(REPO / "experiments" / "circuits_smoke.yaml",
                          ["federation.num_rounds=1", "strategy={name: ncm}",
                           "diagnostics=[{name: circuits, gates: {steps: 10}, min_class_samples: 10, ablations: []}]"])
    files = write_node_data(cfg, tmp_path / "nodes", partition_ids=[2])
    shards = run_in_process(cfg, tmp_path / "shards")
    mixed = run_in_process(cfg, tmp_path / "mixed", node_configs=[
        {"partition-id": 0, "num-partitions": 3}, {"partition-id": 1, "num-partitions": 3}, own(files[0])])
    circuits = [r for r in read_records(mixed, "diagnostic") if r["name"] == "circuits"]
    assert len(circuits) == 1 and without_measured(read_records(mixed)) == without_measured(read_records(shards))
    ref, new = load_arrays(shards / FINAL_MODEL_FILE), load_arrays(mixed / FINAL_MODEL_FILE)
    assert all(np.array_equal(ref[k], new[k]) for k in ref)  # NCM's head from the same class statistics
    assert load_arrays(mixed / "diagnostics" / "circuits" / "round_001.safetensors").keys() == \
        load_arrays(shards / "diagnostics" / "circuits" / "round_001.safetensors").keys()
