"""Process control of a run: the SuperLink a run starts and stops (:class:`OwnSuperLink`), `flwr run` submitted and
followed (:func:`run_with_flower`), the in-process engine (:func:`run_in_process`), and :func:`execute`, which
validates a config and the data before anything starts, then runs it on one of the two engines. Used by `fedapps
run`, `compare` and `tune` (the commands' parsers are in their own modules; this one parses nothing)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from fedapps.config import ConfigError, ExperimentConfig, load_config
from fedapps.importpath import shadowed_modules
from fedapps.reporting.results import EXIT_FAILED, summary_exit_status
from fedapps_tools import raycluster, runnames
from fedapps_tools.devicecheck import check_devices
from fedapps_tools.flwrcli import (
    CONNECTION,
    RunFailed,
    _proc_stat,
    descendants,
    failure_reasons,
    flower_env,
    follow_run,
    stop_processes,
    stop_run,
    submit_run,
    toml_str,
)
from fedapps_tools.logfilter import LogFilter, command_logging
from fedapps_tools.options import resolve_root


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read what the kernel gave)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- processes this run owns


class OwnSuperLink:
    """A ``flower-superlink`` in simulation mode that this run starts and stops: free port on 127.0.0.1, its own
    ``FLWR_HOME`` (state, app bundles, log), its own session/process group.

    Flower detaches what the SuperLink starts (SuperExec and the simulation process run in sessions of their
    own), so the process group alone does not hold them: every descendant seen while the run goes is noted
    (pid + start time, so a recycled pid is never signalled) and stopped with it. Nothing else is touched."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.env = dict(env, FLWR_HOME=str(home))
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.owned: dict[int, int] = {}  # pid -> start time of everything this SuperLink started

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.home / "superlink.log"

    def launch(self) -> None:
        """Start the process on a free port and return at once (:meth:`start` waits until it answers)."""
        self.port = free_port()
        cmd = [
            "flower-superlink",
            "--insecure",
            "--simulation",
            "--isolation",
            "subprocess",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--database",
            str(self.home / "state.db"),
            "--log-file",
            str(self.log_file),
            "--disable-runtime-dependency-installation",
        ]
        with (self.home / "superlink.out").open("ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start(self, timeout: float = 60.0, attempts: int = 3) -> str:
        """Start it (unless :meth:`launch` already did) and wait until its HTTP API answers; a port taken in between
        is retried with another."""
        for _attempt in range(attempts):
            if self.proc is None:
                self.launch()
            assert self.proc is not None
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if self._healthy():
                    return self.address
                time.sleep(0.1)
            if self.proc.poll() is None:  # no answer in time: give up on this one
                self.stop()
                break
            self.proc = None
        raise RunFailed(f"could not start flower-superlink (see {self.log_file} and {self.home / 'superlink.out'})")

    def discard(self) -> None:
        """Stop it and remove its FLWR_HOME: a run that never started on it (a config error found meanwhile)."""
        self.stop()
        shutil.rmtree(self.home, ignore_errors=True)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=0.5) as resp:
                return 200 <= resp.status < 300
        except (OSError, ValueError):
            return False

    def note_children(self) -> None:
        """Remember every process the SuperLink has started so far (they may be re-parented later)."""
        if self.proc is not None:
            self.owned.update(descendants(self.proc.pid))

    def pids(self) -> set[int]:
        """The SuperLink and every process it started that is still alive (same pid AND same start time)."""
        self.note_children()
        alive = {pid for pid, started in self.owned.items() if (_proc_stat(pid) or (0, -1))[1] == started}
        if self.proc is not None and self.proc.poll() is None:
            alive.add(self.proc.pid)
        return alive

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the SuperLink's process group and to each process it started; SIGKILL what is left after
        ``grace`` seconds (an interrupted run: :data:`INTERRUPT_GRACE`)."""
        if self.proc is None:
            return
        self.note_children()
        stop_processes(dict(self.owned), group=self.proc, grace=grace)


# Ctrl-C: seconds the run's processes get after SIGTERM before SIGKILL. Ray's exit within ~3 s of SIGTERM and the
# rounds stop with them; the SuperLink itself takes longer than 15 s; an atomic checkpoint survives SIGKILL.
INTERRUPT_GRACE = 2.0


def write_connection(home: Path, address: str) -> None:
    """``$FLWR_HOME/config.toml`` with one connection, CONNECTION -> ``address`` (insecure loopback)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = {toml_str(address)}\n'
        "insecure = true\n"
    )


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside: SIGTERM raises KeyboardInterrupt, so clean-up runs on `kill` as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def flower_number(v: float) -> str:
    """A resource amount as `--federation-config` takes it: "1", not "1.0", for whole numbers."""
    return str(int(v)) if float(v).is_integer() else str(v)


