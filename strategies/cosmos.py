"""COSMOS: clustered server models with pseudo-label-only communication (model-agnostic personalised FL).

One message per client per round. Down: the pseudo-labels h_π(i)(U) of the client's cluster model (none in
round 1). On the client: distil on them (KL + λ·r_B, per-sample weight w_i(x)) → train on local data (E0
epochs in round 1) → predict on U. Up: its predictions f_i(U) and metrics only.
Server: round 1 clusters the clients once (greedy threshold clustering on distances between f_i(U)); every
round, per cluster, aggregates members' predictions (mean / median / max, temperature T) and fine-tunes
that cluster's model h_k on U towards them (KL + λ·r_B; never reset), then predicts h_k(U) for the next
round. The deployed model of client i after round r is h_π(i) after round r's server training (the paper's
protocol): every ``evaluate_every`` rounds (and after the last) the base class measures it on the client's split —
round r+1's message carries h_π(i) in its ``eval-arrays`` record, the last round's by an evaluation-only
message; those bytes are counted apart (eval_bytes_*). The client's own model is the second column.
Paper: COSMOS, ECML PKDD 2026; where we follow the reference code instead, the parameter comments say so.

Robust option ``member_clip`` (off by default). A cluster's target is its members' aggregate, so a client that joins a
victim's cluster (round 1's predictions copied from the victim's) and then sends one-hot labels of other classes
takes the victim's cluster model over (measured: victim 0.68 against 0.94 with that client dropped). With
``member_clip`` = τ > 0 every member's predictions are first moved towards the cluster's centre until no row is more
than τ away in L1 (:func:`fedapps.wire.pseudolabels.clip_to_centre`); the centre is the cluster model's own predictions
h_k(U) sent last round (round 1, before any: the members' coordinate-wise median). A member then moves its cluster's
target by at most τ/|members| per row and round (mean aggregation) and the members' pulls balance: an honest member
whose data disagree with a drifting h_k pulls back as hard as the liar pushes.

Under ``privacy.mode: client`` each cluster's target is released with client-level DP (:meth:`Cosmos.private_target`,
docs/privacy.md): the members' predictions clipped, Gaussian noise on their sum, the mean over the members sampled;
h_k and everything it sends are post-processing of it. The round-1 clustering (and a newcomer's cluster) is computed
from the raw predictions: the guarantee holds for the targets GIVEN the assignment, and does not cover the assignment.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, Context, Message
from torch import Tensor, nn

from fedapps.client import ops
from fedapps.client.registry import ProtocolError, distill_term, distill_weighting
from fedapps.config import DEVICES, OPTIMIZERS, ConfigError, ExperimentConfig
from fedapps.data import Federation, get_federation
from fedapps.models import MODEL_NAMES, build_model, seeded
from fedapps.params import param, parse_params
from fedapps.reporting.results import Artifact
from fedapps.seeds import derive_seed
from fedapps.server import client_privacy, clustering
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol, pseudolabels
from fedapps.wire.protocol import ClientReply
from strategies.pseudolabel_dropin import (
    FlowerPseudoLabelStrategy,
    TestFn,
    TrainFn,
    pseudolabel_evaluate,
    pseudolabel_train,
)

log = logging.getLogger("fedapps")

WEIGHTINGS = ("label-free", "oracle", "none")
RB_LAMBDA = "rb_lambda"  # the distill-section settings of r_B on the client (λ > 0 switches it on): distill.rb_*
RB_SIGMA = "rb_sigma"
ROUND_OPS = ("distill", "train", "predict")  # the client operations of a round message
ARCHITECTURE_RULES = ("ignore", "centre", "cluster-within")  # how clients' architectures enter the clustering


# --------------------------------------------------------------------------- client side


def frequency_weights(class_counts: np.ndarray, labels: np.ndarray) -> torch.Tensor:
    """Per-sample weight = the client's local frequency of each sample's (pseudo-)label (w_i(x))."""
    freq = class_counts / max(class_counts.sum(), 1)
    freq = np.append(freq, 0.0)  # abstain marker -> weight 0
    return torch.as_tensor(freq[np.clip(labels, 0, len(freq) - 1)], dtype=torch.float32)


def label_free(class_counts: np.ndarray, targets: np.ndarray) -> torch.Tensor:
    """w_i(x) from the server's label: the client's local frequency of the target's argmax."""
    labels = targets if targets.ndim == 1 else targets.argmax(axis=-1)
    return frequency_weights(class_counts, labels)


@distill_weighting("label-free")
def label_free_weights(w, targets: np.ndarray, rows) -> torch.Tensor:
    """w_i(x) from the server's label, on the generic client: :func:`label_free` of its training counts."""
    return label_free(w.fed.train_counts[w.client_id], targets)


@distill_weighting("oracle")
def oracle_weights(w, targets: np.ndarray, rows) -> torch.Tensor:
    """w_i(x) from U's TRUE label (reproduction of the paper's oracle variant only)."""
    if w.fed.public_y is None:
        raise ProtocolError("distill.weighting 'oracle' needs the true labels of U")
    y = w.fed.public_y if rows is None else w.fed.public_y[rows]
    return frequency_weights(w.fed.train_counts[w.client_id], y.numpy())


# --------------------------------------------------------------------------- r_B, client and server


