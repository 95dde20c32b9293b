"""Shared machinery of every strategy: client sampling, the round loop on Flower's Message API, reply
validation, byte accounting, the evaluation protocol and the per-round record. Algorithms subclass
:class:`PersonalisedStrategy`, declare what their deployed model is (:class:`DeployedModel`) and implement
``round_messages`` (the round's training operations) and ``aggregate``. A strategy returns what it measured —
per-round extras from ``aggregate``, summary entries from ``final_summary``, artefacts as data from
``artifacts`` — and the result sinks write it; ``start`` returns Flower's ``Result``.

The evaluation protocol (docs/evaluation.md), owned here for every strategy: client i's DEPLOYED model after
round r (what it would use for inference if the federation stopped after round r's server step) is evaluated
on its evaluation split at the start of round r+1's message, before any training, and, for the last round R,
by one evaluation-only message to every connected client; the measurement is attributed to round r. Every
round message also evaluates the client's model right after its local training ("after training", the second
column). Neither the strategies nor the clients choose when; a strategy only says what its deployed model is.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedapps.wire import protocol
from fedapps.config import ConfigError, ExperimentConfig, cohort_size, exceeds_clients
from fedapps.flower.connect import wait_for_clients
from fedapps.data import NODES
from fedapps.params import parse_params
from fedapps.wire.protocol import ClientReply
from fedapps.reporting.results import Artifact, accuracy_stats, after_training_stats
from fedapps.server.robust import AggregationRule, clip_to_median, clip_update, combine
from fedapps.wire.validation import Rejection, ReplyValidator

log = logging.getLogger("fedapps")


@dataclass
class NoParams:
    """A strategy without parameters of its own."""


DEPLOYED_SOURCES = ("client", "message", "server")
SKIP_PHASE = "aggregate"  # rejections.csv's phase of what a strategy left out (PersonalisedStrategy.skip_reply)
IDENTIFY_PHASE = "identify"  # rejections.csv's phase of the identify messages (see PersonalisedStrategy.identify)


@dataclass(frozen=True)
class DeployedModel:
    """What client i's deployed model after round r is, for :class:`PersonalisedStrategy` to measure it.

    ``source``: ``client`` — the client's own model as it stands after its last local update (nothing is sent
    for it); ``message`` — what the strategy's round message carries, as the client loads it (a global, cluster,
    personalised model or a body under the client's own head): the evaluation-only message after the last
    round carries the same arrays; ``server`` — a server-side model sent for evaluation only
    (:meth:`PersonalisedStrategy.evaluation_models`, its bytes counted as evaluation traffic).
    ``prepare``: client operations that form the deployed model from the message before it is evaluated (IFCA's
    choice among K models); the strategy's round operations start with them. ``evaluate``: the evaluation
    operation (``evaluate`` | ``evaluate-finetuned`` | ``evaluate-received``). ``what``: the definition in
    words (summary.json, the table of docs/algorithms/index.md). ``companions``: (name, evaluation operation) pairs,
    other models of the same round measured right after the deployed one on the same messages (the evaluation-only
    one included), e.g. FedNH's generic model ``("generic", "evaluate")``; tagged ``deployed.<name>``, filed under
    the round they measure (rounds.csv ``<name>_acc_mean`` / ``_weighted``, summary ``final_<name>_acc_*``).
    """

    what: str
    source: str = "client"
    prepare: tuple[str, ...] = ()
    evaluate: str = "evaluate"
    companions: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.source not in DEPLOYED_SOURCES:
            raise ValueError(f"DeployedModel.source '{self.source}'; allowed: {', '.join(DEPLOYED_SOURCES)}")
        if (self.source == "server") != (self.evaluate == "evaluate-received"):
            raise ValueError("a server-side deployed model is evaluated with 'evaluate-received', and only it")

    @property
    def op(self) -> str:
        """The tagged evaluation operation a message runs."""
        return f"{self.evaluate}:{protocol.DEPLOYED_TAG}"

    @property
    def ops(self) -> list[str]:
        """The tagged evaluation operations of a measurement: the deployed model's, then its companions'."""
        return [self.op, *(f"{op}:{protocol.companion_tag(name)}" for name, op in self.companions)]


@dataclass
class Measurement:
    """The deployed-model evaluation of round ``round``: the replies carrying ``deployed-*`` metrics, taken on
    round ``round`` + 1's messages, or (``final``) by the evaluation-only message after the last round."""

    round: int
    replies: list[ClientReply]
    final: bool = False


