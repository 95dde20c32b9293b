"""Client-level DP of the pseudo-label exchange (privacy.mode: client), through the strategies: the clip bounds what
one client moves each release by, the noise's scale is σ times the sensitivity, the ε recorded per round is the
accountant's, the budget ends a run cleanly, every other strategy refuses the mode, and each of the four runs."""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import yaml

dp_accounting = pytest.importorskip("dp_accounting", reason="the accountant comes with the extra privacy")
# the project imports below come after the skip on purpose: without the extra this module is skipped, not broken
# ruff: noqa: E402

from conftest import run_in_process, wire_run
from fedapps.config import ConfigError, ExperimentConfig, config_hash, load_config, without_later_defaults
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server import client_privacy as cp
from fedapps.server.strategy import message_privacy
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply, MessageError
from strategies import STRATEGIES, ignored_settings, resolve
from strategies.fedct import vote_counts

torch.set_num_threads(1)

DELTA = 1e-5
SMALL = (
    "data.source=digits data.partition=cosmos-groups data.alpha=5 data.groups=2 data.num_clients=5 "
    "data.public_fraction=0.2 rounds=2 model.name=mlp client.epochs=1 privacy.mode=client "
    "privacy.reproducible_noise=true"
)
COSMOS_SMALL = (
    "strategy.name=cosmos strategy.params.cosmos.server_model=mlp strategy.params.cosmos.server_epochs=0 "
    "strategy.params.cosmos.b0_mode=fixed strategy.params.cosmos.b0=0.5"
)
NODES = [100, 101, 102, 103, 104]


@pytest.fixture(autouse=True)
def _flower_identity() -> None:
    """Message() needs a task identity outside Flower's runtime; the in-process grid sets one."""
    InProcessGrid(1)


def build(overrides: str, sigma: float | None = None):
    """The strategy of ``SMALL`` + ``overrides``; ``sigma`` replaces σ after validation (0: the clipped sum exactly)."""
    cfg = load_config(None, f"{SMALL} {overrides}")
    if sigma is not None:
        cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, noise_multiplier=sigma))
    resolved = resolve(cfg)
    return resolved.cls(cfg, resolved.params)


def reply(cid: int, preds: np.ndarray) -> ClientReply:
    return ClientReply(
        node_id=100 + cid, client_id=cid, num_examples=10, metrics={}, predictions={protocol.PREDICTION_ARRAY: preds}
    )


def honest(n: int, m: int, clients: int = 4, seed: int = 0) -> list[np.ndarray]:
    """Two groups of clients with similar probability rows on U (float32)."""
    rng = np.random.default_rng(seed)
    centres = [rng.dirichlet(np.ones(m) * 0.3, size=n) for _ in range(2)]
    out = []
    for i in range(clients):
        noisy = np.clip(centres[i % 2] + rng.normal(scale=0.01, size=(n, m)), 1e-6, None)
        out.append((noisy / noisy.sum(axis=1, keepdims=True)).astype(np.float32))
    return out


@pytest.fixture
def releases(monkeypatch):
    """Every noisy sum the strategies release (the mechanism's output, before the division by a public count and the
    post-processing), in order."""
    seen: list[np.ndarray] = []
    real = cp.noisy_sum

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(cp, "noisy_sum", recording)
    return seen


def one_hot_flip(n: int, m: int) -> np.ndarray:
    """The largest a probability matrix can be (one-hot rows: norm sqrt(n)), on classes nobody else predicts much."""
    return np.eye(m, dtype=np.float32)[(np.arange(n) * 7 + 3) % m]


# --------------------------------------------------------------------------- the clip bounds one client


