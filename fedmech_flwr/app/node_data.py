"""Data that an edge node brings itself (``--node-config "data-path=..."``), checked
against the experiment before the first round.

A node's data is an ``.npz`` (``x``, ``y``, optionally ``x_val`` / ``y_val``) or an image
folder tree (``CLASS_NAME/*.png|jpg``). The server sends what the data must match
(``NodeDataSpec``: image shape, classes, pixel format); the node refuses anything else
with a ``NodeDataError`` that names the file and says what to do, so no node trains on
garbage. Pixels are normalised by the dataset's own ``Pixels``: a node holding exactly a
shard's pixels gets bitwise the tensors that the simulation gives that shard.
"""

from __future__ import annotations

import json
import re
import zipfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fedmech_flwr.datasets.data import DatasetBundle, Pixels, npz_arrays
from fedmech_flwr.foundation.errors import BadFileError
from fedmech_flwr.foundation.registry import did_you_mean
from fedmech_flwr.spec.config import ExperimentConfig
from fedmech_flwr.spec.experiment import client_partitions, load_data
from fedmech_flwr.spec.experiment import memory_available_gib

MIN_SAMPLES = 10
"""Fewest training samples a node may bring: fewer make an update that is mostly noise,
and a label histogram that nearly identifies single samples."""
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_MODES = {"L": 1, "RGB": 3}
"""PIL image modes a node's images may have, and their channel counts."""


class NodeDataError(ValueError):
    """A node's own data does not fit the experiment; the message names the file, what
    was expected and what was found."""


@dataclass(frozen=True)
class NodeDataSpec:
    """What a node's data must match: sent by the server, which holds the dataset."""

    dataset: str
    class_names: tuple[str, ...]
    input_shape: tuple[int, int, int]
    """(channels, height, width) of one image."""
    pixels: Pixels
    min_samples: int = MIN_SAMPLES

    @classmethod
    def of(cls, bundle: DatasetBundle) -> NodeDataSpec:
        return cls(bundle.name, bundle.class_names, tuple(bundle.x_train.shape[1:]), bundle.pixels)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    @property
    def image_size(self) -> int:
        return self.input_shape[1]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NodeDataSpec:
        d = json.loads(text)
        pixels = Pixels(d["pixels"]["dtype"], tuple(d["pixels"]["mean"]), tuple(d["pixels"]["std"]))
        return cls(d["dataset"], tuple(d["class_names"]), tuple(d["input_shape"]), pixels, d["min_samples"])

    def expected(self) -> str:
        c, h, w = self.input_shape
        layout = f"[N,{h},{w}]" if c == 1 else f"[N,{h},{w},{c}]"
        what = "pixels 0..255" if self.pixels.dtype == "uint8" else "values as the dataset's tensors hold them"
        return (f"x: {self.pixels.dtype} {layout} ({what}), y: integer labels [N] in 0..{self.num_classes - 1} "
                f"(dataset '{self.dataset}')")


@dataclass(frozen=True, eq=False)
class NodeData:
    """A node's own data as the dataset's tensors (float32 [N, C, H, W], int64 [N])."""

    x: torch.Tensor
    y: torch.Tensor
    x_val: torch.Tensor | None
    y_val: torch.Tensor | None
    num_classes: int

    @property
    def label_histogram(self) -> list[int]:
        """Training samples per class: with the count, all that the server learns of the data."""
        return torch.bincount(self.y, minlength=self.num_classes).tolist()


def load_node_data(path: str | Path, spec: NodeDataSpec) -> NodeData:
    """Read and check the data at ``path`` (an .npz or an image folder tree) against ``spec``."""
    path = Path(path).expanduser()
    if path.is_dir():
        x, y = _read_image_folder(path, spec)
        return _node_data(path, spec, x, y, None, None)
    if not path.is_file():
        raise NodeDataError(f"data-path {path} does not exist; point data-path at an .npz file or a folder of "
                            "class folders")
    if path.stat().st_size == 0:
        raise NodeDataError(f"{path} is empty (0 bytes); expected an .npz with {spec.expected()}")
    arrays = _read_npz(path, spec)
    return _node_data(path, spec, *(arrays.get(k) for k in ("x", "y", "x_val", "y_val")))


