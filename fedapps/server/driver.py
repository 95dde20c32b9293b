"""The round loop of a strategy on Flower's Grid (:class:`RoundDriver`): the round's drafts built into messages, each
once, right before they go out, replies in and validated, the strategy's aggregation, the deployed models measured
(:mod:`fedapps.server.evaluation`), every round's record handed to the result sinks, and the state the loop needs to
continue after a checkpointed round. ``start`` returns Flower's ``Result``."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from flwr.app import Message
from flwr.serverapp.strategy import Result

from fedapps.flower import MessageGrid
from fedapps.flower.connect import wait_for_clients
from fedapps.reporting.results import accuracy_stats
from fedapps.server.evaluation import EvaluationProtocol
from fedapps.server.rounds import (
    Measurement,
    RoundLog,
    StepClock,
    measurement_metrics,
    round_metrics,
)
from fedapps.server.strategy import PersonalisedStrategy
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply, Draft

log = logging.getLogger("fedapps")


class RoundDriver:
    """Drives one strategy: one message phase per round (plus the evaluation-only one after the last round). The
    strategy's ``nodes`` sample and identify, its ``replies`` validate and tally, the :class:`EvaluationProtocol`
    adds the evaluations; every round's record goes to the strategy's ``context.on_round`` (the result sinks and the
    checkpoint). The driver holds the strategy, never the other way round: a strategy nothing else holds is freed."""

    def __init__(self, strategy: PersonalisedStrategy) -> None:
        self.strategy = strategy
        self.nodes = strategy.nodes
        self.replies = strategy.replies
        self.history = strategy.history
        self.evaluation = EvaluationProtocol(strategy)

    def start(
        self, grid: MessageGrid, num_rounds: int | None = None, timeout: float | None = None, first_round: int = 1
    ) -> Result:
        """The round loop: messages out, replies in, aggregate, optional evaluation phase, record.
        ``first_round`` > 1 continues a run restored with :meth:`load_checkpoint_state`.

        Returns Flower's ``Result``: per round the aggregated client metrics (``train_metrics_clientapp``), the
        deployed models' accuracy filed under the round it measures (``evaluate_metrics_clientapp``), and the final
        global model (``arrays``) where the algorithm has one."""
        cfg = self.strategy.cfg
        num_rounds = num_rounds or cfg.rounds
        timeout = timeout or cfg.strategy.timeout
        log.info("strategy %s, params: %s", self.strategy.name, self.strategy.params)
        connected = wait_for_clients(
            grid, cfg.strategy.expected_clients or cfg.data.num_clients, cfg.strategy.connect_timeout
        )
        if first_round > 1:
            self.nodes.rebind_after_resume(connected)
        result = Result()
        if first_round > 1 and self.history.stopped:  # a resumed run that had ended early: nothing more to run
            log.warning(
                "the run ended after round %s: %s", self.history.stopped["round"], self.history.stopped["reason"]
            )
            first_round = num_rounds + 1
        for rnd in range(first_round, num_rounds + 1):
            entry = self.run_round(grid, rnd, timeout, last=rnd == num_rounds)
            result.train_metrics_clientapp[rnd] = round_metrics(entry)
            for m in entry.measurements:  # the deployed models, filed under the round they belong to
                result.evaluate_metrics_clientapp[m.round] = measurement_metrics(m)
            if self.strategy.context.on_round is not None:
                self.strategy.context.on_round(entry)
            if self.history.stopped:
                break
        final = self.strategy.final_arrays()
        if final is not None:
            result.arrays = protocol.arrays_record(final)
        return result

    def run_round(self, grid: MessageGrid, rnd: int, timeout: float, last: bool = False) -> RoundLog:
        """One round: the training phase (whose messages also measure the previous round's deployed models) and,
        in the ``last`` round, the evaluation-only phase measuring this round's. A round after which the strategy
        says the run must end (``stop_reason``: a privacy budget) is the last one: the history records why."""
        t0 = time.time()
        clock = StepClock()
        self.replies.begin(rnd)
        drafts = self.evaluation.round_drafts(rnd, self.nodes.sample_nodes(grid, self.strategy.request))
        messages = self.build(drafts)
        eval_down = sum(protocol.eval_nbytes(m.content) for m in messages)  # a model sent for evaluation only
        down = sum(protocol.record_nbytes(m.content) for m in messages) - eval_down
        clock.done("messages")
        replies = list(grid.send_and_receive(messages, timeout=timeout)) if messages else []
        clock.done("exchange")
        parsed = self.replies.validate(rnd, replies)
        self.nodes.bind(parsed)
        clock.done("replies")
        up = sum(r.nbytes for r in parsed)  # the accepted replies' bytes (the rejected ones: bytes_up_rejected)
        parsed.sort(
            key=lambda r: r.client_id
        )  # replies arrive in any order (Ray): sums over clients must not depend on it
        min_clients = self.strategy.cfg.strategy.min_clients
        skipped = len(parsed) < min_clients
        if skipped:
            self.replies.skip_round(
                rnd,
                f"round skipped: {len(parsed)} usable replies, fewer than "
                f"strategy.min_clients={min_clients} (no aggregation)",
            )
        extra = {} if skipped else self.strategy.aggregate(rnd, parsed)
        clock.done("aggregate")
        if not skipped:
            self.history.last_extra = dict(extra)
        stop = "" if last else self.strategy.stop_reason(rnd)
        if stop:
            log.warning("round %d: %s", rnd, stop)
            self.history.stopped = {"round": rnd, "of": self.strategy.cfg.rounds, "reason": stop}
            last = True
        entry = RoundLog(
            rnd,
            parsed,
            down,
            up,
            eval_bytes_down=eval_down,
            extra=dict(extra),
            sent=len(messages),
            received=len(replies),
            skipped=skipped,
            errors=[str(m.error.reason) for m in replies if m.has_error()],
            steps=clock.seconds,
        )
        deployed = protocol.metric_name(protocol.DEPLOYED_TAG, "acc")
        if rnd > 1 and self.strategy.measures_round(rnd - 1):
            entry.measurements.append(Measurement(rnd - 1, [r for r in parsed if deployed in r.metrics]))
        if last:
            self.final_evaluation(grid, rnd, timeout, entry)
        for m in entry.measurements:
            stats = accuracy_stats([r.metrics for r in m.replies], protocol.DEPLOYED_TAG)
            if stats:
                self.history.last_measured = {"round": m.round, "clients": len(m.replies), **stats}
        self.replies.fill(entry)
        if entry.replies_missing:
            log.warning(
                "round %d: %d of the replies asked for did not arrive within %.0f s",
                rnd,
                entry.replies_missing,
                timeout,
            )
        entry.wall_seconds = time.time() - t0
        return entry

    def build(self, drafts: list[Draft]) -> list[Message]:
        """The messages of a batch of drafts, each built once (:func:`fedapps.wire.message.build_messages`), right
        before they are sent; the reply validator first records what each must be answered with."""
        self.replies.validator.expect(drafts)
        return protocol.build_messages(drafts)

    def final_evaluation(self, grid: MessageGrid, rnd: int, timeout: float, entry: RoundLog) -> None:
        """The deployed models after the last round ``rnd``: one evaluation-only message to EVERY connected
        client, in the evaluation protocol's batches (:meth:`EvaluationProtocol.final_batches`) sent one after
        another, each given ``timeout``; filed as round ``rnd``'s measurement, its bytes evaluation traffic."""
        parsed: list[ClientReply] = []
        sent = 0
        for drafts in self.evaluation.final_batches(grid, rnd):
            messages = self.build(drafts)
            sent += len(messages)
            entry.eval_bytes_down += sum(protocol.record_nbytes(m.content) for m in messages)
            replies = list(grid.send_and_receive(messages, timeout=timeout))
            accepted = self.replies.validate(rnd, replies, phase=protocol.EVAL_MESSAGE_TYPE)
            self.nodes.bind(accepted)
            entry.eval_bytes_up += sum(r.nbytes for r in accepted)
            parsed += accepted
            del drafts, messages, replies
        if not sent:
            self.replies.skip_round(rnd, "no client has a deployed model to evaluate after the last round")
            return
        parsed.sort(key=lambda r: r.client_id)
        entry.measurements.append(Measurement(rnd, parsed, final=True))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything the round loop needs to continue after a round: the algorithm's state, the sampling RNG,
        which node is which client, the last extras."""
        v = self.replies.validator
        return {
            "strategy": self.strategy.state_dict(),
            "rng": self.nodes.rng.bit_generator.state,
            "node_to_client": dict(self.nodes.node_to_client),
            "last_extra": dict(self.history.last_extra),
            "last_measured": dict(self.history.last_measured),
            "stopped": dict(self.history.stopped),
            "identity": {
                "node_client": dict(v.node_client),
                "client_node": dict(v.client_node),
                "bound_examples": dict(v.bound_examples),
                "bound_tests": dict(v.bound_tests),
            },
        }

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`checkpoint_state` returned (onto a strategy built from the same config)."""
        self.strategy.load_state_dict(state["strategy"])
        self.nodes.rng.bit_generator.state = state["rng"]  # the strategy's generator too: it is the same one
        self.nodes.node_to_client = dict(state["node_to_client"])
        self.history.last_extra = dict(state["last_extra"])
        self.history.last_measured = dict(state.get("last_measured", {}))
        self.history.stopped = dict(state.get("stopped", {}))
        identity = state.get("identity", {})  # node <-> client bindings survive a resumption
        self.replies.validator.node_client = dict(identity.get("node_client", {}))
        self.replies.validator.client_node = dict(identity.get("client_node", {}))
        self.replies.validator.bound_examples = dict(identity.get("bound_examples", {}))
        self.replies.validator.bound_tests = dict(identity.get("bound_tests", {}))
