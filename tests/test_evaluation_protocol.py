"""The deployed-model evaluation protocol (docs/evaluation.md), owned by fedapps/server/evaluation.py for every
strategy.

- every strategy's deployed model, checked on a 2-client toy against a hand computation from the server's and
  the clients' state right after the round it belongs to (the number must be that model on the client's test
  split, measured one message later, filed under the round);
- where the protocol puts its evaluations in a message;
- mean-over-clients vs sample-weighted accuracy, the merging of a measurement into its round's row, the
  headline (last round, never the best), COSMOS's headline (its cluster models), all against hand-built replies;
- seeded client sampling; every evaluation reads the one evaluation-split accessor of the worker;
- the round driver holds the strategy, not the other way round: a run's strategy is freed when dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message

from conftest import run_in_process
from deployed_toy import CLASSES, SHAPE, evaluate, private
from fedapps.client.worker import Worker
from fedapps.config import load_config
from fedapps.data import get_federation
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import build_model
from fedapps.reporting.results import (
    FileSink,
    accuracy_stats,
    measured_columns,
    merge_measurement,
    read_csv,
    round_row,
    summarise,
)
from fedapps.server.driver import RoundDriver
from fedapps.server.evaluation import EvaluationProtocol, with_evaluations
from fedapps.server.rounds import Measurement, RoundLog, measured_round
from fedapps.server.sampling import sample_ids
from fedapps.server.strategy import DEPLOYED_SOURCES, DeployedModel
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies import STRATEGIES, RunContext, resolve
from strategies.fedbabu import FINETUNE

CLIENTS = 2
SMALL = {
    "cosmos": ["server_model=mlp", "pretrain_epochs=1", "server_epochs=1", "distill_epochs=1"],
    "fedmd": ["pretrain_epochs=1", "distill_epochs=1"],
    "fedct": ["pretrain_epochs=1", "distill_epochs=1"],
    "comet": ["pretrain_epochs=1", "distill_epochs=1", "clusters=2"],
    "fedrep": ["head_epochs=1"],
    "fedbabu": ["finetune_epochs=2"],
    "ifca": ["clusters=2"],
    "cfl": ["warmup_rounds=1"],
    "fedfomo": ["candidates=1"],
    "fedamp": ["lam=0.01"],  # fedamp: λ/α_K = 1 (lr·λ/α_K < 1)
    "fednh": ["finetune_epochs=2"],
    "fedselect": ["grow_every=1"],
}


def test_every_strategy_declares_its_deployed_model():
    for name, cls in STRATEGIES.items():  # where it lives is checked against the hand computation below
        assert isinstance(cls.deployed, DeployedModel) and cls.deployed.what, name
        assert cls.deployed.source in DEPLOYED_SOURCES, name


# --------------------------------------------------------------------------- every definition on a 2-client toy


@functools.cache  # the suite's test files, read once per session
def deployed_by_hand() -> dict[str, Callable]:
    """Every ``DEPLOYED_BY_HAND`` table of the suite's test files (tests/deployed_toy.py): strategy name -> its
    deployed model by hand. A strategy's hand computation lives in its own test file."""
    found: dict[str, Callable] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if not re.search(r"^DEPLOYED_BY_HAND = ", path.read_text(), re.M):
            continue
        for name, fn in importlib.import_module(path.stem).DEPLOYED_BY_HAND.items():
            assert name not in found, f"{name}: two DEPLOYED_BY_HAND entries ({path.name} and another test file)"
            found[name] = fn
    return found


def own_model(s, grid, cid, data, rnd):
    """deployed.source 'client': the client's own model as it stands after round rnd (nothing sent for it)."""
    return evaluate(private(grid, cid), data)


