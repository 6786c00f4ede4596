"""Datasets as whole, normalised tensors in memory, looked up by name.

Each registered factory decodes its files once (idx ``.gz``, ``.npz`` or torchvision's
arrays) and normalises the full arrays in one go: there are no per-sample PIL transforms.
Nothing is ever downloaded; a missing dataset raises DataNotFoundError that lists where
we looked and how to get the files. Every array's header (shape, dtype) is checked
against the bytes its file holds and the layout the dataset expects before any array is
read (``StoredArray``), so a damaged file is refused in one line, not in allocation.
``dataset_info`` gives a dataset's labels and shapes, its files checked, without decoding
its images, for the checks made before a run starts.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmech_flwr.foundation.errors import BadFileError, ConfigError, DataNotFoundError
from fedmech_flwr.foundation.registry import Registry

log = logging.getLogger(__name__)


def repo_root() -> Path:
    """The checkout a run was started from; shared data lives in ``../shared`` beside it.

    ``$FEDMECH_PROJECT_DIR`` when set (``fedmech run`` sets it: Flower runs the app from an
    unpacked copy elsewhere), else the folder holding ``fedmech_flwr/``.
    """
    return Path(os.environ.get("FEDMECH_PROJECT_DIR") or Path(__file__).resolve().parents[2])


DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the idx files."""

IDX_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
FASHION_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)
CIFAR10_KEYS = ("x_train", "y_train", "x_test", "y_test")

# idx type code -> numpy dtype (big-endian multi-byte values)
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


@dataclass(frozen=True)
class Pixels:
    """How a dataset's stored pixels become its tensors, so that data brought by an edge
    node (``node_data``) is normalised exactly as the dataset's own shards are.

    ``uint8``: values 0..255, divided by 255, then normalised per channel with ``mean`` and
    ``std`` (the image datasets). ``float32``: the values as the dataset's tensors hold them
    (``synthetic``, which has no pixel form).
    """

    dtype: str = "float32"
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def to_tensor(self, x: np.ndarray) -> torch.Tensor:
        """Images [N, H, W] or [N, H, W, C] of ``dtype`` -> float32 [N, C, H, W], in the
        dataset's memory layout (a different one could pick other conv kernels, and so
        other rounding)."""
        if x.ndim == 4 and x.shape[3] == 1:
            x = x[..., 0]
        if self.dtype == "uint8":
            return _normalise(x, self.mean, self.std)
        t = torch.from_numpy(x)
        t = t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2)
        return t.clone(memory_format=torch.contiguous_format)  # torch's own (aligned) memory, as the dataset's

    def from_tensor(self, x: torch.Tensor) -> np.ndarray:
        """The stored pixels [N, H, W, C] of tensors ``x`` (inverse of ``to_tensor``);
        a ValueError if they do not map back bitwise (``x`` was not made by ``to_tensor``)."""
        t = x.detach().cpu()
        if self.dtype == "uint8":
            shape = (1, -1, 1, 1)
            t = (t * torch.tensor(self.std).view(shape) + torch.tensor(self.mean).view(shape)) * 255.0
            t = t.round().clamp(0, 255).to(torch.uint8)
        pixels = t.permute(0, 2, 3, 1).contiguous().numpy()
        if not torch.equal(self.to_tensor(pixels), x.detach().cpu()):
            raise ValueError("these tensors are not the dataset's normalised pixels: they do not map back bitwise")
        return pixels


@dataclass(frozen=True, eq=False)
class DatasetBundle:
    """A dataset split into train and test tensors, already normalised."""

    name: str
    x_train: torch.Tensor = field(repr=False)
    """float32 [N, C, H, W], normalised with the dataset's per-channel train mean/std."""
    y_train: torch.Tensor = field(repr=False)
    """int64 [N] class ids."""
    x_test: torch.Tensor = field(repr=False)
    y_test: torch.Tensor = field(repr=False)
    num_classes: int
    class_names: tuple[str, ...]
    pixels: Pixels = Pixels()
    """How stored pixels became ``x_train`` / ``x_test`` (and become a node's own data)."""

    @property
    def in_channels(self) -> int:
        return self.x_train.shape[1]

    @property
    def image_size(self) -> int:
        """Height (= width) of the images."""
        return self.x_train.shape[2]


