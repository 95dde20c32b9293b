"""The package as a user installs it: the wheel `pip install .` builds, installed (not editable) into a fresh virtual
environment, used from a folder outside the checkout.

The fresh environment reuses the dependencies of the one running the tests instead of installing them again (a
``.pth`` file puts its site-packages after the new one's; 7 GB of torch are neither downloaded nor copied), so the
test runs offline. A ``.pth`` line adds a folder without processing the ``.pth`` files inside it, so an editable
install of this checkout there stays inert: ``fedapps``, ``strategies``, ``server_app`` and ``client_app`` can only
come from the wheel. Flower's command-line programs (`flwr`, `flower-superlink`, ...), which `fedapps run` starts by
name, are written into the new environment's bin/ as pip writes console scripts, so that they run its Python.

Without setuptools >= 64 in the running environment (the test extra installs it) the wheel cannot be built offline:
the tests skip, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from importlib.metadata import distribution
from pathlib import Path

import pytest
import yaml

from conftest import ACTOR_CPUS
from fedapps_tools.flwrcli import FLOWER_APP, installed_app, staged_app

ROOT = Path(__file__).resolve().parent.parent
PROJECT_MODULES = ("fedapps", "strategies", "server_app", "client_app", "fedapps_tools")


@dataclass(frozen=True)
class Venv:
    python: Path
    bin: Path
    site: Path
    outside: Path  # a working folder outside the checkout

    def env(self) -> dict[str, str]:
        """The environment a user of this venv has: its bin first, no PYTHONPATH, one thread per process."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}", "OMP_NUM_THREADS": "1"}

    def run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, cwd=self.outside, env=self.env(), capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip


def setuptools_version() -> tuple[int, ...] | None:
    try:
        import setuptools
    except ImportError:
        return None
    return tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())


