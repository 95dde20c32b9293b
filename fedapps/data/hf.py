"""``data.source: hf:<name>``: an image-classification dataset from the Hugging Face Hub (or a local folder in the
Hub's layout), read through Flower's data library ``flwr-datasets`` (optional extra ``hf``).

As for the other sources, every split the dataset has is loaded and MERGED (in the order the dataset lists them),
then the federation splits it with this project's partitioners (PFLlib's ``iid`` / ``pathological`` /
``dirichlet``, COSMOS's groups, ...): ``FederatedDataset`` serves the whole dataset, its own partitioners are not
used (docs/data.md says how they differ from ours). Rows whose label is negative (the Hub's "no label",
e.g. an unlabelled test split) and splits without the label column are left out.

Columns: the image column is the one ``Image`` feature; the label column the one ``ClassLabel`` feature, else the
one named ``label`` or ``fine_label`` (CIFAR-100 on the Hub has fine and coarse labels), else an integer column
named ``label`` / ``labels``. Images are converted to 8-bit grey (1 channel) when the first one is grey, to RGB
otherwise, and must all have the size of the first one.

Network: with ``data.download: false`` the Hub is never contacted (the dataset must be in the cache under
``<data.root>/huggingface`` from an earlier download, or ``<name>`` is a local folder); with ``true`` it is
downloaded into that cache when missing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedapps.config import HF_SOURCE_PREFIX, ConfigError, check_hf_source

from .errors import DataError

log = logging.getLogger("fedapps.data")

CACHE_FOLDER = "huggingface"  # under data.root: datasets' cache (downloads and Arrow files)
GREY_MODES = frozenset({"1", "L", "I", "I;16", "F"})  # PIL modes read as one channel
LABEL_NAMES = ("label", "fine_label")  # preferred among several ClassLabel columns, in this order
INT_LABEL_NAMES = ("label", "labels")  # integer label columns accepted without a ClassLabel feature
ALL_SPLITS = "all"  # the one split FederatedDataset serves after merging

_LOCK = threading.Lock()
_INFO: dict[tuple[str, str], tuple[int, tuple[int, int, int]]] = {}


def is_hf_source(source: object) -> bool:
    """True for a ``data.source`` of the form ``hf:<name>``."""
    return isinstance(source, str) and source.startswith(HF_SOURCE_PREFIX)


def hf_name(source: str) -> str:
    """The dataset name (Hub id or local folder) of an ``hf:<name>`` source; DataError when it is malformed or the
    optional extra is not installed (the same check as the config's)."""
    try:
        check_hf_source(source)
    except ConfigError as exc:
        raise DataError(str(exc)) from exc
    return source[len(HF_SOURCE_PREFIX) :]


def cache_dir(root: str | Path) -> Path:
    """Where datasets keeps an ``hf:`` source's files: ``<data.root>/huggingface``."""
    return Path(root).expanduser() / CACHE_FOLDER


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """With ``offline``: datasets' offline mode for the duration (no request to the Hub; cache and local folders
    only). datasets reads this flag at call time; the lock keeps two loads in one process from interleaving it."""
    import datasets

    with _LOCK:
        before = datasets.config.HF_HUB_OFFLINE
        datasets.config.HF_HUB_OFFLINE = before or offline
        try:
            yield
        finally:
            datasets.config.HF_HUB_OFFLINE = before


@contextlib.contextmanager
def _quiet_if_local(local: bool) -> Iterator[None]:
    """A local folder is read, not downloaded: datasets' progress bars ("Downloading data", "Generating ... split")
    are turned off while it is (they stay for a download from the Hub)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if local:
        disable_progress_bars()
    try:
        yield
    finally:
        if local and not was_disabled:
            enable_progress_bars()


def _dataset_path(name: str) -> str:
    """A local folder as an absolute path (datasets reads it without the Hub), a Hub id as it is."""
    p = Path(name).expanduser()
    return str(p.resolve()) if p.is_dir() else name


def pick_columns(features: Any, source: str) -> tuple[str, str]:
    """(image column, label column) of a dataset's features; DataError naming the columns when not unique."""
    from datasets import ClassLabel, Image, Value

    listing = ", ".join(f"{k} ({type(v).__name__})" for k, v in features.items())
    images = [k for k, v in features.items() if isinstance(v, Image)]
    if len(images) != 1:
        raise DataError(
            f"data.source={source!r}: expected exactly one image column (an Image feature), found "
            f"{len(images)}; its columns: {listing}. Only image-classification datasets are supported"
        )
    classes = [k for k, v in features.items() if isinstance(v, ClassLabel)]
    if len(classes) == 1:
        return images[0], classes[0]
    for name in LABEL_NAMES if classes else ():
        if name in classes:
            return images[0], name
    if not classes:
        ints = [
            k
            for k in INT_LABEL_NAMES
            if isinstance(features.get(k), Value) and str(features[k].dtype).startswith(("int", "uint"))
        ]
        if ints:
            return images[0], ints[0]
    raise DataError(
        f"data.source={source!r}: cannot tell which column holds the class label (one ClassLabel "
        f"column, or one named {' / '.join(LABEL_NAMES)}, or an integer column named "
        f"{' / '.join(INT_LABEL_NAMES)}); its columns: {listing}"
    )


def _merge_splits(source: str):  # returns flwr-datasets' preprocessor (a callable)
    """A flwr-datasets preprocessor: every labelled split, reduced to (image, label), concatenated into one split."""

    def merge(dd: Any) -> Any:
        from datasets import DatasetDict, concatenate_datasets

        if not len(dd):
            raise DataError(f"data.source={source!r}: the dataset has no split")
        image_col, label_col = pick_columns(next(iter(dd.values())).features, source)
        parts = []
        for split, ds in dd.items():
            if label_col not in ds.column_names or image_col not in ds.column_names:
                log.warning(
                    "data.source=%r: split %r has no %r / %r column; left out", source, split, image_col, label_col
                )
                continue
            parts.append(ds.select_columns([image_col, label_col]))
        try:
            merged = concatenate_datasets(parts)
        except ValueError as exc:  # features that differ between splits
            raise DataError(f"data.source={source!r}: its splits cannot be merged ({exc})") from exc
        log.info("data.source=%r: splits %s merged (%d rows)", source, ", ".join(dd), merged.num_rows)
        return DatasetDict({ALL_SPLITS: merged})

    return merge


def _open(source: str, root: str | Path, download: bool) -> tuple[Any, str, str]:
    """The whole dataset, all splits merged, through flwr-datasets: (Dataset, image column, label column)."""
    name = hf_name(source)
    if name.startswith(("/", "~", ".")) and not Path(name).expanduser().is_dir():
        raise DataError(
            f"data.source={source!r}: {name} is not a folder (a local dataset is a folder in the Hub's "
            "layout, e.g. data/train-00000-of-00001.parquet); give an existing folder or a Hub id"
        )
    from flwr_datasets import FederatedDataset

    cache = cache_dir(root)
    fds = FederatedDataset(
        dataset=_dataset_path(name),
        partitioners={},
        shuffle=False,
        preprocessor=_merge_splits(source),
        cache_dir=str(cache),
    )
    try:
        with _hub_offline(not download), _quiet_if_local(Path(_dataset_path(name)).is_dir()):
            ds = fds.load_split(ALL_SPLITS)
    except DataError:
        raise
    except (ConnectionError, FileNotFoundError) as exc:  # no network, not on the Hub, not in the cache
        reason = f"{type(exc).__name__}: {str(exc).strip()}"
        if download:
            raise DataError(
                f"data.source={source!r}: could not be fetched from the Hugging Face Hub ({reason}). Downloading "
                f"needs network access; offline, use a copy in the cache {cache} (from an earlier download with "
                f"data.download: true) or a local folder (data.source: hf:/path/to/folder)"
            ) from exc
        raise DataError(
            f"data.source={source!r}: not found in the local cache {cache} nor as a local folder, and "
            f"data.download is false, so the Hub was not contacted ({reason}). Set data.download: true to fetch "
            f"it (needs network access), or give a local folder in the Hub's layout "
            f"(data.source: hf:/path/to/folder)"
        ) from exc
    except Exception as exc:  # datasets' own errors (bad config name, corrupt files, ...)
        raise DataError(
            f"data.source={source!r}: could not be loaded ({type(exc).__name__}: {str(exc).strip()})"
        ) from exc
    image_col, label_col = pick_columns(ds.features, source)  # the merged split holds just these two
    return ds, image_col, label_col


def _labels(ds: Any, label_col: str) -> np.ndarray:
    return np.asarray(ds.select_columns([label_col]).with_format("numpy")[:][label_col]).astype(np.int64).reshape(-1)


def _num_classes(ds: Any, label_col: str, labels: np.ndarray | None = None) -> int:
    from datasets import ClassLabel

    feature = ds.features[label_col]
    if isinstance(feature, ClassLabel):
        return int(feature.num_classes)
    y = _labels(ds, label_col) if labels is None else labels
    return int(y.max()) + 1 if (y >= 0).any() else 0


def _mode_and_shape(first: Any) -> tuple[str, tuple[int, int, int]]:
    """PIL mode every image is converted to, and the C×H×W shape, from the first image."""
    mode = "L" if first.mode in GREY_MODES else "RGB"
    width, height = first.size
    return mode, (1 if mode == "L" else 3, int(height), int(width))


def _first_image(ds: Any, image_col: str, source: str) -> Any:
    if ds.num_rows == 0:
        raise DataError(f"data.source={source!r}: the dataset has no labelled rows")
    return ds[0][image_col]


def hf_info(source: str, root: str | Path, download: bool) -> tuple[int, tuple[int, int, int]]:
    """(num_classes, C×H×W) of an ``hf:`` source: its label feature and first image (the dataset is opened, memory
    mapped, not decoded); cached per process and data root."""
    key = (source, str(cache_dir(root)))
    if key not in _INFO:
        ds, image_col, label_col = _open(source, root, download)
        k = _num_classes(ds, label_col)
        _, shape = _mode_and_shape(_first_image(ds, image_col, source))
        _INFO[key] = (k, shape)
    return _INFO[key]


def load_hf(source: str, root: str | Path, download: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """All labelled images of an ``hf:`` source (every split, merged) as uint8 N×H×W or N×H×W×3, int64 labels, and
    the class count."""
    ds, image_col, label_col = _open(source, root, download)
    labels = _labels(ds, label_col)
    k = _num_classes(ds, label_col, labels)
    keep = np.flatnonzero(labels >= 0)
    if keep.size < labels.size:
        log.info("data.source=%r: %d unlabelled rows (label < 0) left out", source, labels.size - keep.size)
    if keep.size == 0:
        raise DataError(f"data.source={source!r}: the dataset has no labelled rows")
    mode, (c, h, w) = _mode_and_shape(_first_image(ds, image_col, source))
    images = np.empty((keep.size, h, w) if c == 1 else (keep.size, h, w, 3), dtype=np.uint8)
    row = 0
    wanted = set(keep.tolist()) if keep.size < labels.size else None
    position = 0
    for batch in ds.select_columns([image_col]).iter(batch_size=1024):
        for img in batch[image_col]:
            if wanted is not None and position not in wanted:
                position += 1
                continue
            if img.size != (w, h):
                raise DataError(
                    f"data.source={source!r}: image {position} is {img.size[0]}×{img.size[1]}, the first "
                    f"is {w}×{h}; this source needs images of one size"
                )
            images[row] = np.asarray(img if img.mode == mode else img.convert(mode))
            row += 1
            position += 1
    _INFO[(source, str(cache_dir(root)))] = (k, (c, h, w))
    log.info("data.source=%r: %d images %d×%d×%d, %d classes", source, keep.size, c, h, w, k)
    return images, labels[keep], k
