"""Aggregation helpers several strategies share: the sample-weighted mean of client arrays
(:func:`weighted_average`), the (robust) mean of the replies that match the model a round sent
(:func:`average_matching`, :mod:`fedapps.server.robust`) and the median clip of a personalising strategy's replies
(:func:`clip_replies_to_median`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedapps.server.robust import AggregationRule, clip_to_median, clip_update, combine
from fedapps.wire.protocol import ClientReply

log = logging.getLogger("fedapps")


def weighted_average(arrays: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Σ_i w_i·a_i / Σ_i w_i per key (float arrays); integer arrays (e.g. BN counters) take the first client's."""
    if not arrays:
        raise ValueError("nothing to average")
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError("weights must sum to a positive number")
    w = w / w.sum()
    out: dict[str, np.ndarray] = {}
    for key, first in arrays[0].items():
        if np.issubdtype(first.dtype, np.floating):
            acc = np.zeros(first.shape, dtype=np.float64)
            term = np.empty_like(acc)  # w_i·a_i, written in place: one buffer per key, not one per client
            for wi, a in zip(w, arrays):
                np.multiply(a[key], wi, out=term)  # the same products as wi * a[key]: float64 for float32 arrays
                acc += term
            out[key] = acc.astype(first.dtype)
        else:
            out[key] = first.copy()
    return out


def clip_replies_to_median(
    replies: list[ClientReply], sent: list[Mapping[str, np.ndarray]], factor: float, who: str
) -> tuple[list[ClientReply], dict[str, Any]]:
    """A personalising strategy's ``median_clip``: each reply's update (its arrays minus ``sent[i]``, the model its
    message carried) clipped to ``factor`` × the median update norm of all of them (:func:`fedapps.server.robust.
    clip_to_median`); the replies with the clipped arrays and the round's extras (the bound, how many were clipped),
    the clipping logged under ``who``."""
    clipped, bound, norms = clip_to_median([r.required_arrays for r in replies], sent, factor)
    over = [n for n in norms if n > bound]
    if over:
        log.info(
            "%s median_clip %g: %d of %d updates clipped to %.3g (largest %.3g)",
            who,
            factor,
            len(over),
            len(norms),
            bound,
            max(over),
        )
    return [dataclasses.replace(r, arrays=a) for r, a in zip(replies, clipped)], {
        "clip_bound": bound,
        "clipped": len(over),
    }


def average_matching(
    replies: list[ClientReply], current: Mapping[str, np.ndarray], rule: AggregationRule | None = None
) -> dict[str, np.ndarray]:
    """Sample-weighted mean (or ``rule``'s robust combination, :mod:`fedapps.server.robust`) of the replies whose arrays
    have exactly ``current``'s keys and shapes (others are ignored); ``current`` itself when none has. With
    ``rule.clip_update_norm`` > 0 each reply's update (its arrays minus ``current``, the model the round sent) is
    first clipped to that L2 norm (:func:`fedapps.server.robust.clip_update`). Integer arrays (e.g. BN counters) take
    the
    first client's, as in :func:`weighted_average`. The result has ``current``'s dtypes, whatever a reply's."""
    usable = [
        r
        for r in replies
        if r.arrays is not None
        and set(r.arrays) == set(current)
        and all(np.shape(r.arrays[k]) == np.shape(v) for k, v in current.items())
    ]
    if not usable:
        return dict(current)
    arrays = [r.required_arrays for r in usable]
    if rule is not None and rule.clip_update_norm > 0:
        clipped = [clip_update(a, current, rule.clip_update_norm) for a in arrays]
        arrays = [a for a, _ in clipped]
        over = [norm for _, norm in clipped if norm > rule.clip_update_norm]
        if over:
            log.info(
                "clip_update_norm %g: %d of %d updates clipped (largest norm %.3g)",
                rule.clip_update_norm,
                len(over),
                len(arrays),
                max(over),
            )
    weights = [r.num_examples for r in usable]
    if rule is not None and rule.method == "trimmed-mean" and int(rule.trim_fraction * len(arrays)) == 0:
        log.warning(
            "trimmed-mean: %d replies and strategy.trim_fraction %g trim no client this time (the config's "
            "cohort would); the unweighted mean of the %d is used",
            len(arrays),
            rule.trim_fraction,
            len(arrays),
        )
    if rule is None or rule.plain:
        out = weighted_average(arrays, weights)
    else:
        out = {}
        for key, value in current.items():
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                out[key] = combine(np.stack([a[key] for a in arrays]), weights, rule)
            else:
                out[key] = np.array(arrays[0][key], copy=True)
    return {k: np.asarray(out[k]).astype(np.asarray(v).dtype, copy=False) for k, v in current.items()}
