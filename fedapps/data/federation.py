"""A federation: a source split into a public set U and per-client train/test data, from one data spec.

Procedure (deterministic for `seed`): load the source (train+test merged) → if public_fraction > 0 take a
stratified public set U → partition the rest over clients → split each client's samples into train/test
(stratified within the client; train keeps at least one sample). Under `rotated` / `label-swap` each client's
group transform is then applied (rotation of its images / permutation of its labels; U: see below).

Evaluation split (``evaluate_on``, docs/evaluation.md#splits): ``test`` (final runs) evaluates on the test split and
trains on the whole train split. ``validation`` (tuning) carves ``validation_fraction`` out of each client's
TRAIN split (stratified, seeded by ``derive_seed(seed, "validation-split", client)``, so the train/test split is
the same in both modes); the client then trains on the rest ("fit") and everything that evaluates on
``ClientData.test_x / test_y`` evaluates on the validation share. In that mode the test samples are never
gathered from the source: no tensor, count or index of the test split exists in the federation (the guard that
keeps tuning off the test split).

Storage: the samples are gathered once into ``Federation.x`` / ``y`` (client by client, train then evaluation
split, then U); every client's splits and U are slices of it, so a process holds one copy however many clients
it serves (``get_federation`` caches one federation per data spec and process). The per-group transforms of
`rotated` and `label-swap` are applied in place to that store, block by block, after the gather: the client
splits stay views of one tensor, and the store holds every sample as its client (or U) sees it.

The public set U under the group settings (docs/data.md):
- `rotated`: U is drawn before partitioning, as always, then cut into `groups` equal shares, stratified by
  class; share g is rotated like group g (``Federation.public_groups``). U thus follows the same input
  distribution as the union of the clients' data, as it does under every other partition; its labels are the
  source's (a rotation changes no label).
- `label-swap`: U's images are untouched (the setting changes no image), so U already follows the clients'
  input distribution; its labels (``public_y``) are the source's labels, i.e. group 0's (identity) convention.
  No single labelling agrees with every group; a mixed one would give identical-looking images contradictory
  labels. Label-free methods never read them; FedMD's optional labelled pre-training on U
  (``pretrain_public_epochs``) and the oracle diagnostics read them in group 0's convention.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedapps.config import did_you_mean

from ..seeds import derive_rng
from .errors import DataError
from .folder import is_folder_source
from .hf import is_hf_source
from .nodes import NODE_SPLIT_PURPOSE, NODES, Labelled, described_counts, read_public, server_public_path
from .partition import (
    PARTITION_KEYS,
    PARTITIONS,
    _check_alpha,
    _check_fraction,
    _check_int,
    partition_cosmos_groups,
    partition_dirichlet,
    partition_groups_iid,
    partition_iid,
    partition_pathological,
    stratified_split,
)
from .sources import SOURCES, UNKNOWN_SOURCE_HINT, load_source, source_info
from .transforms import label_swap_permutations, public_group_shares, rotate_images, rotation_quarter_turns
from .user import is_user_source

log = logging.getLogger("fedapps.data")

SPEC_KEYS: tuple[str, ...] = (
    "source",
    "root",
    "download",
    "partition",
    "num_clients",
    "classes_per_client",
    "alpha",
    "min_samples",
    "groups",
    "redistribute_fraction",
    "test_fraction",
    "public_fraction",
    "seed",
    "synthetic_classes",
    "synthetic_shape",
    "synthetic_samples",
    "validation_fraction",
    "evaluate_on",
    "swap_pairs",
    "num_classes",
    "input_shape",
    "public_path",
    "node_registry",
)
# keys a spec may leave out (older servers, hand-built specs, messages that omit keys at their default): check_spec
# fills in these defaults. num_classes / input_shape / public_path / node_registry belong to data.source 'nodes'
# (fedapps.data.nodes)
SPEC_DEFAULTS: dict[str, Any] = {
    "validation_fraction": 0.15,
    "evaluate_on": "test",
    "swap_pairs": 1,
    "num_classes": 0,
    "input_shape": [],
    "public_path": "",
    "node_registry": "",
}
EVALUATION_SPLITS: tuple[str, ...] = ("test", "validation")
VALIDATION_SEED_PURPOSE = "validation-split"  # derive_seed(data.seed, this, client id): the validation split


@dataclass
class ClientData:
    """One client's private data (train and test from the client's own distribution): slices, i.e. views,
    of the federation's one sample tensor (``Federation.x`` / ``Federation.y``), never copies.

    ``test_x`` / ``test_y`` are the split the client is EVALUATED on: its test split, or, when the data spec says
    ``evaluate_on: validation``, the validation share of its train split (``Federation.eval_split`` names which);
    then ``train_x`` / ``train_y`` are the rest of the train split (the fit share)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