@dataclass(frozen=True, eq=False)
class DataInfo:
    """A dataset's shape without its images: what checks made before a run may know.

    Read from the label files and headers where the dataset allows it (well under a
    second), so ``fedmech validate`` and every sweep cell can check against it.
    """

    y_train: torch.Tensor = field(repr=False)
    """int64 [N] training labels."""
    num_test: int
    num_classes: int
    input_shape: tuple[int, int, int]
    """(channels, height, width) of one image."""
    audit_per_class: int = 0
    """The experiment's server-held audit set, per class (0: none); set by the check."""

    @classmethod
    def of(cls, bundle: DatasetBundle) -> DataInfo:
        return cls(bundle.y_train, len(bundle.y_test), bundle.num_classes, tuple(bundle.x_train.shape[1:]))

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    @property
    def class_counts(self) -> list[int]:
        """Training samples per class."""
        return torch.bincount(self.y_train, minlength=self.num_classes).tolist()

    @property
    def audit_size(self) -> int:
        return self.audit_per_class * self.num_classes

    def require_audit(self, needs: str, where: str, suggested: int) -> None:
        """A ConfigError at ``where`` when the experiment holds no audit set; ``needs`` says
        who uses it for what (``"misalignment trains probes and heads on"``)."""
        if self.audit_per_class == 0:
            raise ConfigError(f"{needs} the server's audit set, but the experiment has none "
                              f"(data.audit_per_class is 0); set data.audit_per_class (e.g. {suggested})", where)


DatasetFactory = Callable[[Any], DatasetBundle]
DATASETS: Registry[DatasetFactory] = Registry("dataset")

DESCRIBERS: dict[str, Callable[[Any], DataInfo]] = {}
"""Datasets that can say their ``DataInfo`` without decoding their images, by name; any
other dataset is loaded (and cached) to describe it."""

_CACHE: dict[tuple[str, ...], DatasetBundle] = {}
_INFO: dict[tuple[str, ...], DataInfo] = {}
_LOCATING_ENV = ("FEDMECH_CIFAR10_NPZ", "FEDMECH_PROJECT_DIR")
"""Environment variables that change where a dataset is found: part of the cache key, so
a changed variable is never answered from data read from the old place."""


def _cache_key(name: str, cfg: Any) -> tuple[str, ...]:
    return (name, repr(cfg), *(os.environ.get(var, "") for var in _LOCATING_ENV))


def load_dataset(name: str, cfg: Any = None) -> DatasetBundle:
    """The dataset ``name`` built from ``cfg`` (its config dataclass; None: defaults).

    Cached per process by (name, repr(cfg)) and the variables that locate data
    (``_LOCATING_ENV``), so repeated calls decode the files once.
    """
    entry = DATASETS.get(name)
    cfg = entry.config_cls() if cfg is None else cfg
    key = _cache_key(name, cfg)
    if key not in _CACHE:
        _CACHE[key] = entry.factory(cfg)
    return _CACHE[key]


def dataset_info(name: str, cfg: Any = None) -> DataInfo:
    """The shape of dataset ``name`` built from ``cfg``, cached per process like
    ``load_dataset`` (a sweep's cells share one read)."""
    cfg = DATASETS.get(name).config_cls() if cfg is None else cfg
    key = _cache_key(name, cfg)
    if key not in _INFO:
        describe = DESCRIBERS.get(name, lambda c: DataInfo.of(load_dataset(name, c)))
        _INFO[key] = describe(cfg)
    return _INFO[key]


def data_home() -> Path:
    """torchvision-style root for downloaded data, ``~/.cache/fedmech/data``."""
    return Path("~/.cache/fedmech/data").expanduser()


