"""Flower's Ray simulation on an existing Ray cluster (`fedapps run --ray-address`, `fedapps_tools.raycluster`).

The fast tests pin the address rules, the per-node actor count, the count of ClientApp messages per node and the
refusals (a closed port, a service that is not a Ray head, impossible option combinations: each a clear error
within seconds, no Flower process started). ``test_simulation_runs_on_both_nodes_of_a_two_node_ray_cluster``
(marked ``raycluster``) starts a Ray head and one worker node on 127.0.0.1 (separate ``ray start --block``
processes, 1 CPU each, own ports and temp dirs), runs a 4-client digits simulation through
``fedapps run --ray-address``, reads from Ray's GCS on which node each ClientApp message ran, and stops exactly
the Ray processes it started (by process group and noted pids; never ``ray stop``), also when it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import pytest

from fedapps.reporting.results import read_csv
from fedapps_tools import cli, flwrcli, launch, raycluster
from fedapps_tools.raycluster import RayClusterError

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# --------------------------------------------------------------------------- rules, by hand


def test_requested_address_option_env_local_and_bad_forms():
    env = {"RAY_ADDRESS": "10.0.0.1:6379"}
    assert raycluster.requested_address("10.0.0.2:7000", env) == ("10.0.0.2:7000", "--ray-address")
    assert raycluster.requested_address(None, env) == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert raycluster.requested_address(None, {}) == (None, "")
    assert raycluster.requested_address(None, {"RAY_ADDRESS": "  "}) == (None, "")
    assert raycluster.requested_address("local", env) == (None, "--ray-address")  # ignores the exported one
    assert raycluster.requested_address("[::1]:6379", {}) == ("[::1]:6379", "--ray-address")
    for bad in ("auto", "ray://10.0.0.1:10001", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000", "10.0.0.1:port", ":6379"):
        with pytest.raises(RayClusterError, match=r"--ray-address.*HOST:PORT|--ray-address='auto'"):
            raycluster.requested_address(bad, {})
    with pytest.raises(RayClusterError, match="RAY_ADDRESS='auto'"):
        raycluster.requested_address(None, {"RAY_ADDRESS": "auto"})


def test_cluster_env_sets_or_removes_ray_address():
    base = {"RAY_ADDRESS": "stale:1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PATH": "/bin"}
    env = raycluster.cluster_env(base, "127.0.0.1:6379")
    assert env["RAY_ADDRESS"] == "127.0.0.1:6379" and env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert env["PATH"] == "/bin"
    env = raycluster.cluster_env(base, None)
    assert "RAY_ADDRESS" not in env and env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert base["RAY_ADDRESS"] == "stale:1"  # the caller's mapping is not changed


def test_actors_per_node_counts_each_node_by_its_own_resources():
    nodes = [
        {"node_id": "a", "alive": True, "cpus": 4, "gpus": 1},
        {"node_id": "b", "alive": True, "cpus": 3, "gpus": 0},
        {"node_id": "c", "alive": False, "cpus": 64, "gpus": 8},
    ]
    assert raycluster.actors_per_node(nodes, 1, 0) == {"a": 4, "b": 3}
    assert raycluster.actors_per_node(nodes, 2, 0) == {"a": 2, "b": 1}  # ⌊3/2⌋ on b, not ⌊7/2⌋ pooled
    assert raycluster.actors_per_node(nodes, 1.5, 0) == {"a": 2, "b": 2}
    assert raycluster.actors_per_node(nodes, 1, 0.5) == {"a": 2, "b": 0}  # GPU-bound on a, no GPU on b
    assert raycluster.actors_per_node(nodes, 1, 0.2) == {"a": 4, "b": 0}  # CPU-bound on a
    assert raycluster.actors_per_node(nodes, 5, 0) == {"a": 0, "b": 0}
    with pytest.raises(RayClusterError, match="--cpus-per-client"):
        raycluster.actors_per_node(nodes, 0, 0)


def test_client_resources_from_options_or_raw_federation_config():
    assert raycluster.client_resources("", 1, 0.25) == (1.0, 0.25)
    assert raycluster.client_resources(
        "num-supernodes=4 client-resources-num-cpus=3 client-resources-num-gpus=0.5", 1, 0
    ) == (3.0, 0.5)
    assert raycluster.client_resources("num-supernodes=4", 1, 0) == (2.0, 0.0)  # Flower's own defaults
    with pytest.raises(RayClusterError, match="client-resources-num-cpus"):
        raycluster.client_resources("client-resources-num-cpus=two", 1, 0)


def test_runs_per_node_from_actor_table_and_timeline():
    a1, a2, other = "11" * 16, "22" * 16, "33" * 16
    actors = {
        a1: {"ActorClassName": "ClientAppActor", "JobID": "01000000", "Address": {"NodeID": "head"}},
        a2: {"ActorClassName": "ClientAppActor", "JobID": "01000000", "Address": {"NodeID": "worker"}},
        other: {"ActorClassName": "SomethingElse", "JobID": "01000000", "Address": {"NodeID": "worker"}},
    }

    def ev(actor, cat="task::ClientAppActor.run"):
        return {"cat": cat, "name": "run", "args": {"task_id": "ab" * 8 + actor}}

    timeline = [
        ev(a1),
        ev(a1),
        ev(a2),
        ev(a1, "task:execute"),
        ev(other, "task::SomethingElse.run"),
        ev(other),
        {"cat": "task::ClientAppActor.run", "args": {}},
    ]
    assert raycluster.runs_per_node(actors, timeline) == {"01000000": {"head": 2, "worker": 1}}


# --------------------------------------------------------------------------- refusals through the CLI


@pytest.fixture
def no_flower(monkeypatch):
    """Fail the test if a run would start Flower."""
    monkeypatch.setattr(launch, "run_with_flower", lambda *a, **k: pytest.fail("flwr must not start"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _cli(capsys, *argv) -> tuple[int, str, float]:
    t0 = time.monotonic()
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err, time.monotonic() - t0


def test_closed_port_is_a_clear_error_naming_the_option(tiny_config, capsys, no_flower, monkeypatch):
    cfg = str(tiny_config())
    port = launch.free_port()
    rc, err, took = _cli(capsys, "run", cfg, "--ray-address", f"127.0.0.1:{port}")
    assert rc == 2 and f"--ray-address=127.0.0.1:{port}" in err and "ray start --head" in err, err
    assert took < 30
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # an exported address is checked the same way
    rc, err, _ = _cli(capsys, "run", cfg)
    assert rc == 2 and f"RAY_ADDRESS=127.0.0.1:{port}" in err, err
    rc, err, _ = _cli(capsys, "run", cfg, "--ray-address", "auto")
    assert rc == 2 and "'auto' is not supported" in err, err


def test_a_grpc_service_that_is_not_ray_is_refused_quickly(tiny_config, capsys, no_flower):
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # no services: every method is unimplemented
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rc, err, took = _cli(capsys, "run", str(tiny_config()), "--ray-address", f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert rc == 2 and "not a Ray head" in err and "--ray-address" in err, err
    assert took < 30


def test_option_combinations_that_cannot_work(tiny_config, capsys, no_flower):
    cfg = str(tiny_config())
    rc, err, _ = _cli(capsys, "run", cfg, "--ray-address", "127.0.0.1:6379", "--superlink", "127.0.0.1:9092")
    assert rc == 2 and "--superlink" in err, err
    rc, err, _ = _cli(capsys, "run", cfg, "--ray-address", "127.0.0.1:6379", "--engine", "inprocess")
    assert rc == 2 and "--engine flower" in err, err
    rc, err, _ = _cli(
        capsys,
        "run",
        cfg,
        "--ray-address",
        "127.0.0.1:6379",
        "--federation-config",
        "num-supernodes=4 init-args-num-cpus=2",
    )
    assert rc == 2 and "init-args-num-cpus" in err, err


def test_the_superlink_gets_the_cluster_address_in_its_environment(tiny_config, tmp_path, monkeypatch):
    """run_with_flower starts its SuperLink with RAY_ADDRESS = the cluster (and without an exported one when
    there is no cluster)."""
    seen: list[dict] = []

    class Recorder(launch.OwnSuperLink):
        def start(self, timeout: float = 60.0, attempts: int = 3) -> str:
            seen.append(dict(self.env))
            raise launch.RunFailed("recorded")

    monkeypatch.setattr(launch, "OwnSuperLink", Recorder)
    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:1")
    cfg_path = tiny_config()
    cfg = launch.load_config(cfg_path)
    args = cli.build_parser().parse_args(["run", str(cfg_path)])
    for address in ("127.0.0.1:6379", None):
        with pytest.raises(launch.RunFailed, match="recorded"):
            launch.run_with_flower(cfg, cfg_path, [], tmp_path, args, ray_address=address)
    assert seen[0]["RAY_ADDRESS"] == "127.0.0.1:6379" and seen[0]["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert "RAY_ADDRESS" not in seen[1]


# --------------------------------------------------------------------------- a real two-node cluster


class RayNode:
    """One ``ray start --block`` process in a session of its own, with its own temp dir; every process it starts is
    noted (pid + start time) so that stop() signals exactly those."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.temp = Path(tempfile.mkdtemp(prefix=f"fa-{name}-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.log = self.temp.parent / f"{self.temp.name}.log"  # beside the temp dir: Ray owns the folder
        cmd = [str(BIN / "ray"), "start", "--block", "--temp-dir", str(self.temp), *args]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.owned: dict[int, int] = {}

    def wait_ready(self, timeout: float) -> bool:
        """True once `ray start` has written its cluster address (the node is up), False if it exited or timed out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.note()
            if (self.temp / "ray_current_cluster").is_file():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.3)
        return False

    def note(self) -> None:
        if self.proc.poll() is None:
            self.owned.update(launch.descendants(self.proc.pid))

    def alive(self) -> set[int]:
        out = {pid for pid, started in self.owned.items() if (launch._proc_stat(pid) or (0, -1))[1] == started}
        if self.proc.poll() is None:
            out.add(self.proc.pid)
        return out

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self, grace: float = 20.0) -> set[int]:
        """SIGTERM to the node's process group and to each noted process, SIGKILL after ``grace``; the pids left."""
        self.note()
        flwrcli.stop_processes(dict(self.owned), group=self.proc, grace=grace)
        return self.alive()


