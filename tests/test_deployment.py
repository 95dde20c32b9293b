"""One run with real SuperLink and SuperNode processes on loopback (deploy/local_deployment.sh).

Where network namespaces are permitted, tests/test_multihost.py runs real SuperLink and SuperNode processes with
more at stake (TLS, authentication, separate network stacks, each node's own data) and this loopback run, ~45 s
of the same machinery, is skipped to keep the suite's time; it runs where the namespace test cannot."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.heavy
def test_real_superlink_and_supernodes(tiny_config, tmp_path):
    from tests.test_multihost import namespaces_permitted

    if not namespaces_permitted():
        pytest.skip("real SuperLink/SuperNode processes are run by tests/test_multihost.py here (namespaces permitted)")
    cfg = tiny_config(rounds=1, data={"num_clients": 2})
    env_home = tmp_path / "flwr-home"
    env_home.mkdir()
    proc = subprocess.run(
        ["bash", str(ROOT / "deploy" / "local_deployment.sh"), str(cfg), "2", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=500,
        env={**__import__("os").environ, "FLWR_HOME": str(env_home), "FEDAPPS_SUPERLINK_PORT": "39491"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished:completed" in proc.stdout
    summary = json.loads((tmp_path / "out" / "fedavg-digits-iid-s0" / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["num_clients"] == 2
    assert summary["bytes_up"] > 0