@pytest.mark.parametrize("clip", [0.0, 2.0])
def test_an_adversarial_client_moves_fedmds_release_by_at_most_c(releases, clip):
    """σ = 0: the released sum with and without a client whose scores are huge differs by at most C in L2, and the
    clip binds (by exactly C). C = 0 means sqrt(rows); FedMD's probabilities consensus takes each client's softmax."""
    over = f"strategy.name=fedmd strategy.params.fedmd.consensus=probs privacy.clip_norm={clip}"
    runs = []
    for adversary in (False, True):
        s = build(over, sigma=0.0)
        s.round_messages(1, NODES)  # the cohort: the same public count either way
        n, m = s.public_size, s.num_classes
        logits = [np.log(p) for p in honest(n, m)]
        if adversary:
            logits.append(np.full((n, m), -1e4, np.float32) + 2e4 * one_hot_flip(n, m))  # one-hot after softmax
        s.aggregate(1, [reply(i, x) for i, x in enumerate(logits)])
        runs.append(releases[-1])
    bound = clip or math.sqrt(s.public_size)
    moved = np.linalg.norm(runs[1] - runs[0])
    assert moved <= bound * (1 + 1e-9) and moved == pytest.approx(bound, rel=1e-6)


def test_an_adversarial_client_moves_fedmds_logit_consensus_by_at_most_c(releases):
    """FedMD on raw logits (its original consensus) needs an explicit C: logits of ±1e4 move the sum by C, no more."""
    over = "strategy.name=fedmd privacy.clip_norm=5"
    runs = []
    for adversary in (False, True):
        s = build(over, sigma=0.0)
        s.round_messages(1, NODES)
        n, m = s.public_size, s.num_classes
        logits = [np.random.default_rng(i).normal(size=(n, m)).astype(np.float32) for i in range(4)]
        if adversary:
            logits.append(np.where(one_hot_flip(n, m) > 0, 1e4, -1e4).astype(np.float32))
        s.aggregate(1, [reply(i, x) for i, x in enumerate(logits)])
        runs.append(releases[-1])
    assert np.linalg.norm(runs[1] - runs[0]) == pytest.approx(5.0, rel=1e-6)


def test_a_huge_client_moves_comets_cluster_release_by_at_most_c(releases):
    """COMET with one cluster (the K-means assignment, which reads the raw predictions, is not covered: K = 1 keeps it
    fixed): a client whose predictions are 1e6 everywhere moves the cluster's released sum by exactly C."""
    runs = []
    for adversary in (False, True):
        s = build("strategy.name=comet strategy.params.comet.clusters=1 privacy.clip_norm=3", sigma=0.0)
        preds = honest(s.public_size, s.num_classes)
        if adversary:
            preds.append(np.full_like(preds[0], 1e6))
        s.aggregate(1, [reply(i, p) for i, p in enumerate(preds)])
        runs.append(releases[-1])
    assert np.linalg.norm(runs[1] - runs[0]) == pytest.approx(3.0, rel=1e-6)


def test_an_adversarial_member_moves_cosmos_cluster_targets_by_at_most_c(releases):
    """COSMOS: clusters are formed in round 1 (from the raw predictions: not covered) and stay; in round 2 a member
    sends predictions of 1e6 everywhere, or nothing: the round's released sums differ by at most C; the clip binds."""
    runs = []
    for adversary in (False, True):
        s = build(f"{COSMOS_SMALL} privacy.clip_norm=2", sigma=0.0)
        n, m = s.n_public, s.num_classes
        preds = honest(n, m, clients=5)
        s.round_messages(1, NODES)
        s.aggregate(1, [reply(i, p) for i, p in enumerate(preds)])
        assert s.clustering is not None and s.clustering.k >= 1
        del releases[:]
        s.round_messages(2, NODES)  # the same cohort either way: the adversary was sampled, then turned or vanished
        now = [reply(i, p) for i, p in enumerate(preds[:4])] + ([reply(4, np.full((n, m), 1e6))] if adversary else [])
        s.aggregate(2, now)
        runs.append(list(releases))
    assert len(runs[0]) == len(runs[1]) == s.clustering.k  # every cluster with a sampled member is released
    moved = math.sqrt(sum(np.linalg.norm(a - b) ** 2 for a, b in zip(runs[0], runs[1])))
    assert moved <= 2.0 * (1 + 1e-9) and moved == pytest.approx(2.0, rel=1e-6)


