"""Memory that does not grow with the run: one shared sample tensor per federation (client splits and U are
views of it, in exactly the order the old per-client copies had), data built once per process, and an
in-process grid that keeps no message history unless asked to."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import server_app
from fedapps.config import DataConfig, load_config
from fedapps.data import DataError, build_federation, clear_federation_cache, federation, get_federation, load_source
from fedapps.flower.inprocess import InProcessGrid

torch.set_num_threads(1)


BASE_SPEC = dict(
    source="digits", root="/nonexistent-data-root", partition="iid", num_clients=5, alpha=0.5, min_samples=5, groups=2
)


def spec(**over) -> dict:
    """A complete data spec: DataConfig's defaults, this file's base, then ``over``."""
    return {**dataclasses.asdict(DataConfig()), **BASE_SPEC, **over}


SPECS = [
    spec(),
    spec(partition="dirichlet", evaluate_on="validation"),  # fit and validation splits, no test samples
    spec(partition="pathological", public_fraction=0.2),
    spec(partition="dirichlet", num_clients=8, alpha=0.3, public_fraction=0.1, seed=3),
    spec(partition="cosmos-groups", num_clients=6, alpha=5.0, public_fraction=0.15),
    spec(
        source="synthetic",
        num_clients=3,
        synthetic_classes=3,
        synthetic_shape=[2, 4, 4],
        synthetic_samples=90,
        test_fraction=0.5,
    ),
]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("s", SPECS, ids=lambda s: f"{s['source']}-{s['partition']}-pub{s['public_fraction']}")
def test_client_splits_and_public_set_are_views_of_one_tensor(s):
    fed = build_federation(s)
    x_ptr, y_ptr = _ptr(fed.x), _ptr(fed.y)
    views = [t for i in range(fed.num_clients) for t in vars(fed.client(i)).values()]
    if fed.public_x is not None:
        views += [fed.public_x, fed.public_y]
    for t in views:
        assert t._base is not None or t is fed.x or t is fed.y  # a view, not a tensor of its own
        assert _ptr(t) == (x_ptr if t.dtype == fed.x.dtype else y_ptr)
        assert t.is_contiguous()
    # the one store holds exactly the used samples: clients' train + test, then U, nothing twice
    used = int(fed.train_counts.sum() + fed.test_counts.sum()) + (0 if fed.public_x is None else len(fed.public_x))
    assert fed.x.shape[0] == fed.y.shape[0] == used
    assert fed.x.untyped_storage().nbytes() == fed.x.numel() * fed.x.element_size()


@pytest.mark.parametrize("s", SPECS, ids=lambda s: f"{s['source']}-{s['partition']}-pub{s['public_fraction']}")
def test_views_equal_the_fancy_indexed_copies_sample_for_sample(s):
    """Same values in the same order as source.x[indices] (what the clients held before): identical runs."""
    fed = build_federation(s)
    ds = load_source(
        s["source"],
        s["root"],
        download=s["download"],
        synthetic_classes=s["synthetic_classes"],
        synthetic_shape=s["synthetic_shape"],
        synthetic_samples=s["synthetic_samples"],
        seed=s["seed"],
    )
    for i in range(fed.num_clients):
        cd = fed.client(i)
        tr, te = torch.from_numpy(fed.train_indices[i]), torch.from_numpy(fed.test_indices[i])
        assert torch.equal(cd.train_x, ds.x[tr]) and torch.equal(cd.train_y, ds.y[tr])
        assert torch.equal(cd.test_x, ds.x[te]) and torch.equal(cd.test_y, ds.y[te])
        assert cd.test_x.shape[1:] == ds.x.shape[1:]
    if fed.public_indices is not None:
        pub = torch.from_numpy(fed.public_indices)
        assert torch.equal(fed.public_x, ds.x[pub]) and torch.equal(fed.public_y, ds.y[pub])
    else:
        assert fed.public_x is None and fed.public_y is None


def test_a_split_that_holds_out_no_test_samples_is_refused_naming_the_fraction():
    """No test split means no headline: refused before any view is built, with the fix (not a client count)."""
    with pytest.raises(
        DataError,
        match=r"data.test_fraction=0.0 holds out nothing to measure on; raise "
        r"data.test_fraction",
    ) as err:
        build_federation(spec(num_clients=4, test_fraction=0.0))
    assert "num_clients=" not in str(err.value).split(":", 1)[1]


def test_an_in_process_run_builds_its_data_once(tiny_config, tmp_path, monkeypatch):
    """Server, strategy and every simulated client ask get_federation for the same spec: one build per process."""
    calls = []
    real = federation.build_federation
    monkeypatch.setattr(federation, "build_federation", lambda s: calls.append(s) or real(s))
    clear_federation_cache()
    try:
        for name, data in (
            ("fedavg", {}),
            ("comet", {"partition": "cosmos-groups", "alpha": 5.0, "groups": 2, "public_fraction": 0.2}),
        ):
            calls.clear()
            params = {"comet": {"clusters": 2}} if name == "comet" else {}
            cfg = tiny_config(rounds=2, strategy={"name": name, "params": params}, data=data)
            server_app.run_experiment(
                InProcessGrid(load_config(cfg).data.num_clients), str(cfg), "", str(tmp_path / name)
            )
            assert len(calls) == 1, f"{name}: data built {len(calls)} times in one process"
    finally:
        clear_federation_cache()
    assert get_federation(spec()) is get_federation(dict(spec()))  # the cache key is the canonical spec


def test_in_process_grid_keeps_no_history_by_default(tiny_config, tmp_path):
    cfg = tiny_config(rounds=2)
    quiet, recording = InProcessGrid(4), InProcessGrid(4, record=True)
    for name, grid in (("quiet", quiet), ("recording", recording)):
        server_app.run_experiment(grid, str(cfg), "", str(tmp_path / name))
    assert quiet.sent == [] and quiet.replies == []
    assert len(recording.sent) >= 8 and len(recording.replies) == len(recording.sent)
