"""Where a client message's time goes, per strategy family: a few rounds through `fedapps run` and the breakdown the
clients' replies carry (rounds.csv ``client_<phase>_seconds``, :class:`fedapps.wire.protocol.MessageProfile`).

Per strategy (default: FedAvg and cwFedAvg, parameter averaging; COSMOS, pseudo-labels; FedFomo, pairwise model
exchange), its shipped config with ``--clients`` clients, ``--rounds`` rounds and the clients on ``--device``, run on
Flower's Ray engine (``--engine flower``, the default: `flwr run`) or the in-process one, with ``--workers`` clients
served at once (default one per core). Printed per strategy, in milliseconds per training message of the measured
rounds (all but the first, which carries start-up, and the last, which carries the evaluation-only message):
  decoding data model train evaluate predict other keep encoding   the phases the client measured
  unattributed   the client's wall not in any phase (the worker's own glue)
  client         the client's wall: from the message's arrival at the worker to its reply encoded
  framework      worker time per message beyond the client's wall: workers x the measured rounds' span / messages -
                 client, split into
    exchange     the rest of the exchange with the clients (Ray's and Flower's delivery of message and reply, queues,
                 polling, waiting at the round's barrier),
    server       the server's steps in the round while the workers wait (messages built, replies checked, aggregation:
                 COSMOS trains its cluster models here) and
    between      the server's work between rounds (results, checkpoint)
Last line: ``framework_ms_<strategy>=... client_ms_<strategy>=...``.

    python bench/message_profile.py
    python bench/message_profile.py --device cuda --workers 4        # on a GPU machine
    python bench/message_profile.py --engine inprocess --clients 4 --rounds 3 --source digits --model mlp  # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedapps_tools.benchrecord import record  # noqa: E402
from fedrun import PHASES, Breakdown, breakdown, fedapps_run, usable_cores  # noqa: E402

FAMILIES = {"fedavg": "averaging", "cwfedavg": "averaging", "cosmos": "pseudo-label", "fedfomo": "pairwise"}


def strategy_config(strategy: str, args: argparse.Namespace) -> dict:
    """The strategy's shipped config with the bench's size, data, model and device."""
    cfg = yaml.safe_load((ROOT / "configs" / f"{strategy}.yaml").read_text())
    cfg.update(run_name=f"profile-{strategy}", rounds=args.rounds, seed=0)
    cfg["strategy"] = {**cfg["strategy"], "min_clients": 1}
    cfg["data"] = {**cfg["data"], "num_clients": args.clients}
    if args.source:
        cfg["data"]["source"] = args.source
    if args.model:
        cfg["model"] = {**cfg.get("model", {}), "name": args.model}
    cfg["client"] = {**cfg.get("client", {}), "device": args.device}
    return cfg


def table(results: dict[str, Breakdown]) -> list[str]:
    """The breakdowns as aligned lines, one per strategy (ms per message)."""
    columns = [*PHASES, "unattributed", "client", "framework", "exchange", "server", "between"]
    lines = [f"{'strategy':10s} {'family':13s} {'msgs':>5s} " + " ".join(f"{c[:8]:>8s}" for c in columns)]
    for strategy, b in results.items():
        values = [
            *(b.phases[p] for p in PHASES),
            b.unattributed,
            b.client,
            b.framework,
            b.exchange,
            b.server,
            b.between,
        ]
        lines.append(
            f"{strategy:10s} {FAMILIES.get(strategy, ''):13s} {b.messages:5d} " + " ".join(f"{v:8.2f}" for v in values)
        )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Breakdown]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", default=",".join(FAMILIES), help="comma-separated strategies (configs/<name>.yaml)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="rounds per run (>= 3: the first and last are not measured)")
    ap.add_argument("--engine", choices=("flower", "inprocess"), default="flower")
    ap.add_argument("--workers", type=int, default=0, help="clients served at once (default: one per core)")
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help="the clients' device")
    ap.add_argument("--source", default="", help="data.source for every strategy (default: each config's)")
    ap.add_argument("--model", default="", help="model.name for every strategy (default: each config's)")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (the first and the last round are not measured)")
    strategies = [s for s in args.strategies.split(",") if s]
    workers = min(args.workers or usable_cores(), usable_cores(), args.clients)
    gpus = 0.0
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            print(f"message_profile: no CUDA device visible; --device {args.device} runs the clients on the CPU")
            args.device = "cpu"
        else:
            gpus = 1.0 / workers  # the workers share the one GPU
    results: dict[str, Breakdown] = {}
    with tempfile.TemporaryDirectory(prefix="fedapps-message-profile-") as tmp:
        for strategy in strategies:
            run = fedapps_run(strategy_config(strategy, args), Path(tmp), args.engine, workers, gpus)
            results[strategy] = breakdown(run.measured(), run.workers, run.measured_span())
    print(
        f"message_profile: {args.clients} clients, {args.rounds - 2} measured rounds, {args.engine} engine with "
        f"{workers} workers, device {args.device}; ms per training message"
    )
    for line in table(results):
        print(line)
    figures = {}
    for strategy, b in results.items():
        figures[f"framework_ms_{strategy}"] = round(b.framework, 2)
        figures[f"client_ms_{strategy}"] = round(b.client, 2)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    record("message_profile", figures)
    return results


if __name__ == "__main__":
    main()
