"""Robust aggregation of client arrays (pure functions): coordinate-wise median, trimmed mean, weight capping,
update-norm clipping.

Chosen by ``strategy.aggregation`` (mean | median | trimmed-mean), ``strategy.trim_fraction``,
``strategy.max_weight_share`` and ``strategy.clip_update_norm`` for the strategies that average parameters with
:func:`fedapps.server.aggregation.average_matching` (FedAvg, FedProx, Ditto, FedPer, FedRep, FedBABU, IFCA, CFL).

- ``mean``: the sample-weighted mean; weights are the clients' ``num-examples``, normalised, then capped by
  :func:`cap_weights` when ``max_weight_share`` < 1. Under ``data.source: nodes`` without an operator's node registry
  (``data.node_registry``) every ``num-examples`` is the node's own unverifiable claim, so the cap is on by default:
  at most :func:`nodes_weight_cap` = min(0.5, 2/k) for a cohort of k clients (no client above half the weight, nor
  above twice an equal share), or the configured cap where that is lower (:meth:`AggregationRule.for_run`).
- ``median``: the coordinate-wise median over clients, unweighted (as Flower's ``FedMedian``).
- ``trimmed-mean``: per coordinate, drop the ``floor(trim_fraction·k)`` smallest and largest of the k client
  values and average the rest, unweighted (as Flower's ``FedTrimmedAvg``); with ``floor(trim_fraction·k) = 0``
  it is the plain unweighted mean. The config refuses a fraction that trims nobody at the round's cohort size
  (:func:`fedapps.config.check_trim`).
- ``clip_update_norm`` > 0 (with any of the three): before they are combined, each client's UPDATE — its arrays
  minus the model the round sent it — is scaled down to that L2 norm where it is longer (:func:`clip_update`;
  the norm over all floating arrays together). ``max_weight_share`` bounds how much one client's update COUNTS;
  this bounds how LARGE it can be.

:func:`clip_to_median` is the scale-free form the personalising strategies offer as their robust option
(``median_clip`` of cwFedAvg, IFCA and pFedHN): each update clipped to a multiple of the round's median update
norm, so that no client moves what other clients receive further than the cohort's typical client does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedapps.config import AGGREGATION_RULES, cohort_size

log = logging.getLogger("fedapps")

__all__ = [
    "AGGREGATION_RULES",
    "AggregationRule",
    "nodes_weight_cap",
    "cap_weights",
    "coordinate_median",
    "trimmed_mean",
    "combine",
    "update_norm",
    "clip_update",
    "scale_update",
    "median_bound",
    "clip_to_median",
]


@dataclass(frozen=True)
class AggregationRule:
    """How client arrays are combined (see the module docstring)."""

    method: str = "mean"
    trim_fraction: float = 0.1
    max_weight_share: float = 1.0
    clip_update_norm: float = 0.0  # 0: updates are not clipped

    @classmethod
    def from_config(cls, strategy_cfg) -> AggregationRule:
        return cls(
            strategy_cfg.aggregation,
            float(strategy_cfg.trim_fraction),
            float(strategy_cfg.max_weight_share),
            float(strategy_cfg.clip_update_norm),
        )

    @classmethod
    def for_run(cls, cfg) -> AggregationRule:
        """The rule of an experiment config: :meth:`from_config`, with the weight cap of deployments whose nodes
        bring their own data and no registry vouches for their sizes (see the module docstring)."""
        from fedapps.data.nodes import NODES

        rule = cls.from_config(cfg.strategy)
        d, s = cfg.data, cfg.strategy
        if d.source != NODES or getattr(d, "node_registry", "") or rule.method != "mean":
            return rule
        cap = nodes_weight_cap(cohort_size(d.num_clients, s.fraction, s.min_clients))
        if cap >= rule.max_weight_share:
            return rule
        log.info(
            "data.source nodes without data.node_registry: each client's weight capped at %g (min(0.5, 2/cohort); "
            "strategy.max_weight_share is %g)",
            cap,
            rule.max_weight_share,
        )
        return dataclasses.replace(rule, max_weight_share=cap)

    @property
    def plain(self) -> bool:
        """The plain sample-weighted mean (no capping; updates may still be clipped before it)."""
        return self.method == "mean" and self.max_weight_share >= 1.0


NODES_MAX_SHARE = 0.5  # data.source nodes without a registry: no client above half the weight ...
NODES_EQUAL_SHARES = 2  # ... nor above twice an equal share of the cohort


def nodes_weight_cap(cohort: int) -> float:
    """The default weight cap when the nodes' sizes are their own claims: min(0.5, 2/cohort)."""
    return min(NODES_MAX_SHARE, NODES_EQUAL_SHARES / max(1, int(cohort)))