def robustness_penalty(
    model: nn.Module,
    x: Tensor,
    logits: Tensor,
    sigma: float,
    lo: float = -1.0,
    hi: float = 1.0,
    sample_weights: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """r_B: MSE between softmax on clean and noisy inputs, gradient through the clean branch.

    Per sample the MSE over classes; averaged over the batch, weighted by w(x) when weights are given
    (objective (2) weights the whole bracket KL + λ·r_B). Without weights it equals F.mse_loss.
    The noise is drawn from ``generator`` (on its device, then moved to x's), so a seeded
    caller gets the same noise on every run and engine; without one, from torch's global RNG.
    """
    with torch.no_grad():
        noise = torch.randn(
            x.shape, generator=generator, dtype=x.dtype, device=generator.device if generator is not None else x.device
        )
        noisy = (x + sigma * noise.to(x.device)).clamp(lo, hi)
        p_noisy = F.softmax(model(noisy), dim=-1)
    per_sample = ((F.softmax(logits, dim=-1) - p_noisy) ** 2).mean(dim=-1)
    return ops.weighted_mean(per_sample, sample_weights)


def rb_term(lam: float, sigma: float, generator: torch.Generator | None = None) -> ops.DistillTerm | None:
    """λ·r_B as a distillation term of :func:`fedapps.client.ops.distill` (noise from ``generator``); None when λ =
    0."""
    if lam <= 0:
        return None
    return lambda model, x, logits, weights: (
        lam * robustness_penalty(model, x, logits, sigma, sample_weights=weights, generator=generator)
    )


def section_rb_term(section: protocol.Section, generator: torch.Generator | None) -> ops.DistillTerm | None:
    """r_B as the message's ``distill.rb_lambda`` / ``distill.rb_sigma`` ask (None when λ = 0)."""
    return rb_term(float(section.extra.get(RB_LAMBDA, 0.0)), float(section.extra.get(RB_SIGMA, 0.05)), generator)


@distill_term("rb")
def rb_client_term(w, section: protocol.Section) -> ops.DistillTerm | None:
    """r_B on the generic client (:func:`section_rb_term`, noise from the client's generator)."""
    return section_rb_term(section, w.generator)


def distill_extras(
    section: protocol.Section, class_counts: np.ndarray, generator: torch.Generator
) -> tuple[Callable[[np.ndarray], torch.Tensor | None], ops.DistillTerm | None]:
    """Objective (2)'s weights and term in the drop-in client helper, as the generic client makes them:
    ``distill.weighting`` none or label-free (:func:`label_free` of the client's counts; the oracle variant needs
    U's true labels, which a user's client does not have), r_B from ``distill.rb_*``."""
    weighting = section.weighting or "none"
    if weighting not in ("none", "label-free"):
        raise ProtocolError(
            f"distill.weighting '{weighting}' is not offered to a user's ClientApp; allowed: none, label-free"
        )
    if weighting == "none":
        return (lambda targets: None), section_rb_term(section, generator)
    return (lambda targets: label_free(class_counts, targets)), section_rb_term(section, generator)


# --------------------------------------------------------------------------- server side


@dataclass
class CosmosParams:
    """COSMOS hyper-parameters (defaults: the paper's, with the spec's label-free w_i(x) and r_B with gradient)."""

    server_model: str = param("vgg16", choices=MODEL_NAMES, help="architecture of every cluster model h_k")
    pretrain_epochs: int = param(
        5, ge=0, help="E0: local cross-entropy epochs in round 1 (later rounds use client.epochs)"
    )
    # clustering (round 1 only; clusters stay fixed)
    distance: str = param(
        "l1",
        choices=clustering.DISTANCES,
        help="l1 (paper) or l2 (reference code's Frobenius norm); both per public sample",
    )
    b0_mode: str = param(
        "auto",
        choices=clustering.B0_MODES,
        help="auto: raise B0 until at most max_clusters clusters (reference rule); fixed: use b0",
    )
    b0: float = param(0.5, ge=0, help="explicit threshold on the per-sample distance (b0_mode fixed)")
    max_clusters: int = param(5, gt=0, help="b0_mode auto: target upper bound on K")
    b0_start: float = param(0.05, ge=0, help="b0_mode auto: first B0 tried")
    b0_step: float = param(0.05, gt=0, help="b0_mode auto: B0 increment")
    # server distillation (objective 1)
    aggregation: str = param(
        "mean", choices=pseudolabels.AGGREGATIONS, help="how a cluster's members' predictions make its target"
    )
    temperature: float = param(1.0, ge=0, help="targets p^(1/T) renormalised; 0 = hard (one-hot) labels")
    member_clip: float = param(
        0.0,
        ge=0,
        le=2,
        help="robust option, 0 = off: each member's predictions moved towards "
        "the cluster's last targets h_k(U) (round 1: the members' median) "
        "until no row is further than this in L1, before they are "
        "aggregated (e.g. 0.5; rows differ by at most 2)",
    )
    rb_lambda: float = param(5.0, ge=0, help="λ of r_B, server and client")
    rb_sigma: float = param(0.05, ge=0, help="std of r_B's input noise")
    server_epochs: int = param(5, ge=0, help="epochs of each cluster model's distillation on U per round")
    server_batch_size: int = param(32, gt=0, help="minibatch size of the server distillation")
    server_lr: float = param(1e-4, gt=0, help="learning rate of the server distillation")
    server_optimizer: str = param("adam", choices=OPTIMIZERS, help="optimiser of the server distillation")
    server_clip_norm: float = param(1.0, ge=0, help="gradient-norm clipping of the server distillation; 0 = off")
    server_device: str = param(
        "auto", choices=DEVICES, help="where the cluster models train: auto (CUDA when present), cpu or cuda"
    )
    # client distillation (objective 2)
    distill_epochs: int = param(5, ge=0, help="epochs of each client's distillation on U per round")
    distill_batch_size: int = param(32, gt=0, help="minibatch size of the client distillation")
    distill_lr: float = param(1e-4, gt=0, help="learning rate of the client distillation")
    distill_optimizer: str = param("adam", choices=OPTIMIZERS, help="optimiser of the client distillation")
    distill_clip_norm: float = param(1.0, ge=0, help="gradient-norm clipping of the client distillation; 0 = off")
    weighting: str = param(
        "label-free",
        choices=WEIGHTINGS,
        help="w_i(x): label-free | none | oracle (true labels of U: reproduction only)",
    )
    # our options for mixed architectures (not the paper's; off by default): docs/algorithms/cosmos.md
    recluster_every: int = param(
        0,
        ge=0,
        help="ours, 0 = off (the paper: clusters fixed after round 1): cluster again on the round's "
        "predictions in rounds 1+k, 1+2k, ...; a new cluster continues the model of the old cluster "
        "most of its members were in",
    )
    architectures: str = param(
        "ignore",
        choices=ARCHITECTURE_RULES,
        help="ours, ignore = off (the paper): centre subtracts from every client's predictions the mean "
        "prediction of the clients of its architecture (model.per_client) before the distances; "
        "cluster-within clusters each architecture's clients apart, then joins every cluster to the "
        "nearest cluster (centred mean prediction) of the architecture with the most clusters",
    )
    # wire
    uplink_encoding: str = param("float32", choices=pseudolabels.ENCODINGS, help="client → server predictions")
    downlink_encoding: str = param("float32", choices=pseudolabels.ENCODINGS, help="server → client pseudo-labels")


soft_predictions = pseudolabels.soft_labels  # a client's checked predictions on U as soft labels (n×M)


class Cosmos(PersonalisedStrategy):
    """Clustered server models, pseudo-labels only; clients may run any architecture."""

    name = "cosmos"
    Params = CosmosParams
    needs_public_set = True
    model_agnostic = True
    moved_params = {"eval_every": "evaluate_every"}  # one meaning for every strategy, in one place
    deployed = DeployedModel(
        "the cluster model h_π(i) after round r's server training", source="server", evaluate="evaluate-received"
    )
    checkpoint_exclude = frozenset({"fed", "device", "num_classes", "n_public"})  # rebuilt from the config
    reply_kind = "predictions"
    client_privacy_refused = ""  # the cluster targets are released through ClientLevelDP under privacy.mode client

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        p: CosmosParams = self.params
        self.fed: Federation = get_federation(dataclasses.asdict(cfg.data))
        if self.fed.public_x is None:
            raise ConfigError("COSMOS needs a public set U: set data.public_fraction in (0, 1)")
        self.num_classes = self.fed.num_classes
        self.n_public = int(self.fed.public_x.shape[0])
        self.device = ops.resolve_device(p.server_device)
        self.clustering: clustering.ClusteringResult | None = None
        self.cluster_of: dict[int, int] = {}  # client id -> cluster
        self.models: dict[int, torch.nn.Module] = {}  # cluster -> h_k
        self.server_targets: dict[int, np.ndarray] = {}  # cluster -> h_k(U) probabilities (n×M)
        self.wire_targets: dict[int, ArrayRecord | None] = {}  # cluster -> encoded h_k(U), as sent
        self.distances: np.ndarray | None = None
        self.distance_clients: list[int] = []
        self.last_acc: dict[str, float] = {}
        self.pseudo_bytes_down = 0

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: CosmosParams) -> None:
        """Under sample-level privacy, the clients' distillation weights must not read their class frequencies; under
        client-level privacy, a cluster's target is its members' mean, each member clipped to privacy.clip_norm."""
        super().check_config(cfg, params)
        if cfg.privacy.mode == "sample" and params.weighting == "label-free":
            raise ConfigError(
                "'privacy.mode: sample' cannot cover cosmos with weighting 'label-free': w_i(x) reads "
                "the client's class frequencies without noise and shapes the model it then trains; set "
                "strategy.params.cosmos.weighting=none (docs/privacy.md)"
            )
        if cfg.privacy.mode == client_privacy.CLIENT_MODE and params.aggregation != "mean":
            raise ConfigError(
                f"'strategy.params.cosmos.aggregation: {params.aggregation}' under privacy.mode client: the noise is "
                "calibrated to a sum, in which one member moves the result by at most privacy.clip_norm; set "
                "aggregation to mean"
            )
        if params.architectures != "ignore" and len(set(cfg.model.per_client)) < 2:
            raise ConfigError(
                f"'strategy.params.cosmos.architectures: {params.architectures}' needs clients of at least two "
                "architectures (model.per_client, e.g. [mlp, cnn]): with one architecture it clusters as ignore "
                "does; set architectures to ignore"
            )
        if cfg.privacy.mode == client_privacy.CLIENT_MODE and params.member_clip > 0:
            raise ConfigError(
                "'strategy.params.cosmos.member_clip' under privacy.mode client: round 1 moves each member towards "
                "the members' median, so one client changes the others' contributions; privacy.clip_norm bounds "
                "each member's pull instead: set member_clip to 0"
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The generic state, with the cluster models h_k as CPU state dicts (rebuilt by :meth:`server_model`)."""
        models, self.models = self.models, {}
        try:
            state = super().state_dict()
        finally:
            self.models = models
        state["models"] = {
            k: {n: t.detach().cpu().clone() for n, t in m.state_dict().items()} for k, m in models.items()
        }
        # a checkpoint holds data, not objects (fedapps.checkpoint): the clustering's fields, the records' arrays
        state["clustering"] = None if self.clustering is None else dataclasses.asdict(self.clustering)
        state["wire_targets"] = {
            k: None if record is None else {name: record[name].numpy() for name in record}
            for k, record in self.wire_targets.items()
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        saved = state.pop("models", {})
        found = state.get("clustering")
        if found is not None:
            state["clustering"] = clustering.ClusteringResult(
                **{**found, "tried": [tuple(t) for t in found.get("tried", [])]}
            )
        state["wire_targets"] = {
            k: None if arrays is None else ArrayRecord({name: Array(a) for name, a in arrays.items()})
            for k, arrays in state.get("wire_targets", {}).items()
        }
        super().load_state_dict(state)
        self.models = {}
        for k in sorted(saved):
            self.server_model(k).load_state_dict(saved[k])

    # ------------------------------------------------------------------ messages
    def round_request(self, server_round: int) -> protocol.Request:
        """The round message's request: data/model/client spec, U's fingerprint, distil/train/predict settings."""
        p: CosmosParams = self.params
        return self.request(
            server_round,
            ROUND_OPS,
            training=protocol.Training(sections=round_sections(p, server_round)),
            public=protocol.PublicSet(self.fed.fingerprint, "probs", p.uplink_encoding),
        )

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        self.note_cohort(node_ids)
        request = self.round_request(server_round)
        messages = []
        for node in node_ids:
            cluster = self.cluster_of.get(self.nodes.node_to_client.get(node, -1))
            targets = self.wire_targets.get(cluster) if cluster is not None else None
            messages.append(protocol.Draft(node, request, targets=targets))
        with_targets = sum(1 for m in messages if m.targets is not None)
        self.pseudo_bytes_down = sum(
            m.targets[protocol.TARGET_ARRAY].numpy().nbytes for m in messages if m.targets is not None
        )
        log.info(
            "cosmos round %d: %d messages (%d with cluster pseudo-labels)", server_round, len(messages), with_targets
        )
        return messages

    def evaluation_models(self, client_ids: list[int | None]) -> list[tuple[str, Mapping[str, np.ndarray]] | None]:
        """h_π(i) for each client (one record per cluster, shared); None for a client in no cluster yet."""
        records: dict[int, dict[str, np.ndarray]] = {}
        out: list[tuple[str, Mapping[str, np.ndarray]] | None] = []
        for cid in client_ids:
            k = self.cluster_of.get(cid) if cid is not None else None
            if k is None or k not in self.models:
                out.append(None)
                continue
            if k not in records:
                records[k] = {n: t.detach().cpu().numpy() for n, t in self.models[k].state_dict().items()}
            out.append((self.params.server_model, records[k]))
        return out

    # ------------------------------------------------------------------ aggregation
    def accept(self, replies: list[ClientReply]) -> dict[int, np.ndarray]:
        """Client id -> soft predictions. The reply validator has checked each reply once (U's fingerprint, the
        predictions' wire type, shape and values: :func:`fedapps.wire.validation.prediction_problem`)."""
        return {
            r.client_id: soft_predictions(r.required_predictions[protocol.PREDICTION_ARRAY], self.num_classes)
            for r in replies
        }

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        t0 = time.perf_counter()
        after = protocol.metric_name(protocol.AFTER_TAG, "acc")
        accs = [float(r.metrics[after]) for r in replies if after in r.metrics]
        if accs:
            self.last_acc["client"] = float(np.mean(accs))  # the clients' own models, after this round's training
        preds = self.accept(replies)
        if not preds:
            self.replies.skip_round(server_round, "no usable predictions; server models unchanged")
            return {}
        reclustered = False
        if self.clustering is None:
            self.cluster_round_one(preds)
        elif recluster_due(server_round, self.params.recluster_every):
            self.recluster(server_round, preds)
            reclustered = True
        for cid in sorted(set(preds) - set(self.cluster_of)):
            self.assign_newcomer(cid, preds[cid])
        losses = self.train_cluster_models(server_round, preds)
        extra: dict[str, Any] = {
            "clusters": self.clustering.k if self.clustering else 0,
            # the clusters against the partition's true groups, every round ("" where the partition has none)
            "cluster_group_ari": adjusted_rand(self.fed.groups, self.cluster_of) if self.fed.groups is not None else "",
            "reclustered": int(reclustered),
            "server_distill_loss": float(np.mean(list(losses.values()))) if losses else "",
            "server_seconds": round(time.perf_counter() - t0, 3),
            "pseudo_bytes_up": int(sum(r.required_predictions[protocol.PREDICTION_ARRAY].nbytes for r in replies)),
            "pseudo_bytes_down": int(self.pseudo_bytes_down),
        }
        if self.client_dp is not None:  # every present client's predictions entered one cluster's release
            extra.update(self.client_dp.record(c for c in preds if c in self.cluster_of))
        return extra

    def cluster_round_one(self, preds: dict[int, np.ndarray]) -> None:
        """Phase 1 clustering on the first round's predictions (clusters then stay fixed, unless
        ``recluster_every``)."""
        t0 = time.perf_counter()
        self.clustering, self.distances, self.distance_clients = cluster_on(preds, self.params, self.architectures())
        self.cluster_of = cluster_index(self.clustering)
        log.info(
            "cosmos: distances and clustering of %d clients in %.3f s; clusters %s",
            len(self.distance_clients),
            time.perf_counter() - t0,
            self.clustering.clusters,
        )

    def architectures(self) -> Callable[[int], str] | None:
        """Client id -> its architecture (``model.per_client`` cycled by id) where ``architectures`` needs it; else
        None."""
        if self.params.architectures == "ignore":
            return None
        return lambda cid: client_architecture(self.cfg.model.name, list(self.cfg.model.per_client), cid)

    def recluster(self, server_round: int, preds: dict[int, np.ndarray]) -> None:
        """``recluster_every``: the clustering again, on this round's predictions of the clients present; each new
        cluster continues (a copy of) the model and targets of the old cluster most of its members were in
        (:func:`inherited_clusters`); one that inherits none starts a fresh model. Absent clients leave their
        cluster and join the nearest one when next seen."""
        old_models, old_server, old_wire = self.models, self.server_targets, self.wire_targets
        result, self.distances, self.distance_clients = cluster_on(preds, self.params, self.architectures())
        sources = inherited_clusters(self.cluster_of, result.clusters)
        self.clustering, self.cluster_of = result, cluster_index(result)
        self.models, self.server_targets, self.wire_targets = {}, {}, {}
        for k, old in enumerate(sources):
            if old is not None and old in old_models:
                self.models[k] = copy.deepcopy(old_models[old])
            if old is not None and old in old_server:
                self.server_targets[k] = old_server[old]
                self.wire_targets[k] = old_wire.get(old)
        log.info(
            "cosmos round %d: clustered again: %s (continuing old clusters %s)", server_round, result.clusters, sources
        )

    def assign_newcomer(self, cid: int, pred: np.ndarray) -> None:
        """A client first seen after round 1 joins the cluster whose current target is nearest to its predictions."""
        assert self.clustering is not None or not self.server_targets  # server targets exist once round one clustered
        nearest = join_nearest(cid, pred, self.server_targets, self.clustering, self.params.distance)
        if nearest is not None:
            self.cluster_of[cid] = nearest

    def server_model(self, k: int) -> torch.nn.Module:
        """h_k, built on first use (seeded by the experiment seed and k), then kept and fine-tuned forever."""
        if k not in self.models:
            self.models[k] = build_model(
                self.params.server_model,
                self.num_classes,
                self.fed.input_shape,
                seed=server_init_seed(self.cfg.seed, k),
            ).to(self.device)
        return self.models[k]

    def train_cluster_models(self, server_round: int, preds: dict[int, np.ndarray]) -> dict[int, float]:
        """Objective (1) per cluster on this round's members' predictions; refresh h_k(U) for the next round."""
        p: CosmosParams = self.params
        losses: dict[int, float] = {}
        public_x = self.fed.public_x
        assert self.clustering is not None and public_x is not None  # aggregate clusters first; __init__ checks U
        for k, members in enumerate(self.clustering.clusters):
            present = [c for c in members if c in preds]
            sampled = self.sampled_members(members, present)
            if not present and not sampled:
                continue
            t0 = time.perf_counter()
            if self.client_dp is not None:
                target = self.private_target(server_round, k, [preds[c] for c in present], sampled)
            else:
                target = member_target(np.stack([preds[c] for c in present]), self.server_targets.get(k), p)
            probs, losses[k] = distill_server_model(
                self.server_model(k), public_x, target, p, self.cfg.seed, server_round, k
            )
            self.server_targets[k] = probs
            self.wire_targets[k] = protocol.Targets(
                pseudolabels.encode(probs, p.downlink_encoding, self.num_classes)
            ).encode()
            log_server_model(server_round, k, p, len(present), losses[k], probs, target, time.perf_counter() - t0)
        return losses

    def sampled_members(self, members: list[int], present: list[int]) -> int:
        """privacy.mode client: how many of a cluster's members the round's messages went to (the public count its
        noisy mean divides by: those who answered and the rest of the cohort in it); 0 without the mode."""
        if self.client_dp is None:
            return 0
        return len(set(members) & (set(self.client_dp.cohort) | set(present)))

    def private_target(self, server_round: int, k: int, member_preds: list[np.ndarray], sampled: int) -> np.ndarray:
        """privacy.mode client: cluster k's target as a release of :class:`fedapps.server.client_privacy.
        ClientLevelDP`: its present members' predictions clipped to privacy.clip_norm, summed, noised, divided by the
        members sampled (a cluster whose sampled members all failed releases the noise alone), made probability rows
        again and tempered (post-processing). The clusters are disjoint: one client enters one release per round."""
        dp = self.client_dp
        assert dp is not None
        contributions = member_preds or [np.zeros((self.n_public, self.num_classes))]
        mean = dp.noisy_mean(contributions, sampled, dp.noise_rng(server_round, k))
        probs = client_privacy.as_probabilities(mean).astype(np.float32)
        return pseudolabels.apply_temperature(probs, self.params.temperature).astype(np.float32)

    # ------------------------------------------------------------------ results
    def final_summary(self) -> dict[str, Any]:
        c = self.clustering
        summary: dict[str, Any] = {
            "clusters": c.k if c else 0,
            "cluster_sizes": c.sizes if c else [],
            "cluster_members": c.clusters if c else [],
            "b0": c.b0 if c else None,
            "b0_mode": c.mode if c else None,
            "distance": self.params.distance,
            "cluster_model_accuracy": self.history.last_measured.get("acc_mean"),  # the headline (deployed model)
            "client_model_accuracy": self.last_acc.get("client"),
        }
        if c and self.fed.groups is not None:
            summary["cluster_group_ari"] = adjusted_rand(self.fed.groups, self.cluster_of)
        return summary

    def artifacts(self) -> list[Artifact]:
        """clusters.json (assignment, B0, distances) and clusters.png (assignment against the true groups)."""
        c = self.clustering
        if c is None:
            return []
        groups = None if self.fed.groups is None else [int(g) for g in self.fed.groups]
        doc = {
            "b0": c.b0,
            "b0_mode": c.mode,
            "distance": c.metric,
            "b0_tried": c.tried,
            "clusters": c.clusters,
            "cluster_of_client": {str(k): v for k, v in sorted(self.cluster_of.items())},
            "true_group_of_client": groups,
            "distance_clients": self.distance_clients,
            "distances_per_sample": None if self.distances is None else np.round(self.distances, 5).tolist(),
            "cluster_group_ari": adjusted_rand(self.fed.groups, self.cluster_of)
            if self.fed.groups is not None
            else None,
        }
        figure = {
            "cluster_of": dict(self.cluster_of),
            "groups": groups,
            "distances": self.distances,
            "distance_clients": self.distance_clients,
            "title": f"{self.cfg.resolved_run_name()}: K = {c.k}, B0 = {c.b0:.3f} ({c.mode}, {c.metric})",
        }
        return [Artifact("clusters", "json", doc), Artifact("clusters", "clusters", figure)]


def server_target(stack: np.ndarray, aggregation: str, temperature: float) -> np.ndarray:
    """A cluster's distillation target: members' predictions (members×n×M) aggregated, then tempered."""
    agg = pseudolabels.aggregate(stack.astype(np.float32), aggregation)
    return pseudolabels.apply_temperature(agg, temperature).astype(np.float32)


# --------------------------------------------------------------------------- the maths both forms run
# (the app's Cosmos above and the drop-in FlowerCosmos below call these, and only these)


def round_sections(p: CosmosParams, server_round: int, local_epochs: int | None = None) -> dict[str, protocol.Section]:
    """The settings of a round message's operations: ``distill`` (objective (2): optimiser, KL, w_i(x), r_B) and, in
    round 1, ``train`` with E0 epochs; ``local_epochs``: the ``train`` epochs of the later rounds (None: not sent, the
    client's own setting)."""
    sections = {
        protocol.DISTILL: protocol.Section(
            epochs=p.distill_epochs,
            batch_size=p.distill_batch_size,
            lr=p.distill_lr,
            optimizer=p.distill_optimizer,
            clip_norm=p.distill_clip_norm,
            loss="kl",
            weighting=p.weighting,
            extra={RB_LAMBDA: p.rb_lambda, RB_SIGMA: p.rb_sigma},
        )
    }
    if server_round == 1:
        sections[protocol.TRAIN] = protocol.Section(epochs=p.pretrain_epochs)  # E0 pre-training
    elif local_epochs is not None:
        sections[protocol.TRAIN] = protocol.Section(epochs=int(local_epochs))
    return sections


def cluster_on(
    preds: Mapping[int, np.ndarray], p: CosmosParams, architecture: Callable[[int], str] | None = None
) -> tuple[clustering.ClusteringResult, np.ndarray, list[int]]:
    """Phase 1: the clients' distances (between their predictions on U, per sample) and the greedy threshold
    clustering on them, its clusters as lists of client ids (ascending ids: ties go to the lowest); with the
    distance matrix and the ids in its order. ``p.architectures`` (``architecture``: client id -> its architecture):
    centre, the distances are between the predictions less their architecture's mean (:func:`centre_by_architecture`);
    cluster-within, :func:`cluster_within_architectures`."""
    ids = sorted(preds)
    stack = np.stack([preds[c] for c in ids])
    archs: list[str] = []
    if p.architectures != "ignore":
        if architecture is None:
            raise ConfigError(
                f"cosmos architectures '{p.architectures}' needs each client's architecture; set it to ignore"
            )
        archs = [architecture(c) for c in ids]
    if p.architectures == "centre":
        stack = centre_by_architecture(stack, archs)
    distances = clustering.pairwise_distances(stack, p.distance)
    if p.architectures == "cluster-within":
        result = cluster_within_architectures(stack, distances, archs, p)
    else:
        result = clustering.cluster_clients(
            distances, p.b0_mode, p.b0, p.max_clusters, p.b0_start, p.b0_step, p.distance
        )
    result.clusters = [[ids[i] for i in members] for members in result.clusters]
    return result, distances, ids


def recluster_due(server_round: int, every: int) -> bool:
    """Whether round ``server_round`` clusters again (``recluster_every`` = ``every``): in rounds 1+k, 1+2k, ...
    (round 1 always clusters, as the paper); never with ``every`` 0."""
    return every > 0 and server_round > 1 and (server_round - 1) % every == 0


def centre_by_architecture(stack: np.ndarray, archs: list[str]) -> np.ndarray:
    """Clients' predictions (clients×n×M, float) less the mean prediction of the clients of the same architecture
    (``archs[i]``: client i's), per sample and class: what is left is how a client departs from its architecture's
    typical prediction, so two clients of different architectures are compared on their data, not their model."""
    stack = np.asarray(stack, dtype=np.float64)
    if len(archs) != len(stack):
        raise ValueError(f"{len(archs)} architectures for {len(stack)} clients")
    out = np.empty_like(stack)
    names = np.asarray(archs)
    for arch in sorted(set(archs)):
        rows = names == arch
        out[rows] = stack[rows] - stack[rows].mean(axis=0, keepdims=True)
    return out.astype(np.float32)


def cluster_within_architectures(
    stack: np.ndarray, distances: np.ndarray, archs: list[str], p: CosmosParams
) -> clustering.ClusteringResult:
    """Clusters (client positions) found within each architecture first: each architecture's clients clustered apart
    (``distances`` restricted to them; the B0 rule of ``p`` each, so ``max_clusters`` bounds each architecture's
    count); the architecture with the most clusters (ties: the first name in sorted order) anchors, and every cluster
    of another architecture joins the anchor cluster whose mean prediction is nearest, both means taken on the
    predictions less their architecture's mean (:func:`centre_by_architecture`: what an architecture adds to all its
    clients' predictions must not decide the match). K is the anchor's; B0 and the steps tried are the anchor's."""
    names = sorted(set(archs))
    found: dict[str, tuple[clustering.ClusteringResult, list[list[int]]]] = {}
    for a in names:
        idx = [i for i, x in enumerate(archs) if x == a]
        r = clustering.cluster_clients(
            distances[np.ix_(idx, idx)], p.b0_mode, p.b0, p.max_clusters, p.b0_start, p.b0_step, p.distance
        )
        found[a] = (r, [[idx[i] for i in members] for members in r.clusters])
    anchor = max(names, key=lambda a: (found[a][0].k, -names.index(a)))
    centred = centre_by_architecture(stack, archs)
    clusters = [list(members) for members in found[anchor][1]]
    centres = np.stack([centred[members].mean(axis=0) for members in clusters])
    for a in names:
        if a == anchor:
            continue
        for members in found[a][1]:
            d = clustering.distance_to_centres(centred[members].mean(axis=0), centres, p.distance)
            clusters[int(np.argmin(d))].extend(members)  # argmin keeps the first minimum: the earlier anchor cluster
    r = found[anchor][0]
    return clustering.ClusteringResult([sorted(c) for c in clusters], r.b0, r.mode, r.metric, r.tried)


def client_architecture(name: str, per_client: list[str], cid: int) -> str:
    """The architecture the config gives client ``cid``: ``model.per_client`` cycled by id, else ``model.name``
    (as the clients pick theirs, unless a node config names its own)."""
    return str(per_client[cid % len(per_client)]) if per_client else str(name)


def inherited_clusters(old_cluster_of: Mapping[int, int], new_clusters: list[list[int]]) -> list[int | None]:
    """For each new cluster, the old cluster that held most of its members (ties: the lowest old index; None when
    none of its members had one): whose model and targets it continues after a re-clustering."""
    out: list[int | None] = []
    for members in new_clusters:
        olds = [old_cluster_of[c] for c in members if c in old_cluster_of]
        if not olds:
            out.append(None)
            continue
        counts = np.bincount(olds)
        out.append(int(np.argmax(counts)))  # argmax keeps the first maximum: the lowest old index
    return out


def cluster_index(result: clustering.ClusteringResult) -> dict[int, int]:
    """Client id -> its cluster."""
    return {cid: k for k, members in enumerate(result.clusters) for cid in members}


def join_nearest(
    cid: int,
    pred: np.ndarray,
    server_targets: Mapping[int, np.ndarray],
    result: clustering.ClusteringResult | None,
    distance: str,
) -> int | None:
    """A client first seen after round 1 joins the cluster whose current targets h_k(U) are nearest to its
    predictions (added to ``result``'s members); None while there are no targets yet."""
    ks = sorted(server_targets)
    if not ks or result is None:
        return None
    d = clustering.distance_to_centres(pred, np.stack([server_targets[k] for k in ks]), distance)
    k = ks[int(np.argmin(d))]
    result.clusters[k].append(cid)
    log.info("cosmos: client %d (not seen in round 1) joins cluster %d (distance %.3f)", cid, k, float(d.min()))
    return k


def member_target(member_preds: np.ndarray, centre: np.ndarray | None, p: CosmosParams) -> np.ndarray:
    """A cluster's target from its present members' predictions (members×n×M): with ``member_clip``, each member
    first moved towards ``centre`` (the cluster's last h_k(U); None: the members' median), then
    :func:`server_target`."""
    if p.member_clip > 0:
        if centre is None:
            centre = pseudolabels.aggregate(member_preds, "median")
        member_preds = pseudolabels.clip_to_centre(member_preds, centre, p.member_clip)
    return server_target(member_preds, p.aggregation, p.temperature)


def server_init_seed(seed: int, k: int) -> int:
    """The seed under which cluster model h_k is initialised."""
    return derive_seed(seed, "cosmos-server-init", k)


def distill_server_model(
    model: nn.Module, public_x: Tensor, target: np.ndarray, p: CosmosParams, seed: int, server_round: int, k: int
) -> tuple[np.ndarray, float]:
    """Objective (1): fine-tune h_k on U towards ``target`` (KL + λ·r_B, its batches and dropout seeded by the run's
    seed, the round and k); returns h_k(U) (probabilities, n×M) and the mean loss."""
    optim = ops.OptimSettings(
        epochs=p.server_epochs,
        batch_size=p.server_batch_size,
        lr=p.server_lr,
        optimizer=p.server_optimizer,
        clip_norm=p.server_clip_norm,
        drop_last=False,
    )
    gen = torch.Generator().manual_seed(derive_seed(seed, "cosmos-server-distill", server_round, k))
    with torch.random.fork_rng(devices=[]):  # dropout in h_k draws from a seeded global stream, restored after
        torch.manual_seed(derive_seed(seed, "cosmos-server-global", server_round, k))
        result = ops.distill(
            model,
            public_x,
            torch.as_tensor(target),
            optim,
            ops.DistillSettings(loss="kl"),
            generator=gen,
            term=rb_term(p.rb_lambda, p.rb_sigma, gen),
        )
    return ops.predict(model, public_x).numpy(), float(result["loss"])


def log_server_model(
    server_round: int,
    k: int,
    p: CosmosParams,
    members: int,
    loss: float,
    probs: np.ndarray,
    target: np.ndarray,
    s: float,
) -> None:
    log.info(
        "cosmos round %d: server model %d distilled on %d members' %s targets, %d epochs: loss %.4f, "
        "agreement with targets %.3f, %.1f s",
        server_round,
        k,
        members,
        p.aggregation,
        p.server_epochs,
        loss,
        float((probs.argmax(1) == target.argmax(1)).mean()),
        s,
    )


# --------------------------------------------------------------------------- the drop-in form, for any Flower app


class FlowerCosmos(FlowerPseudoLabelStrategy):
    """COSMOS as a Flower ``Strategy`` for a user's own ClientApp (exported as ``fedapps.flower_strategies.Cosmos``):
    driven by Flower's ``start()``, it clusters the clients on their round-1 predictions on U and trains one cluster
    model per cluster, built by ``server_model_fn`` (the user's own architecture), with the functions our app's
    :class:`Cosmos` runs (:func:`cluster_on`, :func:`join_nearest`, :func:`member_target`,
    :func:`distill_server_model`).
    The clients serve :data:`strategies.pseudolabel_dropin.TRAIN_TYPE` / ``EVALUATE_TYPE`` messages with
    :func:`cosmos_train` / :func:`cosmos_evaluate`.

    ``params``: the fields of :class:`CosmosParams` (the same names, defaults and ranges as ``strategy.params.cosmos``
    of our app) but ``server_model`` (``server_model_fn`` instead); ``local_epochs``: the clients' training epochs in
    rounds 2+ (round 1: ``pretrain_epochs``). Clients are known by ``client-id`` where their node config has one
    (``partition-id`` in simulation): then a run's clusters are keyed as our app keys them. Client-level privacy
    (``privacy.mode: client`` of our app) is not offered here."""

    def __init__(
        self,
        server_model_fn: Callable[[], nn.Module],
        public_x: Tensor,
        num_classes: int,
        *,
        seed: int = 0,
        local_epochs: int = 1,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        **params: Any,
    ) -> None:
        super().__init__(
            public_x,
            num_classes,
            seed=seed,
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
        )
        if "server_model" in params:
            raise ConfigError("Cosmos(server_model=...): give the architecture as server_model_fn, a factory")
        if not callable(server_model_fn):
            raise ConfigError(
                f"Cosmos: server_model_fn must be callable (returning an nn.Module), got {server_model_fn!r}"
            )
        if int(local_epochs) < 1:
            raise ConfigError(f"Cosmos(local_epochs={local_epochs}): must be at least 1")
        self.params: CosmosParams = parse_params(CosmosParams, params, "Cosmos")
        if self.params.recluster_every or self.params.architectures != "ignore":
            raise ConfigError(
                "Cosmos(recluster_every=..., architectures=...): the re-clustering and architecture options run in "
                "our app's cosmos strategy only (strategy.params.cosmos); leave them at 0 / ignore here"
            )
        self.server_model_fn = server_model_fn
        self.local_epochs = int(local_epochs)
        self.device = ops.resolve_device(self.params.server_device)
        self.clustering: clustering.ClusteringResult | None = None
        self.cluster_of: dict[int, int] = {}  # client id -> cluster
        self.models: dict[int, nn.Module] = {}  # cluster -> h_k
        self.server_targets: dict[int, np.ndarray] = {}  # cluster -> h_k(U) (n×M), as sent
        self.wire_targets: dict[int, ArrayRecord | None] = {}
        self.distances: np.ndarray | None = None
        self.distance_clients: list[int] = []

    def round_request(self, server_round: int) -> protocol.Request:
        """Our app's round settings (:func:`round_sections`), the clients' epochs in every round, and the
        distillation keeping U's last partial batch (in our app: ``client.drop_last``, false in its COSMOS configs)."""
        p = self.params
        sections = round_sections(p, server_round, self.local_epochs)
        sections[protocol.DISTILL] = dataclasses.replace(sections[protocol.DISTILL], drop_last=False)
        return protocol.Request(
            ops=ROUND_OPS,
            round=server_round,
            setup=protocol.Setup(model=protocol.ModelSpec(None, self.seed)),
            training=protocol.Training(sections=sections),
            public=protocol.PublicSet(self.fingerprint, "probs", p.uplink_encoding),
        )

    def targets_for(self, client_id: int | None) -> ArrayRecord | None:
        k = self.cluster_of.get(client_id) if client_id is not None else None
        return self.wire_targets.get(k) if k is not None else None

    def server_model(self, k: int) -> nn.Module:
        """h_k: ``server_model_fn()`` built under the seed our app builds its h_k under, then kept and fine-tuned."""
        if k not in self.models:
            with seeded(server_init_seed(self.seed, k)):
                self.models[k] = self.server_model_fn().to(self.device)
        return self.models[k]

    def learn(self, server_round: int, predictions: dict[int, np.ndarray]) -> dict[str, float]:
        """Round 1: cluster; a client first seen later joins the nearest cluster; then objective (1) per cluster."""
        p = self.params
        if self.clustering is None:
            self.clustering, self.distances, self.distance_clients = cluster_on(predictions, p)
            self.cluster_of = cluster_index(self.clustering)
            log.info("cosmos (drop-in): clusters %s", self.clustering.clusters)
        for cid in sorted(set(predictions) - set(self.cluster_of)):
            k = join_nearest(cid, predictions[cid], self.server_targets, self.clustering, p.distance)
            if k is not None:
                self.cluster_of[cid] = k
        losses = []
        for k, members in enumerate(self.clustering.clusters):
            present = [c for c in members if c in predictions]
            if not present:
                continue
            t0 = time.perf_counter()
            target = member_target(np.stack([predictions[c] for c in present]), self.server_targets.get(k), p)
            probs, loss = distill_server_model(
                self.server_model(k), self.public_x, target, p, self.seed, server_round, k
            )
            self.server_targets[k] = probs
            self.wire_targets[k] = protocol.Targets(
                pseudolabels.encode(probs, p.downlink_encoding, self.num_classes)
            ).encode()
            log_server_model(server_round, k, p, len(present), loss, probs, target, time.perf_counter() - t0)
            losses.append(loss)
        return {"clusters": float(self.clustering.k), "server-distill-loss": float(np.mean(losses)) if losses else 0.0}

    def deployed_arrays(self, client_id: int | None) -> ArrayRecord | None:
        """h_π(i) after the round's server training (the paper's deployed model); None before i has a cluster."""
        k = self.cluster_of.get(client_id) if client_id is not None else None
        if k is None or k not in self.models:
            return None
        return ArrayRecord({n: t.detach().cpu() for n, t in self.models[k].state_dict().items()})


def cosmos_train(
    msg: Message,
    context: Context,
    *,
    model_fn: Callable[[], nn.Module],
    public_x: Tensor,
    train_fn: TrainFn,
    class_counts: Any,
    optimizer: ops.OptimizerFactory | None = None,
    device: str = "cpu",
) -> Message:
    """A ClientApp's ``@app.train("pseudolabels")`` for COSMOS: distil the own model on the cluster's targets
    (objective (2): KL, label-free w_i(x) from ``class_counts``, λ·r_B), the user's ``train_fn(model, epochs)``,
    then the predictions on U back (:func:`strategies.pseudolabel_dropin.pseudolabel_train`)."""
    return pseudolabel_train(
        msg,
        context,
        model_fn=model_fn,
        public_x=public_x,
        train_fn=train_fn,
        class_counts=class_counts,
        optimizer=optimizer,
        device=device,
        extras=distill_extras,
    )


def cosmos_evaluate(
    msg: Message,
    context: Context,
    *,
    model_fn: Callable[[], nn.Module],
    server_model_fn: Callable[[], nn.Module],
    test_fn: TestFn,
    num_examples: int,
    device: str = "cpu",
) -> Message:
    """A ClientApp's ``@app.evaluate("pseudolabels")`` for COSMOS: the cluster model h_π(i) the message carries (built
    by ``server_model_fn``) and the own model, through the user's ``test_fn(model) -> (loss, accuracy)``."""
    return pseudolabel_evaluate(
        msg,
        context,
        model_fn=model_fn,
        test_fn=test_fn,
        num_examples=num_examples,
        server_model_fn=server_model_fn,
        device=device,
    )


def adjusted_rand(groups: np.ndarray, cluster_of: Mapping[int, int]) -> float:
    """Adjusted Rand index between the found clusters and the partition's true client groups (diagnostic)."""
    from sklearn.metrics import adjusted_rand_score

    ids = sorted(cluster_of)
    return float(adjusted_rand_score([int(groups[i]) for i in ids], [cluster_of[i] for i in ids]))