def test_the_hand_computations_are_found_in_the_strategies_test_files():
    hand = deployed_by_hand()
    assert {"fedavg", "cwfedavg", "cosmos", "fedbabu", "fedselect"} <= set(hand)
    assert set(hand) <= set(STRATEGIES), f"DEPLOYED_BY_HAND names no strategy: {sorted(set(hand) - set(STRATEGIES))}"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_deployed_model_of_every_strategy_on_a_two_client_toy(name):
    """Round r's number (``deployed-*`` of client i, taken on round r+1's message or the final evaluation-only
    message) is the evaluation of the model the table defines, computed by hand from the state right after round
    r; a number taken at another point (after training, before the server step, after the next digest) differs."""
    source = STRATEGIES[name].deployed.source
    hand = deployed_by_hand()
    assert (name in hand) == (source != "client"), (
        f"{name}: deployed.source {source}: a 'message' or 'server' model needs its hand computation, "
        f"DEPLOYED_BY_HAND = {{{name!r}: fn}} in its test file (tests/deployed_toy.py); a 'client' one none"
    )
    by_hand = hand.get(name, own_model)
    cfg = load_config(
        None,
        " ".join(
            [
                f"strategy.name={name}",
                "rounds=2",
                "data.source=digits",
                "data.partition=pathological",
                f"data.num_clients={CLIENTS}",
                "data.public_fraction=0.2",
                "model.name=mlp",
                "client.epochs=1",
                "client.batch_size=32",
                "client.lr=0.05",
                *(f"strategy.params.{name}.{kv}" for kv in SMALL.get(name, [])),
            ]
        ),
    )
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    fed = get_federation(dataclasses.asdict(cfg.data))
    grid = InProcessGrid(CLIENTS)
    expected: dict[int, dict[int, dict[str, float]]] = {}
    logs: list[RoundLog] = []

    def on_round(entry: RoundLog) -> None:  # the state right after round r (the final message changes none of it)
        logs.append(entry)
        expected[entry.round] = {c: by_hand(s, grid, c, fed.client(c), entry.round) for c in range(CLIENTS)}

    s = resolved.build(cfg, RunContext(on_round=on_round))
    RoundDriver(s).start(grid)
    measured = {m.round: (m, e.round) for e in logs for m in e.measurements}
    assert sorted(measured) == [1, 2]
    assert measured[1][1] == 2 and not measured[1][0].final  # rode on round 2's messages
    assert measured[2][1] == 2 and measured[2][0].final  # the evaluation-only message after the last round
    for rnd, (m, _) in measured.items():
        got = {r.client_id: r.metrics for r in m.replies}
        assert sorted(got) == list(range(CLIENTS)), f"round {rnd}: every client measured"
        for c in range(CLIENTS):
            want = expected[rnd][c]
            assert got[c]["deployed-correct"] == want["correct"] and got[c]["deployed-n"] == want["n"], (rnd, c)
            assert got[c]["deployed-loss"] == pytest.approx(want["loss"], rel=1e-5), (rnd, c)
    # the second column: each client's model right after its local update in that round (own-model strategies:
    # the same model as the deployed one; FedAvg etc.: a different one)
    for entry in logs:
        assert {r.client_id for r in entry.replies if "after-acc" in r.metrics} == set(range(CLIENTS))


def test_evaluations_are_placed_before_training_and_after_it():
    ifca = STRATEGIES["ifca"].deployed
    assert with_evaluations(["select-model", "train"], ifca, True) == [
        "select-model",
        "evaluate:deployed",
        "train",
        "evaluate:after",
    ]
    assert with_evaluations(["select-model", "train"], ifca, False) == ["select-model", "train", "evaluate:after"]
    babu = STRATEGIES["fedbabu"].deployed
    assert with_evaluations(["train"], babu, True) == ["evaluate-finetuned:deployed", "train", "evaluate:after"]
    with pytest.raises(RuntimeError, match="must start with"):
        with_evaluations(["train"], ifca, True)


def test_measured_rounds_are_multiples_of_evaluate_every_and_the_last():
    assert [r for r in range(1, 13) if measured_round(r, 5, 12)] == [5, 10, 12]
    assert [r for r in range(1, 5) if measured_round(r, 1, 4)] == [1, 2, 3, 4]
    assert [r for r in range(1, 4) if measured_round(r, 10, 3)] == [3]  # k past the last round: only the last
    babu = STRATEGIES["fedbabu"].deployed
    assert with_evaluations(["train"], babu, False, after=False) == ["train"]


