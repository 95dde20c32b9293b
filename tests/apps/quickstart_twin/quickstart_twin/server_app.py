"""The ServerApp: a drop-in strategy (or Flower's FedAvg), started from the app's initial model."""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedapps.flower_strategies import CFL, CwFedAvg, FedAMP, FedPer, Local, PFedHN
from fedapps.models import build_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    model = build_model("mlp", 10, (1, 8, 8), seed=cfg["seed"])  # the app's initial model for this seed
    arrays = ArrayRecord(model.state_dict())
    if cfg["strategy"] == "fedavg":
        strategy = FedAvg()
    elif cfg["strategy"] == "fedper":
        strategy = FedPer()
    elif cfg["strategy"] == "local":
        strategy = Local()
    elif cfg["strategy"] == "pfedhn":  # h initialised as the app's for this seed and number of clients
        strategy = PFedHN(num_nodes=cfg["pfedhn-num-nodes"] or None, seed=cfg["seed"])
    elif cfg["strategy"] == "fedamp":
        strategy = FedAMP(lam=cfg["fedamp-lam"], kappa=cfg["fedamp-kappa"])
    elif cfg["strategy"] == "cfl":
        strategy = CFL(eps1=cfg["cfl-eps1"], eps2=cfg["cfl-eps2"], warmup_rounds=cfg["cfl-warmup-rounds"])
    else:
        strategy = CwFedAvg(estimator=cfg["estimator"], mix=cfg["mix"])
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=cfg["num-server-rounds"])
