"""One hostile client against the strategies whose server combines clients into OTHER clients' models: every capture
case of fedapps_tools/capture.py (each attack against each strategy it applies to; in-process, digits, MLP, 5
clients, seed 0), run three ways — the option off (default), the strategy's robust option on, the attacker dropped
(the reference).

For each case the test asserts what the default run shows (the capture: the victim's accuracy falls, honest replies
are rejected, the consensus or the clusters are taken over — or, where the strategy already resists, that it does)
and that with the robust option on the victim's and the mean honest accuracy stay within
:data:`fedapps_tools.capture.BOUND` of the reference's, every honest client measured. The cases whose robust setting is
known NOT to bound the damage (``Case.limits``) are documented by the capture table, not asserted here. The maths of
each option: tests/test_robust_personalisation.py.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest

from fedapps_tools import capture
from fedapps_tools.capture import ATTACKER, BOUND, VICTIM, Case, Outcome

CASES = [c for c in capture.CASES if not c.limits]


@cache
def arm(name: str, which: str) -> Outcome:
    return capture.run_arm(capture.case(name), which, seed=0)


def honest_partition(assignment: dict) -> set[frozenset[int]]:
    """The honest clients grouped by cluster (cluster ids aside)."""
    groups: dict = {}
    for client, k in assignment.items():
        if int(client) != ATTACKER:
            groups.setdefault(k, set()).add(int(client))
    return {frozenset(g) for g in groups.values()}


def victim_drop(c: Case, got: Outcome, ref: Outcome) -> float:
    v = capture.victim_of(c, got, ref)
    return ref.accuracy[v] - got.accuracy.get(v, 0.0)


def accuracy_falls(c: Case, got: Outcome, ref: Outcome) -> None:
    assert victim_drop(c, got, ref) >= 0.3, (got.accuracy, ref.accuracy)


def honest_replies_rejected(c: Case, got: Outcome, ref: Outcome) -> None:
    """The scaled model makes the honest clients' next models non-finite: their replies are rejected (the run then
    fails its exit status) and their accuracy is gone."""
    assert got.rejected > 0 and ref.rejected == 0
    assert victim_drop(c, got, ref) >= 0.5


def consensus_class_zero(c: Case, got: Outcome, ref: Outcome) -> None:
    """FedMD: the consensus' argmax is the attacker's class on every row of U."""
    assert (got.strategy.consensus.argmax(axis=1) == 0).all()
    assert not (ref.strategy.consensus.argmax(axis=1) == 0).all()


def votes_taken(c: Case, got: Outcome, ref: Outcome) -> None:
    """FedCT: the attacker's vote wins the tied rows; the vote's accuracy on U falls."""
    assert got.diagnostic < ref.diagnostic - 0.05, (got.diagnostic, ref.diagnostic)


def centroid_taken(c: Case, got: Outcome, ref: Outcome) -> None:
    """COMET, K fixed: the outlier takes a cluster of its own and the honest clients are grouped otherwise."""
    assignment = got.strategy.assignment
    assert [k for cl, k in assignment.items() if cl != ATTACKER].count(assignment[ATTACKER]) == 0
    assert honest_partition(assignment) != honest_partition(ref.strategy.assignment)


def resisted(c: Case, got: Outcome, ref: Outcome) -> None:
    """The strategy resists on its own (COMET re-clusters every round: the flipping client is set apart)."""
    assert victim_drop(c, got, ref) <= BOUND


CAPTURED: dict[str, Callable[[Case, Outcome, Outcome], None]] = {
    "cwfedavg/one-hot-rows": accuracy_falls,
    "cwfedavg/scale": honest_replies_rejected,
    "cosmos/copy-then-vote": accuracy_falls,
    "cosmos/copy-then-flip": accuracy_falls,
    "ifca/scale": honest_replies_rejected,
    "pfedhn/scale": honest_replies_rejected,
    "fedavg/scale": honest_replies_rejected,
    "fedct/votes-for-0": votes_taken,
    "fedmd/logits-1e4": consensus_class_zero,
    "fedmd/logits-1e4/median": consensus_class_zero,
    "comet/outlier": centroid_taken,
    "comet/copy-then-flip": resisted,
}


def test_every_case_says_what_its_attack_does():
    assert sorted(CAPTURED) == sorted(c.name for c in CASES)


def by_case(name: str):
    """The xdist group of a case's tests: under `make test` (--dist loadgroup) one worker runs them and computes each
    of the case's arms once (``arm`` is cached per process)."""
    return pytest.mark.xdist_group("hostile-" + name.replace("/", "-"))


CASE_PARAMS = [pytest.param(c.name, marks=by_case(c.name)) for c in CASES]


@pytest.mark.parametrize("name", CASE_PARAMS)
@pytest.mark.heavy
def test_without_the_robust_option_the_attack_does_what_the_issue_measured(name):
    c = capture.case(name)
    CAPTURED[name](c, arm(name, "default"), arm(name, capture.REFERENCE))


@pytest.mark.parametrize("name", CASE_PARAMS)
@pytest.mark.heavy
def test_with_the_robust_option_the_damage_is_bounded(name):
    c = capture.case(name)
    default, robust, ref = arm(name, "default"), arm(name, "robust"), arm(name, capture.REFERENCE)
    row = capture.summarise(robust, ref, capture.victim_of(c, default, ref))
    assert capture.bounded([row]), row
    assert robust.rejected == 0, robust.rejected  # no honest reply lost to the attack


@by_case("comet/outlier")
@pytest.mark.heavy  # the arms of a case: 4 to 18 CPU-s (shared with its heavy tests above)
def test_comet_outlier_guard_restores_the_clusters_without_the_attacker():
    robust, ref = arm("comet/outlier", "robust"), arm("comet/outlier", capture.REFERENCE)
    assert ATTACKER not in robust.strategy.assignment
    assert honest_partition(robust.strategy.assignment) == honest_partition(ref.strategy.assignment)


@by_case("fedmd/logits-1e4")
@pytest.mark.heavy  # the arms of a case: 4 to 18 CPU-s (shared with its heavy tests above)
def test_fedmd_robust_consensus_keeps_the_honest_classes():
    robust, ref = arm("fedmd/logits-1e4", "robust"), arm("fedmd/logits-1e4", capture.REFERENCE)
    assert not (robust.strategy.consensus.argmax(axis=1) == 0).all()
    assert robust.diagnostic >= ref.diagnostic - 0.2, (robust.diagnostic, ref.diagnostic)


@by_case("cosmos/copy-then-flip")
@pytest.mark.heavy  # the arms of a case: 4 to 18 CPU-s (shared with its heavy tests above)
def test_cosmos_copier_joins_the_victims_cluster_and_the_clip_holds_its_model():
    default = arm("cosmos/copy-then-flip", "default")
    cluster_of = default.strategy.cluster_of
    assert cluster_of[ATTACKER] == cluster_of[VICTIM]  # the copy in round 1 bought the membership
    robust = arm("cosmos/copy-then-flip", "robust")
    assert robust.strategy.cluster_of[ATTACKER] == robust.strategy.cluster_of[VICTIM]  # the clip does not un-join it
