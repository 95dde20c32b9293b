"""FedSelect: the selection mask and its growth by hand, the masked average, LocalAlt's frozen entries, what the
client loads and sends (only its shared entries: the byte count), a short run and one real `flwr run`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array
from torch import nn

from deployed_toy import evaluate, private
from fedapps.client import ops
from fedapps.client.registry import ProtocolError
from fedapps.client.worker import STATE_MODEL, Worker
from fedapps.config import ConfigError, OptimSettings, load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.reporting.results import read_csv
from fedapps.server.driver import RoundDriver
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from strategies import RunContext, resolve
from strategies.fedselect import (
    LOAD_OP,
    MASK_PREFIX,
    TRAIN_OP,
    entries_frozen,
    grow_mask,
    local_alt,
    masked_average,
    moved_entries,
    pack_mask,
    scatter_shared,
    selectable,
    shared_values,
    unpack_mask,
)
from test_ops_worker import worker_message

PATHOLOGICAL = {"source": "digits", "partition": "pathological", "num_clients": 4, "classes_per_client": 4}


# --------------------------------------------------------------------------- the selection mask


def test_growth_step_takes_the_largest_movers_among_the_shared_entries_by_hand():
    moved = np.array([[0.5, 0.1, 0.9], [0.3, 0.0, 0.7]])
    none = np.zeros((2, 3), dtype=bool)
    # round(0.5 × 6) = 3 entries: 0.9, 0.7, 0.5
    first = grow_mask(none, moved, rate=0.5, limit=1.0)
    np.testing.assert_array_equal(first, [[True, False, True], [False, False, True]])
    # next step: 3 shared left (0.1, 0.3, 0.0 → new movements below); round(0.5 × 3) = 2 (half up): the two largest
    # of the SHARED entries, even though a personal entry moved more
    moved2 = np.array([[9.0, 0.2, 9.0], [0.6, 0.4, 9.0]])
    second = grow_mask(first, moved2, rate=0.5, limit=1.0)
    np.testing.assert_array_equal(second, [[True, False, True], [True, True, True]])
    # the cap: floor(0.8 × 6) = 4 personal at most, 3 already: one more, the largest mover (0.6)
    capped = grow_mask(first, moved2, rate=0.5, limit=0.8)
    np.testing.assert_array_equal(capped, [[True, False, True], [True, False, True]])
    # ties go to the lower flat index; rate × shared rounds half up (0.25 × 6 = 1.5 → 2)
    np.testing.assert_array_equal(grow_mask(none, np.ones((2, 3)), 0.25, 1.0), [[True, True, False], [False] * 3])
    # the input is not modified, and a full tensor stays as it is
    assert not none.any() and grow_mask(np.ones((2, 2), bool), np.ones((2, 2)), 0.5, 1.0).all()


def test_growth_over_rounds_reaches_the_cap_and_never_drops_an_entry():
    """10×10 tensor, p = 0.25, α = 0.8: 0 → 25 → 44 → 58 → 69 → 77 → 80 (capped) → 80 personal entries."""
    rng = np.random.default_rng(0)
    personal = np.zeros((10, 10), dtype=bool)
    counts = []
    for _ in range(7):
        moved = rng.random((10, 10))
        new = grow_mask(personal, moved, 0.25, 0.8)
        assert np.all(new[personal])  # personal entries stay personal
        chosen = new & ~personal
        if chosen.any():  # the chosen ones are the largest movers among the previously shared entries
            assert moved[chosen].min() >= moved[~personal & ~new].max()
        personal = new
        counts.append(int(personal.sum()))
    assert counts == [25, 44, 58, 69, 77, 80, 80]


def test_only_weight_tensors_are_selectable():
    assert selectable("fc.weight") and selectable("conv1.0.weight") and selectable("weight")
    assert not selectable("fc.bias") and not selectable("fc.weight_scale") and not selectable("bn.running_mean")


def test_masks_travel_as_bits_and_shared_values_round_trip():
    mask = np.array([[True, False, False], [False, True, True], [False, False, True]])
    bits = pack_mask(mask)
    assert bits.dtype == np.uint8 and bits.nbytes == 2  # ceil(9 / 8)
    np.testing.assert_array_equal(unpack_mask(bits, (3, 3)), mask)
    with pytest.raises(ValueError, match="takes 2 bytes"):
        unpack_mask(np.zeros(3, np.uint8), (3, 3))
    full = np.arange(9, dtype=np.float32).reshape(3, 3)
    values = shared_values(full, mask)
    np.testing.assert_array_equal(values, [1, 2, 3, 6, 7])
    np.testing.assert_array_equal(scatter_shared(values, mask, (3, 3)), np.where(mask, 0, full))
    np.testing.assert_array_equal(shared_values(full, None), full.reshape(-1))


# --------------------------------------------------------------------------- the server's average


def test_masked_average_by_hand_a_personal_entry_gets_nothing_from_its_owner():
    current = {"w": np.array([10.0, 20.0, 30.0, 40.0], dtype=np.float32), "b": np.array([1.0], dtype=np.float32)}
    a = {"w": np.array([1000.0, 2.0, 4.0, 1000.0]), "b": np.array([2.0])}  # 1000: personal entries, any value
    b = {"w": np.array([1.0, -9999.0, 8.0, -9999.0]), "b": np.array([6.0])}
    a_personal = {"w": np.array([True, False, False, True])}
    b_personal = {"w": np.array([False, True, False, True])}  # no entry for "b": all shared
    out = masked_average(current, [(a, a_personal, 1.0), (b, b_personal, 3.0)])
    np.testing.assert_allclose(out["w"], [1.0, 2.0, (1 * 4 + 3 * 8) / 4, 40.0])  # entry 3: nobody shares it
    np.testing.assert_allclose(out["b"], [(1 * 2 + 3 * 6) / 4])
    assert out["w"].dtype == np.float32
    assert np.array_equal(masked_average(current, [])["w"], current["w"])


def test_server_averages_over_sharers_and_grows_masks_from_what_it_sent_and_got(tiny_config):
    own = {"grow_every": 1, "rate": 0.5, "weighting": "samples"}
    cfg = load_config(tiny_config(strategy={"name": "fedselect", "params": {"fedselect": own}}))
    s = resolve(cfg).build(cfg)
    sent = {k: v.copy() for k, v in s.global_params.items()}
    w = "fc.weight"
    s.masks[0] = {w: np.zeros(sent[w].shape, dtype=bool)}
    s.masks[0][w][0, :3] = True  # client 0 owns three entries of the classifier
    got, replies = {}, []
    for cid, shift, n in ((0, 1.0, 10), (1, 3.0, 30)):
        values = {k: v + shift for k, v in sent.items()}
        values[w] = values[w] + np.linspace(0, 1, values[w].size, dtype=np.float32).reshape(values[w].shape)
        got[cid] = values
        arrays = {k: shared_values(v, s.masks.get(cid, {}).get(k)) for k, v in values.items()}
        replies.append(ClientReply(100 + cid, cid, n, {}, arrays=arrays))
    extra = s.aggregate(1, replies)
    new = s.global_params
    np.testing.assert_allclose(new[w][0, :3], got[1][w][0, :3], rtol=1e-6)  # client 1 alone: client 0's are personal
    np.testing.assert_allclose(new[w][0, 3:], (10 * got[0][w][0, 3:] + 30 * got[1][w][0, 3:]) / 40, rtol=1e-6)
    np.testing.assert_allclose(new["fc.bias"], sent["fc.bias"] + (10 * 1 + 30 * 3) / 40, rtol=1e-6)
    # both masks grew from |returned − sent|: the largest movers of fc.weight are its last entries (linspace)
    m1 = s.masks[1][w].reshape(-1)
    assert m1.sum() == round(0.5 * m1.size) and m1[-1] and not m1[0]
    m0 = s.masks[0][w]
    assert m0[0, :3].all() and m0.sum() == 3 + int(np.floor(0.5 * (m0.size - 3) + 0.5))
    assert "fc.bias" not in s.masks[1] and extra["masks_grown"] == 2


def fedselect(tiny_config, **own):
    cfg = load_config(tiny_config(strategy={"name": "fedselect", "params": {"fedselect": own}}))
    return resolve(cfg).build(cfg)


def reply_of(s, cid: int, values: dict, n: int = 10) -> ClientReply:
    """Client ``cid``'s reply holding ``values`` at its shared entries (what its client would send)."""
    return ClientReply(
        100 + cid, cid, n, {}, {k: shared_values(v, s.masks.get(cid, {}).get(k)) for k, v in values.items()}
    )