def test_cosmos_releases_the_clipped_mean_it_distils_on(monkeypatch):
    """σ = 0, C large: COSMOS's cluster target is its members' plain mean (what it distils h_k on) made probability rows
    and tempered; the mode changes nothing else in the round."""
    targets = []
    import strategies.cosmos as cosmos_module

    real = cosmos_module.ops.distill

    def spy(model, x, y, *args, **kwargs):
        targets.append(np.asarray(y))
        return real(model, x, y, *args, **kwargs)

    monkeypatch.setattr(cosmos_module.ops, "distill", spy)
    s = build(f"{COSMOS_SMALL} privacy.clip_norm=1000000", sigma=0.0)
    preds = honest(s.n_public, s.num_classes, clients=5)
    s.round_messages(1, NODES)
    s.aggregate(1, [reply(i, p) for i, p in enumerate(preds)])
    assert s.clustering is not None
    for k, members in enumerate(s.clustering.clusters):
        expected = np.mean([preds[c] for c in members], axis=0)
        np.testing.assert_allclose(targets[k], expected / expected.sum(axis=1, keepdims=True), atol=1e-5)


# --------------------------------------------------------------------------- the noise's scale


def noise_of(strategy_overrides: str, sigma: float, releases: list, rounds_of) -> np.ndarray:
    """The noise of one release: the release with σ minus the same release with σ = 0."""
    out = []
    for s in (sigma, 0.0):
        rounds_of(build(strategy_overrides, sigma=s))
        out.append(releases[-1])
    return out[0] - out[1]


@pytest.mark.parametrize("clip", [0.0, 2.0])
def test_fedmds_noise_has_standard_deviation_sigma_times_c(releases, clip):
    """σ = 1.5: the noise's std on |U|×M entries is σ·C (C = 2, or sqrt(rows) for 0), ±5 %: it tells σ·C from σ, C,
    σ²·C and σ·C² apart."""

    def one_round(s):
        s.round_messages(1, NODES)
        s.aggregate(1, [reply(i, p) for i, p in enumerate(honest(s.public_size, s.num_classes))])

    noise = noise_of(
        f"strategy.name=fedmd strategy.params.fedmd.scores=probs strategy.params.fedmd.digest_loss=kl "
        f"privacy.clip_norm={clip}",
        1.5,
        releases,
        one_round,
    )
    c = clip or math.sqrt(noise.shape[0])
    assert abs(noise.mean()) < 0.1 * c
    assert noise.std() == pytest.approx(1.5 * c, rel=0.05)
    for wrong in (1.5, c, 1.5**2 * c, 1.5 * c**2):
        if not math.isclose(wrong, 1.5 * c, rel_tol=0.2):
            assert noise.std() != pytest.approx(wrong, rel=0.1)


def test_fedcts_vote_noise_has_standard_deviation_sigma_times_sqrt_rows():
    """GNMax: the counts FedCT takes its vote from are the true counts plus noise of std σ·sqrt(|U|), ±5 %."""
    s = build("strategy.name=fedct", sigma=0.7)
    n, m = s.public_size, s.num_classes
    votes = np.random.default_rng(0).integers(0, m, size=(5, n))
    noise = s.noisy_counts(1, votes) - vote_counts(votes, m)
    assert noise.std() == pytest.approx(0.7 * math.sqrt(n), rel=0.05)
    exact = build("strategy.name=fedct", sigma=0.0)
    np.testing.assert_array_equal(exact.noisy_counts(1, votes), vote_counts(votes, m))
    # one client more, whatever it votes, moves the counts by sqrt(|U|) in L2: the sensitivity the noise is scaled to
    adversary = np.vstack([votes, np.zeros((1, n), dtype=votes.dtype)])
    moved = exact.noisy_counts(1, adversary) - exact.noisy_counts(1, votes)
    assert np.linalg.norm(moved) == pytest.approx(math.sqrt(n))


