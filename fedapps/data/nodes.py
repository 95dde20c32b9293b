"""A node's own data (deployment): ``data.source: nodes``, node config ``data-path`` and ``public-path``.

A SuperNode that names its own labelled files in its node config (``data-path``) serves them instead of a
partition of a source: an ``.npz`` with ``x`` (N×C×H×W or N×H×W, float or uint8) and ``y`` (integer labels), or a
folder of class sub-folders of images (class index = position of the sub-folder in sorted order, read with PIL).
The node splits them into its train / test split (and, under ``evaluate_on: validation``, the validation share
of its train split) with the data spec's fractions, seeded by ``data.seed`` and its client id: the same every
message, every process, every machine.

Values: uint8 data (every image folder, and ``.npz`` files of dtype uint8) are scaled as the built-in sources
do, ``v / 127.5 − 1`` into [−1, 1]; float data are used AS GIVEN (the site's own normalisation; every node and
the server's U must then use the same one). The class count a node declares: node config ``num-classes``, else
an ``num_classes`` entry of the ``.npz``, else the number of class sub-folders; without any of them it is
inferred as the largest label + 1 (a node whose labels miss the top classes cannot know them).

The shared unlabelled set U (``public-path`` on a node, ``data.public_path`` on the server) is an ``.npz`` with
``x`` (same value rules) and an optional ``y`` (FedMD's labelled pre-training, oracle diagnostics). Its
fingerprint is a content hash of the normalised tensor, so every copy of the same file agrees with the server's.

Paths in node config are the node's own: ``~`` is expanded here, on the node, never on the server. Files are
read once per process (cached on path, size and modification time).

The node registry (``data.node_registry``, on the server): the operator's cap on the ``num-examples`` each client
may claim, a CSV ``client_id,max_num_examples[,node]`` (a row ``*`` caps every client not listed; without one an
unlisted client is refused). ``fedapps deploy node-key DIR NAME --client-id C --max-num-examples N`` writes the row
into DIR/:data:`fedapps.config.REGISTRY_FILE`, next to the node's keys. The server cannot check a node's claimed size
(the data never leave the node) and the node cannot be trusted to cap itself (a hostile node runs its own code): the
cap is the operator's knowledge of each site, enforced by the reply validation
(:class:`fedapps.wire.validation.ReplyValidator`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import DataError

log = logging.getLogger("fedapps.data")

NODES = "nodes"  # data.source: every node brings its own data (node config data-path)
DATA_PATH = "data-path"  # node config: the node's labelled data
PUBLIC_PATH = "public-path"  # node config: the node's copy of U
NUM_CLASSES = "num-classes"  # node config: the class count this node's labels use (optional)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
NODE_SPLIT_PURPOSE = "node-split"  # derive_rng(data.seed, this, client id): a node's train/test split


@dataclass(frozen=True)
class Labelled:
    """A node's labelled data as read: normalised images, labels, the class count it declares (None: none)."""

    x: torch.Tensor  # float32 N×C×H×W
    y: torch.Tensor  # int64 N
    declared_classes: int | None
    path: str

    @property
    def num_classes(self) -> int:
        """The declared class count, else the largest label + 1."""
        if self.declared_classes is not None:
            return self.declared_classes
        return int(self.y.max()) + 1 if self.y.numel() else 0

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(int(d) for d in self.x.shape[1:])  # type: ignore[return-value]


def node_path(value: Any, key: str) -> Path:
    """A path from the node config: ``~`` expanded HERE (on the node), made absolute; it must exist."""
    text = str(value).strip()
    if not text:
        raise DataError(
            f"node config '{key}' is empty; give the path of this node's file or folder, e.g. "
            f"--node-config \"{key}='/data/site1.npz'\""
        )
    path = Path(os.path.expanduser(text)).resolve()
    if not path.exists():
        raise DataError(
            f"node config '{key}'='{text}': {path} does not exist on this node; fix the path in the "
            f"SuperNode's --node-config (paths are this node's own; '~' is this node's home)"
        )
    return path


def as_images(x: np.ndarray, where: str) -> torch.Tensor:
    """N×H×W or N×C×H×W, uint8 or float -> float32 N×C×H×W: uint8 scaled to [-1, 1] as the built-in sources do,
    float taken as given."""
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DataError(f"{where}: 'x' has shape {x.shape}; expected N×C×H×W or N×H×W images")
    if x.dtype == np.uint8:
        t = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32)
        return t.div_(127.5).sub_(1.0)
    if not np.issubdtype(x.dtype, np.floating):
        raise DataError(f"{where}: 'x' has dtype {x.dtype}; expected uint8 (0..255) or float images")
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if not torch.isfinite(t).all():
        raise DataError(f"{where}: 'x' holds non-finite values")
    return t


