"""Arrays on the wire: Flower's ``Array`` as .npy bytes, each header made and read once (:func:`npy_array`,
:func:`npy_values`), named arrays to and from an ``ArrayRecord``, several models packed in one record
(:func:`pack_models`), the compact transport ``strategy.transport`` (:func:`encode_arrays`, :func:`from_wire`) and
metrics as a ``MetricRecord``."""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord

from fedapps.config import TRANSPORTS

log = logging.getLogger("fedapps")


def pack_models(models: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """K state dicts -> one dict with keys 'm<k>.<name>' (several models in one message, ``arrays.multi``)."""
    return {f"m{k}.{name}": value for k, model in enumerate(models) for name, value in model.items()}


def arrays_record(arrays: Mapping[str, np.ndarray], transport: str = "float32") -> ArrayRecord:
    """Named numpy arrays -> ArrayRecord (order kept, shapes kept: a 0-d array such as BatchNorm's
    ``num_batches_tracked`` stays 0-d; ``np.ascontiguousarray`` would make it shape (1,)), floating arrays
    encoded for ``transport`` (:func:`encode_arrays`; float32: as they are), each by :func:`npy_array`."""
    return ArrayRecord({k: npy_array(v) for k, v in encode_arrays(arrays, transport).items()})


# ---------------------------------------------------------------------- .npy bytes, each header made and read once
# Flower's Array holds an array as the bytes np.save writes (an .npy header, then the values in C order). np.save and
# np.load format and parse that header on every call (np.load through ast.literal_eval): a model's arrays carry the
# same few headers every round, so each is made and read once here, and the values are copied in and out directly.
NPY_STYPE = "numpy.ndarray"  # Flower's serialisation type of .npy bytes (Array.from_numpy_ndarray's)
NPY_MAGIC = b"\x93NUMPY"
_NPY_CACHE_SIZE = 4096  # headers kept (each tens of bytes); past it the cache starts again
_npy_headers: dict[tuple[str, tuple[int, ...]], bytes] = {}  # (dtype.str, shape) -> the header np.save writes
_npy_layouts: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int]] = {}  # header -> what it says, the offset


def _remember(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= _NPY_CACHE_SIZE:
        cache.clear()
    cache[key] = value


def npy_array(values: np.ndarray) -> Array:
    """An Array of ``values`` exactly as Flower's ``Array.from_numpy_ndarray`` makes it (the same .npy bytes, dtype,
    shape and stype; a non-C-contiguous array is copied to C order first, 0-d arrays stay 0-d); the header of each
    dtype and shape is taken from np.save once."""
    a = contiguous(values)
    key = (a.dtype.str, tuple(a.shape))
    header = _npy_headers.get(key)
    if header is None or a.dtype.hasobject:
        buffer = io.BytesIO()
        np.save(buffer, a, allow_pickle=False)
        data = buffer.getvalue()
        _remember(_npy_headers, key, data[: len(data) - a.nbytes])
    else:
        data = b"".join((header, a.data))
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype=NPY_STYPE, data=data)


def npy_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """What the .npy header at the start of ``data`` says — shape, Fortran order, dtype — and where the values start,
    as numpy's own reader parses it (headers up to its default 10,000 bytes); ValueError when it is no .npy header.
    Each distinct header is parsed once."""
    if len(data) < 10 or data[:6] != NPY_MAGIC:
        raise ValueError("the bytes do not start with an .npy header")
    start = 10 if data[6] == 1 else 12
    offset = start + int.from_bytes(data[8:start], "little")
    key = bytes(data[:offset])
    layout = _npy_layouts.get(key)
    if layout is None:
        fh = io.BytesIO(key)
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        if fh.tell() != offset:
            raise ValueError("the .npy header's length does not match its text")
        layout = (tuple(int(d) for d in shape), bool(fortran), dtype, offset)
        _remember(_npy_layouts, key, layout)
    return layout


def npy_values(array: Array) -> np.ndarray:
    """The values of an Array as Flower's ``Array.numpy()`` reads them (a writable array of the header's dtype and
    shape), the header parsed by :func:`npy_header`; anything but plain C-order .npy bytes of the right length is
    left to ``Array.numpy()`` (which reads or refuses it as before)."""
    data = array.data
    try:
        shape, fortran, dtype, offset = npy_header(data)
    except ValueError:
        return array.numpy()
    count = math.prod(shape)
    if array.stype != NPY_STYPE or fortran or dtype.hasobject or len(data) - offset != count * dtype.itemsize:
        return array.numpy()
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()


def record_values(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord's arrays by name (:func:`npy_values`), in the record's order."""
    return {k: npy_values(v) for k, v in record.items()}


# ---------------------------------------------------------------------- compact transport (strategy.transport)
# A message whose model arrays travel compactly says so in its config (``arrays.transport``, Request.transport);
# the client then returns its arrays the same way. float32: every array travels in its own dtype (no key is added:
# messages as before).
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504: beyond it a float16 cast gives inf


def check_transport(transport: str) -> None:
    """Refuse an unknown transport (a message from another version, or a typo in a direct call)."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"unknown array transport '{transport}'; allowed: {', '.join(TRANSPORTS)} (config key strategy.transport)"
        )


def encode_arrays(arrays: Mapping[str, np.ndarray], transport: str) -> dict[str, np.ndarray]:
    """Arrays as they travel: with ``float16`` every floating array wider than float16 is cast to float16;
    integer arrays (BatchNorm's ``num_batches_tracked``) are left alone. An array the cast would not keep
    finite (some |x| > 65504, or already non-finite) travels in its own dtype instead, with a warning naming
    it (the receiver's validation still rejects non-finite values). ``float32``: the arrays as they are."""
    check_transport(transport)
    if transport == "float32":
        return dict(arrays)
    out: dict[str, np.ndarray] = {}
    kept: list[str] = []
    for k, v in arrays.items():
        a = np.asarray(v)
        if a.dtype.kind == "f" and a.dtype.itemsize > 2:
            if a.size == 0 or (np.isfinite(a).all() and float(np.abs(a).max()) <= FLOAT16_MAX):
                a = a.astype(np.float16)
            else:
                kept.append(k)
        out[k] = a
    if kept:
        log.warning(
            "transport float16: %d array(s) exceed float16's range (|x| > %g) or are not finite; sent in "
            "their own dtype: %s",
            len(kept),
            FLOAT16_MAX,
            ", ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""),
        )
    return out


def from_wire(value: np.ndarray, dtype: Any) -> np.ndarray:
    """A received array in the receiver's ``dtype``: a float16 array is cast up to a wider floating ``dtype`` (the
    model's); anything else is returned as it came."""
    a = np.asarray(value)
    target = np.dtype(dtype)
    if a.dtype == np.float16 and target.kind == "f" and target.itemsize > 2:
        return a.astype(target)
    return a


def contiguous(value: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape and dtype (0-d included)."""
    a = np.asarray(value)
    return a if a.flags.c_contiguous else a.copy(order="C")


def metrics_record(metrics: Mapping[str, Any]) -> MetricRecord:
    """Metrics dict -> MetricRecord (numpy scalars converted)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, (list, tuple, np.ndarray)):
            vals = [x.item() if hasattr(x, "item") else x for x in v]
            out[k] = [float(x) for x in vals] if any(isinstance(x, float) for x in vals) else [int(x) for x in vals]
        elif isinstance(v, (bool, np.bool_)):
            out[k] = int(v)
        elif isinstance(v, (int, np.integer)):
            out[k] = int(v)
        else:
            out[k] = float(v)
    return MetricRecord(out)
