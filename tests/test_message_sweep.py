"""fedapps.flower.message_sweep: the one-pass message sweep hands out exactly what Flower's per-node sweep does, on a
real InMemoryLinkState filled through Flower's own InMemoryGrid (as in Flower's simulation)."""

from __future__ import annotations

import sys
import threading
from queue import Queue

import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from fedapps.flower import message_sweep

RUN_ID, TASK_ID = 7, 11


@pytest.fixture
def task_identity(monkeypatch):
    """The ServerApp's identity Flower's InMemoryGrid stamps on messages (restored after the test)."""
    monkeypatch.setattr(TaskIdentity, "_task_id", TASK_ID)
    monkeypatch.setattr(TaskIdentity, "_run_id", RUN_ID)
    monkeypatch.setattr(TaskIdentity, "_node_id", SUPERLINK_NODE_ID)


def filled_state(num_nodes: int, messages_per_node: list[int], expired: set[tuple[int, int]] = frozenset()):
    """A simulation's LinkState with ``num_nodes`` nodes; node i gets ``messages_per_node[i]`` messages, pushed
    round-robin; (node, k) in ``expired`` has its TTL run out. Returns (state, node ids, {message id: (node, k)})."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    nodes = list(vce_api._register_nodes(num_nodes=num_nodes, state_factory=factory))
    state = factory.state()
    run = Run.create_empty(run_id=RUN_ID)
    run.primary_task_id, run.federation_id = TASK_ID, NOOP_FEDERATION_ID
    state.run_ids[RUN_ID] = RunRecord(run=run)
    state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=RUN_ID)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    roles = {}
    for k in range(max(messages_per_node)):
        for i, count in enumerate(messages_per_node):
            if k < count:
                (msg_id,) = grid.push_messages([Message(RecordDict(), dst_node_id=nodes[i], message_type="train")])
                roles[msg_id] = (i, k)
                if (i, k) in expired:
                    metadata = state.message_ins_store[msg_id].metadata
                    metadata.created_at -= metadata.ttl + 1.0
    return state, nodes, roles


def flower_sweep_once(state, nodes):
    """One pass of the loop in Flower's vce_api.add_messages_to_queue: get_message_ins(node, limit=1) per node."""
    return [m for node in nodes for m in state.get_message_ins(node_id=node, limit=1)]


def sweeps(sweep_once, state, nodes, roles, times=4):
    """The (node, k) handed out by each of ``times`` successive sweeps."""
    return [sorted(roles[m.metadata.message_id] for m in sweep_once(state, nodes)) for _ in range(times)]


def one_pass_once(state, nodes):
    return message_sweep.deliverable_messages(state, set(nodes))


def test_one_pass_hands_out_what_flowers_sweep_does(task_identity):
    """Node 0 has 3 messages (one per sweep), node 1 two (its first expired: dropped), node 2 one, node 3 none;
    node 4's message goes to a node the sweep does not serve."""
    shape = dict(num_nodes=5, messages_per_node=[3, 2, 1, 0, 1], expired={(1, 0)})
    results = {}
    for name, sweep_once in (("flower", flower_sweep_once), ("one-pass", one_pass_once)):
        state, nodes, roles = filled_state(**shape)
        results[name] = sweeps(sweep_once, state, nodes[:4], roles)
        expired_id = next(i for i, r in roles.items() if r == (1, 0))
        assert expired_id not in state.message_ins_store, name  # validation deleted it
        unserved = next(i for i, r in roles.items() if r == (4, 0))
        assert state.message_ins_store[unserved].metadata.delivered_at == "", name
    assert results["flower"] == [[(0, 0), (1, 1), (2, 0)], [(0, 1)], [(0, 2)], []]
    assert results["one-pass"] == results["flower"]


def test_one_pass_marks_delivered_and_keeps_stored_order(task_identity):
    state, nodes, roles = filled_state(num_nodes=4, messages_per_node=[1, 1, 1, 1])
    order = list(state.message_ins_store)
    handed = one_pass_once(state, list(reversed(nodes)))
    assert [m.metadata.message_id for m in handed] == order  # stored order, whatever the node order
    assert all(m.metadata.delivered_at != "" for m in state.message_ins_store.values())
    assert one_pass_once(state, nodes) == []


def test_installed_sweep_thread_queues_messages_and_stops(task_identity):
    state, nodes, roles = filled_state(num_nodes=3, messages_per_node=[2, 1, 0])
    sweep = message_sweep.one_pass_sweep(vce_api.add_messages_to_queue)
    queue, stop = Queue(), threading.Event()
    thread = threading.Thread(target=sweep, args=(state, queue, {n: i for i, n in enumerate(nodes)}, stop))
    thread.start()
    got = [roles[queue.get(timeout=5).metadata.message_id] for _ in range(3)]
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive() and queue.empty()
    assert sorted(got) == [(0, 0), (0, 1), (1, 0)] and got.index((0, 0)) < got.index((0, 1))


