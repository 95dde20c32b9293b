"""cwFedAvg's estimators on IID data (mnist5k, 10 clients, configs/cwfedavg.yaml otherwise): where cwFedAvg
should reduce to FedAvg. Prints, per estimator, the mean L1 error of p̂ against the clients' true training
distributions, the range of the self-weights A_ii of the mixing matrix, and the largest |A_il − p_l| against
FedAvg's weights p_l.

    python scripts/cwfedavg_iid_estimators.py [ROUNDS]     # default 1 round; about 10 s per estimator and round
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedapps.config import load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.driver import RoundDriver
from strategies import resolve
from strategies.cwfedavg import fedavg_weights, l1_error, mixing_matrix

CLIENTS = 10


def measure(estimator: str, lam: float, rounds: int) -> str:
    cfg = load_config(
        str(Path(__file__).resolve().parent.parent / "configs" / "cwfedavg.yaml"),
        [
            f"rounds={rounds}",
            "data.partition=iid",
            f"data.num_clients={CLIENTS}",
            f"strategy.params.cwfedavg.estimator={estimator}",
            f"strategy.params.cwfedavg.wdr_lambda={lam}",
        ],
    )
    resolved = resolve(cfg)
    strategy = resolved.build(resolved.config(cfg))
    RoundDriver(strategy).start(InProcessGrid(CLIENTS))
    rows = [strategy.stack.row_of[c] for c in range(CLIENTS)]
    a = mixing_matrix(strategy.p_hat[rows], strategy.q[rows])
    fedavg = fedavg_weights(strategy.n[rows])
    l1 = l1_error(strategy.p_hat[rows], strategy.true_p[:CLIENTS])
    return (
        f"{estimator:5s} λ={lam:g} rounds={rounds}: L1(p̂, p) {l1:.3f}  "
        f"self-weights A_ii {np.diag(a).min():.3f}–{np.diag(a).max():.3f} "
        f"(FedAvg {fedavg.min():.3f}–{fedavg.max():.3f})  "
        f"max |A − FedAvg| {np.abs(a - fedavg[None]).max():.3f}"
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for estimator, lam in (("bias", 0.0), ("norm", 10.0), ("true", 10.0)):
        print(measure(estimator, lam, rounds), flush=True)
