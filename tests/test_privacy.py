"""Sample-level differential privacy (privacy.mode: sample, fedapps/client/privacy.py): the accountant against
dp-accounting, per-sample clipping, the noise's scale, training terms, the ledger across messages and processes,
the budget, the config and the records (rounds.csv, summary.json)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import pytest
import torch
from torch import nn

pytest.importorskip(
    "opacus", reason="privacy.mode sample needs the optional extra privacy (pip install -e '.[privacy]')"
)
dp_accounting = pytest.importorskip("dp_accounting", reason="the reference accountant comes with the extra privacy")
# the project imports below come after the skips on purpose: without the extra this module is skipped, not broken
# ruff: noqa: E402

from fedapps.client import ops, privacy
from fedapps.client.worker import Worker
from fedapps.config import (
    ConfigError,
    ExperimentConfig,
    config_hash,
    load_config,
    without_later_defaults,
)
from fedapps.data import get_federation
from fedapps.reporting.results import privacy_columns, rejection_problems
from fedapps.wire import protocol
from fedapps.wire.validation import Rejection
from strategies.cwfedavg import WDR_LAMBDA
from strategies.fedprox import PROX_MU
from test_ops_worker import worker_message

SIGMA, CLIP, DELTA = 1.1, 1.0, 1e-5


def settings(**kw) -> protocol.Privacy:
    values = {
        "mode": "sample",
        "noise_multiplier": SIGMA,
        "max_grad_norm": CLIP,
        "delta": DELTA,
        "reproducible_noise": True,
        **kw,
    }
    return protocol.Privacy(**values)


def message_settings(**kw) -> protocol.Privacy:
    """The privacy settings of a message, as the server's request() builds them from the config."""
    from fedapps.server.strategy import message_privacy

    settings = message_privacy(dataclasses.replace(ExperimentConfig().privacy, mode="sample", **kw))
    assert settings is not None
    return settings


def reference_epsilon(history, delta, orders) -> float:
    """dp-accounting's RDP accountant on the same Poisson-subsampled Gaussian steps (the same RDP orders)."""
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    for sigma, q, steps in history:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


# --------------------------------------------------------------------------- the accountant


@pytest.mark.parametrize(
    "history, delta",
    [
        ([(1.1, 256 / 60000, 60 * 234)], 1e-5),  # DP-SGD's MNIST setting (Abadi et al. 2016)
        ([(1.0, 16 / 337, 21)], 1e-5),  # one local epoch of a digits client
        ([(0.8, 0.05, 100), (2.0, 0.2, 30)], 1e-6),  # two loops with other settings compose
    ],
)
def test_the_accountant_matches_dp_accounting(history, delta):
    from opacus.accountants.rdp import RDPAccountant

    got = privacy.epsilon(history, delta)
    assert 0 < got < 100
    # the libraries compute the subsampled Gaussian's RDP at fractional orders apart (dp-accounting drops an order
    # whose series does not converge): they agree to 1e-3; 1 % more steps or less noise moves ε by more
    assert got == pytest.approx(reference_epsilon(history, delta, RDPAccountant.DEFAULT_ALPHAS), rel=1e-3)
    for wrong in ([(s * 0.99, q, k) for s, q, k in history], [(s, q, int(k * 1.02) + 1) for s, q, k in history]):
        assert privacy.epsilon(wrong, delta) > got * 1.002


def test_the_accountant_grows_with_steps_and_shrinks_with_noise():
    assert privacy.epsilon([], 1e-5) == 0.0
    one = privacy.epsilon([(1.0, 0.05, 100)], 1e-5)
    assert privacy.epsilon([(1.0, 0.05, 200)], 1e-5) > one > privacy.epsilon([(2.0, 0.05, 100)], 1e-5)
    assert privacy.epsilon([(1.0, 0.05, 100), (1.0, 0.05, 100)], 1e-5) == pytest.approx(
        privacy.epsilon([(1.0, 0.05, 200)], 1e-5)
    )


