"""Dataset loaders: idx reader, search paths and errors, synthetic set, npz checks."""

from __future__ import annotations

import gzip
import io
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from fedmech_flwr.datasets import data
from fedmech_flwr.datasets.data import (
    DEBIAN_FASHION_MNIST,
    IDX_FILES,
    CIFAR10Config,
    DataInfo,
    FashionMNISTConfig,
    MNISTConfig,
    SyntheticConfig,
    cifar10,
    dataset_info,
    fashion_mnist,
    load_dataset,
    read_idx,
    repo_root,
)
from fedmech_flwr.foundation.errors import BadFileError, ConfigError, DataNotFoundError
from fedmech_flwr.tools.cli import EXIT_BAD_INPUT, main

SHARED_CIFAR = repo_root().parent / "shared" / "data" / "cifar10" / "cifar10.npz"


def write_idx(path: Path, array: np.ndarray, shape: tuple[int, ...] | None = None, code: int = 0x08) -> None:
    """Write an array as a gzipped idx file (magic 0x00 0x00 ``code`` ndim) whose header
    claims ``shape`` (default: the array's own)."""
    shape = array.shape if shape is None else shape
    header = bytes([0, 0, code, len(shape)]) + struct.pack(f">{len(shape)}i", *shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def write_idx_dataset(folder: Path, n_train: int = 12, n_test: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        np.arange(n_train, dtype=np.uint8) % 10,
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        np.arange(n_test, dtype=np.uint8) % 10,
    ]
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in zip(IDX_FILES, arrays):
        write_idx(folder / name, array)
    return arrays


def test_read_idx_round_trip(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    write_idx(tmp_path / "x.gz", images)
    back = read_idx(tmp_path / "x.gz")
    assert back.shape == (5, 4, 3) and back.dtype == np.uint8
    np.testing.assert_array_equal(back, images)


def test_read_idx_rejects_foreign_file(tmp_path):
    with gzip.open(tmp_path / "bad.gz", "wb") as f:
        f.write(b"PK\x03\x04 not an idx file")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "bad.gz")


def test_mnist_from_torchvision_layout_is_normalised_with_fixed_stats(tmp_path):
    raw = write_idx_dataset(tmp_path / "MNIST" / "raw")
    b = load_dataset("mnist", MNISTConfig(root=str(tmp_path)))
    assert b.x_train.shape == (12, 1, 28, 28) and b.x_train.dtype == torch.float32
    assert b.y_train.dtype == torch.int64 and b.x_test.shape == (6, 1, 28, 28)
    assert (b.in_channels, b.image_size, b.num_classes) == (1, 28, 10)
    expected = (raw[0].astype(np.float32) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(b.x_train[:, 0].numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(b.y_test.numpy(), raw[3])


def test_load_dataset_caches_per_config(tmp_path):
    write_idx_dataset(tmp_path)
    cfg = FashionMNISTConfig(root=str(tmp_path))
    assert load_dataset("fashion_mnist", cfg) is load_dataset("fashion_mnist", cfg)
    assert load_dataset("synthetic", SyntheticConfig(seed=1)) is not load_dataset(
        "synthetic", SyntheticConfig(seed=2)
    )


def test_missing_fashion_mnist_lists_paths_and_how_to_get_it(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("fashion_mnist", FashionMNISTConfig(root=str(root)))
    message = str(err.value)
    assert str(root) in message and str(root / "FashionMNIST" / "raw") in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "download=True" in message and "data.dataset.root" in message


def test_incomplete_folder_names_missing_files(tmp_path):
    write_idx_dataset(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataNotFoundError, match="missing t10k-labels-idx1-ubyte.gz"):
        load_dataset("mnist", MNISTConfig(root=str(tmp_path)))


def test_synthetic_shapes_balance_and_determinism():
    cfg = SyntheticConfig(num_train=60, num_test=20, num_classes=3, image_size=8, channels=3)
    a = load_dataset("synthetic", cfg)
    assert a.x_train.shape == (60, 3, 8, 8) and a.x_test.shape == (20, 3, 8, 8)
    assert a.y_train.dtype == torch.int64 and a.num_classes == len(a.class_names) == 3
    assert torch.bincount(a.y_train).tolist() == [20, 20, 20]
    again = load_dataset("synthetic", SyntheticConfig(**{**vars(cfg), "num_test": 21}))
    assert torch.equal(a.x_train, again.x_train) and torch.equal(a.y_train, again.y_train)
    other = load_dataset("synthetic", SyntheticConfig(**{**vars(cfg), "seed": 1}))
    assert not torch.equal(a.x_train, other.x_train)


def test_synthetic_described_without_images_has_the_labels_the_dataset_has():
    """``dataset_info`` of the synthetic set reads its labels without making an image, so
    the checks before a run draw the partitions the run does; for a size no machine holds
    it answers at once."""
    cfg = SyntheticConfig(num_train=60, num_test=21, num_classes=3, image_size=8, channels=3, seed=4)
    info, bundle = dataset_info("synthetic", cfg), load_dataset("synthetic", cfg)
    assert torch.equal(info.y_train, bundle.y_train)
    assert (info.num_test, info.num_classes, info.input_shape) == (21, 3, (3, 8, 8))
    huge = dataset_info("synthetic", SyntheticConfig(num_train=100, image_size=4096))
    assert huge.input_shape == (1, 4096, 4096) and huge.num_train == 100
    with pytest.raises(ConfigError, match="would hold 10,737,418,240 values, more than 67,108,864"):
        dataset_info("synthetic", SyntheticConfig(image_size=4096, channels=1024))


def test_synthetic_is_normalised_per_channel():
    x = load_dataset("synthetic", SyntheticConfig(channels=3)).x_train
    mean, std = x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3))
    torch.testing.assert_close(mean, torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(std, torch.ones(3), atol=1e-4, rtol=0)


def test_synthetic_is_learnable_by_a_tiny_cnn():
    torch.manual_seed(0)
    b = load_dataset("synthetic", SyntheticConfig())
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, b.num_classes),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        for i in range(0, len(b.y_train), 32):
            loss = torch.nn.functional.cross_entropy(
                model(b.x_train[i : i + 32]), b.y_train[i : i + 32]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(b.x_test).argmax(1) == b.y_test).float().mean().item()
    assert accuracy > 0.9


def fake_cifar(path: Path, **override: np.ndarray) -> Path:
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8),
        "y_train": np.arange(10, dtype=np.uint8),
        "x_test": rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
        "y_test": np.arange(4, dtype=np.uint8),
    }
    arrays.update(override)
    np.savez(path, **arrays)
    return path


