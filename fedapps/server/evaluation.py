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
from collections.abc import Iterator, Mapping

import numpy as np

from fedapps.flower import MessageGrid
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy
from fedapps.server.transport import with_transport
from fedapps.wire import protocol
from fedapps.wire.protocol import Draft


class EvaluationProtocol:
    """The protocol's drafts for one strategy: its round drafts with the evaluations added, and the evaluation-only
    drafts after the last round (the round driver builds and sends them); its nodes say which client each node is,
    ``strategy.transport`` how arrays travel."""

    def __init__(self, strategy: PersonalisedStrategy) -> None:
        self.strategy = strategy
        self.nodes = strategy.nodes
        self.replies = strategy.replies
        self.transport = strategy.cfg.strategy.transport

    def round_drafts(self, server_round: int, node_ids: list[int]) -> list[Draft]:
        """The strategy's round drafts with the protocol's evaluations added: the deployed model of the previous
        round first (after the ``deployed.prepare`` operations, before any training; from round 2 on, where the
        strategy's ``measures_round`` says so), the model after local training last; ``strategy.transport`` applied
        (:func:`fedapps.server.transport.with_transport`). Drafts that shared a request share the rewritten one."""
        s = self.strategy
        drafts = s.round_messages(server_round, node_ids)
        d = s.deployed
        measure = server_round > 1 and s.measures_round(server_round - 1)
        after = s.measures_round(server_round)
        models: list[tuple[str, Mapping[str, np.ndarray]] | None] = [None] * len(drafts)
        if measure and d.source == "server":
            models = s.evaluation_models([self.nodes.node_to_client.get(draft.node) for draft in drafts])
        rewritten: dict[tuple[int, str | None], tuple[protocol.Request, protocol.Request]] = {}
        for draft, model in zip(drafts, models):
            request = draft.request
            key = (id(request), None if model is None else model[0])
            found = rewritten.get(key)
            if found is None or found[0] is not request:
                ops = with_evaluations(
                    list(request.ops), d, measure and (d.source != "server" or model is not None), s.name, after
                )
                evaluation = protocol.Evaluation(model[0]) if model is not None else request.evaluation
                found = rewritten[key] = (request, dataclasses.replace(request, ops=tuple(ops), evaluation=evaluation))
            draft.request = found[1]
            if model is not None:
                draft.eval_arrays = model[1]
        return with_transport(drafts, self.transport)

    def deployed_drafts(self, server_round: int, node_ids: list[int]) -> list[Draft]:
        """Evaluation-only drafts measuring the deployed models after round ``server_round`` − 1: round
        ``server_round``'s message cut down to the deployed model's operations (nothing trained, nothing sent
        back, the client's model read but not written). Clients without a deployed model are left out;
        ``strategy.transport`` applied (:func:`fedapps.server.transport.with_transport`)."""
        s = self.strategy
        d = s.deployed
        ops = (*d.prepare, *d.ops)
        if d.source == "message":  # the round message, nothing sent back, the client's model read but not written
            drafts = s.round_messages(server_round, node_ids)
            cut: dict[int, tuple[protocol.Request, protocol.Request]] = {}
            for draft in drafts:
                r = draft.request
                found = cut.get(id(r))
                if found is None or found[0] is not r:
                    found = cut[id(r)] = (
                        r,
                        dataclasses.replace(
                            r,
                            ops=ops,
                            round=server_round,
                            returns=dataclasses.replace(r.returns, arrays=False),
                            keep=dataclasses.replace(r.keep, save=False),
                        ),
                    )
                draft.request, draft.targets = found[1], None
                draft.message_type = protocol.EVAL_MESSAGE_TYPE
            return with_transport(drafts, self.transport)
        request = s.request(server_round, ops, returns=protocol.Return(arrays=False), keep=protocol.Keep(save=False))
        if d.source == "client":
            return with_transport(
                [Draft(n, request, message_type=protocol.EVAL_MESSAGE_TYPE) for n in node_ids], self.transport
            )
        models = s.evaluation_models([self.nodes.node_to_client.get(n) for n in node_ids])
        named: dict[str, protocol.Request] = {}
        drafts = []
        for n, model in zip(node_ids, models):
            if model is None:
                continue
            if model[0] not in named:
                named[model[0]] = dataclasses.replace(request, evaluation=protocol.Evaluation(model[0]))
            drafts.append(Draft(n, named[model[0]], eval_arrays=model[1], message_type=protocol.EVAL_MESSAGE_TYPE))
        return with_transport(drafts, self.transport)

    def final_batches(self, grid: MessageGrid, rnd: int) -> Iterator[list[Draft]]:
        """The deployed models after the last round ``rnd``: evaluation-only drafts for EVERY connected client
        (sampled this round or not), in batches of a training round's cohort, so that the server holds no more
        messages at once than in a round (a personalised model per client, docs/performance.md). A batch with no
        deployed model to evaluate is left out."""
        nodes = sorted(int(n) for n in grid.get_node_ids() if int(n) not in self.nodes.excluded)
        batch = max(1, self.nodes.cohort_size(len(nodes)))
        for start in range(0, len(nodes), batch):
            drafts = self.deployed_drafts(rnd + 1, nodes[start : start + batch])
            if drafts:
                yield drafts


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
