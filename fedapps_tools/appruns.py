"""Run any Flower app folder through `flwr run` (Ray simulation) on a SuperLink of its own, offline, to its final
status: the drop-in strategies' examples and tests (examples/, tests/apps/) and scripts/dropin_pathological.py.

The SuperLink is :class:`fedapps_tools.launch.OwnSuperLink` (free port, its own FLWR_HOME, every process it starts
stopped with it); the environment is this process's, with the offline settings (:func:`fedapps_tools.flwrcli.
flower_env`), so a ``PYTHONPATH`` set here reaches the ServerApp and the ClientApps.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fedapps_tools.flwrcli import CONNECTION, RunFailed, flower_env, flwr_json, run_status
from fedapps_tools.launch import OwnSuperLink, write_connection


@dataclass
class AppRun:
    """A finished run: its id, final status (``finished:completed`` when it succeeded) and its log."""

    run_id: str
    status: str
    log: str

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


def run_app(app_dir: Path, run_config: str = "", num_supernodes: int = 2, timeout: float = 900.0) -> AppRun:
    """`flwr run APP_DIR` with ``--run-config RUN_CONFIG`` on ``num_supernodes`` simulated SuperNodes (one CPU
    each), waited for up to ``timeout`` seconds (RunFailed past it); the run's status and log."""
    home = Path(tempfile.mkdtemp(prefix="fedapps-app-"))
    link = OwnSuperLink(home, flower_env())
    try:
        write_connection(home, link.start())
        cmd = ["flwr", "run", str(Path(app_dir).resolve()), CONNECTION, "--format", "json"]
        cmd += ["--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus=1"]
        if run_config:
            cmd += ["--run-config", run_config]
        doc = flwr_json(cmd, link.env)
        if not doc.get("success") or not doc.get("run-id"):
            raise RunFailed(f"`flwr run {app_dir}` did not start: {doc}")
        run_id = str(doc["run-id"])
        deadline = time.monotonic() + timeout
        status = run_status(run_id, link.env)
        while not status.startswith("finished"):
            if time.monotonic() > deadline:
                raise RunFailed(f"`flwr run {app_dir}` still {status} after {timeout:.0f} s")
            link.note_children()
            time.sleep(3.0)
            status = run_status(run_id, link.env)
        log = subprocess.run(
            ["flwr", "log", run_id, CONNECTION, "--show"],
            env=link.env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        return AppRun(run_id, status, log.stdout + log.stderr)
    finally:
        link.stop()
        shutil.rmtree(home, ignore_errors=True)
