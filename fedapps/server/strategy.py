"""The algorithm contract of every strategy (:class:`PersonalisedStrategy`): what its deployed model is
(:class:`DeployedModel`), the round's messages (``round_messages``, on the settings every message carries,
``request``), the aggregation of the validated replies (``aggregate``), its state as data (``state_dict``) and
what it measured — per-round extras from ``aggregate``, summary entries from ``final_summary``, artefacts as data
from ``artifacts`` — for the result sinks to write.

The services an algorithm uses are built with it, from its config and :class:`RunContext` (nothing is wired
afterwards): ``nodes`` (:class:`fedapps.server.sampling.NodeSampler`: the seeded cohort and which client each node
is), ``replies`` (:class:`fedapps.server.replies.ReplyChecks`: reply validation and what the algorithm left out,
``skip_reply`` / ``skip_round``) and ``history`` (:class:`fedapps.server.rounds.RoundHistory`: the last extras and
measurement, for the summary). The strategy is run by :class:`fedapps.server.driver.RoundDriver` (the round loop,
``RoundDriver(strategy).start(grid)``, and the checkpoint of the loop's state), which adds the evaluation protocol
(:class:`fedapps.server.evaluation.EvaluationProtocol`, docs/evaluation.md). Helpers several algorithms aggregate with
are in :mod:`fedapps.server.aggregation`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedapps.config import CLIENT_SIDE_PRIVACY_MODES, ExperimentConfig, PrivacyConfig
from fedapps.reporting.results import Artifact
from fedapps.server import strategy_checks as checks
from fedapps.server.client_privacy import ClientLevelDP
from fedapps.server.replies import ReplyChecks
from fedapps.server.robust import AggregationRule
from fedapps.server.rounds import RoundHistory, RoundLog, measured_round
from fedapps.server.sampling import NodeSampler
from fedapps.server.state import restore_state, state_of
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import ReplyValidator


@dataclass
class NoParams:
    """A strategy without parameters of its own."""


DEPLOYED_SOURCES = ("client", "message", "server")
REPLY_KINDS = ("arrays", "predictions", "metrics")


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
    # nodes refused before round 1 (data.source 'nodes': their data do not fit, see fedapps.flower.describe): never
    # sampled
    excluded_nodes: frozenset[int] = frozenset()


class PersonalisedStrategy:
    """Base class of the algorithms: a subclass says what its deployed model is, builds the round's messages and
    aggregates the replies; its services (built here) and the round driver do the rest (see the module docstring).
    It is not Flower's ``Strategy`` (one global model in a configure/aggregate loop): docs/development.md says why."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams  # a dataclass of fedapps.params.param fields: strategy.params.<name>.*
    needs_public_set: ClassVar[bool] = False
    model_agnostic: ClassVar[bool] = False  # may clients run different architectures?
    # what the algorithm does with the model's classifier head (its final nn.Linear, one output per class), said
    # when a user's own model (model.name package.module:factory) has none; '' when it needs none
    needs_classifier: ClassVar[str] = ""
    # parameters that became settings elsewhere: old name -> new key (``strategy.params.<name>.<old>`` is refused
    # with a message pointing at the new key)
    moved_params: ClassVar[dict[str, str]] = {}
    deployed: ClassVar[DeployedModel]  # what client i's deployed model after round r is (every strategy says)
    # what its clients' round replies carry besides metrics (REPLY_KINDS): model ``arrays`` (the default),
    # ``predictions`` on the public set U (the pseudo-label strategies) or ``metrics`` only (nothing to aggregate)
    reply_kind: ClassVar[str] = "arrays"
    robust_aggregation: ClassVar[bool] = False  # averages with average_matching: strategy.aggregation applies
    # why DP-SGD on the clients' training (privacy.mode: sample) cannot bound what this algorithm's clients send:
    # something they compute from their data outside the noisy steps; '' when it can (docs/privacy.md)
    sample_privacy_refused: ClassVar[str] = ""
    # why the server's client-level DP of the pseudo-label exchange (privacy.mode: client) cannot cover this algorithm;
    # '' for the strategies that release through fedapps.server.client_privacy.ClientLevelDP (docs/privacy.md)
    client_privacy_refused: ClassVar[str] = (
        "its clients send the server model parameters (or statistics of their data), not predictions on U; "
        "client-level DP is implemented for the pseudo-label exchange (cosmos, fedmd, fedct, comet) only"
    )
    # Instance attributes that are NOT algorithm state (see :meth:`state_dict`): the config, the run context, the
    # services (their state is the round loop's, saved apart by RoundDriver.checkpoint_state). A subclass names its
    # own non-state attributes (data, devices, caches rebuilt from the config) in its ``checkpoint_exclude``; the sets
    # of every class in the MRO count.
    checkpoint_exclude: ClassVar[frozenset[str]] = frozenset(
        {"cfg", "params", "context", "rng", "rule", "replies", "nodes", "history"}
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.reply_kind not in REPLY_KINDS:
            raise TypeError(f"{cls.__name__}.reply_kind '{cls.reply_kind}'; allowed: {', '.join(REPLY_KINDS)}")

    # ------------------------------------------------------------------ config
    @classmethod
    def read_params(cls, cfg: ExperimentConfig) -> Any:
        """Typed params from ``strategy.params.<name>`` (no section: all defaults), each declared rule checked."""
        return checks.read_params(cls, cfg)

    @classmethod
    def params_from(cls, cfg: ExperimentConfig) -> Any:
        """``read_params`` then ``check_config``: this strategy's params for ``cfg``, ready to run."""
        params = cls.read_params(cfg)
        cls.check_config(cfg, params)
        return params

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: Any) -> None:
        """What no single parameter's declaration can say: checks against the rest of the config (or between
        parameters). Subclasses extend it and call ``super().check_config(cfg, params)`` first; the base checks what
        the class declares (:func:`fedapps.server.strategy_checks.check_declared`)."""
        checks.check_declared(cls, cfg)

    @classmethod
    def require_at_most_clients(cls, cfg: ExperimentConfig, key: str, value: int) -> None:
        """A count parameter (e.g. K cluster models) must not exceed ``data.num_clients``."""
        checks.at_most_clients(f"strategy.params.{cls.name}.{key}", value, cfg)

    # ------------------------------------------------------------------ construction
    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        """``params``: normally from :func:`strategies.resolve` (None: read and checked from ``cfg``);
        ``context``: what the app knows of the run (:class:`RunContext`; None: its defaults). The services are
        built here, once (see the module docstring); none of them holds the strategy."""
        self.cfg = cfg
        self.params = params if params is not None else self.params_from(cfg)
        self.context = context if context is not None else RunContext()
        self.rng = np.random.default_rng(cfg.seed)  # one seeded stream: the cohorts' draws and the algorithm's own
        self.rule = AggregationRule.for_run(cfg)  # for average_matching (robust_aggregation strategies)
        self.replies = ReplyChecks(self.reply_validator(), self.name)  # every reply checked against its message
        self.nodes = NodeSampler(cfg.strategy, self.rng, self.replies, self.context.excluded_nodes)
        self.history = RoundHistory()  # kept by the round driver
        # privacy.mode client: the server's mechanism and its ledger (None otherwise); a strategy that supports the
        # mode releases its aggregates through it
        self.client_dp = ClientLevelDP.for_run(cfg.privacy, cfg.seed)

    def reply_validator(self) -> ReplyValidator:
        """The validator of this strategy's replies, built from ``self.cfg`` alone (it is built before a subclass's
        own state): the config's model and data (a strategy whose replies differ from them says how)."""
        return ReplyValidator.from_config(self.cfg)

    def setup(self) -> protocol.Setup:
        """What every message carries: the data spec, the model spec and the client's training settings."""
        c = self.cfg
        return protocol.Setup(
            data=protocol.data_spec_for_clients(dataclasses.asdict(c.data)),
            model=protocol.ModelSpec(c.model.name, c.seed, tuple(c.model.per_client)),
            client=dataclasses.asdict(c.client),
        )

    def request(self, server_round: int, ops: Iterable[str], **parts: Any) -> protocol.Request:
        """A request of this run: the operations, :meth:`setup`, the run's bookkeeping (where clients keep their
        state), its privacy settings (sent only while a mode the clients apply is on, :func:`message_privacy`: a
        message without them trains as it always did) and ``parts``, the other fields of
        :class:`fedapps.wire.protocol.Request` (load, returns, training, ...)."""
        return protocol.Request(
            ops=tuple(ops),
            round=server_round,
            setup=self.setup(),
            bookkeeping=self.context.client_state,
            privacy=message_privacy(self.cfg.privacy),
            **parts,
        )

    # ------------------------------------------------------------------ to implement
    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        """The round's messages as drafts (:class:`fedapps.wire.protocol.Draft`: node, request, arrays or targets), one
        per sampled node, with the algorithm's own operations only (the deployed model's and the after-training
        evaluations are added by ``EvaluationProtocol.round_drafts``; the driver builds the messages)."""
        raise NotImplementedError

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        """Update server state from this round's validated replies; return extra round metrics."""
        raise NotImplementedError

    def evaluation_models(self, client_ids: list[int | None]) -> list[tuple[str, Mapping[str, np.ndarray]] | None]:
        """``deployed.source == 'server'``: per client (None: not heard from yet) the architecture and arrays of
        its deployed model, or None where it has none yet (then it is not measured)."""
        raise NotImplementedError(
            f"strategy '{self.name}' declares a server-side deployed model: implement evaluation_models"
        )

    def measures_round(self, server_round: int) -> bool:
        """Whether round ``server_round``'s models (deployed, and after local training) are measured: rounds k, 2k, ...
        of the top-level ``evaluate_every`` k, and always the last round."""
        return measured_round(server_round, self.cfg.evaluate_every, self.cfg.rounds)

    def note_cohort(self, node_ids: list[int]) -> None:
        """privacy.mode client: the round's cohort as client ids (-1: a node not identified yet), the public count a
        noisy mean divides by; a strategy whose release is a mean calls it from ``round_messages``."""
        if self.client_dp is not None:
            self.client_dp.cohort = [self.nodes.node_to_client.get(n, -1) for n in node_ids]

    def stop_reason(self, server_round: int) -> str:
        """Why the run must end after round ``server_round`` (privacy.mode client: another release could take a
        client past ``privacy.epsilon_budget``); '' when the next round may run."""
        return self.client_dp.stop_reason(server_round) if self.client_dp is not None else ""

    def final_summary(self) -> dict[str, Any]:
        """Extra keys for summary.json."""
        return {}

    def protocol_summary(self) -> dict[str, Any]:
        """summary.json's description of what the headline measures (written for every strategy)."""
        return {
            "deployed_model": self.deployed.what,
            "deployed_measured": "round r: on round r+1's message before any training; the last round: an "
            "evaluation-only message to every connected client",
        }

    def artifacts(self) -> list[Artifact]:
        """What the strategy measured beyond the per-round record, as data (tables, documents, figure data)."""
        return []

    def final_arrays(self) -> Mapping[str, np.ndarray] | None:
        """The global model at the end, where the algorithm has one (Flower's ``Result.arrays``)."""
        return None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The algorithm's state as data: every instance attribute not named in a ``checkpoint_exclude`` (of any class
        in the MRO). A strategy that keeps torch modules overrides this and :meth:`load_state_dict` (see COSMOS)."""
        return state_of(self, self._checkpoint_excluded())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (onto a strategy built from the same config)."""
        restore_state(self, state, self._checkpoint_excluded())

    @classmethod
    def _checkpoint_excluded(cls) -> frozenset[str]:
        return frozenset(n for klass in cls.__mro__ for n in vars(klass).get("checkpoint_exclude", ()))


def message_privacy(p: PrivacyConfig) -> protocol.Privacy | None:
    """The privacy settings every message carries: under a mode the clients apply (sample: DP-SGD), the fields of
    :class:`fedapps.wire.protocol.Privacy`; None otherwise (off, or client: the server adds the noise)."""
    if p.mode not in CLIENT_SIDE_PRIVACY_MODES:
        return None
    return protocol.Privacy(**{f.name: getattr(p, f.name) for f in dataclasses.fields(protocol.Privacy)})