def test_identical_steps_are_composed_before_the_accountant_without_changing_epsilon():
    """A client enters one (σ, q, steps) per round: the entries of one (σ, q) are added up first (the RDP series is
    evaluated once, not once a round), and ε is the one of Opacus's accountant over the entries one by one."""
    from opacus.accountants import RDPAccountant

    rounds = [(1.0, 10 / 170, 17)] * 20
    history = [*rounds[:5], (2.0, 10 / 170, 17), (1.0, 10 / 170, 0), *rounds[5:], (1.0, 0.1, 3)]
    assert privacy.merged_steps(history) == [(1.0, 10 / 170, 340), (2.0, 10 / 170, 17), (1.0, 0.1, 3)]
    one_by_one = RDPAccountant()
    one_by_one.history = [h for h in history if h[2] > 0]
    assert privacy.epsilon(history, 1e-5) == pytest.approx(one_by_one.get_epsilon(1e-5), rel=1e-9)


def test_planned_steps_are_the_plain_loops():
    for n, b, drop, epochs in ((337, 16, True, 2), (337, 16, False, 1), (5, 16, True, 1), (32, 16, True, 3)):
        s = ops.OptimSettings(epochs=epochs, batch_size=b, drop_last=drop)
        plain = sum(1 for _ in range(epochs) for _ in ops.batches(n, b, True, drop, None))
        assert privacy.planned_steps(n, s) == plain
    assert privacy.sample_rate(337, 16) == 16 / 337 and privacy.sample_rate(5, 16) == 1.0


# --------------------------------------------------------------------------- the mechanism


def one_private_step(
    model: nn.Module, x, y, loss_fn, s: protocol.Privacy, lr: float, batch_size: int, regulariser=None
) -> dict[str, torch.Tensor]:
    """The parameters' change by one DP-SGD step through ``run_epochs`` (batch_size >= n: q = 1, so that every
    sample is in the one minibatch)."""
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    training = privacy.PrivateTraining(s, [], client_id=0, arch="tiny")
    optim = ops.OptimSettings(epochs=1, batch_size=batch_size, lr=lr, drop_last=False)
    with ops.privately(training):
        ops.run_epochs(model, x, y, loss_fn, optim, generator=torch.Generator().manual_seed(0), regulariser=regulariser)
    assert training.history == [(s.noise_multiplier, 1.0, 1)]
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


def cross_entropy(m, xb, yb, _w):
    return nn.functional.cross_entropy(m(xb), yb)


@ops.per_sample
def per_sample_cross_entropy(m, xb, yb, _w):
    """The same loss, marked: DP-SGD takes its per-sample gradients with torch.func instead of Opacus's hooks."""
    return nn.functional.cross_entropy(m(xb), yb)


def flat(update: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in update.values()])


@pytest.mark.parametrize("cross_entropy", [cross_entropy, per_sample_cross_entropy], ids=["hooks", "torch.func"])
def test_per_sample_clipping_bounds_one_samples_influence(cross_entropy):
    """One sample far off (a gradient ~1e4 times C) moves the noiseless step by exactly lr·C/B: its own gradient is
    clipped to C before the sum. Unclipped, or clipped as part of the batch mean, it would move it by far more."""
    torch.manual_seed(0)
    x = torch.randn(15, 4)
    y = torch.randint(0, 3, (15,))
    lr, b, s = 0.1, 16, settings(noise_multiplier=0.0, max_grad_norm=0.5)
    start = nn.Linear(4, 3)
    outlier_x = torch.full((1, 4), 1e4)
    outlier_y = start(outlier_x).argmin(dim=1).detach()  # confidently wrong: a gradient of norm ~1e4
    without = one_private_step(_copy(start), x, y, cross_entropy, s, lr, b)
    with_outlier = one_private_step(
        _copy(start), torch.cat([x, outlier_x]), torch.cat([y, outlier_y]), cross_entropy, s, lr, b
    )
    moved = float((flat(with_outlier) - flat(without)).norm())
    assert moved == pytest.approx(lr * s.max_grad_norm / b, rel=1e-3)


def _copy(model: nn.Module) -> nn.Module:
    out = type(model)(model.in_features, model.out_features)
    out.load_state_dict(model.state_dict())
    return out