def _check_npz_headers(path: Path, spec: NodeDataSpec) -> None:
    """The arrays' headers (shape, dtype) against the bytes the file holds (``npz_arrays``),
    ``spec`` and this host's free memory, before anything is loaded: a header that claims
    a huge shape is refused, naming the file, instead of failing in allocation."""
    try:
        stored = npz_arrays(path)
    except BadFileError as err:
        raise NodeDataError(str(err)) from None
    for x_key, y_key in (("x", "y"), ("x_val", "y_val")):
        if x_key in stored and y_key in stored:
            x, y = stored[x_key], stored[y_key]
            _check_layout(path, spec, x_key, x.shape, x.dtype, y_key, y.shape, y.dtype)
    claimed = sum(array.nbytes for array in stored.values())
    free_gib = memory_available_gib()
    if claimed > free_gib * 2**30:
        raise NodeDataError(f"{path} holds {claimed / 2**30:.1f} GiB of arrays and this node has {free_gib:.1f} GiB "
                            "free; give it fewer samples")


def _read_npz(path: Path, spec: NodeDataSpec) -> dict[str, np.ndarray]:
    try:
        if zipfile.is_zipfile(path):
            _check_npz_headers(path, spec)
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded as z:
                arrays = {k: z[k] for k in z.files}
    except NodeDataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, zlib.error) as err:
        raise NodeDataError(f"{path} is not an npz file ({type(err).__name__}: {err}); expected an .npz "
                            f"(numpy.savez) with {spec.expected()}") from err
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise NodeDataError(f"{path} is a single .npy array, not an npz; expected an .npz (numpy.savez) with "
                            f"{spec.expected()}")
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise NodeDataError(f"{path} has no array(s) {missing} (it has {sorted(arrays)}); expected {spec.expected()}")
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise NodeDataError(f"{path} has only one of x_val and y_val; give both (a validation split) or neither")
    return arrays


def _node_data(path: Path, spec: NodeDataSpec, x: np.ndarray, y: np.ndarray,
               x_val: np.ndarray | None, y_val: np.ndarray | None) -> NodeData:
    _check(path, spec, "x", x, "y", y)
    if len(y) < spec.min_samples:
        raise NodeDataError(f"{path} holds {len(y)} training sample(s); a node needs at least {spec.min_samples}")
    val = (None, None)
    if x_val is not None:
        _check(path, spec, "x_val", x_val, "y_val", y_val)
        val = (spec.pixels.to_tensor(x_val), torch.from_numpy(y_val.astype(np.int64)))
    return NodeData(spec.pixels.to_tensor(x), torch.from_numpy(y.astype(np.int64)), *val, spec.num_classes)


def _check(path: Path, spec: NodeDataSpec, x_key: str, x: np.ndarray, y_key: str, y: np.ndarray) -> None:
    """Layout (``_check_layout``), finiteness and label range of one split."""
    _check_layout(path, spec, x_key, x.shape, x.dtype, y_key, y.shape, y.dtype)
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise NodeDataError(f"{path}: {x_key} holds NaN or Inf values")
    if len(y) and (y.min() < 0 or y.max() >= spec.num_classes):
        bad = int(y.min()) if y.min() < 0 else int(y.max())
        raise NodeDataError(f"{path}: {y_key} holds label {bad}, outside the {spec.num_classes} classes "
                            f"0..{spec.num_classes - 1} of dataset '{spec.dataset}'")


def _check_layout(path: Path, spec: NodeDataSpec, x_key: str, x_shape: tuple[int, ...], x_dtype: np.dtype,
                  y_key: str, y_shape: tuple[int, ...], y_dtype: np.dtype) -> None:
    """Shape, channels and dtype of one split (read from the arrays, or from the npz
    headers before loading), each refused with what was found and what was expected."""
    c, h, w = spec.input_shape
    where = f"{path}: {x_key}"
    if len(x_shape) not in (3, 4):
        raise NodeDataError(f"{where} has shape {x_shape}; expected {spec.expected()}")
    if x_shape[1:3] != (h, w):
        raise NodeDataError(f"{where}: images are {x_shape[1]}x{x_shape[2]} pixels, expected {h}x{w} "
                            f"(dataset '{spec.dataset}'); resize them")
    channels = 1 if len(x_shape) == 3 else x_shape[3]
    if channels != c:
        raise NodeDataError(f"{where}: images have {channels} channel(s), expected {c} "
                            f"({'greyscale' if c == 1 else 'RGB' if c == 3 else f'{c} channels'}, dataset "
                            f"'{spec.dataset}'); layout {spec.expected()}")
    if x_dtype != np.dtype(spec.pixels.dtype):
        raise NodeDataError(f"{where} is {x_dtype}; expected {spec.expected()}")
    if not np.issubdtype(y_dtype, np.integer) or y_shape != (x_shape[0],):
        raise NodeDataError(f"{path}: {y_key} is {y_dtype} {y_shape} for {x_shape[0]} images; expected integer labels "
                            f"[{x_shape[0]}]")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def class_index(folder: str, class_names: tuple[str, ...]) -> int | None:
    """The class a folder name stands for: its name with case and punctuation ignored
    (``t-shirt_top`` is ``T-shirt/top``), or its index (``0``); None if neither."""
    slugs = [_slug(n) for n in class_names]
    if _slug(folder) in slugs:
        return slugs.index(_slug(folder))
    return int(folder) if folder.isdigit() and int(folder) < len(class_names) else None


