"""The clustered-FL settings `rotated` (IFCA) and `label-swap` (CFL): what each client and the public set U hold,
determinism from data.seed, the errors for bad settings, the shipped configs/settings/ files, and one round of
FedAvg end to end on each (digits: 8×8, square, 10 classes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import server_app
from fedapps.config import ConfigError, DataConfig, load_config
from fedapps.data import (
    DataError,
    build_federation,
    check_spec,
    client_groups,
    label_swap_permutations,
    load_source,
    public_group_shares,
    rotation_quarter_turns,
)
from fedapps.flower.inprocess import InProcessGrid
from strategies import STRATEGIES, resolve

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
SETTINGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs" / "settings").glob("*.yaml"))


BASE_SPEC = dict(
    source="digits",
    root="/nonexistent-data-root",
    partition="rotated",
    num_clients=10,
    min_samples=5,
    groups=4,
    public_fraction=0.2,
)


def spec(**over) -> dict:
    """A complete data spec: DataConfig's defaults, this file's base, then ``over``."""
    return {**dataclasses.asdict(DataConfig()), **BASE_SPEC, **over}


@pytest.fixture(scope="module")
def digits():
    return load_source("digits")


@pytest.fixture(scope="module")
def rotated():
    return build_federation(spec())


@pytest.fixture(scope="module")
def swapped():
    return build_federation(spec(partition="label-swap", swap_pairs=2))


def both_splits(fed, i):
    c = fed.client(i)
    return ((c.train_x, c.train_y, fed.train_indices[i]), (c.test_x, c.test_y, fed.test_indices[i]))


# ------------------------------------------------------------------------------------------- rotated
def test_rotated_client_images_are_their_groups_quarter_turns_of_the_source(rotated, digits):
    assert rotated.groups.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]  # 10 clients / 4 groups: 3, 3, 2, 2
    assert rotated.group_rotation.tolist() == [0, 90, 180, 270]
    for i in range(rotated.num_clients):
        g = int(rotated.groups[i])
        for x, y, idx in both_splits(rotated, i):
            src_x, src_y = digits.x[torch.from_numpy(idx)], digits.y[torch.from_numpy(idx)]
            assert torch.equal(x, torch.rot90(src_x, g, dims=(2, 3))), f"client {i} (group {g})"
            assert torch.equal(y, src_y), "labels are not changed by a rotation"
            if g:  # the rotation is real (digits are not rotation-invariant)
                assert not torch.equal(x, src_x)


def test_rotation_angles_are_g_times_360_over_groups():
    assert rotation_quarter_turns(4).tolist() == [0, 1, 2, 3]
    assert rotation_quarter_turns(2).tolist() == [0, 2]
    assert rotation_quarter_turns(1).tolist() == [0]
    fed = build_federation(spec(groups=2, num_clients=4, public_fraction=0.0))
    ds = load_source("digits")
    idx = torch.from_numpy(fed.train_indices[3])  # group 1 of 2: 180°
    assert fed.groups.tolist() == [0, 0, 1, 1]
    assert torch.equal(fed.client(3).train_x, torch.flip(ds.x[idx], dims=(2, 3)))


def test_client_groups_are_balanced_and_samples_iid(rotated):
    for m, g in ((10, 4), (25, 4), (20, 4), (7, 7), (5, 1)):
        sizes = np.bincount(client_groups(m, g), minlength=g)
        assert sizes.sum() == m and sizes.max() - sizes.min() <= 1 and sizes.min() >= 1
    sizes = rotated.train_counts.sum(1) + rotated.test_counts.sum(1)
    assert sizes.max() - sizes.min() <= 1  # IID: the pool cut into near-equal parts
    assert (rotated.train_counts > 0).sum(1).min() >= 8  # every client sees (almost) every class


def test_rotated_public_set_is_equal_class_stratified_shares_rotated_like_their_group(rotated, digits):
    pub = torch.from_numpy(rotated.public_indices)
    shares = rotated.public_groups
    assert shares.shape == (pub.numel(),)
    counts = np.bincount(shares, minlength=4)
    assert counts.max() - counts.min() <= 1
    labels = digits.y[pub].numpy()
    for c in range(10):
        per_class = np.bincount(shares[labels == c], minlength=4)
        assert per_class.max() - per_class.min() <= 1, f"class {c}: shares {per_class}"
    for j in range(pub.numel()):
        assert torch.equal(rotated.public_x[j], torch.rot90(digits.x[pub[j]], int(shares[j]), dims=(1, 2)))
    assert torch.equal(rotated.public_y, digits.y[pub])  # U's labels are the source's


def test_public_group_shares_pure_function():
    y = np.repeat(np.arange(3), [7, 5, 9])
    s = public_group_shares(y, 4, np.random.default_rng(0))
    assert np.bincount(s, minlength=4).tolist() in ([6, 5, 5, 5], [5, 6, 5, 5], [5, 5, 6, 5], [5, 5, 5, 6])
    for c in range(3):
        per = np.bincount(s[y == c], minlength=4)
        assert per.max() - per.min() <= 1


def test_group_transforms_keep_one_shared_store(rotated, swapped):
    for fed in (rotated, swapped):
        views = [t for i in range(fed.num_clients) for t in vars(fed.client(i)).values()] + [fed.public_x, fed.public_y]
        for t in views:
            store = fed.x if t.dtype == fed.x.dtype else fed.y
            assert t.untyped_storage().data_ptr() == store.untyped_storage().data_ptr()
        used = int(fed.train_counts.sum() + fed.test_counts.sum()) + len(fed.public_x)
        assert fed.x.shape[0] == used


# ----------------------------------------------------------------------------------------- label-swap
def test_label_swap_client_labels_are_their_groups_permutation_of_the_source(swapped, digits):
    perms = swapped.label_perms
    assert perms.shape == (4, 10)
    assert perms[0].tolist() == list(range(10)), "group 0 keeps the source's labels"
    assert len({tuple(p) for p in perms}) == 4, "every group has its own permutation"
    for p in perms[1:]:
        assert sorted(p.tolist()) == list(range(10))  # a permutation
        assert np.array_equal(p[p], np.arange(10))  # made of swaps
        assert int((p != np.arange(10)).sum()) == 4  # swap_pairs=2: four labels move
    for i in range(swapped.num_clients):
        g = int(swapped.groups[i])
        for x, y, idx in both_splits(swapped, i):
            src_x, src_y = digits.x[torch.from_numpy(idx)], digits.y[torch.from_numpy(idx)]
            assert torch.equal(y, torch.from_numpy(perms[g])[src_y]), f"client {i} (group {g})"
            assert torch.equal(x, src_x), "images are not changed by a label swap"
        # class counts are in the client's own labels
        assert swapped.train_counts[i].tolist() == np.bincount(swapped.client(i).train_y.numpy(), minlength=10).tolist()


def test_label_swap_public_set_is_untouched_with_source_labels(swapped, digits):
    pub = torch.from_numpy(swapped.public_indices)
    assert torch.equal(swapped.public_x, digits.x[pub]) and torch.equal(swapped.public_y, digits.y[pub])
    assert swapped.public_groups is None and swapped.group_rotation is None


def test_partition_csv_rows_name_group_and_transform(rotated, swapped):
    rows = rotated.stats_rows()
    assert [r["transform"] for r in rows[::2]] == [f"rotate {90 * g}" for g in rotated.groups]
    p = swapped.label_perms[1]
    moved = [c for c in range(10) if p[c] > c]
    row = next(r for r in swapped.stats_rows() if r["group"] == 1)
    assert row["transform"] == "swap " + " ".join(f"{c}-{p[c]}" for c in moved)
    assert next(r for r in swapped.stats_rows() if r["group"] == 0)["transform"] == "identity"


# ---------------------------------------------------------------------------------------- determinism
def test_deterministic_from_data_seed(rotated, swapped):
    for fed, s in ((rotated, spec()), (swapped, spec(partition="label-swap", swap_pairs=2))):
        again = build_federation(s)
        assert torch.equal(again.x, fed.x) and torch.equal(again.y, fed.y)
        assert all(np.array_equal(a, b) for a, b in zip(again.train_indices, fed.train_indices))
        other = build_federation({**s, "seed": 2})
        assert not np.array_equal(other.train_indices[0], fed.train_indices[0])
    a = label_swap_permutations(10, 4, 1, np.random.default_rng(5))
    b = label_swap_permutations(10, 4, 1, np.random.default_rng(6))
    assert np.array_equal(a, label_swap_permutations(10, 4, 1, np.random.default_rng(5))) and not np.array_equal(a, b)
    assert not np.array_equal(
        build_federation(spec(partition="label-swap", seed=2)).label_perms,
        build_federation(spec(partition="label-swap", seed=1)).label_perms,
    )


def test_earlier_partitions_are_unchanged_by_the_new_transform_stream():
    """The transforms draw from their own generator: an iid federation is the same as before the change."""
    fed = build_federation(spec(partition="iid", public_fraction=0.2))
    ds = load_source("digits")
    assert torch.equal(fed.client(0).train_x, ds.x[torch.from_numpy(fed.train_indices[0])])
    assert fed.groups is None and fed.label_perms is None and fed.public_groups is None


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "over, key",
    [
        (dict(groups=11), "data.groups"),  # more groups than clients
        (dict(partition="label-swap", groups=11), "data.groups"),
        (dict(groups=3), "data.groups"),  # 120° is not a quarter turn
        (dict(source="synthetic", synthetic_shape=[1, 8, 6], synthetic_samples=60), "synthetic_shape"),
        (dict(partition="label-swap", swap_pairs=6), "data.swap_pairs"),  # only 5 disjoint pairs among 10
        (dict(partition="label-swap", swap_pairs=0), "data.swap_pairs"),
        (
            dict(partition="label-swap", source="synthetic", synthetic_classes=2, synthetic_samples=60, groups=3),
            "data.groups",
        ),
    ],
)
def test_bad_settings_are_config_errors_naming_the_key(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        check_spec(spec(**over))
    assert isinstance(info.value, DataError)


def test_non_square_images_rotate_by_half_turns_only():
    s = spec(source="synthetic", synthetic_shape=[1, 8, 6], synthetic_samples=60, groups=2, num_clients=4)
    fed = build_federation(s)
    assert fed.client(3).train_x.shape[1:] == (1, 8, 6)


def test_label_swap_needs_two_classes():
    with pytest.raises(DataError, match="at least 2 classes"):
        label_swap_permutations(1, 1, 1, np.random.default_rng(0))


def test_a_spec_without_swap_pairs_gets_the_default():
    s = spec()
    del s["swap_pairs"]
    assert check_spec(s)["swap_pairs"] == 1


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("partition", ["rotated", "label-swap"])
def test_one_round_of_fedavg_on_digits(partition, tiny_config, tmp_path):
    cfg = tiny_config(rounds=1, data={"partition": partition, "groups": 2, "num_clients": 4}, model={"name": "cnn"})
    summary = server_app.run_experiment(InProcessGrid(4), str(cfg), "", str(tmp_path))
    assert summary["rounds"] == 1 and 0.0 <= summary["accuracy_mean"] <= 1.0
    run = load_config(cfg).resolved_run_name()
    text = (tmp_path / run / "partition.csv").read_text().splitlines()
    assert "group" in text[0] and "transform" in text[0] and len(text) == 1 + 2 * 4


@pytest.mark.parametrize("config", SETTINGS)
def test_settings_configs_resolve_under_every_strategy_or_refuse_naming_a_key(config):
    """Each base YAML takes every strategy through strategy.name (or refuses with a key to set); cheap: no rounds
    (the rounds were run by hand, docs/results/index.md)."""
    accepted = []
    for name in sorted(STRATEGIES):
        cfg = load_config(config, f"strategy.name={name} data.source=digits")
        try:
            resolve(cfg)
            accepted.append(name)
        except ConfigError as exc:
            assert "data." in str(exc) or "model." in str(exc), f"{config} + {name}: {exc}"
    family = (
        {"cosmos", "fedmd", "fedct", "comet", "local"}
        if "agnostic" in config
        else {
            "fedavg",
            "local",
            "cwfedavg",
            "fedprox",
            "feduv",
            "fedamp",
            "ditto",
            "ifca",
            "cfl",
            "fedfomo",
            "fedper",
            "fedrep",
            "fedbabu",
            "pfedhn",
            "fednh",
            "fedselect",
            "pfedck",
        }
    )
    assert family <= set(accepted), f"{config}: refused {sorted(family - set(accepted))}"


def test_label_swap_permutations_are_distinct_even_when_choices_run_out():
    for seed in range(10):  # 4 classes, 1 pair: 6 possible swaps, 7 groups use them all
        perms = label_swap_permutations(4, 7, 1, np.random.default_rng(seed))
        assert len({tuple(p) for p in perms}) == 7 and perms[0].tolist() == [0, 1, 2, 3]
    with pytest.raises(DataError, match="data.groups=8"):
        label_swap_permutations(4, 8, 1, np.random.default_rng(0))
