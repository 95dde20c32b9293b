"""Before round 1 under ``data.source: nodes``: the server learns the data from the nodes themselves.

Every connected node gets one ``describe`` message (a registered client operation,
:func:`fedapps.client.worker.describe`; no model is built, nothing is trained) and answers with its input shape, the
class count it declares, its largest label and the per-class counts of its train and evaluation splits. The replies are
validated like any other (:class:`fedapps.wire.validation.ReplyValidator`: identity, U's fingerprint when the run has U,
...); then :func:`agree` settles the federation's input shape and class count — pinned by ``data.input_shape`` /
``data.num_classes`` where the config gives them, else the nodes' majority — and refuses every node whose data do not
fit, with a readable reason. Refused nodes are excluded from the run (never sampled); the others' class counts become
partition.csv and the server federation's counts (cwFedAvg's diagnostics). Every later message carries the settled
classes and shape, so a node that joins later with data that do not fit refuses its first message.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedapps.client.worker import (
    DESCRIBE_CLASSES,
    DESCRIBE_EVAL,
    DESCRIBE_MAX_LABEL,
    DESCRIBE_OP,
    DESCRIBE_SHAPE,
    DESCRIBE_TRAIN,
)
from fedapps.flower.connect import wait_for_clients
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import Rejection, ReplyValidator, max_eval_count

log = logging.getLogger("fedapps")

PHASE = "describe"  # the phase name of rejections.csv rows (round 0)


@dataclass(frozen=True)
class NodeReport:
    """One node's description of its data."""

    node_id: int
    client_id: int
    shape: tuple[int, ...]
    declared: int  # 0: none declared
    max_label: int
    train: tuple[int, ...]
    eval: tuple[int, ...]


@dataclass
class Description:
    """What the describe phase settled: classes, shape, the accepted nodes' reports, the refused nodes."""

    num_classes: int
    input_shape: tuple[int, int, int]
    reports: list[NodeReport]
    rejections: list[Rejection] = field(default_factory=list)
    excluded: set[int] = field(default_factory=set)
    asked: int = 0

    def counts(self, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
        """clients × classes sample counts of the train and evaluation splits (zero rows: not described)."""
        train = np.zeros((num_clients, self.num_classes), dtype=np.int64)
        evaluation = np.zeros((num_clients, self.num_classes), dtype=np.int64)
        for r in self.reports:
            train[r.client_id] = fit_counts(r.train, self.num_classes)
            evaluation[r.client_id] = fit_counts(r.eval, self.num_classes)
        return train, evaluation

    def partition_rows(self, eval_split: str) -> list[dict[str, Any]]:
        """partition.csv rows (as ``Federation.stats_rows``) of the described clients."""
        rows = []
        for r in sorted(self.reports, key=lambda r: r.client_id):
            for split, counts in (("train", r.train), (eval_split, r.eval)):
                c = fit_counts(counts, self.num_classes)
                rows.append(
                    {
                        "client": r.client_id,
                        "split": split,
                        "node_id": r.node_id,
                        "total": int(c.sum()),
                        **{f"class_{k}": int(v) for k, v in enumerate(c)},
                    }
                )
        return rows

    def summary(self) -> dict[str, Any]:
        """summary.json's account of the describe phase."""
        return {
            "nodes_described": len(self.reports),
            "nodes_asked": self.asked,
            "nodes_refused": [r.row() for r in self.rejections],
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
        }


def fit_counts(counts: Iterable[int], k: int) -> np.ndarray:
    """A node's per-class counts (its own length) as a length-``k`` vector (labels >= k were refused before)."""
    c = np.asarray(list(counts), dtype=np.int64)[:k]
    return np.pad(c, (0, k - c.size))


def report_of(r: ClientReply, eval_share: float | None = None) -> NodeReport:
    """The describe metrics of an accepted reply (ValueError when they are missing or malformed). ``eval_share``
    (:func:`fedapps.wire.validation.evaluation_share`): the evaluation counts must not exceed what the data spec's
    split gives beside the training counts (:func:`fedapps.wire.validation.max_eval_count`), whose sum is
    ``num-examples``, itself within the node registry's cap where there is one."""
    m = r.metrics

    def ints(key: str) -> tuple[int, ...]:
        value = m.get(key)
        values: list[Any] = value if isinstance(value, list) else [value]
        if value is None or any(not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < -1 for v in values):
            raise ValueError(f"describe reply lacks a valid '{key}' (got {value!r})")
        return tuple(int(v) for v in values)

    shape = ints(DESCRIBE_SHAPE)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"describe reply: '{DESCRIBE_SHAPE}' must be [C, H, W], got {list(shape)}")
    train, evaluation = ints(DESCRIBE_TRAIN), ints(DESCRIBE_EVAL)
    if min(train + evaluation) < 0:
        raise ValueError("describe reply: negative class counts")
    if sum(train) != r.num_examples:
        raise ValueError(f"describe reply: the training counts sum to {sum(train)}, num-examples is {r.num_examples}")
    if eval_share is not None and sum(evaluation) > max_eval_count(sum(train), eval_share):
        raise ValueError(
            f"describe reply: {sum(evaluation)} evaluation samples beside {sum(train)} training samples; the data "
            f"split (an evaluation share of {eval_share:g}: data.test_fraction, or data.validation_fraction while "
            f"tuning) gives at most {max_eval_count(sum(train), eval_share)}"
        )
    return NodeReport(
        r.node_id, r.client_id, shape, ints(DESCRIBE_CLASSES)[0], ints(DESCRIBE_MAX_LABEL)[0], train, evaluation
    )


