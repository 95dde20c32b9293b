"""Shared fixtures: one thread per process, tiny configs on scikit-learn's digits."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from fedapps_tools.flwrcli import OFFLINE_ENV  # noqa: E402

for _key, _value in OFFLINE_ENV.items():  # Ray on loopback, no telemetry, no run-time installs
    os.environ.setdefault(_key, _value)
torch.set_num_threads(1)
# `--cpus-per-client` (`run_app`'s cpus_per_client) for a test's `flwr run`: all of the machine's CPUs per client, so
# that Ray starts ONE client actor and it serves every SuperNode in turn. Each actor imports torch and the app (~5
# CPU-seconds): on the suite's 2 cores, already busy with the other worker, a second actor costs more than it overlaps.
ACTOR_CPUS = str(os.cpu_count() or 1)


def fedapps_run_argv(config: Path, *args: str) -> list[str]:
    """``fedapps run CONFIG --quiet ARGS`` through `flwr run` as a test starts it: this interpreter, one Ray actor."""
    return [
        sys.executable,
        "-m",
        "fedapps_tools.cli",
        "run",
        str(config),
        "--quiet",
        "--cpus-per-client",
        ACTOR_CPUS,
        *args,
    ]


# A suite started in the background of a non-interactive shell (`make test &`) inherits SIGINT ignored, and so would
# every process a test starts: the tests that press Ctrl-C on a run (SIGINT) need it delivered. A Python handler here
# becomes the default action in the processes the tests exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-csv",
        default=os.environ.get("FEDAPPS_TEST_CPU_CSV"),
        help="write each test's CPU seconds (this process + its reaped child processes) and wall seconds to this CSV "
        "(one file per xdist worker: NAME.gwN.csv); also switched on by FEDAPPS_TEST_CPU_CSV (docs/development.md)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``--cpu-csv PATH``: one CSV row per test, its setup + call + teardown (a session fixture's cost lands on
    the first test that needs it). ``cpu_children`` counts the processes the test started and waited for (a
    `fedapps run` -> `flwr run` tree); daemons that outlive the test or are killed unreaped (a Ray head, a SuperLink
    left to a later teardown) are not in it: ``wall`` bounds what they cost."""
    path = item.config.getoption("--cpu-csv")
    if not path:
        yield
        return
    import csv
    import resource
    import time

    def cpu(who):
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    self0, child0, wall0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    yield
    own, children = cpu(resource.RUSAGE_SELF) - self0, cpu(resource.RUSAGE_CHILDREN) - child0
    wall = time.perf_counter() - wall0
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        stem, dot, ext = str(path).rpartition(".")
        path = f"{stem}.{worker}.{ext}" if dot else f"{path}.{worker}"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    new = not Path(path).is_file()
    marks = "+".join(m for m in ("heavy", "raycluster", "netns") if item.get_closest_marker(m))
    with open(path, "a", newline="") as out:  # a row as each test ends: a cut-short run keeps what it measured
        rows = csv.writer(out)
        if new:
            rows.writerow(["nodeid", "cpu_total", "cpu_self", "cpu_children", "wall", "marks"])
        rows.writerow([item.nodeid, f"{own + children:.2f}", f"{own:.2f}", f"{children:.2f}", f"{wall:.2f}", marks])