def test_cifar10_from_npz_is_channels_first(tmp_path):
    path = fake_cifar(tmp_path / "c.npz")
    b = load_dataset("cifar10", CIFAR10Config(npz=str(path)))
    assert b.x_train.shape == (10, 3, 32, 32) and b.y_train.dtype == torch.int64
    raw = np.load(path)["x_train"]
    expected = (raw[3, 5, 7, 2] / 255 - 0.4465) / 0.2616  # image 3, row 5, col 7, blue
    assert b.x_train[3, 2, 5, 7].item() == pytest.approx(expected, abs=1e-5)
    assert b.class_names[0] == "airplane" and b.in_channels == 3


def test_cifar10_npz_found_through_environment(tmp_path, monkeypatch):
    """The variable is read on every load: data cached from one place (the shared copy, or
    an earlier value) never answers for another."""
    monkeypatch.setenv("FEDMECH_CIFAR10_NPZ", str(fake_cifar(tmp_path / "env.npz")))
    assert load_dataset("cifar10", CIFAR10Config()).x_test.shape == (4, 3, 32, 32)
    other = fake_cifar(tmp_path / "other.npz", x_test=np.zeros((6, 32, 32, 3), np.uint8), y_test=np.arange(6) % 10)
    monkeypatch.setenv("FEDMECH_CIFAR10_NPZ", str(other))
    assert load_dataset("cifar10", CIFAR10Config()).x_test.shape == (6, 3, 32, 32)


