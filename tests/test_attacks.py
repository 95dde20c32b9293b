"""The attacks of docs/privacy.md's "What the server can infer" (fedapps_tools/attacks.py): each estimator on inputs
whose answer is known, and the capture grid against what the strategy itself received."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn

from fedapps.config import load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.driver import RoundDriver
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from fedapps_tools import attacks, cli
from strategies import RunContext, resolve
from strategies.cwfedavg import l1_error


@pytest.fixture(autouse=True)
def _flower_identity() -> None:
    """Message() needs a task identity outside Flower's runtime; the in-process grid sets one."""
    InProcessGrid(1)


COUNTS = np.array([6, 3, 1, 0])  # a client's training labels per class: N = 10, one batch
LR = 0.1


def one_sgd_step(bias: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A linear classifier with zero weights (every sample gets softmax(bias)) takes one SGD step on cross-entropy
    over a batch with :data:`COUNTS` labels: the bias before and after."""
    model = nn.Linear(3, len(COUNTS))
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(bias)
    before = model.bias.detach().numpy().copy()
    x = torch.randn(int(COUNTS.sum()), 3)
    y = torch.as_tensor(np.repeat(np.arange(len(COUNTS)), COUNTS))
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        model.bias -= LR * model.bias.grad
    return before, model.bias.detach().numpy().copy()


def hand_built_exchange(bias_before: np.ndarray, bias_after: np.ndarray, drop_last: bool = False):
    """The message a server sent (model and training settings) and the reply it parsed (the trained model)."""
    n = int(COUNTS.sum())
    request = protocol.Request(
        ops=("train",),
        round=1,
        setup=protocol.Setup(client={"lr": LR, "batch_size": n, "epochs": 1, "drop_last": drop_last}),
    )
    weight = np.zeros((len(COUNTS), 3), np.float32)
    sent = {"fc.weight": weight, "fc.bias": bias_before.astype(np.float32)}
    msg = protocol.Draft(7, request, arrays=sent).message()
    returned = {"fc.weight": weight + np.float32(0.5), "fc.bias": bias_after.astype(np.float32)}
    return msg, ClientReply(node_id=7, client_id=0, num_examples=n, metrics={}, arrays=returned)


def test_bias_update_estimate_is_the_client_class_distribution():
    """An uninformed model (uniform softmax): the estimate from the reply is the true distribution, L1 = 0."""
    msg, reply = hand_built_exchange(*one_sgd_step(torch.zeros(len(COUNTS))))
    found = attacks.label_estimates(msg, reply, "fc", len(COUNTS))
    truth = COUNTS / COUNTS.sum()
    np.testing.assert_allclose(found[attacks.BIAS_UPDATE], truth, atol=1e-6)
    assert l1_error(found[attacks.BIAS_UPDATE], truth) < 1e-5
    assert l1_error(found[attacks.BIAS_UPDATE], np.full(4, 0.25)) == pytest.approx(0.8, abs=1e-5)
    np.testing.assert_allclose(found[attacks.ROW_NORMS], np.full(4, 0.25))  # equal rows: no class information
    assert attacks.HISTOGRAM not in found


def test_bias_update_estimate_uses_the_mean_softmax_it_is_given():
    """A model that predicts softmax(b) ≠ uniform: exact with that mean softmax, off without it."""
    bias = torch.tensor([1.0, 0.0, -1.0, 0.5])
    before, after = one_sgd_step(bias)
    s = torch.softmax(bias, 0).numpy()
    n = int(COUNTS.sum())
    exact = attacks.bias_update_distribution(before, after, LR, n, 1, n, mean_softmax=s)
    np.testing.assert_allclose(exact, COUNTS / n, atol=1e-6)
    assert l1_error(attacks.bias_update_distribution(before, after, LR, n, 1, n), COUNTS / n) > 0.1


def test_the_reply_estimate_takes_its_mean_softmax_from_the_models_sent_and_returned():
    """s̄ from dummy inputs: a classifier with zero weights predicts softmax(bias) on any input, so the mean over the
    two models is exactly the mean of their two softmaxes; the reply's estimate passes the models to it."""
    model = nn.Linear(3, 4)
    b1, b2 = np.array([1.0, 0.0, -1.0, 0.5]), np.array([0.0, 2.0, 0.0, 0.0])
    states = [{"weight": np.zeros((4, 3)), "bias": b} for b in (b1, b2)]
    softmax = [np.exp(b) / np.exp(b).sum() for b in (b1, b2)]
    np.testing.assert_allclose(
        attacks.dummy_mean_softmax(model, states, (3,)), (softmax[0] + softmax[1]) / 2, atol=1e-6
    )
    bias = torch.tensor(b1, dtype=torch.float32)
    msg, reply = hand_built_exchange(*one_sgd_step(bias))
    seen = []

    def mean_softmax(sent, returned):
        seen.append((sent["fc.bias"], returned["fc.bias"]))
        return softmax[0]

    found = attacks.label_estimates(msg, reply, "fc", len(COUNTS), mean_softmax)[attacks.BIAS_UPDATE]
    np.testing.assert_allclose(found, COUNTS / COUNTS.sum(), atol=1e-5)
    assert np.array_equal(seen[0][0], b1.astype(np.float32)) and np.array_equal(seen[0][1], reply.arrays["fc.bias"])


def test_samples_per_epoch_follow_drop_last():
    msg, _ = hand_built_exchange(np.zeros(4), np.zeros(4), drop_last=True)
    t = attacks.LocalTraining.of(msg)
    assert (t.lr, t.batch_size, t.epochs) == (LR, 10, 1)
    assert t.samples_per_epoch(27) == 20
    assert attacks.LocalTraining(LR, 10, 1, False).samples_per_epoch(27) == 27


def test_prediction_histogram_is_exact():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]], np.float32)
    np.testing.assert_array_equal(attacks.prediction_histogram(probs, 3), [0.5, 0.25, 0.25])
    np.testing.assert_array_equal(attacks.prediction_histogram(np.log(probs), 3), [0.5, 0.25, 0.25])  # logits
    hard = np.array([2, 2, 1, 3, 3, 3], np.uint8)  # 3 = abstain: no class
    np.testing.assert_array_equal(attacks.prediction_histogram(hard, 3), [0.0, 1 / 3, 2 / 3])


