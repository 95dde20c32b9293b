"""cwfedavg-quickstart: a Flower ServerApp with the drop-in cwFedAvg (one personalised model per client)."""

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from cwfedavg_quickstart.task import Net
from fedapps.flower_strategies import CwFedAvg

app = ServerApp()


def mean_over_clients(records, weighting_key):
    """Each metric's plain mean over the clients (Flower's default weights them by examples)."""
    metrics = [next(iter(r.metric_records.values())) for r in records]
    keys = [k for k in metrics[0] if k != weighting_key]
    return MetricRecord({k: sum(float(m[k]) for m in metrics) / len(metrics) for k in keys})


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(cfg["seed"])
    arrays = ArrayRecord(Net().state_dict())
    Strategy = FedAvg if cfg["strategy"] == "fedavg" else CwFedAvg  # the one line that changes
    strategy = Strategy(fraction_train=cfg["fraction-train"], evaluate_metrics_aggr_fn=mean_over_clients)
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": cfg["lr"]}),
        num_rounds=cfg["num-server-rounds"],
    )
    if cfg["results"]:
        rounds = {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()}
        with open(cfg["results"], "w") as f:
            json.dump({"strategy": cfg["strategy"], "evaluate": rounds}, f, indent=1)