@dataclass(frozen=True)
class StoredArray:
    """An array as its file's header claims it, read without reading the array. Loaders
    check it (``fits``, then its layout) before allocating anything, so a damaged or
    foreign header is refused in one line instead of failing in allocation."""

    what: str
    """The file, and the array in it for an .npz (``/data/cifar10.npz: x_train``)."""
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def fits(self, held: int, holder: str) -> None:
        """A BadFileError unless the claimed shape and dtype make exactly the ``held``
        bytes that ``holder`` (``the member``, ``the file``) holds."""
        if self.nbytes != held:
            raise BadFileError(f"{self.what} claims shape {self.shape} {self.dtype} = {self.nbytes:,} bytes but "
                               f"{holder} holds {held:,} bytes; the file is damaged or cut short: get a good copy")


NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
"""The .npy header versions ``numpy.savez`` writes, and their public readers."""


def npz_arrays(path: Path) -> dict[str, StoredArray]:
    """The arrays of the .npz at ``path`` by name, as their .npy headers claim them, each
    checked against the bytes its zip member holds (``StoredArray.fits``); none is read."""
    arrays = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename.removesuffix(".npy")
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    if version not in NPY_HEADER_READERS:
                        raise BadFileError(f"{path}: {name} is in .npy format {version}; write it with numpy.savez")
                    shape, _, dtype = NPY_HEADER_READERS[version](member)
                    held = info.file_size - member.tell()
                arrays[name] = StoredArray(f"{path}: {name}", shape, dtype)
                arrays[name].fits(held, "the member")
    except BadFileError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise BadFileError(f"{path} is not an npz of .npy arrays ({type(err).__name__}: {err}); "
                           "write it with numpy.savez") from err
    return arrays