def test_fedcts_vote_follows_a_clear_majority_under_small_noise_and_records_the_release():
    s = build("strategy.name=fedct", sigma=0.01)
    n, m = s.public_size, s.num_classes
    truth = np.arange(n) % m
    votes = [truth, truth, truth, (truth + 1) % m, (truth + 2) % m]
    extra = s.aggregate(1, [reply(i, v.astype(np.uint8)) for i, v in enumerate(votes)])
    assert np.array_equal(s.consensus, truth)
    eps = cp.gaussian_epsilon(0.01, 1, DELTA)
    assert extra["epsilon_max"] == pytest.approx(eps) and extra["epsilon_client_4"] == pytest.approx(eps)


def test_the_noise_comes_from_the_os_unless_it_is_made_reproducible():
    def noise(overrides):
        s = build(f"strategy.name=fedct {overrides}")
        votes = np.zeros((5, s.public_size), dtype=np.int64)
        return s.noisy_counts(3, votes)

    assert np.array_equal(noise(""), noise(""))  # SMALL sets privacy.reproducible_noise
    free = "privacy.reproducible_noise=false"
    assert not np.array_equal(noise(free), noise(free))


# --------------------------------------------------------------------------- the accountant and the budget


def reference_epsilon(sigma: float, releases: int, delta: float) -> float:
    """dp-accounting's RDP accountant on its default orders, composed release by release (no shortcut)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    for _ in range(releases):
        accountant.compose(dp_accounting.GaussianDpEvent(sigma))
    return accountant.get_epsilon(delta)


def test_the_ledger_counts_each_clients_releases_and_stops_before_the_budget():
    dp = cp.ClientLevelDP(2.0, 0.0, DELTA, epsilon_budget=0.0, reproducible_noise=True, seed=0)
    dp.record([0, 1, 2])
    cols = dp.record([0, 2])
    assert dp.releases == {0: 2, 1: 1, 2: 2}
    assert cols["epsilon_client_0"] == pytest.approx(reference_epsilon(2.0, 2, DELTA), rel=1e-9)
    assert "epsilon_client_1" not in cols and cols["epsilon_max"] == cols["epsilon_client_2"]
    assert dp.stop_reason(2) == ""  # no budget
    budget = (cp.gaussian_epsilon(2.0, 2, DELTA) + cp.gaussian_epsilon(2.0, 3, DELTA)) / 2
    dp.epsilon_budget = budget
    assert "privacy budget reached: after round 2" in dp.stop_reason(2) and "past privacy.epsilon_budget" in (
        dp.stop_reason(2)
    )
    dp.releases = {0: 1, 1: 1}
    assert dp.stop_reason(2) == ""


def rounds_csv(run_dir) -> list[dict[str, str]]:
    with open(run_dir / "rounds.csv") as fh:
        return list(csv.DictReader(fh))


def test_a_run_records_the_accountants_epsilon_and_ends_cleanly_at_the_budget(tmp_path, tiny_config):
    """In-process FedCT, 4 clients, every one in every round, a budget between the ε of two and of three releases and
    4 rounds configured: rounds 1 and 2 record each client's ε as dp-accounting gives it for r releases, the run ends
    after round 2 (recorded, with the reason), the deployed models of round 2 are measured, and no client passes the
    budget."""
    sigma = 3.0
    two, three = (cp.gaussian_epsilon(sigma, r, DELTA) for r in (2, 3))
    budget = (two + three) / 2
    path = tiny_config(
        rounds=4,
        strategy={"name": "fedct", "params": {"fedct": {"distill_epochs": 1}}},
        data={"source": "digits", "partition": "iid", "num_clients": 4, "public_fraction": 0.2},
        privacy={"mode": "client", "noise_multiplier": sigma, "epsilon_budget": budget},
    )
    summary, run = run_in_process(path, tmp_path / "out", InProcessGrid(4))
    rows = rounds_csv(run)
    assert [int(r["round"]) for r in rows] == [1, 2]
    for r, row in enumerate(rows, start=1):
        for cid in range(4):
            assert float(row[f"epsilon_client_{cid}"]) == pytest.approx(reference_epsilon(sigma, r, DELTA), rel=1e-9)
        assert float(row["epsilon_max"]) == pytest.approx(cp.gaussian_epsilon(sigma, r, DELTA), rel=1e-12)
    assert summary["stopped_early"]["round"] == 2 and summary["stopped_early"]["of"] == 4
    assert protocol.PRIVACY_EPSILON_BUDGET in summary["stopped_early"]["reason"]
    p = summary["privacy"]
    assert p["mode"] == "client" and p["epsilon_max"] == pytest.approx(two) and two <= budget
    assert set(p["epsilon_per_client"]) == {"0", "1", "2", "3"} and p["sampling_amplification"] is False
    assert summary["final_round"] == 2 and math.isfinite(summary["accuracy_mean"])
    assert summary["problems"] == []
    assert json.loads((run / "summary.json").read_text())["stopped_early"]["round"] == 2


def test_with_partial_cohorts_each_client_pays_for_the_rounds_it_took_part_in(tmp_path, tiny_config):
    """strategy.fraction 0.5 (fixed-size cohorts drawn without replacement: no amplification): each client's ε in
    rounds.csv is that of the releases its own predictions entered so far, and a client left out of a round has no
    column that round; the summary's ε per client is its latest."""
    sigma = 2.0
    path = tiny_config(
        rounds=4,
        strategy={"name": "fedct", "fraction": 0.5, "min_clients": 2, "params": {"fedct": {"distill_epochs": 1}}},
        data={"source": "digits", "partition": "iid", "num_clients": 4, "public_fraction": 0.2},
        privacy={"mode": "client", "noise_multiplier": sigma},
    )
    summary, run = run_in_process(path, tmp_path / "out", InProcessGrid(4))
    taken: dict[int, int] = {}
    for row in rounds_csv(run):
        present = [c for c in range(4) if row.get(f"epsilon_client_{c}")]
        assert len(present) == int(row["clients"]) == 2
        for c in present:
            taken[c] = taken.get(c, 0) + 1
            assert float(row[f"epsilon_client_{c}"]) == pytest.approx(reference_epsilon(sigma, taken[c], DELTA))
        assert float(row["epsilon_max"]) == pytest.approx(cp.gaussian_epsilon(sigma, max(taken.values()), DELTA))
    assert min(taken.values()) < 4  # someone was left out of a round: the test compares counts, not rounds
    for c, n in taken.items():
        assert summary["privacy"]["epsilon_per_client"][str(c)] == pytest.approx(cp.gaussian_epsilon(sigma, n, DELTA))