def test_evaluate_every_runs_both_evaluations_and_the_fine_tuning_only_on_measured_rounds(tiny_config, tmp_path):
    """FedBABU with evaluate_every 5 over 12 rounds: the fine-tuned deployed model is evaluated on rounds 6 and 11's
    messages (measuring rounds 5 and 10) and by the evaluation-only message after round 12; the model after local
    training in rounds 5, 10 and 12 only. Rounds.csv and the summary say the same."""
    cfg = tiny_config(
        rounds=12, evaluate_every=5, strategy={"name": "fedbabu", "params": {"fedbabu": {"finetune_epochs": 1}}}
    )
    grid = InProcessGrid(4, record=True)
    summary, run_dir = run_in_process(cfg, tmp_path / "out", grid)
    finetuned, after = set(), set()
    for m in grid.sent:
        request = protocol.request_of(m)
        if any(op.startswith("evaluate-finetuned") for op in request.ops):
            finetuned.add((request.round, m.metadata.message_type))
        if f"evaluate:{protocol.AFTER_TAG}" in request.ops:
            after.add(request.round)
    assert finetuned == {(6, "train"), (11, "train"), (13, protocol.EVAL_MESSAGE_TYPE)}
    assert after == {5, 10, 12}
    rows = read_csv(run_dir / "rounds.csv")
    assert [r["round"] for r in rows if r["acc_mean"] is not None] == [5, 10, 12]  # the others empty, never 0
    assert [r["round"] for r in rows if r["acc_after_training_mean"] is not None] == [5, 10, 12]
    assert all(r["measured_clients"] is None for r in rows if r["round"] not in (5, 10, 12))
    assert summary["final_round"] == 12 and summary["rounds"] == 12
    assert summary["accuracy_mean"] == rows[-1]["acc_mean"]
    assert summary["accuracy_mean_last5"] == pytest.approx(sum(rows[r - 1]["acc_mean"] for r in (5, 10, 12)) / 3)


# --------------------------------------------------------------------------- the numbers, against hand-built replies


def _metrics(cid, tag, correct, n, loss=1.0):
    return {
        protocol.CLIENT_ID: cid,
        protocol.NUM_EXAMPLES: 50,
        f"{tag}-acc": correct / n,
        f"{tag}-loss": loss,
        f"{tag}-n": n,
        f"{tag}-correct": correct,
    }


def test_acc_mean_and_acc_weighted_against_hand_built_replies():
    # client 0: 9 of 10 right; client 1: 10 of 90 right
    replies = [_metrics(0, "deployed", 9, 10, loss=0.5), _metrics(1, "deployed", 10, 90, loss=2.0)]
    stats = accuracy_stats(replies, "deployed")
    assert stats["acc_mean"] == pytest.approx((0.9 + 10 / 90) / 2)  # every client counts once
    assert stats["acc_weighted"] == pytest.approx(19 / 100)  # every test sample counts once
    assert stats["loss"] == pytest.approx((0.5 * 10 + 2.0 * 90) / 100)
    cols = measured_columns(replies, num_clients=3)
    assert cols["acc_mean"] == stats["acc_mean"] and cols["acc_weighted"] == stats["acc_weighted"]
    assert cols["measured_clients"] == 2 and cols["acc_client_0"] == 0.9 and "acc_client_2" not in cols
    assert accuracy_stats(replies, "after") == {}  # another evaluation's metrics are not this one's


def _reply(cid, metrics):
    return ClientReply(node_id=100 + cid, client_id=cid, num_examples=50, metrics=metrics)


def _cfg(rounds=2):
    return load_config(None, f"rounds={rounds} data.source=digits data.num_clients=2 model.name=mlp run_name=t")


