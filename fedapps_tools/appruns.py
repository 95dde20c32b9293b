"""Run any Flower app folder through `flwr run` (Ray simulation) on a SuperLink of its own, offline, to its final
status: the drop-in strategies' examples and tests (examples/, tests/apps/) and scripts/dropin_pathological.py.

The SuperLink is :class:`fedapps_tools.launch.OwnSuperLink` (free port, its own FLWR_HOME, every process it starts
stopped with it); the environment is this process's, with the offline settings (:func:`fedapps_tools.flwrcli.
flower_env`), so a ``PYTHONPATH`` set here reaches the ServerApp and the ClientApps.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fedapps_tools.flwrcli import CONNECTION, RunFailed, flower_env, flwr_json, follow_run
from fedapps_tools.launch import OwnSuperLink, flower_number, write_connection


@dataclass
class AppRun:
    """A finished run: its id, final status (``finished:completed`` when it succeeded) and its log."""

    run_id: str
    status: str
    log: str

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


def run_app(
    app_dir: Path,
    run_config: str = "",
    num_supernodes: int = 2,
    timeout: float = 900.0,
    cpus_per_client: float = 1,
) -> AppRun:
    """`flwr run APP_DIR` with ``--run-config RUN_CONFIG`` on ``num_supernodes`` simulated SuperNodes of
    ``cpus_per_client`` CPUs each (Ray runs one client actor per that many of the machine's CPUs: 2 on a 2-core
    machine serves every SuperNode with one actor, which imports torch and the app once), waited for up to
    ``timeout`` seconds (RunFailed past it); the run's status and log, both read from the SuperLink in this process
    (:func:`fedapps_tools.flwrcli.follow_run`)."""
    home = Path(tempfile.mkdtemp(prefix="fedapps-app-"))
    link = OwnSuperLink(home, flower_env())
    try:
        write_connection(home, link.start())
        cpus = flower_number(cpus_per_client)
        cmd = ["flwr", "run", str(Path(app_dir).resolve()), CONNECTION, "--format", "json"]
        cmd += ["--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus}"]
        if run_config:
            cmd += ["--run-config", run_config]
        doc = flwr_json(cmd, link.env)
        if not doc.get("success") or not doc.get("run-id"):
            raise RunFailed(f"`flwr run {app_dir}` did not start: {doc}")
        run_id = str(doc["run-id"])
        try:
            status, lines = follow_run(run_id, link.env, quiet=True, link=link, timeout=timeout)
        except RunFailed as exc:
            raise RunFailed(f"`flwr run {app_dir}`: {exc}") from None
        return AppRun(run_id, status, "".join(lines))
    finally:
        link.stop()
        shutil.rmtree(home, ignore_errors=True)