def test_the_noise_has_standard_deviation_sigma_times_c():
    """Zero gradients, SGD with lr 1: the step is minus the noise over the expected batch size B, so B·step has
    standard deviation σ·C (10,100 draws: ±3 % tells σ·C = 3.0 from σ = 1.5, σ·C² = 6 and σ²·C = 4.5)."""
    torch.manual_seed(0)
    s = settings(noise_multiplier=1.5, max_grad_norm=2.0)
    b = 20
    step = one_private_step(
        nn.Linear(100, 100),
        torch.randn(8, 100),
        torch.zeros(8, dtype=torch.long),
        lambda m, xb, yb, w: 0.0 * m(xb).sum(),
        s,
        lr=1.0,
        batch_size=b,
    )
    noise = -b * flat(step)
    assert abs(float(noise.mean())) < 0.1
    assert float(noise.std()) == pytest.approx(s.noise_multiplier * s.max_grad_norm, rel=0.03)


def test_a_term_on_the_model_alone_is_added_after_the_noise():
    """Without data loss and noise, the step is the proximal term's gradient in full: not clipped to C, not divided
    by B (it reads no sample), and not lost (Opacus's optimizer keeps the per-sample gradients only)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    anchor = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    mu, lr = 4.0, 0.1

    def proximal(m):
        return 0.5 * mu * sum(((p - anchor[k]) ** 2).sum() for k, p in m.named_parameters())

    before = flat({k: v.detach().clone() for k, v in model.named_parameters()})
    step = one_private_step(
        model,
        torch.randn(6, 5),
        torch.zeros(6, dtype=torch.long),
        lambda m, xb, yb, w: 0.0 * m(xb).sum(),
        settings(noise_multiplier=0.0),
        lr,
        8,
        regulariser=proximal,
    )
    torch.testing.assert_close(flat(step), -lr * mu * before)


def test_a_model_with_batchnorm_is_refused_naming_it():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    training = privacy.PrivateTraining(settings(), [], client_id=0, arch="bn-net")
    with ops.privately(training), pytest.raises(privacy.PrivacyError, match="model 'bn-net'.*BatchNorm.*model.name"):
        ops.run_epochs(
            model, torch.randn(32, 4), torch.zeros(32, dtype=torch.long), cross_entropy, ops.OptimSettings(batch_size=8)
        )
    assert training.history == []


def test_public_loops_and_other_threads_train_as_usual():
    """Under privately(), a loop marked public (distillation on U) and a loop on another thread are the plain loop."""
    import threading

    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    optim = ops.OptimSettings(epochs=1, batch_size=8, lr=0.1)

    def trained(public: bool, context) -> dict:
        model = nn.Linear(4, 3)
        torch.manual_seed(1)
        model.reset_parameters()
        with context:
            ops.run_epochs(model, x, y, cross_entropy, optim, generator=torch.Generator().manual_seed(0), public=public)
        return model.state_dict()

    from contextlib import nullcontext

    plain = trained(False, nullcontext())
    training = privacy.PrivateTraining(settings(), [], client_id=0, arch="tiny")
    for k, v in trained(True, ops.privately(training)).items():
        torch.testing.assert_close(v, plain[k], rtol=0, atol=0)
    assert training.history == []
    found = {}
    with ops.privately(training):
        thread = threading.Thread(target=lambda: found.update(loop=ops.private_loop()))
        thread.start()
        thread.join()
        assert ops.private_loop() is training
    assert found["loop"] is None and ops.private_loop() is None


# --------------------------------------------------------------------------- through the worker


def private_message(bookkeeping=protocol.Bookkeeping(), train=None, **privacy_kw):
    """A message to train and evaluate with privacy on: ``bookkeeping`` where the client keeps its state, ``train``
    the ``train`` section's algorithm settings, ``privacy_kw`` over the default privacy settings."""
    training = protocol.Training(sections={protocol.TRAIN: protocol.Section(extra=train)} if train else {})
    return worker_message(
        ["train", "evaluate:after"], privacy=message_settings(**privacy_kw), bookkeeping=bookkeeping, training=training
    )