@dataclass
class Federation:
    """All clients' data, the public set U and partition statistics for one data spec."""

    num_classes: int
    input_shape: tuple[int, int, int]
    num_clients: int
    public_x: torch.Tensor | None
    public_y: torch.Tensor | None  # true labels of U: for an explicitly named oracle option only
    train_counts: (
        np.ndarray
    )  # num_clients × num_classes, int64: what clients train on (the fit share in validation mode)
    test_counts: np.ndarray  # num_clients × num_classes, int64: the evaluation split (test, or validation)
    groups: np.ndarray | None  # group of each client (cosmos-groups, rotated, label-swap), else None
    fingerprint: str  # short sha256 of U (shape + bytes), "" without U
    spec: dict[str, Any]
    train_indices: list[np.ndarray] = field(repr=False)  # indices into the merged source (before group transforms)
    test_indices: list[np.ndarray] = field(repr=False)  # the evaluation split's (test, or validation)
    public_indices: np.ndarray | None = field(repr=False)
    # The samples, stored once: client 0's train then test samples, client 1's, ..., then U, each block in
    # the order of its index list (x = source.x[concatenated indices]). Every ClientData split and public_x /
    # public_y are contiguous slices (views sharing this storage), so the process holds one copy.
    x: torch.Tensor = field(repr=False)
    y: torch.Tensor = field(repr=False)
    _clients: list[ClientData | None] = field(repr=False)  # None: that client's data is elsewhere (source 'nodes')
    # which split test_* hold: "test", or "validation" (then no sample, count or index of the test split is here)
    eval_split: str = "test"
    # rotated: each group's counter-clockwise rotation in degrees (group g: g·360/groups); else None
    group_rotation: np.ndarray | None = None
    # label-swap: groups × num_classes; client of group g holds label label_perms[g, c] for a source label c
    label_perms: np.ndarray | None = None
    # rotated: the group whose rotation each U sample carries (equal, class-stratified shares); else None
    public_groups: np.ndarray | None = field(default=None, repr=False)

    def client(self, i: int) -> ClientData:
        """The data of client `i` (0 ≤ i < num_clients)."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.num_clients:
            raise DataError(
                f"client id {i!r} is out of range: expected an integer in 0..{self.num_clients - 1} "
                f"(data.num_clients={self.num_clients})"
            )
        data = self._clients[int(i)]
        if data is None:  # data.source 'nodes': each node holds its own data, the server none
            raise DataError(
                f"client {i}'s data is not in this process: under data.source 'nodes' each node holds "
                "its own (node config data-path)"
            )
        return data

    def group_transform(self, group: int) -> str:
        """What group `group` sees, in words: 'rotate 90' (degrees, counter-clockwise), 'swap 3-7 2-4', 'identity'."""
        if self.group_rotation is not None:
            return f"rotate {int(self.group_rotation[group])}"
        if self.label_perms is not None:
            p = self.label_perms[group]
            pairs = [f"{c}-{int(p[c])}" for c in range(p.size) if p[c] > c]
            return "swap " + " ".join(pairs) if pairs else "identity"
        return "identity"

    def stats_rows(self) -> list[dict[str, Any]]:
        """Per client and split (train/test, or train/validation): sample count per class (in the client's own
        labels), as CSV rows; with the client's group (and, for rotated / label-swap, its transform) where the
        partition has groups."""
        rows = []
        for i in range(self.num_clients):
            for split, counts in (("train", self.train_counts[i]), (self.eval_split, self.test_counts[i])):
                row: dict[str, Any] = {"client": i, "split": split}
                if self.groups is not None:
                    row["group"] = int(self.groups[i])
                if self.groups is not None and (self.group_rotation is not None or self.label_perms is not None):
                    row["transform"] = self.group_transform(int(self.groups[i]))
                row["total"] = int(counts.sum())
                row.update({f"class_{k}": int(c) for k, c in enumerate(counts)})
                rows.append(row)
        return rows


def check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Check every key of a data spec; return a normalised copy (plain Python types).

    The one check of the ``data`` section: the server runs it when it resolves an experiment, and every client
    on the spec a message brings (clients read no config file)."""
    if not isinstance(spec, dict):
        raise DataError(f"data spec must be a dict with keys {', '.join(SPEC_KEYS)}; got {type(spec).__name__}")
    spec = {**SPEC_DEFAULTS, **spec}
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise DataError(f"data spec is missing keys: {', '.join(missing)} (required: {', '.join(SPEC_KEYS)})")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise DataError(f"data spec has unknown keys: {', '.join(unknown)} (allowed: {', '.join(SPEC_KEYS)})")
    s = dict(spec)
    if (
        s["source"] not in (*SOURCES, NODES)
        and not is_hf_source(s["source"])
        and not is_user_source(s["source"])
        and not is_folder_source(s["source"])
    ):
        raise DataError(
            f"data.source={s['source']!r} is unknown{did_you_mean(s['source'], (*SOURCES, NODES))}; allowed: "
            f"{', '.join((*SOURCES, NODES))}, {UNKNOWN_SOURCE_HINT}"
        )
    if s["partition"] not in PARTITIONS:
        raise DataError(
            f"data.partition={s['partition']!r} is unknown{did_you_mean(s['partition'], PARTITIONS)}; allowed: "
            f"{', '.join(PARTITIONS)}"
        )
    if not isinstance(s["root"], (str, os.PathLike)) or not str(s["root"]):
        raise DataError(f"data.root={s['root']!r} must be a non-empty path string")
    s["root"] = str(s["root"])
    if not isinstance(s["download"], bool):
        raise DataError(f"data.download={s['download']!r} must be true or false")
    s["num_clients"] = _check_int("num_clients", s["num_clients"], 1)
    s["classes_per_client"] = _check_int("classes_per_client", s["classes_per_client"], 1)
    s["alpha"] = _check_alpha(s["alpha"])
    s["min_samples"] = _check_int("min_samples", s["min_samples"], 1)
    s["groups"] = _check_int("groups", s["groups"], 1)
    s["redistribute_fraction"] = _check_fraction("redistribute_fraction", s["redistribute_fraction"], allow_one=False)
    s["test_fraction"] = _check_fraction("test_fraction", s["test_fraction"], allow_one=False)
    s["public_fraction"] = _check_fraction("public_fraction", s["public_fraction"], allow_one=False)
    if isinstance(s["seed"], bool) or not isinstance(s["seed"], (int, np.integer)) or s["seed"] < 0:
        raise DataError(f"data.seed={s['seed']!r} must be a non-negative integer")
    s["seed"] = int(s["seed"])
    s["synthetic_classes"] = _check_int("synthetic_classes", s["synthetic_classes"], 2)
    shape = s["synthetic_shape"]
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != 3
        or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape)
    ):
        raise DataError(f"data.synthetic_shape={shape!r} must be a list of 3 positive integers [C, H, W]")
    s["synthetic_shape"] = [int(d) for d in shape]
    s["synthetic_samples"] = _check_int("synthetic_samples", s["synthetic_samples"], s["synthetic_classes"])
    s["swap_pairs"] = _check_int("swap_pairs", s["swap_pairs"], 1)

    s["validation_fraction"] = _check_fraction("validation_fraction", s["validation_fraction"], allow_one=False)
    if s["evaluate_on"] not in EVALUATION_SPLITS:
        raise DataError(
            f"data.evaluate_on={s['evaluate_on']!r} is unknown; allowed: {', '.join(EVALUATION_SPLITS)} "
            "(test for final runs; validation while tuning hyper-parameters, e.g. with `fedapps tune`)"
        )
    if s["evaluate_on"] == "validation" and s["validation_fraction"] <= 0:
        raise DataError(
            f"data.validation_fraction={s['validation_fraction']!r} leaves no validation split, but "
            "data.evaluate_on is 'validation'; set data.validation_fraction in (0, 1), e.g. 0.15"
        )

    _check_nodes_keys(s)
    if s["source"] == NODES:
        return s  # no source to partition: the nodes bring their data (the keys above still apply to their splits)
    num_classes, shape = source_info(
        s["source"], s["synthetic_classes"], s["synthetic_shape"], root=s["root"], download=s["download"]
    )
    if s["partition"] == "pathological" and s["classes_per_client"] > num_classes:
        raise DataError(
            f"data.classes_per_client={s['classes_per_client']} exceeds the {num_classes} classes "
            f"of data.source={s['source']!r}; allowed: 1..{num_classes}"
        )
    if s["partition"] == "cosmos-groups" and s["groups"] > min(num_classes, s["num_clients"]):
        raise DataError(
            f"data.groups={s['groups']} must be at most min(num_classes={num_classes}, "
            f"num_clients={s['num_clients']}) for partition 'cosmos-groups'"
        )
    if s["partition"] in ("rotated", "label-swap") and s["groups"] > s["num_clients"]:
        raise DataError(
            f"data.groups={s['groups']} exceeds data.num_clients={s['num_clients']}: partition "
            f"{s['partition']!r} needs at least one client per group; lower data.groups or raise "
            f"data.num_clients"
        )
    if s["partition"] == "rotated":
        quarters = rotation_quarter_turns(s["groups"])
        if np.any(quarters % 2 == 1) and shape[1] != shape[2]:
            raise DataError(
                f"partition 'rotated' with data.groups={s['groups']} turns images by 90°, which needs "
                f"square images; data.source={s['source']!r} has H×W = {shape[1]}×{shape[2]}. Use "
                f"data.groups=2 (0/180°) or a square data.synthetic_shape"
            )
    if s["partition"] == "label-swap":
        label_swap_permutations(num_classes, s["groups"], s["swap_pairs"], np.random.default_rng(0))  # feasibility
    return s