@dataclass
class RoundLog:
    """What one round produced (the results writer turns it into a row of rounds.csv)."""

    round: int
    replies: list[ClientReply]
    bytes_down: int
    bytes_up: int
    eval_bytes_down: int = 0
    eval_bytes_up: int = 0
    # bytes of the replies the validator rejected (both phases): counted apart, never in bytes_up / eval_bytes_up
    bytes_up_rejected: int = 0
    wall_seconds: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # reply validation (both phases of the round together): accepted, rejected, asked for but never answered
    replies_ok: int = 0
    replies_rejected: int = 0
    replies_missing: int = 0
    rejections: list[Rejection] = dataclasses.field(default_factory=list)  # the sinks append them to rejections.csv
    # what the algorithm left out of a validated round (a reply it could not use, or the whole round's step),
    # phase "aggregate"; also written to rejections.csv, not counted in replies_rejected
    skips: list[Rejection] = dataclasses.field(default_factory=list)
    sent: int = 0  # training messages sent this round (one per sampled node)
    received: int = 0  # replies that came back (error replies included: the message reached a client)
    skipped: bool = False  # fewer usable replies than strategy.min_clients: nothing was aggregated
    errors: list[str] = dataclasses.field(default_factory=list)  # reasons of the error replies
    # deployed-model measurements taken during this round: of the previous round (on this round's messages) and,
    # in the last round, of this round itself (the evaluation-only message); the sinks file each under its round
    measurements: list[Measurement] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class RunContext:
    """What the app driver knows of a run beyond its config, given to the strategy at construction (never set
    afterwards). The defaults (rounds recorded nowhere, state kept in memory, every node sampled) suit tests."""

    on_round: Callable[[RoundLog], None] | None = None  # called with every round's record: the result sinks
    # where clients keep their private model across a resumption, sent in every message (see fedapps.client.worker):
    # <run folder>/client-state and the run's token; unset: clients keep it in memory only
    client_state: protocol.Bookkeeping = protocol.Bookkeeping()
    # where the strategy may keep per-client state too large to rewrite in checkpoint.pt every round (see
    # fedapps.checkpoint.RowFiles; cwFedAvg's stack); None: everything goes in checkpoint.pt
    server_state_dir: str | None = None
    # nodes refused before round 1 (data.source 'nodes': their data do not fit, see fedapps.flower.describe): never sampled
    excluded_nodes: frozenset[int] = frozenset()