def client_rate_and_steps(batch_size=16, epochs=1) -> tuple[float, int]:
    """q and steps of client 0 of :func:`worker_message`'s federation."""
    grid, msg = worker_message([])
    n = len(Worker(msg, grid.contexts[100]).train_y)
    return privacy.sample_rate(n, batch_size), privacy.planned_steps(
        n, ops.OptimSettings(epochs=epochs, batch_size=batch_size)
    )


def test_each_reply_reports_the_epsilon_of_all_the_clients_steps_so_far(tmp_path):
    """ε in the reply of message r is the accountant's over r loops; a fresh process (an empty Context.state) reads the
    ledger back from the state directory and goes on from there."""
    q, steps = client_rate_and_steps()
    state = protocol.Bookkeeping(state_dir=str(tmp_path), state_run="run1")
    context = private_message(state)[0].contexts[100]
    for r in (1, 2):
        reply = Worker(private_message(state)[1], context).run()
        expected = privacy.epsilon([(1.0, q, steps)] * r, 1e-5)
        assert reply.content[protocol.METRICS][protocol.PRIVACY_EPSILON] == pytest.approx(expected, rel=1e-9)
    ledger = json.loads((tmp_path / f"0{privacy.LEDGER_SUFFIX}").read_text())
    assert ledger["run"] == "run1" and len(ledger["history"]) == 2
    fresh_grid, fresh_msg = private_message(state)  # another process: a new Context
    reply = Worker(fresh_msg, fresh_grid.contexts[100]).run()
    assert reply.content[protocol.METRICS][protocol.PRIVACY_EPSILON] == pytest.approx(
        privacy.epsilon([(1.0, q, steps)] * 3, 1e-5), rel=1e-9
    )
    other_grid, other_msg = private_message(
        dataclasses.replace(state, state_run="run2")
    )  # another run's ledger is not this one's
    reply = Worker(other_msg, other_grid.contexts[100]).run()
    assert reply.content[protocol.METRICS][protocol.PRIVACY_EPSILON] == pytest.approx(
        privacy.epsilon([(1.0, q, steps)], 1e-5), rel=1e-9
    )


def test_a_client_stops_at_its_budget():
    """A budget between the ε of two and of three rounds: the first two train, the third is refused (an error reply
    naming the budget) and its steps are not counted, nor those of any later message."""
    q, steps = client_rate_and_steps()
    two, three = (privacy.epsilon([(1.0, q, steps)] * r, 1e-5) for r in (2, 3))
    budget = (two + three) / 2
    context = private_message(epsilon_budget=budget)[0].contexts[100]
    seen = []
    for _ in range(4):
        seen.append(_serve(private_message(epsilon_budget=budget)[1], context))
    assert [r.has_error() for r in seen] == [False, False, True, True]
    assert seen[1].content[protocol.METRICS][protocol.PRIVACY_EPSILON] == pytest.approx(two, rel=1e-9) and two <= budget
    assert protocol.PRIVACY_REFUSED in seen[2].error.reason and "privacy.epsilon_budget" in seen[2].error.reason
    assert len(json.loads(context.state[privacy.STATE_LEDGER]["ledger"])["history"]) == 2


def _serve(msg, context):
    """Serve a message as Flower does: an exception becomes an error reply."""
    from flwr.app import Error, Message

    try:
        return Worker(msg, context).run()
    except Exception as exc:  # noqa: BLE001
        return Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)


def test_a_training_term_that_reads_the_data_is_refused_and_a_proximal_one_is_not():
    grid, msg = private_message(train={WDR_LAMBDA: 10.0})
    reply = _serve(msg, grid.contexts[100])
    assert reply.has_error() and "['wdr']" in reply.error.reason and "read the client's data" in reply.error.reason
    from fedapps.models import build_model

    arrays = {k: v.numpy() for k, v in build_model("mlp", 10, (1, 8, 8), seed=0).state_dict().items()}
    grid, msg = worker_message(
        ["train"],
        arrays,
        privacy=message_settings(),
        load=protocol.Load(into_model=True),
        training=protocol.Training(sections={protocol.TRAIN: protocol.Section(extra={PROX_MU: 0.1})}),
    )
    reply = _serve(msg, grid.contexts[100])
    assert not reply.has_error() and reply.content[protocol.METRICS][protocol.PRIVACY_EPSILON] > 0