def test_foreign_npz_gives_clear_errors(tmp_path):
    np.savez(tmp_path / "a.npz", images=np.zeros((2, 32, 32, 3), np.uint8))
    with pytest.raises(BadFileError, match=r"missing array\(s\) \['x_train'"):
        load_dataset("cifar10", CIFAR10Config(npz=str(tmp_path / "a.npz")))
    path = fake_cifar(tmp_path / "b.npz", x_test=np.zeros((4, 3, 32, 32), np.uint8))
    with pytest.raises(BadFileError, match=r"x_test is uint8 \(4, 3, 32, 32\); expected"):
        load_dataset("cifar10", CIFAR10Config(npz=str(path)))


def test_missing_cifar10_npz(tmp_path):
    with pytest.raises(DataNotFoundError, match="data.dataset.npz") as err:
        load_dataset("cifar10", CIFAR10Config(npz=str(tmp_path / "none.npz")))
    assert str(tmp_path / "none.npz") in str(err.value)


@pytest.mark.integration
@pytest.mark.skipif(not DEBIAN_FASHION_MNIST.is_dir(), reason="dataset-fashion-mnist absent")
def test_real_fashion_mnist():
    b = fashion_mnist(FashionMNISTConfig())  # uncached: frees the memory afterwards
    assert b.x_train.shape == (60000, 1, 28, 28) and b.x_test.shape == (10000, 1, 28, 28)
    assert b.num_classes == 10 and torch.bincount(b.y_train).tolist() == [6000] * 10
    assert abs(b.x_train.mean().item()) < 0.01 and abs(b.x_train.std().item() - 1) < 0.01


@pytest.mark.integration
@pytest.mark.skipif(not SHARED_CIFAR.is_file(), reason="shared cifar10.npz absent")
def test_real_cifar10_npz():
    b = cifar10(CIFAR10Config(npz=str(SHARED_CIFAR)))  # uncached: frees ~700 MB afterwards
    assert b.x_train.shape == (50000, 3, 32, 32) and b.x_test.shape == (10000, 3, 32, 32)
    assert torch.bincount(b.y_test).tolist() == [1000] * 10
    assert b.x_train.mean(dim=(0, 2, 3)).abs().max().item() < 0.02


def test_cifar10_from_torchvision_root(tmp_path, monkeypatch):
    """A torchvision root is read through its CIFAR10 class (stubbed: no pickles here)."""
    import torchvision

    class FakeCIFAR10:
        def __init__(self, root, train, download):
            assert root == str(tmp_path) and download is False
            n = 8 if train else 2
            self.data = np.full((n, 32, 32, 3), 255, np.uint8)
            self.targets = [i % 10 for i in range(n)]

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    (tmp_path / "cifar-10-batches-py").mkdir()
    b = load_dataset("cifar10", CIFAR10Config(root=str(tmp_path)))
    assert b.x_train.shape == (8, 3, 32, 32) and b.y_test.tolist() == [0, 1]
    assert b.x_train[0, 0, 0, 0].item() == pytest.approx((1 - 0.4914) / 0.2470)


# --- DataInfo: the shape of the data, read before a run --------------------------------

def test_dataset_info_matches_the_loaded_dataset(tmp_path):
    write_idx_dataset(tmp_path / "fm")
    for name, cfg in [
        ("fashion_mnist", FashionMNISTConfig(root=str(tmp_path / "fm"))),
        ("cifar10", CIFAR10Config(npz=str(fake_cifar(tmp_path / "c.npz")))),
        ("synthetic", SyntheticConfig(num_train=30, num_test=7, num_classes=3, image_size=8, channels=2)),
    ]:
        info, bundle = dataset_info(name, cfg), load_dataset(name, cfg)
        assert torch.equal(info.y_train, bundle.y_train), name
        assert (info.num_train, info.num_test, info.num_classes) == (len(bundle.y_train), len(bundle.y_test),
                                                                      bundle.num_classes), name
        assert info.input_shape == tuple(bundle.x_train.shape[1:]), name
        assert info.class_counts == torch.bincount(bundle.y_train, minlength=bundle.num_classes).tolist(), name
        assert info.audit_per_class == info.audit_size == 0