def _ports(*names: str) -> list[str]:
    return [arg for name in names for arg in (f"--{name}", str(launch.free_port()))]


@pytest.fixture
def two_node_cluster():
    """A Ray head and one worker node on 127.0.0.1, 1 CPU each; stopped (only them) afterwards, pass or fail."""
    if not (BIN / "ray").exists() or not (BIN / "flower-superlink").exists():
        pytest.skip(f"ray / flower-superlink are not installed next to {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",  # 0 (the offline default) forbids a second node
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS="1",
    )

    def common_args() -> list[str]:  # each node its own ports (two raylets share one machine)
        return [
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            "1",
            "--num-gpus",
            "0",
            "--disable-usage-stats",
            *_ports(
                "node-manager-port",
                "object-manager-port",
                "dashboard-agent-listen-port",
                "dashboard-agent-grpc-port",
                "runtime-env-agent-port",
                "metrics-export-port",
            ),
        ]

    port = launch.free_port()
    address = f"127.0.0.1:{port}"
    nodes: list[RayNode] = []
    started = False  # False: a node failed to come up (its temp dir and log are kept for a look)
    try:
        head = RayNode(
            "rayhead",
            [
                "--head",
                "--port",
                str(port),
                "--include-dashboard",
                "false",
                *_ports("ray-client-server-port", "dashboard-port"),
                *common_args(),
            ],
            env,
        )
        nodes.append(head)
        if not head.wait_ready(90):
            pytest.skip(f"Ray cannot start a head node here:\n{head.log_tail()}")
        worker = RayNode("rayworker", ["--address", address, *common_args()], env)
        nodes.append(worker)
        assert worker.wait_ready(90), f"the worker node did not join:\n{worker.log_tail()}"
        started = True
        yield address, head, worker
    finally:
        left: dict[str, set[int]] = {}
        for node in reversed(nodes):
            left[node.name] = node.stop()
        if started:
            for node in nodes:
                shutil.rmtree(node.temp, ignore_errors=True)
                node.log.unlink(missing_ok=True)
        assert not any(left.values()), f"Ray processes this test started are still running: {left}"