def test_a_message_without_privacy_settings_trains_as_before():
    """Privacy off: no privacy key in the message, no ε in the reply, no ledger: the plain loop."""
    grid, msg = worker_message(["train"])
    assert protocol.request_of(msg).privacy is None
    assert not [k for k in msg.content[protocol.CONFIG] if k.startswith("privacy.")]
    reply = Worker(msg, grid.contexts[100]).run()
    assert protocol.PRIVACY_EPSILON not in reply.content[protocol.METRICS]
    assert privacy.STATE_LEDGER not in grid.contexts[100].state


# --------------------------------------------------------------------------- config


def test_the_config_checks_the_privacy_section():
    assert load_config(None, "privacy.mode=sample").privacy.mode == "sample"
    for bad, words in (
        ("privacy.mode=cohort", "'privacy.mode' is 'cohort'"),
        ("privacy.mode=sample privacy.noise_multiplier=0", "noise_multiplier' must be > 0"),
        ("privacy.max_grad_norm=-1", "max_grad_norm' must be > 0"),
        ("privacy.delta=1", "delta' must be in (0, 1)"),
        ("privacy.epsilon_budget=-2", "epsilon_budget' must be >= 0"),
        ("privacy.mode=sample client.mixed_precision=true client.device=cuda", "mixed_precision"),
    ):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, bad)


def test_privacy_settings_while_off_are_reported_as_ignored():
    from strategies import ignored_settings

    found = dict(ignored_settings(load_config(None, "privacy.noise_multiplier=2.0"), ["privacy.delta=0.001"]))
    assert found["privacy.noise_multiplier"] == found["privacy.delta"] == "privacy.mode is 'off'"
    assert not [
        k
        for k, _ in ignored_settings(load_config(None, "privacy.mode=sample privacy.noise_multiplier=2.0"))
        if k.startswith("privacy.")
    ]


def test_privacy_off_keeps_the_config_hash_and_the_messages():
    """An off section is not hashed (runs recorded before it existed keep their hash) and not sent."""
    from strategies import resolve

    off, on = load_config(None, "data.source=digits"), load_config(None, "data.source=digits privacy.mode=sample")
    assert "privacy" not in without_later_defaults(off.to_dict())
    assert "privacy" in without_later_defaults(on.to_dict()) and config_hash(on) != config_hash(off)
    sent_off, sent_on = (resolve(c).build(c).request(1, ["train"]) for c in (off, on))
    assert sent_off.privacy is None and not [k for k in sent_off.encode() if k.startswith("privacy.")]
    assert sent_on.privacy == message_settings() and sent_on.privacy.mode == "sample"
    assert protocol.Request.decode(sent_on.encode()).privacy == sent_on.privacy
    assert dict(dataclasses.replace(sent_on, privacy=None).encode()) == dict(sent_off.encode())  # nothing else differs


@pytest.mark.parametrize(
    "overrides, words",
    [
        ("strategy.name=ifca", "cannot cover strategy 'ifca'"),
        ("strategy.name=fedfomo", "cannot cover strategy 'fedfomo'"),
        ("strategy.name=fednh", "cannot cover strategy 'fednh'"),
        ("strategy.name=feduv", "cannot cover strategy 'feduv'"),
        ("strategy.name=cwfedavg", "cwfedavg with WDR"),
        (
            "strategy.name=cwfedavg strategy.params.cwfedavg.wdr_lambda=0 strategy.params.cwfedavg.estimator=true",
            "estimator 'true'",
        ),
        ("strategy.name=cosmos data.public_fraction=0.2", "weighting 'label-free'"),
    ],
)
def test_strategies_that_release_data_outside_dp_sgd_refuse_it(overrides, words):
    from strategies import resolve

    with pytest.raises(ConfigError, match=words):
        resolve(load_config(None, f"data.source=digits privacy.mode=sample {overrides}"))
    resolve(load_config(None, f"data.source=digits {overrides}"))  # without privacy they run