def test_merge_measurement_files_the_deployed_models_under_the_round_they_belong_to():
    entry1 = RoundLog(1, [_reply(0, _metrics(0, "after", 5, 10)), _reply(1, _metrics(1, "after", 6, 10))], 10, 10)
    rows = [round_row(entry1, 2)]
    assert rows[0]["acc_mean"] == "" and rows[0]["acc_after_training_mean"] == pytest.approx(0.55)
    # round 1's deployed models, measured on round 2's messages
    columns = measured_columns([_metrics(0, "deployed", 7, 10), _metrics(1, "deployed", 2, 40)], 2)
    assert merge_measurement(rows, 1, columns)
    assert rows[0]["acc_mean"] == pytest.approx((0.7 + 0.05) / 2) and rows[0]["acc_weighted"] == pytest.approx(9 / 50)
    assert rows[0]["acc_client_1"] == 0.05 and rows[0]["measured_clients"] == 2
    assert rows[0]["acc_after_training_mean"] == pytest.approx(0.55)  # the second column is kept
    assert not merge_measurement(rows, 5, columns)


def test_headline_is_the_deployed_models_after_the_last_round_not_the_best(tmp_path):
    cfg = _cfg()
    sink = FileSink(cfg, tmp_path)
    after = [_reply(0, _metrics(0, "after", 1, 10)), _reply(1, _metrics(1, "after", 3, 30))]
    sink.on_round(RoundLog(1, list(after), 10, 10))
    best = [_reply(0, _metrics(0, "deployed", 10, 10)), _reply(1, _metrics(1, "deployed", 30, 30))]
    last = [_reply(0, _metrics(0, "deployed", 4, 10)), _reply(1, _metrics(1, "deployed", 3, 30))]
    sink.on_round(
        RoundLog(2, list(after), 10, 10, measurements=[Measurement(1, best), Measurement(2, last, final=True)])
    )
    summary = sink.summary(1.0)
    assert summary["protocol"] == "deployed-model" and summary["final_round"] == 2
    assert summary["accuracy_mean"] == pytest.approx((0.4 + 0.1) / 2)
    assert summary["accuracy_weighted"] == pytest.approx(7 / 40)
    assert summary["accuracy_after_training_mean"] == pytest.approx(0.1)
    assert summary["best_round_on_test_set_NOT_the_result"]["round"] == 1
    assert [r["acc_mean"] for r in sink.rows] == [pytest.approx(1.0), pytest.approx(0.25)]
    assert summarise(cfg, sink.rows, 1.0)["accuracy_mean"] == summary["accuracy_mean"]
    header = (sink.dir / "rounds.csv").read_text().splitlines()[0].split(",")
    assert {"acc_mean", "acc_weighted", "acc_after_training_mean", "measured_clients", "acc_client_1"} <= set(header)


