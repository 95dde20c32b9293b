"""The evaluation protocol (docs/evaluation.md), owned here for every strategy: client i's DEPLOYED model after
round r (what it would use for inference if the federation stopped after round r's server step) is evaluated
on its evaluation split at the start of round r+1's message, before any training, and, for the last round R,
by one evaluation-only message to every connected client; the measurement is attributed to round r. Every
round message also evaluates the client's model right after its local training ("after training", the second
column). Neither the strategies nor the clients choose when; a strategy only says what its deployed model is
(``fedapps.server.strategy.DeployedModel``). Which rounds are measured is the top-level ``evaluate_every`` k
(:func:`fedapps.server.rounds.measured_round`: rounds k, 2k, ... and the last); in an unmeasured round neither
evaluation runs, and the results leave that round's accuracy cells empty."""

from __future__ import annotations

import dataclasses

from flwr.app import ArrayRecord, Message

from fedapps.flower import MessageGrid
from fedapps.server.rounds import Measurement, RoundLog
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy
from fedapps.server.transport import with_transport
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply


class EvaluationProtocol:
    """The protocol's messages for one strategy: its round messages with the evaluations added, and the
    evaluation-only messages after the last round (validated by the strategy's reply checks); its nodes say which
    client each node is, ``strategy.transport`` how arrays travel."""

    def __init__(self, strategy: PersonalisedStrategy) -> None:
        self.strategy = strategy
        self.nodes = strategy.nodes
        self.replies = strategy.replies
        self.transport = strategy.cfg.strategy.transport

    def messages_for_round(self, server_round: int, node_ids: list[int]) -> list[Message]:
        """The strategy's round messages with the protocol's evaluations added: the deployed model of the
        previous round first (after the ``deployed.prepare`` operations, before any training; from round 2 on,
        where the strategy's ``measures_round`` says so), the model after local training last;
        ``strategy.transport`` applied (:func:`fedapps.server.transport.with_transport`)."""
        s = self.strategy
        messages = s.round_messages(server_round, node_ids)
        d = s.deployed
        measure = server_round > 1 and s.measures_round(server_round - 1)
        after = s.measures_round(server_round)
        models: list[tuple[str, ArrayRecord] | None] = [None] * len(messages)
        if measure and d.source == "server":
            models = s.evaluation_models([self.nodes.node_to_client.get(int(m.metadata.dst_node_id)) for m in messages])
        requests = protocol.RequestMemo()  # messages sharing settings share their decoded and rewritten requests
        for msg, model in zip(messages, models):
            request = requests.of(msg)
            ops = with_evaluations(
                list(request.ops), d, measure and (d.source != "server" or model is not None), s.name, after
            )
            evaluation = protocol.Evaluation(model[0]) if model is not None else request.evaluation
            protocol.with_request(msg, requests.replaced(request, ops=tuple(ops), evaluation=evaluation))
            if model is not None:
                msg.content[protocol.EVAL_ARRAYS] = model[1]
        return with_transport(messages, self.transport)

    def deployed_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        """Evaluation-only messages measuring the deployed models after round ``server_round`` − 1: round
        ``server_round``'s message cut down to the deployed model's operations (nothing trained, nothing sent
        back, the client's model read but not written). Clients without a deployed model are left out;
        ``strategy.transport`` applied (:func:`fedapps.server.transport.with_transport`)."""
        return with_transport(self._deployed_messages(server_round, node_ids), self.transport)

    def _deployed_messages(self, server_round: int, node_ids: list[int]) -> list[Message]:
        s = self.strategy
        d = s.deployed
        ops = (*d.prepare, *d.ops)
        out: list[Message] = []
        if d.source == "message":  # the round message, nothing sent back, the client's model read but not written
            for msg in s.round_messages(server_round, node_ids):
                r = protocol.request_of(msg)
                request = dataclasses.replace(
                    r,
                    ops=ops,
                    round=server_round,
                    returns=dataclasses.replace(r.returns, arrays=False),
                    keep=dataclasses.replace(r.keep, save=False),
                )
                arrays = msg.content.array_records[protocol.ARRAYS] if protocol.ARRAYS in msg.content else None
                out.append(
                    protocol.build_message(
                        int(msg.metadata.dst_node_id), request, arrays=arrays, message_type=protocol.EVAL_MESSAGE_TYPE
                    )
                )
            return out
        request = s.request(server_round, ops, returns=protocol.Return(arrays=False), keep=protocol.Keep(save=False))
        if d.source == "client":
            return [protocol.build_message(n, request, message_type=protocol.EVAL_MESSAGE_TYPE) for n in node_ids]
        models = s.evaluation_models([self.nodes.node_to_client.get(n) for n in node_ids])
        return [
            protocol.build_message(
                n,
                dataclasses.replace(request, evaluation=protocol.Evaluation(model[0])),
                eval_arrays=model[1],
                message_type=protocol.EVAL_MESSAGE_TYPE,
            )
            for n, model in zip(node_ids, models)
            if model is not None
        ]

    def final_evaluation(self, grid: MessageGrid, rnd: int, timeout: float, entry: RoundLog) -> None:
        """The deployed models after the last round ``rnd``: one evaluation-only message to EVERY connected
        client (sampled this round or not), filed as round ``rnd``'s measurement; its bytes are evaluation
        traffic. Sent in batches of a training round's cohort, one after another, so that the server holds no
        more messages at once than in a round (a personalised model per client: cwFedAvg's 1,000 clients held
        ~17 GB when sent at once, docs/performance.md); each batch gets ``timeout``."""
        nodes = sorted(int(n) for n in grid.get_node_ids() if int(n) not in self.nodes.excluded)
        batch = max(1, self.nodes.cohort_size(len(nodes)))
        parsed: list[ClientReply] = []
        sent = 0
        for start in range(0, len(nodes), batch):
            messages = self.deployed_messages(rnd + 1, nodes[start : start + batch])
            if not messages:
                continue
            sent += len(messages)
            self.replies.validator.expect(messages)
            entry.eval_bytes_down += sum(protocol.record_nbytes(m.content) for m in messages)
            replies = list(grid.send_and_receive(messages, timeout=timeout))
            accepted = self.replies.validate(rnd, replies, phase=protocol.EVAL_MESSAGE_TYPE)
            self.nodes.bind(accepted)
            entry.eval_bytes_up += sum(r.nbytes for r in accepted)
            parsed += accepted
            del messages, replies
        if not sent:
            self.replies.skip_round(rnd, "no client has a deployed model to evaluate after the last round")
            return
        parsed.sort(key=lambda r: r.client_id)
        entry.measurements.append(Measurement(rnd, parsed, final=True))


def with_evaluations(
    ops: list[str], deployed: DeployedModel, measure: bool, strategy: str = "", after: bool = True
) -> list[str]:
    """A round message's operations with the protocol's evaluations: ``deployed.prepare``, then (``measure``)
    the deployed model's evaluation (and its companions'), then the strategy's other operations, then (``after``:
    the round is measured) the after-training evaluation."""
    k = len(deployed.prepare)
    if tuple(ops[:k]) != deployed.prepare:
        raise RuntimeError(
            f"strategy '{strategy}': round operations {ops} must start with its deployed model's "
            f"preparation {list(deployed.prepare)}"
        )
    after_ops = [f"evaluate:{protocol.AFTER_TAG}"] if after else []
    return [*ops[:k], *(deployed.ops if measure else []), *ops[k:], *after_ops]