@pytest.mark.parametrize(
    "overrides",
    [
        "strategy.name=fedavg",
        "strategy.name=fedprox",
        "strategy.name=ditto",
        "strategy.name=cwfedavg strategy.params.cwfedavg.wdr_lambda=0",
        "strategy.name=cosmos data.public_fraction=0.2 strategy.params.cosmos.weighting=none",
    ],
)
def test_the_other_strategies_accept_it(overrides):
    from strategies import resolve

    resolve(load_config(None, f"data.source=digits privacy.mode=sample {overrides}"))


# --------------------------------------------------------------------------- records


def test_the_round_row_records_epsilon_per_client_and_refusals():
    metrics = [
        {protocol.CLIENT_ID: 2, protocol.PRIVACY_EPSILON: 1.5},
        {protocol.CLIENT_ID: 0, protocol.PRIVACY_EPSILON: 0.5},
    ]
    refused = Rejection(3, "train", 7, 1, f"client error 0: PrivacyBudgetExhausted: {protocol.PRIVACY_REFUSED}: ...")
    other = Rejection(3, "train", 8, 3, "client error 0: RuntimeError: boom")
    assert privacy_columns(metrics, [refused, other]) == {
        "epsilon_max": 1.5,
        "privacy_refused": 1,
        "epsilon_client_0": 0.5,
        "epsilon_client_2": 1.5,
    }
    assert privacy_columns([{protocol.CLIENT_ID: 0}], [other]) == {}
    assert rejection_problems([{"round": 3, "replies_ok": 1, "replies_rejected": 3, "privacy_refused": 3}]) == []
    assert rejection_problems([{"round": 3, "replies_ok": 1, "replies_rejected": 3, "privacy_refused": 1}])


def test_the_printed_summary_shows_the_largest_epsilon_and_the_refusals(tmp_path):
    from fedapps_tools.summary import summary_lines

    s = {
        "strategy": "fedavg",
        "rounds": 3,
        "privacy": {
            "mode": "sample",
            "delta": 1e-5,
            "noise_multiplier": 1.1,
            "max_grad_norm": 1.0,
            "epsilon_budget": 8.0,
            "epsilon_max": 2.345678,
            "refused": 4,
        },
    }
    text = "\n".join(summary_lines(s, tmp_path))
    assert "sample-level DP, ε ≤ 2.35 at δ = 1e-05 (the largest over clients; σ 1.1, C 1, budget ε 8)" in text
    assert "4 training replies were refused past privacy.epsilon_budget" in text
    assert "privacy" not in "\n".join(summary_lines({"strategy": "fedavg", "rounds": 3}, tmp_path))