def test_a_budget_below_one_release_is_refused():
    with pytest.raises(ConfigError, match="does not allow a single round"):
        resolve(load_config(None, f"{SMALL} strategy.name=fedct privacy.epsilon_budget=0.01"))


# --------------------------------------------------------------------------- config and messages


@pytest.mark.parametrize("name", sorted(n for n, c in STRATEGIES.items() if c.client_privacy_refused))
def test_the_other_strategies_refuse_the_mode_naming_the_key_and_why(name):
    with pytest.raises(ConfigError, match=rf"'privacy.mode: client' cannot cover strategy '{name}': \w+"):
        resolve(load_config(None, f"data.source=digits privacy.mode=client strategy.name={name}"))


def test_every_strategy_runs_under_it_or_refuses_it_with_its_reason():
    from fedapps.config import APP_DIR
    from strategies import STRATEGIES

    accepted = []
    for name in STRATEGIES:
        cfg = load_config(
            APP_DIR / "configs" / f"{name}.yaml",
            "model.name=mlp model.per_client=[] privacy.mode=client"
            + (" privacy.clip_norm=10" if name == "fedmd" else ""),  # FedMD's logits need a C
        )
        try:
            resolve(cfg)
            accepted.append(name)
        except ConfigError as exc:
            assert "'privacy.mode: client' cannot cover" in str(exc) and name in str(exc)
    assert sorted(accepted) == ["comet", "cosmos", "fedct", "fedmd"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        ("strategy.name=fedmd", "privacy.clip_norm"),  # raw logits have no natural bound
        ("strategy.name=fedmd strategy.params.fedmd.consensus=median", "consensus: median"),
        (f"{COSMOS_SMALL} strategy.params.cosmos.aggregation=median", "aggregation: median"),
        (f"{COSMOS_SMALL} strategy.params.cosmos.member_clip=0.5", "member_clip"),
        ("strategy.name=comet strategy.params.comet.outlier_factor=3", "outlier_factor"),
        ("strategy.name=fedct privacy.clip_norm=2", "does not apply to fedct"),
    ],
)
def test_options_outside_the_guarantee_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        resolve(load_config(None, f"{SMALL} {overrides}"))
    resolve(load_config(None, f"{SMALL.replace('privacy.mode=client', '')} {overrides}"))  # fine without the mode


