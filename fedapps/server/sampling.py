"""Which nodes a round goes to, and which client each node is: the seeded draw of a round's cohort over client ids,
the identify messages that settle a node's client before its first round message, and the bindings a resumed run
keeps (:class:`NodeSampler`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from fedapps.config import StrategyConfig, cohort_size
from fedapps.flower import MessageGrid
from fedapps.server.replies import ReplyChecks
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply

# the strategy's request builder: request(server_round, ops, **parts) -> protocol.Request (fedapps.server.strategy)
RequestBuilder = Callable[..., protocol.Request]

log = logging.getLogger("fedapps")

IDENTIFY_PHASE = "identify"  # rejections.csv's phase of the identify messages (see NodeSampler.identify)


class NodeSampler:
    """A strategy's nodes: ``node_to_client`` (which client each node is, bound from accepted replies) and the
    round's draw, by ``config`` (``strategy.*``: fraction, min_clients, timeout). ``rng``: the run's seeded
    generator (the strategy draws from the same one); ``replies``: the validator that binds identities and the
    round's tally the identify rejections go to; ``excluded``: nodes refused before round 1, never sampled."""

    def __init__(
        self, config: StrategyConfig, rng: np.random.Generator, replies: ReplyChecks, excluded: frozenset[int]
    ) -> None:
        self.config = config
        self.rng = rng
        self.replies = replies
        self.excluded = excluded
        self.node_to_client: dict[int, int] = {}
        self.identify_asked: set[int] = set()  # nodes sent an identify message (each is asked once)

    def bind(self, accepted: Iterable[ClientReply]) -> None:
        """Node ↔ client of validated replies."""
        for r in accepted:
            self.node_to_client[r.node_id] = r.client_id

    def cohort_size(self, connected: int) -> int:
        """Clients per training round out of ``connected``: ceil(fraction·N), at least min_clients, at most N."""
        return cohort_size(connected, self.config.fraction, self.config.min_clients)

    def available_nodes(self, grid: MessageGrid, wait_seconds: float = 120.0) -> list[int]:
        """Connected node ids; waits until at least ``min_clients`` are there (simulation starts empty)."""
        deadline = time.time() + wait_seconds
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= self.config.min_clients or time.time() > deadline:
                return nodes
            time.sleep(0.5)

    def sample_nodes(self, grid: MessageGrid, request: RequestBuilder) -> list[int]:
        """ceil(fraction·N) nodes, at least min_clients (when that many are connected), seeded. Every node is
        identified before it is first sampled (:meth:`identify`; ``request``: the strategy's request builder). The draw
        is over the nodes ordered by CLIENT id:
        node ids are random per run (Flower's simulation draws them afresh), so a draw over them would give the
        same seed another cohort in every run."""
        nodes = [n for n in self.available_nodes(grid) if n not in self.excluded]
        if not nodes:
            raise RuntimeError("no client nodes are connected")
        self.identify(grid, nodes, request)
        k = self.cohort_size(len(nodes))
        if k == len(nodes):
            return nodes
        return sample_ids(by_client_id(nodes, self.node_to_client), k, self.rng)

    def identify(self, grid: MessageGrid, node_ids: list[int], request: RequestBuilder) -> None:
        """Settle which client each node is, once, before its first round message: the nodes of ``node_ids`` whose
        identity is not bound yet (by the describe phase, or an earlier identify) and that were not asked before get
        a message with no operation and the settings every message carries (``request(0, [])``; the client loads its
        data split, trains and stores nothing, and replies with its identity). The validator binds node <-> client id
        on the accepted replies; from then on a reply is
        attributed by its node, and one claiming another client's id is rejected alone (the owner's reply stands).
        A node that does not answer, or is rejected (e.g. two nodes claiming one id: neither gets it), stays
        unbound, is drawn after the known ones, by node id, and is bound by its first accepted round reply.
        Rejections go to the round's record (rejections.csv, phase ``identify``)."""
        validator = self.replies.validator
        for node, client in validator.node_client.items():
            self.node_to_client.setdefault(node, client)
        ask = [n for n in node_ids if n not in validator.node_client and n not in self.identify_asked]
        if not ask:
            return
        self.identify_asked.update(ask)
        query = request(0, [], returns=protocol.Return(arrays=False), keep=protocol.Keep(persist=False, save=False))
        drafts = [protocol.Draft(n, query, message_type=protocol.QUERY_MESSAGE_TYPE) for n in ask]
        validator.expect(drafts)
        messages = protocol.build_messages(drafts)
        t0 = time.time()
        replies = grid.send_and_receive(messages, timeout=self.config.timeout)
        outcome = validator.validate_batch(0, replies, protocol.QUERY_MESSAGE_TYPE)
        self.bind(outcome.accepted)
        self.replies.record_rejections(outcome.rejections, IDENTIFY_PHASE)
        log.info(
            "identified %d of %d nodes (%.1f s)%s",
            len(outcome.accepted),
            len(ask),
            time.time() - t0,
            f"; {len(outcome.rejections)} rejected (rejections.csv)" if outcome.rejections else "",
        )

    def rebind_after_resume(self, connected: Iterable[int]) -> None:
        """A resumed run: the checkpoint's node <-> client bindings of nodes that are not connected now are
        dropped (Flower's simulation gives its nodes new ids in every run), so the nodes now serving those clients
        are identified afresh; a node that is still connected keeps its binding."""
        now = {int(n) for n in connected}
        gone = [n for n in self.replies.validator.node_client if n not in now]
        self.replies.validator.forget_nodes(gone)
        self.node_to_client = {n: c for n, c in self.node_to_client.items() if n in now}
        if gone:
            log.info(
                "resumed: %d node(s) of the checkpointed run are gone (new node ids); their clients are "
                "identified again",
                len(gone),
            )


def by_client_id(node_ids: list[int], node_to_client: Mapping[int, int]) -> list[int]:
    """``node_ids`` ordered by the client each serves; nodes of unknown client last, by node id."""
    unknown = float("inf")
    return sorted(node_ids, key=lambda n: (node_to_client.get(n, unknown), n))


def sample_ids(ids: list[int], k: int, rng: np.random.Generator) -> list[int]:
    """k distinct ids drawn without replacement, sorted. The draw is over POSITIONS: node ids are unsigned 64-bit
    and a numpy array of them becomes float64 once one is >= 2**63, which silently rounds off their low bits."""
    picks = rng.choice(len(ids), size=k, replace=False)
    return sorted(int(ids[int(i)]) for i in picks)