def _check_nodes_keys(s: dict[str, Any]) -> None:
    """``num_classes`` / ``input_shape`` / ``public_path`` / ``node_registry``: data.source 'nodes' only (normalised
    in ``s``)."""
    k = s["num_classes"]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise DataError(f"data.num_classes={k!r} must be a non-negative integer (0: learnt from the nodes)")
    s["num_classes"] = int(k)
    shape = s["input_shape"]
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) not in (0, 3)
        or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape)
    ):
        raise DataError(
            f"data.input_shape={shape!r} must be [] (learnt from the nodes) or 3 positive integers [C, H, W]"
        )
    s["input_shape"] = [int(d) for d in shape]
    for key in ("public_path", "node_registry"):
        if not isinstance(s[key], (str, os.PathLike)):
            raise DataError(f"data.{key}={s[key]!r} must be a path string ('' = none)")
        s[key] = str(s[key])
    if s["source"] == NODES:  # U is a file (public_path); public_fraction and the partition keys do not apply
        return
    for key, default in (("num_classes", 0), ("input_shape", []), ("public_path", ""), ("node_registry", "")):
        if s[key] != default:
            raise DataError(
                f"data.{key}={s[key]!r} applies to data.source 'nodes' only (data.source is {s['source']!r}); remove it"
            )


