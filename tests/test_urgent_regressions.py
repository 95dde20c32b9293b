"""Regressions that ended with exit 0 and wrong or empty results: client sampling with Flower's 64-bit node ids,
and BatchNorm models (0-d ``num_batches_tracked``) in parameter exchange."""

import math

import numpy as np
import pytest

import server_app
from fedapps.wire import protocol
from fedapps.config import load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.sampling import sample_ids

BIG = 2**63 - 40  # Flower's node ids are uint64: a federation mixes ids below and above 2**63 (-> float64 in numpy)


def test_sample_ids_keeps_64_bit_ids_exact():
    ids = [BIG + 7 * i for i in range(200)]  # straddles 2**63
    picked = sample_ids(ids, 20, np.random.default_rng(0))
    assert len(picked) == 20 and len(set(picked)) == 20
    assert set(picked) <= set(ids)  # float64 would round BIG + 7i to a multiple of 2048: not an id
    assert picked == sorted(picked)


def test_sample_ids_is_seeded():
    ids = [BIG + i for i in range(50)]
    a = sample_ids(ids, 10, np.random.default_rng(3))
    b = sample_ids(ids, 10, np.random.default_rng(3))
    c = sample_ids(ids, 10, np.random.default_rng(4))
    assert a == b and a != c


def run(cfg_path, tmp_path, grid, overrides=""):
    cfg = load_config(cfg_path, overrides)
    summary = server_app.run_experiment(grid, str(cfg_path), overrides, str(tmp_path / "out"))
    return summary, tmp_path / "out" / cfg.resolved_run_name()


def test_partial_participation_reaches_every_sampled_node_with_large_ids(tiny_config, tmp_path):
    cfg = tiny_config(rounds=2, strategy={"name": "fedavg", "fraction": 0.25, "min_clients": 1},
                      data={"source": "digits", "partition": "iid", "num_clients": 12})
    grid = InProcessGrid(12, first_node_id=2**63 - 6, record=True)  # ids on both sides of 2**63
    summary, out = run(cfg, tmp_path, grid)
    k = math.ceil(0.25 * 12)
    for rnd in ("1", "2"):
        sent = [m for m in grid.sent if m.metadata.group_id == rnd]
        assert len(sent) == k
        destinations = [m.metadata.dst_node_id for m in sent]
        assert len(set(destinations)) == k and set(destinations) <= set(grid.contexts)
    from fedapps.reporting.results import read_csv
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [k, k]


def test_zero_dim_arrays_keep_their_shape():
    rec = protocol.arrays_record({"num_batches_tracked": np.array(5, dtype=np.int64),
                                  "w": np.arange(6, dtype=np.float32).reshape(2, 3).T})
    assert rec["num_batches_tracked"].numpy().shape == ()
    assert int(rec["num_batches_tracked"].numpy()) == 5
    np.testing.assert_array_equal(rec["w"].numpy(), np.arange(6, dtype=np.float32).reshape(2, 3).T)


# 8×8 images: what these regressions are about (BatchNorm buffers in the exchange, the server model's evaluation)
# does not depend on the input size, and 32×32 costs ~5× the time
SYNTH = {"source": "synthetic", "partition": "iid", "num_clients": 2, "synthetic_samples": 120,
         "synthetic_classes": 4, "synthetic_shape": [3, 8, 8]}


@pytest.mark.parametrize("strategy", ["fedavg", "fedper"])
def test_batchnorm_model_exchanges_parameters(strategy, tiny_config, tmp_path):
    cfg = tiny_config(rounds=2, strategy={"name": strategy}, data=SYNTH, model={"name": "resnet18"},
                      client={"epochs": 1, "batch_size": 16, "lr": 0.01})
    grid = InProcessGrid(2, record=True)
    summary, out = run(cfg, tmp_path, grid)
    from fedapps.reporting.results import read_csv
    rows = read_csv(out / "rounds.csv")
    assert [r["clients"] for r in rows] == [2, 2]
    assert all(not m.has_error() for m in grid.replies)
    assert isinstance(summary["accuracy_mean"], float)


def test_cosmos_vgg16_cluster_model_is_evaluated(tiny_config, tmp_path):
    """The paper's VGG16 (BatchNorm) server model travels to the clients for evaluation: its accuracy is a number."""
    data = {**SYNTH, "num_clients": 2, "public_fraction": 0.2, "synthetic_samples": 100}
    params = {"server_model": "vgg16", "pretrain_epochs": 1, "server_epochs": 1, "distill_epochs": 1}
    cfg = tiny_config(rounds=1, strategy={"name": "cosmos", "params": {"cosmos": params}}, data=data, model={"name": "cnn"},
                      client={"epochs": 1, "batch_size": 16, "lr": 0.001, "optimizer": "adam"})
    grid = InProcessGrid(2, record=True)
    summary, _ = run(cfg, tmp_path, grid)
    assert all(not m.has_error() for m in grid.replies)
    assert isinstance(summary["cluster_model_accuracy"], float)
    assert isinstance(summary["accuracy_mean"], float)
