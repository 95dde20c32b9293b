"""``data.source: package.module:loader``: the user's own data set, from a function of theirs (docs/data.md).

The loader is called with no argument, or as ``loader(root=<data.root>)`` when it has a ``root`` parameter, and
returns either

- ``(images, labels)``: images a tensor or NumPy array N×C×H×W (or N×H×W: one channel), labels N integers; or
- a ``torch.utils.data.Dataset`` of ``(image, label)`` pairs: image a C×H×W (or H×W) tensor or array, or a PIL
  image (H×W×C), label an integer; every item is read once, into memory.

Like every source, it is the whole data set (train and test together): the federation splits it with this project's
partitioners. Images of dtype uint8 are scaled to [-1, 1] as the built-in sources are; floating images are taken as
they are (float32). The class count is the data set's ``classes`` (a Dataset that has one, as torchvision's do), else
the largest label + 1. Every process of a run (the server and each client) calls the loader and must get the same
samples in the same order.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedapps.importpath import is_import_path, load_callable

from .errors import DataError
from .folder import is_folder_source
from .hf import is_hf_source

KEY = "data.source"
RETURNS = (
    "return (images, labels) — images N×C×H×W (or N×H×W), labels N integers — or a torch.utils.data.Dataset of "
    "(image, label) pairs"
)

_LOCK = threading.Lock()
_INFO: dict[tuple[str, str], tuple[int, tuple[int, int, int]]] = {}
# loaded for source_info and not yet taken by load_user (the federation's build): one loader call per process
_LOADED: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, int]] = {}


def is_user_source(source: object) -> bool:
    """True for a ``data.source`` written as an import path (``hf:<name>`` is Flower Datasets', ``folder:<path>`` a
    folder of images: neither is one)."""
    return is_import_path(source) and not is_hf_source(source) and not is_folder_source(source)


def user_loader(source: str) -> Callable[..., Any]:
    """The loader ``source`` names, imported (DataError naming data.source otherwise)."""
    return load_callable(KEY, source, DataError)


def _call(source: str, loader: Callable[..., Any], root: Path) -> Any:
    try:
        params = inspect.signature(loader).parameters
    except ValueError:  # a builtin without a signature
        params = {}  # type: ignore[assignment]
    takes_root = "root" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    required = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and n != "root"
    ]
    if required:
        raise DataError(
            f"'{KEY}' is {source!r}, whose loader needs the argument(s) {', '.join(required)}; it is called with "
            "no argument, or with root=<data.root> when it has a parameter root"
        )
    try:
        return loader(root=str(root)) if takes_root else loader()
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"'{KEY}' is {source!r}: the loader raised {type(exc).__name__}: {exc}") from exc


def _image_tensor(source: str, images: Any, what: str) -> torch.Tensor:
    """Images as float32 (uint8 scaled to [-1, 1] as the built-in sources are; floating taken as it is)."""
    try:
        t = images if isinstance(images, torch.Tensor) else torch.as_tensor(np.asarray(images))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"'{KEY}' is {source!r}: {what} are not an array of numbers ({exc}); {RETURNS}") from None
    if t.dtype == torch.uint8:
        return t.to(torch.float32).div_(127.5).sub_(1.0)
    if not t.is_floating_point():
        raise DataError(
            f"'{KEY}' is {source!r}: {what} have dtype {t.dtype}; give uint8 (0..255, scaled to [-1, 1]) or "
            "floating values (taken as they are)"
        )
    return t.to(torch.float32)


def _labels(source: str, labels: Any, n: int) -> torch.Tensor:
    try:
        y = labels if isinstance(labels, torch.Tensor) else torch.as_tensor(np.asarray(labels))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"'{KEY}' is {source!r}: the labels are not integers ({exc}); {RETURNS}") from None
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise DataError(f"'{KEY}' is {source!r}: the labels have dtype {y.dtype}; give integer class indices 0..K-1")
    y = y.reshape(-1).to(torch.int64)
    if y.numel() != n:
        raise DataError(f"'{KEY}' is {source!r}: {n} images but {y.numel()} labels; give one label per image")
    return y


def _from_arrays(source: str, images: Any, labels: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = _image_tensor(source, images, "the images")
    if x.ndim == 3:
        x = x.unsqueeze(1)
    if x.ndim != 4:
        raise DataError(
            f"'{KEY}' is {source!r}: the images have shape {tuple(x.shape)}; give N×C×H×W (or N×H×W for one channel)"
        )
    if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        raise DataError(
            f"'{KEY}' is {source!r}: the images have shape {tuple(x.shape)}, which looks channels-last (N×H×W×C); "
            "give N×C×H×W (e.g. images.permute(0, 3, 1, 2) or np.transpose(images, (0, 3, 1, 2)))"
        )
    return x.contiguous(), _labels(source, labels, int(x.shape[0]))


def _item_image(source: str, image: Any, index: int) -> torch.Tensor:
    if not isinstance(image, (torch.Tensor, np.ndarray)) and hasattr(image, "getbands"):  # a PIL image: H×W(×C)
        array = np.asarray(image)
        image = array if array.ndim == 2 else np.transpose(array, (2, 0, 1))
    x = _image_tensor(source, image, f"the image of item {index}")
    if x.ndim == 2:
        x = x.unsqueeze(0)
    if x.ndim != 3:
        raise DataError(f"'{KEY}' is {source!r}: item {index}'s image has shape {tuple(x.shape)}; give C×H×W (or H×W)")
    return x


def _from_dataset(source: str, ds: Any) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(ds)
    if n == 0:
        raise DataError(f"'{KEY}' is {source!r}: the loader's Dataset is empty")
    images: list[torch.Tensor] = []
    labels: list[int] = []
    for i in range(n):
        item = ds[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DataError(
                f"'{KEY}' is {source!r}: item {i} of the loader's Dataset is a {type(item).__name__}, not an "
                "(image, label) pair"
            )
        image = _item_image(source, item[0], i)
        if images and image.shape != images[0].shape:
            raise DataError(
                f"'{KEY}' is {source!r}: item {i}'s image has shape {tuple(image.shape)}, item 0's "
                f"{tuple(images[0].shape)}; every image must have the same shape"
            )
        images.append(image)
        try:
            labels.append(int(item[1]))
        except (TypeError, ValueError):
            raise DataError(
                f"'{KEY}' is {source!r}: item {i}'s label {item[1]!r} is not an integer class index"
            ) from None
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64)


def as_data(source: str, out: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What a loader returned as (images float32 N×C×H×W, labels int64 N, class count); DataError naming data.source
    when it is neither form or its values are not usable."""
    classes = None
    if isinstance(out, torch.utils.data.Dataset) or (
        not isinstance(out, (tuple, list, dict, str, bytes)) and hasattr(out, "__getitem__") and hasattr(out, "__len__")
    ):
        x, y = _from_dataset(source, out)
        classes = getattr(out, "classes", None)
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        x, y = _from_arrays(source, *out)
    else:
        shown = f"a {type(out).__name__}" + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else "")
        raise DataError(f"'{KEY}' is {source!r}, whose loader returned {shown}; it must {RETURNS}")
    if y.numel() == 0:
        raise DataError(f"'{KEY}' is {source!r}: the loader returned no samples")
    if not bool(torch.isfinite(x).all()):
        raise DataError(f"'{KEY}' is {source!r}: the images hold NaN or infinite values")
    if int(y.min()) < 0:
        raise DataError(f"'{KEY}' is {source!r}: a label is negative ({int(y.min())}); labels are class indices 0..K-1")
    k = len(classes) if classes is not None else int(y.max()) + 1
    if int(y.max()) >= k:
        raise DataError(f"'{KEY}' is {source!r}: a label is {int(y.max())}, but the Dataset's classes list {k} classes")
    if k < 2:
        raise DataError(f"'{KEY}' is {source!r}: the labels name {k} class; a classification task needs at least 2")
    return x, y, k


def _load(source: str, root: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    return as_data(source, _call(source, user_loader(source), root))


def user_info(source: str, root: str | Path) -> tuple[int, tuple[int, int, int]]:
    """(classes, input shape C×H×W) of a user's source: the loader runs once per process and root (what it loaded is
    kept for :func:`load_user`, which takes it)."""
    key = (source, str(Path(root).expanduser()))
    with _LOCK:
        info = _INFO.get(key)
        if info is not None:
            return info
        x, y, k = _load(source, Path(key[1]))
        info = (k, (int(x.shape[1]), int(x.shape[2]), int(x.shape[3])))
        _INFO[key] = info
        _LOADED[key] = (x, y, k)
        return info


def load_user(source: str, root: str | Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(images, labels, classes) of a user's source: what :func:`user_info` loaded in this process, else the loader
    called now."""
    key = (source, str(Path(root).expanduser()))
    with _LOCK:
        loaded = _LOADED.pop(key, None)
        if loaded is not None:
            return loaded
        x, y, k = _load(source, Path(key[1]))
        _INFO[key] = (k, (int(x.shape[1]), int(x.shape[2]), int(x.shape[3])))
        return x, y, k
