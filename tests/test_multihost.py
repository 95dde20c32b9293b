"""Across machines, on one machine: the SuperLink, three SuperNodes and the CLI each in its own network namespace
(veth pairs to a bridge in a hub namespace; addresses exist inside the namespaces only, never on a real network),
TLS and SuperNode authentication on, every step done with `fedapps deploy` exactly as docs/deployment.md
tells a user. Each node reads its own data file (node config ``data-path``) and U (``public-path``); the server
holds neither. A node with a wrong data-path is refused with its reason and the runs go on with the others; an
unregistered node is refused. Every process and namespace is removed afterwards, also when the
test fails. Needs root (CAP_NET_ADMIN) and `ip`; skipped with the reason where namespaces are not permitted.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
pytestmark = pytest.mark.netns


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


class Namespaces:
    """Namespaces named ``<prefix>-<name>`` joined by a bridge in ``<prefix>-hub``; ``address[name]`` is the
    namespace's IP on that private /24. ``remove()`` kills whatever runs inside them and deletes them."""

    def __init__(self, names: list[str]) -> None:
        tag = os.getpid() % 100000
        self.prefix = f"fa{tag}"
        self.net = f"10.{200 + tag % 50}.{tag % 250}"
        self.hub = f"{self.prefix}-hub"
        self.names = names
        self.created: list[str] = []
        self.address: dict[str, str] = {}

    def ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def create(self) -> None:
        self._add(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names, start=1):
            ns = self.ns(name)
            self._add(ns)
            inner, outer = f"{self.prefix}i{i}"[:15], f"{self.prefix}o{i}"[:15]
            sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "link", "set", outer, "netns", self.hub)
            sh("ip", "-n", self.hub, "link", "set", outer, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", outer, "up")
            self.address[name] = f"{self.net}.{i}"
            sh("ip", "-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", inner)
            sh("ip", "-n", ns, "link", "set", inner, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _add(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self.created.append(ns)

    def run(self, name: str, *cmd: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(name), *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )

    def popen(self, name: str, *cmd: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns(name), *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )

    def remove(self) -> list[str]:
        """Kill every process left in our namespaces, delete them; return the namespaces still present."""
        for ns in self.created:
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self.created):
            sh("ip", "netns", "del", ns, check=False)
        listed = sh("ip", "netns", "list", check=False).stdout
        return [ns for ns in self.created if ns in listed.split()]


def namespaces_permitted() -> str:
    """'' when this process may create network namespaces, else why not."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"faprobe{os.getpid() % 100000}"
    proc = sh("ip", "netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` is not permitted here ({proc.stderr.strip()}); run as root to include this test"
    sh("ip", "netns", "del", probe, check=False)
    return ""


@pytest.fixture
def netns():
    reason = namespaces_permitted()
    if reason:
        print(f"SKIPPED multi-host namespace test: {reason}")
        pytest.skip(reason)
    spaces = Namespaces(["link", "node1", "node2", "broken", "rogue", "cli"])
    try:
        spaces.create()
        yield spaces
    finally:
        left = spaces.remove()
        assert not left, f"namespaces not removed: {left}"


def write_node_data(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    np.savez(path, x=x, y=y)
    return path


def deploy(spaces: Namespaces, where: str, *args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return spaces.run(where, PY, "-m", "fedapps_tools.cli", "deploy", *args, env=env, timeout=timeout)


def wait_for_installed_app(apps: Path, timeout: float = 180.0) -> None:
    """Until the first run's ServerApp has installed the app (its files there and no longer changing). Flower 1.42's
    ``install_from_fab`` returns an existing install folder at once, so a second run of the same FAB that starts
    while the first is still copying finds no pyproject.toml there ("Cannot find pyproject.toml") and fails;
    docs/deployment.md says so for users."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        files = sum(1 for _ in apps.rglob("*")) if apps.is_dir() else 0
        if files and files == last and any(apps.glob("*/pyproject.toml")):
            return
        last = files
        time.sleep(1.0)
    raise AssertionError(f"the first run's app was not installed under {apps} within {timeout:.0f} s")


@pytest.mark.heavy
def test_tls_authenticated_deployment_across_namespaces(netns, tmp_path):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x.reshape(-1, 1, 8, 8) / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    public_rows, rest = order[:200], order[200:]
    public = write_node_data(tmp_path / "public.npz", x[public_rows], y[public_rows])
    halves = np.array_split(rest, 2)
    files = [write_node_data(tmp_path / f"site{i}.npz", x[rows], y[rows]) for i, rows in enumerate(halves, start=1)]

    env = {**os.environ, "FLWR_HOME": str(tmp_path / "cli-home"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    link_ip = netns.address["link"]
    certs, keys = tmp_path / "certs", tmp_path / "keys"
    link_state, node_state = tmp_path / "link", tmp_path / "nodes"
    step = lambda where, *a, **kw: deploy(netns, where, *a, env=env, **kw)  # noqa: E731
    states = [link_state, node_state]
    try:
        assert step("cli", "certs", str(certs), "--host", link_ip).returncode == 0
        for name in ("node1", "node2", "broken", "rogue"):
            assert step("cli", "node-key", str(keys), name).returncode == 0
        r = step(
            "link",
            "superlink",
            "--state",
            str(link_state),
            "--host",
            link_ip,
            "--port",
            "9092",
            "--certs",
            str(certs),
            "--auth",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        r = step("cli", "connect", "far", "--address", f"{link_ip}:9092", "--ca", str(certs / "ca.crt"))
        assert r.returncode == 0, r.stderr
        for name in ("node1", "node2", "broken"):
            r = step("cli", "register", "far", str(keys / f"{name}.pub"))
            assert r.returncode == 0, r.stdout + r.stderr
        broken_path = tmp_path / "no-such-site.npz"  # a node whose data-path is wrong: refused, the others go on
        for i, name in enumerate(("node1", "node2", "broken"), start=1):
            data_path = files[i - 1] if name != "broken" else broken_path
            node_config = (
                f"client-id={i - 1} data-path='{data_path}' public-path='{public}' threads=1 "
                f"state-dir='{tmp_path / ('state-' + name)}'"
            )
            r = step(
                name,
                "supernode",
                "--state",
                str(node_state),
                "--name",
                name,
                "--superlink",
                f"{link_ip}:9092",
                "--ca",
                str(certs / "ca.crt"),
                "--key",
                str(keys / name),
                "--node-config",
                node_config,
            )
            assert r.returncode == 0, r.stdout + r.stderr
        # an unregistered node is refused, and says what to do
        r = step(
            "rogue",
            "supernode",
            "--state",
            str(node_state),
            "--name",
            "rogue",
            "--superlink",
            f"{link_ip}:9092",
            "--ca",
            str(certs / "ca.crt"),
            "--key",
            str(keys / "rogue"),
            "--node-config",
            f"client-id=0 data-path='{files[0]}'",
        )
        assert r.returncode == 2 and "register its public key" in r.stderr, r.stdout + r.stderr

        nodes_data = [
            "data.source=nodes",
            "data.num_clients=3",
            "rounds=2",
            "model.name=mlp",
            "client.epochs=1",
            "client.batch_size=32",
            "strategy.min_clients=2",
            "strategy.connect_timeout=60",
        ]
        cosmos = [
            f"data.public_path={public}",
            "strategy.params.cosmos.pretrain_epochs=2",
            "strategy.params.cosmos.server_epochs=1",
        ]  # clients: MLP and CNN (the config's per_client)
        # both runs at once on the same SuperLink and SuperNodes (a node serves several runs; their state-dir
        # files go to one folder per run), which also halves the test's wall time
        runs = {"cwfedavg": ["client.lr=0.1"], "cosmos": cosmos}
        t0 = time.monotonic()
        started = {}
        for name, extra in runs.items():
            started[name] = netns.popen(
                "cli",
                PY,
                "-m",
                "fedapps_tools.cli",
                "deploy",
                "run",
                f"configs/{name}.yaml",
                "--link",
                "far",
                "--set",
                *nodes_data,
                *extra,
                "--fetch-to",
                str(tmp_path / "fetched" / name),
                "--quiet",
                env=env,
            )
            if len(started) < len(runs):
                wait_for_installed_app(tmp_path / "cli-home" / "apps")
        for name, proc in started.items():
            out, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, f"{name}: " + out[-3000:] + err[-3000:]
        print(f"cwFedAvg and COSMOS, 2 rounds each, concurrently: {time.monotonic() - t0:.0f} s")
        for name in runs:
            (run_dir,) = [p for p in (tmp_path / "fetched" / name).iterdir() if p.is_dir()]
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["strategy"] == name
            assert summary["final_round"] == 2 and summary["problems"] == [], summary
            assert summary["final_round_measured_clients"] == 2
            assert summary["messages_answered"] == summary["messages_sent"]
            assert summary["nodes"]["nodes_described"] == 2
            (refused,) = summary["nodes"]["nodes_refused"]  # the broken node, with its reason, on the server
            assert "data-path" in refused["reason"]
            assert str(broken_path) in refused["reason"] and "does not exist" in refused["reason"], refused
            assert summary["accuracy_mean"] > 0.15  # above chance (10 classes: 0.1; ~200 test samples per client)
            # partition.csv is what the nodes described: the class counts of their own files, train + test
            rows = list(csv.DictReader(open(run_dir / "partition.csv")))
            for cid, rows_i in enumerate(halves):
                counts = np.zeros(10, dtype=int)
                for row in rows:
                    if int(row["client"]) == cid:
                        counts += np.array([int(row[f"class_{k}"]) for k in range(10)])
                assert counts.tolist() == np.bincount(y[rows_i], minlength=10).tolist()
        # each node kept each run's private models apart, under its own state-dir
        for name in ("node1", "node2"):
            assert len([p for p in (tmp_path / f"state-{name}").iterdir() if p.is_dir()]) == 2
    finally:
        for state in states:
            if (state / "pids").is_dir():
                step("cli", "stop", "--state", str(state), timeout=60)