def _read_image_folder(root: Path, spec: NodeDataSpec) -> tuple[np.ndarray, np.ndarray]:
    """Images of ``root/CLASS_NAME/*.png|jpg``, in class then file-name order."""
    from PIL import Image  # only image folders need it

    if spec.pixels.dtype != "uint8":
        raise NodeDataError(f"{root} is an image folder, but dataset '{spec.dataset}' has no image form; "
                            f"give an .npz with {spec.expected()}")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise NodeDataError(f"{root} holds no class folders; expected {root}/CLASS_NAME/*.png|jpg with class names "
                            f"{list(spec.class_names)}")
    labelled = []
    for folder in folders:
        label = class_index(folder.name, spec.class_names)
        if label is None:
            raise NodeDataError(f"{folder}: unknown class folder '{folder.name}'; "
                                f"{did_you_mean(folder.name, spec.class_names)}the classes of dataset "
                                f"'{spec.dataset}' are {list(spec.class_names)} (case and punctuation are ignored)")
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        labelled += [(label, f) for f in files]
    labelled.sort()
    c, h, w = spec.input_shape
    images = []
    for _, file in labelled:
        try:
            with Image.open(file) as img:  # reads the header: mode and size are checked before the pixels are decoded
                if img.mode not in _MODES:
                    expected = "L (greyscale)" if c == 1 else "RGB"
                    raise NodeDataError(f"{file}: image mode {img.mode}; expected {expected}")
                if img.size != (w, h):
                    raise NodeDataError(f"{file}: image is {img.height}x{img.width} pixels, expected {h}x{w} "
                                        f"(dataset '{spec.dataset}'); resize it")
                if _MODES[img.mode] != c:
                    raise NodeDataError(f"{file}: image has {_MODES[img.mode]} channel(s) (mode {img.mode}), "
                                        f"expected {c}")
                images.append(np.asarray(img))
        except (OSError, Image.DecompressionBombError) as err:
            raise NodeDataError(f"{file} is not a readable image ({err})") from err
    if not images:
        return np.zeros((0, h, w, c), np.uint8), np.zeros(0, np.int64)
    x = np.stack(images)
    return (x if x.ndim == 4 else x[..., None]), np.array([label for label, _ in labelled], np.int64)


NODE_FORMATS = ("npz", "images")


def write_node_data(cfg: ExperimentConfig, out: str | Path, partition_ids: list[int] | None = None,
                    fmt: str = "npz") -> list[Path]:
    """Write the shards of ``cfg``'s partition (``partition_ids``: these shards; default
    all) as per-node data, ``out/node_III.npz`` or ``out/node_III/CLASS/*.png``: a test
    federation whose nodes bring their own data. An .npz holds exactly the shard's pixels
    in the shard's order, so nodes on these files train bitwise as the simulation does."""
    if fmt not in NODE_FORMATS:
        raise ValueError(f"format must be one of {NODE_FORMATS}, got {fmt!r}")
    bundle = load_data(cfg)
    if fmt == "images" and bundle.pixels.dtype != "uint8":
        raise ValueError(f"dataset '{bundle.name}' has no image form ({bundle.pixels.dtype} values); use the npz format")
    parts = client_partitions(cfg, bundle)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for partition_id in range(len(parts)) if partition_ids is None else partition_ids:
        if not 0 <= partition_id < len(parts):
            raise ValueError(f"client {partition_id} is outside the partition's clients 0..{len(parts) - 1}")
        idx = torch.from_numpy(parts[partition_id])
        pixels = bundle.pixels.from_tensor(bundle.x_train[idx])
        written.append(write_node_file(out / f"node_{partition_id:03d}", pixels, bundle.y_train[idx].numpy(), fmt))
    return written


def write_node_file(path: str | Path, pixels: np.ndarray, labels: np.ndarray, fmt: str = "npz") -> Path:
    """Write one node's data as an .npz (``path`` + ``.npz``) or an image folder tree (``path/CLASS/NNNNN.png``,
    class folders named by index); ``pixels`` are stored pixels [N, H, W, C] (``Pixels.from_tensor``)."""
    path = Path(path)
    if fmt == "npz":
        out = path.with_suffix(".npz")
        np.savez(out, x=pixels, y=labels.astype(np.int64))
        return out
    from PIL import Image

    for i, (image, label) in enumerate(zip(pixels, labels)):
        folder = path / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(folder / f"{i:05d}.png")
    return path