def cap_weights(weights, max_share: float) -> np.ndarray:
    """Normalised weights with no share above ``max_share``; the excess goes to the others in proportion.

    The rule: normalise w to sum 1; while some uncapped weight exceeds ``max_share``, fix every such weight at
    ``max_share`` and rescale the uncapped ones so that all sum to 1 (repeat, since rescaling may push another
    above the cap). The result is w'_i = min(max_share, λ·w_i) with the λ >= 1 that makes Σ w' = 1. Where
    k·max_share < 1 (k clients) no such weights exist: every client gets 1/k. Where every uncapped weight is 0
    (no λ can lift it), the uncapped clients share the excess equally. ``max_share`` >= 1: no cap.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative and sum to a positive number, got {w}")
    w = w / w.sum()
    if max_share >= 1.0:
        return w
    if max_share <= 0:
        raise ValueError(f"max_share must be in (0, 1], got {max_share}")
    k = w.size
    if k * max_share <= 1.0:
        return np.full(k, 1.0 / k)
    capped = np.zeros(k, dtype=bool)
    for _ in range(k):
        free = ~capped
        rest = 1.0 - max_share * capped.sum()
        free_sum = w[free].sum()  # zero when every uncapped client had weight 0: they share the rest equally
        spread = w * rest / free_sum if free_sum > 0 else np.full(k, rest / free.sum())
        scaled = np.where(capped, max_share, spread)
        over = free & (scaled > max_share)
        if not over.any():
            return scaled
        capped |= over
    return np.where(capped, max_share, w * (1.0 - max_share * capped.sum()) / max(w[~capped].sum(), 1e-300))


def coordinate_median(stack: np.ndarray) -> np.ndarray:
    """Median over axis 0 (clients), coordinate by coordinate."""
    return np.median(np.asarray(stack, dtype=np.float64), axis=0)


def trimmed_mean(stack: np.ndarray, trim_fraction: float) -> np.ndarray:
    """Mean over axis 0 after dropping the floor(trim_fraction·k) lowest and highest values per coordinate."""
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    x = np.sort(np.asarray(stack, dtype=np.float64), axis=0)
    k = x.shape[0]
    cut = int(trim_fraction * k)
    return x[cut : k - cut].mean(axis=0)


def combine(stack: np.ndarray, weights, rule: AggregationRule) -> np.ndarray:
    """One array from clients×shape by ``rule`` (float64)."""
    stack = np.asarray(stack, dtype=np.float64)
    if rule.method == "median":
        return coordinate_median(stack)
    if rule.method == "trimmed-mean":
        return trimmed_mean(stack, rule.trim_fraction)
    if rule.method != "mean":
        raise ValueError(f"unknown aggregation '{rule.method}'; allowed: {', '.join(AGGREGATION_RULES)}")
    w = cap_weights(weights, rule.max_weight_share)
    return np.tensordot(w, stack, axes=1)


def update_norm(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """L2 norm of ``arrays − reference`` over every floating array together (float64): sqrt(Σ_k ‖a_k − r_k‖²)."""
    total = 0.0
    for key, ref in reference.items():
        ref = np.asarray(ref)
        if np.issubdtype(ref.dtype, np.floating):
            delta = np.asarray(arrays[key], dtype=np.float64) - ref.astype(np.float64)
            total += float(np.dot(delta.ravel(), delta.ravel()))
    return float(np.sqrt(total))


def clip_update(
    arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], max_norm: float
) -> tuple[dict[str, np.ndarray], float]:
    """``reference + s·(arrays − reference)`` with s = min(1, max_norm / ‖arrays − reference‖) on the floating
    arrays (integer arrays as they are), and the update's norm before clipping. An update within the norm comes
    back unchanged; ``max_norm`` <= 0: no clipping."""
    norm = update_norm(arrays, reference)
    if max_norm <= 0 or norm <= max_norm:
        return dict(arrays), norm
    return scale_update(arrays, reference, max_norm / norm), norm


def scale_update(
    arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], scale: float
) -> dict[str, np.ndarray]:
    """``reference + scale·(arrays − reference)`` on the floating arrays (computed in float64, returned in each
    array's own dtype); integer arrays as they are."""
    out: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        ref = np.asarray(reference[key])
        if np.issubdtype(ref.dtype, np.floating):
            r64 = ref.astype(np.float64)
            out[key] = (r64 + scale * (np.asarray(value, dtype=np.float64) - r64)).astype(np.asarray(value).dtype)
        else:
            out[key] = value
    return out


def median_bound(norms, factor: float) -> float:
    """``factor`` × the median of ``norms``: the longest update a client may send when no client may move the
    model more than ``factor`` times as far as the cohort's typical client (the median resists a minority)."""
    norms = np.asarray(norms, dtype=np.float64)
    if norms.ndim != 1 or norms.size == 0 or np.any(~np.isfinite(norms)) or np.any(norms < 0):
        raise ValueError(f"norms must be a non-empty list of finite non-negative numbers, got {norms}")
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    return float(factor * np.median(norms))


def clip_to_median(
    arrays: list[Mapping[str, np.ndarray]], references: list[Mapping[str, np.ndarray]], factor: float
) -> tuple[list[dict[str, np.ndarray]], float, list[float]]:
    """Each client's update (``arrays[i] − references[i]``, over the reference's keys: what the client was sent)
    scaled down to at most :func:`median_bound` of the cohort's update norms; returns the clipped arrays, the
    bound and the norms before clipping. An update within the bound comes back unchanged (the same values)."""
    if len(arrays) != len(references):
        raise ValueError(f"{len(arrays)} clients' arrays but {len(references)} references")
    if not arrays:
        return [], 0.0, []
    norms = [update_norm(a, ref) for a, ref in zip(arrays, references)]
    bound = median_bound(norms, factor)
    out = [dict(a) if n <= bound else scale_update(a, ref, bound / n) for a, ref, n in zip(arrays, references, norms)]
    return out, bound, norms
