"""``data.source: folder:<path>``: your own images, one folder per class, read from disk (no network, no extra).

Two layouts (``<path>`` relative to ``data.root``, or absolute, or starting with ``~``):

- ``<path>/<class>/<image>``: every image is the clients' data; each client's part is split into train and test
  (``data.test_fraction``), as for every other source;
- ``<path>/train/<class>/<image>`` and ``<path>/test/<class>/<image>``: ``train/`` is partitioned among the clients,
  and ``test/`` stays the test split: it is never trained on, and each client is measured on test images of its own
  classes, in the proportions of its training data (:func:`fedapps.data.federation.allocate_test`). The validation
  split of tuning (``data.evaluate_on: validation``) is still carved from each client's training data. A ``train/``
  without a ``test/`` is the first layout inside ``train/``.

The classes are the sorted names of the class folders (of ``train/`` in the second layout; a class folder of
``test/`` that ``train/`` lacks is refused). Images: the files whose suffix PIL reads (PNG, JPEG, BMP, GIF, TIFF, WebP,
PGM/PPM), read in sorted order, converted to 8-bit grey when the first image is grey, else to RGB; all must have the
size of the first one. Hidden files are ignored.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from .errors import DataError

log = logging.getLogger("fedapps.data")

FOLDER_PREFIX = "folder:"
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm"})
GREY_MODES = frozenset({"1", "L", "I", "I;16", "F"})  # PIL modes read as one channel
TRAIN, TEST = "train", "test"

_LOCK = threading.Lock()
_LOADED: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None, list[str]]] = {}


def is_folder_source(source: object) -> bool:
    """True for a ``data.source`` of the form ``folder:<path>``."""
    return isinstance(source, str) and source.startswith(FOLDER_PREFIX)


def folder_path(source: str, root: str | Path) -> Path:
    """The folder a ``folder:<path>`` source names: absolute or ``~`` as written, else under ``data.root``."""
    name = source[len(FOLDER_PREFIX) :].strip()
    if not name:
        raise DataError(
            f"data.source={source!r}: after 'folder:' give a folder of class folders (e.g. folder:/data/pets, or "
            "folder:pets under data.root)"
        )
    p = Path(name).expanduser()
    return p if p.is_absolute() else Path(root).expanduser() / p


def class_folders(folder: Path) -> list[Path]:
    """The class folders of ``folder``, sorted by name (hidden ones left out)."""
    return sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def image_files(folder: Path) -> list[Path]:
    """The image files under a class folder (nested folders included), sorted by path."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not any(part.startswith(".") for part in p.parts)
    )


def layout(source: str, root: str | Path) -> tuple[Path, Path | None]:
    """(the folder of training class folders, the test folder or None) of a ``folder:`` source (DataError naming
    data.source when the folder or its classes are missing)."""
    path = folder_path(source, root)
    if not path.is_dir():
        raise DataError(
            f"data.source={source!r}: {path} is not a folder; give a folder holding one folder per class "
            "(or train/ and test/, each holding one folder per class)"
        )
    train, test = path / TRAIN, path / TEST
    if train.is_dir():
        return train, (test if test.is_dir() else None)
    if test.is_dir():
        raise DataError(f"data.source={source!r}: {path} has test/ but no train/; add train/<class>/ folders")
    return path, None


def _read(files: list[Path], source: str, mode: str | None, size: tuple[int, int] | None) -> tuple[np.ndarray, str]:
    from PIL import Image, UnidentifiedImageError

    arrays = []
    for f in files:
        try:
            with Image.open(f) as img:
                if mode is None:
                    mode = "L" if img.mode in GREY_MODES else "RGB"
                    size = img.size
                if size is not None and img.size != size:
                    raise DataError(
                        f"data.source={source!r}: {f} is {img.size[0]}×{img.size[1]}, the first image is "
                        f"{size[0]}×{size[1]}; this source needs images of one size (resize them first)"
                    )
                arrays.append(np.asarray(img if img.mode == mode else img.convert(mode), dtype=np.uint8))
        except (OSError, UnidentifiedImageError) as exc:
            raise DataError(f"data.source={source!r}: {f} cannot be read as an image ({exc})") from exc
    assert mode is not None
    return (np.stack(arrays) if arrays else np.empty((0,), np.uint8)), mode


def load_folder(source: str, root: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, list[str]]:
    """(images uint8 N×H×W or N×H×W×3, int64 labels, the test mask (None without a test/ folder), class names) of a
    ``folder:`` source: training images first, then test images. Read once per process and folder."""
    train_dir, test_dir = layout(source, root)
    key = str(train_dir.resolve())
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
    classes = class_folders(train_dir)
    if not classes:
        raise DataError(
            f"data.source={source!r}: {train_dir} holds no class folder; put each class's images in a folder of "
            "its own (e.g. cats/, dogs/)"
        )
    names = [c.name for c in classes]
    files, labels = [], []
    for k, c in enumerate(classes):
        found = image_files(c)
        if not found:
            raise DataError(
                f"data.source={source!r}: class folder {c} holds no image ({', '.join(sorted(IMAGE_SUFFIXES))})"
            )
        files += found
        labels += [k] * len(found)
    test_files, test_labels = [], []
    if test_dir is not None:
        extra = [c.name for c in class_folders(test_dir) if c.name not in names]
        if extra:
            raise DataError(
                f"data.source={source!r}: {test_dir} has class folders that train/ lacks ({', '.join(extra)}); "
                "a class must have training images"
            )
        for c in class_folders(test_dir):
            found = image_files(c)
            test_files += found
            test_labels += [names.index(c.name)] * len(found)
        if not test_files:
            raise DataError(f"data.source={source!r}: {test_dir} holds no image; fill it or remove it")
    images, mode = _read(files + test_files, source, None, None)
    y = np.asarray(labels + test_labels, dtype=np.int64)
    mask = None
    if test_dir is not None:
        mask = np.zeros(y.size, dtype=bool)
        mask[len(files) :] = True
    log.info(
        "data.source=%r: %d images (%s), %d classes, from %s%s",
        source,
        y.size,
        "grey" if mode == "L" else "RGB",
        len(names),
        train_dir.parent if test_dir is not None else train_dir,
        f" (train {len(files)}, test {len(test_files)}: test/ kept as the test split)" if test_dir is not None else "",
    )
    loaded = (images, y, mask, names)
    with _LOCK:
        _LOADED[key] = loaded
    return loaded


def folder_info(source: str, root: str | Path) -> tuple[int, tuple[int, int, int]]:
    """(num_classes, C×H×W) of a ``folder:`` source, from its class folders and its first image."""
    train_dir, _ = layout(source, root)
    classes = class_folders(train_dir)
    if not classes:
        raise DataError(f"data.source={source!r}: {train_dir} holds no class folder")
    first = next((f for c in classes for f in image_files(c)[:1]), None)
    if first is None:
        raise DataError(f"data.source={source!r}: no image found under {train_dir}")
    image, mode = _read([first], source, None, None)
    h, w = image.shape[1], image.shape[2]
    return len(classes), (1 if mode == "L" else 3, int(h), int(w))
