"""Flower's Ray simulation on an existing Ray cluster: ``fedapps run CONFIG --ray-address HOST:PORT``.

Flower's Ray backend calls ``ray.init()`` without an address, so the ``RAY_ADDRESS`` in the environment of the
simulation process decides where the ClientApp actors run. That process is started by the SuperLink, which
copies its environment when it starts; ``fedapps run`` starts a SuperLink of its own for every run (own
``FLWR_HOME``), so it is started with the cluster's address in its environment (:func:`cluster_env`) and no
SuperLink started with another environment is ever reused.

Before anything starts, the address is checked (:func:`check_cluster`): a TCP connection, a gRPC handshake with
a short timeout, then a Ray driver in a subprocess with a timeout that lists the cluster's nodes (Ray itself
retries an unreachable or non-Ray address for minutes). The clients' resources (``--cpus-per-client``,
``--gpus-per-client``) are per actor and every node hosts ⌊its CPUs / CPUs per client⌋ actors (fewer when GPUs
bound it), as Flower counts them; a request no node can host is refused here, not by an empty actor pool later.

``python -m fedapps_tools.raycluster HOST:PORT [--json]`` lists the nodes of a cluster and how many ClientApp
messages (``ClientAppActor.run`` tasks, from Ray's GCS: the actor table and the task timeline) ran on each,
per Ray job: the evidence that a simulation used the nodes it was meant to.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from fedapps.config import ConfigError

OPTION = "--ray-address"
ENV_VAR = "RAY_ADDRESS"
LOCAL = "local"  # --ray-address local: a Ray instance of this run only, whatever RAY_ADDRESS says
ACTOR_CLASS = "ClientAppActor"  # Flower's Ray actor that runs ClientApp messages
RUN_TASK = f"task::{ACTOR_CLASS}.run"  # its task category in Ray's timeline
PROBE_TIMEOUT = 60.0  # seconds a probe driver may take to join the cluster and list its nodes


class RayClusterError(ConfigError):
    """The Ray cluster asked for cannot be used; the message names the option (or RAY_ADDRESS) and the fix."""


def requested_address(option: str | None, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The Ray cluster a run asks for and where the request came from: (``HOST:PORT`` or None, source).

    ``--ray-address`` wins over an exported ``RAY_ADDRESS``; ``--ray-address local`` (or neither) means Flower
    starts a Ray instance of this run's own (None)."""
    if option is not None and option.strip():
        value, source = option.strip(), OPTION
    elif environ.get(ENV_VAR, "").strip():
        value, source = environ[ENV_VAR].strip(), ENV_VAR
    else:
        return None, ""
    if value == LOCAL:
        return None, source
    parse_address(value, source)
    return value, source


def parse_address(address: str, source: str = OPTION) -> tuple[str, int]:
    """``HOST:PORT`` of a Ray head (its GCS, ``ray start --head --port PORT``, default 6379) -> (host, port)."""
    fix = (
        f"give the head node's GCS address HOST:PORT (`ray start --head --port 6379` prints it), e.g. "
        f"{OPTION} 10.0.0.1:6379, or {OPTION} {LOCAL} for a Ray instance of this run only"
    )
    if address == "auto":
        raise RayClusterError(
            f"{source}='auto' is not supported: it joins whichever cluster `ray start` last "
            f"started on this machine; {fix}"
        )
    if "://" in address:
        raise RayClusterError(
            f"{source}='{address}': Ray Client addresses (ray://) and URLs are not supported "
            f"(Flower runs its Ray driver on a node of the cluster); {fix}"
        )
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayClusterError(f"{source}='{address}' is not HOST:PORT; {fix}")
    return host, int(port)


