"""Experiment tracking (config key ``tracking``): a small in-process run writes TensorBoard events and an MLflow
file store whose values, read back with each tool's own reader, equal rounds.csv's; an interrupted run is marked
FAILED and its resumption continues the same MLflow run; the config refuses unknown trackers and names the
extra to install when a tracker's package is missing."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml

from fedapps.checkpoint import config_differences
from fedapps.config import TRACKERS, ConfigError, config_from_dict, config_hash, dump_yaml, load_config
from fedapps.reporting import tracking

NEEDS = 'pip install -e ".[tracking]" (the test extra includes it)'


def needs(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed: {NEEDS}")


def run(config: Path, out: Path, after_round=None, resume_dir: str = "") -> Path:
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    server_app.run_experiment(
        InProcessGrid(3), str(config), "", str(out), resume_dir=resume_dir, after_round=after_round
    )
    return next(p for p in out.iterdir() if p.is_dir() and (p / "config.yaml").is_file())


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "rounds.csv").open() as fh:
        return list(csv.DictReader(fh))


def series(rows: list[dict[str, str]], column: str) -> list[tuple[int, float]]:
    """(round, value) of a rounds.csv column over the rounds that have a number in it."""
    return [(int(r["round"]), float(r[column])) for r in rows if r.get(column, "") != ""]


TEXT_EXTRAS = ("cluster_sizes",)  # CFL's cluster sizes, 'n1 n2 ...': text even when one cluster makes it '3'


def numeric_columns(rows: list[dict[str, str]]) -> list[str]:
    out = []
    for column in (c for c in rows[0] if c not in TEXT_EXTRAS):
        cells = [r[column] for r in rows if r[column] != ""]
        try:
            [float(c) for c in cells]
        except ValueError:
            continue  # a text column (a strategy's string extra)
        if column != "round" and cells:
            out.append(column)
    return out


def same_series(logged: list[tuple[int, float]], expected: list[tuple[int, float]], rel: float) -> bool:
    """Same rounds, values equal within ``rel`` (TensorBoard stores float32)."""
    return [s for s, _ in logged] == [s for s, _ in expected] and [v for _, v in logged] == pytest.approx(
        [v for _, v in expected], rel=rel
    )


def tb_events(log_dir: Path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    return acc


def mlflow_client(store: Path):
    needs("mlflow")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.as_uri())


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# --------------------------------------------------------------------------- a tracked run, read back


@pytest.mark.heavy
def test_tensorboard_and_mlflow_hold_what_rounds_csv_holds(tiny_config, tmp_path):
    needs("tensorboard")
    needs("mlflow")
    # CFL: a strategy with a numeric extra ('clusters') and a text one ('cluster_sizes') in rounds.csv
    config = tiny_config(
        tracking=["tensorboard", "mlflow"],
        strategy={"name": "cfl"},
        data={"source": "digits", "partition": "iid", "num_clients": 3},
    )
    run_dir = run(config, tmp_path / "out")
    rows = csv_rows(run_dir)
    columns = numeric_columns(rows)
    assert [r["round"] for r in rows] == ["1", "2"]
    for wanted in (
        "acc_mean",
        "acc_weighted",
        "loss",
        "acc_after_training_mean",
        "bytes_up",
        "bytes_down",
        "clusters",
        "acc_client_0",
        "acc_client_2",
    ):
        assert wanted in columns

    # TensorBoard: every numeric column a scalar of the same name (per-client accuracies as a histogram instead)
    events = tb_events(run_dir / "tensorboard")
    scalars = set(events.Tags()["scalars"])
    plain = [c for c in columns if not c.startswith("acc_client_")]
    assert scalars == set(plain)
    for column in plain:
        assert same_series([(e.step, e.value) for e in events.Scalars(column)], series(rows, column), 1e-6), column
    histograms = events.Histograms(tracking.HISTOGRAM)
    assert [h.step for h in histograms] == [1, 2]
    for h, row in zip(histograms, rows):
        accs = [float(row[f"acc_client_{i}"]) for i in range(3)]
        value = h.histogram_value
        assert value.num == 3
        assert (value.min, value.max, value.sum) == pytest.approx((min(accs), max(accs), sum(accs)))

    # MLflow: one run named after the folder, the config as params, every column per round, the folder as artefacts
    client = mlflow_client(run_dir / "mlruns")
    experiment = client.get_experiment_by_name(tracking.EXPERIMENT)
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == run_dir.name and found.info.status == "FINISHED"
    params = found.data.params
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert params == tracking.flatten_config(resolved)
    assert params["strategy.name"] == "cfl" and params["data.num_clients"] == "3" and params["client.lr"] == "0.05"
    assert params["tracking"] == '["tensorboard", "mlflow"]'
    for column in columns:
        assert same_series(history(client, found.info.run_id, column), series(rows, column), 1e-12), column
    assert "cluster_sizes" not in found.data.metrics  # text, not a metric
    summary = yaml.safe_load((run_dir / "summary.json").read_text())
    assert found.data.metrics["summary.accuracy_mean"] == pytest.approx(summary["accuracy_mean"])
    logged = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"summary.json", "rounds.csv", "config.yaml", "partition.csv", "accuracy.png"} <= logged
    assert not logged & {"checkpoint.pt", "client-state", "mlruns", "tensorboard"}
    assert found.data.tags[tracking.RUN_DIR_TAG] == str(run_dir)


def test_interrupted_run_is_failed_and_its_resumption_continues_the_mlflow_run(tiny_config, tmp_path):
    """tracking_dir shared by the runs of an output folder (relative: against it); a run stopped after round 1
    is FAILED in MLflow; resumed, the same MLflow run ends FINISHED holding both rounds, TensorBoard too."""
    needs("tensorboard")
    needs("mlflow")
    config = tiny_config(
        tracking=["tensorboard", "mlflow"],
        tracking_dir="tracking",
        data={"source": "digits", "partition": "iid", "num_clients": 3},
    )
    out = tmp_path / "out"

    class Stopped(RuntimeError):
        pass

    def stop(round_: int) -> None:
        raise Stopped(f"stopped after round {round_}")

    with pytest.raises(Stopped):
        run(config, out, after_round=stop)
    run_dir = out / "fedavg-digits-iid-s0"
    store = out / "tracking" / "mlruns"
    client = mlflow_client(store)
    experiment = client.get_experiment_by_name(tracking.EXPERIMENT)
    (stopped,) = client.search_runs([experiment.experiment_id])
    assert stopped.info.status == "FAILED"
    assert "stopped after round 1" in stopped.data.tags["fedapps.failure"]

    run(config, out, resume_dir=str(run_dir))
    (resumed,) = client.search_runs([experiment.experiment_id])
    assert resumed.info.run_id == stopped.info.run_id and resumed.info.status == "FINISHED"
    rows = csv_rows(run_dir)
    events = tb_events(out / "tracking" / "tensorboard" / run_dir.name)
    for column in ("acc_mean", "train_loss", "bytes_up"):
        expected = series(rows, column)
        assert [s for s, _ in expected] == [1, 2]
        assert same_series(history(client, resumed.info.run_id, column), expected, 1e-12), column
        assert same_series([(e.step, e.value) for e in events.Scalars(column)], expected, 1e-6), column
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "mlruns").exists()

    # a new (not resumed) run of the same name, the old folder moved aside (a used one is refused): its own MLflow
    # run, and the old TensorBoard curves are gone
    run_dir.rename(out / "moved-aside")
    run(config, out)
    assert len(client.search_runs([experiment.experiment_id])) == 2
    assert len(list((out / "tracking" / "tensorboard" / run_dir.name).glob("events.out.tfevents.*"))) == 1


# --------------------------------------------------------------------------- config


def test_tracking_key_is_validated():
    assert config_from_dict({}).tracking == []
    with pytest.raises(ConfigError, match=r"'tracking' is 'wandb'.*allowed: tensorboard, mlflow"):
        config_from_dict({"tracking": ["wandb"]})
    with pytest.raises(ConfigError, match="'tracking' lists a tracker twice"):
        config_from_dict({"tracking": ["tensorboard", "tensorboard"]})
    with pytest.raises(ConfigError, match="'tracking' must be a list of tracker names"):
        config_from_dict({"tracking": [{"mlflow": True}]})
    with pytest.raises(ConfigError, match="'tracking' must be a list"):
        config_from_dict({"tracking": 3})
    assert set(TRACKERS) == set(tracking.SINKS)


@pytest.mark.parametrize("tracker", sorted(TRACKERS))
def test_a_missing_package_names_the_key_and_the_extra(tracker, monkeypatch):
    monkeypatch.setitem(sys.modules, TRACKERS[tracker], None)  # import machinery: "not installed"
    with pytest.raises(ConfigError) as err:
        config_from_dict({"tracking": "tensorboard, mlflow"})  # a string is split into the list (as an override is)
    text = str(err.value)
    assert "'tracking' lists" in text and "not installed" in text and f"'{tracker}'" in text
    assert 'pip install -e ".[tracking]"' in text


def test_tracking_keys_change_neither_the_hash_nor_a_resumption(tmp_path):
    plain = config_from_dict({"rounds": 3})
    tracked = config_from_dict({"rounds": 3, "tracking": [], "tracking_dir": "/elsewhere"})
    tracked.tracking = ["tensorboard"]  # (not validated here: whether the package is installed does not matter)
    assert config_hash(plain) == config_hash(tracked)
    assert config_differences(dump_yaml(plain), dump_yaml(tracked)) == []
    assert config_hash(plain) != config_hash(config_from_dict({"rounds": 4}))


def test_default_config_tracks_nothing():
    assert load_config("configs/default.yaml").tracking == []


# --------------------------------------------------------------------------- the pure helpers


def test_flatten_config():
    flat = tracking.flatten_config(
        {"a": 1, "b": {"c": 0.5, "d": {"e": "x"}, "f": {}}, "g": [3, 32], "h": True, "i": None, "j": ""}
    )
    assert flat == {
        "a": "1",
        "b.c": "0.5",
        "b.d.e": "x",
        "b.f": "{}",
        "g": "[3, 32]",
        "h": "true",
        "i": "null",
        "j": "",
    }


def test_numeric_columns_and_client_accuracies():
    row = {
        "round": 3,
        "acc_mean": 0.5,
        "loss": "",
        "skipped": 0,
        "cluster_sizes": "2 1",
        "flag": True,
        "acc_client_10": 0.1,
        "acc_client_2": 0.2,
        "acc_client_x": 0.3,
    }
    values = tracking.numeric_columns(row)
    assert values == {"acc_mean": 0.5, "skipped": 0.0, "acc_client_10": 0.1, "acc_client_2": 0.2, "acc_client_x": 0.3}
    assert tracking.client_accuracies(values) == [0.2, 0.1]  # client order, not text order


def test_tracking_root(tmp_path):
    run_dir = tmp_path / "results" / "r1"
    assert tracking.tracking_root(config_from_dict({}), run_dir) == run_dir
    assert tracking.tracking_root(config_from_dict({"tracking_dir": "tb"}), run_dir) == tmp_path / "results" / "tb"
    assert (
        tracking.tracking_root(config_from_dict({"tracking_dir": str(tmp_path / "abs")}), run_dir) == tmp_path / "abs"
    )
