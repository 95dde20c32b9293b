"""cwFedAvg: class-wise federated averaging with weight-distribution regularisation (WDR).

Server side (paper: ICCV 2025, arXiv 2406.07800). With n_i the sample counts and P = [p̂_ij] the estimated class
distributions of the clients, the class-wise global models are ``w_j^G = Σ_l q_lj w_l`` with
``q_lj = n_l p̂_lj / Σ_m n_m p̂_mj`` and client i's personalised model is ``w_i^L = Σ_j p̂_ij w_j^G``.
Both steps are linear, so ``w_i^L = Σ_l A_il w_l`` with ``A = P Qᵀ`` (M×M): the server keeps the M client
models it received (as FedAvg does before averaging) and forms one personalised model per client, when
that client's message is built — the K class models are never materialised and every client downloads
exactly one model.

Which layers are class-wise: ``output`` (the classifier, default), ``last-N`` (the last N top-level
children that own parameters) or ``all``; matched by exact parameter name. Every other layer is plain
sample-weighted FedAvg. Parameters travel; buffers (BatchNorm statistics) stay on the clients by default.

Where p̂ comes from (``estimator``) — docs/algorithms/cwfedavg.md:
- ``norm``  the paper's, the default (with WDR λ = 10, the paper's value for MNIST/CIFAR-10): normalised L2
  norms of the uploaded classifier rows. No counts are sent, but WDR trains those norms towards the client's
  class distribution, so the upload itself approximates p_i ever more closely as training goes on.
- ``true``  the client reports its training class counts (the paper's "-gt" ablation): the server learns n_ij.
- ``bias``  (ours, an option with known limits) the positive part of the classifier-BIAS update, accumulated
  over rounds. Under plain SGD one epoch moves bias j by ``lr/B · (n_ij − Σ_x s_j(x))``: strictly negative for
  every class the client does not hold (WDR does not touch the bias), positive for the classes it holds AND
  the model under-predicts. So ``relu(b_uploaded − b_sent)`` is zero on absent classes — the server learns
  each client's class support exactly — but it is not an estimate of p_i: a held class the model already
  predicts at or above its share gets zero too (true [0.9, 0.1] can read [1, 0]), and on IID data, where the
  model's predictions match every client's shares, the update is noise, so cwFedAvg does not reduce to FedAvg.
  Good on label-skewed partitions (few classes per client), wrong near IID.

Partial participation / dropped clients: the server keeps, per client, its latest class-wise arrays, its
sample count and its estimate. ``mix: latest`` (default) mixes over the latest model of every client seen
so far (with full participation: exactly this round's models); ``mix: round`` only over this round's
repliers. A client with an estimate gets its row of A; a client never seen gets the FedAvg model (the
sample-weighted mean of the same set); before any reply, everyone gets the initial model.

Server memory (F shared floats, C class-wise parameters per client, M clients; docs/algorithms/cwfedavg.md). The
shared (non-class-wise) keys are one FedAvg for everybody, kept as a float64 running sum Σ_l n_l w_l:
- ``mix: round``: the sum is over this round's replies only, so the server holds O(F + M·C): never a whole
  client model beyond the reply being added.
- ``mix: latest``: when a client re-uploads, its previous contribution n_l^old w_l^old must leave the sum, and
  nothing short of w_l^old itself gives it (the next FedAvg depends on it for every l that may re-upload), so
  the server also keeps each client's latest shared arrays: O(M·(F + C)), whole models. Exact, not O(model);
  the sum only makes a round cost O(repliers·F) instead of O(M·F).

Robust option ``median_clip`` (off by default): one client's upload enters every other client's personalised model
through A, so a hostile client can take them over with valid-looking arrays — classifier rows that make its p̂ one-hot
on a class and scale that row up (measured: every other client at chance). With ``median_clip`` = c > 0 each upload
w_l is replaced, before anything else reads it (stack, running sum, estimate), by s + min(1, c·m/‖w_l − s‖)(w_l − s),
s the personalised model client l was sent and m the median of this round's ‖w_l − s‖ (:func:`fedapps.server.robust.
clip_to_median`): no client moves anyone's model further than c times the cohort's typical update.

Client side (registered here): the training term ``wdr``, switched on by ``train.wdr_lambda`` → loss
CE + (λ/2)·‖p_i − p̃_i‖₂ (:func:`wdr_penalty`), p_i from the
client's TRAIN split (the authors' code uses train+test). The deployed model after round r is client i's
personalised model formed from round r's uploads (what it receives in round r+1), evaluated by the base class
before training (``acc_*``); the model right after local training is the second column (``acc_after_training_*``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import Tensor, nn

from fedapps import checkpoint
from fedapps.client.registry import client_op, training_term
from fedapps.config import ConfigError, ExperimentConfig
from fedapps.data import get_federation, spec_info
from fedapps.models import build_model, classifier_name, top_level_children
from fedapps.params import lower, param
from fedapps.reporting.results import Artifact
from fedapps.server.aggregation import clip_replies_to_median
from fedapps.server.dropin import (
    PersonalisedFlowerStrategy,
    array_record,
    numpy_arrays,
    only_arrays,
    only_metrics,
    output_layer,
)
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply

log = logging.getLogger("fedapps")

ESTIMATORS = ("bias", "norm", "true")
MIX_SETS = ("latest", "round")
BUFFER_MODES = ("local", "fedavg")
_LAST_N = re.compile(r"^last-(\d+)$")


WDR_LAMBDA = "wdr_lambda"  # the train-section setting that switches WDR on (λ > 0): train.wdr_lambda
CLASS_COUNTS = "class-counts"  # the metric the `true` estimator's clients report their training class counts in


# --------------------------------------------------------------------------- client side


def class_distribution_from_rows(weight: Tensor) -> Tensor:
    """cwFedAvg's p̃: the L2 norm of each classifier row, normalised to sum to one (last dim = features)."""
    norms = weight.norm(dim=-1)
    return norms / norms.sum(dim=-1, keepdim=True).clamp_min(1e-12)