def federation_config(cfg: ExperimentConfig, args: argparse.Namespace) -> str:
    """--federation-config: one SuperNode per client, CPUs/GPUs per client."""
    if args.federation_config:
        return args.federation_config
    return (
        f"num-supernodes={args.supernodes or cfg.data.num_clients} "
        f"client-resources-num-cpus={flower_number(args.cpus_per_client)} "
        f"client-resources-num-gpus={flower_number(args.gpus_per_client)}"
    )


def start_run(
    cfg: ExperimentConfig,
    config_path: Path,
    overrides: list[str],
    output_dir: Path,
    args: argparse.Namespace,
    env: dict[str, str],
) -> str:
    """`flwr run APP fedapps --format json ...`: submit the run, return its id (from Flower's JSON)."""
    run_config = " ".join(
        [
            f"config={toml_str(str(config_path))}",
            f"overrides={toml_str(' '.join(overrides))}",
            f"output-dir={toml_str(str(output_dir))}",
            f"resume-dir={toml_str(str(getattr(args, 'resume', None) or ''))}",
            f"keep-state={'true' if getattr(args, 'keep_state', False) else 'false'}",
        ]
    )
    return submit_run(CONNECTION, run_config, env, ["--federation-config", federation_config(cfg, args)])


def new_superlink(ray_address: str | None) -> OwnSuperLink:
    """A SuperLink of this run's own (not started yet): a fresh FLWR_HOME, the offline environment, and
    ``ray_address`` (the Ray cluster its simulation joins; None: a Ray instance of the run's own)."""
    home = Path(tempfile.mkdtemp(prefix="fedapps-flwr-"))
    return OwnSuperLink(home, raycluster.cluster_env(flower_env(), ray_address))


def run_with_flower(
    cfg: ExperimentConfig,
    config_path: Path,
    overrides: list[str],
    output_dir: Path,
    args: argparse.Namespace,
    ray_address: str | None = None,
    link: OwnSuperLink | None = None,
) -> Path:
    """`flwr run` the app on a SuperLink this run starts (or ``--superlink ADDRESS``); raise RunFailed unless the
    run completed. Only the processes this run started are stopped, also on Ctrl-C/SIGTERM or an error.
    ``ray_address``: the Ray cluster the simulation runs on (in the new SuperLink's environment); None: a Ray
    instance of the run's own (no RAY_ADDRESS reaches the SuperLink). ``link``: the run's SuperLink, already
    launched (see :func:`execute`); None: one is started here."""
    if args.superlink:
        home = Path(tempfile.mkdtemp(prefix="fedapps-flwr-"))
        env = dict(flower_env(), FLWR_HOME=str(home))
    else:
        link = link if link is not None else new_superlink(ray_address)
        home, env = link.home, link.env
    result_dir = Path(args.resume) if getattr(args, "resume", None) else output_dir / cfg.resolved_run_name()
    ok = interrupted = False
    run_id = ""
    try:
        with sigterm_as_interrupt():
            if link is None:
                address = args.superlink
            else:
                address = link.start()
                assert link.proc is not None  # start() returned: it runs
                print(f"SuperLink {address} (pid {link.proc.pid}, FLWR_HOME {home})", flush=True)
            write_connection(home, address)
            submitted = time.time()
            run_id = start_run(cfg, config_path, overrides, output_dir, args, env)
            print(f"run {run_id} started on {address}", flush=True)
            status, lines = follow_run(run_id, env, args.quiet, link, log_filter=getattr(args, "log_filter", None))
            if status != "finished:completed":
                failed = RunFailed(f"run {run_id} ended with status '{status}':\n{failure_reasons(lines, result_dir)}")
                # the ServerApp's verdict where it wrote one in this run (summary.json exit_status), else 1
                failed.exit_status = summary_exit_status(result_dir / "summary.json", submitted - 1) or EXIT_FAILED
                raise failed
        ok = True
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: the run stops (its checkpoint stays, for --resume)
        interrupted = True
        if run_id and (link is None or args.keep_superlink):  # a SuperLink this command does not stop
            stopped = stop_run(run_id, env)
            print(
                f"run {run_id} {'stopped' if stopped else 'could not be stopped: flwr stop ' + run_id}", file=sys.stderr
            )
        raise
    finally:
        if link is not None:
            if args.keep_superlink and link.proc is not None:  # None: it never started
                print(
                    f"SuperLink left running: {link.address}, pid {link.proc.pid} (stop it with kill {link.proc.pid})"
                )
            else:
                link.stop(grace=INTERRUPT_GRACE if interrupted else 10.0)
        if ok and not args.keep_superlink:
            shutil.rmtree(home, ignore_errors=True)
        elif not ok:
            print(f"Flower's state and logs kept in {home}", file=sys.stderr)
    if not (result_dir / "summary.json").is_file():
        raise RunFailed(f"run completed but {result_dir}/summary.json is missing")
    return result_dir