def test_dataset_info_reads_labels_and_headers_not_images(tmp_path, monkeypatch):
    write_idx_dataset(tmp_path)
    read = data.read_idx
    monkeypatch.setattr(data, "read_idx", lambda path: pytest.fail(f"read {path}") if "images" in path.name
                        else read(path))
    info = dataset_info("fashion_mnist", FashionMNISTConfig(root=str(tmp_path)))
    assert (info.num_train, info.num_test, info.input_shape) == (12, 6, (1, 28, 28))
    assert info.class_counts == [2, 2] + [1] * 8


def test_data_info_audit_size():
    info = DataInfo(torch.arange(20) % 4, 8, 4, (1, 8, 8), audit_per_class=3)
    assert (info.num_train, info.audit_size, info.class_counts) == (20, 12, [5, 5, 5, 5])


@pytest.mark.skipif(not (DEBIAN_FASHION_MNIST.is_dir() and SHARED_CIFAR.is_file()),
                    reason="dataset-fashion-mnist or the shared cifar10.npz absent")
def test_real_data_info():
    fm = dataset_info("fashion_mnist", FashionMNISTConfig())
    assert (fm.num_train, fm.num_test, fm.input_shape, fm.class_counts) == (60000, 10000, (1, 28, 28), [6000] * 10)
    c = dataset_info("cifar10", CIFAR10Config(npz=str(SHARED_CIFAR)))
    assert (c.num_train, c.num_test, c.input_shape, c.class_counts) == (50000, 10000, (3, 32, 32), [5000] * 10)


# --- damaged files: refused from their headers, before anything is read or started --------

def lying_npz(path: Path, name: str, shape: tuple[int, ...], **arrays: np.ndarray) -> Path:
    """A CIFAR-10 npz (``fake_cifar``) whose ``name`` header claims ``shape`` over the bytes
    it holds (numpy would allocate the claim first)."""
    fake_cifar(path, **arrays)
    with zipfile.ZipFile(path) as archive:
        members = {member: archive.read(member) for member in archive.namelist()}
    array = np.load(io.BytesIO(members[f"{name}.npy"]))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": array.dtype.str, "fortran_order": False, "shape": shape})
    members[f"{name}.npy"] = header.getvalue() + array.tobytes()
    with zipfile.ZipFile(path, "w") as archive:
        for member, content in members.items():
            archive.writestr(member, content)
    return path


def cifar_npz(make):
    """A planted CIFAR-10 npz (``make(path)`` writes it): the override that points at it, and its path."""
    def plant(folder: Path) -> tuple[str, Path]:
        path = make(folder / "cifar10.npz")
        return f"data.dataset={{name: cifar10, npz: {path}}}", path
    return plant


def fashion_idx(damage):
    """Planted Fashion-MNIST idx files (``write_idx_dataset``), then ``damage(folder)``."""
    def plant(folder: Path) -> tuple[str, Path]:
        write_idx_dataset(folder)
        damage(folder)
        return f"data.dataset={{name: fashion_mnist, root: {folder}}}", folder
    return plant


def write_gz(path: Path, content: bytes) -> None:
    with gzip.open(path, "wb") as f:
        f.write(content)


