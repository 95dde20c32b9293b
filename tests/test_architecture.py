"""Architecture rules that an import linter cannot state, checked on the source with ``ast`` (no project module is
imported here).

The import rules themselves are import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``), run by
``make lint`` (``lint-imports``): the tools above the strategies above the core (``fedapps/``), the core's own layers
(the server side > the Flower glue > client execution | reporting, which know nothing of each other > the wire > the
base: config, params, seeds, checkpoint, data, models), every core module placed in a layer, the drop-in facade
``fedapps.flower_strategies`` a top layer nothing imports, the config importing nothing of the project but
``fedapps.params``, and no import cycle. :func:`test_the_import_contracts_are_kept` runs them from the tests too.

What stays here:

(a) ``fedapps/client/worker.py`` (the generic client) names no algorithm: no registered strategy name (the
    ``name = "..."`` class attributes in ``strategies/*.py``) and no algorithm display name appears in it,
    case-insensitively, as a whole word, in code, strings or comments (a linter sees imports, not words);
(b) the apps (``server_app.py``, ``client_app.py``: modules, not packages, which import-linter does not analyse) import
    no tool (``fedapps_tools``);
(c) only ``fedapps/flower/`` touches Flower's private modules (a contract cannot name an external sub-package): no
    other project module imports a ``flwr`` module outside :data:`PUBLIC_FLWR`;
(d) the ClientApp's first message imports nothing only the server or some models need (a property of the import
    graph at run time).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedapps", "strategies", "fedapps_tools")
APPS = ("server_app.py", "client_app.py")
WORKER = ROOT / "fedapps" / "client" / "worker.py"
DISPLAY_NAMES = ("FedAvg", "cwFedAvg", "COSMOS", "FedMD", "FedCT", "COMET", "FedAMP", "FedFomo", "CFL", "IFCA", "Ditto")
DISPLAY_NAMES += ("FedBABU", "FedPer", "FedRep", "FedProx", "WDR")
ORDINARY_WORDS = frozenset({"local"})  # a registered name that is an ordinary word ('local' training) says nothing
PUBLIC_FLWR = ("flwr.app", "flwr.serverapp", "flwr.clientapp", "flwr.simulation")  # and ``flwr`` itself (its version)
FLOWER_GLUE = ROOT / "fedapps" / "flower"


def imported_modules(path: Path) -> dict[str, int]:
    """Every absolute module name one file imports (anywhere in it, functions included) -> its first line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name, node.lineno)
    return found


def project_files(root: Path = ROOT) -> list[Path]:
    return [f for pkg in PACKAGES for f in sorted((root / pkg).rglob("*.py"))] + [root / a for a in APPS]


# --------------------------------------------------------------------------- (a) algorithm names in the worker


def registered_strategy_names(root: Path = ROOT) -> set[str]:
    """Values of ``name = "..."`` class attributes in strategies/*.py."""
    names = set()
    for f in sorted((root / "strategies").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
                    target = stmt.target if isinstance(stmt, ast.AnnAssign) else target
                    value = getattr(stmt, "value", None)
                    if isinstance(target, ast.Name) and target.id == "name" and isinstance(value, ast.Constant):
                        names.add(str(value.value))
    return names


def algorithm_mentions(path: Path = WORKER, root: Path = ROOT) -> list[str]:
    """'file:line: name: the line' for every whole-word, case-insensitive mention of an algorithm name (letters and
    digits form words: ``ditto_lam`` and ``FedAvg's`` both count)."""
    names = {n.lower() for n in registered_strategy_names(root) if n.strip()} - ORDINARY_WORDS
    names |= {n.lower() for n in DISPLAY_NAMES}
    pattern = re.compile(r"(?<![a-z0-9])(" + "|".join(map(re.escape, sorted(names))) + r")(?![a-z0-9])", re.I)
    out = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        hits = sorted({m.group(1) for m in pattern.finditer(line)})
        if hits:
            out.append(f"{path.relative_to(root)}:{no}: {', '.join(hits)}: {line.strip()}")
    return out


def test_worker_names_no_algorithm():
    assert {"fedavg", "cosmos", "comet", "ifca"} <= registered_strategy_names()  # the check sees the registry
    mentions = algorithm_mentions()
    assert not mentions, f"{len(mentions)} algorithm names in the generic client:\n" + "\n".join(mentions)


def test_the_worker_check_sees_a_mention(tmp_path):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "x.py").write_text('class X:\n    name = "ditto"\n\nclass L:\n    name = "local"\n')
    (tmp_path / "w.py").write_text("x = 1\nlam = cfg.ditto_lam  # as in Ditto's paper\nlocal epochs\nfedavg2 = 0\n")
    assert algorithm_mentions(tmp_path / "w.py", tmp_path) == [
        "w.py:2: Ditto, ditto: lam = cfg.ditto_lam  # as in Ditto's paper"
    ]