def shared_fixtures(item) -> list[str]:
    """The module- and session-scoped fixtures of this suite (defined under tests/) that ``item`` uses, as group names:
    ``module.fixture`` for a module's, the fixture's name for a session's."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a python test function
        return []
    names = []
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if not defs or defs[-1].scope not in ("module", "session"):
            continue
        source = getattr(defs[-1].func, "__module__", "") or ""
        module = sys.modules.get(source)
        if module is None or not str(getattr(module, "__file__", "")).startswith(str(ROOT / "tests")):
            continue  # pytest's own (tmp_path_factory, ...)
        names.append(name if defs[-1].scope == "session" else f"{source}.{name}")
    return names


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    """Tests marked ``heavy`` (a second or more each: real `flwr run`s and other process trees, the model zoo)
    run first, in their collection order. `make test` runs the suite on two pytest-xdist workers, which take tests
    in this order: the heavy ones are shared out while plenty of short tests remain to even out the end, instead of
    a late 60-s test leaving one worker alone at the finish. Serially the order changes nothing.

    The tests that share a module- or session-scoped fixture of this suite (a `flwr run` made once, the wheel's venv,
    a `fedapps compare` folder) are put in one ``xdist_group``: under ``--dist loadgroup`` (`make test`) one worker
    runs them all and builds the fixture once, where ``--dist load`` would let both workers build it."""
    for item in items:
        for group in shared_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: the rest keep their order
    record = os.environ.get(GROUPS_ENV)
    if record and "PYTEST_XDIST_WORKER" in os.environ:  # for the controller's scheduler (pytest_xdist_make_scheduler)
        groups = {}
        for item in items:
            names = sorted(
                {
                    str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")
                }
            )
            if names:
                groups[item.nodeid] = "_".join(names)
        tmp = Path(f"{record}.{os.environ['PYTEST_XDIST_WORKER']}")
        tmp.write_text(json.dumps(groups))
        tmp.replace(record)  # whole: every worker collects the same tests


# pytest-xdist 3.8's --dist loadgroup finds a test's group in a suffix it appends to the test's id on the worker, which
# pytest 9.2 (ids kept elsewhere) no longer takes: every test would be its own group. The workers write the groups to
# a file instead (above), and the controller's scheduler reads them from it.
GROUPS_ENV = "FEDAPPS_XDIST_GROUPS"


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" in os.environ or config.getoption("dist", "no") != "loadgroup":
        return
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="fedapps-xdist-groups-")
    os.environ[GROUPS_ENV] = str(Path(folder) / "groups.json")  # the workers, started later, inherit it
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown to pytest without it (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups the workers wrote (see :data:`GROUPS_ENV`)."""
    from xdist.scheduler import LoadGroupScheduling

    if config.getoption("dist", "no") != "loadgroup" or not os.environ.get(GROUPS_ENV):
        return None
    record = Path(os.environ[GROUPS_ENV])

    class RecordedGroups(LoadGroupScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read when the schedule is made: after every worker has collected
                self.groups = json.loads(record.read_text()) if record.is_file() else {}
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    return RecordedGroups(config, log)


def write_config(path: Path, **sections) -> Path:
    """A YAML config on digits with 4 clients and 2 rounds, updated by the given sections."""
    cfg = {
        "seed": 0,
        "rounds": 2,
        "strategy": {"name": "fedavg"},
        "data": {"source": "digits", "partition": "iid", "num_clients": 4},
        "model": {"name": "mlp"},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_folder(out: Path) -> Path:
    """The one run folder `fedapps run` wrote under ``out`` (its name ends with the digest of the run's config)."""
    found = [d for d in sorted(out.iterdir()) if (d / "config.yaml").is_file()] if out.is_dir() else []
    assert len(found) == 1, f"expected one run folder under {out}, found {[d.name for d in found]}"
    return found[0]


def derived_run_dir(out: Path, config: Path, overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """Where `fedapps run CONFIG --set OVERRIDES --output-dir OUT` writes its run (the name derived from the resolved
    config, see fedapps_tools/runnames.py), known before the run starts."""
    from fedapps.config import load_config
    from fedapps_tools.runnames import derived_name
    from strategies import resolve

    cfg = load_config(config, list(overrides))
    return out / derived_name(resolve(cfg).config(cfg))


def flwr_run(folder: Path, **sections) -> Path:
    """A real `fedapps run` -> `flwr run` (own SuperLink, Ray simulation, one SuperNode per client) of
    :func:`write_config`'s config updated by ``sections``; asserts it exits 0 and returns the run's folder (~35 s)."""
    import subprocess

    cfg = write_config(folder / "cfg.yaml", **sections)
    out = folder / "out"
    proc = subprocess.run(
        fedapps_run_argv(cfg, "--output-dir", str(out)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = [d for d in out.iterdir() if (d / "summary.json").is_file()]
    return run


def wire_run(folder: Path, **sections) -> Path:
    """:func:`write_config`'s config updated by ``sections`` run in process on an :class:`InProcessGrid` that sends
    every message, reply and node Context through Flower's protobuf encoding (``wire=True``, as `flwr run` does), its
    node ids as large as Flower's (≥ 2⁶³); returns the run's folder (a second or two, where a real `flwr run` costs
    ~25 CPU-seconds: :func:`flwr_run`)."""
    from fedapps.flower.inprocess import InProcessGrid

    cfg = write_config(folder / "cfg.yaml", **sections)
    clients = int(yaml.safe_load(cfg.read_text())["data"]["num_clients"])
    _, run = run_in_process(cfg, folder / "out", InProcessGrid(clients, wire=True, first_node_id=2**63 + 7))
    return run


def run_in_process(config: Path, out: Path, grid, overrides: str = "") -> tuple[dict, Path]:
    """``server_app.run_experiment`` of ``config`` on ``grid`` (an in-process grid) with results under ``out``:
    (the summary, the run's folder)."""
    import server_app
    from fedapps.config import load_config

    summary = server_app.run_experiment(grid, str(config), overrides, str(out))
    return summary, out / load_config(config, overrides).resolved_run_name()


@pytest.fixture
def tiny_config(tmp_path):
    """Factory: tiny_config(**sections) -> path of a small digits config."""
    counter = iter(range(1000))
    return lambda **sections: write_config(tmp_path / f"cfg{next(counter)}.yaml", **sections)


def _tiny_flower_run(folder: Path):
    """The run of :func:`flower_run_of_tiny_config` into ``folder``: (config path, completed process, run folder)."""
    import subprocess

    cfg = write_config(folder / "cfg.yaml", data={"source": "digits", "partition": "iid", "num_clients": 3})
    # the results root "fl" has the same path length as the in-process twin's "ip" (bytes_down counts the state-dir)
    proc = subprocess.run(
        fedapps_run_argv(cfg, "--output-dir", str(folder / "fl")),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return cfg, proc, derived_run_dir(folder / "fl", cfg)


@pytest.fixture(scope="session")
def flower_run_of_tiny_config(tmp_path_factory):
    """ONE real `fedapps run` -> `flwr run` (own SuperLink, Ray simulation, 3 SuperNodes, 2 rounds of FedAvg on
    digits), shared by the tests that check it from different sides (end to end; identical to the in-process
    engine): (config path, completed process, results folder). Each such run costs ~35 s.

    Under pytest-xdist (`make test`) a session fixture is set up once per worker: here the first worker that needs
    the run makes it in the session's temp folder, which the workers share, under a file lock; another worker
    waits on the lock and reads the same run (its exit status and output from ``proc.json``)."""
    import fcntl
    import json
    import subprocess

    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process
        return _tiny_flower_run(tmp_path_factory.mktemp("flower-run"))
    folder = tmp_path_factory.getbasetemp().parent / "flower-run"  # this session's, shared by its workers
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        record = folder / "proc.json"
        if not record.is_file():
            folder.mkdir()
            cfg, proc, out = _tiny_flower_run(folder)
            record.write_text(
                json.dumps(
                    {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
                )
            )
            return cfg, proc, out
    done = json.loads(record.read_text())
    proc = subprocess.CompletedProcess(done["args"], done["returncode"], done["stdout"], done["stderr"])
    return folder / "cfg.yaml", proc, derived_run_dir(folder / "fl", folder / "cfg.yaml")