@pytest.mark.heavy
@pytest.mark.raycluster
def test_simulation_runs_on_both_nodes_of_a_two_node_ray_cluster(two_node_cluster, tiny_config, tmp_path):
    address, head, worker = two_node_cluster
    cfg = tiny_config(rounds=2, run_name="raycluster", data={"num_clients": 4})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # only the option names the cluster
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedapps_tools.cli",
            "run",
            str(cfg),
            "--ray-address",
            address,
            "--cpus-per-client",
            "1",
            "--output-dir",
            str(tmp_path / "res"),
            "--quiet",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    head.note()
    worker.note()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the CLI saw both nodes and sized the pool per node: 1 CPU per client on two 1-CPU nodes
    assert re.search(
        r"Ray cluster 127\.0\.0\.1:\d+ \(from --ray-address.*2 nodes alive, 2 CPUs.*-> 2 clients at once", out
    ), out[-3000:]
    rows = read_csv(tmp_path / "res" / "raycluster" / "rounds.csv")
    assert [r["clients"] for r in rows] == [4, 4]
    pid = int(re.search(r"^SuperLink 127\.0\.0\.1:\d+ \(pid (\d+)", proc.stdout, re.M).group(1))
    assert launch._proc_stat(pid) is None, "the SuperLink started by the run must be stopped"

    # Ray's own record (GCS actor table + task timeline): which node ran each ClientApp message
    doc = raycluster.probe(address, env, runs=True)
    nodes = {n["node_id"]: n for n in doc["nodes"] if n["alive"]}
    assert len(nodes) == 2, doc["nodes"]
    by_dir = {nid: n["raylet_socket"] for nid, n in nodes.items()}
    head_id = next(nid for nid, sock in by_dir.items() if sock.startswith(str(head.temp) + "/"))
    worker_id = next(nid for nid, sock in by_dir.items() if sock.startswith(str(worker.temp) + "/"))
    assert nodes[head_id]["head"] and not nodes[worker_id]["head"]
    assert len(doc["runs"]) == 1, doc["runs"]  # one simulation (one Ray job) ran ClientApps on this cluster
    per_node = next(iter(doc["runs"].values()))
    assert set(per_node) <= {head_id, worker_id}, per_node
    assert per_node.get(head_id, 0) >= 1 and per_node.get(worker_id, 0) >= 1, (
        f"ClientApp messages per node: {json.dumps(per_node)} (head {head_id[:8]}, worker {worker_id[:8]})"
    )
    assert sum(per_node.values()) >= 2 * 4, per_node  # every client trained in each of the 2 rounds
