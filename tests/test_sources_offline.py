"""The torchvision sources and the Tiny ImageNet folder, loaded offline from tiny files this test writes in their
real on-disk formats (MNIST-family idx files, EMNIST's split files, CIFAR's pickled batches, Tiny ImageNet's
extracted folder), so the paper configs' loading path is known to work before anyone downloads the real sets.

Two things differ from the real files, and only these: the files are small, and torchvision's md5 check (CIFAR's
batches, every downloaded archive) is made to accept them where a test says so (``accept_any_md5``): a real
file passes that check, a tiny one cannot. The network is blocked in every test (``no_network``): a load that
tried to download would fail.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedapps.config import load_config
from fedapps.data import DataError, build_federation, load_source, source_info

N_TRAIN, N_TEST = 20, 10
PAPER = Path(__file__).resolve().parent.parent / "configs" / "paper"


# ------------------------------------------------------------------------------------------------ helpers
def idx_bytes(array: np.ndarray) -> bytes:
    """An unsigned-byte array in the idx format of MNIST's files: magic 0x0000 0x08 ndim, big-endian sizes, data."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def normalised(images: np.ndarray) -> torch.Tensor:
    """What the loaders promise: uint8 v -> (v/255 − 0.5)/0.5, computed here independently in float64."""
    return torch.from_numpy((images.astype(np.float64) / 255.0 - 0.5) / 0.5)


def assert_images(x: torch.Tensor, expected_nchw: np.ndarray) -> None:
    assert x.dtype == torch.float32 and tuple(x.shape) == expected_nchw.shape
    assert torch.allclose(x.double(), normalised(expected_nchw), atol=1e-6, rtol=0)


def grey_images(r: np.random.Generator, n: int) -> np.ndarray:
    """n random 28×28 uint8 images; image 0 holds a black and a white pixel, so the [-1, 1] ends are checked."""
    a = r.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    a[0, 0, 0], a[0, 0, 1] = 0, 255
    return a