def agree(
    reports: list[NodeReport], pinned_classes: int = 0, pinned_shape: tuple[int, ...] = ()
) -> tuple[int, tuple[int, int, int], dict[int, str]]:
    """The federation's class count and input shape, and node id -> reason for every node that does not fit.

    Shape: ``pinned_shape`` if given, else the most common one (ties: the smallest). Classes: ``pinned_classes`` if
    given, else, among the nodes of that shape, the candidate count (any count a node declares, or the largest
    label + 1) that most of them fit (:func:`fits`; ties: the larger). A node is refused for another shape, another
    declared count, or a label outside the classes."""
    refused: dict[int, str] = {}
    if not reports:
        return int(pinned_classes), tuple(pinned_shape), refused  # type: ignore[return-value]
    if pinned_shape:
        shape, why_shape = tuple(int(d) for d in pinned_shape), "data.input_shape"
    else:
        tally = Counter(r.shape for r in reports)
        shape = min(tally, key=lambda s: (-tally[s], s))
        why_shape = f"{tally[shape]} of {len(reports)} nodes"
    for r in reports:
        if r.shape != shape:
            refused[r.node_id] = (
                f"input shape {list(r.shape)} (C, H, W) differs from the federation's {list(shape)} "
                f"({why_shape}); give this node data of that shape"
            )
    fitting = [r for r in reports if r.node_id not in refused]
    if pinned_classes:
        k, why_k = int(pinned_classes), "data.num_classes"
    else:
        # candidates: every declared count, and the largest label + 1; the one most nodes fit wins (ties: larger)
        candidates = {r.declared for r in fitting if r.declared} | {max(r.max_label for r in fitting) + 1}
        support = {v: sum(1 for r in fitting if fits(r, v)) for v in candidates}
        k = max(support, key=lambda v: (support[v], v))
        why_k = f"the count {support[k]} of {len(fitting)} nodes fit"
    for r in fitting:
        if r.declared and r.declared != k:
            refused[r.node_id] = (
                f"declares {r.declared} classes, the federation has {k} ({why_k}); fix the node's "
                "class sub-folders / the .npz's num_classes, or node config num-classes"
            )
        elif r.max_label >= k:
            refused[r.node_id] = (
                f"label {r.max_label} is outside the federation's {k} classes ({why_k}); fix the node's labels"
            )
    return k, shape, refused  # type: ignore[return-value]


def fits(r: NodeReport, k: int) -> bool:
    """Whether a node's data fit ``k`` classes: the count it declares is ``k``, or (none declared) its labels < k."""
    return r.declared == k if r.declared else r.max_label < k


