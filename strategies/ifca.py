"""IFCA (Ghosh et al., NeurIPS 2020): K cluster models; every client joins the one that fits its data best.

Each round every sampled client receives all K cluster models, computes each one's loss on its TRAINING data,
takes the lowest (ties: the lower index), trains it and sends it back with its choice. The chosen model (before
training) is the client's deployed model: after round r, the model of lowest training loss among round r's K. The
server averages, per
cluster, the models of the clients that chose it (by sample count); a cluster nobody chose keeps its model.
The K models start from different seeds (the experiment seed + k) so that they can separate. No model stays
on the client. Download cost: K models per client per round.

Robust option ``median_clip`` (off by default): a cluster model is the mean of its choosers' models, so one scaled
model drags every client of its cluster with it (and a cluster nobody else can fit). With ``median_clip`` = c > 0
each reply's update (its model minus the cluster model it chose, as sent) is first clipped to c × the round's median
update norm over every reply of every cluster (:func:`fedapps.server.robust.clip_to_median`). It works beside
``strategy.aggregation`` / ``clip_update_norm`` (applied after it, per cluster).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedapps.client import ops
from fedapps.client.registry import client_op
from fedapps.config import ExperimentConfig
from fedapps.params import param
from fedapps.server.aggregation import average_matching, clip_replies_to_median
from fedapps.server.robust import AggregationRule
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies.fedavg import initial_model_arrays

log = logging.getLogger("fedapps")

CHOICE = "ifca-choice"  # the metric a client reports its chosen cluster in
LOSSES = "ifca-losses"  # ... and every cluster model's training loss

# --------------------------------------------------------------------------- client side


@client_op("select-model")
def select_model(w, tag: str) -> None:
    """Of the K models in the message, load the one with the lowest loss on the local TRAIN data (ties: lower k)."""
    candidates = w.candidate_models("select-model")
    losses = ops.losses_of(w.model, candidates, w.train_x, w.train_y)
    best = int(np.argmin(losses))
    w.model.load_state_dict(candidates[best], strict=True)
    w.metrics[CHOICE] = best
    w.metrics[LOSSES] = [float(v) for v in losses]


# --------------------------------------------------------------------------- server side


def average_per_cluster(
    models: list[dict[str, np.ndarray]], replies: list[ClientReply], rule: AggregationRule | None = None
) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """New cluster models (each the sample-weighted mean of its choosers' models, or unchanged) and sizes."""
    out, sizes = [], []
    for k, current in enumerate(models):
        chosen = [r for r in replies if int(r.metrics[CHOICE]) == k]
        sizes.append(len(chosen))
        out.append(average_matching(chosen, current, rule))
    return out, sizes


def clip_choosers(
    models: list[dict[str, np.ndarray]], replies: list[ClientReply], factor: float
) -> tuple[list[ClientReply], dict[str, Any]]:
    """The replies with each update (arrays minus the cluster model it chose) clipped to ``factor`` × the median
    update norm of all of them (:func:`fedapps.server.robust.clip_to_median`); the bound and the count clipped."""
    return clip_replies_to_median(replies, [models[int(r.metrics[CHOICE])] for r in replies], factor, "IFCA")


@dataclass
class IFCAParams:
    """IFCA's parameters."""

    clusters: int = param(2, ge=1, help="K: the number of cluster models")
    median_clip: float = param(
        0.0,
        ge=0,
        help="robust option, 0 = off: each update (the returned model minus the "
        "cluster model it chose) is clipped to this multiple of the round's "
        "median update norm before the clusters are averaged (e.g. 2)",
    )


class IFCA(PersonalisedStrategy):
    """Iterative federated clustering by lowest training loss."""

    name = "ifca"
    sample_privacy_refused = (
        "each client picks its cluster's model by every model's loss on its training data, "
        "without noise, and the choice shows in what it returns"
    )
    robust_aggregation = True
    Params = IFCAParams
    deployed = DeployedModel(
        "the model of client i's cluster after round r: of round r's K cluster models, the one "
        "of lowest loss on its training split",
        source="message",
        prepare=("select-model",),
    )

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: IFCAParams) -> None:
        super().check_config(cfg, params)
        cls.require_at_most_clients(cfg, "clusters", params.clusters)

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.models = [initial_model_arrays(cfg, seed=cfg.seed + k) for k in range(self.params.clusters)]
        self.assignment: dict[int, int] = {}  # client id -> cluster chosen last

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            ["select-model", "train"],
            load=protocol.Load(into_model=False, multi=True),
            keep=protocol.Keep(persist=False),
            returns=protocol.Return(arrays=True, part="state"),
        )
        arrays = protocol.pack_models(self.models)
        return [protocol.Draft(n, request, arrays=arrays) for n in node_ids]

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        keys = set(self.models[0])
        usable = []
        for r in replies:
            choice = r.metrics.get(CHOICE)
            if (
                r.arrays is None
                or set(r.arrays) != keys
                or isinstance(choice, (bool, list))
                or choice is None
                or float(choice) != int(choice)
                or not 0 <= int(choice) < len(self.models)
            ):
                self.replies.skip_reply(server_round, r, "no valid model or cluster choice")
                continue
            usable.append(r)
            self.assignment[r.client_id] = int(choice)
        extra: dict[str, Any] = {}
        if usable and self.params.median_clip > 0:
            usable, extra = clip_choosers(self.models, usable, float(self.params.median_clip))
        self.models, sizes = average_per_cluster(self.models, usable, self.rule)
        log.info("round %d: IFCA cluster sizes %s", server_round, sizes)
        return {"clusters": sum(1 for s in sizes if s), "cluster_sizes": " ".join(str(s) for s in sizes), **extra}

    def final_summary(self) -> dict[str, Any]:
        return {"cluster_assignment": {str(c): k for c, k in sorted(self.assignment.items())}}
