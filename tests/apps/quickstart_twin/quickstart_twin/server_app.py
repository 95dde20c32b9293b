"""The ServerApp: a drop-in strategy (or Flower's FedAvg), started from the app's initial model; ``strategy`` may name
several, comma-separated: each then runs its rounds from that same initial model, one after another on the same
SuperNodes, and tells the clients its name in the ``phase`` config entry (so that their dumps do not mix)."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedapps.flower_strategies import CFL, CwFedAvg, FedAMP, FedPer, Local, PFedHN
from fedapps.models import build_model

app = ServerApp()


def build_strategy(name: str, cfg):
    if name == "fedavg":
        return FedAvg()
    if name == "fedper":
        return FedPer()
    if name == "local":
        return Local()
    if name == "pfedhn":  # h initialised as the app's for this seed and number of clients
        return PFedHN(num_nodes=cfg["pfedhn-num-nodes"] or None, seed=cfg["seed"])
    if name == "fedamp":
        return FedAMP(lam=cfg["fedamp-lam"], kappa=cfg["fedamp-kappa"])
    if name == "cfl":
        return CFL(eps1=cfg["cfl-eps1"], eps2=cfg["cfl-eps2"], warmup_rounds=cfg["cfl-warmup-rounds"])
    return CwFedAvg(estimator=cfg["estimator"], mix=cfg["mix"])


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    names = str(cfg["strategy"]).split(",")
    for name in names:
        model = build_model("mlp", 10, (1, 8, 8), seed=cfg["seed"])  # the app's initial model for this seed
        phase = ConfigRecord({"phase": name if len(names) > 1 else ""})
        build_strategy(name, cfg).start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=cfg["num-server-rounds"],
            train_config=phase,
            evaluate_config=ConfigRecord(dict(phase)),
        )