def write_console_scripts(dist: str, python: Path, bindir: Path) -> list[str]:
    """The console scripts of the installed distribution ``dist``, written into ``bindir`` to run ``python`` (what pip
    writes when it installs the distribution there)."""
    names = []
    for ep in distribution(dist).entry_points:
        if ep.group != "console_scripts":
            continue
        module, _, attr = ep.value.partition(":")
        script = bindir / ep.name
        script.write_text(
            f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\n"
            f"if __name__ == '__main__':\n    sys.exit({attr}())\n"
        )
        script.chmod(0o755)
        names.append(ep.name)
    return names


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    """The wheel of this checkout built and installed into a fresh venv (~5 s)."""
    if (setuptools_version() or (0,)) < (64,):
        pytest.skip("building the wheel offline needs setuptools >= 64 in this environment (pip install -e '.[test]')")
    tmp = tmp_path_factory.mktemp("wheel")
    src = staged_app(ROOT, tmp / "src")  # the checkout's files less what .gitignore ignores (no build/, no .venv)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
         str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("fedapps-*.whl")
    home = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=120)
    python = home / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    parent = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "zz-dependencies-of-the-test-environment.pth").write_text("\n".join(parent) + "\n")
    install = subprocess.run(
        # --ignore-installed: the parent environment (seen through the .pth) holds this checkout's editable install of
        # the same version, which pip would otherwise take as already satisfied and install nothing
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--ignore-installed", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    missing = [m for m in PROJECT_MODULES if not any((site / f"{m}{ext}").exists() for ext in ("", ".py"))]
    assert not missing, f"the wheel's install left out {missing}: {install.stdout[-3000:]}"
    assert "flower-superlink" in write_console_scripts("flwr", python, home / "bin")
    outside = tmp / "elsewhere"
    outside.mkdir()
    return Venv(python, home / "bin", site, outside)


@pytest.mark.heavy
def test_the_installed_modules_come_from_the_wheel_not_the_checkout(venv):
    code = (
        "import json, importlib; from fedapps.importpath import shadowed_modules; "
        f"print(json.dumps([{{m: importlib.import_module(m).__file__ for m in {list(PROJECT_MODULES)}}}, "
        "shadowed_modules()]))"
    )
    proc = venv.run([str(venv.python), "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    files, shadowed = json.loads(proc.stdout)
    for module, file in files.items():
        assert Path(file).is_relative_to(venv.site), (module, file)
        assert not Path(file).resolve().is_relative_to(ROOT), (module, file)
    assert shadowed == []
    # the installed package has no pyproject.toml beside it: `fedapps run` gives flwr an app folder of its own
    assert not (venv.site / "pyproject.toml").exists()


@pytest.mark.heavy
def test_fedapps_run_with_its_default_engine_works_outside_the_checkout(venv):
    """`fedapps run <config> --set rounds=1` with `flwr run` (its own SuperLink, Ray workers), from a folder outside
    the checkout; the config is a shipped one, shrunk to a few seconds (digits, 3 clients, the MLP)."""
    config = venv.outside / "fedavg.yaml"
    config.write_text((ROOT / "configs" / "fedavg.yaml").read_text())
    assert yaml.safe_load(config.read_text())["strategy"]["name"] == "fedavg"
    small = ["data.source=digits", "data.num_clients=3", "model.name=mlp"]
    proc = venv.run(
        [str(venv.bin / "fedapps"), "run", config.name, "--set", "rounds=1", *small, "--output-dir", "out", "--quiet"],
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run,) = [d for d in (venv.outside / "out").iterdir() if (d / "summary.json").is_file()]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_round"] == 1 and isinstance(summary["accuracy_mean"], float), summary
    assert not summary["problems"], summary["problems"]
    assert str(ROOT) not in proc.stdout, proc.stdout  # the app handed to flwr run is not the checkout


@pytest.mark.heavy
def test_the_drop_in_strategies_import_from_the_wheel(venv):
    if not ((ROOT / "fedapps" / "flower_strategies.py").is_file() or (ROOT / "fedapps" / "flower_strategies").is_dir()):
        pytest.skip(
            "fedapps.flower_strategies is not on this branch (issue #36 item 1 builds it on another): this check "
            "runs once it is merged"
        )
    code = (
        "import fedapps.flower_strategies as m; from flwr.serverapp.strategy import Strategy; "
        "assert issubclass(m.CwFedAvg, Strategy), m.CwFedAvg; print(m.__file__)"
    )
    proc = venv.run([str(venv.python), "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).is_relative_to(venv.site), proc.stdout


def user_copy(venv: Venv, example: str) -> Path:
    """A user's copy of ``examples/<example>``, outside the checkout."""
    import shutil

    app = venv.outside / example
    shutil.copytree(ROOT / "examples" / example, app, ignore=shutil.ignore_patterns("__pycache__"))
    return app


@pytest.mark.heavy
def test_the_cwfedavg_example_runs_against_the_wheel_outside_the_checkout(venv):
    """A user's copy of the cwFedAvg example, outside the checkout, run with `flwr run` in the wheel's environment for
    two rounds: its ServerApp drives the drop-in strategy through Flower's own start() to the end of the run, its
    ClientApp uses the installed data loader, and its clients evaluate the personalised models they were sent in both
    rounds. The COSMOS example runs through `flwr run` from the checkout (test_cosmos_dropin.py, against our app's
    COSMOS); what it needs from the wheel is checked below."""
    app = user_copy(venv, "cwfedavg-quickstart")
    results = venv.outside / "cwfedavg-quickstart.json"
    code = (
        "import sys; from pathlib import Path; from fedapps_tools.appruns import run_app; "
        f"run = run_app(Path({str(app)!r}), 'num-server-rounds=2 results=\"{results}\"', "
        f"num_supernodes=2, cpus_per_client={ACTOR_CPUS}); "
        "print(run.status); print(run.log); sys.exit(0 if run.completed else 1)"
    )
    proc = venv.run([str(venv.python), "-c", code], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Starting FlowerCwFedAvg" in proc.stdout, proc.stdout[-3000:]  # the drop-in's start() ran in the ServerApp
    evaluate = json.loads(results.read_text())["evaluate"]
    assert sorted(evaluate) == ["1", "2"] and all(0.0 <= evaluate[r]["eval_acc"] <= 1.0 for r in evaluate), evaluate


@pytest.mark.heavy
def test_the_cosmos_example_loads_its_strategy_helpers_and_data_from_the_wheel(venv):
    """A user's copy of the COSMOS example, outside the checkout, in the wheel's environment: its ServerApp and
    ClientApp modules import (the drop-in strategy and the client helpers from the installed package), a node's data
    and the server's U load with the example's own settings, and U is the same on the node and the server."""
    app = user_copy(venv, "cosmos-quickstart")
    code = f"""
import json, sys, tomllib
from pathlib import Path
import torch
from flwr.app import Context, RecordDict
app = Path({str(app)!r})
sys.path.insert(0, str(app))
from cosmos_quickstart import client_app, server_app, task
import fedapps.flower_strategies as helpers
settings = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
node = Context(0, 0, {{"partition-id": 1, "num-partitions": 2}}, RecordDict(), settings)
train, test, public = task.load_data(node)
server_public = task.load_server_public(Context(0, 0, {{}}, RecordDict(), settings))
print(json.dumps({{"helpers": helpers.__file__, "train": len(train.dataset), "test": len(test.dataset),
                  "public": list(public.shape), "same_u": bool(torch.equal(public, server_public)),
                  "apps": [type(client_app.app).__name__, type(server_app.app).__name__]}}))
"""
    proc = venv.run([str(venv.python), "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["helpers"]).is_relative_to(venv.site), got
    assert got["apps"] == ["ClientApp", "ServerApp"] and got["same_u"], got
    assert got["train"] > 0 and got["test"] > 0 and got["public"][1:] == [1, 28, 28], got


def test_the_installed_app_declares_what_pyproject_declares(tmp_path):
    """The [tool.flwr.app] of the app folder written for an installed package is the checkout's, and Flower's own
    check of an app's pyproject.toml accepts it (its components resolve to the modules on the Python path)."""
    from flwr.common.config import validate_config

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert declared == FLOWER_APP
    app = installed_app(tmp_path / "app")
    assert sorted(p.name for p in app.iterdir()) == ["pyproject.toml"]
    written = tomllib.loads((app / "pyproject.toml").read_text())
    assert written["tool"]["flwr"]["app"] == FLOWER_APP
    ok, errors, warnings = validate_config(written, check_module=True, project_dir=app)
    assert ok and not errors and not warnings, (errors, warnings)


def test_a_module_named_like_one_of_ours_is_refused_before_it_is_imported(tmp_path):
    """A user's strategies.py earlier on the Python path would be imported instead of ours: `fedapps run` says so
    (exit 2) and so does the ServerApp and the ClientApp (check_own_modules) before importing it."""
    (tmp_path / "strategies.py").write_text("raise SystemExit('the user module was imported')\n")
    config = tmp_path / "cfg.yaml"
    config.write_text("rounds: 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "fedapps_tools.cli", "run", str(config), "--engine", "inprocess"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"the module 'strategies' comes from {tmp_path}, not from fedapps' own folder {ROOT}" in proc.stderr
    assert "the user module was imported" not in proc.stderr
    elsewhere = tmp_path / "elsewhere"  # `python -c` puts its working directory first on the path
    elsewhere.mkdir()
    env_ok = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = [sys.executable, "-c", "from fedapps.importpath import check_own_modules; check_own_modules()"]
    assert subprocess.run(check, cwd=elsewhere, env=env_ok, capture_output=True, timeout=60).returncode == 0
    refused = subprocess.run(check, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "ImportError: the module 'strategies' comes from" in refused.stderr