def test_uniform_weighting_gives_each_sharing_client_the_same_weight(tiny_config):
    """weighting uniform (the default, the authors' code): each shared entry the plain mean over its sharers,
    whatever their sample counts (10 and 30 here: (1 + 3)/2 = 2 added, not (10·1 + 30·3)/40 = 2.5)."""
    s = fedselect(tiny_config, grow_every=5)
    assert s.params.weighting == "uniform"
    sent = {k: v.copy() for k, v in s.global_params.items()}
    s.aggregate(1, [reply_of(s, 0, {k: v + 1.0 for k, v in sent.items()}, 10),
                    reply_of(s, 1, {k: v + 3.0 for k, v in sent.items()}, 30)])  # fmt: skip
    for k, v in sent.items():
        np.testing.assert_allclose(s.global_params[k], v + 2.0, rtol=1e-6, atol=1e-6, err_msg=k)


def test_span_delta_measures_from_the_previous_growth_step_not_from_what_was_sent(tiny_config):
    """grow_every 2, one client: round 1 it returns w0 + a, which becomes the global model w1 (it alone shares every
    entry); round 2 it returns w1 + b. At that growth step span ranks |a + b| (moved since the initial model, across
    the server's average) and last ranks |b| (this training alone). a = 1 on fc.weight's first k entries, b = 0.1 on
    the next k (k = round(0.25 × size)): span makes the first k personal, last the next k. Then the span restarts
    from the values returned at that step: a third and fourth round returning c = 0.05 on the k entries after those
    make personal only entries of c (with the reference not reset, |a + b + c| would take b's 0.1 entries first)."""
    w = "fc.weight"
    masks = {}
    for delta in ("span", "last"):
        s = fedselect(tiny_config, grow_every=2, delta=delta)
        w0 = {k: v.copy() for k, v in s.global_params.items()}
        size = w0[w].size
        k = int(np.floor(0.25 * size + 0.5))
        a, b = np.zeros(size, np.float32), np.zeros(size, np.float32)
        a[:k], b[k : 2 * k] = 1.0, 0.1
        s.aggregate(1, [reply_of(s, 0, {**w0, w: w0[w] + a.reshape(w0[w].shape)})])
        w1 = {key: v.copy() for key, v in s.global_params.items()}
        np.testing.assert_allclose(w1[w], w0[w] + a.reshape(w0[w].shape), rtol=1e-6)
        assert s.aggregate(2, [reply_of(s, 0, {**w1, w: w1[w] + b.reshape(w1[w].shape)})])["masks_grown"] == 1
        masks[delta] = s.masks[0][w].reshape(-1).copy()
        if delta == "span":
            got = s.reference[0][w].reshape(-1)
            np.testing.assert_allclose(got, (w1[w].reshape(-1) + b), rtol=1e-6)  # returned at the growth step
            c = np.zeros(size, np.float32)
            c[2 * k : 3 * k] = 0.05
            w2 = {key: v.copy() for key, v in s.global_params.items()}
            s.aggregate(3, [reply_of(s, 0, w2)])
            w3 = {key: v.copy() for key, v in s.global_params.items()}
            s.aggregate(4, [reply_of(s, 0, {**w3, w: w3[w] + c.reshape(w3[w].shape)})])
            second = np.flatnonzero(s.masks[0][w].reshape(-1) & ~masks["span"])
            assert len(second) == int(np.floor(0.25 * (size - k) + 0.5)) and set(second) <= set(range(2 * k, 3 * k))
    assert np.flatnonzero(masks["span"]).tolist() == list(range(k))
    assert np.flatnonzero(masks["last"]).tolist() == list(range(k, 2 * k))