def test_messages_carry_no_privacy_settings_and_a_client_refuses_the_server_mode():
    """The server adds the noise: its messages are those of privacy off; a message claiming mode client is refused."""
    s = build("strategy.name=fedct")
    request = s.round_messages(1, NODES)[0].request
    assert request.privacy is None and not [k for k in request.encode() if k.startswith("privacy.")]
    assert message_privacy(s.cfg.privacy) is None
    sample = message_privacy(dataclasses.replace(ExperimentConfig().privacy, mode="sample"))
    assert sample is not None
    forged = dict(protocol.Request(ops=(), round=1, privacy=sample).encode(), **{protocol.PRIVACY_MODE: "client"})
    with pytest.raises(MessageError, match="must be one of sample"):
        protocol.Privacy.decode(forged)


def test_each_modes_own_c_is_reported_as_ignored_under_the_other():
    client = dict(ignored_settings(load_config(None, "privacy.mode=client privacy.max_grad_norm=2")))
    assert client[protocol.PRIVACY_MAX_GRAD_NORM] == "privacy.mode 'client' does not use it"
    sample = dict(ignored_settings(load_config(None, "privacy.mode=sample privacy.clip_norm=2")))
    assert sample["privacy.clip_norm"] == "privacy.mode 'sample' does not use it"
    assert "privacy.clip_norm" not in dict(
        ignored_settings(load_config(None, "privacy.mode=client privacy.clip_norm=2"))
    )


def test_the_new_key_keeps_the_hashes_of_runs_recorded_before_it():
    off, sample = load_config(None, ""), load_config(None, "privacy.mode=sample")
    assert "privacy" not in without_later_defaults(off.to_dict())
    assert "clip_norm" not in without_later_defaults(sample.to_dict())["privacy"]
    clipped = load_config(None, "privacy.mode=client privacy.clip_norm=3")
    assert without_later_defaults(clipped.to_dict())["privacy"]["clip_norm"] == 3
    assert config_hash(clipped) != config_hash(load_config(None, "privacy.mode=client"))


def test_a_checkpoint_written_before_the_new_key_resumes_under_todays_config():
    """A run checkpointed before privacy.clip_norm existed dumped a privacy section without it; today's config of the
    same computation must compare equal to it (else `--resume` and `fedapps compare` refuse or restart the run)."""
    from fedapps.checkpoint import config_differences
    from fedapps.config import dump_yaml

    for overrides in ("", "privacy.mode=sample"):
        today = load_config(None, overrides).to_dict()
        before = {**today, "privacy": {k: v for k, v in today["privacy"].items() if k != "clip_norm"}}
        assert config_differences(yaml.safe_dump(before), dump_yaml(load_config(None, overrides))) == []
    changed = load_config(None, "privacy.clip_norm=2").to_dict()  # a key held at another value still counts
    assert config_differences(yaml.safe_dump(changed), dump_yaml(load_config(None, ""))) != []