def public_fingerprint(x: torch.Tensor) -> str:
    """U's identity: a short sha256 of its shape, dtype and bytes (the same U in the same order, the same string)."""
    h = hashlib.sha256()
    h.update(repr(tuple(x.shape)).encode())
    h.update(str(x.dtype).encode())
    h.update(x.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def client_split(
    idx: np.ndarray, labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A client's source indices ``idx`` -> (train, test), stratified by label; train keeps at least one sample."""
    test_loc, train_loc = stratified_split(labels[idx], test_fraction, rng)
    if train_loc.size == 0:  # tiny client: keep one sample for training
        train_loc, test_loc = test_loc[:1], test_loc[1:]
    return idx[train_loc], idx[test_loc]


def allocate_test(
    test: np.ndarray, labels: np.ndarray, trains: list[np.ndarray], rng: np.random.Generator
) -> list[np.ndarray]:
    """A source's own test split (indices ``test``) shared among the clients: each class's test samples, shuffled,
    go to the clients holding that class in proportion to their training samples of it (largest remainder), so
    that every client is measured on its own class distribution; a class no client trains on is left out. Each
    client's share is returned sorted."""
    k = int(labels.max()) + 1 if labels.size else 0
    counts = np.stack([np.bincount(labels[tr], minlength=k) for tr in trains]) if trains else np.zeros((0, k), int)
    shares: list[list[np.ndarray]] = [[] for _ in trains]
    for c in range(k):
        pool = test[labels[test] == c]
        weight = counts[:, c] if counts.size else np.zeros(0, int)
        if not pool.size or not weight.sum():
            continue
        pool = rng.permutation(pool)
        exact = pool.size * weight / weight.sum()
        n = np.floor(exact).astype(np.int64)
        left = pool.size - int(n.sum())
        if left:
            n[np.argsort(-(exact - n), kind="stable")[:left]] += 1
        ends = np.cumsum(n)
        for i, (a, b) in enumerate(zip(ends - n, ends)):
            if b > a:
                shares[i].append(pool[a:b])
    return [np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64) for parts in shares]


def validation_split(
    train: np.ndarray, labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A client's train indices -> (fit, validation): ``fraction`` of each class held out (largest remainder,
    so stratified where the counts allow); fit keeps at least one sample. Both keep train's order."""
    val_loc, fit_loc = stratified_split(labels[train], fraction, rng)
    if fit_loc.size == 0:  # tiny client: keep one sample for training
        fit_loc, val_loc = val_loc[:1], val_loc[1:]
    return train[fit_loc], train[val_loc]


def split_clients(
    s: dict[str, Any], labels: np.ndarray, k: int, pool: np.ndarray, m: int, own_test: np.ndarray | None = None
) -> tuple[np.ndarray | None, list[np.ndarray], list[np.ndarray]]:
    """The pool (source indices left after U) partitioned among ``m`` clients as spec ``s`` says, each client's part
    split into train and evaluation indices (test, or the validation share of train): (groups, train, eval).
    ``own_test``: the source's own test split (indices outside the pool); then a client's whole part is its training
    data and its test split is its share of ``own_test`` (:func:`allocate_test`). Deterministic for the spec's seed
    (the partition and split streams of :func:`build_federation`)."""
    _, rng_partition, rng_split = (np.random.default_rng(c) for c in np.random.SeedSequence(s["seed"]).spawn(3))
    pool_labels = labels[pool]
    part = s["partition"]
    groups: np.ndarray | None = None
    if m > pool.size:
        raise DataError(
            f"data.num_clients={m} exceeds the {pool.size} samples left for clients "
            f"(source {s['source']!r}, public_fraction={s['public_fraction']})"
        )
    if part == "iid":
        local = partition_iid(pool_labels, m, rng_partition)
    elif part == "pathological":
        local = partition_pathological(pool_labels, m, k, s["classes_per_client"], rng_partition)
    elif part == "dirichlet":
        local = partition_dirichlet(pool_labels, m, k, s["alpha"], s["min_samples"], rng_partition)
    elif part == "cosmos-groups":
        local, groups = partition_cosmos_groups(
            pool_labels, m, k, s["alpha"], s["groups"], s["redistribute_fraction"], rng_partition
        )
    else:  # rotated / label-swap
        local, groups = partition_groups_iid(pool_labels, m, s["groups"], rng_partition)
    validating = s["evaluate_on"] == "validation"
    train_indices, eval_indices = [], []
    own_shares = None
    if own_test is not None and not validating:
        own_shares = allocate_test(own_test, labels, [pool[loc] for loc in local], rng_split)
    for i, loc in enumerate(local):
        if loc.size == 0:
            raise DataError(
                f"client {i} received no samples with partition {part!r} "
                f"(num_clients={m}, alpha={s['alpha']}); use fewer clients or another partition"
            )
        if own_test is not None:  # the source's test split is the test split: the client's part is all training
            tr, te = pool[loc], (own_shares[i] if own_shares is not None else np.zeros(0, np.int64))
        else:
            tr, te = client_split(pool[loc], labels, s["test_fraction"], rng_split)
        if validating:  # the test indices `te` are dropped here: only train's split into fit / validation stays
            tr, te = validation_split(
                tr, labels, s["validation_fraction"], derive_rng(s["seed"], VALIDATION_SEED_PURPOSE, i)
            )
        train_indices.append(tr)
        eval_indices.append(te)
    return groups, train_indices, eval_indices


def _clients_have_data(
    s: dict[str, Any], labels: np.ndarray, k: int, pool: np.ndarray, m: int, own_test: np.ndarray | None = None
) -> bool:
    """Whether ``m`` clients (the rest of spec ``s`` as it is) would each get training data and an evaluation split."""
    try:
        _, train, evaluation = split_clients(s, labels, k, pool, m, own_test)
    except DataError:
        return False
    return all(tr.size and ev.size for tr, ev in zip(train, evaluation))


def largest_working(m: int, works: Callable[[int], bool]) -> int:
    """The largest client count below ``m`` for which ``works`` holds (binary search: fewer clients get more data
    each); 0 when even one client does not work."""
    lo, hi = 0, m  # works(lo) holds (0 trivially), works(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if works(mid):
            lo = mid
        else:
            hi = mid
    return lo


def check_every_client_has_data(
    s: dict[str, Any], train_sizes: np.ndarray, eval_sizes: np.ndarray, works: Callable[[int], bool]
) -> None:
    """DataError (exit 2 before any run starts) when a client has no training data or an empty evaluation split: a
    headline averaged over clients measured on nothing means nothing. Names the largest ``data.num_clients`` that
    gives every client both (``works(m)``: whether m clients do)."""
    m = s["num_clients"]
    no_train = np.flatnonzero(np.asarray(train_sizes) == 0).tolist()
    no_eval = np.flatnonzero(np.asarray(eval_sizes) == 0).tolist()
    if not no_train and not no_eval:
        return
    split = "validation" if s["evaluate_on"] == "validation" else "test"
    fraction = "data.validation_fraction" if split == "validation" else "data.test_fraction"
    parts = []
    if no_eval:
        parts.append(f"{len(no_eval)} of the {m} clients without a {split} split (e.g. clients {no_eval[:5]})")
    if no_train:
        parts.append(f"{len(no_train)} without training data (e.g. clients {no_train[:5]})")
    share = s["test_fraction"] if split == "test" else s["validation_fraction"]
    if share <= 0:  # no client count helps: nothing is held out at all
        fix = f"{fraction}={share} holds out nothing to measure on; raise {fraction} (e.g. 0.25)"
    else:
        best = largest_working(m, works)
        fix = (
            f"at most data.num_clients={best} gives every client training data and a {split} split here"
            if best
            else f"no client count gives every client training data and a {split} split here"
        ) + f"; use fewer clients, raise {fraction}, or a larger source"
    raise DataError(
        f"data.source={s['source']} data.num_clients={m} (partition {s['partition']}, "
        f"{fraction}={share}) leaves {' and '.join(parts)}: {fix}"
    )


def build_federation(spec: dict[str, Any]) -> Federation:
    """Load, split off U, partition and split per client, as the data spec says (deterministic for its seed).
    Under data.source 'nodes': the server's view, :func:`nodes_server_federation`."""
    s = check_spec(spec)
    if s["source"] == NODES:
        return nodes_server_federation(s)
    t0 = time.perf_counter()
    ds = load_source(
        s["source"],
        s["root"],
        download=s["download"],
        synthetic_classes=s["synthetic_classes"],
        synthetic_shape=s["synthetic_shape"],
        synthetic_samples=s["synthetic_samples"],
        seed=s["seed"],
    )
    labels = ds.y.numpy()
    k = ds.num_classes
    rng_public = np.random.default_rng(np.random.SeedSequence(s["seed"]).spawn(3)[0])
    # a source's own test split (folder:<path> with test/): kept out of U and of the clients' training data
    own_test = None if ds.test_mask is None else np.flatnonzero(ds.test_mask).astype(np.int64)
    usable = (
        np.arange(labels.size, dtype=np.int64)
        if ds.test_mask is None
        else np.flatnonzero(~ds.test_mask).astype(np.int64)
    )

    public_idx: np.ndarray | None = None
    if s["public_fraction"] > 0:
        public_loc, pool_loc = stratified_split(labels[usable], s["public_fraction"], rng_public)
        public_idx, pool = usable[public_loc], usable[pool_loc]
    else:
        pool = usable

    m, part = s["num_clients"], s["partition"]
    try:
        groups, train_indices, eval_indices = split_clients(s, labels, k, pool, m, own_test)
    except DataError as exc:  # e.g. a client without any sample: name a client count that works, where one does
        best = largest_working(m, lambda n: _clients_have_data(s, labels, k, pool, n, own_test))
        if not best:
            raise
        raise DataError(
            f"{exc} (at most data.num_clients={best} gives every client training data and an evaluation split here)"
        ) from exc
    # the transforms draw from their own stream: the partitions above stay those of earlier versions
    rng_transform = np.random.default_rng(np.random.SeedSequence([s["seed"], 0x7261]))
    label_perms = (
        label_swap_permutations(k, s["groups"], s["swap_pairs"], rng_transform) if part == "label-swap" else None
    )

    train_counts = np.zeros((m, k), dtype=np.int64)
    eval_counts = np.zeros((m, k), dtype=np.int64)
    for i, (tr, te) in enumerate(zip(train_indices, eval_indices)):
        relabel = np.arange(k)  # counts: the client's labels
        if label_perms is not None:
            assert groups is not None  # the group partitions give every client its group
            relabel = label_perms[groups[i]]
        train_counts[i] = np.bincount(relabel[labels[tr]], minlength=k)
        eval_counts[i] = np.bincount(relabel[labels[te]], minlength=k)
    check_every_client_has_data(
        s,
        train_counts.sum(axis=1),
        eval_counts.sum(axis=1),
        lambda n: _clients_have_data(s, labels, k, pool, n, own_test),
    )

    # One gather from the source into the stored order; every split below is a slice (a view) of it.
    blocks = [b for tr, te in zip(train_indices, eval_indices) for b in (tr, te)]
    if public_idx is not None:
        blocks.append(public_idx)
    order = torch.from_numpy(np.concatenate(blocks).astype(np.int64, copy=False))
    x, y = ds.x[order], ds.y[order]
    input_shape = ds.input_shape
    del ds  # the source's own tensors are no longer needed
    ends = np.cumsum([b.size for b in blocks]).tolist()

    # Group transforms, in place on the one store (x / y are the gathered copy, not the source's tensors).
    group_rotation = public_groups = None
    if part == "rotated":
        assert groups is not None  # the group partitions give every client its group
        quarters = rotation_quarter_turns(s["groups"])
        group_rotation = quarters * 90
        for i in range(m):
            start, end = (ends[2 * i - 1] if i else 0), ends[2 * i + 1]
            if quarters[groups[i]]:
                x[start:end] = rotate_images(x[start:end], int(quarters[groups[i]]))
        if public_idx is not None:
            public_groups = public_group_shares(labels[public_idx], s["groups"], rng_transform)
            for g, turns in enumerate(quarters):
                rows = torch.from_numpy(ends[-2] + np.flatnonzero(public_groups == g))
                if turns and rows.numel():
                    x[rows] = rotate_images(x[rows], turns)
    elif label_perms is not None:
        assert groups is not None  # the group partitions give every client its group
        perms = torch.from_numpy(label_perms)
        for i in range(m):
            start, end = (ends[2 * i - 1] if i else 0), ends[2 * i + 1]
            y[start:end] = perms[groups[i]][y[start:end]]
    clients: list[ClientData | None] = []
    for i in range(m):
        start, mid, end = (ends[2 * i - 1] if i else 0), ends[2 * i], ends[2 * i + 1]
        clients.append(ClientData(x[start:mid], y[start:mid], x[mid:end], y[mid:end]))

    public_x = public_y = None
    fingerprint = ""
    if public_idx is not None:
        public_x, public_y = x[ends[-2] :], y[ends[-2] :]
        fingerprint = public_fingerprint(public_x)
    log.info(
        "data: %s / %s, %d clients, train %d, %s %d, public %d (%.2fs)",
        s["source"],
        part,
        m,
        int(train_counts.sum()),
        s["evaluate_on"],
        int(eval_counts.sum()),
        0 if public_idx is None else public_idx.size,
        time.perf_counter() - t0,
    )
    return Federation(
        num_classes=k,
        input_shape=input_shape,
        num_clients=m,
        public_x=public_x,
        public_y=public_y,
        train_counts=train_counts,
        test_counts=eval_counts,
        groups=groups,
        fingerprint=fingerprint,
        spec=s,
        train_indices=train_indices,
        test_indices=eval_indices,
        public_indices=public_idx,
        x=x,
        y=y,
        _clients=clients,
        eval_split=s["evaluate_on"],
        group_rotation=group_rotation,
        label_perms=label_perms,
        public_groups=public_groups,
    )


_CACHE: dict[str, Federation] = {}
_CACHE_LOCK = threading.Lock()


def spec_key(spec: dict[str, Any]) -> str:
    """Canonical JSON of a validated data spec: the cache key, and a stable identity for the data."""
    return json.dumps(check_spec(spec), sort_keys=True, separators=(",", ":"))


SYNTHETIC_KEYS: tuple[str, ...] = ("synthetic_classes", "synthetic_shape", "synthetic_samples")  # source synthetic


def unused_data_keys(
    spec: dict[str, Any], defaults: dict[str, Any], named: set[str] | frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """``(key, why)`` for each data key that is set (a value other than its default in ``defaults``, or a key in
    ``named``: the overrides) but that the spec's source and partition do not read (e.g. ``alpha`` under a
    pathological partition). Pure; the caller reports them."""
    out: list[tuple[str, str]] = []
    source, partition = spec.get("source"), spec.get("partition")

    def changed(key: str) -> bool:
        return key in spec and (key in named or (key in defaults and spec[key] != defaults[key]))

    for key, partitions in PARTITION_KEYS.items():
        if not changed(key):
            continue
        if source == NODES:
            out.append((key, "data.source is 'nodes': every node brings its own data, nothing is partitioned"))
        elif partition not in partitions:
            out.append(
                (
                    key,
                    (
                        f"only the {' / '.join(partitions)} partition{'s' if len(partitions) > 1 else ''} "
                        f"read{'' if len(partitions) > 1 else 's'} it; data.partition is '{partition}'"
                    ),
                )
            )
    for key in SYNTHETIC_KEYS:
        if changed(key) and source != "synthetic":
            out.append((key, f"only data.source 'synthetic' reads it; data.source is '{source}'"))
    if changed("validation_fraction") and spec.get("evaluate_on") != "validation":
        out.append(
            (
                "validation_fraction",
                (
                    "the validation split is carved only when data.evaluate_on is "
                    "'validation' (tuning, e.g. fedapps tune); data.evaluate_on is "
                    f"'{spec.get('evaluate_on')}'"
                ),
            )
        )
    return out


class _DropWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.WARNING


@contextlib.contextmanager
def data_warnings_silenced():
    """While inside, this process logs no warning about the data it builds (a partition that leaves classes unused,
    an empty validation split, ...): a client rebuilding the federation the server has built and reported from the
    same spec would repeat each warning once per client process. Errors still raise."""
    dropper = _DropWarnings()
    log.addFilter(dropper)
    try:
        yield
    finally:
        log.removeFilter(dropper)


def get_federation(spec: dict[str, Any]) -> Federation:
    """`build_federation`, cached per process on the canonical spec (each process loads and partitions once).
    Under data.source 'nodes' not cached (the counts the nodes describe may change; U itself is read once)."""
    key = spec_key(spec)
    if json.loads(key)["source"] == NODES:
        return build_federation(spec)
    with _CACHE_LOCK:
        fed = _CACHE.get(key)
        if fed is None:
            fed = build_federation(spec)
            _CACHE[key] = fed
        return fed


def clear_federation_cache() -> None:
    """Forget every cached federation (frees memory; tests)."""
    with _CACHE_LOCK:
        _CACHE.clear()


# ---------------------------------------------------------------------- data.source 'nodes'


def nodes_server_federation(s: dict[str, Any]) -> Federation:
    """The server's federation under data.source 'nodes': no client data; U from ``data.public_path`` (the server's
    copy); classes and shape as the nodes described them (0 / (0, 0, 0) before); per-client class counts as the
    nodes reported them (``nodes.set_described_counts``; zeros for clients never described)."""
    k = int(s["num_classes"])
    shape = tuple(s["input_shape"]) if s["input_shape"] else (0, 0, 0)
    m = int(s["num_clients"])
    public_x = public_y = None
    fingerprint = ""
    if s["public_path"]:
        path = server_public_path(s["public_path"])
        public_x, public_y = read_public(path, f"data.public_path={s['public_path']!r}")
        if k and tuple(public_x.shape[1:]) != shape:
            raise DataError(
                f"data.public_path={s['public_path']!r}: U's images are {tuple(public_x.shape[1:])}, the "
                f"nodes' are {shape}; U must have the clients' input shape"
            )
        if k and public_y is not None and public_y.numel() and int(public_y.max()) >= k:
            raise DataError(
                f"data.public_path={s['public_path']!r}: U's label {int(public_y.max())} does not fit the "
                f"nodes' {k} classes"
            )
        fingerprint = public_fingerprint(public_x)
    counts = described_counts(spec_key(s)) if k else None
    train_counts = np.zeros((m, k), dtype=np.int64) if counts is None else counts[0]
    eval_counts = np.zeros((m, k), dtype=np.int64) if counts is None else counts[1]
    empty = torch.zeros((0, *shape))
    return Federation(
        num_classes=k,
        input_shape=shape,
        num_clients=m,
        public_x=public_x,
        public_y=public_y,
        train_counts=train_counts,
        test_counts=eval_counts,
        groups=None,
        fingerprint=fingerprint,
        spec=s,
        train_indices=[],
        test_indices=[],
        public_indices=None,
        x=public_x if public_x is not None else empty,
        y=public_y if public_y is not None else torch.zeros(0, dtype=torch.int64),
        _clients=[None] * m,
        eval_split=s["evaluate_on"],
    )


def split_node(
    y: np.ndarray, test_fraction: float, validation_fraction: float, evaluate_on: str, seed: int, client_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """A node's sample indices -> (train, evaluation split): stratified test split with ``test_fraction``; under
    ``evaluate_on: validation`` the evaluation split is the validation share of train and train the rest (the
    test indices are dropped). Deterministic in (seed, client id); the same rules as a source's clients."""
    idx = np.arange(y.size, dtype=np.int64)
    train, test = client_split(idx, y, test_fraction, derive_rng(seed, NODE_SPLIT_PURPOSE, client_id))
    if evaluate_on == "validation":
        return validation_split(train, y, validation_fraction, derive_rng(seed, VALIDATION_SEED_PURPOSE, client_id))
    return train, test


def node_federation(
    spec: dict[str, Any], client_id: int, data: Labelled, public: tuple[torch.Tensor, torch.Tensor | None] | None
) -> Federation:
    """A node's federation: its own labelled ``data`` split into train / evaluation (``nodes.split_node``) as client
    ``client_id``'s, the other clients' entries empty; U from the node's own copy (``public``). Classes and shape:
    the spec's (what the server expects; 0 / [] in the describe message: then the node's own)."""
    s = check_spec(spec)
    m = int(s["num_clients"])
    if not 0 <= client_id < m:
        raise DataError(
            f"client id {client_id} is outside the federation 0..{m - 1} (data.num_clients={m}); give "
            "this node a client-id in that range"
        )
    k = int(s["num_classes"]) or data.num_classes
    labels = data.y.numpy()
    train, held = split_node(
        labels, s["test_fraction"], s["validation_fraction"], s["evaluate_on"], s["seed"], client_id
    )
    train_counts = np.zeros((m, k), dtype=np.int64)
    eval_counts = np.zeros((m, k), dtype=np.int64)
    train_counts[client_id] = np.bincount(labels[train], minlength=k)[:k]
    eval_counts[client_id] = np.bincount(labels[held], minlength=k)[:k]
    order = torch.from_numpy(np.concatenate([train, held]))
    x, y = data.x[order], data.y[order]
    clients: list[ClientData | None] = [None] * m
    clients[client_id] = ClientData(x[: train.size], y[: train.size], x[train.size :], y[train.size :])
    public_x, public_y = public if public is not None else (None, None)
    return Federation(
        num_classes=k,
        input_shape=data.input_shape,
        num_clients=m,
        public_x=public_x,
        public_y=public_y,
        train_counts=train_counts,
        test_counts=eval_counts,
        groups=None,
        fingerprint=public_fingerprint(public_x) if public_x is not None else "",
        spec=s,
        train_indices=[train if i == client_id else np.zeros(0, np.int64) for i in range(m)],
        test_indices=[held if i == client_id else np.zeros(0, np.int64) for i in range(m)],
        public_indices=None,
        x=x,
        y=y,
        _clients=clients,
        eval_split=s["evaluate_on"],
    )