def run_in_process(
    cfg: ExperimentConfig,
    config_path: Path,
    overrides: list[str],
    output_dir: Path,
    resume: str | None = None,
    keep_state: bool = False,
) -> Path:
    """The same strategy and client code without Ray: clients served in this process, several at a time on threads
    (FEDAPPS_INPROCESS_WORKERS, default the usable CPUs), each with FEDAPPS_CLIENT_THREADS torch threads (default 1)."""
    import torch

    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    torch.set_num_threads(int(os.environ.get("FEDAPPS_CLIENT_THREADS", "1")))
    server_app.run_experiment(
        InProcessGrid(cfg.data.num_clients),
        str(config_path),
        " ".join(overrides),
        str(output_dir),
        resume_dir=resume or "",
        keep_state=keep_state,
    )
    return Path(resume) if resume else output_dir / cfg.resolved_run_name()


def check_output_dir(out: Path) -> None:
    """The results root must be (or become) a writable folder: checked before any process starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".fedapps-write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"output directory '{out}' is not writable ({exc.strerror or exc}); "
            "pass --output-dir DIR (or set output_dir) to a folder you can write"
        ) from exc


def preflight(cfg: ExperimentConfig, overrides: Sequence[str] = ()) -> None:
    """What can be checked before a run starts: strategy and params, then the data (loaded and partitioned
    here, so a DataError is a message and exit 2, not a failed Flower run); keys set but not read by the run are
    reported (a warning each)."""
    import dataclasses

    from fedapps.data import get_federation
    from strategies import report_ignored, resolve  # local: the strategies (torch, flwr) load only when a run starts

    resolve(cfg)  # strategy.name and strategy.params: a bad one fails here, before flwr run starts
    report_ignored(cfg, overrides)
    get_federation(dataclasses.asdict(cfg.data))


def ray_cluster_request(args: argparse.Namespace) -> tuple[str | None, str]:
    """The Ray cluster this run's simulation joins (``--ray-address``, else an exported RAY_ADDRESS) and where that
    came from; (None, ...) for a Ray instance of the run's own. Combinations that cannot work are refused."""
    option = getattr(args, "ray_address", None)
    if option and option.strip() == raycluster.LOCAL:
        option = raycluster.LOCAL
    elif option and getattr(args, "engine", "flower") != "flower":
        raise raycluster.RayClusterError(
            "--ray-address needs --engine flower (the in-process engine runs no Ray); drop one of the two"
        )
    if option and option != raycluster.LOCAL and getattr(args, "superlink", ""):
        raise raycluster.RayClusterError(
            "--ray-address cannot be combined with --superlink: a running SuperLink simulates on the Ray cluster of "
            "its own environment (start it with RAY_ADDRESS=HOST:PORT); drop one of the two"
        )
    if getattr(args, "engine", "flower") != "flower" or getattr(args, "superlink", ""):
        return None, ""
    address, source = raycluster.requested_address(option, os.environ)
    fed = getattr(args, "federation_config", "") or ""
    if address and re.search(r"\binit-args-num-(cpus|gpus)\b", fed):
        raise raycluster.RayClusterError(
            f"--federation-config sets init-args-num-cpus/gpus, which Ray refuses when joining the cluster of "
            f"{source}={address} (a cluster's resources are those of its nodes: `ray start --num-cpus/--num-gpus`); "
            "remove them"
        )
    return address, source


def check_ray_cluster(args: argparse.Namespace, address: str, source: str) -> None:
    """The cluster answers as a Ray head and some node can host a client of the requested size (RayClusterError
    otherwise); prints what the run will use."""
    cpus, gpus = raycluster.client_resources(
        getattr(args, "federation_config", "") or "",
        getattr(args, "cpus_per_client", 1),
        getattr(args, "gpus_per_client", 0),
    )
    doc = raycluster.check_cluster(address, source, flower_env(), cpus, gpus)
    print(raycluster.summary_line(address, source, doc, cpus, gpus), flush=True)


def check_gpu_request(args: argparse.Namespace) -> None:
    """A GPU share for the local Ray engine needs a visible GPU; without one Ray's actor pool stays empty and the
    run dies with "ActorPool is empty" after start-up. (A remote --superlink has its own machines: not checked.)"""
    gpus = float(getattr(args, "gpus_per_client", 0) or 0)
    if gpus <= 0 or getattr(args, "engine", "flower") != "flower" or getattr(args, "superlink", ""):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--gpus-per-client {gpus:g} asks Ray for a share of a GPU, but no CUDA GPU is visible on "
            "this machine; drop the option (or pass --gpus-per-client 0) to run the clients on the CPU"
        )