def test_cosmos_headline_is_its_cluster_models_on_hand_built_replies(tmp_path):
    """The evaluation-only message after the last round carries h_π(i) to every clustered client (none to a client
    in no cluster); the headline is the mean / weighted accuracy of those replies, never the own models'."""
    cfg = load_config(
        None,
        "strategy.name=cosmos rounds=1 data.source=digits data.num_clients=4 "
        "data.public_fraction=0.2 model.name=mlp run_name=t strategy.params.cosmos.server_model=mlp",
    )
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    s = resolved.build(cfg)
    fed = get_federation(dataclasses.asdict(cfg.data))
    s.models = {0: build_model("mlp", CLASSES, SHAPE, seed=1), 1: build_model("mlp", CLASSES, SHAPE, seed=2)}
    s.cluster_of = {0: 0, 1: 1, 2: 0}  # client 3 has no cluster yet
    s.nodes.node_to_client = {100 + c: c for c in range(4)}
    correct = {0: 3, 1: 20, 2: 40}  # per client, out of its whole test split

    class Grid:
        def get_node_ids(self):
            return [100, 101, 102, 103]

        def send_and_receive(self, messages, timeout=None):
            out = []
            for msg in messages:
                cid = int(msg.metadata.dst_node_id) - 100
                sent = msg.content[protocol.EVAL_ARRAYS].to_torch_state_dict()
                own = s.models[s.cluster_of[cid]].state_dict()
                assert all(torch.equal(sent[k], own[k]) for k in own)  # h_π(i), and only for evaluation
                n = int(fed.test_counts[cid].sum())
                metrics = {
                    "deployed-acc": correct[cid] / n,
                    "deployed-loss": 1.0,
                    "deployed-n": n,
                    "deployed-correct": correct[cid],
                }
                content = protocol.Reply(
                    cid,
                    int(fed.train_counts[cid].sum()),
                    metrics,
                    info=protocol.ReplyInfo(arch="mlp", fingerprint=fed.fingerprint),
                ).encode()
                out.append(Message(content=content, reply_to=msg))
            return out

    InProcessGrid(1)  # Flower's task identity, so that messages can be built outside its runtime
    entry = RoundLog(1, [_reply(c, _metrics(c, "after", 1, 10)) for c in range(4)], 0, 0)
    RoundDriver(s).final_evaluation(Grid(), 1, 5.0, entry)
    assert [m.round for m in entry.measurements] == [1]
    assert sorted(r.client_id for r in entry.measurements[0].replies) == [0, 1, 2]
    sink = FileSink(cfg, tmp_path)
    sink.on_round(entry)
    summary = sink.summary(1.0)
    n = [int(fed.test_counts[c].sum()) for c in range(3)]
    assert summary["accuracy_mean"] == pytest.approx(np.mean([correct[c] / n[c] for c in range(3)]))
    assert summary["accuracy_weighted"] == pytest.approx(sum(correct.values()) / sum(n))
    assert summary["accuracy_after_training_mean"] == pytest.approx(0.1)  # the own models: the second column
    assert summary["final_round_measured_clients"] == 3


# --------------------------------------------------------------------------- sampling and the evaluation split


def sampled_clients(seed: int, node_ids: list[int], rounds: int = 4) -> tuple[list[list[int]], InProcessGrid]:
    """The CLIENT ids a fedavg strategy samples in ``rounds`` draws (5 of 20) on an in-process grid whose node
    ``node_ids[i]`` serves client i."""
    cfg = load_config(
        None,
        f"seed={seed} data.source=digits data.num_clients=20 model.name=mlp client.device=cpu "
        "strategy.fraction=0.25 strategy.min_clients=2",
    )
    s = STRATEGIES["fedavg"](cfg)
    grid = InProcessGrid(20, node_ids=node_ids, record=True)
    client_of = {n: int(c.node_config["partition-id"]) for n, c in grid.contexts.items()}
    return [sorted(client_of[n] for n in s.nodes.sample_nodes(grid, s.request)) for _ in range(rounds)], grid


def test_client_sampling_is_seeded_over_client_ids_whatever_the_node_ids():
    """Flower's simulation gives the nodes new random ids in every run: the same seed must still draw the same
    CLIENTS. Here the second run's node ids are large, shuffled and in another order than the clients."""
    in_order = list(range(1000, 1020))
    shuffled = [int(v) for v in np.random.default_rng(5).permutation(2**63 + np.arange(20, dtype=np.uint64) * 7919)]
    a, grid = sampled_clients(0, in_order)
    b, _ = sampled_clients(0, shuffled)
    c, _ = sampled_clients(1, shuffled)
    assert all(len(d) == 5 and len(set(d)) == 5 for d in a)
    assert a == b  # same seed, same clients every round, whatever the node ids
    assert a != c  # another seed, other clients
    assert len({tuple(d) for d in a}) > 1  # and the draw changes between rounds
    # every node was asked once who it is (a message with no operation), before the first draw only
    assert len(grid.sent) == 20 and all(protocol.request_of(m).ops == () for m in grid.sent)


def test_full_participation_identifies_every_node_once():
    """Identity is settled before round 1 whatever the cohort (tests/test_identity.py): each node is asked once."""
    cfg = load_config(None, "data.source=digits data.num_clients=4 model.name=mlp client.device=cpu")
    grid = InProcessGrid(4, record=True)
    strategy = STRATEGIES["fedavg"](cfg)
    first = strategy.nodes.sample_nodes(grid, strategy.request)
    assert first == sorted(grid.contexts) == strategy.nodes.sample_nodes(grid, strategy.request)
    assert sorted(int(m.metadata.dst_node_id) for m in grid.sent) == sorted(grid.contexts)
    assert all(protocol.request_of(m).ops == () for m in grid.sent)