def test_loss_threshold_auc_by_hand_and_against_sklearn():
    assert attacks.loss_threshold_auc([0.1, 0.2], [0.3, 0.15]) == pytest.approx(0.75)  # 3 of 4 pairs
    assert attacks.loss_threshold_auc([0.3, 0.15], [0.1, 0.2]) == pytest.approx(0.25)  # swapped
    assert attacks.loss_threshold_auc([0.1, 0.2], [0.1, 0.2]) == pytest.approx(0.5)  # ties count one half
    rng = np.random.default_rng(0)
    members = np.round(rng.exponential(0.5, 200), 1)  # members lower, with many ties
    others = np.round(rng.exponential(1.0, 150), 1)
    auc = attacks.loss_threshold_auc(members, others)
    labels = np.r_[np.ones(len(members)), np.zeros(len(others))]
    assert auc == pytest.approx(roc_auc_score(labels, -np.r_[members, others]), abs=1e-12)
    assert auc > 0.5
    assert attacks.loss_threshold_auc(others, members) == pytest.approx(1 - auc, abs=1e-12)


TINY = [
    "data.source=digits",
    "model.name=mlp",
    "data.num_clients=3",
    "data.partition=pathological",
    "data.classes_per_client=4",
    "data.public_fraction=0.2",
    "rounds=2",
    "client.batch_size=16",
    "strategy.min_clients=1",
]
SHRINK = {  # COSMOS's own settings that make its server side small (as fedapps_tools/capture.py's)
    "cosmos": ["server_model=mlp", "pretrain_epochs=1", "server_epochs=1", "distill_epochs=1"],
}


def same_arrays(x: dict[str, np.ndarray] | None, y: dict[str, np.ndarray] | None) -> bool:
    x, y = x or {}, y or {}
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize(("strategy_name", "model_kind"), [("fedavg", "returned"), ("cosmos", "sent for evaluation")])
def test_capture_grid_records_exactly_the_replies_the_strategy_received(strategy_name, model_kind, monkeypatch):
    """A 2-round run: per round the captured replies, parsed, are the replies the strategy's aggregation was given
    (same clients, counts, metrics, arrays, predictions); the identification and evaluation-only phases are kept apart;
    the model the server has of each client is the one returned (FedAvg) or sent for evaluation (COSMOS's cluster
    model, as the last message carried it)."""
    shrink = [f"strategy.params.{strategy_name}.{kv}" for kv in SHRINK.get(strategy_name, [])]
    cfg = load_config(None, [*TINY, f"strategy.name={strategy_name}", *shrink])
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    strategy = resolved.build(cfg, RunContext())
    aggregated: dict[int, list[ClientReply]] = {}
    aggregate = strategy.aggregate

    def spy(server_round, replies):
        aggregated[server_round] = list(replies)
        return aggregate(server_round, replies)

    monkeypatch.setattr(strategy, "aggregate", spy)
    capture = attacks.CaptureGrid(InProcessGrid(3))
    RoundDriver(strategy).start(capture, num_rounds=2)
    kinds = [(p.round, p.message_type) for p in capture.phases if p.message_type != protocol.QUERY_MESSAGE_TYPE]
    assert kinds[:2] == [(1, protocol.MESSAGE_TYPE), (2, protocol.MESSAGE_TYPE)]
    assert [k for _, k in kinds[2:]] == [protocol.EVAL_MESSAGE_TYPE]
    received = capture.received()
    assert sorted(aggregated) == [1, 2]
    assert len(received) == sum(len(replies) for replies in aggregated.values()) == 6
    for rnd, theirs in aggregated.items():
        mine = sorted((r for k, _, r in received if k == rnd), key=lambda r: r.client_id)
        assert [r.client_id for r in mine] == [r.client_id for r in theirs] == [0, 1, 2]
        for a, b in zip(mine, theirs, strict=True):
            assert (a.node_id, a.num_examples, a.metrics) == (b.node_id, b.num_examples, b.metrics)
            assert same_arrays(a.arrays, b.arrays) and same_arrays(a.predictions, b.predictions)
        assert all(bool(r.arrays) == (model_kind == "returned") for r in mine)
        assert all(bool(r.predictions) == (model_kind != "returned") for r in mine)
    for _, msg, reply in received:  # each reply is paired with the message its node was sent
        assert msg.metadata.dst_node_id == reply.node_id
    kind, models = attacks.models_of_clients(capture, cfg.model.name)
    assert kind == model_kind and sorted(models) == [0, 1, 2]
    if model_kind == "returned":
        assert all(np.array_equal(models[r.client_id][1][k], r.arrays[k]) for r in aggregated[2] for k in r.arrays)
    else:  # COSMOS: h_π(i) of the last round's training, as the server holds it
        for client, (arch, arrays) in models.items():
            held = strategy.models[strategy.cluster_of[client]].state_dict()
            assert arch == "mlp" and all(np.array_equal(arrays[k], held[k].numpy()) for k in held)


