"""What every tool that drives Flower's CLI shares: the offline environment, `flwr ... --format json`, following
a run to its FINAL status (``flwr run --stream`` exits 0 on a failed run), reading why it failed off its log, and
the /proc bookkeeping that lets a tool stop exactly the processes it started (pid + start time)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedapps.config import APP_DIR
from fedapps.flower.control import control_client, gitignore_matcher, log_chunks
from fedapps.flower.control import run_status as control_run_status
from fedapps_tools.logfilter import LogFilter, for_output

OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    # Ray's raylet starts idle Python workers ahead of any task; Flower's actors need a runtime env (its PYTHONPATH),
    # so those workers are never used: each costs a Python start-up on the cores the actors are starting on
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}


class RunFailed(RuntimeError):
    """A run that did not finish with status completed."""

    exit_status: int  # where set: the ServerApp's verdict (summary.json), the CLI's exit status


CONNECTION = "fedapps"  # the name of the SuperLink connection this tool writes into its own FLWR_HOME


def flower_env() -> dict[str, str]:
    """Environment for `flwr`: offline settings, this venv's bin on PATH (FLWR_HOME is set per run)."""
    env = dict(os.environ)
    for k, v in OFFLINE_ENV.items():
        env.setdefault(k, v)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def toml_str(value: str) -> str:
    """A TOML string literal for --run-config."""
    return json.dumps(value)


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] == "Z":  # a zombie is gone for our purposes
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root`` (pid -> start time), found through /proc (Linux; {} elsewhere)."""
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for name in entries:
        if name.isdigit():
            st = _proc_stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append((int(name), st[1]))
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in out:
                out[pid] = started
                todo.append(pid)
    return out


def _signal(pid: int, started: int | None, sig: int) -> None:
    """Signal ``pid`` only if it is still the process that was noted (its start time matches)."""
    st = _proc_stat(pid)
    if st is None or (started is not None and st[1] != started):
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def app_files(app_dir: Path) -> dict[str, Path]:
    """The files under ``app_dir`` Flower's FAB builder may take, found without entering the directories the app's
    .gitignore ignores as a whole (`.venv/`, `results/`, ...).

    `flwr run DIR` lists EVERY file under DIR before it filters by .gitignore and its include rules
    (``flwr.cli.utils.collect_files``): with the virtual environment inside the app folder, as `make` sets it up,
    that is ~60,000 paths, each resolved — most of the `submit` part of a run's start-up (docs/performance.md). What
    this returns filters down to the same FAB (``tests/test_flwrcli.py`` compares both on this repository); where
    the .gitignore has negations (``!``) nothing is pruned."""
    root = Path(app_dir).resolve()
    ignored = gitignore_matcher(root)
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        if ignored is not None:  # a directory ignored as a whole: it and anything under it
            dirnames[:] = [
                d
                for d in dirnames
                if not (ignored((rel_dir / d).as_posix() + "/") and ignored((rel_dir / d / "x" / "x.py").as_posix()))
            ]
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink() and path.resolve().is_relative_to(root):  # as Flower: no symlinks, nothing outside
                files[(rel_dir / name).as_posix()] = path
    return files


def staged_app(app_dir: Path, into: Path) -> Path:
    """A copy of the app's files (:func:`app_files`) under ``into`` (hard links where the filesystem allows, else
    copies): the folder to hand to `flwr run`, which then walks ~300 paths instead of the whole app folder."""
    import shutil

    into.mkdir(parents=True, exist_ok=True)
    for rel, src in app_files(app_dir).items():
        dst = into / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    return into


# The Flower app's [tool.flwr.app] of pyproject.toml, for an installed package, whose folder (site-packages) holds no
# pyproject.toml: installed_app writes it into a folder of its own (tests/test_wheel.py checks that both say the same).
FLOWER_APP: dict[str, Any] = {
    "publisher": "fedapps",
    "components": {"serverapp": "server_app:app", "clientapp": "client_app:app"},
    "config": {
        "config": "configs/default.yaml",
        "overrides": "",
        "output-dir": "results",
        "resume-dir": "",
        "keep-state": False,
    },
}


def source_app_dir() -> Path | None:
    """The app's source folder (a checkout, or the checkout an editable install points at: APP_DIR with the
    pyproject.toml that declares the Flower app); None for a package installed from a wheel, whose APP_DIR is
    site-packages."""
    pyproject = APP_DIR / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    return APP_DIR if "[tool.flwr.app.components]" in text else None


def toml_value(value: Any) -> str:
    """A TOML literal of a string, boolean or number (strings as JSON writes them: a valid TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def installed_app(into: Path) -> Path:
    """A Flower app folder for the installed package: a pyproject.toml alone, whose components name the installed
    top-level modules server_app and client_app (the app's code comes from site-packages, not from the FAB)."""
    from fedapps_tools.options import package_version

    lines = [
        "[project]",
        'name = "fedapps"',
        f"version = {toml_value(package_version())}",
        'description = "fedapps, installed: its ServerApp and ClientApp come from the installed package"',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        f"publisher = {toml_value(FLOWER_APP['publisher'])}",
    ]
    for table in ("components", "config"):
        lines += ["", f"[tool.flwr.app.{table}]"]
        lines += [f"{key} = {toml_value(value)}" for key, value in FLOWER_APP[table].items()]
    into.mkdir(parents=True, exist_ok=True)
    (into / "pyproject.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return into


def app_for_flwr(into: Path) -> Path:
    """The folder to hand to `flwr run`: the checkout's app files staged under ``into`` (:func:`staged_app`), or,
    for an installed package, :func:`installed_app` there."""
    source = source_app_dir()
    return staged_app(source, into / source.name) if source is not None else installed_app(into / "fedapps-app")


def submit_run(connection: str, run_config: str, env: dict[str, str], extra: Sequence[str] = ()) -> str:
    """`flwr run APP connection --format json --run-config ... [extra]`: the run submitted, its id returned
    (RunFailed otherwise). The command shown is the one a user would type; it runs on the app's files staged in a
    temporary folder (:func:`app_for_flwr`: the same FAB without walking the virtual environment, or, for an installed
    package, a pyproject.toml naming its installed apps)."""
    import shlex
    import tempfile

    def command(app: Path) -> list[str]:
        return ["flwr", "run", str(app), connection, "--format", "json", "--run-config", run_config, *extra]

    with tempfile.TemporaryDirectory(prefix="fedapps-app-") as tmp:
        app = app_for_flwr(Path(tmp))
        source = source_app_dir()
        print("$ " + " ".join(shlex.quote(c) for c in command(source if source is not None else app)), flush=True)
        doc = flwr_json(command(app), env)
    if not doc.get("success") or not doc.get("run-id"):
        raise RunFailed(f"`flwr run` did not start the run: {json.dumps(doc)[:2000]}")
    return str(doc["run-id"])


def flwr_json(cmd: list[str], env: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    """Run a `flwr ... --format json` command and return its JSON document (RunFailed when there is none)."""
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, cwd=source_app_dir(), timeout=timeout, stdin=subprocess.DEVNULL
    )
    text = proc.stdout.strip()
    try:
        doc = json.loads(text[text.index("{") :]) if "{" in text else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise RunFailed(f"`{' '.join(cmd[:2])}` gave no JSON (exit {proc.returncode}): {(text + proc.stderr)[-2000:]}")
    return doc


def run_status(run_id: str, env: dict[str, str], connection: str = CONNECTION) -> str:
    """The run's status from `flwr ls --run-id ID --format json` (e.g. running, finished:completed)."""
    try:
        doc = flwr_json(["flwr", "ls", connection, "--run-id", run_id, "--format", "json"], env, timeout=60)
        return str(doc["runs"][0]["status"])
    except (RunFailed, KeyError, IndexError, TypeError, subprocess.TimeoutExpired):
        return "unknown"


def local_run_status(run_id: str, address: str) -> str | None:
    """The run's status asked in this process (see :func:`control_client`); None when it cannot be asked so (no
    client, or no answer): then :func:`run_status` is used."""
    client = control_client(address)
    if client is None:
        return None
    try:
        return control_run_status(client, run_id)
    except Exception:  # noqa: BLE001 - any failure of the shortcut falls back to `flwr ls`
        return None
    finally:
        client.close()


class LogStream:
    """The run's log, line by line as it comes, read on a thread: in this process from the Control API of a SuperLink
    at ``address`` (this tool's own), else from `flwr log ID CONNECTION --stream`. ``ended`` is set when the stream
    ends: the SuperLink ends it once the run has finished (or the connection broke). ``log_filter``: which lines are
    shown (:class:`fedapps_tools.logfilter.LogFilter`; None: all); ``lines`` keeps every line."""

    def __init__(
        self,
        run_id: str,
        env: dict[str, str],
        connection: str,
        quiet: bool,
        address: str | None = None,
        log_filter: LogFilter | None = None,
    ):
        self.lines: list[str] = []
        self.ended = threading.Event()
        self._quiet = quiet
        self._filter = log_filter
        self._client = control_client(address) if address is not None else None
        self._proc: subprocess.Popen | None = None
        if self._client is None:
            self._proc = subprocess.Popen(
                ["flwr", "log", run_id, connection, "--stream"],
                env=env,
                cwd=source_app_dir(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                stdin=subprocess.DEVNULL,
            )
        self._thread = threading.Thread(target=self._pump, args=(run_id,), daemon=True)
        self._thread.start()

    def _emit(self, line: str) -> None:
        self.lines.append(line)
        if not self._quiet and (self._filter is None or self._filter.show(line)):
            sys.stdout.write(for_output(line, sys.stdout.isatty()))
            sys.stdout.flush()

    def _pump(self, run_id: str) -> None:
        try:
            if self._proc is not None:
                assert self._proc.stdout is not None
                for line in self._proc.stdout:
                    self._emit(line)
                self._proc.wait()
            else:
                pending = ""  # a line the last chunk did not finish
                for chunk in log_chunks(self._client, run_id):
                    *complete, pending = (pending + chunk).split("\n")
                    for line in complete:
                        self._emit(line + "\n")
                if pending:
                    self._emit(pending + "\n")
        except Exception as exc:  # noqa: BLE001 - the stream's end is all the caller needs (it then reads the status)
            self._emit(f"(the run's log stream ended: {type(exc).__name__}: {exc})\n")
        finally:
            self.ended.set()

    def close(self, wait: float = 5.0) -> None:
        """Let the stream end by itself for up to ``wait`` seconds, then cut it."""
        self.ended.wait(wait)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._client is not None:
            self._client.close()
        self._thread.join(timeout=5 if wait else 0.5)


STATUS_BACKSTOP = 30.0  # seconds between status checks while the log stream is still open (see follow_run)


def follow_run(
    run_id: str,
    env: dict[str, str],
    quiet: bool,
    link: Any | None,
    poll: float = 2.0,
    connection: str = CONNECTION,
    backstop: float = STATUS_BACKSTOP,
    log_filter: LogFilter | None = None,
    timeout: float | None = None,
) -> tuple[str, list[str]]:
    """Stream the run's log until the run finishes; return (final status, log). ``link``: a SuperLink process this
    run owns (its children are noted, its exit ends the wait; its log and status are read in this process, see
    :func:`control_client`), or None (`flwr log` / `flwr ls` on the connection). ``log_filter``: which streamed
    lines are shown (see :class:`LogStream`). ``timeout``: RunFailed when the run has not finished after that many
    seconds (None: wait as long as it runs).

    The SuperLink ends the log stream once the run has finished, so the status is asked when the stream has ended —
    then every ``poll`` seconds until it reads finished — and, while the stream is open, only every ``backstop``
    seconds (a stream that hangs cannot hide the end of a run; each `flwr ls` is a Python process of ~1 CPU-second
    that would compete with the run's workers)."""
    stream = LogStream(run_id, env, connection, quiet, link.address if link is not None else None, log_filter)
    status = "unknown"
    finished = False  # an interrupt (Ctrl-C) does not wait for the stream: the caller stops the run at once
    tick = 0.5 if link is not None else poll  # how often the SuperLink's children are noted
    stream_open = True
    next_check = time.monotonic() + backstop
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise RunFailed(f"run {run_id} still {status} after {timeout:.0f} s")
            if link is not None:
                link.note_children()
                if link.proc is not None and link.proc.poll() is not None:
                    status = "superlink-exited"
                    break
            if stream_open and stream.ended.is_set():
                stream_open, next_check = False, time.monotonic()  # the run has (most likely) finished: ask now
            if time.monotonic() >= next_check:
                status = (local_run_status(run_id, link.address) if link is not None else None) or run_status(
                    run_id, env, connection
                )
                if status.startswith("finished"):
                    break
                next_check = time.monotonic() + (backstop if stream_open else poll)
            if stream_open:
                stream.ended.wait(tick)  # wakes at once when the stream ends
            else:
                time.sleep(tick)
        finished = True
    finally:
        stream.close(wait=5.0 if finished else 0.0)
    return status, stream.lines


def stop_run(run_id: str, env: dict[str, str], connection: str = CONNECTION) -> bool:
    """`flwr stop RUN_ID`: ask the SuperLink to stop a run (one this tool submitted to a SuperLink it does not stop
    itself); whether it said so."""
    try:
        return bool(flwr_json(["flwr", "stop", run_id, connection, "--format", "json"], env, timeout=30).get("success"))
    except (RunFailed, subprocess.TimeoutExpired):
        return False


def failure_reasons(lines: list[str], result_dir: Path) -> str:
    """Why a run failed: the problems the ServerApp recorded in summary.json, else its error lines."""
    summary = result_dir / "summary.json"
    if summary.is_file():
        try:
            problems = json.loads(summary.read_text()).get("problems") or []
        except (ValueError, OSError):
            problems = []
        if problems:
            return "\n".join(f"  - {p}" for p in problems)
    errors = [ln.rstrip() for ln in lines if re.search(r"ERROR|Error|Exception|failed", ln)]
    return "\n".join(exception_lines(lines) + (errors or [ln.rstrip() for ln in lines])[-25:])


def exception_lines(lines: list[str]) -> list[str]:
    """The 'Type: message' line that ends each Python traceback in a log (whatever the exception's name)."""
    out: list[str] = []
    in_traceback = False
    for prev, line in zip([""] + lines, lines):
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line.strip() and not line[0].isspace() and prev[:1].isspace():
            out.append(line.rstrip())
            in_traceback = False
    return out


def _alive(pid: int, started: int | None) -> bool:
    st = _proc_stat(pid)
    return st is not None and (started is None or st[1] == started)


def _killpg(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_processes(owned: dict[int, int | None], group: subprocess.Popen | None = None, grace: float = 10.0) -> None:
    """Stop what a tool started: SIGTERM to ``group``'s process group (a child started in a session of its own)
    and to every process in ``owned`` (pid -> start time: a recycled pid is never signalled), SIGKILL to whatever
    is left after ``grace`` seconds, then wait (up to 5 s) until they are gone."""

    def left() -> bool:
        return (group is not None and group.poll() is None) or any(_alive(p, s) for p, s in owned.items())

    _killpg(group, signal.SIGTERM)
    for pid, started in owned.items():
        _signal(pid, started, signal.SIGTERM)
    for seconds, final in ((grace, False), (5.0, True)):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and left():
            time.sleep(0.1)
        if final:
            break
        for pid, started in owned.items():
            _signal(pid, started, signal.SIGKILL)
        _killpg(group, signal.SIGKILL)
    if group is not None:
        try:
            group.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