def test_other_linkstates_get_flowers_sweep():
    calls = []
    sweep = message_sweep.one_pass_sweep(lambda *args: calls.append(args))
    args = (object(), Queue(), {1: 0}, threading.Event())
    sweep(*args)
    assert calls == [args]


def test_install_swaps_flowers_sweep_once(monkeypatch):
    flower = getattr(vce_api.add_messages_to_queue, "flower_sweep", vce_api.add_messages_to_queue)
    monkeypatch.setattr(vce_api, "add_messages_to_queue", flower)
    monkeypatch.delenv(message_sweep.ENV, raising=False)
    assert message_sweep.in_use() == "flower"
    assert message_sweep.install()
    installed = vce_api.add_messages_to_queue
    assert installed.flower_sweep is flower and message_sweep.in_use() == "one-pass"
    assert message_sweep.install() and vce_api.add_messages_to_queue is installed  # not wrapped twice


def test_install_can_be_turned_off(monkeypatch):
    flower = getattr(vce_api.add_messages_to_queue, "flower_sweep", vce_api.add_messages_to_queue)
    monkeypatch.setattr(vce_api, "add_messages_to_queue", flower)
    monkeypatch.setenv(message_sweep.ENV, "flower")
    assert not message_sweep.install() and vce_api.add_messages_to_queue is flower


def test_install_is_a_no_op_where_flowers_engine_is_not_loaded(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, message_sweep.VCE_MODULE)
    assert not message_sweep.install() and message_sweep.in_use() is None


def test_the_simulation_grid_polls_for_replies_every_interval(monkeypatch):
    monkeypatch.delenv(message_sweep.ENV, raising=False)
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    grid = InMemoryGrid(state_factory=factory)
    assert grid.pull_interval == 0.1  # Flower's
    assert message_sweep.poll_replies_often(grid) and grid.pull_interval == message_sweep.INTERVAL < 0.1
    other = type("DeploymentGrid", (), {"pull_interval": 3.0})()
    assert not message_sweep.poll_replies_often(other) and other.pull_interval == 3.0
    monkeypatch.setenv(message_sweep.ENV, "flower")
    kept = InMemoryGrid(state_factory=factory)
    assert not message_sweep.poll_replies_often(kept) and kept.pull_interval == 0.1


def test_the_wait_grows_with_what_a_sweep_costs_but_never_past_flowers():
    f = message_sweep.interval_after
    assert f(0.0) == f(0.0005) == message_sweep.INTERVAL == 0.02  # cheap: every 0.02 s
    assert f(0.002) == pytest.approx(0.04)  # 2 ms: 20 times as long, ~5 % of a core
    assert f(0.004) == pytest.approx(0.08) and f(0.05) == 0.1 == f(10.0)  # never longer than Flower's 0.1 s


def test_the_grid_poll_adapts_its_interval_to_its_own_cost(monkeypatch):
    monkeypatch.delenv(message_sweep.ENV, raising=False)
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    grid = InMemoryGrid(state_factory=factory)
    slow = []
    monkeypatch.setattr(grid, "pull_messages", lambda ids: (slow.append(ids), __import__("time").sleep(0.004))[0])
    assert message_sweep.poll_replies_often(grid)
    grid.pull_messages({"a"})
    assert slow == [{"a"}] and 0.08 <= grid.pull_interval <= 0.1


def test_private_touches_are_gated_on_the_checked_flower_release(monkeypatch):
    """Another Flower release than the one the glue was checked against: a clear error naming the installed version,
    the pinned range and the workaround; the Control API shortcut (public fallback: the flwr commands) is
    unavailable."""
    import fedapps.flower as glue
    from fedapps.flower import control, message_sweep

    assert glue.is_checked_release("1.42.0") and glue.is_checked_release("1.42.3rc1")
    assert not any(map(glue.is_checked_release, ["1.43.0", "1.4.2", "2.42.0", "", "x.y"]))
    glue.require_checked_flower("anything")  # the installed release passes
    with pytest.raises(glue.UnsupportedFlowerVersion) as err:
        glue.require_checked_flower("The sweep", workaround="set X=flower", flwr_version="1.43.0")
    assert str(err.value) == (
        "The sweep uses Flower 1.42's private internals, but flwr 1.43.0 is installed: install the "
        "release this project pins (pip install 'flwr[simulation]>=1.42,<1.43'); or set X=flower"
    )
    monkeypatch.setattr(glue, "installed_flwr", lambda: "1.43.0")
    monkeypatch.setattr(control, "installed_flwr", lambda: "1.43.0")
    monkeypatch.setitem(sys.modules, message_sweep.VCE_MODULE, vce_api)
    monkeypatch.delenv(message_sweep.ENV, raising=False)
    with pytest.raises(glue.UnsupportedFlowerVersion, match="FEDAPPS_MESSAGE_SWEEP=flower"):
        message_sweep.install()
    monkeypatch.setenv(message_sweep.ENV, "flower")
    assert message_sweep.install() is False  # Flower's own sweep needs no private touch
    assert control.control_client("127.0.0.1:1") is None