def cluster_env(env: Mapping[str, str], address: str | None) -> dict[str, str]:
    """The environment for the SuperLink (and through it Flower's Ray driver) of a run on ``address``.

    With a cluster: ``RAY_ADDRESS`` set and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` (the offline default 0 makes
    Ray treat the machine as a one-node cluster on 127.0.0.1: a driver then finds no raylet of a cluster on a real
    network address, and `ray start --address` refuses to join). Without one: no ``RAY_ADDRESS`` at all."""
    out = dict(env)
    out.pop(ENV_VAR, None)
    if address is not None:
        out[ENV_VAR] = address
        out["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    return out


def client_resources(federation_config: str, cpus: float, gpus: float) -> tuple[float, float]:
    """CPUs and GPUs per client: the ``client-resources-num-*`` of a raw ``--federation-config`` when it names
    them (Flower's defaults 2 and 0 when it does not), else the ``--cpus/gpus-per-client`` values."""
    if not federation_config.strip():
        return float(cpus), float(gpus)
    pairs = dict(item.split("=", 1) for item in shlex.split(federation_config) if "=" in item)
    try:
        return (float(pairs.get("client-resources-num-cpus", 2)), float(pairs.get("client-resources-num-gpus", 0)))
    except ValueError as exc:
        raise RayClusterError(
            f"--federation-config '{federation_config}': client-resources-num-cpus/gpus must be numbers ({exc})"
        ) from exc


def actors_per_node(nodes: list[dict[str, Any]], cpus: float, gpus: float) -> dict[str, int]:
    """How many client actors of ``cpus`` CPUs and ``gpus`` GPUs each alive node hosts at once (Flower's rule:
    ⌊CPUs / cpus⌋, bounded by ⌊GPUs / gpus⌋ when clients ask for a GPU share; a node without GPUs hosts none
    then)."""
    if cpus <= 0:
        raise RayClusterError(f"--cpus-per-client must be > 0 on a Ray cluster (got {cpus:g})")
    out: dict[str, int] = {}
    for node in nodes:
        if not node.get("alive"):
            continue
        n = int(float(node.get("cpus", 0)) // cpus)
        if gpus > 0:
            n = min(n, int(float(node.get("gpus", 0)) // gpus))
        out[node["node_id"]] = n
    return out


def check_reachable(address: str, source: str, timeout: float = 5.0) -> None:
    """A TCP connection, then one call of the Ray GCS's own API (``GetClusterId``, with a timeout): a closed port, an
    unreachable host or a service that is not a Ray head fail here within seconds (Ray's driver retries them for
    minutes)."""
    host, port = parse_address(address, source)
    where = f"{source}={address}"
    fix = (
        "start the cluster first (`ray start --head --port PORT` on the head node, then `ray start --address "
        f"HEAD:PORT` on every worker node), fix the address, or pass {OPTION} {LOCAL} to run on a Ray instance of "
        "this run only"
    )
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise RayClusterError(f"{where}: cannot connect to a Ray head there ({exc.strerror or exc}); {fix}") from exc
    import grpc  # installed with flwr (and Ray)
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # the installed Ray's own GCS API

    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]  # made by protobuf at import
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(request, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        what = (
            "a gRPC service that is not a Ray head answers there (a Flower SuperLink? `fedapps run --superlink` "
            "takes that)"
            if code == grpc.StatusCode.UNIMPLEMENTED
            else f"something listens there but does not answer as a Ray head within {timeout:g} s ({code})"
        )
        raise RayClusterError(f"{where}: {what}; {fix}") from exc
    finally:
        channel.close()


def probe(
    address: str, env: Mapping[str, str], timeout: float = PROBE_TIMEOUT, runs: bool = False, source: str = OPTION
) -> dict[str, Any]:
    """Join the cluster with a Ray driver in a subprocess (killed after ``timeout`` s) and return what
    :func:`describe` found there."""
    cmd = [sys.executable, "-m", "fedapps_tools.raycluster", address, "--json"] + (["--runs"] if runs else [])
    try:
        proc = subprocess.run(
            cmd,
            env=cluster_env(env, address),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise RayClusterError(
            f"{source}={address}: a Ray driver could not join the cluster within {timeout:g} s. Is this machine a "
            "node of that cluster (run `fedapps run` on the head node, or on a machine that joined it with `ray "
            "start --address`), and is it the same Ray and Python version everywhere?"
        ) from exc
    text = proc.stdout.strip()
    try:
        doc = json.loads(text.splitlines()[-1]) if text else None
    except ValueError:
        doc = None
    if proc.returncode != 0 or not isinstance(doc, dict):
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-15:])
        raise RayClusterError(
            f"{source}={address}: a Ray driver could not join the cluster (exit {proc.returncode}):\n{tail}"
        )
    return doc


def check_cluster(
    address: str, source: str, env: Mapping[str, str], cpus: float, gpus: float, timeout: float = PROBE_TIMEOUT
) -> dict[str, Any]:
    """Refuse (RayClusterError) a Ray cluster that cannot take this run's clients; return its description."""
    check_reachable(address, source)
    doc = probe(address, env, timeout=timeout, source=source)
    fit = actors_per_node(doc["nodes"], cpus, gpus)
    alive = [n for n in doc["nodes"] if n.get("alive")]
    if sum(fit.values()) == 0:
        have = ", ".join(f"{n['node_id'][:8]}: {n['cpus']:g} CPUs, {n['gpus']:g} GPUs" for n in alive) or "none alive"
        raise RayClusterError(
            f"{source}={address}: no node of the Ray cluster can host a client with {cpus:g} CPUs and {gpus:g} GPUs "
            f"(nodes: {have}); lower --cpus-per-client / --gpus-per-client (or client-resources-num-cpus/gpus in "
            "--federation-config), or add nodes with `ray start --address HEAD:PORT --num-cpus N [--num-gpus G]`"
        )
    doc["actors_per_node"] = fit
    return doc


def summary_line(address: str, source: str, doc: dict[str, Any], cpus: float, gpus: float) -> str:
    """One line about the cluster a run will use."""
    alive = [n for n in doc["nodes"] if n.get("alive")]
    fit = doc["actors_per_node"]
    per_node = ", ".join(f"{nid[:8]} {k}" for nid, k in fit.items())
    return (
        f"Ray cluster {address} (from {source}, Ray {doc['ray_version']}): {len(alive)} nodes alive, "
        f"{sum(n['cpus'] for n in alive):g} CPUs, {sum(n['gpus'] for n in alive):g} GPUs; {cpus:g} CPUs + "
        f"{gpus:g} GPUs per client -> {sum(fit.values())} clients at once ({per_node})"
    )


# --------------------------------------------------------------------------- the probe driver (a subprocess)


def runs_per_node(
    actors: Mapping[str, Mapping[str, Any]], timeline: list[Mapping[str, Any]]
) -> dict[str, dict[str, int]]:
    """{job id: {node id: ClientApp messages run there}} from Ray's actor table and task timeline.

    An actor task's id ends with its actor's id; the actor table says on which node each actor lived."""
    where = {
        aid: (str(a.get("JobID", "")), str((a.get("Address") or {}).get("NodeID", "")))
        for aid, a in actors.items()
        if a.get("ActorClassName") == ACTOR_CLASS
    }
    out: dict[str, dict[str, int]] = {}
    for event in timeline:
        if event.get("cat") != RUN_TASK:
            continue
        task_id = str((event.get("args") or {}).get("task_id", ""))
        for aid, (job, node) in where.items():
            if aid and task_id.endswith(aid):
                out.setdefault(job, {}).setdefault(node, 0)
                out[job][node] += 1
                break
    return out


def describe(address: str, runs: bool) -> dict[str, Any]:
    """Join the cluster as a Ray driver (this process) and describe it: nodes, and with ``runs`` the ClientApp
    messages each node ran per job."""
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        nodes = [
            {
                "node_id": n["NodeID"],
                "alive": bool(n.get("Alive")),
                "ip": n.get("NodeManagerAddress", ""),
                "head": "node:__internal_head__" in (n.get("Resources") or {}),
                "cpus": float((n.get("Resources") or {}).get("CPU", 0)),
                "gpus": float((n.get("Resources") or {}).get("GPU", 0)),
                "raylet_socket": n.get("RayletSocketName", ""),
            }
            for n in ray.nodes()
        ]
        doc: dict[str, Any] = {"ray_version": ray.__version__, "nodes": nodes}
        if runs:
            from ray._private import state  # the GCS actor table (ray.util.state needs the dashboard)

            doc["runs"] = runs_per_node(state.actors(), ray.timeline())
        return doc
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedapps_tools.raycluster",
        description="List a Ray cluster's nodes and the ClientApp messages each ran.",
    )
    p.add_argument("address", help="the head's HOST:PORT")
    p.add_argument("--json", action="store_true", help="one JSON document (what `fedapps run` reads)")
    p.add_argument("--runs", action="store_true", help="also count ClientApp messages per job and node")
    args = p.parse_args(argv)
    if args.json:
        doc = describe(args.address, args.runs)
        print(json.dumps(doc), flush=True)
        return 0
    try:
        check_reachable(args.address, "address")
        doc = probe(args.address, os.environ, runs=True, source="address")
    except RayClusterError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"Ray {doc['ray_version']} at {args.address}")
    for n in doc["nodes"]:
        print(
            f"  node {n['node_id']}  {n['ip']:<15} {'head' if n['head'] else 'worker'}  "
            f"{'alive' if n['alive'] else 'dead '}  {n['cpus']:g} CPUs  {n['gpus']:g} GPUs"
        )
    for job, per_node in sorted(doc["runs"].items()):
        counts = ", ".join(f"{nid[:8]}: {k}" for nid, k in sorted(per_node.items()))
        print(f"  job {job}: ClientApp messages per node: {counts}")
    if not doc["runs"]:
        print("  no ClientApp messages ran on this cluster yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