BIG = 2**63 - 40  # Flower's node ids are uint64: a federation mixes ids below and above 2**63 (-> float64 in numpy)


# regression: exit 0 with wrong or empty results
def test_sample_ids_keeps_64_bit_ids_exact():
    ids = [BIG + 7 * i for i in range(200)]  # straddles 2**63
    picked = sample_ids(ids, 20, np.random.default_rng(0))
    assert len(picked) == 20 and len(set(picked)) == 20
    assert set(picked) <= set(ids)  # float64 would round BIG + 7i to a multiple of 2048: not an id
    assert picked == sorted(picked)


# regression: exit 0 with wrong or empty results
def test_sample_ids_is_seeded():
    ids = [BIG + i for i in range(50)]
    a = sample_ids(ids, 10, np.random.default_rng(3))
    b = sample_ids(ids, 10, np.random.default_rng(3))
    c = sample_ids(ids, 10, np.random.default_rng(4))
    assert a == b and a != c


# regression: exit 0 with wrong or empty results
def test_partial_participation_reaches_every_sampled_node_with_large_ids(tiny_config, tmp_path):
    cfg = tiny_config(
        rounds=2,
        strategy={"name": "fedavg", "fraction": 0.25, "min_clients": 1},
        data={"source": "digits", "partition": "iid", "num_clients": 12},
    )
    grid = InProcessGrid(12, first_node_id=2**63 - 6, record=True)  # ids on both sides of 2**63
    _, out = run_in_process(cfg, tmp_path / "out", grid)
    k = math.ceil(0.25 * 12)
    for rnd in ("1", "2"):
        sent = [m for m in grid.sent if m.metadata.group_id == rnd]
        assert len(sent) == k
        destinations = [m.metadata.dst_node_id for m in sent]
        assert len(set(destinations)) == k and set(destinations) <= set(grid.contexts)
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [k, k]


def worker_message(ops_list, training, client=None):
    """A message for client 0 on digits (the data spec every message carries), with the given operations, training
    settings and ``client`` over the config's client settings."""
    grid = InProcessGrid(2)
    cfg = load_config(None, "data.source=digits data.num_clients=2 model.name=mlp client.device=cpu")
    setup = protocol.Setup(
        data=dataclasses.asdict(cfg.data),
        model=protocol.ModelSpec("mlp", 0),
        client={**dataclasses.asdict(cfg.client), **(client or {})},
    )
    return grid, protocol.Draft(
        100, protocol.Request(ops=tuple(ops_list), round=1, setup=setup, training=training)
    ).message()


@pytest.mark.parametrize("op", ["evaluate", "evaluate-finetuned", "evaluate-received"])
def test_every_evaluation_reads_the_workers_evaluation_split(op, monkeypatch):
    """Patching Worker.eval_x / eval_y (what a tuning run's validation split goes through) changes what every
    evaluation operation measures: none reads the test split by another way."""
    model = build_model("mlp", CLASSES, SHAPE, seed=0)
    eval_arrays = protocol.arrays_record({k: v.numpy() for k, v in model.state_dict().items()})
    grid, msg = worker_message(
        [f"{op}:deployed"],
        protocol.Training(sections={FINETUNE: protocol.Section(epochs=1)}),
        client={"batch_size": 16},
    )
    if op == "evaluate-received":
        msg.content[protocol.EVAL_ARRAYS] = eval_arrays
    probe = Worker(msg, grid.contexts[100])
    x, y = probe.data.train_x[:7], probe.data.train_y[:7]
    monkeypatch.setattr(Worker, "eval_x", property(lambda w: x))
    monkeypatch.setattr(Worker, "eval_y", property(lambda w: y))
    metrics = Worker(msg, grid.contexts[101]).run().content[protocol.METRICS]
    assert metrics["deployed-n"] == 7


