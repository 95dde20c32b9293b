"""Experiment-tracking sinks (opt-in, config key ``tracking``): TensorBoard event files and an MLflow file store.

They receive what :class:`fedapps.reporting.results.FileSink` receives and turn it into the same numbers, by the same
functions (:func:`fedapps.reporting.results.round_row` for a round's training phase,
:func:`fedapps.reporting.results.measured_columns` for the deployed models, filed under the round they measure), so
every value equals its rounds.csv cell:

- TensorBoard: one scalar per numeric rounds.csv column (tag = the column's name, step = the round), strategy
  extras included, and a histogram ``acc_client`` of the clients' deployed-model accuracies per round.
- MLflow: one MLflow run per fedapps run (named after the run folder), params = the resolved config flattened
  to dotted keys, one metric per numeric rounds.csv column (``acc_client_<i>`` included; step = the round), the
  numbers of summary.json as ``summary.<key>``, and the run folder as artefacts at the end.

Where: ``tracking_dir`` empty (the default): inside the run folder, ``<run>/tensorboard/`` and ``<run>/mlruns/``;
else ``<tracking_dir>/tensorboard/<run-name>/`` and one store ``<tracking_dir>/mlruns/`` shared by every run
written there (a relative ``tracking_dir`` resolves against the output folder, the run folder's parent).
The packages are optional (``pip install -e ".[tracking]"``) and imported only when a tracker is configured.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedapps.checkpoint import CHECKPOINT, CLIENT_STATE
from fedapps.config import ExperimentConfig, config_hash
from fedapps.reporting.results import Artifact, measured_columns, round_row

log = logging.getLogger("fedapps")

TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
EXPERIMENT = "fedapps"  # the MLflow experiment every run is filed under
HISTOGRAM = "acc_client"  # TensorBoard histogram of the per-client deployed-model accuracies
CLIENT_PREFIX = "acc_client_"
RUN_DIR_TAG = "fedapps.run_dir"  # MLflow tag: the run folder (a resumed run finds its MLflow run by it)
# never logged as MLflow artefacts: the resume state (the clients' private models, large) and the tracking stores
NOT_ARTEFACTS = (CHECKPOINT, CLIENT_STATE, TENSORBOARD_DIR, MLFLOW_DIR)


def tracking_root(cfg: ExperimentConfig, run_dir: Path) -> Path:
    """Where the stores go: the run folder, or ``tracking_dir`` (relative: against the run folder's parent)."""
    if not cfg.tracking_dir:
        return run_dir
    return (run_dir.parent / Path(cfg.tracking_dir).expanduser()).resolve()


def numeric_columns(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric cells of a rounds.csv row (empty cells, strings and ``round`` left out)."""
    return {
        k: float(v) for k, v in row.items() if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def round_values(entry: Any, num_clients: int) -> list[tuple[int, dict[str, float]]]:
    """(round, {column: value}) for everything one round's record adds to rounds.csv: its training phase under
    its own round, and each deployed-model measurement under the round it measures."""
    out = [(int(entry.round), numeric_columns(round_row(entry, num_clients)))]
    for m in getattr(entry, "measurements", []):
        out.append((int(m.round), numeric_columns(measured_columns([r.metrics for r in m.replies], num_clients))))
    return out


def client_accuracies(values: Mapping[str, float]) -> list[float]:
    """The ``acc_client_<i>`` values of a row, in client order."""
    keys = [k for k in values if k.startswith(CLIENT_PREFIX) and k[len(CLIENT_PREFIX) :].isdigit()]
    return [values[k] for k in sorted(keys, key=lambda k: int(k[len(CLIENT_PREFIX) :]))]


def flatten_config(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config dict as dotted keys -> text (MLflow params are strings); an empty section is kept as '{}'."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, prefix=f"{name}."))
        elif isinstance(value, Mapping):
            out[name] = "{}"
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, bool)) or value is None else str(value)
    return out


class TensorBoardSink:
    """TensorBoard event files: per-round scalars (the numeric rounds.csv columns) and a per-client accuracy
    histogram; flushed every round, so an interrupted run keeps what it logged."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, resumed: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional `tensorboard` package

        self.num_clients = cfg.data.num_clients
        root = tracking_root(cfg, run_dir)
        self.dir = root / TENSORBOARD_DIR if root == run_dir else root / TENSORBOARD_DIR / run_dir.name
        self.dir.mkdir(parents=True, exist_ok=True)
        if not resumed:  # a new run in this folder: the previous run's curves would mix with this one's
            for stale in self.dir.glob("events.out.tfevents.*"):
                stale.unlink()
        self.writer = SummaryWriter(log_dir=str(self.dir))
        log.info("tracking: TensorBoard events in %s", self.dir)

    def on_round(self, entry: Any) -> None:
        import numpy as np

        for step, values in round_values(entry, self.num_clients):
            for tag, value in values.items():
                if not tag.startswith(CLIENT_PREFIX):
                    self.writer.add_scalar(tag, value, step)
            accuracies = client_accuracies(values)
            if accuracies:
                self.writer.add_histogram(HISTOGRAM, np.asarray(accuracies, dtype=np.float64), step)
        self.writer.flush()

    def on_finish(self, summary: Mapping[str, Any], artifacts: list[Artifact]) -> None:
        self.writer.close()

    def on_abort(self, reason: str) -> None:
        self.writer.close()


class MLflowSink:
    """One MLflow run in a local file store: the flattened config as params, per-round metrics, the run folder as
    artefacts at the end. A resumed run continues the MLflow run of its folder (found by the run-folder tag)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, resumed: bool = False) -> None:
        # set before mlflow is imported: no telemetry (offline runs), and its file store, which MLflow 3 keeps only
        # behind this switch (a database store would need a server-side schema)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._Metric, self._RunTag = Metric, RunTag
        self.num_clients = cfg.data.num_clients
        self.run_dir = run_dir
        self.store = tracking_root(cfg, run_dir) / MLFLOW_DIR
        self.store.mkdir(parents=True, exist_ok=True)
        self.uri = self.store.as_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        if experiment is None:
            try:
                experiment_id = self.client.create_experiment(EXPERIMENT)
            except MlflowException:  # another run sharing the store created it in the meantime
                created = self.client.get_experiment_by_name(EXPERIMENT)
                if created is None:  # not that: the store refused it
                    raise
                experiment_id = created.experiment_id
        else:
            experiment_id = experiment.experiment_id
        earlier = self._earlier_run(experiment_id) if resumed else None
        if earlier is not None:
            self.run_id = earlier
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                experiment_id,
                run_name=run_dir.name,
                tags={
                    RUN_DIR_TAG: str(run_dir),
                    "fedapps.config_hash": config_hash(cfg),
                    "fedapps.strategy": cfg.strategy.name,
                },
            )
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in flatten_config(cfg.to_dict()).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_batch(self.run_id, tags=[RunTag("fedapps.resumed", str(bool(resumed)).lower())])
        log.info("tracking: MLflow run %s in %s", self.run_id, self.uri)

    def _earlier_run(self, experiment_id: str) -> str | None:
        """The latest MLflow run logged for this run folder, if any."""
        if "'" in str(self.run_dir):  # not expressible in MLflow's filter syntax
            log.warning("tracking: the run folder's name has a quote; the resumed run gets a new MLflow run")
            return None
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_DIR_TAG}` = '{self.run_dir}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def _log(self, values: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self._Metric(k, v, now, step) for step, row in values for k, v in row.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def on_round(self, entry: Any) -> None:
        self._log(round_values(entry, self.num_clients))

    def on_finish(self, summary: Mapping[str, Any], artifacts: list[Artifact]) -> None:
        """The summary's numbers as ``summary.<key>`` (step 0), the run folder as artefacts (the file sink, earlier
        in the list, has written summary.json and the figures by now); the run FINISHED, or FAILED when the summary
        records problems (the run is then unusable and the ServerApp fails it)."""
        self._log([(0, {f"summary.{k}": v for k, v in numeric_columns(summary).items()})])
        for path in sorted(self.run_dir.iterdir()):
            if path.name in NOT_ARTEFACTS:
                continue
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            else:
                self.client.log_artifact(self.run_id, str(path))
        problems = list(summary.get("problems") or [])
        if problems:
            self.client.log_batch(self.run_id, tags=[self._RunTag("fedapps.failure", "; ".join(problems)[:5000])])
        self.client.set_terminated(self.run_id, status="FAILED" if problems else "FINISHED")

    def on_abort(self, reason: str) -> None:
        """The run failed before its end: the MLflow run is marked FAILED with the reason as a tag."""
        self.client.log_batch(self.run_id, tags=[self._RunTag("fedapps.failure", reason[:5000])])
        self.client.set_terminated(self.run_id, status="FAILED")


SINKS = {"tensorboard": TensorBoardSink, "mlflow": MLflowSink}


def tracking_sinks(cfg: ExperimentConfig, run_dir: str | Path, resumed: bool = False) -> list[Any]:
    """The sinks ``cfg.tracking`` asks for, writing for the run in ``run_dir`` (its results folder)."""
    return [SINKS[name](cfg, Path(run_dir), resumed=resumed) for name in cfg.tracking]


def abort(sinks: Iterable[Any], reason: str) -> None:
    """Tell the tracking sinks that the run failed; a sink that cannot record it is logged, never raised."""
    for sink in sinks:
        try:
            sink.on_abort(reason)
        except Exception as exc:  # noqa: BLE001 - the run's own error is what matters here
            log.warning("tracking: could not record the failure in %s: %s", type(sink).__name__, exc)
