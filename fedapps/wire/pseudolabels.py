"""Pseudo-labels on the wire and on the server: encodings, aggregation, temperature.

Encodings (both directions): ``float32`` and ``float16`` soft labels (|U|×M), and ``hard`` labels
(|U| class indices in the smallest unsigned integer type that holds M classes plus an abstain marker).
"""

from __future__ import annotations

import numpy as np

ENCODINGS = ("float32", "float16", "hard")
AGGREGATIONS = ("mean", "median", "max")


def label_dtype(num_classes: int) -> np.dtype:
    """Smallest unsigned integer type holding 0..num_classes (num_classes itself marks 'abstain')."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if num_classes <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def encode(values: np.ndarray, encoding: str, num_classes: int) -> np.ndarray:
    """Soft labels (n×M) or hard labels (n,) -> wire array. Soft input to 'hard' takes the argmax."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown pseudo-label encoding '{encoding}'; allowed: {', '.join(ENCODINGS)}")
    if encoding == "hard":
        labels = values.argmax(axis=-1) if values.ndim == 2 else values
        if labels.size and (labels.min() < 0 or labels.max() > num_classes):
            raise ValueError(f"hard labels must be in [0, {num_classes}] ({num_classes} = abstain)")
        return labels.astype(label_dtype(num_classes))
    if values.ndim != 2 or values.shape[1] != num_classes:
        raise ValueError(f"soft labels must have shape (n, {num_classes}), got {values.shape}")
    return values.astype(np.float16 if encoding == "float16" else np.float32)


def decode(wire: np.ndarray, num_classes: int) -> np.ndarray:
    """Wire array -> float32 soft labels (n×M) or int64 hard labels (n,), by dtype."""
    if np.issubdtype(wire.dtype, np.integer):
        return wire.astype(np.int64)
    return wire.astype(np.float32)


def one_hot(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Hard labels (n,) -> one-hot float32 (n×M); the abstain marker (= M) becomes an all-zero row."""
    out = np.zeros((len(labels), num_classes + 1), dtype=np.float32)
    out[np.arange(len(labels)), labels] = 1.0
    return out[:, :num_classes]


def soft_labels(wire: np.ndarray, num_classes: int) -> np.ndarray:
    """A client's predictions on U (already checked by the reply validator) as float32 soft labels (n×M): hard
    labels one-hot, probabilities clipped at 0 (the validator lets entries down to -1e-3 through)."""
    decoded = decode(wire, num_classes)
    if np.issubdtype(wire.dtype, np.integer):
        return one_hot(decoded, num_classes)
    return np.clip(decoded, 0.0, None)


def apply_temperature(probs: np.ndarray, temperature: float) -> np.ndarray:
    """p^(1/T) renormalised; T = 0 -> one-hot of the argmax; T = 1 leaves p unchanged."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return one_hot(probs.argmax(axis=-1), probs.shape[-1])
    if temperature == 1:
        return probs
    logp = np.log(np.clip(probs, 1e-12, None)) / temperature
    logp -= logp.max(axis=-1, keepdims=True)
    p = np.exp(logp)
    return (p / p.sum(axis=-1, keepdims=True)).astype(np.float32)


def aggregate(stack: np.ndarray, method: str = "mean") -> np.ndarray:
    """Combine members' soft labels (members×n×M) into one target (n×M).

    mean: element-wise mean; median: element-wise median, renormalised;
    max: per sample, the distribution of the most confident member.
    """
    if stack.ndim != 3:
        raise ValueError(f"expected members×samples×classes, got shape {stack.shape}")
    if method == "mean":
        return stack.mean(axis=0)
    if method == "median":
        med = np.median(stack, axis=0)
        return med / np.clip(med.sum(axis=-1, keepdims=True), 1e-12, None)
    if method == "max":
        best = stack.max(axis=-1).argmax(axis=0)  # most confident member per sample
        return stack[best, np.arange(stack.shape[1])]
    raise ValueError(f"unknown aggregation '{method}'; allowed: {', '.join(AGGREGATIONS)}")


def clip_to_centre(stack: np.ndarray, centre: np.ndarray, max_l1: float) -> np.ndarray:
    """Members' probability rows (members×n×M) each moved towards ``centre`` (n×M) so that its L1 distance to
    the centre's row is at most ``max_l1``: c + min(1, max_l1/‖p − c‖₁)·(p − c), a point between the two rows
    (still a probability row). A member can then move the rows of an aggregate over k members by at most
    max_l1/k (mean) wherever it reports."""
    if max_l1 < 0:
        raise ValueError(f"max_l1 must be >= 0, got {max_l1}")
    stack = np.asarray(stack, dtype=np.float64)
    centre = np.asarray(centre, dtype=np.float64)
    if stack.ndim != 3 or centre.shape != stack.shape[1:]:
        raise ValueError(f"expected members×n×M and an n×M centre, got {stack.shape} and {centre.shape}")
    deviation = stack - centre[None]
    l1 = np.abs(deviation).sum(axis=-1, keepdims=True)
    scale = np.where(l1 > max_l1, max_l1 / np.where(l1 > 0, l1, 1.0), 1.0)
    return (centre[None] + scale * deviation).astype(np.float32)