def wdr_penalty(weight: Tensor, target_distribution: Tensor, lam: float) -> Tensor:
    """WDR: (λ/2)·‖p − p̃‖₂ (Euclidean norm, not squared) on the classifier rows."""
    return 0.5 * lam * torch.linalg.vector_norm(target_distribution - class_distribution_from_rows(weight))


@training_term("wdr")
def wdr_term(w, section: protocol.Section):
    """WDR on the client's classifier rows towards its training class distribution; None when λ = 0."""
    lam = float(section.extra.get(WDR_LAMBDA, 0.0))
    if lam <= 0:
        return None
    weight = w.model.get_submodule(classifier_name(w.model)).weight
    counts = torch.as_tensor(w.fed.train_counts[w.client_id], dtype=torch.float32, device=w.device)
    target = counts / counts.sum()
    return lambda model: wdr_penalty(weight, target, lam)


@client_op("report-class-counts")
def report_class_counts(w, tag: str) -> None:
    """The client's training class counts as a metric (the `true` estimator, the paper's "-gt" ablation)."""
    w.metrics[CLASS_COUNTS] = [int(v) for v in w.fed.train_counts[w.client_id]]


# --------------------------------------------------------------------------- server side


@dataclass
class CwFedAvgParams:
    """cwFedAvg's parameters (``strategy.params.cwfedavg``); strings are read lower-case (YAML's bare `true`)."""

    layers: str = param(
        "output",
        normalise=lower,
        help="which layers are aggregated class-wise: output | last-N "
        "(e.g. last-2) | all (parsed by parse_layers in check)",
    )
    estimator: str = param(
        "norm",
        choices=ESTIMATORS,
        normalise=lower,
        help="norm (the paper's: classifier row norms; needs WDR) | true (clients report class "
        "counts) | bias (ours: support from classifier-bias updates; not FedAvg on IID data, "
        "drops held classes the model over-predicts)",
    )
    # λ = 10 is the paper's value for MNIST/CIFAR-10 (CIFAR-100 1000, Tiny ImageNet 2000); to be re-chosen on a
    # validation split, never on test accuracy
    wdr_lambda: float = param(
        10.0, ge=0, help="WDR strength λ on the clients; 0 turns WDR off (`bias` and `true` do not need it)"
    )
    mix: str = param(
        "latest",
        choices=MIX_SETS,
        normalise=lower,
        help="latest: mix every client's latest model | round: only this round's repliers",
    )
    buffers: str = param(
        "local",
        choices=BUFFER_MODES,
        normalise=lower,
        help="local: buffers (BN statistics) never leave the clients | fedavg: averaged",
    )
    track_estimation_error: bool = param(True, help="log mean L1(p̂, p) per estimator (simulation: the server knows p)")
    # robust option (docs/reliability.md, threat model): off by default, so published results are the paper's method
    median_clip: float = param(
        0.0,
        ge=0,
        help="robust option, 0 = off: each upload's update (the upload minus the "
        "personalised model the client was sent) is clipped to this multiple "
        "of the round's median update norm before it enters any mixing, its "
        "class estimate included (e.g. 2)",
    )


# --------------------------------------------------------------------------- pure maths


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to sum to one; an all-zero row becomes uniform."""
    x = np.asarray(x, dtype=np.float64)
    s = x.sum(axis=-1, keepdims=True)
    k = x.shape[-1]
    return np.where(s > 0, x / np.where(s > 0, s, 1.0), 1.0 / k)


def row_norm_distribution(weight: np.ndarray) -> np.ndarray:
    """The paper's p̃: L2 norm of each classifier row (last axis = features), normalised to sum to one."""
    return normalise_rows(np.linalg.norm(np.asarray(weight, dtype=np.float64), axis=-1))


def bias_evidence(bias_uploaded: np.ndarray, bias_sent: np.ndarray) -> np.ndarray:
    """Positive part of the classifier-bias update: zero for absent classes, ∝ class mass for present ones."""
    return np.maximum(np.asarray(bias_uploaded, np.float64) - np.asarray(bias_sent, np.float64), 0.0)


def counts_distribution(counts: Any, num_classes: int) -> np.ndarray | None:
    """The class distribution a client's reported ``class-counts`` give (the `true` estimator); None unless they are
    a list of ``num_classes`` non-negative numbers with a positive sum."""
    if not isinstance(counts, list) or len(counts) != num_classes:
        return None
    values = np.asarray(counts, np.float64)
    if not np.all(np.isfinite(values)) or values.min() < 0 or values.sum() <= 0:
        return None
    return normalise_rows(values)