TRAIN_IMAGES, TRAIN_LABELS = IDX_FILES[:2]
IMAGES = np.zeros((12, 28, 28), np.uint8)
DAMAGED = [
    # (id, plant, the refusal (``{path}``: the planted file or folder))
    ("npz x_train claims 10^12 images", cifar_npz(lambda p: lying_npz(p, "x_train", (10**12, 32, 32, 3))),
     "{path}: x_train claims shape (1000000000000, 32, 32, 3) uint8 = 3,072,000,000,000,000 bytes but the member "
     "holds 30,720 bytes; the file is damaged or cut short: get a good copy"),
    ("npz y_train claims 10^12 labels", cifar_npz(lambda p: lying_npz(p, "y_train", (10**12,))),
     "{path}: y_train claims shape (1000000000000,) uint8 = 1,000,000,000,000 bytes but the member holds 10 bytes"),
    ("npz labels of another length", cifar_npz(lambda p: fake_cifar(p, y_test=np.arange(3, dtype=np.uint8))),
     "{path}: y_test is uint8 (3,) for 4 images; expected"),
    ("npz float labels", cifar_npz(lambda p: fake_cifar(p, y_train=np.arange(10, dtype=np.float32))),
     "{path}: y_train is float32 (10,) for 10 images; expected"),
    ("not an npz", cifar_npz(lambda p: (p.write_text("x,y\n1,2\n"), p)[1]),
     "{path} is not an npz of .npy arrays (BadZipFile: File is not a zip file)"),
    ("idx images cut short", fashion_idx(lambda d: write_idx(d / TRAIN_IMAGES, IMAGES[:5], shape=(12, 28, 28))),
     "{path}/" + TRAIN_IMAGES + " claims shape (12, 28, 28) uint8 = 9,408 bytes but the file holds 3,920 bytes"),
    ("idx header cut short", fashion_idx(lambda d: write_gz(d / TRAIN_IMAGES, bytes([0, 0, 8, 3, 0, 0, 0, 12]))),
     "{path}/" + TRAIN_IMAGES + " ends inside its idx header (3 dimensions claimed)"),
    ("idx wrong magic", fashion_idx(lambda d: write_idx(d / TRAIN_IMAGES, IMAGES, code=0x01)),
     "{path}/" + TRAIN_IMAGES + " is not an idx file (magic bytes 00000103)"),
    ("idx wrong dimension count", fashion_idx(lambda d: write_idx(d / TRAIN_IMAGES, IMAGES.reshape(12, 784))),
     "{path}/" + TRAIN_IMAGES + " holds uint8 (12, 784); expected uint8 images [N,28,28]"),
    ("idx labels of another length", fashion_idx(lambda d: write_idx(d / TRAIN_LABELS, np.zeros(11, np.uint8))),
     "{path}/" + TRAIN_LABELS + " holds uint8 (11,) for 12 images; expected integer labels [12]"),
    ("idx float labels", fashion_idx(lambda d: write_idx(d / TRAIN_LABELS, np.zeros(12, ">f4"), code=0x0D)),
     "{path}/" + TRAIN_LABELS + " holds >f4 (12,) for 12 images; expected integer labels [12]"),
]


@pytest.mark.parametrize(("plant", "refusal"), [case[1:] for case in DAMAGED], ids=[case[0] for case in DAMAGED])
def test_a_damaged_data_file_is_refused_in_one_line_by_validate_and_run(plant, refusal, tmp_path, monkeypatch, capsys):
    """``validate`` and ``run`` check every array's header before Flower starts: exit 2
    and one line naming the file, the array and what it claims."""
    import fedmech_flwr.tools.cli as cli

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(cli, "launch", lambda *args, **kwargs: pytest.fail("fedmech run started Flower"))
    (files := tmp_path / "files").mkdir()
    override, path = plant(files)
    for command in (["validate"], ["run", "--out", str(tmp_path / "runs")]):
        assert main([*command, "experiments/smoke.yaml", "--set", override]) == EXIT_BAD_INPUT, command
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("error: dataset ") and refusal.format(path=path) in line, (command, line)
        assert line.endswith(" in experiments/smoke.yaml: data.dataset"), line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name, plant", [
    ("cifar10", lambda d: CIFAR10Config(npz=str(lying_npz(d / "c.npz", "x_train", (20_000, 32, 32, 3))))),
    ("fashion_mnist", lambda d: (write_idx_dataset(d), write_idx(d / TRAIN_IMAGES, IMAGES, shape=(80_000, 28, 28)),
                                 FashionMNISTConfig(root=str(d)))[-1]),
])
def test_a_lying_header_is_refused_before_anything_is_allocated(name, plant, tmp_path):
    """A claim of about 60 MB, which numpy would allocate before finding the bytes missing:
    the loader and ``dataset_info`` refuse it while the traced memory stays under 2 MiB."""
    cfg = plant(tmp_path)
    for read in (load_dataset, dataset_info):
        tracemalloc.start()
        try:
            with pytest.raises(BadFileError, match="claims shape"):
                read(name, cfg)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 * 2**20, (read.__name__, peak)