def test_moved_entries_by_hand():
    got = moved_entries(np.array([1.0, -2.0, 5.0]), np.array([0.5, 1.0, 0.0]), np.array([False, False, True]))
    np.testing.assert_allclose(got, [0.5, 3.0, 0.0])  # |Δ|, a personal entry 0


def test_span_reference_is_plain_data_and_survives_a_checkpoint(tiny_config, tmp_path):
    """The per-client reference is arrays in dicts (what a checkpoint may hold); saved and loaded into a fresh
    strategy, the next growth step is the same as without the interruption."""
    from fedapps.checkpoint import load_checkpoint, save_checkpoint

    w = "fc.weight"
    runs = []
    for interrupted in (False, True):
        s = fedselect(tiny_config, grow_every=1)
        rng = np.random.default_rng(0)

        def step(s=s, rng=rng):
            return {k: v + rng.standard_normal(v.shape).astype(np.float32) for k, v in s.global_params.items()}

        s.aggregate(1, [reply_of(s, 0, step())])
        if interrupted:
            state = s.state_dict()
            assert isinstance(state["reference"][0][w], np.ndarray) and "initial_params" not in state
            save_checkpoint(tmp_path, {"strategy": state})
            s = fedselect(tiny_config, grow_every=1)
            s.load_state_dict(load_checkpoint(tmp_path)["strategy"])
        s.aggregate(2, [reply_of(s, 0, step(s))])
        runs.append(s.masks[0][w])
    np.testing.assert_array_equal(runs[0], runs[1])