def describe_drafts(
    node_ids: Iterable[int], setup: protocol.Setup, public: protocol.PublicSet = protocol.PublicSet()
) -> list[protocol.Draft]:
    """One describe message (its draft) per node: the data spec and model (and U's fingerprint, when the run has U),
    nothing to keep."""
    request = protocol.Request(
        ops=(DESCRIBE_OP,), round=0, setup=setup, public=public, keep=protocol.Keep(persist=False, save=False)
    )
    return [protocol.Draft(int(n), request, message_type=protocol.QUERY_MESSAGE_TYPE) for n in node_ids]


def describe_nodes(
    grid: Any,
    setup: protocol.Setup,
    num_clients: int,
    timeout: float,
    validator: ReplyValidator,
    pinned_classes: int = 0,
    pinned_shape: tuple[int, ...] = (),
    wanted: int = 1,
    wait_seconds: float = 120.0,
    public: protocol.PublicSet = protocol.PublicSet(),
    eval_share: float | None = None,
) -> Description:
    """Ask every connected node (after waiting for ``wanted``) to describe its data; settle classes and shape
    (:func:`agree`); refuse what does not fit. ``setup``: the data spec and model the messages carry; ``public``: U's
    fingerprint, when the run has U. ``validator`` checks the replies and binds node <-> client (the caller hands
    the bindings of the accepted nodes on to the run's validator); ``eval_share``: the data spec's evaluation share,
    which bounds each node's evaluation counts by its training counts (:func:`report_of`)."""
    nodes = wait_for_clients(grid, wanted, wait_seconds)
    if not nodes:
        raise RuntimeError("data.source 'nodes': no node is connected to describe its data")
    drafts = describe_drafts(nodes, setup, public)
    validator.expect(drafts)
    replies = list(grid.send_and_receive(protocol.build_messages(drafts), timeout=timeout))
    outcome = validator.validate_batch(0, replies, protocol.QUERY_MESSAGE_TYPE)
    rejections = [Rejection(0, PHASE, r.node_id, r.client_id, r.reason) for r in outcome.rejections]
    reports: list[NodeReport] = []
    for r in outcome.accepted:
        try:
            reports.append(report_of(r, eval_share))
        except ValueError as exc:
            rejections.append(Rejection(0, PHASE, r.node_id, r.client_id, str(exc)))
    k, shape, refused = agree(reports, pinned_classes, pinned_shape)
    for report in reports:
        if report.node_id in refused:
            rejections.append(Rejection(0, PHASE, report.node_id, report.client_id, refused[report.node_id]))
    accepted = [r for r in reports if r.node_id not in refused]
    excluded = {int(r.node_id) for r in rejections if r.node_id is not None}
    for rej in rejections:
        log.warning("describe: node %s (client %s) refused: %s", rej.node_id, rej.client_id, rej.reason)
    if not accepted:
        reasons = "; ".join(f"node {r.node_id}: {r.reason}" for r in rejections) or "no node replied"
        raise RuntimeError(f"data.source 'nodes': no node described data the run can use ({reasons})")
    log.info(
        "describe: %d of %d nodes agree on %d classes, input shape %s (%d refused)",
        len(accepted),
        len(nodes),
        k,
        list(shape),
        len(excluded),
    )
    return Description(k, shape, accepted, rejections, excluded, asked=len(nodes))


def bind_accepted(source: ReplyValidator, target: ReplyValidator, description: Description) -> None:
    """Hand the node <-> client bindings, the reported ``num-examples`` and the described evaluation-split size of the
    accepted nodes to ``target``: where it knows no sizes of its own (deployment), every later ``num-examples`` and
    ``<tag>-n`` of that client must equal them, so the weight a client has in a sample-weighted mean is the one it
    described (within the split rules and the node registry's cap, :func:`report_of`)."""
    for r in description.reports:
        target.node_client[r.node_id] = r.client_id
        target.client_node[r.client_id] = r.node_id
        if r.client_id in source.bound_examples and target.train_sizes is None:
            target.bound_examples[r.client_id] = source.bound_examples[r.client_id]
        if target.test_sizes is None:
            target.bound_tests[r.client_id] = int(sum(r.eval))