def test_the_table_reads_round_one_and_the_last_round_and_says_why_a_cell_is_empty(tmp_path):
    """One arm's rows, through the CSV and back: the first and last round's L1 per estimator, the uniform guess, the
    membership AUC and the model it attacked; a refused arm and an arm without a model of a client say so."""
    stamp = {"command": "fedapps attacks", "commit": "abc", "machine": "m", "date": "d"}
    got = attacks.Measured(attacks.Arm("fedavg", "sample"), epsilon=2.5, delta=1e-5, accuracy=0.9)
    got.labels = {
        (attacks.BIAS_UPDATE, 1): {0: 0.2, 1: 0.4},
        (attacks.BIAS_UPDATE, 2): {0: 0.5, 1: 0.5},
        (attacks.BIAS_UPDATE, 3): {0: 0.8, 1: 0.6},
        (attacks.UNIFORM_GUESS, 3): {0: 1.0, 1: 1.2},
    }
    got.membership, got.membership_model = {0: 0.6, 1: 0.7}, "returned"
    pl = attacks.Measured(attacks.Arm("fedmd", "off"), labels={(attacks.HISTOGRAM, 1): {0: 0.3}})
    refused = attacks.Measured(attacks.Arm("comet", "client"), refused="'privacy.mode' is 'client', which is not known")
    rows = [r for m in (got, pl, refused) for r in attacks.rows_of(m, stamp)]
    from fedapps.reporting.results import write_csv
    from fedapps_tools.tables_spec import read_rows

    write_csv(tmp_path / "a.csv", rows)
    for table in (attacks.table_lines(rows), attacks.table_lines(read_rows(tmp_path / "a.csv"))):
        assert table[2] == (
            "| fedavg | sample | 2.5 (1e-05) | 0.9 | bias update | 0.30 ± 0.10 | 0.70 ± 0.10 | 1.10 ± 0.10 | "
            "0.65 ± 0.05 (returned) |"
        )
        assert (
            table[3] == "| fedmd | off | ∞ |  | predicted-class histogram | 0.30 ± 0.00 | 0.30 ± 0.00 | — | "
            "— (no model of a client) |"
        )
        assert table[4].startswith("| comet | client | refused: 'privacy.mode' is 'client'")
    page = tmp_path / "page.md"
    page.write_text(f"before\n{attacks.BEGIN}\nold table\n{attacks.END}\nafter\n")
    attacks.write_between_markers(page, ["| new |"])
    assert page.read_text() == f"before\n{attacks.BEGIN}\n| new |\n{attacks.END}\nafter\n"


def test_update_keeps_the_rows_of_the_arms_not_run_and_orders_them_as_the_arms(tmp_path, monkeypatch):
    """`--update`: a second call for one mode replaces that mode's rows only; the table keeps ARMS' order."""
    runs = []

    def measure(arm, rounds, seed, work, extra=()):
        runs.append(arm.key)
        return attacks.Measured(arm, labels={(attacks.HISTOGRAM, 1): {0: 0.1 * len(runs)}})

    monkeypatch.setattr(attacks, "measure", measure)
    out = tmp_path / "tables"
    assert cli.main(["attacks", "--strategies", "fedct", "--modes", "client", "off", "--out", str(out)]) == 0
    assert runs == [("fedct", "", "off"), ("fedct", "", "client")]
    assert cli.main(["attacks", "--strategies", "fedct", "--modes", "client", "--out", str(out), "--update"]) == 0
    from fedapps_tools.tables_spec import read_rows

    rows = read_rows(out / attacks.DEFAULT_CSV)
    assert [(attacks.arm_key(r), r["attack"], r["value"]) for r in rows] == [
        (("fedct", "", "off"), "label L1", "0.1"),
        (("fedct", "", "off"), attacks.MEMBERSHIP, ""),
        (("fedct", "", "client"), "label L1", "0.3"),
        (("fedct", "", "client"), attacks.MEMBERSHIP, ""),
    ]