def idx_array(path: Path) -> StoredArray:
    """The array a gzipped idx file (the MNIST format) claims, checked against the bytes
    the file holds by gzip's size field (its last 4 bytes), without decompressing it.

    Header: two zero bytes, a type code, the number of dims, then each dim as a
    big-endian int32; the data follows. gzip's size field is the size modulo 2^32: idx
    datasets (tens of MB) stay far below it, so a claim of 4 GiB or more is refused.
    """
    try:
        with gzip.open(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in _IDX_DTYPES:
                raise BadFileError(f"{path} is not an idx file (magic bytes {head.hex()})")
            dims = f.read(4 * head[3])
        with open(path, "rb") as raw:
            raw.seek(-4, os.SEEK_END)
            held = int.from_bytes(raw.read(4), "little") - len(head) - len(dims)
    except (OSError, EOFError, zlib.error) as err:
        raise BadFileError(f"{path} is not a gzipped idx file ({type(err).__name__}: {err})") from err
    if len(dims) < 4 * head[3]:
        raise BadFileError(f"{path} ends inside its idx header ({head[3]} dimensions claimed)")
    stored = StoredArray(str(path), tuple(int(d) for d in np.frombuffer(dims, ">i4")), np.dtype(_IDX_DTYPES[head[2]]))
    stored.fits(held, "the file")
    return stored


def read_idx(path: Path) -> np.ndarray:
    """A gzipped idx file's array, its header checked (``idx_array``) before it is read."""
    stored = idx_array(path)
    with gzip.open(path, "rb") as f:
        raw = bytearray(f.read())  # writable, so torch.from_numpy needs no copy
    start = 4 + 4 * len(stored.shape)
    stored.fits(len(raw) - start, "the file")  # a gzip of several members gives only the last one's size field
    return np.frombuffer(raw, stored.dtype, offset=start).reshape(stored.shape)


def _normalise(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 images [N, H, W, C] or [N, H, W] -> float32 [N, C, H, W], normalised per channel."""
    t = torch.from_numpy(x)
    t = t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2)
    t = t.to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)
    shape = (1, -1, 1, 1)
    return t.sub_(torch.tensor(mean).view(shape)).div_(torch.tensor(std).view(shape))


def _bundle(
    name: str,
    arrays: Sequence[np.ndarray],
    class_names: Sequence[str],
    mean: Sequence[float],
    std: Sequence[float],
) -> DatasetBundle:
    """Normalise uint8 ``(x_train, y_train, x_test, y_test)`` into a bundle."""
    x_train, y_train, x_test, y_test = arrays
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if len(x) != len(y):
            raise ValueError(f"{name}: {len(x)} {split} images but {len(y)} labels")
        if len(y) and (y.min() < 0 or y.max() >= len(class_names)):
            raise ValueError(f"{name}: {split} labels outside 0..{len(class_names) - 1}")
    bundle = DatasetBundle(
        name=name,
        x_train=_normalise(x_train, mean, std),
        y_train=torch.from_numpy(y_train.astype(np.int64)),
        x_test=_normalise(x_test, mean, std),
        y_test=torch.from_numpy(y_test.astype(np.int64)),
        num_classes=len(class_names),
        class_names=tuple(class_names),
        pixels=Pixels("uint8", tuple(mean), tuple(std)),
    )
    n_train, n_test, shape = len(bundle.y_train), len(bundle.y_test), bundle.x_train.shape[1:]
    log.info("%s: %d train / %d test images of shape %s", name, n_train, n_test, tuple(shape))
    return bundle


def _missing(what: str, looked: Sequence[object], how: str) -> DataNotFoundError:
    places = "\n".join(f"  - {p}" for p in looked)
    return DataNotFoundError(f"{what} not found. Looked in:\n{places}\nTo get it: {how}")


def _idx_dir(name: str, dirs: Sequence[Path], how: str) -> Path:
    """The first directory in ``dirs`` holding all four idx files (else DataNotFoundError)."""
    dirs = [d.expanduser().resolve() for d in dirs]
    for d in dirs:
        if all((d / f).is_file() for f in IDX_FILES):
            return d
    looked = [
        f"{d} (missing {', '.join(f for f in IDX_FILES if not (d / f).is_file())})"
        if d.is_dir() else f"{d} (no such directory)"
        for d in dirs
    ]
    raise _missing(name, looked, how)


IDX_IMAGE_SIZE = (28, 28)
"""Height and width of the images of the idx datasets here (Fashion-MNIST, MNIST)."""


def _idx_arrays(d: Path) -> list[StoredArray]:
    """The four idx files' arrays (``IDX_FILES``) as their headers claim them, checked
    before any is read: their sizes, uint8 images [N, 28, 28], integer labels [N]."""
    arrays = [idx_array(d / f) for f in IDX_FILES]
    for images, labels in (arrays[:2], arrays[2:]):
        if images.dtype != np.uint8 or images.shape[1:] != IDX_IMAGE_SIZE:
            raise BadFileError(f"{images.what} holds {images.dtype} {images.shape}; expected uint8 images "
                               f"[N,{IDX_IMAGE_SIZE[0]},{IDX_IMAGE_SIZE[1]}]")
        if not np.issubdtype(labels.dtype, np.integer) or labels.shape != images.shape[:1]:
            raise BadFileError(f"{labels.what} holds {labels.dtype} {labels.shape} for {images.shape[0]} images; "
                               f"expected integer labels [{images.shape[0]}]")
    return arrays


@dataclass(frozen=True)
class IdxDataset:
    """An idx dataset of 28x28 grey images (Fashion-MNIST, MNIST): where its four files are
    looked for, how to get them, its classes and pixel statistics. ``load`` and ``info``
    read every one of them the same way."""

    name: str
    torchvision: str
    """The torchvision dataset class, also its folder under a root (``<root>/<torchvision>/raw``)."""
    class_names: tuple[str, ...]
    mean: float
    std: float
    system: tuple[Path, str] | None = None
    """A system package's folder, looked in first when no root is set, and how to install it."""

    def folder(self, root: str | None) -> Path:
        """The first folder holding the four idx files: ``root`` or its torchvision folder,
        else (no root) the system package's, then ``~/.cache/fedmech/data``'s."""
        if root is None:
            dirs = [*(self.system[:1] if self.system else ()), data_home() / self.torchvision / "raw"]
        else:
            dirs = [Path(root), Path(root) / self.torchvision / "raw"]
        how = (
            f"{self.system[1] + '; or, ' if self.system else ''}on a machine with network, "
            f"`python -c \"import torchvision; torchvision.datasets.{self.torchvision}('~/.cache/fedmech/data', "
            "download=True)\"`; or point `data.dataset.root: /path` at a directory holding the four idx .gz "
            "files. Nothing is downloaded automatically."
        )
        return _idx_dir(self.name, dirs, how)

    def load(self, root: str | None) -> DatasetBundle:
        """The dataset, normalised, every file's header checked before any is read."""
        d = self.folder(root)
        _idx_arrays(d)
        log.info("%s: reading idx files from %s", self.name, d)
        arrays = [read_idx(d / f) for f in IDX_FILES]
        return _bundle(self.name, arrays, self.class_names, (self.mean,), (self.std,))

    def info(self, root: str | None) -> DataInfo:
        """Labels and image shape, every file's header checked, without reading the images."""
        d = self.folder(root)
        _, _, test_images, _ = _idx_arrays(d)
        y_train = torch.from_numpy(read_idx(d / IDX_FILES[1]).astype(np.int64))
        return DataInfo(y_train, test_images.shape[0], len(self.class_names), (1, *IDX_IMAGE_SIZE))


FASHION_MNIST = IdxDataset("fashion_mnist", "FashionMNIST", FASHION_CLASSES, 0.2860, 0.3530,
                           (DEBIAN_FASHION_MNIST, "on Debian/Ubuntu `apt-get install dataset-fashion-mnist`"))
MNIST = IdxDataset("mnist", "MNIST", tuple(str(i) for i in range(10)), 0.1307, 0.3081)


@dataclass
class FashionMNISTConfig:
    root: str | None = None
    """Directory with the idx .gz files, or a torchvision root (<root>/FashionMNIST/raw).
    None: Debian's /usr/share/datasets/fashion-mnist, then ~/.cache/fedmech/data."""


@DATASETS.register("fashion_mnist", FashionMNISTConfig)
def fashion_mnist(cfg: FashionMNISTConfig) -> DatasetBundle:
    """Fashion-MNIST, 60000/10000 grey 28x28 images, 10 classes."""
    return FASHION_MNIST.load(cfg.root)


DESCRIBERS["fashion_mnist"] = lambda cfg: FASHION_MNIST.info(cfg.root)


@dataclass
class MNISTConfig:
    root: str | None = None
    """Directory with the idx .gz files, or a torchvision root (<root>/MNIST/raw).
    None: ~/.cache/fedmech/data/MNIST/raw."""


@DATASETS.register("mnist", MNISTConfig)
def mnist(cfg: MNISTConfig) -> DatasetBundle:
    """MNIST digits, 60000/10000 grey 28x28 images, 10 classes."""
    return MNIST.load(cfg.root)


DESCRIBERS["mnist"] = lambda cfg: MNIST.info(cfg.root)


@dataclass
class CIFAR10Config:
    root: str | None = None
    """torchvision root holding cifar-10-batches-py (used when ``npz`` is not set)."""
    npz: str | None = None
    """An .npz with uint8 x_train/x_test [N, 32, 32, 3] and y_train/y_test [N]. With
    neither set: $FEDMECH_CIFAR10_NPZ, ../shared/data/cifar10/cifar10.npz beside the
    repository, then ~/.cache/fedmech/data/cifar-10-batches-py."""


_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)
_CIFAR_EXPECTED = "uint8 x_train/x_test [N,32,32,3] and integer y_train/y_test [N]"


def _cifar10_source(cfg: CIFAR10Config) -> Path:
    """The first CIFAR-10 .npz or cifar-10-batches-py folder that ``cfg`` points at and
    exists (else DataNotFoundError)."""
    if cfg.npz is not None:
        candidates = [Path(cfg.npz)]
    elif cfg.root is not None:
        candidates = [Path(cfg.root) / "cifar-10-batches-py"]
    else:
        env = os.environ.get("FEDMECH_CIFAR10_NPZ")
        candidates = [Path(env)] if env else []
        candidates += [
            repo_root().parent / "shared" / "data" / "cifar10" / "cifar10.npz",
            data_home() / "cifar-10-batches-py",
        ]
    candidates = [p.expanduser().resolve() for p in candidates]
    for path in candidates:
        if (path.suffix == ".npz" and path.is_file()) or (path.name == "cifar-10-batches-py" and path.is_dir()):
            return path
    how = (
        "set `data.dataset.npz: /path/cifar10.npz` (or $FEDMECH_CIFAR10_NPZ) to an .npz holding "
        "uint8 x_train/x_test [N,32,32,3] and integer y_train/y_test [N]; or, on a machine "
        "with network, `python -c \"import torchvision; torchvision.datasets.CIFAR10("
        "'~/.cache/fedmech/data', download=True)\"`. Nothing is downloaded automatically."
    )
    raise _missing("cifar10", candidates, how)


@DATASETS.register("cifar10", CIFAR10Config)
def cifar10(cfg: CIFAR10Config) -> DatasetBundle:
    """CIFAR-10, 50000/10000 RGB 32x32 images, 10 classes, from an .npz or torchvision."""
    path = _cifar10_source(cfg)
    if path.suffix == ".npz":
        log.info("cifar10: loading %s", path)
        arrays, names = _read_cifar_npz(path)
        return _bundle("cifar10", arrays, names, _CIFAR_MEAN, _CIFAR_STD)
    return _bundle("cifar10", _read_cifar_torchvision(path.parent), CIFAR10_CLASSES, _CIFAR_MEAN, _CIFAR_STD)


def _cifar10_info(cfg: CIFAR10Config) -> DataInfo:
    """From an .npz, the labels alone, every array's header checked; the torchvision
    pickles hold labels and images together, so those are loaded."""
    path = _cifar10_source(cfg)
    if path.suffix != ".npz":
        return DataInfo.of(load_dataset("cifar10", cfg))
    stored = _cifar_npz_arrays(path)
    with np.load(path, allow_pickle=False) as z:
        y_train = z["y_train"]
    return DataInfo(torch.from_numpy(y_train.astype(np.int64)), stored["y_test"].shape[0], len(CIFAR10_CLASSES),
                    (3, 32, 32))


DESCRIBERS["cifar10"] = _cifar10_info


def _cifar_npz_arrays(path: Path) -> dict[str, StoredArray]:
    """The arrays of a CIFAR-10 .npz as their headers claim them, checked before any is
    read: their sizes (``npz_arrays``), then the four arrays' names and layout."""
    stored = npz_arrays(path)
    missing = [k for k in CIFAR10_KEYS if k not in stored]
    if missing:
        raise BadFileError(f"{path} is not a CIFAR-10 npz: missing array(s) {missing} (it has {sorted(stored)}); "
                           f"expected {_CIFAR_EXPECTED}")
    for split in ("train", "test"):
        x, y = stored[f"x_{split}"], stored[f"y_{split}"]
        if x.dtype != np.uint8 or x.shape[1:] != (32, 32, 3):
            raise BadFileError(f"{x.what} is {x.dtype} {x.shape}; expected {_CIFAR_EXPECTED}")
        if not np.issubdtype(y.dtype, np.integer) or y.shape != x.shape[:1]:
            raise BadFileError(f"{y.what} is {y.dtype} {y.shape} for {x.shape[0]} images; expected {_CIFAR_EXPECTED}")
    return stored


def _read_cifar_npz(path: Path) -> tuple[list[np.ndarray], tuple[str, ...]]:
    """The four CIFAR-10 arrays from ``path``, checked from their headers first; class
    names if it stores them."""
    stored = _cifar_npz_arrays(path)
    with np.load(path, allow_pickle=False) as z:
        arrays = [z[k] for k in CIFAR10_KEYS]
        names = tuple(str(n) for n in z["label_names"]) if "label_names" in stored else ()
    return arrays, names if len(names) == 10 else CIFAR10_CLASSES


def _read_cifar_torchvision(root: Path) -> list[np.ndarray]:
    """The four CIFAR-10 arrays via torchvision's reader of the official pickles."""
    import torchvision  # slow import, only needed here

    log.info("cifar10: reading torchvision files under %s", root)
    arrays = []
    for train in (True, False):
        try:
            ds = torchvision.datasets.CIFAR10(str(root), train=train, download=False)
        except RuntimeError as err:  # torchvision's md5 check failed
            raise DataNotFoundError(f"{root / 'cifar-10-batches-py'}: {err}") from err
        arrays += [ds.data, np.asarray(ds.targets)]
    return arrays


@dataclass
class SyntheticConfig:
    num_train: int = field(default=600, metadata={"ge": 1, "le": 10_000_000})
    num_test: int = field(default=200, metadata={"ge": 1, "le": 10_000_000})
    num_classes: int = field(default=10, metadata={"ge": 2, "le": 100_000})
    image_size: int = field(default=12, metadata={"ge": 4, "le": 4096})
    channels: int = field(default=1, metadata={"ge": 1, "le": 1024})
    seed: int = 0
    """Same seed, same prototypes and samples."""


@DATASETS.register("synthetic", SyntheticConfig)
def synthetic(cfg: SyntheticConfig) -> DatasetBundle:
    """A tiny learnable set for tests: each class is a fixed smooth random prototype
    image, each sample its prototype plus pixel noise; labels are balanced.

    Prototypes are drawn at a quarter of the resolution and upsampled, so nearby pixels
    agree and a small CNN with pooling picks them up within a few epochs.
    """
    rng = np.random.default_rng(cfg.seed)
    low = max(2, cfg.image_size // 4)
    coarse = rng.normal(size=(cfg.num_classes, cfg.channels, low, low)).astype(np.float32)
    protos = torch.nn.functional.interpolate(
        torch.from_numpy(coarse), size=cfg.image_size, mode="bilinear", align_corners=False
    )

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.from_numpy(rng.permutation(np.arange(n) % cfg.num_classes))
        noise = rng.normal(scale=1.0, size=(n, *protos.shape[1:])).astype(np.float32)
        return protos[y] + torch.from_numpy(noise), y

    x_train, y_train = sample(cfg.num_train)
    x_test, y_test = sample(cfg.num_test)
    # NumPy's single-threaded float64 sums: torch's parallel float32 reductions differ with
    # the thread count, and a client (1 thread) must see the samples the server does.
    plain = x_train.numpy().astype(np.float64)
    mean = torch.from_numpy(plain.mean(axis=(0, 2, 3), keepdims=True).astype(np.float32))
    std = torch.from_numpy(plain.std(axis=(0, 2, 3), ddof=1, keepdims=True).astype(np.float32))
    return DatasetBundle(
        name="synthetic",
        x_train=(x_train - mean) / std,
        y_train=y_train,
        x_test=(x_test - mean) / std,
        y_test=y_test,
        num_classes=cfg.num_classes,
        class_names=tuple(f"class {i}" for i in range(cfg.num_classes)),
    )


SYNTHETIC_MAX_PROTOTYPE_VALUES = 2**26
"""The most values the synthetic set's prototypes may hold (512 MiB as the float64 they
are drawn in): describing the set steps its random stream past them, a second or two."""


def _synthetic_info(cfg: SyntheticConfig) -> DataInfo:
    """The synthetic set's labels and shapes without making an image: its seeded stream
    is stepped past the prototypes' draws in chunks (the labels are drawn after them), so
    the training labels are those ``synthetic`` makes, in constant memory."""
    low = max(2, cfg.image_size // 4)
    left = cfg.num_classes * cfg.channels * low * low
    if left > SYNTHETIC_MAX_PROTOTYPE_VALUES:
        raise ConfigError(
            f"the synthetic set's prototypes ({cfg.num_classes} classes x {cfg.channels} channels x {low}x{low} "
            f"pixels) would hold {left:,} values, more than {SYNTHETIC_MAX_PROTOTYPE_VALUES:,}; use fewer classes "
            "or channels, or smaller images", "data.dataset")
    rng = np.random.default_rng(cfg.seed)
    while left:
        chunk = min(left, 2**20)
        rng.standard_normal(chunk)  # the same draws, one after the other, as ``rng.normal`` of them all
        left -= chunk
    y_train = torch.from_numpy(rng.permutation(np.arange(cfg.num_train) % cfg.num_classes))
    return DataInfo(y_train, cfg.num_test, cfg.num_classes, (cfg.channels, cfg.image_size, cfg.image_size))


DESCRIBERS["synthetic"] = _synthetic_info
