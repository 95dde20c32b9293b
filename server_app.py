"""Flower ServerApp: run the configured experiment (:class:`fedapps.server.experiment.Experiment`), write its results.

When it loads, this module imports Flower and the light part of the core only (no torch); the experiment, the data,
checkpoints, trackers and the strategies (torch) are imported when a run starts. Flower's simulation loads the
ServerApp (on its thread) and the ClientApp (on its main thread, which then starts Ray) under one import lock: a light
module lets Ray's processes boot while the run's imports happen (docs/performance.md, start-up).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedapps.flower import MessageGrid, message_sweep
from fedapps.importpath import check_own_modules

log = logging.getLogger("fedapps")
app = ServerApp()


def setup_logging() -> None:
    """Progress lines of the fedapps logger go to the run's log (what `flwr run --stream` shows)."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s fedapps: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def run_experiment(
    grid: MessageGrid,
    config_path: str,
    overrides: str,
    output_dir: str,
    resume_dir: str = "",
    after_round: Callable[[int], Any] | None = None,
    keep_state: bool = False,
) -> dict:
    """Run one configured experiment on a Grid and return its summary (the ServerApp's, the tools' and the tests').

    A new run's folder (``<output_dir>/<run name>``) must be new or empty. After every round the results and
    ``checkpoint.pt`` are written (then ``after_round(k)``). ``resume_dir``: a run folder with a checkpoint of the same
    config, continued after its last round. A run that ends successfully removes its resume state unless ``keep_state``.
    """
    check_own_modules()  # a user's module named like ours (strategies) is said so, before it is imported instead
    import torch  # these import torch: when the run starts, not when Flower loads the module (the module docstring)

    from fedapps.server.experiment import Experiment
    from strategies import STRATEGIES

    setup_logging()
    # server-side torch threads (COSMOS trains models here): FEDAPPS_SERVER_THREADS, default 1 (docs/performance.md)
    torch.set_num_threads(max(1, int(os.environ.get("FEDAPPS_SERVER_THREADS", "1"))))
    run = Experiment(grid, config_path, overrides, STRATEGIES, output_dir, resume_dir, after_round)
    return run.run(keep_state)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point under `flwr run`: run config keys 'config', 'overrides', 'output-dir', 'resume-dir', 'keep-state'."""
    message_sweep.poll_replies_often(grid)  # simulation: replies looked for every 0.02 s, not 0.1 s
    rc = context.run_config
    run_experiment(
        grid,
        str(rc.get("config", "configs/default.yaml")),
        str(rc.get("overrides", "")),
        str(rc.get("output-dir", "")),
        resume_dir=str(rc.get("resume-dir", "")),
        keep_state=str(rc.get("keep-state", "false")).lower() in ("true", "1"),
    )
