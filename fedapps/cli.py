"""`fedapps run / compare / report`: thin helpers around `flwr run`.

`fedapps run CONFIG` validates the config here (a bad key fails at once, naming it), runs it through
`flwr run` on Flower's Ray simulation engine with the offline environment, waits, checks the run's
final status (``flwr run --stream`` exits 0 even when the run failed), and prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedapps.config import APP_DIR, ConfigError, ExperimentConfig, load_config

OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


class RunFailed(RuntimeError):
    """A run that did not finish with status completed."""


def flower_env() -> dict[str, str]:
    """Environment for `flwr`: offline settings, a project-local FLWR_HOME, this venv's bin on PATH."""
    env = dict(os.environ)
    for k, v in OFFLINE_ENV.items():
        env.setdefault(k, v)
    env.setdefault("FLWR_HOME", str(APP_DIR / ".flwr"))
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def toml_str(value: str) -> str:
    """A TOML string literal for --run-config."""
    return json.dumps(value)


def superlink_pids() -> set[int]:
    """PIDs of running flower-superlink processes (to stop the one a run started)."""
    try:
        out = subprocess.run(["pgrep", "-f", "flower-superlink"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return set()
    return {int(p) for p in out.split()}


def stop_pids(pids: set[int]) -> None:
    """SIGTERM (SuperLink shuts down cleanly and its children follow)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def federation_config(cfg: ExperimentConfig, args: argparse.Namespace) -> str:
    """--federation-config: one SuperNode per client, CPUs/GPUs per client."""
    if args.federation_config:
        return args.federation_config
    def number(v: float) -> str:  # flwr wants "1", not "1.0", for whole numbers
        return str(int(v)) if float(v).is_integer() else str(v)

    return (f"num-supernodes={args.supernodes or cfg.data.num_clients} "
            f"client-resources-num-cpus={number(args.cpus_per_client)} "
            f"client-resources-num-gpus={number(args.gpus_per_client)}")


def run_with_flower(cfg: ExperimentConfig, config_path: Path, overrides: list[str], output_dir: Path,
                    args: argparse.Namespace) -> Path:
    """`flwr run` the app with this config; stream its log; raise RunFailed unless it completed."""
    env = flower_env()
    run_config = " ".join([
        f"config={toml_str(str(config_path))}",
        f"overrides={toml_str(' '.join(overrides))}",
        f"output-dir={toml_str(str(output_dir))}",
        f"resume-dir={toml_str(str(getattr(args, 'resume', None) or ''))}",
    ])
    cmd = ["flwr", "run", str(APP_DIR), "--stream", "--run-config", run_config,
           "--federation-config", federation_config(cfg, args)]
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    before = superlink_pids()
    run_id = None
    log_lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=APP_DIR)
        assert proc.stdout is not None
        for line in proc.stdout:
            log_lines.append(line)
            if not args.quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
            m = re.search(r"Successfully started run (\d+)", line)
            if m:
                run_id = m.group(1)
        proc.wait()
        if proc.returncode != 0:
            raise RunFailed(f"`flwr run` exited with {proc.returncode}")
        if run_id is None:
            raise RunFailed("`flwr run` did not report a run id")
        status = run_status(run_id, env)
        if status != "finished:completed":
            tail = "".join(log_lines[-20:])
            raise RunFailed(f"run {run_id} ended with status '{status}'; last log lines:\n{tail}")
    finally:
        if not args.keep_superlink:
            stop_pids(superlink_pids() - before)
    result_dir = Path(args.resume) if getattr(args, "resume", None) else output_dir / cfg.resolved_run_name()
    if not (result_dir / "summary.json").is_file():
        raise RunFailed(f"run completed but {result_dir}/summary.json is missing")
    return result_dir


def run_status(run_id: str, env: dict[str, str], attempts: int = 10) -> str:
    """The run's final status from `flwr ls` (e.g. finished:completed, finished:failed)."""
    status = "unknown"
    for _ in range(attempts):
        out = subprocess.run(["flwr", "ls", "local", "--run-id", run_id, "--format", "json"], env=env,
                             capture_output=True, text=True, cwd=APP_DIR).stdout
        try:
            status = json.loads(out)["runs"][0]["status"]
        except (ValueError, KeyError, IndexError):
            status = "unknown"
        if status.startswith("finished"):
            return status
        time.sleep(1)
    return status


def run_in_process(cfg: ExperimentConfig, config_path: Path, overrides: list[str], output_dir: Path,
                   resume: str | None = None) -> Path:
    """The same strategy and client code without Ray: clients served sequentially in this process."""
    import torch

    import server_app
    from fedapps.inprocess import InProcessGrid

    torch.set_num_threads(int(os.environ.get("FEDAPPS_CLIENT_THREADS", "1")))
    server_app.run_experiment(InProcessGrid(cfg.data.num_clients), str(config_path), " ".join(overrides), str(output_dir),
                              resume_dir=resume or "")
    return Path(resume) if resume else output_dir / cfg.resolved_run_name()


def print_summary(result_dir: Path) -> None:
    """A small table of the run's summary.json."""
    s = json.loads((result_dir / "summary.json").read_text())
    keys = ["strategy", "dataset", "partition", "model", "num_clients", "rounds", "accuracy_mean", "accuracy_weighted"]
    keys += sorted(k for k in s if k.startswith("final_") or k in ("clusters",))
    keys += ["bytes_up_per_client_round", "bytes_down_per_client_round", "wall_seconds"]
    width = max(len(k) for k in keys)
    print("\n" + "-" * (width + 24))
    for k in keys:
        if k in s:
            v = s[k]
            print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    print("-" * (width + 24))
    print(f"results: {result_dir}")
    if s.get("strategy") != "fedavg":
        print_fedavg_reference(result_dir, s)


def number(value: Any) -> str:
    """A metric for printing: 4 decimals, or 'none' where a run produced no value."""
    return f"{value:.4f}" if isinstance(value, (int, float)) else "none"


def print_fedavg_reference(result_dir: Path, summary: dict[str, Any]) -> None:
    """FedAvg's number beside a personalised run: from a FedAvg run of the same setting if one is on disk."""
    cfg = load_config(result_dir / "config.yaml")
    twin = result_dir.parent / f"fedavg-{cfg.data.source}-{cfg.data.partition}-s{cfg.seed}"
    same = twin / "config.yaml"
    if same.is_file() and (twin / "summary.json").is_file():
        other = load_config(same)
        if (other.data, other.model, other.client, other.rounds) == (cfg.data, cfg.model, cfg.client, cfg.rounds):
            ref = json.loads((twin / "summary.json").read_text())
            print(f"FedAvg on the same setting ({twin.name}): accuracy_mean {number(ref.get('accuracy_mean'))} "
                  f"vs {summary['strategy']} {number(summary.get('accuracy_mean'))}")
            return
    print("FedAvg's number on the same setting: add  --set strategy.name=fedavg  "
          "(e.g. make run ARGS=\"--set strategy.name=fedavg\"); it is then shown here.")


def execute(config: str, overrides: list[str], output_dir: str | None, args: argparse.Namespace) -> Path:
    """Validate, run (flwr or in-process) and return the results folder."""
    config_path = Path(config).expanduser().resolve()
    if not config_path.is_file():
        raise ConfigError(f"config file '{config}' not found; pass the path of a YAML file (e.g. configs/default.yaml)")
    cfg = load_config(config_path, overrides)
    from strategies import resolve  # local: the strategies (torch, flwr) load only when a run starts

    resolve(cfg)  # strategy.name and strategy.params: a bad one fails here, before flwr run starts
    out = Path(output_dir or cfg.output_dir).expanduser().resolve()
    if getattr(args, "resume", None):
        args.resume = str(Path(args.resume).expanduser().resolve())
        from fedapps import checkpoint
        from fedapps.config import dump_yaml

        saved = checkpoint.load_checkpoint(args.resume)  # refuse here, before flwr run starts
        checkpoint.check_same_config(saved["config"], dump_yaml(resolve(cfg).config(cfg)), args.resume)
    if args.engine == "inprocess":
        return run_in_process(cfg, config_path, overrides, out, getattr(args, "resume", None))
    return run_with_flower(cfg, config_path, overrides, out, args)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options shared by run and compare."""
    p.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="dotted overrides, e.g. --set rounds=5 client.lr=0.01")
    p.add_argument("--output-dir", default=None, help="results root (default: the config's output_dir)")
    p.add_argument("--engine", choices=("flower", "inprocess"), default="flower",
                   help="flower: `flwr run` on the Ray simulation engine (default); inprocess: same code, no Ray")
    p.add_argument("--supernodes", type=int, default=0, help="simulated SuperNodes (default: data.num_clients)")
    p.add_argument("--cpus-per-client", type=float, default=1, help="client-resources-num-cpus (default 1)")
    p.add_argument("--gpus-per-client", type=float, default=0, help="client-resources-num-gpus (default 0)")
    p.add_argument("--federation-config", default="", help="raw --federation-config for flwr run (overrides the three above)")
    p.add_argument("--keep-superlink", action="store_true", help="leave the local SuperLink running afterwards")
    p.add_argument("--quiet", action="store_true", help="do not stream the run's log")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedapps", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one config through flwr run and print its summary")
    run.add_argument("config")
    run.add_argument("--resume", default=None, metavar="RUN_DIR",
                     help="continue the run in RUN_DIR (<output-dir>/<run-name>) after its last checkpointed round")
    add_run_options(run)
    cmp_ = sub.add_parser("compare", help="run configs × seeds, then tabulate mean ± SEM")
    cmp_.add_argument("configs", nargs="+")
    cmp_.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    cmp_.add_argument("--name", default="comparison", help="folder under the output dir for the table and plot")
    add_run_options(cmp_)
    rep = sub.add_parser("report", help="print the summary of a results folder")
    rep.add_argument("result_dir")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            print_summary(execute(args.config, args.overrides, args.output_dir, args))
        elif args.command == "compare":
            from fedapps.compare import compare

            compare(args, execute)
        elif args.command == "report":
            print_summary(Path(args.result_dir))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"run failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
