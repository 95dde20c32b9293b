"""A node's own data (node config data-path / public-path, data.source: nodes) and node-side state (state-dir).

Runs go through the real ServerApp driver (``server_app.run_experiment``) on an :class:`InProcessGrid` whose
nodes get their node config as a SuperNode's ``--node-config`` would give it (``node_configs``); data are
scikit-learn's digits written to each node's own files by the test.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

import server_app
from fedapps.client.worker import NODE_CLIENT_ID, STATE_DIR_KEY, STATE_MODEL, handle
from fedapps.config import load_config
from fedapps.data import DataError, load_source, node_path, read_labelled
from fedapps.flower import faults
from fedapps.flower.describe import NodeReport, agree
from fedapps.flower.inprocess import InProcessGrid
from fedapps.reporting.results import UnusableRun
from fedapps.server.evaluation import EvaluationProtocol
from fedapps.server.experiment import nodes_as_checkpointed
from fedapps.wire import protocol
from strategies import STRATEGIES, RunContext, resolve

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def digits():
    ds = load_source("digits")
    return ds.x.numpy(), ds.y.numpy()


def write_sites(tmp: Path, digits, n: int = 3) -> list[Path]:
    """n disjoint non-IID shares of digits as .npz files (site i holds classes biased towards i)."""
    x, y = digits
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    parts = np.array_split(order[np.argsort(y[order] % n, kind="stable")], n)  # site i: mostly labels ≡ i (mod n)
    paths = []
    for i, p in enumerate(parts):
        paths.append(tmp / f"site{i}.npz")
        np.savez(paths[-1], x=x[p], y=y[p])
    return paths


def write_public(tmp: Path, digits, name: str = "U.npz", rows: slice = slice(0, 120)) -> Path:
    x, y = digits
    path = tmp / name
    np.savez(path, x=x[rows], y=y[rows])
    return path


def run(
    tmp: Path, node_configs: dict, strategy: str = "fedavg", extra: str = "", rounds: int = 1, mods: list | None = None
) -> Path:
    """One run over len(node_configs) nodes, data.source nodes (``mods``: the nodes' client mods, e.g. the fault
    injection); returns the run folder."""
    n = len(node_configs)
    overrides = (
        f"strategy.name={strategy} rounds={rounds} data.source=nodes data.num_clients={n} model.name=mlp "
        f"client.batch_size=32 client.epochs=1 run_name=nodes {extra}"
    )
    grid = InProcessGrid(n, node_configs=node_configs, mods=mods)
    server_app.run_experiment(grid, None, overrides, str(tmp / "out"))
    return tmp / "out" / "nodes"


def read_csv(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


# ------------------------------------------------------------------ the happy path


def test_three_nodes_read_their_own_files_and_the_server_learns_counts_from_them(tmp_path, digits):
    sites = write_sites(tmp_path, digits)
    folder = tmp_path / "site1-images"  # node 1 brings a folder of class sub-folders of PNG images instead
    x, y = np.load(sites[1])["x"], np.load(sites[1])["y"]
    write_image_folder(folder, x, y)
    configs = {
        0: {"data-path": str(sites[0]), NODE_CLIENT_ID: 0},
        1: {"data-path": str(folder), NODE_CLIENT_ID: 1},
        2: {"data-path": str(sites[2]), NODE_CLIENT_ID: 2},
    }
    out = run(tmp_path, configs)
    cfg = load_config(out / "config.yaml")
    assert (cfg.data.num_classes, cfg.data.input_shape) == (10, [1, 8, 8])  # learnt from the nodes
    rows = read_csv(out / "partition.csv")
    for client, path in enumerate(sites):
        labels = np.load(path)["y"]
        got = np.zeros(10, dtype=int)
        for row in rows:
            if int(row["client"]) == client:
                got += np.array([int(row[f"class_{k}"]) for k in range(10)])
        np.testing.assert_array_equal(got, np.bincount(labels, minlength=10))  # train + test = the file's counts
    train = {int(r["client"]): int(r["total"]) for r in rows if r["split"] == "train"}
    test = {int(r["client"]): int(r["total"]) for r in rows if r["split"] == "test"}
    sizes = [len(np.load(p)["y"]) for p in sites]
    assert all(test[i] == pytest.approx(0.25 * sizes[i], abs=10) for i in range(3))  # data.test_fraction
    assert sum(train.values()) + sum(test.values()) == sum(sizes)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes"]["nodes_described"] == 3 and summary["nodes"]["nodes_refused"] == []
    rounds = read_csv(out / "rounds.csv")
    assert int(rounds[-1]["clients"]) == 3


def write_image_folder(folder: Path, x: np.ndarray, y: np.ndarray) -> None:
    from PIL import Image

    for k in range(10):
        (folder / f"class{k:02d}").mkdir(parents=True)  # sorted names = class order, every class folder present
    for i, (img, label) in enumerate(zip(x, y)):
        pixels = np.round((img[0] + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / f"class{label:02d}" / f"{i}.png")


def test_image_folder_is_read_like_the_npz_it_was_written_from(tmp_path, digits):
    x, y = digits
    folder = tmp_path / "imgs"
    write_image_folder(folder, x[:60], y[:60])
    data = read_labelled(str(folder))
    assert data.declared_classes == 10 and data.input_shape == (1, 8, 8)
    # files are read class folder by class folder: compare as multisets per class
    for k in range(10):
        got = np.sort(data.x.numpy()[data.y.numpy() == k].reshape(-1))
        want = np.sort(np.round((x[:60][y[:60] == k] + 1) * 127.5).clip(0, 255).reshape(-1) / 127.5 - 1)
        np.testing.assert_allclose(got, want, atol=1e-6)  # uint8 pixels scaled to [-1, 1] as the sources do
    bad = folder / "class03" / "broken.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"node config 'data-path'.*broken\.png.*cannot be read"):
        read_labelled(str(folder))


def test_a_nodes_split_is_seeded_by_its_client_id_and_its_counts_are_its_own(tmp_path, digits):
    import dataclasses

    from fedapps.config import DataConfig
    from fedapps.data import node_federation

    x, y = digits
    np.savez(tmp_path / "own.npz", x=x[:300], y=y[:300])
    data = read_labelled(str(tmp_path / "own.npz"))
    spec = {**dataclasses.asdict(DataConfig(source="nodes", num_clients=4)), "public_path": ""}
    fed = node_federation(spec, 2, data, None)
    c = fed.client(2)
    np.testing.assert_array_equal(np.bincount(c.train_y.numpy(), minlength=10), fed.train_counts[2])
    np.testing.assert_array_equal(np.bincount(c.test_y.numpy(), minlength=10), fed.test_counts[2])
    assert fed.train_counts[[0, 1, 3]].sum() == 0 and len(c.test_y) == pytest.approx(75, abs=10)
    # the samples themselves: train + test are the file's, each once
    got = sorted(map(bytes, np.concatenate([c.train_x.numpy(), c.test_x.numpy()]).reshape(300, -1)))
    assert got == sorted(map(bytes, x[:300].astype(np.float32).reshape(300, -1)))
    again = node_federation(spec, 2, data, None).client(2)
    assert torch.equal(again.train_x, c.train_x)  # the same split every message / process
    other = node_federation(spec, 3, data, None).client(3)
    assert not torch.equal(other.train_y, c.train_y)  # seeded by the client id
    validating = node_federation({**spec, "evaluate_on": "validation"}, 2, data, None).client(2)
    fit_and_val = np.concatenate([validating.train_x.numpy(), validating.test_x.numpy()])
    assert sorted(map(bytes, fit_and_val.reshape(len(fit_and_val), -1))) == sorted(
        map(bytes, c.train_x.numpy().reshape(len(c.train_x), -1))
    )  # validation is carved out of train; no test sample
    with pytest.raises(DataError, match="outside the federation"):
        node_federation(spec, 4, data, None)


def test_tilde_in_node_config_is_expanded_on_the_node(tmp_path, monkeypatch, digits):
    home = tmp_path / "nodehome"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    np.savez(home / "mine.npz", x=digits[0][:40], y=digits[1][:40])
    assert node_path("~/mine.npz", "data-path") == (home / "mine.npz").resolve()
    assert len(read_labelled("~/mine.npz").y) == 40
    with pytest.raises(DataError, match=r"node config 'public-path'='~/absent.npz'.*does not exist on this node"):
        node_path("~/absent.npz", "public-path")


def test_the_server_never_sends_its_own_paths(tmp_path, digits):
    """data.public_path is the server's path: messages carry U's fingerprint, never the path (nor unset keys)."""
    spec = {"source": "nodes", "public_path": "/srv/U.npz", "num_classes": 0, "input_shape": [], "seed": 1}
    sent = protocol.data_spec_for_clients(spec)
    assert "public_path" not in sent and "num_classes" not in sent and "input_shape" not in sent
    assert protocol.data_spec_for_clients({**spec, "num_classes": 10, "input_shape": [1, 8, 8]})["num_classes"] == 10


# ------------------------------------------------------------------ nodes refused, the run goes on


def test_broken_nodes_are_refused_with_their_reason_and_the_run_completes(tmp_path, digits):
    sites = write_sites(tmp_path, digits, 2)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"\x00 this is not an npz file")
    x, y = digits
    five = tmp_path / "five.npz"  # declares 5 classes: the others have 10
    np.savez(five, x=x[y < 5][:100], y=y[y < 5][:100], num_classes=np.int64(5))
    wide = tmp_path / "wide.npz"  # 1×8×9 images
    np.savez(wide, x=np.zeros((50, 1, 8, 9), np.float32), y=np.arange(50) % 10)
    missing = tmp_path / "nowhere" / "site.npz"
    configs = {
        0: {"data-path": str(sites[0]), NODE_CLIENT_ID: 0},
        1: {"data-path": str(sites[1]), NODE_CLIENT_ID: 1},
        2: {"data-path": str(missing), NODE_CLIENT_ID: 2},
        3: {"data-path": str(garbage), NODE_CLIENT_ID: 3},
        4: {"data-path": str(five), NODE_CLIENT_ID: 4},
        5: {"data-path": str(wide), NODE_CLIENT_ID: 5},
    }
    # 2 of the 6 clients take part: below the default min_measured_share 0.5 the run would exit 3 (its headline
    # covers a third of the federation); this test is about the refusals, so it accepts a third
    with pytest.raises(UnusableRun, match="measured on 2 of 6 clients") as failed:
        run(tmp_path / "default", configs, rounds=2)
    assert failed.value.exit_status == 3
    out = run(tmp_path, configs, rounds=2, extra="min_measured_share=0.3")
    # keyed by node (InProcessGrid: node 100 + i); a node that fails before reading its data names no client id
    refused = {int(r["node_id"]) - 100: r for r in read_csv(out / "rejections.csv") if r["phase"] == "describe"}
    assert sorted(refused) == [2, 3, 4, 5]
    assert all(r["round"] == "0" for r in refused.values())
    assert "node config 'data-path'" in refused[2]["reason"] and str(missing) in refused[2]["reason"]
    assert "does not exist on this node" in refused[2]["reason"]
    assert "cannot be read as an .npz" in refused[3]["reason"] and str(garbage) in refused[3]["reason"]
    assert "declares 5 classes, the federation has 10" in refused[4]["reason"]
    assert "input shape [1, 8, 9]" in refused[5]["reason"] and "[1, 8, 8]" in refused[5]["reason"]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["node_id"] - 100 for r in summary["nodes"]["nodes_refused"]) == [2, 3, 4, 5]
    assert summary["problems"] == []
    rounds = read_csv(out / "rounds.csv")
    assert [int(r["clients"]) for r in rounds] == [2, 2]  # the refused nodes were never sampled again
    assert [r for r in read_csv(out / "rejections.csv") if r["phase"] != "describe"] == []
    assert {int(r["client"]) for r in read_csv(out / "partition.csv")} == {0, 1}


def test_a_node_whose_data_do_not_fit_refuses_a_later_message(tmp_path, digits):
    """Every message names the classes and shape: a node that joins with other data refuses clearly."""
    sites = write_sites(tmp_path, digits, 2)
    x, y = digits
    wrong = tmp_path / "twelve.npz"
    np.savez(wrong, x=x[:60], y=y[:60], num_classes=np.int64(12))
    cfg = load_config(
        None,
        [
            "strategy.name=local",
            "data.source=nodes",
            "data.num_clients=2",
            "model.name=mlp",
            "data.num_classes=10",
            "data.input_shape=[1,8,8]",
        ],
    )
    s = resolve(cfg).build(cfg)
    grid = InProcessGrid(
        2,
        node_configs={
            0: {"data-path": str(sites[0]), NODE_CLIENT_ID: 0},
            1: {"data-path": str(wrong), NODE_CLIENT_ID: 1},
        },
    )
    (msg,) = protocol.build_messages(EvaluationProtocol(s).round_drafts(1, [101]))
    reply = grid.send_and_receive([msg])[0]
    assert reply.has_error()
    assert "declares 12 classes, the federation has 10" in reply.error.reason and str(wrong) in reply.error.reason
    (ok,) = grid.send_and_receive(protocol.build_messages(EvaluationProtocol(s).round_drafts(1, [100])))
    assert not ok.has_error()
    shifted = tmp_path / "shifted.npz"  # no declared count, labels 5..14
    np.savez(shifted, x=x[:60], y=y[:60] + 5)
    grid = InProcessGrid(2, node_configs={1: {"data-path": str(shifted), NODE_CLIENT_ID: 1}})
    reply = grid.send_and_receive(protocol.build_messages(EvaluationProtocol(s).round_drafts(1, [101])))[0]
    assert reply.has_error() and "label 14 is outside the federation's 10 classes" in reply.error.reason


def test_a_wrong_public_set_is_refused_before_round_one(tmp_path, digits):
    sites = write_sites(tmp_path, digits, 3)
    u = write_public(tmp_path, digits)
    other_u = write_public(tmp_path, digits, "otherU.npz", slice(200, 320))
    configs = {i: {"data-path": str(sites[i]), NODE_CLIENT_ID: i, "public-path": str(u)} for i in range(3)}
    configs[2]["public-path"] = str(other_u)
    out = run(
        tmp_path,
        configs,
        strategy="fedmd",
        extra=f"data.public_path={u} strategy.params.fedmd.pretrain_epochs=1 strategy.params.fedmd.distill_epochs=1",
    )
    (row,) = [r for r in read_csv(out / "rejections.csv") if r["phase"] == "describe"]
    assert row["node_id"] == "102"
    assert "public set mismatch" in row["reason"] and "node config 'public-path'" in row["reason"]
    assert str(other_u) in row["reason"]
    assert int(read_csv(out / "rounds.csv")[-1]["clients"]) == 2


def test_nodes_config_errors_name_the_key(tmp_path):
    from fedapps.config import ConfigError

    with pytest.raises(ConfigError, match="data.public_path"):  # a U strategy on nodes needs the server's U file
        resolve(load_config(None, ["strategy.name=fedmd", "data.source=nodes"]))
    resolve(
        load_config(
            None, ["strategy.name=fedmd", "data.source=nodes", "data.public_fraction=0.2", "data.public_path=U.npz"]
        )
    )  # public_fraction does not apply to nodes: ignored
    with pytest.raises(ConfigError, match="data.num_classes.*'nodes' only"):
        resolve(load_config(None, ["data.source=digits", "data.num_classes=10"]))


def test_agree_takes_the_majority_and_refuses_the_rest():
    def rep(node, shape=(1, 8, 8), declared=0, max_label=9):
        return NodeReport(node, node, shape, declared, max_label, (1,), (1,))

    k, shape, refused = agree([rep(1), rep(2), rep(3, shape=(3, 8, 8)), rep(4, max_label=3)])
    assert (k, shape, sorted(refused)) == (10, (1, 8, 8), [3])  # labels 0..3 fit 10 classes
    k, _, refused = agree([rep(1, declared=10), rep(2, declared=10), rep(3, declared=5, max_label=4)])
    assert k == 10 and sorted(refused) == [3]
    k, _, refused = agree([rep(1), rep(2), rep(3, declared=5, max_label=4)])  # one declarer does not outvote two
    assert k == 10 and sorted(refused) == [3]
    k, _, refused = agree([rep(1, max_label=4), rep(2, max_label=6)])  # nobody declares: the largest label + 1
    assert k == 7 and not refused
    k, _, refused = agree([rep(1), rep(2)], pinned_classes=8)  # data.num_classes pins it: label 9 does not fit
    assert k == 8 and sorted(refused) == [1, 2]


# ------------------------------------------------------------------ node-side state across a SuperNode restart


def message(cfg, strategy, rnd: int, ops: list[str], token: str):
    # no run-folder state-dir in the message: only the node's own counts
    InProcessGrid(1)  # building a Message outside Flower's runtime needs a task identity; the grid sets one
    s = resolve(cfg).build(cfg, RunContext(client_state=protocol.Bookkeeping(state_run=token)))
    return protocol.Draft(100, s.request(rnd, ops, keep=protocol.Keep(persist=True))).message()


def test_state_dir_survives_a_supernode_restart(tmp_path, monkeypatch, digits):
    sites = write_sites(tmp_path, digits, 2)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cfg = load_config(
        None,
        [
            "strategy.name=local",
            "data.source=nodes",
            "data.num_clients=2",
            "model.name=mlp",
            "data.num_classes=10",
            "data.input_shape=[1,8,8]",
        ],
    )
    node = {"data-path": str(sites[0]), NODE_CLIENT_ID: 0, STATE_DIR_KEY: "~/state", "threads": 1}

    def fresh() -> Context:  # what a restarted SuperNode has: a new Context with the same node config
        return Context(run_id=1, node_id=100, node_config=dict(node), state=RecordDict(), run_config={})

    first = fresh()
    handle(message(cfg, "local", 1, ["train"], "run-a"), first)
    trained = first.state[STATE_MODEL].to_torch_state_dict()
    assert (home / "state" / "run-a" / "0.r1.pt").is_file()  # '~' is the node's home; one folder per run
    handle(message(cfg, "local", 1, ["train"], "run-c"), fresh())  # another run on the same node at the same time
    assert (home / "state" / "run-c" / "0.r1.pt").is_file() and len(list((home / "state").glob("*/*.pt"))) == 2
    restarted = fresh()
    handle(message(cfg, "local", 2, ["evaluate"], "run-a"), restarted)
    restored = restarted.state[STATE_MODEL].to_torch_state_dict()
    assert all(torch.equal(trained[k], restored[k]) for k in trained)
    # without the node's state-dir the restarted node starts from the initial model (what the table of
    # docs/reference/node-state.md says)
    node.pop(STATE_DIR_KEY)
    bare = fresh()
    handle(message(cfg, "local", 2, ["evaluate"], "run-a"), bare)
    initial = bare.state[STATE_MODEL].to_torch_state_dict()
    assert not all(torch.equal(trained[k], initial[k]) for k in trained)
    # another run's files are never restored
    node[STATE_DIR_KEY] = "~/state"
    other = fresh()
    handle(message(cfg, "local", 2, ["evaluate"], "run-b"), other)
    assert all(torch.equal(initial[k], v) for k, v in other.state[STATE_MODEL].to_torch_state_dict().items())


def test_threads_node_config_is_checked():
    from fedapps.client.registry import ProtocolError
    from fedapps.client.worker import node_threads

    ctx = Context(run_id=1, node_id=1, node_config={"threads": 3}, state=RecordDict(), run_config={})
    assert node_threads(ctx) == 3
    ctx = Context(run_id=1, node_id=1, node_config={"threads": "many"}, state=RecordDict(), run_config={})
    with pytest.raises(ProtocolError, match="node config 'threads'"):
        node_threads(ctx)


# ------------------------------------------------------------------ what a restart loses (docs/reference/node-state.md)


def test_what_a_restart_loses_is_read_off_the_request():
    """fedapps_tools.docgen.lost_on_restart on hand-made requests: nothing kept, the whole state / the parameters /
    the body loaded, or nothing loaded (several packed models are not the client's model)."""
    from fedapps_tools.docgen import lost_on_restart

    def request(persist, into_model=None, multi=None, which="state"):
        return protocol.Request(
            ops=("train",),
            round=1,
            keep=protocol.Keep(persist=persist),
            load=protocol.Load(into_model=into_model, multi=multi),
            returns=protocol.Return(part=which),
        )

    assert lost_on_restart(request(False, True)) == "nothing"
    assert lost_on_restart(request(True, True, which="state")) == "nothing"
    assert lost_on_restart(request(True, True, which="params")) == "buffers"
    assert lost_on_restart(request(True, True, which="body")) == "head"
    assert lost_on_restart(request(True, None)) == "model"
    assert lost_on_restart(request(True, True, multi=True)) == "model"


def test_each_strategys_restart_loss_matches_what_its_messages_load():
    """The generated page's rows (docgen.restart_losses, read off every strategy's messages of rounds 1 and 2) agree
    with the arrays those messages carry: where a message loads arrays into the model, they are exactly the part
    its reply names. A few rows pinned from the algorithms: FedAvg keeps nothing, FedPer its head, cwFedAvg its
    buffers, COSMOS its whole model."""
    from fedapps.models import build_model, state_part
    from fedapps_tools.docgen import restart_drafts, restart_losses

    losses = restart_losses(STRATEGIES)
    assert set(losses) == set(STRATEGIES)
    assert (losses["fedavg"], losses["fedper"], losses["cwfedavg"], losses["cosmos"]) == (
        "nothing",
        "head",
        "buffers",
        "model",
    )
    for name in sorted(STRATEGIES):
        for draft in restart_drafts(name):
            request = draft.request
            if request.load.into_model and draft.arrays is not None:  # arrays.keys says what is loaded
                model = build_model(str(request.setup.model.name), 10, (1, 8, 8))  # FedNH's: mlp+cosine
                assert set(draft.arrays) == set(state_part(model, request.returns.which)), name


def test_a_resumed_nodes_run_pins_what_its_nodes_described():
    cfg = load_config(None, ["data.source=nodes", "data.num_clients=2"])
    saved = "data:\n  source: nodes\n  num_classes: 10\n  input_shape: [1, 8, 8]\n"
    pinned = nodes_as_checkpointed(cfg, saved)
    assert (pinned.data.num_classes, pinned.data.input_shape) == (10, [1, 8, 8])
    assert nodes_as_checkpointed(load_config(None, ["data.source=digits"]), saved).data.num_classes == 0


def test_error_replies_read_as_the_clients_own_exception():
    """Flower 1.42's two reason formats (observed: a SuperNode's, and the Ray simulation's, which wraps the whole
    remote traceback with colour codes) become 'ProtocolError: <message>' in the rejection."""
    from fedapps.wire.validation import error_reason

    msg = "node config 'data-path'='/x/site.npz': /x/site.npz does not exist on this node; fix the path"
    supernode = f"<class 'fedapps.client.registry.ProtocolError'>:<'{msg}'>"
    ray = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
        '(pid=1, ip=127.0.0.1)\n  File "/w/fedapps/client/worker.py", line 110, in client_federation\n'
        f"    raise ProtocolError(...)\nfedapps.client.registry.ProtocolError: {msg}\n\nThe above exception was the "
        'direct cause of the following exception:\n\n  File "/f/ray_actor.py", line 65, in run\n    raise '
        "ClientAppException(str(ex)) from ex\nflwr.clientapp.client_app.ClientAppException: \nException "
        f"ClientAppException occurred. Message: {msg}'>"
    )
    assert error_reason(supernode) == f"ProtocolError: {msg}"
    assert error_reason(ray) == f"ProtocolError: {msg}"
    assert error_reason("InjectedFault: injected failure") == "InjectedFault: injected failure"


