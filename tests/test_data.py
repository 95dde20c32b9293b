"""Tests of the data layer: sources, partitioners, public set U, federation building and errors."""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedapps.config import DataConfig
from fedapps.data import (
    PARTITIONS,
    SOURCES,
    DataError,
    build_federation,
    clear_federation_cache,
    get_federation,
    group_classes,
    load_source,
    partition_cosmos_groups,
    partition_dirichlet,
    partition_iid,
    partition_pathological,
    source_info,
    stratified_split,
)
from fedapps.data.partition import _cosmos_group_split, _redistribute

torch.set_num_threads(1)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def balanced_labels(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    y = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(seed).permutation(y)


BASE_SPEC = dict(root="/nonexistent-data-root", partition="pathological")


def spec(**over) -> dict:
    """A complete data spec: DataConfig's defaults, this file's base, then ``over``."""
    return {**dataclasses.asdict(DataConfig()), **BASE_SPEC, **over}


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert allidx.size == n, "every sample assigned"
    assert np.unique(allidx).size == n, "no sample assigned twice"
    assert allidx.min() >= 0 and allidx.max() < n


# ------------------------------------------------------------------------------------------ sources
def test_source_info_without_loading():
    assert SOURCES == (
        "mnist5k",
        "digits",
        "synthetic",
        "mnist",
        "fmnist",
        "emnist-balanced",
        "cifar10",
        "cifar100",
        "tinyimagenet",
    )
    assert PARTITIONS == ("iid", "pathological", "dirichlet", "cosmos-groups", "rotated", "label-swap")
    assert source_info("mnist5k") == (10, (1, 28, 28))
    assert source_info("digits") == (10, (1, 8, 8))
    assert source_info("emnist-balanced") == (47, (1, 28, 28))
    assert source_info("cifar100") == (100, (3, 32, 32))
    assert source_info("tinyimagenet") == (200, (3, 64, 64))
    assert source_info("synthetic", 7, [1, 5, 6]) == (7, (1, 5, 6))
    with pytest.raises(DataError, match="source"):
        source_info("imagenet")
    with pytest.raises(DataError, match="synthetic_shape"):
        source_info("synthetic", 10, [3, 32])


def test_load_mnist5k_and_digits():
    ds = load_source("mnist5k", "unused")
    assert ds.x.shape == (5000, 1, 28, 28) and ds.x.dtype == torch.float32
    assert ds.y.dtype == torch.int64 and ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    assert float(ds.x.min()) == -1.0 and float(ds.x.max()) == 1.0
    assert np.bincount(ds.y.numpy()).tolist() == [500] * 10
    dg = load_source("digits", "unused")
    assert dg.x.shape == (1797, 1, 8, 8) and dg.input_shape == (1, 8, 8)
    assert float(dg.x.min()) == -1.0 and float(dg.x.max()) == 1.0


def test_digits_are_scikit_learns_read_without_importing_it():
    """The digits read from scikit-learn's CSV are its ``load_digits`` exactly (images and labels), and a process that
    loads them has not imported scikit-learn."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    bunch = load_digits()
    dg = load_source("digits", "unused")
    assert torch.equal(dg.x, torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0)
    assert dg.y.tolist() == bunch.target.tolist()
    code = "import sys; from fedapps.data import load_source as f; f('digits', 'x'); print('sklearn' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stdout + proc.stderr


def test_parsed_csv_is_kept_once_and_read_back_exactly(tmp_path, monkeypatch):
    """A CSV source is parsed once: the copy kept in the cache folder reads back equal (uint8 where the values are
    whole bytes, float32 otherwise), a damaged copy is parsed again and replaced, 'off' keeps nothing."""
    from fedapps.data import sources

    rng = np.random.default_rng(0)
    whole = np.hstack([rng.integers(0, 256, (6, 4)), rng.integers(0, 10, (6, 1))]).astype(np.float32)
    fractional = whole.copy()
    fractional[0, 0] = 0.5
    cache = tmp_path / "cache"
    monkeypatch.setenv(sources.CACHE_ENV, str(cache))
    for name, table in (("whole.csv", whole), ("fractional.csv", fractional)):
        path = tmp_path / name
        np.savetxt(path, table, delimiter=",", fmt="%g")
        images, labels = sources.parsed_csv(str(path))
        np.testing.assert_array_equal(images, table[:, :-1])
        np.testing.assert_array_equal(labels, table[:, -1].astype(np.int64))
        [kept] = cache.glob(path.stem + "-*.npz")
        with np.load(kept) as z:
            assert z["images"].dtype == (np.uint8 if table is whole else np.float32)
        monkeypatch.setattr(np, "loadtxt", lambda *a, **k: pytest.fail("parsed again although a copy is kept"))
        again = sources.parsed_csv(str(path))
        monkeypatch.undo()
        monkeypatch.setenv(sources.CACHE_ENV, str(cache))
        np.testing.assert_array_equal(again[0], images)
        np.testing.assert_array_equal(again[1], labels)
        assert again[0].dtype == np.float32 and again[1].dtype == np.int64
        kept.write_bytes(b"not an npz")  # a damaged copy: parsed again, the copy rewritten
        np.testing.assert_array_equal(sources.parsed_csv(str(path))[0], table[:, :-1])
        with np.load(kept) as z:
            np.testing.assert_array_equal(z["labels"], labels)
    monkeypatch.setenv(sources.CACHE_ENV, "off")
    assert sources.cache_dir() is None
    path = tmp_path / "other.csv"
    np.savetxt(path, whole, delimiter=",", fmt="%g")
    sources.parsed_csv(str(path))
    assert not list(cache.glob("other-*"))


def test_synthetic_is_deterministic_and_learnable():
    a = load_source(
        "synthetic", "unused", synthetic_classes=5, synthetic_shape=(2, 6, 6), synthetic_samples=500, seed=3
    )
    b = load_source(
        "synthetic", "unused", synthetic_classes=5, synthetic_shape=(2, 6, 6), synthetic_samples=500, seed=3
    )
    c = load_source(
        "synthetic", "unused", synthetic_classes=5, synthetic_shape=(2, 6, 6), synthetic_samples=500, seed=4
    )
    assert a.x.shape == (500, 2, 6, 6) and a.num_classes == 5
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    assert float(a.x.min()) >= -1.0 and float(a.x.max()) <= 1.0
    assert np.bincount(a.y.numpy()).tolist() == [100] * 5
    # nearest class mean (fitted on half) classifies the other half well: the classes are learnable
    x, y = a.x.reshape(500, -1), a.y
    means = torch.stack([x[:250][y[:250] == k].mean(0) for k in range(5)])
    pred = torch.cdist(x[250:], means).argmin(1)
    assert (pred == y[250:]).float().mean() > 0.9


def _write_idx(path: Path, array: np.ndarray) -> None:
    code = 0x08  # unsigned byte
    header = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_torchvision_mnist_loader_merges_train_and_test(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    r = np.random.default_rng(0)
    _write_idx(raw / "train-images-idx3-ubyte", r.integers(0, 256, (30, 28, 28)))
    _write_idx(raw / "train-labels-idx1-ubyte", np.arange(30) % 10)
    _write_idx(raw / "t10k-images-idx3-ubyte", np.full((10, 28, 28), 255))
    _write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(10))
    ds = load_source("mnist", tmp_path, download=False)
    assert ds.x.shape == (40, 1, 28, 28) and ds.y.tolist()[-10:] == list(range(10))
    assert float(ds.x[-1].min()) == 1.0 and float(ds.x.min()) >= -1.0


def test_missing_torchvision_files_raise_clear_error(tmp_path):
    with pytest.raises(DataError) as err:
        load_source("mnist", tmp_path, download=False)
    msg = str(err.value)
    assert "MNIST/raw" in msg and "images-idx3-ubyte" in msg
    assert "data.download: true" in msg and str(tmp_path) in msg
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        load_source("cifar10", tmp_path)
    with pytest.raises(DataError, match="data.download: true"):
        build_federation(spec(source="fmnist", root=str(tmp_path)))
    with pytest.raises(DataError, match="tiny-imagenet-200"):
        load_source("tinyimagenet", tmp_path)


def test_tinyimagenet_folder_loader(tmp_path):
    from PIL import Image

    base = tmp_path / "tiny-imagenet-200"
    wnids = [f"n{k:08d}" for k in range(200)]
    img = Image.fromarray(np.full((64, 64, 3), 255, dtype=np.uint8))
    for w in wnids:
        (base / "train" / w / "images").mkdir(parents=True)
        img.save(base / "train" / w / "images" / f"{w}_0.JPEG")
    (base / "val" / "images").mkdir(parents=True)
    img.convert("L").save(base / "val" / "images" / "val_0.JPEG")  # grayscale files exist in the real set
    (base / "val" / "val_annotations.txt").write_text(f"val_0.JPEG\t{wnids[7]}\t0\t0\t63\t63\n")
    ds = load_source("tinyimagenet", tmp_path)
    assert ds.x.shape == (201, 3, 64, 64) and ds.num_classes == 200
    assert ds.y[:200].tolist() == list(range(200)) and int(ds.y[200]) == 7
    assert abs(float(ds.x.mean()) - 1.0) < 0.05


# --------------------------------------------------------------------------------------- partitions
def test_iid_near_equal():
    y = balanced_labels(10, 103)
    parts = partition_iid(y, 7, rng())
    assert_disjoint_cover(parts, y.size)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_stratified_split_takes_fraction_of_each_class():
    y = balanced_labels(10, 100)
    taken, rest = stratified_split(y, 0.2, rng())
    assert np.bincount(y[taken]).tolist() == [20] * 10
    assert_disjoint_cover([taken, rest], y.size)
    y2 = np.array([0] * 7 + [1] * 5 + [2] * 1)
    t2, r2 = stratified_split(y2, 0.25, rng(1))
    assert t2.size == round(0.25 * 13)
    counts = np.bincount(y2[t2], minlength=3)
    assert np.all(np.abs(counts - 0.25 * np.array([7, 5, 1])) < 1)
    with pytest.raises(DataError, match="fraction"):
        stratified_split(y, 1.5, rng())


def test_pathological_pfllib_assignment_and_skew():
    y = balanced_labels(10, 500)
    parts = partition_pathological(y, 20, 10, 2, rng(1))
    assert_disjoint_cover(parts, y.size)
    all_counts = []
    for i, p in enumerate(parts):
        counts = np.bincount(y[p], minlength=10)
        g = i // 4
        assert set(np.flatnonzero(counts)) == {2 * g, 2 * g + 1}, f"client {i}"
        all_counts.extend(counts[[2 * g, 2 * g + 1]])
    assert min(all_counts) >= 1
    assert len(set(all_counts)) > 10, "counts within a class are skewed, not balanced"
    # CIFAR-100-like: 20 clients, 100 classes, 10 per client → exactly 10 classes each
    y100 = balanced_labels(100, 20)
    for p in partition_pathological(y100, 20, 100, 10, rng(2)):
        assert np.unique(y100[p]).size == 10


def test_pathological_uneven_and_errors(caplog):
    y = balanced_labels(10, 50)
    parts = partition_pathological(y, 10, 10, 3, rng())  # 3 per class: the last client gets fewer classes
    assert_disjoint_cover(parts, y.size)
    assert all(1 <= np.unique(y[p]).size <= 3 for p in parts)
    with caplog.at_level(logging.WARNING, logger="fedapps.data"):
        parts = partition_pathological(y, 5, 10, 1, rng())  # classes 5..9 find no free client
    assert "no free client slots" in caplog.text
    assert sorted(np.unique(y[np.concatenate(parts)])) == [0, 1, 2, 3, 4]
    with pytest.raises(DataError, match="classes_per_client"):
        partition_pathological(y, 10, 10, 11, rng())


def test_dirichlet_min_samples_and_cover():
    y = balanced_labels(10, 500)
    parts = partition_dirichlet(y, 20, 10, 0.1, 40, rng(1))
    assert_disjoint_cover(parts, y.size)
    assert min(p.size for p in parts) >= 40
    # non-IID: most clients are dominated by few classes
    top = [np.bincount(y[p], minlength=10).max() / p.size for p in parts]
    assert np.median(top) > 0.5
    with pytest.raises(DataError, match="min_samples"):
        partition_dirichlet(y, 20, 10, 0.1, 300, rng())  # 20·300 > 5000: impossible
    with pytest.raises(DataError, match=r"alpha=0\.001.*min_samples=240|min_samples=240.*alpha"):
        partition_dirichlet(y, 20, 10, 0.001, 240, rng(), max_tries=5)
    with pytest.raises(DataError, match="alpha"):
        partition_dirichlet(y, 20, 10, 0.0, 1, rng())


def test_cosmos_class_groups_even_and_complete():
    sizes = [g.size for g in group_classes(47, 5)]
    assert sizes == [10, 10, 9, 9, 9]
    assert np.concatenate(group_classes(47, 5)).tolist() == list(range(47))
    assert [g.size for g in group_classes(10, 5)] == [2] * 5


def test_cosmos_groups_structure_and_redistribution():
    y = balanced_labels(47, 60)
    m, g, alpha, frac = 23, 5, 5.0, 0.1
    # the public function equals the two internal steps run on the same generator state
    pre, group_of = _cosmos_group_split(y, m, 47, alpha, g, rng(4))
    parts, group_pub = partition_cosmos_groups(y, m, 47, alpha, g, frac, rng(4))
    r = rng(4)
    pre2, _ = _cosmos_group_split(y, m, 47, alpha, g, r)
    final = _redistribute(pre2, frac, r)
    assert all(np.array_equal(a, b) for a, b in zip(parts, final))
    assert np.array_equal(group_of, group_pub)
    assert np.bincount(group_of).tolist() == [5, 5, 5, 4, 4]  # uneven: earlier groups get one more
    # before redistribution every client holds only its group's classes
    cls = group_classes(47, g)
    assert_disjoint_cover(pre, y.size)
    for i, p in enumerate(pre):
        assert set(np.unique(y[p])) <= set(cls[group_of[i]].tolist())
    # after: everything assigned once; each client gave round(10%) and received an even share of the pool
    assert_disjoint_cover(parts, y.size)
    given = np.array([int(round(frac * p.size)) for p in pre])
    pool = given.sum()
    for i, (p, f) in enumerate(zip(pre, parts)):
        left = np.setdiff1d(p, f).size
        assert left <= given[i]
        received = f.size - (p.size - given[i])
        assert received in (pool // m, pool // m + 1)
        assert 0.05 < received / f.size < 0.2  # ≈ 10 % of every client's samples come from the pool
    # the pool brings classes from other groups
    outside = [np.isin(y[f], cls[group_of[i]], invert=True).sum() for i, f in enumerate(parts)]
    assert sum(outside) > 0.5 * pool * (1 - 1 / g)
    with pytest.raises(DataError, match="groups"):
        partition_cosmos_groups(y, 3, 47, alpha, 5, frac, rng())


@pytest.mark.parametrize("name", ["iid", "pathological", "dirichlet", "cosmos"])
def test_partitioners_deterministic(name):
    y = balanced_labels(10, 200)

    def run(seed):
        if name == "iid":
            return partition_iid(y, 10, rng(seed))
        if name == "pathological":
            return partition_pathological(y, 10, 10, 2, rng(seed))
        if name == "dirichlet":
            return partition_dirichlet(y, 10, 10, 0.5, 10, rng(seed))
        return partition_cosmos_groups(y, 10, 10, 1.0, 5, 0.1, rng(seed))[0]

    a, b, c = run(1), run(1), run(2)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


# --------------------------------------------------------------------------------------- federation
def _check_federation(fed, n_total: int) -> None:
    tr = np.concatenate(fed.train_indices)
    te = np.concatenate(fed.test_indices)
    pub = fed.public_indices if fed.public_indices is not None else np.zeros(0, np.int64)
    everything = np.concatenate([tr, te, pub])
    assert np.unique(everything).size == everything.size, "train / test / U disjoint"
    for i in range(fed.num_clients):
        cd = fed.client(i)
        assert cd.train_x.shape[1:] == fed.input_shape and cd.train_x.dtype == torch.float32
        assert cd.train_y.dtype == torch.int64 and cd.train_y.shape[0] >= 1
        assert float(cd.train_x.min()) >= -1.0 and float(cd.train_x.max()) <= 1.0
        assert np.bincount(cd.train_y.numpy(), minlength=fed.num_classes).tolist() == fed.train_counts[i].tolist()
        assert np.bincount(cd.test_y.numpy(), minlength=fed.num_classes).tolist() == fed.test_counts[i].tolist()
    assert fed.train_counts.shape == (fed.num_clients, fed.num_classes) and fed.train_counts.dtype == np.int64
    assert everything.size <= n_total


def test_federation_mnist5k_pathological_paper_setting():
    t0 = time.perf_counter()
    fed = build_federation(spec())
    assert time.perf_counter() - t0 < 5.0  # ~0.2 s here
    assert fed.num_clients == 20 and fed.num_classes == 10 and fed.input_shape == (1, 28, 28)
    assert fed.public_x is None and fed.public_y is None and fed.fingerprint == "" and fed.groups is None
    _check_federation(fed, 5000)
    assert fed.train_counts.sum() + fed.test_counts.sum() == 5000
    assert abs(fed.test_counts.sum() / 5000 - 0.25) < 0.01
    # per-client test split follows the client's own classes
    for i in range(20):
        assert set(np.flatnonzero(fed.test_counts[i])) <= set(np.flatnonzero(fed.train_counts[i]))
        assert np.count_nonzero(fed.train_counts[i]) == 2
    rows = fed.stats_rows()
    assert len(rows) == 40 and rows[0]["client"] == 0 and rows[0]["split"] == "train"
    assert rows[0]["total"] == sum(rows[0][f"class_{k}"] for k in range(10))
    with pytest.raises(DataError, match="out of range"):
        fed.client(20)


def test_federation_public_set_and_fingerprint():
    s = spec(partition="cosmos-groups", num_clients=25, alpha=5.0, public_fraction=0.2)
    fed = build_federation(s)
    _check_federation(fed, 5000)
    assert fed.public_x.shape == (1000, 1, 28, 28)
    assert np.bincount(fed.public_y.numpy()).tolist() == [100] * 10, "U stratified per class"
    assert fed.train_counts.sum() + fed.test_counts.sum() == 4000, "U excluded from clients"
    assert len(fed.fingerprint) == 16 and int(fed.fingerprint, 16) >= 0
    assert fed.groups.tolist() == [g for g in range(5) for _ in range(5)]
    again = build_federation(s)
    assert again.fingerprint == fed.fingerprint
    assert torch.equal(again.client(3).train_x, fed.client(3).train_x)
    other = build_federation(spec(partition="cosmos-groups", num_clients=25, alpha=5.0, public_fraction=0.2, seed=2))
    assert other.fingerprint != fed.fingerprint
    assert not np.array_equal(other.train_counts, fed.train_counts)
    rows = fed.stats_rows()
    assert rows[0]["group"] == 0 and rows[-1]["group"] == 4


def test_federation_digits_and_synthetic():
    fed = build_federation(
        spec(source="digits", partition="dirichlet", num_clients=10, alpha=0.5, min_samples=20, public_fraction=0.1)
    )
    _check_federation(fed, 1797)
    assert fed.input_shape == (1, 8, 8) and fed.public_x.shape[0] == round(0.1 * 1797)
    assert fed.train_counts.sum() + fed.test_counts.sum() + fed.public_x.shape[0] == 1797
    syn = build_federation(
        spec(
            source="synthetic",
            partition="iid",
            num_clients=4,
            synthetic_classes=3,
            synthetic_shape=[3, 16, 16],
            synthetic_samples=300,
        )
    )
    _check_federation(syn, 300)
    assert syn.input_shape == (3, 16, 16) and syn.num_classes == 3
    assert syn.client(0).train_x.shape[1:] == (3, 16, 16)


def test_get_federation_caches_per_spec():
    clear_federation_cache()
    s = spec(source="digits", partition="iid", num_clients=5)
    a = get_federation(s)
    assert get_federation(dict(reversed(list(s.items())))) is a  # key order does not matter
    assert get_federation(spec(source="digits", partition="iid", num_clients=6)) is not a
    clear_federation_cache()


def test_spec_validation_errors():
    with pytest.raises(DataError, match=r"data\.partition='patho'.*iid, pathological, dirichlet, cosmos-groups"):
        build_federation(spec(partition="patho"))
    with pytest.raises(DataError, match=r"classes_per_client=11.*10 classes"):
        build_federation(spec(classes_per_client=11))
    with pytest.raises(DataError, match="missing keys: alpha"):
        s = spec()
        del s["alpha"]
        build_federation(s)
    with pytest.raises(DataError, match="unknown keys: batch_size"):
        build_federation(spec(batch_size=32))
    with pytest.raises(DataError, match="source"):
        build_federation(spec(source="svhn"))
    with pytest.raises(DataError, match="num_clients"):
        build_federation(spec(num_clients=0))
    with pytest.raises(DataError, match="test_fraction"):
        build_federation(spec(test_fraction=1.0))
    with pytest.raises(DataError, match="download"):
        build_federation(spec(download="yes"))
    with pytest.raises(DataError, match="groups"):
        build_federation(spec(partition="cosmos-groups", groups=11))
    with pytest.raises(DataError, match="synthetic_shape"):
        build_federation(spec(synthetic_shape=[3, 32]))