def test_the_printed_summary_shows_the_client_level_epsilon_and_the_early_end(tmp_path):
    from fedapps_tools.summary import summary_lines

    s = {
        "strategy": "cosmos",
        "rounds": 3,
        "privacy": {
            "mode": "client",
            "delta": 1e-5,
            "noise_multiplier": 2.0,
            "clip_norm": None,
            "epsilon_budget": 5.0,
            "epsilon_max": 4.2,
        },
        "stopped_early": {"round": 3, "of": 10, "reason": "privacy budget reached: ..."},
    }
    text = "\n".join(summary_lines(s, tmp_path))
    assert "client-level DP (the server's noise on the pseudo-label aggregates), ε ≤ 4.2 at δ = 1e-05" in text
    assert "σ 2, C sqrt(rows), budget ε 5" in text
    assert "the run ended after round 3 of 10: privacy budget reached" in text


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(
    "overrides",
    [
        f"{COSMOS_SMALL} strategy.params.cosmos.pretrain_epochs=1 strategy.params.cosmos.distill_epochs=1",
        "strategy.name=fedmd strategy.params.fedmd.distill_epochs=1 privacy.clip_norm=10",
        "strategy.name=fedct strategy.params.fedct.distill_epochs=1",
        "strategy.name=comet strategy.params.comet.distill_epochs=1 strategy.params.comet.clusters=2",
    ],
)
def test_each_strategy_runs_in_process_under_the_mode(tmp_path, overrides):
    path = tmp_path / "c.yaml"
    path.write_text("{}\n")
    summary, run = run_in_process(path, tmp_path / "out", InProcessGrid(5), f"{SMALL} {overrides}")
    rows = rounds_csv(run)
    assert len(rows) == 2 and all(int(r["clients"]) == 5 for r in rows)
    for r, row in enumerate(rows, start=1):
        eps = [float(row[f"epsilon_client_{c}"]) for c in range(5)]
        assert eps == pytest.approx([cp.gaussian_epsilon(1.0, r, DELTA)] * 5, rel=1e-12)
    assert summary["privacy"]["epsilon_max"] == pytest.approx(cp.gaussian_epsilon(1.0, 2, DELTA))
    assert math.isfinite(summary["accuracy_mean"]) and summary["problems"] == []


@pytest.mark.heavy
def test_cosmos_under_the_mode_through_flowers_wire_format(tmp_path):
    """COSMOS in client mode with every message, reply and node Context through Flower's protobuf encoding
    (:func:`conftest.wire_run`): ε per round is the accountant's, the clusters formed, and the clients never saw the
    mode (no reply reported an ε of its own, which a client does exactly when its message carries privacy settings)."""
    run = wire_run(
        tmp_path,
        rounds=2,
        strategy={
            "name": "cosmos",
            "params": {
                "cosmos": {"server_model": "mlp", "server_epochs": 1, "pretrain_epochs": 1, "distill_epochs": 1}
            },
        },
        data={"source": "digits", "partition": "iid", "num_clients": 4, "public_fraction": 0.2},
        privacy={"mode": "client", "noise_multiplier": 2.0},
    )
    rows = rounds_csv(run)
    assert len(rows) == 2 and "privacy_refused" not in rows[0]  # the column of the clients' own reports
    for r, row in enumerate(rows, start=1):
        assert float(row["epsilon_max"]) == pytest.approx(reference_epsilon(2.0, r, DELTA), rel=1e-9)
        assert sorted(k for k in row if k.startswith("epsilon_client_") and row[k]) == [
            f"epsilon_client_{c}" for c in range(4)
        ]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["privacy"]["mode"] == "client" and summary["clusters"] >= 1
    assert isinstance(summary["accuracy_mean"], float)
