"""cosmos-quickstart: a Flower ServerApp running COSMOS with Flower's own strategy loop."""

import json

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from cosmos_quickstart.task import NUM_CLASSES, Net, load_server_public
from fedapps.flower_strategies import Cosmos

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    strategy = Cosmos(
        server_model_fn=Net,  # each cluster's model h_k: any architecture, here the clients' own
        public_x=load_server_public(context),
        num_classes=NUM_CLASSES,
        seed=cfg["seed"],
        local_epochs=cfg["local-epochs"],
        pretrain_epochs=cfg["pretrain-epochs"],
        max_clusters=cfg["max-clusters"],
        server_epochs=cfg["server-epochs"],
        distill_epochs=cfg["distill-epochs"],
        server_lr=cfg["server-lr"],
        distill_lr=cfg["distill-lr"],
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=cfg["num-server-rounds"])
    last = max(result.evaluate_metrics_clientapp)
    print(f"Clusters: {strategy.clustering.clusters}")
    print(f"Round {last}: mean accuracy of the deployed cluster models {result.evaluate_metrics_clientapp[last]}")
    if cfg["results"]:
        clients = {str(c): m for c, m in strategy.client_metrics[last].items()}
        doc = {"clusters": strategy.clustering.clusters, "round": last, "clients": clients}
        with open(cfg["results"], "w", encoding="utf-8") as out:
            json.dump(doc, out, indent=1)