# --------------------------------------------------------------------------- the client side


def test_frozen_entries_stay_exact_under_momentum_and_weight_decay():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    frozen = {"weight": torch.tensor([[True, False, True, False]] * 3), "bias": torch.ones(3, dtype=torch.bool)}
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    settings = OptimSettings(epochs=2, batch_size=8, lr=0.5, momentum=0.9, weight_decay=0.1)
    with entries_frozen(model, frozen):
        ops.train(model, x, y, settings)
    w = model.weight.detach()
    assert torch.equal(w[frozen["weight"]], before["weight"][frozen["weight"]])
    assert (w[~frozen["weight"]] != before["weight"][~frozen["weight"]]).all()
    assert torch.equal(model.bias.detach(), before["bias"]) and model.bias.requires_grad  # restored afterwards
    ops.train(model, x, y, settings)  # outside the block everything moves again
    assert (model.weight.detach()[frozen["weight"]] != before["weight"][frozen["weight"]]).all()


def test_local_alt_trains_the_personal_entries_first_then_the_shared_ones():
    torch.manual_seed(1)
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    start = nn.Linear(4, 3)
    personal = {"weight": torch.tensor([[True, False, False, False], [False, True, False, False], [False] * 4])}
    settings = OptimSettings(epochs=1, batch_size=8, lr=0.3)

    def copy() -> nn.Module:
        m = nn.Linear(4, 3)
        m.load_state_dict(start.state_dict())
        return m

    got = copy()
    local_alt(got, x, y, personal, settings, torch.Generator().manual_seed(5))
    by_hand, reversed_ = copy(), copy()
    shared_frozen = {"weight": ~personal["weight"], "bias": torch.ones(3, dtype=torch.bool)}
    gen = torch.Generator().manual_seed(5)
    for frozen in (shared_frozen, personal):  # the personal epoch, then the shared one, on one batch stream
        with entries_frozen(by_hand, frozen):
            ops.train(by_hand, x, y, settings, None, gen)
    gen = torch.Generator().manual_seed(5)
    for frozen in (personal, shared_frozen):
        with entries_frozen(reversed_, frozen):
            ops.train(reversed_, x, y, settings, None, gen)
    assert torch.equal(got.weight, by_hand.weight) and torch.equal(got.bias, by_hand.bias)
    assert not torch.equal(got.weight, reversed_.weight)
    # nothing personal yet: one plain epoch, the same as ops.train
    plain, alt = copy(), copy()
    ops.train(plain, x, y, settings, None, torch.Generator().manual_seed(5))
    local_alt(alt, x, y, {}, settings, torch.Generator().manual_seed(5))
    assert torch.equal(plain.weight, alt.weight)