# ------------------------------------------------------------------ evaluation counts bound (deployment)


def weighted_headline(out: Path) -> tuple[float, dict[int, int]]:
    """summary.json's accuracy_weighted and each client's evaluation-split size as partition.csv records it."""
    summary = json.loads((out / "summary.json").read_text())
    sizes = {int(r["client"]): int(r["total"]) for r in read_csv(out / "partition.csv") if r["split"] == "test"}
    return float(summary["accuracy_weighted"]), sizes


@pytest.mark.parametrize(
    "claim, rejected",
    [("eval-claim=1000000000000", True), ("eval-claim", False)],  # 10^12 samples all correct; its own n, all correct
)
def test_one_client_moves_the_weighted_headline_by_at_most_its_described_share(tmp_path, digits, claim, rejected):
    """data.source nodes: the server knows no test sizes, so each client's evaluation-split size is bound by the
    describe phase. A client reporting deployed-n 10^12 with counts that agree (all correct) is rejected; one that
    lies about its accuracy on its own bound n is accepted, and moves the sample-weighted headline by at most its
    share. Local: the other clients' models are the same in every run, so the share is the whole difference."""
    sites = write_sites(tmp_path, digits, 4)
    hostile = 3

    def configs(spec: str) -> dict:
        return {i: {"data-path": str(sites[i]), NODE_CLIENT_ID: i, faults.NODE_KEY: spec} for i in range(4)}

    clean, sizes = weighted_headline(run(tmp_path / "clean", configs(""), strategy="local", mods=[faults.faults_mod]))
    share = sizes[hostile] / sum(sizes.values())
    out = run(tmp_path / "hostile", configs(f"{claim}@{hostile}/*/*"), strategy="local", mods=[faults.faults_mod])
    got, _ = weighted_headline(out)
    refused = [r for r in read_csv(out / "rejections.csv") if r["phase"] != "describe"]
    if rejected:
        assert {(r["phase"], r["client_id"]) for r in refused} == {("train", "3"), ("evaluate", "3")}
        assert all(
            f"differs from the {sizes[hostile]} evaluation samples client 3 is bound to" in r["reason"] for r in refused
        ), refused
        assert json.loads((out / "summary.json").read_text())["final_round_measured_clients"] == 3
    else:
        assert refused == [] and got > clean  # accepted: it moves the headline, up (all correct) ...
    assert abs(got - clean) <= share + 1e-12, (got, clean, share)  # ... by at most its bound share
