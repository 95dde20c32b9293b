"""`fedapps deploy ...`: a Flower deployment across machines, step by step (docs/deployment.md).

    certs DIR --host H [--host H2]    a CA and a SuperLink certificate whose SAN holds every given name/IP
    node-key DIR NAME                 a SuperNode key pair (OpenSSH ECDSA P-384): DIR/NAME and DIR/NAME.pub
                                      (--client-id C --max-num-examples N: its row in the node registry DIR/nodes.csv)
    node-cap DIR --client-id C --max-num-examples N   add or change a row of the node registry DIR/nodes.csv
    superlink --state S --host H ...  start a SuperLink (TLS, --auth: SuperNode authentication) in the background
    connect NAME --address H:P ...    write the CLI's connection NAME into $FLWR_HOME/config.toml
    register NAME KEY.pub             register a node's public key with the SuperLink (before the node starts)
    supernode --state S --superlink H:P --name N ...   start a SuperNode with its node config
    run CONFIG --link NAME            run a config (path relative to the app) and check its FINAL status
    stop --state S                    stop exactly the processes these commands started from S

Every process started here is recorded in <state>/pids/<name>.json (pid + start time, so a recycled pid is
never signalled); `stop` signals those and their descendants, nothing else. Plain-text (insecure) mode is
refused unless the address is a loopback one.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from fedapps.config import APP_DIR, REGISTRY_FILE, ConfigError, load_config
from fedapps_tools.flwrcli import (
    RunFailed,
    _alive,
    _proc_stat,
    descendants,
    failure_reasons,
    flower_env,
    follow_run,
    stop_processes,
    submit_run,
    toml_str,
)
from fedapps_tools.options import add_set_option

CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
RESULTS_LINE = re.compile(r"RESULTS (\S.*)$")


class DeployError(RuntimeError):
    """A deployment step that could not be done; the message says why and what to do."""


# ----------------------------------------------------------------------------------- certificates and keys


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback IPs (127.0.0.0/8, ::1); the only addresses plain-text mode may use."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def san_entries(hosts: list[str]) -> list[str]:
    """subjectAltName entries for the SuperLink certificate: each host as IP or DNS, plus loopback (the
    SuperLink's own ServerApp and a CLI on the same machine connect through it)."""
    out: list[str] = []
    for host in [*hosts, "127.0.0.1", "localhost"]:
        try:
            entry = f"IP:{ipaddress.ip_address(host.strip('[]'))}"
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
                raise DeployError(f"--host '{host}' is neither an IP address nor a DNS name") from None
            entry = f"DNS:{host}"
        if entry not in out:
            out.append(entry)
    return out


def _openssl(args: list[str], cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DeployError(f"openssl {args[0]} failed: {proc.stderr.strip()[-800:]}")


def make_certs(out: Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """A self-signed CA and a SuperLink certificate signed by it for ``hosts`` (RSA 2048; keys mode 0600).
    An existing CA in ``out`` is reused, so certificates for more hosts can be added later."""
    if shutil.which("openssl") is None:
        raise DeployError("openssl is not installed: install it (e.g. apt install openssl) to make certificates")
    if not hosts:
        raise DeployError("give the SuperLink's host names / IPs with --host (the address the SuperNodes dial)")
    out.mkdir(parents=True, exist_ok=True)
    if not (out / CA_CERT).is_file():
        _openssl(
            [
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                CA_KEY,
                "-out",
                CA_CERT,
                "-subj",
                "/CN=fedapps deployment CA",
                "-days",
                str(days),
                "-sha256",
            ],
            out,
        )
    (out / "server.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join(san_entries(hosts))}\n"
    )
    _openssl(
        [
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            SERVER_KEY,
            "-out",
            "server.csr",
            "-subj",
            f"/CN={hosts[0]}",
        ],
        out,
    )
    _openssl(
        [
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            CA_CERT,
            "-CAkey",
            CA_KEY,
            "-CAcreateserial",
            "-out",
            SERVER_CERT,
            "-days",
            str(days),
            "-sha256",
            "-extfile",
            "server.ext",
        ],
        out,
    )
    for key in (CA_KEY, SERVER_KEY):
        os.chmod(out / key, 0o600)
    return {"ca": out / CA_CERT, "cert": out / SERVER_CERT, "key": out / SERVER_KEY}


def make_node_key(out: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's key pair in the format Flower 1.42 wants (OpenSSH ECDSA P-384, no passphrase)."""
    if shutil.which("ssh-keygen") is None:
        raise DeployError(
            "ssh-keygen is not installed: install OpenSSH's client tools (e.g. apt install openssh-client)"
        )
    out.mkdir(parents=True, exist_ok=True)
    private = out / name
    if private.exists():
        raise DeployError(f"{private} exists: a node key is never overwritten; choose another name or delete it")
    proc = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-C", f"fedapps-{name}", "-f", str(private)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise DeployError(f"ssh-keygen failed: {proc.stderr.strip()}")
    return private, out / f"{name}.pub"


# ----------------------------------------------------------------------------------- processes


def pid_file(state: Path, name: str) -> Path:
    return state / "pids" / f"{name}.json"


def start_background(cmd: list[str], state: Path, name: str, env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in its own session, cwd ``state``, output to ``<state>/logs/<name>.log``, recorded for stop."""
    if pid_file(state, name).is_file() and _recorded_alive(pid_file(state, name)):
        raise DeployError(
            f"'{name}' is already running from {state} (see {pid_file(state, name)}); "
            f"stop it first: fedapps deploy stop --state {state} --only {name}"
        )
    (state / "logs").mkdir(parents=True, exist_ok=True)
    (state / "pids").mkdir(parents=True, exist_ok=True)
    log_path = state / "logs" / f"{name}.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd,
            cwd=state,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    st = _proc_stat(proc.pid)
    pid_file(state, name).write_text(
        json.dumps({"pid": proc.pid, "start": st[1] if st else None, "cmd": cmd, "log": str(log_path)})
    )
    return proc


def _recorded_alive(path: Path) -> bool:
    rec = json.loads(path.read_text())
    return _alive(int(rec["pid"]), rec.get("start"))


def stop_recorded(state: Path, only: str | None = None, grace: float = 10.0) -> list[str]:
    """SIGTERM every process recorded under ``state`` (and its descendants), SIGKILL what is left after
    ``grace`` seconds; return the names stopped. Processes not recorded there are never touched."""
    stopped: list[str] = []
    targets: dict[int, int | None] = {}
    for path in sorted((state / "pids").glob("*.json")):
        if only and path.stem != only:
            continue
        rec = json.loads(path.read_text())
        pid, start = int(rec["pid"]), rec.get("start")
        if _alive(pid, start):
            targets.update({pid: start, **descendants(pid)})
            stopped.append(path.stem)
        path.unlink()
    stop_processes(targets, grace=grace)
    return stopped


def wait_for_port(host: str, port: int, proc: subprocess.Popen, log_path: Path, timeout: float = 60.0) -> None:
    """Until ``host:port`` accepts a TCP connection; DeployError with the log's tail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DeployError(
                f"the process exited with status {proc.returncode}; its log {log_path}:\n{_tail(log_path)}"
            )
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise DeployError(f"nothing listens on {host}:{port} after {timeout:.0f} s; see {log_path}:\n{_tail(log_path)}")


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def superlink_command(host: str, port: int, certs: Path | None, auth: bool, insecure: bool) -> list[str]:
    """The ``flower-superlink`` command line: TLS from ``certs`` (ca.crt, server.pem, server.key), or plain text
    on a loopback host only; ``auth`` turns on SuperNode authentication (needs TLS)."""
    bindir = Path(sys.executable).parent
    cmd = [
        str(bindir / "flower-superlink"),
        "--host",
        host,
        "--port",
        str(port),
        "--database",
        "state.db",
        "--disable-runtime-dependency-installation",
    ]
    if insecure:
        if not is_loopback(host):
            raise DeployError(
                f"plain text (--insecure) is allowed on a loopback address only, not on '{host}': "
                "make certificates with `fedapps deploy certs` and pass --certs DIR"
            )
        if auth:
            raise DeployError("SuperNode authentication (--auth) needs TLS: pass --certs DIR instead of --insecure")
        return [*cmd, "--insecure"]
    if certs is None:
        raise DeployError("pass --certs DIR (made by `fedapps deploy certs`) or, on loopback only, --insecure")
    for f in (CA_CERT, SERVER_CERT, SERVER_KEY):
        if not (certs / f).is_file():
            raise DeployError(f"{certs / f} is missing: make it with `fedapps deploy certs {certs} --host {host}`")
    cmd += [
        "--ssl-ca-certfile",
        str(certs / CA_CERT),
        "--ssl-certfile",
        str(certs / SERVER_CERT),
        "--ssl-keyfile",
        str(certs / SERVER_KEY),
    ]
    return [*cmd, "--enable-supernode-auth"] if auth else cmd


def supernode_command(
    superlink: str, node_config: str, port: int, ca: Path | None, key: Path | None, insecure: bool
) -> list[str]:
    """The ``flower-supernode`` command line (its own Runtime API port on 127.0.0.1)."""
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "flower-supernode"), "--superlink", superlink, "--port", str(port)]
    if node_config:
        cmd += ["--node-config", node_config]
    if insecure:
        if not is_loopback(superlink.rsplit(":", 1)[0]):
            raise DeployError(
                f"plain text (--insecure) is allowed to a loopback SuperLink only, not '{superlink}': "
                "pass --ca ca.crt (from `fedapps deploy certs`)"
            )
        return [*cmd, "--insecure"]
    if ca is None or not ca.is_file():
        raise DeployError(f"pass --ca with the deployment's CA certificate (ca.crt); got {ca}")
    cmd += ["--root-certificates", str(ca)]
    if key is not None:
        if not key.is_file():
            raise DeployError(f"node key {key} not found: make it with `fedapps deploy node-key DIR NAME`")
        cmd += ["--auth-supernode-private-key", str(key)]  # Flower 1.42 derives the public key from it
    return cmd


def check_node_started(proc: subprocess.Popen, log_path: Path, seconds: float, offset: int = 0) -> bool:
    """Watch a new SuperNode for up to ``seconds``: True once it logs its SuperNode ID (the SuperLink accepted
    it), False if it is still connecting; DeployError if it exits (refused: e.g. an unregistered key gets HTTP
    412 and does not retry). ``offset``: where this start's output begins in the (appended) log."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = _tail(log_path)
            hint = ""
            if any(
                sign in tail for sign in ("Failed to activate SuperNode", "412", "not registered", "UNAUTHENTICATED")
            ):
                hint = (
                    "\nthe SuperLink refused this node's key: register its public key first "
                    "(`fedapps deploy register LINK KEY.pub` from the CLI machine), then start the node again"
                )
            raise DeployError(f"the SuperNode exited with status {proc.returncode} (log {log_path}):\n{tail}{hint}")
        if "SuperNode ID:" in _since(log_path, offset):
            return True
        time.sleep(0.3)
    return False


# ----------------------------------------------------------------------------------- the CLI's connections


def flwr_home() -> Path:
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser()


def connection_block(name: str, address: str, ca: Path | None, insecure: bool) -> str:
    if insecure and not is_loopback(address.rsplit(":", 1)[0]):
        raise DeployError(f"an insecure connection is allowed to a loopback address only, not '{address}'; pass --ca")
    if insecure:
        security = "insecure = true\n"
    elif ca is None or not ca.is_file():
        raise DeployError(f"pass --ca with the deployment's CA certificate (ca.crt); got {ca}")
    else:
        security = f"root-certificates = {toml_str(str(ca.resolve()))}\n"
    return f"[superlink.{name}]\naddress = {toml_str(address)}\n{security}"


def write_connection(home: Path, name: str, block: str) -> Path:
    """Add (or replace) the ``[superlink.NAME]`` table of ``$FLWR_HOME/config.toml``; other tables are kept."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise DeployError(f"connection name '{name}' may hold letters, digits, '-' and '_' only")
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    text = path.read_text() if path.is_file() else ""
    text = re.sub(rf"(?ms)^\[superlink\.{re.escape(name)}\]\n.*?(?=^\[|\Z)", "", text).rstrip()
    path.write_text((text + "\n\n" if text else "") + block)
    return path


# ----------------------------------------------------------------------------------- running a config


def app_relative_config(config: str) -> str:
    """The config as a path inside the app bundle (``configs/...``): the ServerApp reads it on the SuperLink's
    machine from the bundle, where an absolute path of this machine does not exist."""
    path = Path(config).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"config file '{config}' not found")
    try:
        return path.relative_to(APP_DIR).as_posix()
    except ValueError:
        raise ConfigError(
            f"config '{path}' is outside the app folder {APP_DIR}: only the app's files travel to the "
            "SuperLink (the bundle); copy it under configs/ and pass that path"
        ) from None


def results_dir(lines: list[str]) -> str | None:
    """The results folder the ServerApp reported (its ``RESULTS <dir>`` log line), on the SuperLink's machine."""
    for line in reversed(lines):
        m = RESULTS_LINE.search(line.rstrip())
        if m:
            return m.group(1).strip()
    return None


def fetch_results(remote: str, dest: Path, fetch_from: str | None) -> Path:
    """Copy the run's results folder here: directly when this machine sees the path (same host or shared
    file system), else with ``scp -r HOST:DIR`` when ``fetch_from`` names the SuperLink's host."""
    target = dest / Path(remote).name
    if Path(remote).is_dir():
        shutil.copytree(remote, target, dirs_exist_ok=True)
        return target
    if not fetch_from:
        raise DeployError(
            f"the results are in {remote} on the SuperLink's machine; copy them with "
            f"`scp -r LINKHOST:{remote} {dest}/` or rerun with --fetch-from USER@LINKHOST"
        )
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["scp", "-r", "-q", f"{fetch_from}:{remote}", str(dest)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DeployError(f"scp from {fetch_from} failed: {proc.stderr.strip()}")
    return target


def run_on_link(
    config: str, link: str, overrides: list[str], output_dir: str, fetch_to: Path, fetch_from: str | None, quiet: bool
) -> tuple[str, Path | None]:
    """Submit a config to the connection ``link``, follow it, require ``finished:completed`` (``flwr run
    --stream`` exits 0 on a failed run), then fetch the results folder. Returns (run id, local results)."""
    rel = app_relative_config(config)
    cfg = load_config(APP_DIR / rel, overrides)
    from strategies import resolve

    resolve(cfg)  # strategy and params checked here; the data is the nodes' (not loaded on this machine)
    env = flower_env()
    run_config = " ".join(
        [
            f"config={toml_str(rel)}",
            f"overrides={toml_str(' '.join(overrides))}",
            f"output-dir={toml_str(output_dir)}",
            'resume-dir=""',
        ]
    )
    run_id = submit_run(link, run_config, env)
    print(f"run {run_id} started on '{link}'", flush=True)
    status, lines = follow_run(run_id, env, quiet, None, connection=link)
    remote = results_dir(lines)
    if status != "finished:completed":
        raise RunFailed(f"run {run_id} ended with status '{status}':\n" + failure_reasons(lines, Path(remote or "-")))
    print(f"run {run_id}: {status}", flush=True)
    if remote is None:
        raise RunFailed(f"run {run_id} completed but its log names no results folder (RESULTS line)")
    local = fetch_results(remote, fetch_to, fetch_from)
    print(f"results: {local}", flush=True)
    return run_id, local


# ----------------------------------------------------------------------------------- command line


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "deploy",
        help="across machines: certificates, node keys, SuperLink/SuperNodes with "
        "TLS and authentication, runs on a named SuperLink, stop",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    sub = p.add_subparsers(dest="step", required=True)
    c = sub.add_parser("certs", help="a CA and a SuperLink certificate for the given host names / IPs")
    c.add_argument(
        "dir",
        type=Path,
        metavar="DIR",
        help="the folder the CA and the SuperLink's certificate and key "
        "are written to (ca.crt, server.pem, server.key)",
    )
    c.add_argument("--host", action="append", default=[], required=True, help="an address SuperNodes and the CLI dial")
    c.add_argument(
        "--days", type=int, default=365, metavar="N", help="how long the certificates are valid (default 365)"
    )
    k = sub.add_parser("node-key", help="a SuperNode key pair (OpenSSH ECDSA P-384)")
    k.add_argument("dir", type=Path, metavar="DIR", help="the folder the key pair is written to")
    k.add_argument("name", metavar="NAME", help="the key's file name: DIR/NAME (private) and DIR/NAME.pub")
    add_cap_arguments(k, required=False)
    nc = sub.add_parser("node-cap", help=f"add or change a client's row of the node registry DIR/{REGISTRY_FILE}")
    nc.add_argument("dir", type=Path, metavar="DIR", help="the folder of the node keys (the registry lies beside them)")
    nc.add_argument("--node", default="", help="the node's key name, for the operator's reference")
    add_cap_arguments(nc, required=True)
    s = sub.add_parser("superlink", help="start a SuperLink in the background")
    s.add_argument("--state", type=Path, required=True, help="its folder: database, logs, pid files, relative results")
    s.add_argument("--host", required=True, help="the address to serve on (in the certificate's SAN)")
    s.add_argument("--port", type=int, default=9092, help="the Fleet API port SuperNodes dial (default 9092)")
    s.add_argument(
        "--certs",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder with ca.crt, server.pem, server.key (of `certs`)",
    )
    s.add_argument("--auth", action="store_true", help="SuperNode authentication (register node keys first)")
    s.add_argument("--insecure", action="store_true", help="plain text; loopback addresses only")
    n = sub.add_parser("supernode", help="start a SuperNode in the background")
    n.add_argument("--state", type=Path, required=True, help="its folder: logs and pid files")
    n.add_argument("--name", required=True, help="a name for its log and pid file, e.g. node-3")
    n.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's Fleet API address")
    n.add_argument(
        "--node-config", default="", help="e.g. \"client-id=3 data-path='/data/site3.npz' state-dir='/var/fedapps'\""
    )
    n.add_argument(
        "--port", type=int, default=9094, help="its local Runtime API port, one per node on a machine (default 9094)"
    )
    n.add_argument("--ca", type=Path, default=None, help="the CA certificate (ca.crt of `certs`); TLS needs it")
    n.add_argument("--key", type=Path, default=None, help="its private key (KEY.pub beside it) when --auth is on")
    n.add_argument("--insecure", action="store_true", help="plain text; a loopback SuperLink only")
    n.add_argument(
        "--check-seconds",
        type=float,
        default=20.0,
        help="watch it until the SuperLink accepts it, at most this long (a refusal exits with status 2; default 20)",
    )
    cn = sub.add_parser("connect", help="write the CLI's connection NAME into $FLWR_HOME/config.toml")
    cn.add_argument("name", metavar="NAME", help="the connection's name, used later as `run --link NAME`")
    cn.add_argument("--address", required=True, metavar="HOST:PORT", help="the SuperLink's Control API address")
    cn.add_argument("--ca", type=Path, default=None, help="the CA certificate (ca.crt of `certs`); TLS needs it")
    cn.add_argument("--insecure", action="store_true", help="plain text; a loopback SuperLink only")
    r = sub.add_parser("register", help="register a SuperNode's public key (flwr supernode register)")
    r.add_argument("link", metavar="NAME", help="the connection (see `connect`) of the SuperLink to register with")
    r.add_argument("public_key", type=Path, metavar="KEY.pub", help="the SuperNode's public key (see `node-key`)")
    ru = sub.add_parser("run", help="run a config on a named SuperLink and fetch the results")
    ru.add_argument("config", metavar="CONFIG", help="a YAML file inside the app folder (e.g. configs/cwfedavg.yaml)")
    ru.add_argument("--link", required=True, metavar="NAME", help="connection name (see `connect`)")
    add_set_option(ru, "the config's keys")
    ru.add_argument(
        "--remote-output-dir",
        default="results",
        metavar="DIR",
        help="results root on the SuperLink's machine (relative: to the SuperLink's --state folder; default: results)",
    )
    ru.add_argument(
        "--fetch-to",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="local folder the results are copied to (default: results)",
    )
    ru.add_argument(
        "--fetch-from",
        default=None,
        metavar="USER@LINKHOST",
        help="scp the results from this host (default: the results folder is local: a shared or the same machine)",
    )
    ru.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    st = sub.add_parser("stop", help="stop the processes started from a state folder")
    st.add_argument("--state", type=Path, required=True, help="the --state folder they were started with")
    st.add_argument("--only", default=None, metavar="NAME", help="one name (superlink, node-3, ...; default: all)")
    return p


def add_cap_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    """--client-id and --max-num-examples: a client's row of the node registry (docs/deployment.md)."""
    parser.add_argument(
        "--client-id",
        type=int,
        default=None,
        required=required,
        help="the client id the node serves (its node config client-id)",
    )
    parser.add_argument(
        "--max-num-examples",
        type=int,
        default=None,
        required=required,
        help=f"the most training examples that client may claim; recorded in DIR/{REGISTRY_FILE}, "
        "which the server's data.node_registry names (replies above it are rejected)",
    )


def record_cap(directory: Path, client_id: int | None, max_num_examples: int | None, node: str) -> Path | None:
    """Write a client's cap into ``directory``'s registry (both or neither of the two values; None: nothing)."""
    if client_id is None and max_num_examples is None:
        return None
    if client_id is None or max_num_examples is None:
        raise DeployError("give both --client-id and --max-num-examples (a registry row needs the two)")
    if client_id < 0 or max_num_examples <= 0:
        raise DeployError(
            f"--client-id must be >= 0 and --max-num-examples > 0, got {client_id} and {max_num_examples}"
        )
    from fedapps.data.nodes import record_node  # the data package imports torch: only the commands that need it

    path = directory / REGISTRY_FILE
    record_node(path, client_id, max_num_examples, node)
    return path


def run(args: argparse.Namespace) -> int:
    try:
        return dispatch(args)
    except (DeployError, ConfigError) as exc:
        print(f"deploy {args.step}: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"run failed: {exc}", file=sys.stderr)
        return 1


def dispatch(args: argparse.Namespace) -> int:
    env = flower_env()
    if args.step == "certs":
        made = make_certs(args.dir, args.host, args.days)
        print(
            f"CA {made['ca']} (give it to every SuperNode and CLI machine); SuperLink certificate {made['cert']}, "
            f"key {made['key']} (SuperLink machine only) for {', '.join(san_entries(args.host))}"
        )
    elif args.step == "node-key":
        if (args.client_id is None) != (args.max_num_examples is None):
            raise DeployError("give both --client-id and --max-num-examples (a registry row needs the two), or neither")
        private, public = make_node_key(args.dir, args.name)
        print(f"private key {private} (stays on the node); public key {public} (register it on the SuperLink)")
        registry = record_cap(args.dir, args.client_id, args.max_num_examples, args.name)
        if registry is not None:
            print(
                f"client {args.client_id} may claim at most {args.max_num_examples} examples: {registry} (name it in "
                "the server's config: data.node_registry)"
            )
    elif args.step == "node-cap":
        registry = record_cap(args.dir, args.client_id, args.max_num_examples, args.node)
        print(f"client {args.client_id} may claim at most {args.max_num_examples} examples: {registry}")
    elif args.step == "superlink":
        state = args.state.resolve()
        cmd = superlink_command(
            args.host, args.port, args.certs.resolve() if args.certs else None, args.auth, args.insecure
        )
        proc = start_background(cmd, state, "superlink", env)
        wait_for_port(args.host, args.port, proc, state / "logs" / "superlink.log")
        mode = (
            "PLAIN TEXT (loopback only)"
            if args.insecure
            else "TLS" + (" + SuperNode authentication" if args.auth else "")
        )
        print(f"SuperLink {args.host}:{args.port} [{mode}] pid {proc.pid}; state {state}")
    elif args.step == "supernode":
        state = args.state.resolve()
        cmd = supernode_command(
            args.superlink,
            args.node_config,
            args.port,
            args.ca.resolve() if args.ca else None,
            args.key.resolve() if args.key else None,
            args.insecure,
        )
        log_path = state / "logs" / f"{args.name}.log"
        offset = log_path.stat().st_size if log_path.is_file() else 0
        proc = start_background(cmd, state, args.name, env)
        try:
            accepted = check_node_started(proc, log_path, args.check_seconds, offset)
        except DeployError:
            stop_recorded(state, only=args.name, grace=2)
            raise
        status = "connected" if accepted else f"still connecting after {args.check_seconds:g} s"
        print(f"SuperNode '{args.name}' -> {args.superlink} pid {proc.pid} ({status}); log {log_path}")
    elif args.step == "connect":
        path = write_connection(
            flwr_home(), args.name, connection_block(args.name, args.address, args.ca, args.insecure)
        )
        print(f"connection '{args.name}' -> {args.address} written to {path}")
    elif args.step == "register":
        if not args.public_key.is_file():
            raise DeployError(f"public key {args.public_key} not found")
        done = subprocess.run(
            ["flwr", "supernode", "register", str(args.public_key.resolve()), args.link],
            env=env,
            capture_output=True,
            text=True,
            cwd=APP_DIR,
            stdin=subprocess.DEVNULL,
        )
        out = (done.stdout + done.stderr).strip()
        if done.returncode != 0 or "❌" in out:
            raise DeployError(f"registering {args.public_key} with '{args.link}' failed: {out[-1500:]}")
        print(out.splitlines()[-1] if out else f"registered {args.public_key}")
    elif args.step == "run":
        run_on_link(
            args.config,
            args.link,
            args.overrides,
            args.remote_output_dir,
            args.fetch_to.resolve(),
            args.fetch_from,
            args.quiet,
        )
    elif args.step == "stop":
        stopped = stop_recorded(args.state.resolve(), args.only)
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0