def resolved_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """The config as the run records it (the chosen strategy's params with every default filled in)."""
    from strategies import resolve

    return resolve(cfg).config(cfg)


def new_run_folder(
    cfg: ExperimentConfig, config_path: Path, overrides: list[str], out: Path, overwrite: bool
) -> tuple[ExperimentConfig, list[str]]:
    """A new run's folder: the config's ``run_name``, else one derived from the resolved config (see
    :mod:`fedapps_tools.runnames`), handed to the run as ``run_name=...`` so that both engines write there. The
    folder must be unused; ``overwrite`` removes an earlier run's folder first. Returns the config and overrides
    the run starts with."""
    from fedapps import checkpoint

    if not cfg.run_name:
        overrides = [*overrides, f"run_name={runnames.derived_name(resolved_config(cfg))}"]
        cfg = load_config(config_path, overrides)
    folder = out / cfg.resolved_run_name()
    if overwrite and runnames.replace_run(folder):
        print(f"--overwrite: removed the earlier run in {folder}", flush=True)
    try:
        checkpoint.check_fresh(folder)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or replace it on purpose: add --overwrite") from None
    return cfg, overrides


def execute(config: str, overrides: list[str], output_dir: str | None, args: argparse.Namespace) -> Path:
    """Validate, run (flwr or in-process) and return the results folder.

    The flower engine's own SuperLink is launched once the config has parsed and boots (~2 s of one core) while
    the strategy, its parameters and the data are checked in this process (~2 s of the other: torch and the data);
    an error found meanwhile stops it again and removes its FLWR_HOME before the exit 2: no run is submitted."""
    shadowed = shadowed_modules()  # before anything imports them: a user's strategies.py would be imported instead
    if shadowed:
        raise ConfigError("; ".join(shadowed))
    config_path = Path(config).expanduser().resolve()
    if not config_path.is_file():
        raise ConfigError(f"config file '{config}' not found; pass the path of a YAML file (e.g. configs/default.yaml)")
    cfg = load_config(config_path, overrides)
    out = resolve_root(output_dir, cfg.output_dir)
    check_output_dir(out)
    ray_address, ray_source = ray_cluster_request(args)
    if ray_address:
        check_ray_cluster(args, ray_address, ray_source)  # the cluster's GPUs count, not this machine's
    link: OwnSuperLink | None = None
    with sigterm_as_interrupt():
        try:
            if args.engine == "flower" and not args.superlink:
                link = new_superlink(ray_address)
                link.launch()
            preflight(cfg, overrides)
            if getattr(args, "resume", None):
                args.resume = str(Path(args.resume).expanduser().resolve())
                from fedapps import checkpoint
                from fedapps.config import dump_yaml

                saved = checkpoint.load_checkpoint(args.resume)  # refuse here, before flwr run starts
                checkpoint.check_same_config(saved["config"], dump_yaml(resolved_config(cfg)), args.resume)
                if not cfg.run_name:  # the run keeps its name (derived when it started: see new_run_folder)
                    overrides = [*overrides, f"run_name={Path(args.resume).name}"]
                    cfg = load_config(config_path, overrides)
            else:  # a new run: a folder of its own, which must not hold an earlier run's files
                cfg, overrides = new_run_folder(cfg, config_path, overrides, out, getattr(args, "overwrite", False))
            check_devices(
                resolved_config(cfg),
                args.engine,
                raycluster.client_resources(
                    getattr(args, "federation_config", "") or "", args.cpus_per_client, args.gpus_per_client
                )[1],
                superlink=bool(args.superlink),
                ray_cluster=bool(ray_address),
            )
            if not ray_address:
                check_gpu_request(args)
        except BaseException:
            if link is not None:
                link.discard()
            raise
        if args.engine != "inprocess":  # still under the SIGTERM handler: the launched SuperLink is never left behind
            return run_with_flower(cfg, config_path, overrides, out, args, ray_address=ray_address, link=link)
    return run_in_process(
        cfg, config_path, overrides, out, getattr(args, "resume", None), getattr(args, "keep_state", False)
    )


def start_logging(args: argparse.Namespace) -> None:
    """A command that runs configs logs through one filter: config/data warnings once, Flower's noise left out
    (see logfilter); ``args.log_filter`` is handed to the run it follows."""
    args.log_filter = LogFilter()
    command_logging(args.log_filter)