class PersonalisedStrategy:
    """Base class: one message phase per round (plus the evaluation-only one after the last round);
    subclasses hold the algorithm.

    It does not subclass Flower's ``flwr.serverapp.strategy.Strategy``: that contract is a loop of
    ``configure_train`` / ``aggregate_train`` / ``configure_evaluate`` / ``aggregate_evaluate`` around one global
    model, driven by ``Strategy.start(grid, initial_arrays, ...)``. Ours sends a personalised message per client,
    measures the previous round's deployed models on the next round's messages and resumes from a checkpoint
    (``start(grid, num_rounds, timeout, first_round)``), so the four adapters would only be code nothing calls.
    What it keeps of Flower: the Grid it drives, the Message API and the ``Result`` that ``start`` returns."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams  # a dataclass of fedapps.params.param fields: strategy.params.<name>.*
    needs_public_set: ClassVar[bool] = False
    model_agnostic: ClassVar[bool] = False  # may clients run different architectures?
    deployed: ClassVar[DeployedModel]  # what client i's deployed model after round r is (every strategy says)
    robust_aggregation: ClassVar[bool] = False  # averages with average_matching: strategy.aggregation applies
    # why DP-SGD on the clients' training (privacy.mode: sample) cannot bound what this algorithm's clients send:
    # something they compute from their data outside the noisy steps; '' when it can (docs/privacy.md)
    sample_privacy_refused: ClassVar[str] = ""
    # Instance attributes that are NOT algorithm state (see :meth:`state_dict`): the config and callbacks, the
    # round loop's own state (saved apart by :meth:`checkpoint_state`). A subclass names its own non-state
    # attributes (data, devices, caches rebuilt from the config) in its ``checkpoint_exclude``; the sets of
    # every class in the MRO count.
    checkpoint_exclude: ClassVar[frozenset[str]] = frozenset(
        {"cfg", "params", "context", "rng", "node_to_client", "last_extra", "rule", "validator", "_checked",
         "last_measured", "identify_asked"})

    # ------------------------------------------------------------------ config
    @classmethod
    def read_params(cls, cfg: ExperimentConfig) -> Any:
        """Typed params from ``strategy.params.<name>`` (no section: all defaults), each declared rule checked."""
        key = f"strategy.params.{cls.name}"
        section = cfg.strategy.params.get(cls.name)
        if section and not dataclasses.fields(cls.Params):
            raise ConfigError(f"strategy '{cls.name}' has no parameters; remove '{key}' "
                              f"(it sets {', '.join(map(str, section)) if isinstance(section, Mapping) else section!r})")
        return parse_params(cls.Params, section, key)

    @classmethod
    def params_from(cls, cfg: ExperimentConfig) -> Any:
        """``read_params`` then ``check``: this strategy's params for ``cfg``, ready to run."""
        params = cls.read_params(cfg)
        cls.check(cfg, params)
        return params

    @classmethod
    def check(cls, cfg: ExperimentConfig, params: Any) -> None:
        """What no single parameter's declaration can say: checks against the rest of the config (or between
        parameters). Subclasses extend it and call ``super().check(cfg, params)`` first."""
        if cfg.model.per_client and not cls.model_agnostic:
            raise ConfigError(f"'model.per_client' is set but strategy '{cls.name}' exchanges model parameters, "
                              "so every client must run the same 'model.name'; remove model.per_client")
        if cls.needs_public_set and cfg.data.source == NODES and not cfg.data.public_path:
            raise ConfigError(f"strategy '{cls.name}' needs a public set U, and with data.source 'nodes' U is a file: set "
                              "'data.public_path' to the server's copy of U (an .npz with 'x'); every node names its "
                              "own copy in node config public-path")
        if cls.needs_public_set and cfg.data.source != NODES and cfg.data.public_fraction <= 0:
            raise ConfigError(f"strategy '{cls.name}' needs a public set U: set 'data.public_fraction' in (0, 1), e.g. 0.2")
        if cfg.privacy.mode == "sample" and cls.sample_privacy_refused:
            raise ConfigError(f"'privacy.mode: sample' cannot cover strategy '{cls.name}': "
                              f"{cls.sample_privacy_refused}, so ε would not bound what its clients send "
                              "(docs/privacy.md); run it with privacy.mode off, or choose another strategy")
        s = cfg.strategy
        robust = s.aggregation != "mean" or s.max_weight_share < 1.0 or s.clip_update_norm > 0
        if not cls.robust_aggregation and robust:
            raise ConfigError(f"'strategy.aggregation: {s.aggregation}' / 'strategy.max_weight_share: {s.max_weight_share}' "
                              f"/ 'strategy.clip_update_norm: {s.clip_update_norm}' apply to the parameter-averaging "
                              f"strategies only (fedavg, fedprox, ditto, fedper, fedrep, fedbabu, ifca, cfl), not to "
                              f"'{cls.name}'; remove them (defaults: mean, 1.0, 0)")
        if s.transport != "float32" and cls.model_agnostic:
            raise ConfigError(f"'strategy.transport: {s.transport}' applies to the strategies that exchange model "
                              f"parameters; '{cls.name}' sends none (its clients may run different architectures). "
                              "Remove it (default float32); the pseudo-label strategies set their own wire encoding "
                              "in strategy.params.<name> (e.g. encoding, uplink_encoding)")

    @classmethod
    def require_at_most_clients(cls, cfg: ExperimentConfig, key: str, value: int) -> None:
        """A count parameter (e.g. K cluster models) must not exceed ``data.num_clients``."""
        if value > cfg.data.num_clients:
            raise ConfigError(exceeds_clients(f"strategy.params.{cls.name}.{key}", value, cfg.data.num_clients,
                                              "there are not that many clients to share out"))

    # ------------------------------------------------------------------ construction
    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        """``params``: normally from :func:`strategies.resolve` (None: read and checked from ``cfg``);
        ``context``: the run's collaborators and places (:class:`RunContext`; None: its defaults)."""
        self.cfg = cfg
        self.params = params if params is not None else self.params_from(cfg)
        self.context = context if context is not None else RunContext()
        self.rng = np.random.default_rng(cfg.seed)
        self.node_to_client: dict[int, int] = {}
        self.last_extra: dict[str, Any] = {}  # the extras of the last round that had usable replies
        self.last_measured: dict[str, Any] = {}  # round and accuracy of the latest deployed-model measurement
        self.rule = AggregationRule.for_run(cfg)  # for average_matching (robust_aggregation strategies)
        self.validator = ReplyValidator.from_config(cfg)  # every reply is checked against what its message asked
        self._checked = RoundLog(0, [], 0, 0)  # validation counts of the phases validated since the last reset
        self.identify_asked: set[int] = set()  # nodes sent an identify message (each is asked once)

    def setup(self) -> protocol.Setup:
        """What every message carries: the data spec, the model spec and the client's training settings."""
        c = self.cfg
        return protocol.Setup(data=protocol.data_spec_for_clients(dataclasses.asdict(c.data)),
                              model=protocol.ModelSpec(c.model.name, c.seed, tuple(c.model.per_client)),
                              client=dataclasses.asdict(c.client))

    def request(self, server_round: int, ops: Iterable[str], **parts: Any) -> protocol.Request:
        """A request of this run: the operations, :meth:`setup`, the run's bookkeeping (where clients keep their
        state), its privacy settings (sent only while privacy.mode is on: a message without them trains as it always
        did) and ``parts``, the other fields of :class:`fedapps.wire.protocol.Request` (load, returns, training,
        ...)."""
        p = self.cfg.privacy
        private = protocol.Privacy(**dataclasses.asdict(p)) if p.mode != "off" else None
        return protocol.Request(ops=tuple(ops), round=server_round, setup=self.setup(),
                                bookkeeping=self.context.client_state, privacy=private, **parts)

    # ------------------------------------------------------------------ to implement
    def round_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        """The round's messages, one per sampled node, with the algorithm's own operations only (the deployed
        model's and the after-training evaluations are added by :meth:`messages_for_round`)."""
        raise NotImplementedError

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        """Update server state from this round's validated replies; return extra round metrics."""
        raise NotImplementedError

    def evaluation_models(self, client_ids: list[int | None]) -> list[tuple[str, ArrayRecord] | None]:
        """``deployed.source == 'server'``: per client (None: not heard from yet) the architecture and arrays of
        its deployed model, or None where it has none yet (then it is not measured)."""
        raise NotImplementedError(f"strategy '{self.name}' declares a server-side deployed model: implement "
                                  "evaluation_models")

    def measures_round(self, server_round: int) -> bool:
        """Whether round ``server_round``'s deployed models are measured (default: every round; the last round
        always is)."""
        return True

    def final_summary(self) -> dict[str, Any]:
        """Extra keys for summary.json."""
        return {}

    def protocol_summary(self) -> dict[str, Any]:
        """summary.json's description of what the headline measures (written for every strategy)."""
        return {"deployed_model": self.deployed.what,
                "deployed_measured": "round r: on round r+1's message before any training; the last round: an "
                                     "evaluation-only message to every connected client"}

    def artifacts(self) -> list[Artifact]:
        """What the strategy measured beyond the per-round record, as data (tables, documents, figure data)."""
        return []

    def final_arrays(self) -> Mapping[str, np.ndarray] | None:
        """The global model at the end, where the algorithm has one (Flower's ``Result.arrays``)."""
        return None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The algorithm's state as data: every instance attribute not named in a ``checkpoint_exclude``
        (tensors moved to the CPU). A torch module cannot be restored generically (its architecture is not
        data): a strategy that keeps modules overrides this and :meth:`load_state_dict` (see COSMOS)."""
        excluded = self._checkpoint_excluded()
        return {k: _state_value(v, f"{type(self).__name__}.{k}") for k, v in vars(self).items() if k not in excluded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (onto a strategy built from the same config)."""
        excluded = self._checkpoint_excluded()
        for k, v in state.items():
            if k not in excluded:
                setattr(self, k, v)

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything the round loop needs to continue after a round: the algorithm's state, the sampling RNG,
        which node is which client, the last extras."""
        v = self.validator
        return {"strategy": self.state_dict(), "rng": self.rng.bit_generator.state,
                "node_to_client": dict(self.node_to_client), "last_extra": dict(self.last_extra),
                "last_measured": dict(self.last_measured),
                "identity": {"node_client": dict(v.node_client), "client_node": dict(v.client_node),
                             "bound_examples": dict(v.bound_examples)}}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(state["strategy"])
        self.rng.bit_generator.state = state["rng"]
        self.node_to_client = dict(state["node_to_client"])
        self.last_extra = dict(state["last_extra"])
        self.last_measured = dict(state.get("last_measured", {}))
        identity = state.get("identity", {})  # node <-> client bindings survive a resumption
        self.validator.node_client = dict(identity.get("node_client", {}))
        self.validator.client_node = dict(identity.get("client_node", {}))
        self.validator.bound_examples = dict(identity.get("bound_examples", {}))

    @classmethod
    def _checkpoint_excluded(cls) -> frozenset[str]:
        out: set[str] = set()
        for klass in cls.__mro__:
            out |= set(vars(klass).get("checkpoint_exclude", ()))
        return frozenset(out)

    # ------------------------------------------------------------------ sampling
    def available_nodes(self, grid: Grid, wait_seconds: float = 120.0) -> list[int]:
        """Connected node ids; waits until at least ``min_clients`` are there (simulation starts empty)."""
        deadline = time.time() + wait_seconds
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= self.cfg.strategy.min_clients or time.time() > deadline:
                return nodes
            time.sleep(0.5)

    def sample_nodes(self, grid: Grid) -> list[int]:
        """ceil(fraction·N) nodes, at least min_clients (when that many are connected), seeded. Every node is
        identified before it is first sampled (:meth:`identify`). The draw is over the nodes ordered by CLIENT id:
        node ids are random per run (Flower's simulation draws them afresh), so a draw over them would give the
        same seed another cohort in every run."""
        nodes = [n for n in self.available_nodes(grid) if n not in self.context.excluded_nodes]
        if not nodes:
            raise RuntimeError("no client nodes are connected")
        self.identify(grid, nodes)
        k = self.cohort_size(len(nodes))
        if k == len(nodes):
            return nodes
        return sample_ids(by_client_id(nodes, self.node_to_client), k, self.rng)

    def identify(self, grid: Grid, node_ids: list[int]) -> None:
        """Settle which client each node is, once, before its first round message: the nodes of ``node_ids`` whose
        identity is not bound yet (by the describe phase, or an earlier identify) and that were not asked before get
        a message with no operation (the client loads its data split, trains and stores nothing, and replies with
        its identity). The validator binds node <-> client id on the accepted replies; from then on a reply is
        attributed by its node, and one claiming another client's id is rejected alone (the owner's reply stands).
        A node that does not answer, or is rejected (e.g. two nodes claiming one id: neither gets it), stays
        unbound, is drawn after the known ones, by node id, and is bound by its first accepted round reply.
        Rejections go to the round's record (rejections.csv, phase ``identify``)."""
        for node, client in self.validator.node_client.items():
            self.node_to_client.setdefault(node, client)
        ask = [n for n in node_ids if n not in self.validator.node_client and n not in self.identify_asked]
        if not ask:
            return
        self.identify_asked.update(ask)
        request = self.request(0, [], returns=protocol.Return(arrays=False),
                               keep=protocol.Keep(persist=False, save=False))
        messages = [protocol.build_message(n, request, message_type=protocol.QUERY_MESSAGE_TYPE) for n in ask]
        self.validator.expect(messages)
        t0 = time.time()
        replies = grid.send_and_receive(messages, timeout=self.cfg.strategy.timeout)
        outcome = self.validator.check(0, replies, protocol.QUERY_MESSAGE_TYPE)
        for r in outcome.accepted:
            self.node_to_client[r.node_id] = r.client_id
        self._checked.rejections.extend(dataclasses.replace(r, round=self._checked.round, phase=IDENTIFY_PHASE)
                                        for r in outcome.rejections)
        log.info("identified %d of %d nodes (%.1f s)%s", len(outcome.accepted), len(ask), time.time() - t0,
                 f"; {len(outcome.rejections)} rejected (rejections.csv)" if outcome.rejections else "")

    def rebind_after_resume(self, connected: Iterable[int]) -> None:
        """A resumed run: the checkpoint's node <-> client bindings of nodes that are not connected now are
        dropped (Flower's simulation gives its nodes new ids in every run), so the nodes now serving those clients
        are identified afresh; a node that is still connected keeps its binding."""
        now = {int(n) for n in connected}
        gone = [n for n in self.validator.node_client if n not in now]
        self.validator.forget_nodes(gone)
        self.node_to_client = {n: c for n, c in self.node_to_client.items() if n in now}
        if gone:
            log.info("resumed: %d node(s) of the checkpointed run are gone (new node ids); their clients are "
                     "identified again", len(gone))

    def validate(self, server_round: int, replies: Iterable[Message],
                 phase: str = protocol.MESSAGE_TYPE) -> list[ClientReply]:
        """Check replies against what their messages asked (:mod:`fedapps.wire.validation`; recorded by
        ``validator.expect`` when the messages were built: what each reply must carry is read off its message) and
        bind node ↔ client; never raises. The counts and rejections go into the round's record."""
        replies = list(replies)
        outcome = self.validator.check(server_round, replies, phase)
        for r in outcome.accepted:
            self.node_to_client[r.node_id] = r.client_id
        received = sum(reply_nbytes(m) for m in replies)
        self._checked.bytes_up_rejected += max(0, received - sum(r.nbytes for r in outcome.accepted))
        self._checked.replies_ok += len(outcome.accepted)
        self._checked.replies_rejected += len(outcome.rejections)
        self._checked.replies_missing += outcome.missing
        self._checked.rejections.extend(outcome.rejections)
        return outcome.accepted

    def skip_reply(self, server_round: int, reply: ClientReply, reason: str) -> None:
        """A validated reply the algorithm cannot use (e.g. arrays that answer no model of this round): logged and
        recorded (rejections.csv, phase ``aggregate``), never silently dropped."""
        log.warning("round %d: %s left out client %d's reply: %s", server_round, self.name, reply.client_id, reason)
        self._checked.skips.append(Rejection(server_round, SKIP_PHASE, reply.node_id, reply.client_id,
                                             f"{self.name}: {reason}"))

    def skip_round(self, server_round: int, reason: str) -> None:
        """A step of the round the algorithm did not take (no usable reply for it; too few replies): logged and
        recorded like :meth:`skip_reply`, without a node."""
        log.warning("round %d: %s: %s", server_round, self.name, reason)
        self._checked.skips.append(Rejection(server_round, SKIP_PHASE, None, None, f"{self.name}: {reason}"))

    def start(self, grid: Grid, num_rounds: int | None = None, timeout: float | None = None,
              first_round: int = 1) -> Result:
        """The round loop: messages out, replies in, aggregate, optional evaluation phase, record.
        ``first_round`` > 1 continues a run restored with :meth:`load_checkpoint_state`.

        Returns Flower's ``Result``: per round the aggregated client metrics (``train_metrics_clientapp``), the
        deployed models' accuracy filed under the round it measures (``evaluate_metrics_clientapp``), and the final
        global model (``arrays``) where the algorithm has one."""
        num_rounds = num_rounds or self.cfg.rounds
        timeout = timeout or self.cfg.strategy.timeout
        log.info("strategy %s, params: %s", self.name, self.params)
        connected = wait_for_clients(grid, self.cfg.strategy.expected_clients or self.cfg.data.num_clients,
                                     self.cfg.strategy.connect_timeout)
        if first_round > 1:
            self.rebind_after_resume(connected)
        result = Result()
        for rnd in range(first_round, num_rounds + 1):
            entry = self.run_round(grid, rnd, timeout, last=rnd == num_rounds)
            result.train_metrics_clientapp[rnd] = round_metrics(entry)
            for m in entry.measurements:  # the deployed models, filed under the round they belong to
                result.evaluate_metrics_clientapp[m.round] = measurement_metrics(m)
            if self.context.on_round is not None:
                self.context.on_round(entry)
        final = self.final_arrays()
        if final is not None:
            result.arrays = protocol.arrays_record(final)
        return result

    # ------------------------------------------------------------------ the evaluation protocol
    def with_transport(self, messages: list[Message]) -> list[Message]:
        """``strategy.transport`` applied to messages as the strategy built them: their model arrays (``arrays``,
        ``eval-arrays``) re-encoded (:func:`protocol.encode_arrays`) and, where arrays go out or are asked back,
        ``arrays.transport`` set so that the client replies in kind. float32: the messages untouched. A record
        shared by several messages is encoded once."""
        transport = self.cfg.strategy.transport
        if transport == "float32":
            return messages
        encoded: dict[int, ArrayRecord] = {}
        for msg in messages:
            request = protocol.request_of(msg)
            names = [n for n in (protocol.ARRAYS, protocol.EVAL_ARRAYS) if n in msg.content]
            for name in names:
                record = msg.content[name]
                if id(record) not in encoded:
                    encoded[id(record)] = protocol.transport_record(record, transport)
                msg.content[name] = encoded[id(record)]
            if names or request.returns.arrays:
                protocol.with_request(msg, dataclasses.replace(request, transport=transport))
        return messages

    def messages_for_round(self, server_round: int, node_ids: list[int]) -> list[Message]:
        """The strategy's round messages with the protocol's evaluations added: the deployed model of the
        previous round first (after the ``deployed.prepare`` operations, before any training; from round 2 on,
        where :meth:`measures_round` says so), the model after local training last; ``strategy.transport``
        applied (:meth:`with_transport`)."""
        messages = self.round_messages(server_round, node_ids)
        d = self.deployed
        measure = server_round > 1 and self.measures_round(server_round - 1)
        models: list[tuple[str, ArrayRecord] | None] = [None] * len(messages)
        if measure and d.source == "server":
            models = self.evaluation_models([self.node_to_client.get(int(m.metadata.dst_node_id)) for m in messages])
        for msg, model in zip(messages, models):
            request = protocol.request_of(msg)
            ops = with_evaluations(list(request.ops), d, measure and (d.source != "server" or model is not None),
                                   self.name)
            evaluation = protocol.Evaluation(model[0]) if model is not None else request.evaluation
            protocol.with_request(msg, dataclasses.replace(request, ops=tuple(ops), evaluation=evaluation))
            if model is not None:
                msg.content[protocol.EVAL_ARRAYS] = model[1]
        return self.with_transport(messages)

    def deployed_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        """Evaluation-only messages measuring the deployed models after round ``server_round`` − 1: round
        ``server_round``'s message cut down to the deployed model's operations (nothing trained, nothing sent
        back, the client's model read but not written). Clients without a deployed model are left out;
        ``strategy.transport`` applied (:meth:`with_transport`)."""
        return self.with_transport(self._deployed_messages(server_round, node_ids))

    def _deployed_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        d = self.deployed
        ops = (*d.prepare, *d.ops)
        out: list[Message] = []
        if d.source == "message":  # the round message, nothing sent back, the client's model read but not written
            for msg in self.round_messages(server_round, node_ids):
                r = protocol.request_of(msg)
                request = dataclasses.replace(r, ops=ops, round=server_round,
                                              returns=dataclasses.replace(r.returns, arrays=False),
                                              keep=dataclasses.replace(r.keep, save=False))
                arrays = msg.content[protocol.ARRAYS] if protocol.ARRAYS in msg.content else None
                out.append(protocol.build_message(int(msg.metadata.dst_node_id), request, arrays=arrays,
                                                  message_type=protocol.EVAL_MESSAGE_TYPE))
            return out
        request = self.request(server_round, ops, returns=protocol.Return(arrays=False), keep=protocol.Keep(save=False))
        if d.source == "client":
            return [protocol.build_message(n, request, message_type=protocol.EVAL_MESSAGE_TYPE) for n in node_ids]
        models = self.evaluation_models([self.node_to_client.get(n) for n in node_ids])
        return [protocol.build_message(n, dataclasses.replace(request, evaluation=protocol.Evaluation(model[0])),
                                       eval_arrays=model[1], message_type=protocol.EVAL_MESSAGE_TYPE)
                for n, model in zip(node_ids, models) if model is not None]

    def cohort_size(self, connected: int) -> int:
        """Clients per training round out of ``connected``: ceil(fraction·N), at least min_clients, at most N."""
        s = self.cfg.strategy
        return cohort_size(connected, s.fraction, s.min_clients)

    def final_evaluation(self, grid: Grid, rnd: int, timeout: float, entry: RoundLog) -> None:
        """The deployed models after the last round ``rnd``: one evaluation-only message to EVERY connected
        client (sampled this round or not), filed as round ``rnd``'s measurement; its bytes are evaluation
        traffic. Sent in batches of a training round's cohort, one after another, so that the server holds no
        more messages at once than in a round (a personalised model per client: cwFedAvg's 1,000 clients held
        ~17 GB when sent at once, docs/performance.md); each batch gets ``timeout``."""
        nodes = sorted(int(n) for n in grid.get_node_ids() if int(n) not in self.context.excluded_nodes)
        batch = max(1, self.cohort_size(len(nodes)))
        parsed: list[ClientReply] = []
        sent = 0
        for start in range(0, len(nodes), batch):
            messages = self.deployed_messages(rnd + 1, nodes[start:start + batch])
            if not messages:
                continue
            sent += len(messages)
            self.validator.expect(messages)
            entry.eval_bytes_down += sum(protocol.record_nbytes(m.content) for m in messages)
            replies = list(grid.send_and_receive(messages, timeout=timeout))
            accepted = self.validate(rnd, replies, phase=protocol.EVAL_MESSAGE_TYPE)
            entry.eval_bytes_up += sum(r.nbytes for r in accepted)
            parsed += accepted
            del messages, replies
        if not sent:
            self.skip_round(rnd, "no client has a deployed model to evaluate after the last round")
            return
        parsed.sort(key=lambda r: r.client_id)
        entry.measurements.append(Measurement(rnd, parsed, final=True))

    def run_round(self, grid: Grid, rnd: int, timeout: float, last: bool = False) -> RoundLog:
        """One round: the training phase (whose messages also measure the previous round's deployed models) and,
        in the ``last`` round, the evaluation-only phase measuring this round's."""
        t0 = time.time()
        self._checked = RoundLog(rnd, [], 0, 0)
        messages = self.messages_for_round(rnd, self.sample_nodes(grid))
        self.validator.expect(messages)
        eval_down = sum(protocol.eval_nbytes(m.content) for m in messages)  # a model sent for evaluation only
        down = sum(protocol.record_nbytes(m.content) for m in messages) - eval_down
        replies = list(grid.send_and_receive(messages, timeout=timeout)) if messages else []
        parsed = self.validate(rnd, replies)
        up = sum(r.nbytes for r in parsed)  # the accepted replies' bytes (the rejected ones: bytes_up_rejected)
        parsed.sort(key=lambda r: r.client_id)  # replies arrive in any order (Ray): sums over clients must not depend on it
        skipped = len(parsed) < self.cfg.strategy.min_clients
        if skipped:
            self.skip_round(rnd, f"round skipped: {len(parsed)} usable replies, fewer than strategy.min_clients="
                                 f"{self.cfg.strategy.min_clients} (no aggregation)")
        extra = {} if skipped else self.aggregate(rnd, parsed)
        if not skipped:
            self.last_extra = dict(extra)
        entry = RoundLog(rnd, parsed, down, up, eval_bytes_down=eval_down, extra=dict(extra), sent=len(messages),
                         received=len(replies), skipped=skipped,
                         errors=[str(m.error.reason) for m in replies if m.has_error()])
        deployed = protocol.metric_name(protocol.DEPLOYED_TAG, "acc")
        if rnd > 1 and self.measures_round(rnd - 1):
            entry.measurements.append(Measurement(rnd - 1, [r for r in parsed if deployed in r.metrics]))
        if last:
            self.final_evaluation(grid, rnd, timeout, entry)
        for m in entry.measurements:
            stats = accuracy_stats([r.metrics for r in m.replies], protocol.DEPLOYED_TAG)
            if stats:
                self.last_measured = {"round": m.round, "clients": len(m.replies), **stats}
        entry.replies_ok, entry.replies_rejected = self._checked.replies_ok, self._checked.replies_rejected
        entry.replies_missing, entry.rejections = self._checked.replies_missing, list(self._checked.rejections)
        entry.bytes_up_rejected, entry.skips = self._checked.bytes_up_rejected, list(self._checked.skips)
        if entry.replies_missing:
            log.warning("round %d: %d of the replies asked for did not arrive within %.0f s", rnd, entry.replies_missing,
                        timeout)
        entry.wall_seconds = time.time() - t0
        return entry