# --------------------------------------------------------------------------- (b), (c) imports a contract cannot state


def tool_imports_of_the_apps(root: Path = ROOT) -> list[str]:
    return [
        f"{app}:{line}: imports {name}"
        for app in APPS
        if (root / app).is_file()
        for name, line in sorted(imported_modules(root / app).items())
        if name == "fedapps_tools" or name.startswith("fedapps_tools.")
    ]


def private_flower_imports(files: list[Path], root: Path = ROOT, glue: Path | None = FLOWER_GLUE) -> list[str]:
    """'file:line: flwr.x' for every import of a Flower module outside its public API, outside the ``glue``."""
    return [
        f"{f.relative_to(root)}:{line}: {name}"
        for f in files
        if glue is None or not f.is_relative_to(glue)
        for name, line in sorted(imported_modules(f).items())
        if (name == "flwr" or name.startswith("flwr.")) and name != "flwr"
        if not any(name == p or name.startswith(p + ".") for p in PUBLIC_FLWR)
    ]


def test_the_apps_import_no_tool():
    assert not tool_imports_of_the_apps(), tool_imports_of_the_apps()


def test_only_the_flower_glue_imports_flowers_private_modules():
    found = private_flower_imports(project_files())
    assert not found, "private Flower modules imported outside fedapps/flower/:\n" + "\n".join(found)
    assert private_flower_imports(sorted(FLOWER_GLUE.rglob("*.py")), glue=None), "the glue does: the check has teeth"


def test_the_import_checks_see_a_violation(tmp_path):
    (tmp_path / "a.py").write_text(
        "import flwr\nfrom flwr.app import Message\n\ndef f():\n    from flwr.supercore.control import X\n"
        "    import flwr.proto.x_pb2\n    import fedapps_tools.cli\n"
    )
    assert private_flower_imports([tmp_path / "a.py"], tmp_path) == [
        "a.py:6: flwr.proto.x_pb2",
        "a.py:5: flwr.supercore.control",
    ]
    (tmp_path / "a.py").rename(tmp_path / "server_app.py")
    assert tool_imports_of_the_apps(tmp_path) == ["server_app.py:7: imports fedapps_tools.cli"]


@pytest.mark.skipif(
    shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None, reason="no import-linter"
)
def test_the_import_contracts_are_kept():
    """The contracts of pyproject.toml (what `make lint` runs), from the tests too."""
    exe = str(Path(sys.executable).parent / "lint-imports")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" in out.stdout and " kept" in out.stdout  # the summary line: contracts were read and checked


# --------------------------------------------------------------------------- (d) the ClientApp's imports


def test_the_clientapp_does_not_import_what_only_the_server_or_some_models_need():
    """Every message in deployment starts a fresh ClientApp process: torchvision (~1.3 s, only the vision models
    need it), scikit-learn's clustering (~1 s, server side of CFL / COMET) and numba (~0.5 s, COSMOS's server-side
    l1 distances) are imported where used."""
    code = (
        "import sys, client_app, strategies, fedapps.client.worker; "
        "heavy = [m for m in ('torchvision', 'sklearn.cluster', 'numba') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(ROOT))
