"""`fedapps deploy`'s pieces without a network: certificates, node keys, connections, plain-text refusal, config
paths, process records and stop, the wait for the expected clients, and failure reasons read off a run's log."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedapps.config import ConfigError
from fedapps.flower.connect import FederationIncomplete, wait_for_clients
from fedapps_tools import deploy
from fedapps_tools.flwrcli import _proc_stat, descendants, exception_lines

ROOT = Path(__file__).resolve().parent.parent


def test_certificate_covers_every_host_and_verifies_against_the_ca(tmp_path):
    made = deploy.make_certs(tmp_path, ["10.1.2.3", "link.example.org"])
    san = subprocess.run(
        ["openssl", "x509", "-in", str(made["cert"]), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for entry in ("IP Address:10.1.2.3", "DNS:link.example.org", "IP Address:127.0.0.1", "DNS:localhost"):
        assert entry in san
    ok = subprocess.run(
        ["openssl", "verify", "-CAfile", str(made["ca"]), str(made["cert"])], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert (made["key"].stat().st_mode & 0o777) == 0o600 and ((tmp_path / "ca.key").stat().st_mode & 0o777) == 0o600
    # a second call for another host reuses the CA: the first certificate's CA still verifies the new one
    ca_before = made["ca"].read_bytes()
    again = deploy.make_certs(tmp_path, ["10.9.9.9"])
    assert again["ca"].read_bytes() == ca_before
    assert subprocess.run(["openssl", "verify", "-CAfile", str(again["ca"]), str(again["cert"])]).returncode == 0
    with pytest.raises(deploy.DeployError, match="neither an IP address nor a DNS name"):
        deploy.san_entries(["bad host!"])


def test_node_key_is_openssh_ecdsa_p384_and_never_overwritten(tmp_path):
    private, public = deploy.make_node_key(tmp_path, "site1")
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert "OPENSSH PRIVATE KEY" in private.read_text()
    with pytest.raises(deploy.DeployError, match="never overwritten"):
        deploy.make_node_key(tmp_path, "site1")


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("10.0.0.1", False),
        ("0.0.0.0", False),
        ("link.example.org", False),
    ],
)
def test_plain_text_only_on_loopback(host, loopback):
    assert deploy.is_loopback(host) is loopback
    if loopback:
        assert "--insecure" in deploy.superlink_command(host, 9092, None, auth=False, insecure=True)
    else:
        with pytest.raises(deploy.DeployError, match="loopback"):
            deploy.superlink_command(host, 9092, None, auth=False, insecure=True)
        with pytest.raises(deploy.DeployError, match="loopback"):
            deploy.supernode_command(f"{host}:9092", "", 9094, None, None, insecure=True)
        with pytest.raises(deploy.DeployError, match="loopback"):
            deploy.connection_block("x", f"{host}:9092", None, insecure=True)


def test_superlink_command_tls_and_auth(tmp_path):
    with pytest.raises(deploy.DeployError, match="needs TLS"):
        deploy.superlink_command("127.0.0.1", 9092, None, auth=True, insecure=True)
    with pytest.raises(deploy.DeployError, match="ca.crt is missing"):
        deploy.superlink_command("10.0.0.1", 9092, tmp_path, auth=True, insecure=False)
    deploy.make_certs(tmp_path, ["10.0.0.1"])
    cmd = deploy.superlink_command("10.0.0.1", 9092, tmp_path, auth=True, insecure=False)
    assert "--enable-supernode-auth" in cmd and "--insecure" not in cmd
    assert cmd[cmd.index("--ssl-certfile") + 1] == str(tmp_path / "server.pem")


def test_connection_is_added_and_replaced_keeping_the_others(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    home = tmp_path / "home"
    (home).mkdir()
    (home / "config.toml").write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    deploy.write_connection(home, "far", deploy.connection_block("far", "10.0.0.1:9092", ca, insecure=False))
    deploy.write_connection(home, "far", deploy.connection_block("far", "10.0.0.2:9092", ca, insecure=False))
    import tomllib

    doc = tomllib.loads((home / "config.toml").read_text())
    assert doc["superlink"]["local"]["address"] == ":local:" and doc["superlink"]["default"] == "local"
    assert doc["superlink"]["far"] == {"address": "10.0.0.2:9092", "root-certificates": str(ca.resolve())}


def test_config_must_travel_in_the_app_bundle(tmp_path):
    assert deploy.app_relative_config(str(ROOT / "configs" / "cwfedavg.yaml")) == "configs/cwfedavg.yaml"
    outside = tmp_path / "mine.yaml"
    outside.write_text("rounds: 1\n")
    with pytest.raises(ConfigError, match="outside the app folder"):
        deploy.app_relative_config(str(outside))


def test_results_folder_and_failure_reason_read_off_the_log():
    lines = ["INFO fedapps: round 2 ...\n", "INFO fedapps: RESULTS /srv/link/results/run-a\n", "more\n"]
    assert deploy.results_dir(lines) == "/srv/link/results/run-a"
    assert deploy.results_dir(["nothing\n"]) is None
    log = [
        "ERROR : ServerApp raised an exception\n",
        "Traceback (most recent call last):\n",
        '  File "x.py", line 1, in f\n',
        "    raise FederationIncomplete(\n",
        "fedapps.server.strategy.FederationIncomplete: only 1 of the 2 expected client nodes connected\n",
        "ERROR : Exit Code: 201\n",
    ]
    assert exception_lines(log) == [
        "fedapps.server.strategy.FederationIncomplete: only 1 of the 2 expected client nodes connected"
    ]


def test_stop_signals_exactly_the_recorded_processes_and_their_children(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    # a recorded process with a child of its own, and an unrecorded bystander
    parent = deploy.start_background(
        [sys.executable, "-c", ("import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)")],
        tmp_path,
        "link",
        env,
    )
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        deadline = time.monotonic() + 20
        while not descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        (child,) = descendants(parent.pid)
        with pytest.raises(deploy.DeployError, match="already running"):
            deploy.start_background(["sleep", "1"], tmp_path, "link", env)
        assert deploy.stop_recorded(tmp_path, grace=5) == ["link"]
        parent.wait(timeout=10)
        assert _proc_stat(child) is None and bystander.poll() is None
        assert not list((tmp_path / "pids").glob("*.json"))
        # a record whose pid now belongs to another process (start time differs) is not signalled
        (tmp_path / "pids" / "old.json").write_text(json.dumps({"pid": bystander.pid, "start": 1}))
        assert deploy.stop_recorded(tmp_path, grace=1) == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        parent.kill()


class GrowingGrid:
    """A grid whose connected nodes grow by one per poll, up to ``final``."""

    def __init__(self, final: int) -> None:
        self.final, self.polls = final, 0

    def get_node_ids(self):
        self.polls += 1
        return list(range(min(self.polls, self.final)))


class FakeClock:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_round_one_waits_for_the_expected_clients():
    grid = GrowingGrid(final=5)
    assert wait_for_clients(grid, 3, timeout=100, poll=0, clock=FakeClock(1.0)) == [0, 1, 2]
    assert grid.polls == 3  # returned as soon as the third came, not before and not later
    with pytest.raises(FederationIncomplete, match=r"only 2 of the 4 expected .*strategy.expected_clients=2"):
        wait_for_clients(GrowingGrid(final=2), 4, timeout=10, poll=0, clock=FakeClock(1.0))


def test_a_new_supernode_is_watched_until_accepted_or_refused(tmp_path):
    log = tmp_path / "node.log"
    log.write_text("SuperNode ID: 111  (an earlier start of the same node)\n")
    offset = log.stat().st_size

    def fake_node(script: str) -> subprocess.Popen:
        out = open(log, "ab")
        return subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT)

    quiet = fake_node("import time; time.sleep(30)")  # connecting, never accepted: the earlier line does not count
    try:
        assert deploy.check_node_started(quiet, log, seconds=1.0, offset=offset) is False
    finally:
        quiet.kill()
        quiet.wait()
    accepted = fake_node("import time; print('SuperNode ID: 42', flush=True); time.sleep(30)")
    try:
        t0 = time.monotonic()
        assert deploy.check_node_started(accepted, log, seconds=20.0, offset=offset) is True
        assert time.monotonic() - t0 < 15  # returned on the line, not at the end of the watch
    finally:
        accepted.kill()
        accepted.wait()
    offset = log.stat().st_size
    refused = fake_node("import sys; print('[code: 2004] Failed to activate SuperNode.'); sys.exit(1)")
    with pytest.raises(deploy.DeployError, match="register its public key first"):
        deploy.check_node_started(refused, log, seconds=20.0, offset=offset)