def _state_value(value: Any, where: str) -> Any:
    """A checkpointable copy of an attribute's value: tensors on the CPU; torch modules refused (see state_dict)."""
    if isinstance(value, torch.nn.Module):
        raise TypeError(f"{where} is a torch module: override state_dict/load_state_dict to save its state_dict")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the mapping's type (a defaultdict keeps its factory)
        out.clear()
        out.update((k, _state_value(v, f"{where}[{k!r}]")) for k, v in value.items())
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_state_value(v, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def with_evaluations(ops: list[str], deployed: DeployedModel, measure: bool, strategy: str = "") -> list[str]:
    """A round message's operations with the protocol's evaluations: ``deployed.prepare``, then (``measure``)
    the deployed model's evaluation (and its companions'), then the strategy's other operations, then the
    after-training evaluation."""
    k = len(deployed.prepare)
    if tuple(ops[:k]) != deployed.prepare:
        raise RuntimeError(f"strategy '{strategy}': round operations {ops} must start with its deployed model's "
                           f"preparation {list(deployed.prepare)}")
    return [*ops[:k], *(deployed.ops if measure else []), *ops[k:], f"evaluate:{protocol.AFTER_TAG}"]


def round_metrics(entry: RoundLog) -> MetricRecord:
    """A round's training phase as Flower metrics: replies, the accuracy after local training and the numeric
    strategy extras (the deployed models' accuracy is :func:`measurement_metrics`, filed under its round)."""
    out: dict[str, Any] = {"clients": len(entry.replies)}
    out.update(after_training_stats([r.metrics for r in entry.replies]))
    out.update({k: float(v) for k, v in entry.extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(float(v))})
    return MetricRecord(out)


def reply_nbytes(msg: Message) -> int:
    """Payload bytes of a reply (:func:`protocol.record_nbytes`; 0 for an error reply, or one that cannot be
    measured: counting never fails a round)."""
    try:
        return 0 if msg.has_error() else protocol.record_nbytes(msg.content)
    except Exception:  # noqa: BLE001 - a hostile reply of any shape
        return 0


def by_client_id(node_ids: list[int], node_to_client: Mapping[int, int]) -> list[int]:
    """``node_ids`` ordered by the client each serves; nodes of unknown client last, by node id."""
    unknown = float("inf")
    return sorted(node_ids, key=lambda n: (node_to_client.get(n, unknown), n))


def sample_ids(ids: list[int], k: int, rng: np.random.Generator) -> list[int]:
    """k distinct ids drawn without replacement, sorted. The draw is over POSITIONS: node ids are unsigned 64-bit
    and a numpy array of them becomes float64 once one is >= 2**63, which silently rounds off their low bits."""
    picks = rng.choice(len(ids), size=k, replace=False)
    return sorted(int(ids[int(i)]) for i in picks)


def measurement_metrics(m: Measurement) -> MetricRecord:
    """A deployed-model measurement as Flower metrics: clients measured, accuracy (mean over clients and
    sample-weighted) and weighted loss."""
    return MetricRecord({"clients": len(m.replies),
                         **accuracy_stats([r.metrics for r in m.replies], protocol.DEPLOYED_TAG)})


def weighted_average(arrays: list[Mapping[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
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
            for wi, a in zip(w, arrays):
                acc += wi * a[key]
            out[key] = acc.astype(first.dtype)
        else:
            out[key] = first.copy()
    return out


def clip_replies_to_median(replies: list[ClientReply], sent: list[Mapping[str, np.ndarray]], factor: float,
                           who: str) -> tuple[list[ClientReply], dict[str, Any]]:
    """A personalising strategy's ``median_clip``: each reply's update (its arrays minus ``sent[i]``, the model its
    message carried) clipped to ``factor`` × the median update norm of all of them (:func:`fedapps.server.robust.
    clip_to_median`); the replies with the clipped arrays and the round's extras (the bound, how many were clipped),
    the clipping logged under ``who``."""
    clipped, bound, norms = clip_to_median([r.arrays for r in replies], sent, factor)
    over = [n for n in norms if n > bound]
    if over:
        log.info("%s median_clip %g: %d of %d updates clipped to %.3g (largest %.3g)", who, factor, len(over),
                 len(norms), bound, max(over))
    return [dataclasses.replace(r, arrays=a) for r, a in zip(replies, clipped)], {"clip_bound": bound,
                                                                                  "clipped": len(over)}


def average_matching(replies: list[ClientReply], current: Mapping[str, np.ndarray],
                     rule: AggregationRule | None = None) -> dict[str, np.ndarray]:
    """Sample-weighted mean (or ``rule``'s robust combination, :mod:`fedapps.server.robust`) of the replies whose arrays
    have exactly ``current``'s keys and shapes (others are ignored); ``current`` itself when none has. With
    ``rule.clip_update_norm`` > 0 each reply's update (its arrays minus ``current``, the model the round sent) is
    first clipped to that L2 norm (:func:`fedapps.server.robust.clip_update`). Integer arrays (e.g. BN counters) take the
    first client's, as in :func:`weighted_average`. The result has ``current``'s dtypes, whatever a reply's."""
    usable = [r for r in replies if r.arrays is not None and set(r.arrays) == set(current)
              and all(np.shape(r.arrays[k]) == np.shape(v) for k, v in current.items())]
    if not usable:
        return dict(current)
    arrays = [r.arrays for r in usable]
    if rule is not None and rule.clip_update_norm > 0:
        clipped = [clip_update(a, current, rule.clip_update_norm) for a in arrays]
        arrays = [a for a, _ in clipped]
        over = [norm for _, norm in clipped if norm > rule.clip_update_norm]
        if over:
            log.info("clip_update_norm %g: %d of %d updates clipped (largest norm %.3g)", rule.clip_update_norm,
                     len(over), len(arrays), max(over))
    weights = [r.num_examples for r in usable]
    if rule is not None and rule.method == "trimmed-mean" and int(rule.trim_fraction * len(arrays)) == 0:
        log.warning("trimmed-mean: %d replies and strategy.trim_fraction %g trim no client this time (the config's "
                    "cohort would); the unweighted mean of the %d is used", len(arrays), rule.trim_fraction, len(arrays))
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