class Split:
    """Images (as torchvision stores them) and labels of one split."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels


def mnist_like(r: np.random.Generator, classes: int) -> tuple[Split, Split]:
    return (
        Split(grey_images(r, N_TRAIN), r.integers(0, classes, N_TRAIN)),
        Split(grey_images(r, N_TEST), r.integers(0, classes, N_TEST)),
    )


MNIST_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def write_mnist(
    raw: Path, train: Split, test: Split, names: dict[str, tuple[str, str]] = MNIST_NAMES, gz: bool = False
) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for split, data in (("train", train), ("test", test)):
        for name, array in zip(names[split], (data.images, data.labels)):
            payload = idx_bytes(array)
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(payload))
            else:
                (raw / name).write_bytes(payload)


EMNIST_NAMES = {
    s: (f"emnist-balanced-{s}-images-idx3-ubyte", f"emnist-balanced-{s}-labels-idx1-ubyte") for s in ("train", "test")
}


def cifar_split(r: np.random.Generator, n: int, classes: int) -> Split:
    """n random 3×32×32 images (stored by CIFAR as rows of 3072 bytes: all red, then green, then blue)."""
    return Split(r.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), r.integers(0, classes, n))


def pickled(obj: dict) -> bytes:
    return pickle.dumps(obj, protocol=2)


def cifar10_files(train: Split, test: Split) -> dict[str, bytes]:
    """cifar-10-batches-py/: data_batch_1..5 (the train images in five equal batches), test_batch, batches.meta."""
    files = {}
    for b, rows in enumerate(np.array_split(np.arange(N_TRAIN), 5), start=1):
        files[f"data_batch_{b}"] = pickled(
            {
                "batch_label": f"training batch {b} of 5",
                "data": train.images[rows].reshape(len(rows), -1),
                "labels": train.labels[rows].tolist(),
            }
        )
    files["test_batch"] = pickled(
        {"batch_label": "testing batch 1 of 1", "data": test.images.reshape(N_TEST, -1), "labels": test.labels.tolist()}
    )
    files["batches.meta"] = pickled({"label_names": [f"class{k}" for k in range(10)], "num_vis": 3072})
    return files


def cifar100_files(train: Split, test: Split, coarse: tuple[np.ndarray, np.ndarray]) -> dict[str, bytes]:
    """cifar-100-python/: train, test (fine_labels and coarse_labels), meta."""
    out = {}
    for name, data, c in (("train", train, coarse[0]), ("test", test, coarse[1])):
        out[name] = pickled(
            {
                "data": data.images.reshape(len(data.labels), -1),
                "fine_labels": data.labels.tolist(),
                "coarse_labels": c.tolist(),
            }
        )
    out["meta"] = pickled(
        {"fine_label_names": [f"f{k}" for k in range(100)], "coarse_label_names": [f"c{k}" for k in range(20)]}
    )
    return out


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def write_targz(path: Path, folder: str, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every way torchvision reaches the network fails the test."""
    import torchvision.datasets.utils as tvu

    def refuse(*args, **kwargs):
        raise AssertionError("this test must not use the network")

    monkeypatch.setattr(tvu, "_urlretrieve", refuse)
    monkeypatch.setattr(tvu, "_get_redirect_url", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.fixture
def accept_any_md5(monkeypatch):
    """torchvision's md5 check passes for every file (the only change to the real loading path; see the docstring)."""
    import torchvision.datasets.utils as tvu

    monkeypatch.setattr(tvu, "check_md5", lambda *args, **kwargs: True)


# ------------------------------------------------------------------------------------- MNIST family, EMNIST
@pytest.mark.parametrize("source, folder", [("mnist", "MNIST"), ("fmnist", "FashionMNIST")])
def test_mnist_family_idx_files(tmp_path, source, folder):
    train, test = mnist_like(np.random.default_rng(1), 10)
    write_mnist(tmp_path / folder / "raw", train, test)
    ds = load_source(source, tmp_path, download=False)
    assert_images(ds.x, np.concatenate([train.images, test.images])[:, None])  # train first, then test
    assert ds.y.dtype == torch.int64
    assert ds.y.tolist() == np.concatenate([train.labels, test.labels]).tolist()
    assert (ds.num_classes, ds.input_shape) == source_info(source) == (10, (1, 28, 28))
    assert float(ds.x[0, 0, 0, 0]) == -1.0 and float(ds.x[0, 0, 0, 1]) == 1.0


def test_mnist_gz_archives_are_extracted_without_network(tmp_path, accept_any_md5):
    """The offline route of docs/data.md: the original .gz files in MNIST/raw with data.download: true are only checked
    and extracted."""
    train, test = mnist_like(np.random.default_rng(2), 10)
    write_mnist(tmp_path / "MNIST" / "raw", train, test, gz=True)
    with pytest.raises(DataError, match="train-images-idx3-ubyte"):  # without download the .gz are not read
        load_source("mnist", tmp_path, download=False)
    ds = load_source("mnist", tmp_path, download=True)
    assert_images(ds.x, np.concatenate([train.images, test.images])[:, None])
    assert ds.y.tolist() == np.concatenate([train.labels, test.labels]).tolist()


def test_emnist_balanced_split_files_are_read_upright(tmp_path):
    train, test = mnist_like(np.random.default_rng(3), 47)
    train.labels[0], test.labels[0] = 46, 0  # both ends of EMNIST-balanced's 47 classes
    write_mnist(tmp_path / "EMNIST" / "raw", train, test, names=EMNIST_NAMES)
    ds = load_source("emnist-balanced", tmp_path, download=False)
    stored = np.concatenate([train.images, test.images])
    assert_images(ds.x, stored.transpose(0, 2, 1)[:, None])  # EMNIST's files hold every image transposed
    assert ds.y.tolist() == np.concatenate([train.labels, test.labels]).tolist()
    assert (ds.num_classes, ds.input_shape) == (47, (1, 28, 28))


def test_emnist_zip_archive_is_extracted_without_network(tmp_path, accept_any_md5):
    train, test = mnist_like(np.random.default_rng(4), 47)
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    with zipfile.ZipFile(raw / "gzip.zip", "w") as z:  # NIST's archive: gzip/<split files>.gz
        for split, data in (("train", train), ("test", test)):
            for name, array in zip(EMNIST_NAMES[split], (data.images, data.labels)):
                z.writestr(f"gzip/{name}.gz", gzip.compress(idx_bytes(array)))
    ds = load_source("emnist-balanced", tmp_path, download=True)
    assert ds.y.tolist() == np.concatenate([train.labels, test.labels]).tolist()
    assert_images(ds.x, np.concatenate([train.images, test.images]).transpose(0, 2, 1)[:, None])


# ------------------------------------------------------------------------------------------------ CIFAR
def test_cifar10_pickled_batches(tmp_path, accept_any_md5):
    r = np.random.default_rng(5)
    train, test = cifar_split(r, N_TRAIN, 10), cifar_split(r, N_TEST, 10)
    write_files(tmp_path / "cifar-10-batches-py", cifar10_files(train, test))
    ds = load_source("cifar10", tmp_path, download=False)
    assert_images(ds.x, np.concatenate([train.images, test.images]))  # channels as stored: R, G, B planes
    assert ds.y.tolist() == np.concatenate([train.labels, test.labels]).tolist()
    assert (ds.num_classes, ds.input_shape) == (10, (3, 32, 32))


def test_cifar10_batches_need_their_checksums(tmp_path):
    """Without the md5 relaxation the tiny batches are refused, with the message naming the folder and files."""
    r = np.random.default_rng(5)
    write_files(
        tmp_path / "cifar-10-batches-py", cifar10_files(cifar_split(r, N_TRAIN, 10), cifar_split(r, N_TEST, 10))
    )
    with pytest.raises(DataError, match="cifar-10-batches-py.*data_batch_1..data_batch_5, test_batch, batches.meta"):
        load_source("cifar10", tmp_path, download=False)


def test_cifar10_archive_is_extracted_without_network(tmp_path, accept_any_md5):
    r = np.random.default_rng(6)
    train, test = cifar_split(r, N_TRAIN, 10), cifar_split(r, N_TEST, 10)
    write_targz(tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py", cifar10_files(train, test))
    ds = load_source("cifar10", tmp_path, download=True)
    assert (tmp_path / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert_images(ds.x, np.concatenate([train.images, test.images]))
    assert ds.y.tolist() == np.concatenate([train.labels, test.labels]).tolist()


def test_cifar100_uses_the_fine_labels(tmp_path, accept_any_md5):
    r = np.random.default_rng(7)
    train, test = cifar_split(r, N_TRAIN, 100), cifar_split(r, N_TEST, 100)
    train.labels[0] = 99
    coarse = (train.labels // 5, test.labels // 5)  # CIFAR-100's 20 superclasses: another label array
    write_files(tmp_path / "cifar-100-python", cifar100_files(train, test, coarse))
    ds = load_source("cifar100", tmp_path, download=False)
    assert_images(ds.x, np.concatenate([train.images, test.images]))
    assert ds.y.tolist() == np.concatenate([train.labels, test.labels]).tolist()
    assert (ds.num_classes, ds.input_shape) == (100, (3, 32, 32))


# ---------------------------------------------------------------------------------------------- Tiny ImageNet
def colour(k: int) -> tuple[int, int, int]:
    """A distinct flat colour per class (JPEG keeps a flat colour within a few levels)."""
    return (k, 255 - k, (37 * k) % 256)


def write_tinyimagenet(root: Path, wnids: list[str], val: list[tuple[str, int, str]]) -> None:
    """The extracted tiny-imagenet-200/ folder: wnids.txt, words.txt, train/<wnid>/images/<wnid>_0.JPEG (one flat
    64×64 image per class) with <wnid>_boxes.txt, val/images + val_annotations.txt, an unlabelled test/images."""
    from PIL import Image

    base = root / "tiny-imagenet-200"
    base.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")  # the real file lists them unsorted
    (base / "words.txt").write_text("".join(f"{w}\tthing {w}\n" for w in wnids))
    for w in wnids:
        folder = base / "train" / w / "images"
        folder.mkdir(parents=True)
        Image.new("RGB", (64, 64), colour(sorted(wnids).index(w))).save(folder / f"{w}_0.JPEG")
        (base / "train" / w / f"{w}_boxes.txt").write_text(f"{w}_0.JPEG\t0\t0\t63\t63\n")
    (base / "val" / "images").mkdir(parents=True)
    lines = []
    for name, k, mode in val:
        img = Image.new("RGB", (64, 64), colour(k))
        (img.convert("L") if mode == "L" else img).save(base / "val" / "images" / name)
        lines.append(f"{name}\t{sorted(wnids)[k]}\t0\t0\t63\t63\n")
    (base / "val" / "val_annotations.txt").write_text("".join(lines))
    (base / "test" / "images").mkdir(parents=True)
    Image.new("RGB", (64, 64), (0, 0, 0)).save(base / "test" / "images" / "test_0.JPEG")


def test_tinyimagenet_extracted_folder(tmp_path):
    r = np.random.default_rng(8)
    wnids = [f"n{v:08d}" for v in r.choice(10**8, 200, replace=False)]  # creation order is not sorted order
    val = [("val_0.JPEG", 7, "RGB"), ("val_1.JPEG", 199, "RGB"), ("val_2.JPEG", 0, "L")]
    write_tinyimagenet(tmp_path, wnids, val)
    ds = load_source("tinyimagenet", tmp_path)
    assert ds.x.shape == (203, 3, 64, 64) and ds.x.dtype == torch.float32  # the test/ images are unlabelled: unused
    assert (ds.num_classes, ds.input_shape) == source_info("tinyimagenet") == (200, (3, 64, 64))
    assert ds.y.tolist() == list(range(200)) + [7, 199, 0]  # class k = k-th wnid in sorted order
    means = ds.x.mean(dim=(2, 3)).double()
    for i in range(200):  # every train image carries its class's colour: labels and pixels stay paired
        assert torch.allclose(means[i], normalised(np.array(colour(i))), atol=0.03), i
    assert torch.allclose(means[201], normalised(np.array(colour(199))), atol=0.03)
    grey = means[202]  # a greyscale val file is read as RGB with three equal channels
    assert float(grey.max() - grey.min()) < 1e-6


def test_tinyimagenet_needs_all_200_class_folders(tmp_path):
    wnids = [f"n{k:08d}" for k in range(200)]
    write_tinyimagenet(tmp_path, wnids, [("val_0.JPEG", 3, "RGB")])
    import shutil

    shutil.rmtree(tmp_path / "tiny-imagenet-200" / "train" / wnids[5])
    with pytest.raises(DataError, match="199 class folders, expected 200"):
        load_source("tinyimagenet", tmp_path)


# ------------------------------------------------------------------------------------------ the paper configs
@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory) -> Path:
    """A data root holding every source the paper configs read, each in its tiny real format."""
    root = tmp_path_factory.mktemp("data-root")
    r = np.random.default_rng(9)
    write_mnist(root / "MNIST" / "raw", *mnist_like(r, 10))
    write_mnist(root / "FashionMNIST" / "raw", *mnist_like(r, 10))
    write_mnist(root / "EMNIST" / "raw", *mnist_like(r, 47), names=EMNIST_NAMES)
    write_files(root / "cifar-10-batches-py", cifar10_files(cifar_split(r, N_TRAIN, 10), cifar_split(r, N_TEST, 10)))
    train, test = cifar_split(r, N_TRAIN, 100), cifar_split(r, N_TEST, 100)
    write_files(root / "cifar-100-python", cifar100_files(train, test, (train.labels // 5, test.labels // 5)))
    write_tinyimagenet(root, [f"n{k:08d}" for k in range(200)], [("val_0.JPEG", 1, "RGB")])
    return root


FILE_SOURCES = ("mnist", "fmnist", "emnist-balanced", "cifar10", "cifar100", "tinyimagenet")
PAPER_CONFIGS = sorted(p.name for p in PAPER.glob("*.yaml") if load_config(p).data.source in FILE_SOURCES)


def test_every_file_source_has_a_paper_config():
    sources = {load_config(PAPER / name).data.source for name in PAPER_CONFIGS}
    assert sources >= {"mnist", "emnist-balanced", "cifar10", "cifar100", "tinyimagenet"}


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_loads_its_source_offline(tiny_tree, accept_any_md5, name):
    """The paper config's own data section (source, download flag) with data.root pointed at the tiny tree."""
    cfg = load_config(PAPER / name, [f"data.root={tiny_tree}"])
    d = cfg.data
    ds = load_source(d.source, d.root, download=d.download)
    k, shape = source_info(d.source)
    assert (ds.num_classes, ds.input_shape) == (k, shape) and tuple(ds.x.shape[1:]) == shape
    expected = 201 if d.source == "tinyimagenet" else N_TRAIN + N_TEST  # Tiny ImageNet: 200 train + 1 val
    assert len(ds) == expected and float(ds.x.min()) >= -1.0 and float(ds.x.max()) <= 1.0


def test_paper_mnist_config_builds_its_federation_offline(tmp_path):
    """cwfedavg-mnist-pat (20 clients, 2 classes each) from idx files big enough for its partition."""
    r = np.random.default_rng(10)
    train = Split(r.integers(0, 256, (300, 28, 28), dtype=np.uint8), np.arange(300) % 10)
    test = Split(r.integers(0, 256, (100, 28, 28), dtype=np.uint8), np.arange(100) % 10)
    write_mnist(tmp_path / "MNIST" / "raw", train, test)
    cfg = load_config(PAPER / "cwfedavg-mnist-pat.yaml", [f"data.root={tmp_path}"])
    import dataclasses

    fed = build_federation(dataclasses.asdict(cfg.data))
    assert fed.num_clients == 20 and fed.input_shape == (1, 28, 28)
    assert int(fed.train_counts.sum() + fed.test_counts.sum()) == 400
    assert all(np.count_nonzero(fed.train_counts[i] + fed.test_counts[i]) == 2 for i in range(20))
