"""``data.source: folder:<path>``: a tiny image folder generated here (offline), one folder per class; with train/ and
test/ the test images stay the test split (never trained on, shared among the clients by their classes), the
validation split of tuning still comes from training data; a whole run on it prints nothing about downloads."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest

from conftest import write_config
from fedapps.config import DataConfig
from fedapps.data import DataError, build_federation, source_info
from fedapps.data.federation import allocate_test
from fedapps_tools import cli

CLASSES = ("cat", "dog", "owl")
TRAIN_PER_CLASS, TEST_PER_CLASS = 24, 6


def make_folder(root, split=True, rgb=False, size=(8, 8)):
    """CLASSES × images (PNG), class c drawn around grey level 50 + 70 c; train/ and test/ when ``split``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    parts = (("train", TRAIN_PER_CLASS), ("test", TEST_PER_CLASS)) if split else (("", TRAIN_PER_CLASS),)
    for part, n in parts:
        for c, name in enumerate(CLASSES):
            folder = root / part / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                shape = (*size[::-1], 3) if rgb else size[::-1]
                a = np.clip(rng.normal(50 + 70 * c, 15, shape), 0, 255).astype(np.uint8)
                Image.fromarray(a, "RGB" if rgb else "L").save(folder / f"{i:03d}.png")
    return root


def spec(source, **data):
    return dataclasses.asdict(DataConfig(source=source, **data))


def test_allocate_test_follows_each_clients_class_counts():
    labels = np.array([0] * 8 + [1] * 4 + [2] * 3 + [0] * 8 + [1] * 4 + [2] * 2)  # 15 train, then 14 test
    test = np.arange(15, 29)
    trains = [np.arange(0, 6), np.array([6, 7, 8, 9, 10, 11])]  # client 0: 6 of class 0; client 1: 2 of 0, 4 of 1
    a, b = allocate_test(test, labels, trains, np.random.default_rng(0))
    assert np.bincount(labels[a], minlength=3).tolist() == [6, 0, 0]  # 8 × 6/8
    assert np.bincount(labels[b], minlength=3).tolist() == [2, 4, 0]  # 8 × 2/8, all 4 of class 1; class 2: nobody's
    assert not set(a) & set(b) and set(a) | set(b) <= set(test)
    again = allocate_test(test, labels, trains, np.random.default_rng(0))
    assert [x.tolist() for x in again] == [a.tolist(), b.tolist()]


def test_train_and_test_folders_keep_the_test_split(tmp_path):
    make_folder(tmp_path / "pets")
    n_train = TRAIN_PER_CLASS * len(CLASSES)
    assert source_info("folder:pets", root=str(tmp_path)) == (3, (1, 8, 8))  # relative: under data.root
    fed = build_federation(
        spec("folder:pets", root=str(tmp_path), partition="pathological", classes_per_client=1, num_clients=3)
    )
    assert fed.num_classes == 3 and fed.input_shape == (1, 8, 8)
    for tr, te in zip(fed.train_indices, fed.test_indices):
        assert tr.max() < n_train <= te.min()  # trained on train/ only, measured on test/ only
    # every client holds one class and all its test images; nothing of test/ is trained on
    assert sorted(fed.train_counts.sum(axis=1).tolist()) == [TRAIN_PER_CLASS] * 3
    assert (fed.test_counts == (fed.train_counts > 0) * TEST_PER_CLASS).all()
    # tuning: validation carved from the training data, test/ not used at all
    val = build_federation(spec("folder:pets", root=str(tmp_path), num_clients=2, evaluate_on="validation"))
    for tr, ev in zip(val.train_indices, val.test_indices):
        assert tr.max() < n_train and ev.size and ev.max() < n_train and not set(tr) & set(ev)


def test_one_folder_per_class_is_split_like_every_source(tmp_path):
    make_folder(tmp_path / "flat", split=False, rgb=True, size=(6, 4))
    fed = build_federation(spec(f"folder:{tmp_path / 'flat'}", num_clients=2, test_fraction=0.25))
    assert fed.input_shape == (3, 4, 6)
    assert int(fed.train_counts.sum() + fed.test_counts.sum()) == TRAIN_PER_CLASS * 3
    assert int(fed.test_counts.sum()) == pytest.approx(0.25 * TRAIN_PER_CLASS * 3, abs=3)


def test_bad_folders_are_data_errors_naming_the_source(tmp_path):
    with pytest.raises(DataError, match="data.source='folder:nowhere'.* is not a folder"):
        build_federation(spec("folder:nowhere", root=str(tmp_path)))
    make_folder(tmp_path / "x")
    (tmp_path / "x" / "test" / "bat").mkdir()
    with pytest.raises(DataError, match="class folders that train/ lacks \\(bat\\)"):
        build_federation(spec(f"folder:{tmp_path / 'x'}", num_clients=2))
    make_folder(tmp_path / "sizes", split=False)
    make_folder(tmp_path / "sizes2", split=False, size=(9, 9))
    (tmp_path / "sizes2" / "cat" / "000.png").rename(tmp_path / "sizes" / "cat" / "zzz.png")
    with pytest.raises(DataError, match="images of one size"):
        build_federation(spec(f"folder:{tmp_path / 'sizes'}", num_clients=2))


def test_a_run_on_an_image_folder_is_offline_and_quiet_about_downloads(tmp_path, capfd):
    make_folder(tmp_path / "pets")
    cfg = write_config(
        tmp_path / "c.yaml",
        rounds=1,
        data={"source": "folder:pets", "root": str(tmp_path), "partition": "iid", "num_clients": 3},
    )
    out = tmp_path / "out"
    assert cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(out)]) == 0
    captured = capfd.readouterr()
    assert "download" not in (captured.out + captured.err).lower()
    (run,) = out.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["accuracy_mean"] is not None
    # partition.csv: the clients' test samples are test/'s, all of them (iid: every client holds every class)
    import csv

    with (run / "partition.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    total = {split: sum(int(r["total"]) for r in rows if r["split"] == split) for split in ("train", "test")}
    assert total == {"train": TRAIN_PER_CLASS * len(CLASSES), "test": TEST_PER_CLASS * len(CLASSES)}


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="the optional extra hf is not installed")
def test_the_hf_route_reads_an_image_folder_without_download_messages(tmp_path, capfd):
    make_folder(tmp_path / "pets")
    fed = build_federation(spec(f"hf:{tmp_path / 'pets'}", root=str(tmp_path / "cache"), num_clients=2))
    assert fed.num_classes == 3 and int(fed.train_counts.sum() + fed.test_counts.sum()) == 90  # merged, re-split
    captured = capfd.readouterr()
    assert "downloading" not in (captured.out + captured.err).lower()