def test_client_loads_the_shared_values_keeps_its_personal_ones_and_sends_only_the_shared():
    grid, msg = worker_message([])
    ctx = grid.contexts[100]
    Worker(msg, ctx).run()  # first contact: the private model (seeded initial) is kept
    own = ctx.state[STATE_MODEL].to_torch_state_dict()
    w = "fc1.0.weight"
    personal = np.zeros(tuple(own[w].shape), dtype=bool)
    personal[:5, :7] = True
    params = {k: v.numpy() for k, v in own.items()}  # the MLP has no buffers
    rng = np.random.default_rng(0)
    glob = {k: (0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}
    arrays = {k: shared_values(v, personal if k == w else None) for k, v in glob.items()}
    arrays[MASK_PREFIX + w] = pack_mask(personal)
    _, msg = worker_message([LOAD_OP, "evaluate:loaded"], arrays=arrays)
    Worker(msg, ctx).run()
    loaded = ctx.state[STATE_MODEL].to_torch_state_dict()
    assert torch.equal(loaded[w][torch.from_numpy(personal)], own[w][torch.from_numpy(personal)])
    np.testing.assert_array_equal(loaded[w][~torch.from_numpy(personal)].numpy(), shared_values(glob[w], personal))
    assert all(torch.equal(loaded[k], torch.from_numpy(v)) for k, v in glob.items() if k != w)
    _, msg = worker_message([LOAD_OP, TRAIN_OP], arrays=arrays)
    reply = Worker(msg, ctx).run()
    sent_back = {k: v.numpy() for k, v in reply.content[protocol.ARRAYS].items()}
    assert set(sent_back) == set(params)  # no mask goes up
    assert sent_back[w].shape == (personal.size - personal.sum(),) and sent_back["fc.bias"].shape == (10,)
    shared_counts = [v.size - (personal.sum() if k == w else 0) for k, v in params.items()]
    assert protocol.record_nbytes(RecordDictOf(reply)) == wire_bytes(shared_counts)
    assert wire_bytes(shared_counts) == wire_bytes([v.size for v in params.values()]) - 4 * personal.sum()
    trained = ctx.state[STATE_MODEL].to_torch_state_dict()
    np.testing.assert_array_equal(shared_values(trained[w].numpy(), personal), sent_back[w])
    assert not torch.equal(trained[w][torch.from_numpy(personal)], own[w][torch.from_numpy(personal)])  # fine-tuned


def wire_bytes(counts) -> int:
    """Bytes of float32 arrays of these sizes as they travel (4 per value plus each array's .npy header)."""
    return sum(len(Array(np.zeros(int(n), dtype=np.float32)).data) for n in counts)


def RecordDictOf(reply):
    """Just the reply's arrays record, for its byte count."""
    from flwr.app import RecordDict

    return RecordDict({protocol.ARRAYS: reply.content[protocol.ARRAYS]})


def test_client_refuses_a_message_whose_values_do_not_fit_its_mask():
    grid, msg = worker_message([])
    ctx = grid.contexts[100]
    Worker(msg, ctx).run()
    params = {k: v.numpy() for k, v in ctx.state[STATE_MODEL].to_torch_state_dict().items()}
    personal = np.zeros(params["fc.weight"].shape, dtype=bool)
    personal[0, 0] = True
    arrays = {k: v.reshape(-1) for k, v in params.items()}  # every value, but a mask that says one is personal
    arrays[MASK_PREFIX + "fc.weight"] = pack_mask(personal)
    _, msg = worker_message([LOAD_OP], arrays=arrays)
    with pytest.raises(ProtocolError, match="shared values for"):  # the app turns it into an error reply
        Worker(msg, ctx).run()


# --------------------------------------------------------------------------- the strategy


def test_params_are_declared_and_checked(tiny_config):
    params = resolve(load_config(tiny_config(strategy={"name": "fedselect"}))).params
    assert (params.rate, params.limit, params.grow_every) == (0.25, 0.8, 3)  # the authors' code
    assert (params.delta, params.weighting) == ("span", "uniform")  # the authors' code too
    for bad in ({"rate": 0.0}, {"limit": 1.5}, {"grow_every": 0}, {"delta": "round"}, {"weighting": "data"}):
        with pytest.raises(ConfigError, match=f"strategy.params.fedselect.{next(iter(bad))}"):
            resolve(load_config(tiny_config(strategy={"name": "fedselect", "params": {"fedselect": bad}})))


def run_inprocess(tiny_config, rounds: int, **params):
    """A short in-process run; also returns, per round, each client's personal entries after that round."""
    strategy = {"name": "fedselect", "params": {"fedselect": params}} if params else {"name": "fedselect"}
    cfg = load_config(tiny_config(rounds=rounds, data=PATHOLOGICAL, strategy=strategy))
    resolved = resolve(cfg)
    cfg = resolved.config(cfg)
    logs: list = []
    personal: list[dict[int, int]] = []

    def on_round(entry) -> None:
        logs.append(entry)
        personal.append({c: sum(int(m.sum()) for m in s.client_masks(c).values()) for c in range(4)})

    s = resolved.build(cfg, RunContext(on_round=on_round))
    grid = InProcessGrid(4, record=True)
    return s, grid, RoundDriver(s).start(grid), logs, personal


def test_short_run_sends_only_shared_entries_and_personalises(tiny_config):
    s, grid, result, logs, personal = run_inprocess(tiny_config, 4, grow_every=1)
    assert all(e.replies_rejected == 0 for e in logs), [e.rejections for e in logs]
    n_params = sum(v.size for v in s.global_params.values())
    for reply in grid.replies:  # every array that goes up: float32, one value per shared entry
        if protocol.ARRAYS in reply.content:
            arrays = reply.content[protocol.ARRAYS]
            assert all(len(a.data) == wire_bytes([a.numpy().size]) and a.numpy().ndim == 1 for a in arrays.values())
    # round r's upload: 4 bytes per entry each client shared after round r − 1 (+ headers and metrics): it shrinks
    shared = [4 * n_params] + [sum(n_params - personal[r][c] for c in range(4)) for r in range(3)]
    for e, entries in zip(logs, shared):
        assert 0 < e.bytes_up - 4 * entries < 4 * 2000, (e.round, e.bytes_up, entries)
    assert shared[0] > shared[1] > shared[2] > shared[3]
    fractions = [e.extra["personal_fraction_mean"] for e in logs]
    assert fractions[0] == pytest.approx(0.25, abs=0.01) and fractions == sorted(fractions) and fractions[-1] < 0.8
    # round 1's messages carry no mask (nobody has a personal entry yet); later ones do, as bits
    for m in grid.sent:
        if m.metadata.message_type == "train":
            masks = [k for k in m.content[protocol.ARRAYS].keys() if k.startswith(MASK_PREFIX)]
            assert (protocol.request_of(m).round == 1) == (not masks)
    acc = {r: result.evaluate_metrics_clientapp[r]["acc_mean"] for r in (1, 4)}
    assert acc[4] > acc[1], acc
    assert set(s.final_summary()["personal_fraction"]) == {"0", "1", "2", "3"}


def test_with_nothing_personal_it_is_fedavg(tiny_config):
    """A mask that never grows: the same values sent, the same training, the same average as FedAvg (up to the
    rounding of the two ways of dividing by the weights), with the average weighted by samples as FedAvg's."""
    s, _, selected, _, _ = run_inprocess(tiny_config, 2, grow_every=1000, weighting="samples")
    cfg = load_config(tiny_config(rounds=2, data=PATHOLOGICAL, strategy={"name": "fedavg"}))
    plain = RoundDriver(resolve(cfg).build(cfg)).start(InProcessGrid(4))
    for k, v in s.global_params.items():
        np.testing.assert_allclose(v, plain.arrays[k].numpy(), rtol=1e-5, atol=1e-7, err_msg=k)
    for r in (1, 2):
        assert selected.evaluate_metrics_clientapp[r]["acc_mean"] == plain.evaluate_metrics_clientapp[r]["acc_mean"]


@pytest.mark.heavy
def test_same_seed_same_rounds_csv(tiny_config, tmp_path):
    import server_app

    cfg = tiny_config(
        rounds=3, data=PATHOLOGICAL, strategy={"name": "fedselect", "params": {"fedselect": {"grow_every": 1}}}
    )
    rows = []
    for i in (0, 1):
        server_app.run_experiment(InProcessGrid(4), str(cfg), "", str(tmp_path / str(i)))
        (run,) = [d for d in (tmp_path / str(i)).iterdir() if d.is_dir()]
        rows.append(
            [
                {k: v for k, v in r.items() if "seconds" not in k and not k.startswith("t_")}
                for r in read_csv(run / "rounds.csv")
            ]
        )
    assert rows[0] == rows[1]


@pytest.mark.heavy
def test_end_to_end_through_flowers_wire_format(tmp_path):
    """2 rounds of FedSelect on digits, 3 clients, every message, reply and node Context through Flower's protobuf
    encoding (:func:`conftest.wire_run`; the Ray path itself: test_cli_e2e.py)."""
    from conftest import wire_run

    out = wire_run(
        tmp_path,
        strategy={"name": "fedselect", "params": {"fedselect": {"grow_every": 1}}},
        data={"source": "digits", "partition": "pathological", "num_clients": 3, "classes_per_client": 4},
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fedselect" and summary["rounds"] == 2 and summary["num_clients"] == 3
    assert 0.0 < summary["accuracy_mean"] <= 1.0
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [3, 3] and [r["replies_rejected"] for r in rows] == [0, 0]
    assert rows[1]["bytes_up"] < rows[0]["bytes_up"]  # after round 1's growth a quarter of the weights stay home
    assert rows[0]["personal_fraction_mean"] == pytest.approx(0.25, abs=0.01)


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """FedSelect's deployed model after round rnd: that round's shared values under the client's personal entries
    (its mask after that round's growth)."""
    state = {}
    for k, own in private(grid, cid).items():
        personal = s.client_masks(cid).get(k)
        shared = torch.as_tensor(s.global_params[k]) if k in s.global_params else own
        state[k] = shared if personal is None else torch.where(torch.as_tensor(personal), own, shared)
    return evaluate(state, data)


DEPLOYED_BY_HAND = {"fedselect": deployed_by_hand}