def test_a_run_records_the_accountants_epsilon_per_client_and_round_and_stops_at_the_budget(tmp_path, tiny_config):
    """In-process, 4 clients, 3 rounds, a budget between every client's ε of two and of three rounds: rounds.csv holds
    each client's ε as the accountant gives it for its own data; in round 3 every client refuses, nothing is
    aggregated, the refusals are recorded, and the run is not judged as lost to rejection."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    path = tiny_config(rounds=3, privacy={"mode": "sample", "noise_multiplier": 1.0, "reproducible_noise": True})
    cfg = load_config(path)
    fed = get_federation(dataclasses.asdict(cfg.data))
    history = {}
    for cid in range(4):
        n = len(fed.client(cid).train_y)
        history[cid] = (1.0, privacy.sample_rate(n, 16), privacy.planned_steps(n, ops.OptimSettings(batch_size=16)))
    two = max(privacy.epsilon([history[c]] * 2, 1e-5) for c in history)
    three = min(privacy.epsilon([history[c]] * 3, 1e-5) for c in history)
    assert two < three
    budget = (two + three) / 2
    summary = server_app.run_experiment(InProcessGrid(4), str(path), f"privacy.epsilon_budget={budget}", str(tmp_path))
    with open(tmp_path / cfg.resolved_run_name() / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    for r in (1, 2):
        row = rows[r - 1]
        for cid, step in history.items():
            assert float(row[f"epsilon_client_{cid}"]) == pytest.approx(privacy.epsilon([step] * r, 1e-5), rel=1e-9)
        assert int(row["privacy_refused"]) == 0 and int(row["clients"]) == 4
    last = rows[2]
    assert int(last["privacy_refused"]) == 4 and int(last["clients"]) == 0 and int(last["skipped"]) == 1
    assert summary["privacy"]["refused"] == 4
    assert summary["privacy"]["epsilon_max"] == pytest.approx(two, rel=1e-9) and two <= budget
    assert not any("rejection" in str(p) for p in summary.get("problems", []))
    reasons = (tmp_path / cfg.resolved_run_name() / "rejections.csv").read_text()
    assert reasons.count(protocol.PRIVACY_REFUSED) == 4
    assert math.isfinite(summary["accuracy_mean"])


def test_every_strategy_runs_under_it_or_refuses_it_with_its_reason():
    """Every registered strategy either accepts privacy.mode sample with its shipped config, or refuses it naming
    itself and why (no strategy is silently left uncovered)."""
    from fedapps.config import APP_DIR
    from strategies import STRATEGIES, resolve

    refused = []
    for name in STRATEGIES:
        cfg = load_config(
            APP_DIR / "configs" / f"{name}.yaml", "model.name=mlp model.per_client=[] privacy.mode=sample"
        )
        try:
            resolve(cfg)
        except ConfigError as exc:
            assert "'privacy.mode: sample' cannot cover" in str(exc) and name in str(exc)
            refused.append(name)
    assert {"ifca", "fedfomo", "fednh", "feduv", "cwfedavg", "cosmos"} <= set(refused)
    assert "fedavg" not in refused and "fedmd" not in refused


def last_epsilon(run_dir) -> dict[int, list[float]]:
    """rounds.csv's ε per client, round by round."""
    with open(run_dir / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    out: dict[int, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("epsilon_client_") and value:
                out.setdefault(int(key.rsplit("_", 1)[1]), []).append(float(value))
    return out


@pytest.mark.heavy
@pytest.mark.parametrize(
    "overrides",
    [
        "strategy.name=ditto",  # two private loops per message, the proximal term after the noise
        "strategy.name=fedbabu",  # a frozen head, and fine-tuning before each evaluation
        "strategy.name=pfedck",  # a pair of models in one loop
        "strategy.name=fedmd data.public_fraction=0.2",  # public pre-training on U, not counted
        (
            "strategy.name=cosmos data.public_fraction=0.2 strategy.params.cosmos.weighting=none "
            "strategy.params.cosmos.server_model=mlp strategy.params.cosmos.server_epochs=1"
        ),
    ],
)
def test_strategies_run_in_process_with_a_growing_epsilon(tmp_path, overrides):
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    path = tmp_path / "c.yaml"
    path.write_text("{}\n")
    ov = f"data.source=digits data.num_clients=3 rounds=2 model.name=mlp privacy.mode=sample {overrides}"
    summary = server_app.run_experiment(InProcessGrid(3), str(path), ov, str(tmp_path))
    eps = last_epsilon(tmp_path / load_config(None, ov).resolved_run_name())
    assert sorted(eps) == [0, 1, 2]
    for values in eps.values():
        assert len(values) == 2 and 0 < values[0] < values[1] < 100
    assert summary["privacy"]["epsilon_max"] == pytest.approx(max(v[-1] for v in eps.values()))


@pytest.mark.heavy
def test_the_ledger_persists_between_messages_through_flowers_wire_format(tmp_path):
    """With each node's Context encoded as Flower keeps it between messages and decoded again for the next one
    (:func:`conftest.wire_run`), round 2's ε of each client is that of two rounds of its own steps: the ledger
    outlived the message in the node's records, as it must under `flwr run`."""
    from conftest import wire_run

    run = wire_run(tmp_path, privacy={"mode": "sample", "noise_multiplier": 1.0})
    cfg = load_config(run / "config.yaml")
    fed = get_federation(dataclasses.asdict(cfg.data))
    for cid, values in last_epsilon(run).items():
        n = len(fed.client(cid).train_y)
        step = (1.0, privacy.sample_rate(n, 16), privacy.planned_steps(n, ops.OptimSettings(batch_size=16)))
        assert values == pytest.approx([privacy.epsilon([step] * r, 1e-5) for r in (1, 2)], rel=1e-9)
    assert json.loads((run / "summary.json").read_text())["privacy"]["epsilon_max"] > 0


# --------------------------------------------------------------------------- the two ways to per-sample gradients


@pytest.mark.parametrize("arch, shape", [("cnn", (1, 28, 28)), ("mlp", (1, 8, 8)), ("cnn", (3, 32, 32))])
def test_torch_func_per_sample_gradients_are_the_hooks_ones(arch, shape):
    """Each sample's gradient from its own loss (torch.func) equals what Opacus's hooks split out of the minibatch's
    mean loss, for the zoo's DP-compatible models; so does the minibatch loss."""
    from opacus.grad_sample import GradSampleHooks

    from fedapps.models.zoo import build_model

    torch.manual_seed(0)
    model = build_model(arch, 10, shape, seed=0)
    model.train()
    x, y = torch.randn(7, *shape), torch.randint(0, 10, (7,))
    with privacy.out_of_place(model):
        fast = privacy.per_sample_gradients(model, per_sample_cross_entropy)(x, y)
        by_func = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad_sample = None
        hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=True)
        try:
            slow = privacy.hooked_gradients(model, cross_entropy)(x, y)
            by_hooks = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
        finally:
            hooks.cleanup()
    assert float(fast) == pytest.approx(float(slow), rel=1e-6)
    for name, p in model.named_parameters():
        assert by_func[name].shape == (7, *p.shape), name
        torch.testing.assert_close(by_func[name], by_hooks[name], rtol=1e-4, atol=1e-6, msg=name)
    # the batch's mean gradient is the mean of the per-sample ones (a wrong scale or a missing sample shows here)
    mean = torch.autograd.grad(cross_entropy(model, x, y, None), list(model.parameters()))
    for (name, _), g in zip(model.named_parameters(), mean, strict=True):
        torch.testing.assert_close(by_func[name].mean(0), g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_private_loop_trains_the_same_model_on_either_path():
    """Three epochs of DP-SGD with the same reproducible noise and minibatches: the marked loss (torch.func) and the
    unmarked one (hooks) end at the same parameters, so the faster path changes nothing but the time."""
    from fedapps.models.zoo import build_model

    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    ends = []
    for loss in (cross_entropy, per_sample_cross_entropy):
        model = build_model("mlp", 10, (1, 8, 8), seed=3)
        training = privacy.PrivateTraining(settings(noise_multiplier=1.0, max_grad_norm=0.5), [], 0, "mlp")
        optim = ops.OptimSettings(epochs=3, batch_size=8, lr=0.1, drop_last=False)
        with ops.privately(training):
            ops.run_epochs(model, x, y, loss, optim, generator=torch.Generator().manual_seed(5))
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in build_model("mlp", 10, (1, 8, 8), seed=3).parameters()])
    assert float((ends[0] - start).abs().max()) > 1e-3  # it trained
    torch.testing.assert_close(ends[0], ends[1], rtol=1e-4, atol=1e-5)


def test_supervised_training_takes_the_torch_func_path(monkeypatch):
    """ops.train's cross-entropy is marked per-sample: under DP-SGD it goes through per_sample_gradients."""
    calls = []
    real = privacy.per_sample_gradients
    monkeypatch.setattr(privacy, "per_sample_gradients", lambda m, f: calls.append(f) or real(m, f))
    training = privacy.PrivateTraining(settings(), [], 0, "tiny")
    with ops.privately(training):
        ops.train(nn.Linear(4, 3), torch.randn(12, 4), torch.randint(0, 3, (12,)), ops.OptimSettings(batch_size=4))
    assert len(calls) == 1 and ops.is_per_sample(calls[0])
    assert training.history and training.history[0][2] > 0