def fedavg_weights(n: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """p_l = n_l / Σ n over the rows in ``mask`` (others 0); uniform over the mask if every n is 0."""
    n = np.asarray(n, dtype=np.float64)
    m = np.ones(n.shape, bool) if mask is None else np.asarray(mask, bool)
    w = np.where(m, n, 0.0)
    return w / w.sum() if w.sum() > 0 else m / max(m.sum(), 1)


def class_weights(n: np.ndarray, p: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Q (M×K): q_lj = n_l p_lj / Σ_m n_m p_mj over ``mask``; a class nobody holds falls back to FedAvg weights."""
    n = np.asarray(n, dtype=np.float64)
    m = np.ones(n.shape, bool) if mask is None else np.asarray(mask, bool)
    mass = np.where(m, n, 0.0)[:, None] * np.asarray(p, dtype=np.float64)
    total = mass.sum(axis=0, keepdims=True)
    fallback = fedavg_weights(n, m)[:, None]
    return np.where(total > 0, mass / np.where(total > 0, total, 1.0), fallback)


def mixing_matrix(p_targets: np.ndarray, q: np.ndarray) -> np.ndarray:
    """A = P Qᵀ: row i gives the weights of the client models in client i's personalised model."""
    return np.asarray(p_targets, np.float64) @ np.asarray(q, np.float64).T


def mix(weights: np.ndarray, stack: np.ndarray) -> np.ndarray:
    """Σ_l weights[..., l] · stack[l]: one (weights 1-D) or several (2-D) mixed arrays, in the stack's dtype."""
    w = np.asarray(weights, dtype=stack.dtype if np.issubdtype(stack.dtype, np.floating) else np.float64)
    flat = stack.reshape(stack.shape[0], -1)
    return (w @ flat).reshape(w.shape[:-1] + stack.shape[1:])


def class_models(q: np.ndarray, stack: np.ndarray) -> np.ndarray:
    """The K class-wise global models w_j^G = Σ_l q_lj w_l (the reference computation; K × shape)."""
    return mix(np.asarray(q).T, stack)


def parse_layers(layers: str) -> tuple[str, int]:
    """'output' → ('output', 0); 'all' → ('all', 0); 'last-3' → ('last', 3); anything else is a ConfigError."""
    if layers in ("output", "all"):
        return layers, 0
    m = _LAST_N.match(str(layers))
    if not m or int(m.group(1)) < 1:
        raise ConfigError(
            f"'strategy.params.cwfedavg.layers' is '{layers}'; allowed: output, all, or last-N with N >= 1 "
            "(e.g. last-2)"
        )
    return "last", int(m.group(1))


def parameterised_children(model: nn.Module) -> list[str]:
    """Top-level children that own parameters, in registration order (what `last-N` counts)."""
    return [c for c in top_level_children(model) if any(True for _ in model.get_submodule(c).parameters())]


def classwise_keys(model: nn.Module, layers: str) -> list[str]:
    """Parameter names aggregated class-wise, matched exactly (module path components, never substrings)."""
    mode, n = parse_layers(layers)
    names = [name for name, _ in model.named_parameters()]
    if mode == "all":
        return names
    if mode == "output":
        head = classifier_name(model)
        return [k for k in names if k.rsplit(".", 1)[0] == head]
    children = parameterised_children(model)
    if n > len(children):
        raise ConfigError(
            f"'strategy.params.cwfedavg.layers' is 'last-{n}' but the model has only {len(children)} "
            f"top-level children with parameters ({', '.join(children)})"
        )
    chosen = set(children[-n:])
    return [k for k in names if k.split(".", 1)[0] in chosen]


def l1_error(p_hat: np.ndarray, p_true: np.ndarray) -> float:
    """Mean over clients of Σ_j |p̂_ij − p_ij|."""
    return float(np.abs(np.asarray(p_hat) - np.asarray(p_true)).sum(axis=-1).mean())


# --------------------------------------------------------------------------- server state


@dataclass
class SavedStack:
    """A :class:`ModelStack` in a checkpoint: its layout, and its rows' files in ``server-state/`` (RowFiles)."""

    template: dict[str, np.ndarray]
    stacked: list[str]
    capacity: int
    row_of: dict[int, int]
    files: dict[int, str]  # client id -> file name
    version: int


class ModelStack:
    """The latest uploaded arrays of every client seen, for the template's keys. The ``stacked`` keys (what the
    mixing multiplies: cwFedAvg's class-wise keys) live in one (rows × shape) array per key, rows by client id,
    doubling as clients are heard from; the other keys (cwFedAvg's shared float keys under ``mix: latest``, a
    whole model per client, only ever read one client at a time) are kept per client, so that growing the stack
    never copies whole models (at 1,000 clients that copying cost more than a round's aggregation)."""

    def __init__(self, template: Mapping[str, np.ndarray], capacity: int, stacked: list[str] | None = None) -> None:
        self.template = {k: np.asarray(v) for k, v in template.items()}
        self.capacity = max(1, capacity)
        self.arrays = {
            k: np.zeros((self.capacity,) + self.template[k].shape, self.template[k].dtype)
            for k in (self.template if stacked is None else stacked)
        }
        self.loose: dict[int, dict[str, np.ndarray]] = {}  # client id -> its arrays of the keys not stacked
        self.row_of: dict[int, int] = {}
        self.changed: set[int] = set()  # clients whose arrays were put since the last save_rows

    def __len__(self) -> int:
        return len(self.row_of)

    def row(self, client_id: int) -> int:
        """The row of a client, allocating one (and growing the stacked arrays) on first sight."""
        if client_id not in self.row_of:
            if len(self.row_of) == self.capacity:
                self.capacity *= 2
                self.arrays = {k: np.concatenate([a, np.zeros_like(a)]) for k, a in self.arrays.items()}
            self.row_of[client_id] = len(self.row_of)
        return self.row_of[client_id]

    def put(self, client_id: int, arrays: Mapping[str, np.ndarray]) -> int:
        """Store a client's upload of the stack's keys (cast to the template dtypes; other keys ignored)."""
        r = self.row(client_id)
        for k, a in self.arrays.items():
            a[r] = arrays[k]
        if len(self.arrays) < len(self.template):
            self.loose[client_id] = {
                k: np.array(arrays[k], dtype=v.dtype) for k, v in self.template.items() if k not in self.arrays
            }
        self.changed.add(client_id)
        return r

    def get(self, client_id: int, key: str) -> np.ndarray:
        """A client's latest array of ``key`` (a client put before)."""
        if key in self.arrays:
            return self.arrays[key][self.row_of[client_id]]
        return self.loose[client_id][key]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + sum(
            a.nbytes for arrays in self.loose.values() for a in arrays.values()
        )

    def save_rows(self, files: checkpoint.RowFiles) -> SavedStack:
        """The clients put since the last save written to ``files`` (one file per client); the stack's layout
        and the files' map for the checkpoint (restored by :meth:`from_saved`)."""
        names = files.save({c: {k: np.array(self.get(c, k)) for k in self.template} for c in sorted(self.changed)})
        self.changed.clear()
        return SavedStack(
            dict(self.template), list(self.arrays), self.capacity, dict(self.row_of), names, files.version
        )

    @classmethod
    def filled(
        cls,
        template: Mapping[str, np.ndarray],
        capacity: int,
        stacked: list[str],
        row_of: Mapping[int, int],
        arrays_of: Any,
    ) -> ModelStack:
        """A stack holding every client of ``row_of`` in the same row, its arrays from ``arrays_of(client)``; every
        client counts as changed (the next save writes it)."""
        stack = cls(template, capacity, stacked)
        for client in sorted(row_of, key=row_of.__getitem__):  # rows are allocated in order: the same rows
            stack.put(client, arrays_of(client))
        return stack

    @classmethod
    def from_saved(cls, saved: SavedStack, files: checkpoint.RowFiles) -> ModelStack:
        rows = files.restore(saved.files, saved.version)
        stack = cls.filled(saved.template, saved.capacity, saved.stacked, saved.row_of, rows.__getitem__)
        stack.changed.clear()  # every row is in its file already
        return stack


def add_weighted(total: dict[str, np.ndarray], arrays: Mapping[str, np.ndarray], weight: float) -> None:
    """total[k] += weight · arrays[k] for every key of ``total`` (float64 sums; the product in float64 too)."""
    for k, t in total.items():
        t += np.multiply(arrays[k], weight, dtype=np.float64)


def _grow(x: np.ndarray, rows: int, fill: float = 0.0) -> np.ndarray:
    """x with at least ``rows`` rows (new rows = fill)."""
    if x.shape[0] >= rows:
        return x
    return np.concatenate([x, np.full((rows - x.shape[0],) + x.shape[1:], fill, x.dtype)])


class CwFedAvg(PersonalisedStrategy):
    """Class-wise federated averaging with WDR; one personalised model per client through A = P Qᵀ."""

    name = "cwfedavg"
    needs_classifier = "aggregates the classifier head (its final nn.Linear, one row per class) class by class"
    Params = CwFedAvgParams
    # the stack's files: state_dict writes them, the map is state; the models the round's messages carried (for
    # median_clip): rebuilt with every round's messages
    checkpoint_exclude = frozenset({"stack_files", "sent_models"})
    deployed = DeployedModel(
        "client i's personalised model formed from round r's uploads (what it receives in round r+1)", source="message"
    )

    # ------------------------------------------------------------------ config
    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: CwFedAvgParams) -> None:
        """The layer spec must parse and fit the model, and the `bias` estimator needs a classifier bias."""
        super().check_config(cfg, params)
        parse_layers(params.layers)
        if cfg.privacy.mode == "sample" and (params.estimator == "true" or params.wdr_lambda > 0):
            raise ConfigError(
                "'privacy.mode: sample' cannot cover cwfedavg with "
                + (
                    "estimator 'true': its clients report their class counts"
                    if params.estimator == "true"
                    else f"WDR (wdr_lambda {params.wdr_lambda:g}): its term pulls the classifier towards the "
                    "client's class distribution, read from its data without noise"
                )
                + "; set strategy.params.cwfedavg.wdr_lambda=0 and estimator 'norm' or 'bias' "
                "(docs/privacy.md)"
            )
        if params.estimator == "norm" and params.wdr_lambda == 0:
            log.warning(
                "cwfedavg: estimator 'norm' without WDR (wdr_lambda=0): the row norms carry little class "
                "information; the paper uses λ=10 (MNIST/CIFAR-10) to 2000 (Tiny ImageNet)"
            )
        model = _build(cfg, stand_in=True)  # the structure only: under data.source 'nodes' the shape is not known yet
        classwise_keys(model, params.layers)
        head = classifier_name(model)
        if params.estimator == "bias" and getattr(model.get_submodule(head), "bias", None) is None:
            raise ConfigError(
                f"'strategy.params.cwfedavg.estimator' is 'bias', which needs a bias in the classifier "
                f"'{head}' of model '{cfg.model.name}'; use estimator 'norm' or 'true'"
            )

    # ------------------------------------------------------------------ construction
    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        p: CwFedAvgParams = self.params
        model = _build(cfg)
        state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        params = [n for n, _ in model.named_parameters()]
        self.keys = list(state) if p.buffers == "fedavg" else params
        self.initial = {k: state[k] for k in self.keys}
        self.head = classifier_name(model)
        self.head_w, self.head_b = f"{self.head}.weight", f"{self.head}.bias"
        self.has_bias = self.head_b in self.initial
        self.classwise = [k for k in classwise_keys(model, p.layers) if k in self.keys]
        self.shared_keys = [k for k in self.keys if k not in self.classwise]
        # shared keys averaged over the clients; the others (BatchNorm's num_batches_tracked) are the last replier's
        self.shared_float = [k for k in self.shared_keys if np.issubdtype(self.initial[k].dtype, np.floating)]
        head_weight = model.get_submodule(self.head).weight
        assert isinstance(head_weight, Tensor)  # the head is the model's final nn.Linear
        self.num_classes = int(head_weight.shape[0])
        m = cfg.data.num_clients
        # per client: the class-wise arrays; under `latest` also the shared float arrays (see the module docstring)
        per_client = self.classwise + (self.shared_float if p.mix == "latest" else [])
        # rows for one cohort to start with; the stack grows as new clients are heard from, so memory follows the
        # clients heard from, not the federation (and a checkpoint writes the rows a round changed, see state_dict)
        self.stack = ModelStack({k: self.initial[k] for k in per_client}, self.nodes.cohort_size(m), self.classwise)
        self.sums: dict[str, np.ndarray] = {}  # Σ_l n_l w_l (float64) of the shared float keys over the mixed set
        self.n = np.zeros(self.stack.capacity)
        self.p_hat = np.full((self.stack.capacity, self.num_classes), 1.0 / self.num_classes)
        self.evidence = np.zeros((self.stack.capacity, self.num_classes))  # accumulated bias evidence
        self.norm_est = np.full((self.stack.capacity, self.num_classes), np.nan)
        self.estimated = np.zeros(self.stack.capacity, bool)  # rows with an estimate
        self.fresh = np.zeros(self.stack.capacity, bool)  # rows that replied in the last aggregation
        self.q: np.ndarray | None = None  # class weights of the last aggregation (rows of the stack)
        self.shared: dict[str, np.ndarray] = {}  # FedAvg arrays of the shared keys (what every client gets)
        self.fedavg_w: np.ndarray | None = None
        self.sent_bias: dict[int, np.ndarray] = {}  # node id -> classifier bias it was sent
        self.true_p = _true_distributions(cfg) if p.track_estimation_error else None
        self.snapshots: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}  # 'first'/'last' -> (round, ids, p̃)
        self.stack_files: checkpoint.RowFiles | None = None  # where state_dict writes the stack's rows
        self.sent_models: dict[
            int, dict[str, np.ndarray]
        ] = {}  # node id -> the model its message carried (median_clip)
        log.info(
            "cwfedavg: %d of %d parameter tensors class-wise (%s), estimator %s, WDR λ=%g, mix %s, buffers %s",
            len(self.classwise),
            len(params),
            p.layers,
            p.estimator,
            p.wdr_lambda,
            p.mix,
            p.buffers,
        )

    # ------------------------------------------------------------------ personalised models
    def personalised(self, client_id: int | None) -> dict[str, np.ndarray]:
        """Client's model: the shared FedAvg arrays, and its row of A on the stacked class-wise arrays (FedAvg
        weights if never seen); the initial model before any reply."""
        if self.q is None:
            return self.initial
        row = self.stack.row_of.get(client_id) if client_id is not None else None
        if row is None or not self.estimated[row]:
            weights = self.fedavg_w
        else:
            weights = mixing_matrix(self.p_hat[row][None], self.q)[0]
        assert weights is not None  # fedavg_w is set with q, by the same aggregation
        out = dict(self.shared)
        for k in self.classwise:
            out[k] = mix(weights, self.stack.arrays[k])
        return {k: out[k] for k in self.keys}

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        p: CwFedAvgParams = self.params
        client_ops = ["train"] + (["report-class-counts"] if p.estimator == "true" else [])
        part = "state" if p.buffers == "fedavg" else "params"
        request = self.request(
            server_round,
            client_ops,
            load=protocol.Load(into_model=True),
            returns=protocol.Return(arrays=True, part=part),
            training=protocol.Training(
                sections={protocol.TRAIN: protocol.Section(extra={WDR_LAMBDA: float(p.wdr_lambda)})}
            ),
        )
        messages = []
        self.sent_models = {}
        for node in node_ids:
            arrays = self.personalised(self.nodes.node_to_client.get(node))
            if self.has_bias:
                self.sent_bias[node] = np.array(arrays[self.head_b], dtype=np.float64)
            if p.median_clip > 0:
                self.sent_models[node] = arrays
            messages.append(protocol.Draft(node, request, arrays=arrays))
        return messages

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        """Take each usable reply (``replies`` is iterated once, so it may be a generator; ``median_clip`` clips
        the usable ones first): its class-wise arrays into the stack, its shared arrays into the running sum, its
        estimate; then Q, the FedAvg weights and the shared arrays for the next messages."""
        p: CwFedAvgParams = self.params
        errors: dict[str, list[tuple[int, np.ndarray]]] = {e: [] for e in ESTIMATORS}
        taken: set[int] = set()
        usable: list[ClientReply] = []
        for r in replies:
            if self._usable(server_round, r, taken):
                taken.add(r.client_id)
                usable.append(r)
        if not usable:
            return {}
        extra: dict[str, Any] = {}
        if p.median_clip > 0:
            usable, extra = self._clipped(server_round, usable)
            if not usable:
                return {}
        self.fresh[:] = False  # the first usable reply opens the aggregation (nothing changes without one)
        if p.mix == "round" or not self.sums:
            self.sums = {k: np.zeros(self.initial[k].shape, np.float64) for k in self.shared_float}
        for r in usable:
            self._take(r, errors)
        last = usable[-1]
        self._record_snapshot(server_round)
        mask = self.estimated & (self.fresh if p.mix == "round" else True)
        self.q = class_weights(self.n, self.p_hat, mask)
        self.fedavg_w = fedavg_weights(self.n, mask)
        total = float(self.n[mask].sum())  # > 0: every reply taken has num_examples >= 1
        self.shared = {k: (self.sums[k] / total).astype(self.initial[k].dtype) for k in self.shared_float}
        for k in self.shared_keys:
            if k not in self.sums:  # integer buffers (BatchNorm's num_batches_tracked): the last replier's
                self.shared[k] = np.array(last.required_arrays[k], dtype=self.initial[k].dtype)
        if p.mix == "round":
            self.sums = {}  # this round's sum is spent: O(F) only while aggregating
        return {**extra, **self._error_metrics(errors)}

    def _clipped(self, server_round: int, replies: list[ClientReply]) -> tuple[list[ClientReply], dict[str, Any]]:
        """``median_clip``: each reply's update against the model its message carried, clipped to median_clip × the
        round's median update norm (:func:`fedapps.server.robust.clip_to_median`); the replies with the clipped arrays
        and
        the round's extras (the bound, how many were clipped)."""
        known = []
        for r in replies:  # every training message's model is recorded: a reply without one answers none
            if r.node_id in self.sent_models:
                known.append(r)
            else:
                self.replies.skip_reply(server_round, r, "median_clip: no model was sent to this node this round")
        if not known:
            return [], {}
        return clip_replies_to_median(
            known,
            [self.sent_models[r.node_id] for r in known],
            float(self.params.median_clip),
            f"cwfedavg round {server_round}:",
        )

    def _usable(self, server_round: int, r: ClientReply, taken: set[int]) -> bool:
        """Whether a reply can be aggregated: the model's keys and shapes, examples > 0, once per client."""
        if (
            r.arrays is None
            or set(r.arrays) != set(self.keys)
            or any(r.arrays[k].shape != self.initial[k].shape for k in self.keys)
        ):
            self.replies.skip_reply(server_round, r, "arrays that do not match the model")
            return False
        if r.num_examples <= 0:  # the reply validator refuses these already
            self.replies.skip_reply(server_round, r, f"{r.num_examples} examples reported")
            return False
        if r.client_id in taken:  # the validator allows one reply per node and node per client
            self.replies.skip_reply(server_round, r, "a second reply from this client")
            return False
        return True

    def _take(self, r: ClientReply, errors: dict[str, list[tuple[int, np.ndarray]]]) -> None:
        """One reply into the state: the running sum (minus the client's previous upload under `latest`), the
        stack, its sample count and estimate."""
        p: CwFedAvgParams = self.params
        row = self.stack.row(r.client_id)
        self._ensure_rows(self.stack.capacity)
        if p.mix == "latest" and self.estimated[row]:  # its previous upload leaves the sum
            add_weighted(self.sums, {k: self.stack.get(r.client_id, k) for k in self.sums}, -float(self.n[row]))
        # shared arrays in the template dtypes, so what enters the sum is what the stack keeps (and later removes)
        add_weighted(
            self.sums,
            {k: np.asarray(r.required_arrays[k], self.initial[k].dtype) for k in self.sums},
            float(r.num_examples),
        )
        self.stack.put(r.client_id, r.required_arrays)
        self.n[row] = r.num_examples
        self.fresh[row] = True
        estimates = self._estimates(r, row)
        for name, est in estimates.items():
            errors[name].append((r.client_id, est))
        chosen = estimates.get(p.estimator)
        if chosen is None:  # e.g. no counts sent, or no bias evidence yet: the paper's estimate
            chosen = estimates["norm"]
        self.p_hat[row] = chosen
        self.estimated[row] = True

    def state_dict(self) -> dict[str, Any]:
        """The state, with the stack's changed rows written to ``server-state/stack/`` (when its RunContext gives a
        folder) rather than the whole stack into checkpoint.pt every round: under partial participation the
        stack holds every client heard from, a round changes a cohort's rows."""
        state = super().state_dict()
        if self.context.server_state_dir is not None:  # its fields: a checkpoint holds data, not objects
            state["stack"] = dataclasses.asdict(self.stack.save_rows(self._stack_files()))
        return state

    def _stack_files(self) -> checkpoint.RowFiles:
        if self.stack_files is None:
            self.stack_files = checkpoint.RowFiles(f"{self.context.server_state_dir}/stack")
        return self.stack_files

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint (the stack from its files, see :meth:`state_dict`)."""
        saved = state.get("stack")
        if isinstance(saved, dict):  # a SavedStack's fields (state_dict)
            if self.context.server_state_dir is None:
                raise ValueError(
                    "cwfedavg: this checkpoint keeps the stack in server-state files; build the strategy "
                    "with RunContext(server_state_dir=<run folder>/server-state) to load it"
                )
            state = {**state, "stack": ModelStack.from_saved(SavedStack(**saved), self._stack_files())}
        super().load_state_dict(state)

    def _ensure_rows(self, rows: int) -> None:
        self.n = _grow(self.n, rows)
        self.p_hat = _grow(self.p_hat, rows, 1.0 / self.num_classes)
        self.evidence = _grow(self.evidence, rows)
        self.norm_est = _grow(self.norm_est, rows, np.nan)
        self.estimated = _grow(self.estimated, rows, False)
        self.fresh = _grow(self.fresh, rows, False)

    def _estimates(self, r: ClientReply, row: int) -> dict[str, np.ndarray]:
        """Every estimate available for this reply (the chosen one drives the mixing, all are measured)."""
        out = {"norm": row_norm_distribution(r.required_arrays[self.head_w])}
        self.norm_est[row] = out["norm"]
        if self.has_bias and r.node_id in self.sent_bias:
            self.evidence[row] += bias_evidence(r.required_arrays[self.head_b], self.sent_bias.pop(r.node_id))
            if self.evidence[row].sum() > 0:
                out["bias"] = normalise_rows(self.evidence[row])
        counted = counts_distribution(r.metrics.get(CLASS_COUNTS), self.num_classes)
        if counted is not None:
            out["true"] = counted
        elif self.params.estimator == "true":
            log.warning("client %d sent no usable 'class-counts'; using the norm estimate for it", r.client_id)
        return out

    def _error_metrics(self, errors: dict[str, list[tuple[int, np.ndarray]]]) -> dict[str, Any]:
        """Mean L1(p̂, p) of each estimator over this round's repliers (simulation only: needs the true p)."""
        if self.true_p is None:
            return {}
        out: dict[str, Any] = {}
        for name, items in errors.items():
            items = [(c, e) for c, e in items if 0 <= c < len(self.true_p)]
            if items:
                out[f"est_l1_{name}"] = l1_error(np.stack([e for _, e in items]), self.true_p[[c for c, _ in items]])
        rows = [(c, r) for c, r in self.stack.row_of.items() if self.fresh[r] and 0 <= c < len(self.true_p)]
        if rows:
            out["est_l1"] = l1_error(self.p_hat[[r for _, r in rows]], self.true_p[[c for c, _ in rows]])
        log.info("estimation error (mean L1 to true p): %s", ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
        return out

    def _record_snapshot(self, server_round: int) -> None:
        """Normalised row norms of every client seen (rows in client-id order), for the heatmap."""
        ids = np.array(sorted(self.stack.row_of), dtype=np.int64)
        mat = self.norm_est[[self.stack.row_of[c] for c in ids]].copy()
        self.snapshots.setdefault("first", (server_round, ids, mat))
        self.snapshots["last"] = (server_round, ids, mat)

    # ------------------------------------------------------------------ end of run
    def final_summary(self) -> dict[str, Any]:
        p: CwFedAvgParams = self.params
        out: dict[str, Any] = {"cwfedavg": {**dataclasses.asdict(p), "classwise_keys": self.classwise}}
        for k, v in self.history.last_extra.items():
            if k.startswith("est_l1"):
                out[f"final_{k}"] = v
        return out

    def artifacts(self) -> list[Artifact]:
        """estimates.csv (every client's p̂, row-norm estimate and, in simulation, true p) and weight_norms.png
        (clients × classes: true distribution, normalised classifier row norms in the first and last round)."""
        out = []
        if self.stack.row_of:
            out.append(Artifact("estimates", "table", self.estimate_rows()))
        if self.snapshots:
            out.append(Artifact("weight_norms", "heatmaps", self.heatmap_panels()))
        return out

    def heatmap_panels(self) -> list[tuple[str, list[int], np.ndarray]]:
        """(title, client ids, clients × classes) panels: true p where known, row norms first and last round."""
        ids = self.snapshots["last"][1]
        panels = []
        if self.true_p is not None and len(ids) and ids.min() >= 0 and ids.max() < len(self.true_p):
            panels.append(("true class distribution p (train split)", list(ids), self.true_p[ids]))
        for key in ("first", "last"):
            if key in self.snapshots and not (
                key == "last" and self.snapshots["last"][0] == self.snapshots["first"][0]
            ):
                rnd, ids_k, mat = self.snapshots[key]
                panels.append((f"row norms p̃, round {rnd}", list(ids_k), mat))
        return panels

    def estimate_rows(self) -> list[dict[str, Any]]:
        """Per client: the estimate in use, the row-norm estimate and (simulation) the true distribution."""
        rows = []
        for c in sorted(self.stack.row_of):
            r = self.stack.row_of[c]
            kinds = [("estimate", self.p_hat[r]), ("norm", self.norm_est[r])]
            if self.true_p is not None and 0 <= c < len(self.true_p):
                kinds.append(("true", self.true_p[c]))
            for kind, v in kinds:
                rows.append({"client": c, "kind": kind, **{f"class_{j}": round(float(x), 5) for j, x in enumerate(v)}})
        return rows


def _build(cfg: ExperimentConfig, stand_in: bool = False) -> nn.Module:
    # a source's classes and shape, or what the nodes described (stand_in: placeholders while they are unknown)
    num_classes, shape = spec_info(dataclasses.asdict(cfg.data), stand_in=stand_in)
    return build_model(cfg.model.name, num_classes, shape, seed=cfg.seed)


def _true_distributions(cfg: ExperimentConfig) -> np.ndarray | None:
    """Clients' true training class distributions, when the server can build the federation (simulation)."""
    try:
        return normalise_rows(get_federation(dataclasses.asdict(cfg.data)).train_counts)
    except Exception as exc:  # noqa: BLE001 - deployment: the data lives on the clients only
        log.info("cwfedavg: true class distributions unavailable (%s); estimation error not tracked", exc)
        return None


# --------------------------------------------------------------------------- drop-in form (any Flower ClientApp)

DROPIN_ESTIMATORS = ("bias", "norm")  # without class counts from a client, what p̂ is read from


class FlowerCwFedAvg(PersonalisedFlowerStrategy):
    """cwFedAvg as a drop-in Flower strategy (``fedapps.flower_strategies.CwFedAvg``): each node is sent its
    personalised model ``Σ_l A_il w_l`` with ``A = P Qᵀ``, formed by the functions the app's :class:`CwFedAvg` uses
    (:func:`class_weights`, :func:`fedavg_weights`, :func:`mixing_matrix`, :func:`mix`, :class:`ModelStack`).

    p̂ of a node: its ``class-counts`` metric when its reply carries one (the app's `true`), else ``estimator``:
    ``bias`` (the positive part of the classifier-bias updates, accumulated) or ``norm`` (the classifier row norms,
    which need WDR in the client's loss: :func:`wdr_penalty`); ``bias`` falls back to ``norm`` until a node's bias
    evidence is positive (and for a classifier without bias). The class-wise layers: the output layer (``classifier``,
    or found in ``model``, or in the arrays as the app finds it) or, with ``model``, ``layers`` as in the app
    (``output`` | ``last-N`` | ``all``). ``mix``: ``latest`` mixes the latest upload of every node seen, ``round`` only
    this round's. Every other argument is Flower's FedAvg's. State is per node id (see
    :mod:`fedapps.server.dropin`)."""

    def __init__(
        self,
        *,
        estimator: str = "bias",
        classifier: str | None = None,
        model: nn.Module | None = None,
        layers: str = "output",
        mix: str = "latest",
        **flower_args: Any,
    ) -> None:
        super().__init__(**flower_args)
        if estimator not in DROPIN_ESTIMATORS:
            raise ValueError(f"cwFedAvg: estimator is {estimator!r}; allowed: {', '.join(DROPIN_ESTIMATORS)}")
        if mix not in MIX_SETS:
            raise ValueError(f"cwFedAvg: mix is {mix!r}; allowed: {', '.join(MIX_SETS)}")
        if model is None and layers not in ("output", "all"):
            raise ValueError(f"cwFedAvg: layers {layers!r} counts the model's children; pass model=... with it")
        self.estimator, self.mix = estimator, mix
        self.classifier, self.model = classifier, model
        self.layers = layers
        self.model_classwise = classwise_keys(model, layers) if model is not None else None
        self.keys: list[str] = []  # set from the first arrays (the initial model): what every node is sent

    def settings(self) -> list[tuple[str, object]]:
        return [("Estimator (without class-counts)", self.estimator), ("Class-wise layers", self.layers),
                ("Mix", self.mix)]  # fmt: skip

    def _setup(self, arrays: ArrayRecord) -> None:
        """The layout, from the first arrays Flower's loop passes (the initial model)."""
        initial = numpy_arrays(arrays)
        self.keys = list(initial)
        self.initial = initial
        self.head = output_layer(self.classifier, self.model, initial)
        self.head_w, self.head_b = f"{self.head}.weight", f"{self.head}.bias"
        if self.model_classwise is not None:
            self.classwise = [k for k in self.model_classwise if k in initial]
        elif self.layers == "all":
            self.classwise = list(self.keys)
        else:
            self.classwise = [k for k in (self.head_w, self.head_b) if k in initial]
        self.has_bias = self.head_b in initial
        self.num_classes = int(initial[self.head_w].shape[0])
        shared = [k for k in self.keys if k not in self.classwise]
        self.shared_float = [k for k in shared if np.issubdtype(initial[k].dtype, np.floating)]
        self.shared_other = [k for k in shared if k not in self.shared_float]
        per_node = self.classwise + (self.shared_float if self.mix == "latest" else [])
        self.stack = ModelStack({k: initial[k] for k in per_node}, 8, self.classwise)
        self.sums: dict[str, np.ndarray] = {}
        self.n = np.zeros(self.stack.capacity)
        self.p_hat = np.full((self.stack.capacity, self.num_classes), 1.0 / self.num_classes)
        self.evidence = np.zeros((self.stack.capacity, self.num_classes))
        self.estimated = np.zeros(self.stack.capacity, bool)
        self.fresh = np.zeros(self.stack.capacity, bool)
        self.q: np.ndarray | None = None
        self.fedavg_w: np.ndarray | None = None
        self.shared: dict[str, np.ndarray] = {}
        self.sent_bias: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ personalised models
    def node_arrays(self, node_id: int, arrays: ArrayRecord, for_training: bool) -> ArrayRecord:
        """The node's row of A on the stacked class-wise arrays and the shared FedAvg arrays (FedAvg weights for a
        node never heard from); before any reply, the arrays Flower's loop passes (the initial model)."""
        if not self.keys:
            self._setup(arrays)
        model = numpy_arrays(arrays) if self.q is None else self.personalised(node_id)
        if for_training and self.has_bias:
            self.sent_bias[node_id] = np.array(model[self.head_b], dtype=np.float64)
        return array_record(model, self.keys)

    def personalised(self, node_id: int) -> dict[str, np.ndarray]:
        """As :meth:`CwFedAvg.personalised`, by node id."""
        assert self.q is not None and self.fedavg_w is not None  # set by the first aggregation
        row = self.stack.row_of.get(node_id)
        weights = (
            self.fedavg_w if row is None or not self.estimated[row] else mixing_matrix(self.p_hat[row][None], self.q)[0]
        )
        out = dict(self.shared)
        for k in self.classwise:
            out[k] = mix(weights, self.stack.arrays[k])
        return out

    # ------------------------------------------------------------------ aggregation
    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord | None:
        """Each matching reply into the state (as :meth:`CwFedAvg.aggregate`); the FedAvg model of the mixed set."""
        uploads = []
        for msg in replies:
            arrays = numpy_arrays(only_arrays(msg))
            if set(arrays) != set(self.keys) or any(arrays[k].shape != self.initial[k].shape for k in self.keys):
                log.warning("cwFedAvg round %d: node %d sent arrays that do not match the model; left out",
                            server_round, msg.metadata.src_node_id)  # fmt: skip
                continue
            uploads.append((msg.metadata.src_node_id, arrays, only_metrics(msg)))
        if not uploads:
            return None
        self.fresh[:] = False
        if self.mix == "round" or not self.sums:
            self.sums = {k: np.zeros(self.initial[k].shape, np.float64) for k in self.shared_float}
        for node, arrays, metrics in uploads:
            self._take(node, arrays, metrics)
        mask = self.estimated & (self.fresh if self.mix == "round" else True)
        self.q = class_weights(self.n, self.p_hat, mask)
        self.fedavg_w = fedavg_weights(self.n, mask)
        total = float(self.n[mask].sum())
        self.shared = {k: (self.sums[k] / total).astype(self.initial[k].dtype) for k in self.shared_float}
        for k in self.shared_other:  # integer buffers: the last replier's, as the app does
            self.shared[k] = np.array(uploads[-1][1][k], dtype=self.initial[k].dtype)
        if self.mix == "round":
            self.sums = {}
        aggregate = dict(self.shared)
        for k in self.classwise:
            aggregate[k] = mix(self.fedavg_w, self.stack.arrays[k])
        return array_record(aggregate, self.keys)

    def _take(self, node: int, arrays: Mapping[str, np.ndarray], metrics: Mapping[str, Any]) -> None:
        """One upload into the running sum (its previous one out under `latest`), the stack, n and p̂."""
        num_examples = float(metrics[self.weighted_by_key])
        row = self.stack.row(node)
        self._grow(self.stack.capacity)
        if self.mix == "latest" and self.estimated[row]:
            add_weighted(self.sums, {k: self.stack.get(node, k) for k in self.sums}, -float(self.n[row]))
        add_weighted(self.sums, {k: np.asarray(arrays[k], self.initial[k].dtype) for k in self.sums}, num_examples)
        self.stack.put(node, arrays)
        self.n[row] = num_examples
        self.fresh[row] = True
        if self.has_bias and node in self.sent_bias:
            self.evidence[row] += bias_evidence(arrays[self.head_b], self.sent_bias.pop(node))
        estimate = counts_distribution(metrics.get(CLASS_COUNTS), self.num_classes)
        if estimate is None and self.estimator == "bias" and self.evidence[row].sum() > 0:
            estimate = normalise_rows(self.evidence[row])
        if estimate is None:
            estimate = row_norm_distribution(arrays[self.head_w])
        self.p_hat[row] = estimate
        self.estimated[row] = True

    def _grow(self, rows: int) -> None:
        self.n = _grow(self.n, rows)
        self.p_hat = _grow(self.p_hat, rows, 1.0 / self.num_classes)
        self.evidence = _grow(self.evidence, rows)
        self.estimated = _grow(self.estimated, rows, False)
        self.fresh = _grow(self.fresh, rows, False)