def as_labels(y: np.ndarray, n: int, where: str) -> torch.Tensor:
    """Integer labels, one per sample, non-negative."""
    y = np.asarray(y)
    if y.ndim != 1 or y.shape[0] != n:
        raise DataError(f"{where}: 'y' has shape {y.shape}; expected ({n},), one label per image of 'x'")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        else:
            raise DataError(f"{where}: 'y' has dtype {y.dtype}; expected integer class labels 0..K-1")
    if y.size and int(y.min()) < 0:
        raise DataError(f"{where}: 'y' holds negative labels; expected class indices 0..K-1")
    return torch.from_numpy(y.astype(np.int64))


def _open_npz(path: Path, where: str) -> Mapping[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except Exception as exc:  # unreadable, truncated, not an npz, pickled objects
        raise DataError(
            f"{where}: cannot be read as an .npz file ({type(exc).__name__}: {exc}); give an .npz "
            "written with numpy.savez (arrays 'x' and 'y') or a folder of class sub-folders"
        ) from exc


def read_npz_labelled(path: Path, key: str) -> Labelled:
    where = f"node config '{key}'={str(path)!r}"
    data = _open_npz(path, where)
    missing = [k for k in ("x", "y") if k not in data]
    if missing:
        raise DataError(
            f"{where}: the .npz lacks {missing} (it holds {sorted(data)}); save it with "
            "numpy.savez(path, x=images, y=labels)"
        )
    x = as_images(data["x"], where)
    y = as_labels(data["y"], int(x.shape[0]), where)
    declared = None
    if "num_classes" in data:
        value = np.asarray(data["num_classes"])
        if value.size != 1 or not np.issubdtype(value.dtype, np.integer) or int(value) < 1:
            raise DataError(f"{where}: 'num_classes' must be one positive integer, got {value!r}")
        declared = int(value)
    return Labelled(x, y, declared, str(path))


def read_image_folder(path: Path, key: str) -> Labelled:
    """Class sub-folders of images (sorted names = class 0, 1, ...); every image of the same size and mode."""
    where = f"node config '{key}'={str(path)!r}"
    from PIL import Image, UnidentifiedImageError

    classes = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(
            f"{where}: the folder has no class sub-folders; put the images of class k in the k-th "
            "sub-folder (sorted by name), or give an .npz file"
        )
    files = [
        (f, c)
        for c, d in enumerate(classes)
        for f in sorted(d.iterdir())
        if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise DataError(f"{where}: no image files ({', '.join(IMAGE_SUFFIXES)}) in its class sub-folders")
    images: list[np.ndarray] = []
    first_size = first_mode = None
    for f, _ in files:
        try:
            with Image.open(f) as img:
                mode = "L" if img.mode in ("L", "1", "I;16", "I", "F") else "RGB"
                array = np.asarray(img.convert(mode))
                size = img.size
        except (UnidentifiedImageError, OSError) as exc:
            raise DataError(
                f"{where}: image {f} cannot be read ({type(exc).__name__}: {exc}); remove or replace it"
            ) from exc
        if first_size is None:
            first_size, first_mode = size, mode
        if size != first_size or mode != first_mode:
            raise DataError(
                f"{where}: image {f} is {size[0]}×{size[1]} {mode}, the first one was "
                f"{first_size[0]}×{first_size[1]} {first_mode}; every image must have the same size "
                "and colour mode (resize / convert them first)"
            )
        images.append(array if array.ndim == 3 else array[..., None])
    stacked = np.stack(images).transpose(0, 3, 1, 2)  # N×C×H×W, uint8
    labels = np.array([c for _, c in files], dtype=np.int64)
    return Labelled(as_images(stacked, where), torch.from_numpy(labels), len(classes), str(path))


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _read_labelled_cached(path: str, size: int, mtime_ns: int, key: str) -> Labelled:
    p = Path(path)
    out = read_image_folder(p, key) if p.is_dir() else read_npz_labelled(p, key)
    log.info(
        "node data: %d samples %s from %s (%s classes)",
        len(out.y),
        tuple(out.x.shape[1:]),
        path,
        out.declared_classes if out.declared_classes is not None else f"inferred {out.num_classes}",
    )
    return out


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    if path.is_dir():  # a folder changes when its class folders do
        stamps = [d.stat() for d in path.iterdir() if d.is_dir()]
        return len(stamps), max([st.st_mtime_ns, *(s.st_mtime_ns for s in stamps)])
    return st.st_size, st.st_mtime_ns


def read_labelled(value: Any, key: str = DATA_PATH, declared_classes: Any = None) -> Labelled:
    """The node's labelled data from node config ``key`` (read once per process). ``declared_classes``: node
    config ``num-classes`` (overrides what the files say)."""
    path = node_path(value, key)
    with _LOCK:
        data = _read_labelled_cached(str(path), *_stamp(path), key)
    if declared_classes is not None and str(declared_classes).strip() != "":
        try:
            k = int(declared_classes)
        except (TypeError, ValueError):
            k = 0
        if k < 1:
            raise DataError(f"node config '{NUM_CLASSES}'={declared_classes!r} must be a positive integer")
        data = Labelled(data.x, data.y, k, data.path)
    if data.y.numel() == 0:
        raise DataError(f"node config '{key}'={str(path)!r}: holds no samples")
    if int(data.y.max()) >= data.num_classes:
        raise DataError(
            f"node config '{key}'={str(path)!r}: label {int(data.y.max())} does not fit the "
            f"{data.num_classes} classes this node declares; fix the labels or '{NUM_CLASSES}'"
        )
    return data


@functools.lru_cache(maxsize=2)
def _read_public_cached(path: str, size: int, mtime_ns: int, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    data = _open_npz(Path(path), where)
    if "x" not in data:
        raise DataError(
            f"{where}: the .npz lacks 'x' (it holds {sorted(data)}); save U with numpy.savez(path, x=images"
            "[, y=labels])"
        )
    x = as_images(data["x"], where)
    y = as_labels(data["y"], int(x.shape[0]), where) if "y" in data else None
    return x, y


def read_public(path: Path, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """U from an .npz (``x``, optional ``y``), normalised like the labelled data; read once per process."""
    if path.is_dir():
        raise DataError(f"{where}: {path} is a folder; U must be an .npz file with 'x' (and optionally 'y')")
    with _LOCK:
        return _read_public_cached(str(path), *_stamp(path), where)


def server_public_path(value: str) -> Path:
    """``data.public_path`` on the server: ``~`` is the server's home; a relative path is taken against the working
    directory, then the app folder (as config files are)."""
    return _server_file(value, "data.public_path", "the server's copy of U, an .npz with 'x'")


REGISTRY_COLUMNS = ("client_id", "max_num_examples", "node")  # node: the key's name, for the operator only
ANY_CLIENT = "*"  # a registry row for every client not listed


@dataclass(frozen=True)
class NodeRegistry:
    """The operator's caps on the training examples each client may claim (``data.node_registry``)."""

    path: str
    caps: Mapping[int, int]
    default: int | None = None  # the '*' row: every client not listed; None: an unlisted client is refused

    def problem(self, client_id: int, num_examples: int) -> str | None:
        """Why a reply claiming ``num_examples`` for ``client_id`` breaks the registry (None: within its cap)."""
        cap = self.caps.get(client_id, self.default)
        if cap is None:
            return (
                f"client-id {client_id} is not in the node registry {self.path} (data.node_registry); add its row: "
                f"fedapps deploy node-key DIR NAME --client-id {client_id} --max-num-examples N"
            )
        if num_examples > cap:
            return (
                f"num-examples {num_examples} exceeds the {cap} the node registry {self.path} "
                f"(data.node_registry) allows client {client_id}"
            )
        return None


def parse_registry(text: str, where: str, num_clients: int) -> NodeRegistry:
    """A registry from CSV text (header naming ``client_id`` and ``max_num_examples``; other columns ignored);
    DataError naming ``where`` and the line for a bad row: an id outside [0, num_clients) or listed twice, a cap that
    is not a positive integer."""
    import csv
    import io

    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in REGISTRY_COLUMNS[:2] if c not in (reader.fieldnames or [])]
    if missing:
        raise DataError(
            f"{where}: the header must name {', '.join(REGISTRY_COLUMNS[:2])} (missing: {', '.join(missing)}); "
            f"e.g. 'client_id,max_num_examples,node' then rows '3,5000,site3'"
        )
    caps: dict[int, int] = {}
    default: int | None = None
    for row in reader:
        line = reader.line_num
        raw_id, raw_cap = (row.get("client_id") or "").strip(), (row.get("max_num_examples") or "").strip()
        try:
            cap = int(raw_cap)
        except ValueError:
            cap = 0
        if cap <= 0:
            raise DataError(f"{where}, line {line}: max_num_examples {raw_cap!r} must be a positive integer")
        if raw_id == ANY_CLIENT:
            if default is not None:
                raise DataError(f"{where}, line {line}: a second '{ANY_CLIENT}' row")
            default = cap
            continue
        if not raw_id.isdigit() or int(raw_id) >= num_clients:
            raise DataError(
                f"{where}, line {line}: client_id {raw_id!r} must be an id in [0, {num_clients}) "
                f"(data.num_clients) or '{ANY_CLIENT}'"
            )
        if int(raw_id) in caps:
            raise DataError(f"{where}, line {line}: client_id {raw_id} is listed twice")
        caps[int(raw_id)] = cap
    return NodeRegistry(where, caps, default)


def read_registry(value: str, num_clients: int) -> NodeRegistry:
    """``data.node_registry`` on the server (``~``: the server's home; relative: the working directory, then the
    app folder)."""
    path = _server_file(
        value, "data.node_registry", f"the operator's node registry, a CSV {','.join(REGISTRY_COLUMNS)}"
    )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"data.node_registry={value!r}: cannot read {path}: {exc}") from exc
    return parse_registry(text, str(path), num_clients)


def record_node(path: Path, client_id: int, max_num_examples: int, node: str = "") -> None:
    """Add (or replace) client ``client_id``'s row of the registry at ``path`` (created with its header)."""
    import csv
    import io

    if client_id < 0 or max_num_examples <= 0:
        raise DataError(f"client id {client_id} must be >= 0 and max_num_examples {max_num_examples} > 0")
    rows: list[dict[str, str]] = []
    if path.is_file():
        reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
        rows = [r for r in reader if (r.get("client_id") or "").strip() != str(client_id)]
    rows.append({"client_id": str(client_id), "max_num_examples": str(max_num_examples), "node": node})
    rows.sort(key=lambda r: (not r["client_id"].isdigit(), int(r["client_id"]) if r["client_id"].isdigit() else 0))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(REGISTRY_COLUMNS), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue(), encoding="utf-8")


def _server_file(value: str, key: str, what: str) -> Path:
    """A server-side file named by a config key: ``~`` is the server's home; a relative path is taken against the
    working directory, then the app folder (as config files are)."""
    from fedapps.config import APP_DIR

    p = Path(os.path.expanduser(str(value)))
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, APP_DIR / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise DataError(
        f"{key}={value!r}: no such file on the server (looked at: {', '.join(str(c) for c in candidates)}); give {what}"
    )


STAND_IN_INFO = (10, (3, 32, 32))  # classes and shape of a model built only to check its structure (see spec_info)


def spec_info(spec: Mapping[str, Any], stand_in: bool = False) -> tuple[int, tuple[int, int, int]]:
    """(num_classes, input shape) of a data spec: the source's, or, under ``nodes``, what the server learnt from the
    nodes (``num_classes`` / ``input_shape``; a DataError before that, or with ``stand_in`` the placeholder
    :data:`STAND_IN_INFO` for config checks of a model's structure, which run before the nodes are asked)."""
    from .sources import source_info

    if spec.get("source") != NODES:
        return source_info(
            str(spec["source"]),
            int(spec.get("synthetic_classes", 10)),
            tuple(spec.get("synthetic_shape", (3, 32, 32))),
            root=spec.get("root"),
            download=bool(spec.get("download", False)),
        )
    k, shape = int(spec.get("num_classes", 0) or 0), list(spec.get("input_shape", []) or [])
    if (k < 1 or len(shape) != 3) and stand_in:
        return STAND_IN_INFO
    if k < 1 or len(shape) != 3:
        raise DataError(
            "data.source='nodes': the class count and input shape are not known yet; the server learns "
            "them from the nodes before round 1 (or set data.num_classes and data.input_shape)"
        )
    return k, (int(shape[0]), int(shape[1]), int(shape[2]))


# ------------------------------------------------------------------ the server's view of the nodes' counts

_DESCRIBED: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def set_described_counts(key: str, train_counts: np.ndarray, eval_counts: np.ndarray) -> None:
    """Per-client class counts the nodes reported (clients × classes): the server federation of the spec with
    canonical key ``key`` carries them (partition statistics, cwFedAvg's diagnostics)."""
    with _LOCK:
        _DESCRIBED[key] = (np.asarray(train_counts, dtype=np.int64), np.asarray(eval_counts, dtype=np.int64))


def described_counts(key: str) -> tuple[np.ndarray, np.ndarray] | None:
    with _LOCK:
        return _DESCRIBED.get(key)