def test_no_module_reads_the_test_split_but_the_worker_accessor():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readers = []
    for path in [
        *root.glob("strategies/*.py"),
        *root.glob("fedapps/*.py"),
        *root.glob("fedapps/*/*.py"),
        root / "client_app.py",
        root / "server_app.py",
    ]:
        text = path.read_text()
        if "test_x" in text or "test_y" in text:
            readers.append(path.relative_to(root).as_posix())
    # fedapps/data builds the split; the worker's eval_x reads it; the drop-in facade's load_partition hands a user's
    # own ClientApp its client's splits (the user's test() reads them: our worker is not involved)
    assert sorted(r for r in readers if not r.startswith("fedapps/data/")) == [
        "fedapps/client/worker.py",
        "fedapps/flower_strategies.py",
    ], readers
    worker = (root / "fedapps" / "client" / "worker.py").read_text()
    assert worker.count("self.data.test_x") == 1 and worker.count("self.data.test_y") == 1


def test_final_evaluation_reaches_every_client_in_batches_of_a_cohort():
    """fraction 0.25 of 8 clients: the evaluation-only phase asks all 8, two at a time (the server never holds more
    messages than a training round's), and files one measurement of all 8."""
    cfg = load_config(
        None,
        "data.source=digits data.num_clients=8 model.name=mlp client.device=cpu "
        "strategy.fraction=0.25 strategy.min_clients=1",
    )
    s = STRATEGIES["fedavg"](cfg)
    grid = InProcessGrid(8, record=True)
    batches = []
    send = grid.send_and_receive
    grid.send_and_receive = lambda messages, timeout=None: (
        batches.append(len(list(messages))) or send(messages, timeout=timeout)
    )
    entry = RoundLog(1, [], 0, 0)
    RoundDriver(s).final_evaluation(grid, 1, 60.0, entry)
    assert batches == [2, 2, 2, 2]
    (m,) = entry.measurements
    assert m.final and sorted(r.client_id for r in m.replies) == list(range(8))
    assert entry.eval_bytes_down > 0 and entry.eval_bytes_up > 0


def test_evaluation_ops_file_their_tags_where_the_validator_reads_them():
    """The validator reads an evaluation op's default tag from protocol.EVALUATION_TAGS (the wire, below the client),
    which registering the op fills: the worker's own ops, an algorithm's, and one registered here."""
    from fedapps.client.registry import client_op
    from fedapps.wire import protocol
    from fedapps.wire.validation import eval_tags_of

    assert (
        protocol.EVALUATION_TAGS["evaluate"] == "eval" and protocol.EVALUATION_TAGS["evaluate-received"] == "received"
    )
    client_op("evaluate-made-up-here", default_tag="madeup")(lambda w, tag: None)
    try:
        assert eval_tags_of(["train", "evaluate", "evaluate-made-up-here", "evaluate:deployed", "evaluate"]) == (
            "eval",
            "madeup",
            "deployed",
        )
    finally:
        from fedapps.client.registry import OPERATIONS

        OPERATIONS.pop("evaluate-made-up-here")
        protocol.EVALUATION_TAGS.pop("evaluate-made-up-here")


def test_a_strategy_is_freed_when_dropped_after_its_run():
    """The services a strategy holds (nodes, replies, history) hold nothing of it, and the round driver and the
    evaluation protocol hold the strategy, not the reverse: without a reference cycle a dropped strategy (and its
    server state, e.g. cwFedAvg's per-client stack) is freed at once, not at the garbage collector's next full pass."""
    import gc
    import weakref

    cfg = load_config(None, "data.source=digits data.num_clients=2 model.name=mlp client.device=cpu rounds=1")
    s = STRATEGIES["fedavg"](cfg)
    RoundDriver(s).start(InProcessGrid(2))
    EvaluationProtocol(s).deployed_drafts(2, [100])
    ref = weakref.ref(s)
    gc.disable()
    try:
        del s
        assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
    finally:
        gc.enable()
