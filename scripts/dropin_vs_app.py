"""Where a drop-in strategy cannot give the app's models bit for bit, what a user gets instead: per-client test
accuracies of the app's own strategy and of the drop-in with a quickstart-style ClientApp (tests/apps/quickstart_twin:
its own Net, train and test; the app's minibatch order) on the same partition, seed and initial model.

- ``pfedhn``: the app identifies every node before round 1 and sends client i h(v_i) from the start; a plain Flower
  client names itself only in its first reply, so the drop-in sends every node the mean embedding's model in round 1.
- ``fedamp``: the paper's client keeps its own model between rounds (the app's, and the drop-in with a ClientApp that
  keeps it in ``context.state``); a FedProx-style ClientApp starts from the anchor u_i it receives instead. Run at two
  pulls: λ 0.1 (lr·μ = 0.5 per SGD step) and λ 0.01 (0.05).

Both sides run in this process on the in-process engine (the suite's `flwr run` tests show the drop-ins give the
same models there as in Ray simulation). Each run appends its rows to docs/results/dropin-vs-app.csv (with the
command and commit); the script prints the table docs/flower-apps.md shows.

    python scripts/dropin_vs_app.py [--rounds 20] [--clients 10] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
TWIN = ROOT / "tests" / "apps" / "quickstart_twin"
sys.path[:0] = [str(ROOT), str(TWIN)]
from fedapps.flower.inprocess import InProcessGrid  # noqa: E402
from fedapps_tools.benchrecord import command_line, git_commit  # noqa: E402

CSV = ROOT / "docs" / "results" / "dropin-vs-app.csv"
COLUMNS = ("case", "side", "seed", "rounds", "clients", "client", "acc", "date_utc", "commit", "command")
LR, BATCH = 0.05, 16
CASES = {  # case -> (the app's strategy section, the drop-in's constructor arguments, the twin's run-config changes)
    "pfedhn": ({"name": "pfedhn"}, {}, {"send-partition-id": True}),
    "fedamp-lam0.1": (
        {"name": "fedamp", "params": {"fedamp": {"lam": 0.1, "kappa": 1.0}}},
        {"lam": 0.1, "kappa": 1.0},
        {},
    ),
    "fedamp-lam0.01": (
        {"name": "fedamp", "params": {"fedamp": {"lam": 0.01, "kappa": 1.0}}},
        {"lam": 0.01, "kappa": 1.0},
        {},
    ),
}


def app_accuracies(strategy: dict, seed: int, rounds: int, clients: int) -> list[float]:
    """The app's strategy in process: each client's accuracy of its deployed model after the last round."""
    import server_app

    with tempfile.TemporaryDirectory(prefix="dropin-vs-app-") as tmp:
        cfg = Path(tmp) / "cfg.yaml"
        data = {"source": "digits", "partition": "pathological", "num_clients": clients, "classes_per_client": 2}
        client = {"epochs": 1, "batch_size": BATCH, "lr": LR}
        config = {"seed": seed, "rounds": rounds, "strategy": strategy, "data": data, "model": {"name": "mlp"}}
        cfg.write_text(yaml.safe_dump({**config, "client": client}))
        server_app.run_experiment(InProcessGrid(clients), str(cfg), "", str(Path(tmp) / "out"))
        (run_dir,) = [d for d in (Path(tmp) / "out").iterdir() if (d / "rounds.csv").is_file()]
        with open(run_dir / "rounds.csv") as f:
            last = list(csv.DictReader(f))[-1]
    return [float(last[f"acc_client_{c}"]) for c in range(clients)]


def dropin_accuracies(case: str, seed: int, rounds: int, clients: int, twin: dict) -> list[float]:
    """The drop-in with the quickstart twin in process: each client's accuracy of the model it was sent for the last
    round's evaluation."""
    from flwr.app import ArrayRecord
    from quickstart_twin.client_app import app as twin_client

    from fedapps.flower_strategies import FedAMP, PFedHN
    from fedapps.models import build_model

    last: dict[int, float] = {}  # partition -> its accuracy in the latest evaluation

    def serve(msg, ctx, call_next):  # the twin's ClientApp, its evaluation accuracies noted on the way back
        reply = twin_client(msg, ctx)
        if msg.metadata.message_type == "evaluate":
            last[int(ctx.node_config["partition-id"])] = float(reply.content["metrics"]["eval_acc"])
        return reply

    grid = InProcessGrid(clients, mods=[serve], first_node_id=2**63 + 7)
    run_config = {"seed": seed, "source": "digits", "partition": "pathological", "classes-per-client": 2,
                  "batch-size": BATCH, "lr": LR, "local-epochs": 1, "send-class-counts": False,
                  "send-partition-id": False, "keep-model": False, "keep-model-phases": "", "dump-dir": "",
                  **twin}  # fmt: skip
    for ctx in grid.contexts.values():
        ctx.run_config = run_config
    every = {"min_available_nodes": clients, "min_train_nodes": clients, "min_evaluate_nodes": clients}
    args = {**CASES[case][1], **every}
    strategy = PFedHN(num_nodes=clients, seed=seed, **args) if case == "pfedhn" else FedAMP(**args)
    initial = ArrayRecord(build_model("mlp", 10, (1, 8, 8), seed=seed).state_dict())
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds)
    return [last[c] for c in range(clients)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    command, commit = command_line(argv), git_commit()
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = not CSV.is_file()
    table: dict[tuple[str, str], list[float]] = {}
    for case in args.cases:
        app_strategy, _, twin = CASES[case]
        sides: list[tuple[str, dict | None]] = [("app", None)]  # (side, the twin's run config; None: the app)
        if case == "pfedhn":
            sides.append(("drop-in", twin))
        else:
            sides += [("drop-in, client keeps its model", {**twin, "keep-model": True}),
                      ("drop-in, FedProx-style client", {**twin, "keep-model": False})]  # fmt: skip
        for side, twin_config in sides:
            for seed in args.seeds:
                if twin_config is None:
                    accs = app_accuracies(app_strategy, seed, args.rounds, args.clients)
                else:
                    accs = dropin_accuracies(case, seed, args.rounds, args.clients, twin_config)
                table.setdefault((case, side), []).extend(accs)
                with CSV.open("a", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=COLUMNS)
                    if new:
                        writer.writeheader()
                        new = False
                    for client, acc in enumerate(accs):
                        writer.writerow(dict(case=case, side=side, seed=seed, rounds=args.rounds, clients=args.clients,
                                             client=client, acc=round(acc, 4), date_utc=date, commit=commit,
                                             command=command))  # fmt: skip
                print(f"{case} | {side} | seed {seed}: mean {np.mean(accs):.3f}", flush=True)
    seeds = " ".join(map(str, args.seeds))
    print(f"\n{args.clients} clients, {args.rounds} rounds, seeds {seeds}; `{command}` at commit {commit}")
    print("\n| case | side | mean client accuracy | min | max |\n| --- | --- | --- | --- | --- |")
    for (case, side), accs in table.items():
        print(f"| {case} | {side} | {np.mean(accs):.3f} | {min(accs):.3f} | {max(accs):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
