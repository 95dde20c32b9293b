"""Architecture rules, checked on the source with ``ast`` alone (no project module is imported).

The module import graph of the project's own modules (``fedapps/``, ``strategies/``, ``fedapps_tools/``,
``server_app.py``, ``client_app.py``) is built from every ``import`` / ``from ... import`` statement, including those
inside functions. Rules:

(a) no import cycle among the project's modules;
(b) layers point down only:
    - ``fedapps/*`` (the core) imports nothing from ``strategies``, ``server_app``, ``client_app`` or the tools
      (``fedapps_tools``: the ``fedapps`` command, ``compare``), which sit above them all;
    - ``fedapps.config`` knows no strategy and nothing above it: of the project's modules it imports at most
      ``fedapps.params`` and error modules (a module whose last name ends in ``errors``/``exceptions``);
    - ``strategies/*`` import neither ``server_app``, ``client_app`` nor the tools;
    - ``fedapps.flower_strategies`` (:data:`FACADE`), the public module of the drop-in strategies, is a top layer like
      the tools: the one module of ``fedapps/`` that may import ``strategies``, and no other core module imports it;
(c) ``fedapps/client/worker.py`` (the generic client) names no algorithm: no registered strategy name (the
    ``name = "..."`` class attributes in ``strategies/*.py``) and no algorithm display name appears in it,
    case-insensitively, as a whole word (letters and digits only form words: ``ditto_lam`` and ``FedAvg's``
    both count), in code, strings or comments;
(d) an algorithm's own maths stays in its module: COSMOS's r_B (:data:`MOVED_OUT_OF_CORE`: the function, its term
    builder and its message settings) is defined in ``strategies/cosmos.py`` and named nowhere in ``fedapps/``;
(e) each reply is checked once, with one prediction check: ``prediction_problem`` is defined in
    ``fedapps/wire/validation.py`` and in no other module of ``fedapps/`` or ``strategies/``;
(f) every wire key (the names of records, settings, arrays, metrics and info entries that the schema module
    modules :data:`SCHEMA` declare, :func:`schema_keys`) is spelled there only: no other
    module of the project and no test (this one aside) holds a string literal equal to one (docstrings, comments and
    longer strings that contain one do not count). Narrow exemptions, each with its reason and each still needed
    (:func:`stale_exemptions`): :data:`WIRE_FORGING_TESTS`, test modules that build or take apart raw wire records
    on purpose; :data:`ALSO_A_NAME`, a key that is also an ordinary name elsewhere (``round`` is a column of
    rounds.csv too), in the places where it means that;
(g) a strategy is given its run context at construction, never wired afterwards: no module of the project and no test
    assigns an attribute named after a field of ``strategies.base.RunContext`` (``x.client_state = ...``);
(h) no dead hooks or adapters: every method a class in ``strategies/`` defines is named somewhere in the project's
    modules (called, referenced or looked up by a string; tests do not count), torch's ``forward`` aside.
(i) the core's sub-packages show its layers (:data:`CORE_LEVELS`), and a core module imports only core modules of a
    LOWER level or of its own sub-package: the base (``config``, ``params``, ``seeds``, ``checkpoint``, ``data``,
    ``models``) < the wire (``fedapps.wire``: the message schema, reply validation, pseudo-label encodings) < client
    execution (``fedapps.client``) and reporting (``fedapps.reporting``), which know nothing of each other < the
    Flower glue (``fedapps.flower``) < the server side (``fedapps.server``: the round loop, sampling, the evaluation
    protocol, reply checks, and the maths strategies share); a core module the table does not place is reported
    too, so a new module must be given its layer;
(j) only ``fedapps/flower/`` touches Flower's private modules: no other project module imports a ``flwr`` module
    outside :data:`PUBLIC_FLWR` (``flwr.app``, ``flwr.serverapp``, ``flwr.clientapp``, ``flwr.simulation`` and the
    ``flwr`` package itself, for its version); each touch there is gated on the checked Flower release
    (``fedapps.flower.require_checked_flower``). Tests may reach into Flower to test that glue.

Run ``python tests/test_architecture.py`` to print the graph's layer violations and cycles (exit status 1
when there are any). A standard alternative for looking at the graph is ``pydeps`` (e.g.
``pydeps fedapps --show-cycles``) or ``import-linter`` for layer contracts; this module needs neither.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedapps", "strategies", "fedapps_tools")
TOP_MODULES = ("server_app", "client_app")
ENTRY_POINTS = ("fedapps_tools",)  # the layer above the apps
APPS = ("server_app", "client_app")
CONFIG = "fedapps.config"
CONFIG_MAY_IMPORT = ("fedapps.params",)  # beside error modules
DISPLAY_NAMES = (
    "FedAvg",
    "cwFedAvg",
    "COSMOS",
    "FedMD",
    "FedCT",
    "COMET",
    "FedAMP",
    "FedFomo",
    "CFL",
    "IFCA",
    "Ditto",
    "FedBABU",
    "FedPer",
    "FedRep",
    "FedProx",
    "WDR",
)
# A registered name that is an ordinary word ('local' training/epochs/data) says nothing about an algorithm.
ORDINARY_WORDS = frozenset({"local"})
WORKER = ROOT / "fedapps" / "client" / "worker.py"
# names that left the core for their algorithm's module (rule d): name -> the module that defines or reads it
MOVED_OUT_OF_CORE = {
    "robustness_penalty": "strategies/cosmos.py",
    "rb_term": "strategies/cosmos.py",
    "rb_lambda": "strategies/cosmos.py",
    "rb_sigma": "strategies/cosmos.py",
}
PREDICTION_CHECK = ("prediction_problem", "fedapps/wire/validation.py")  # rule (e): the one prediction check, where
# rule (f): the schema modules, where every wire key is declared (by ``key(...)`` or a field's ``wire(...)``)
SCHEMA = ("fedapps/wire/keys.py", "fedapps/wire/request.py", "fedapps/wire/reply.py")
RULES = "tests/test_architecture.py"  # this module (it names the keys it checks)
# rule (f)'s exemptions. Test modules that spell wire keys to forge or take apart raw records on purpose:
WIRE_FORGING_TESTS = {
    "tests/test_validation.py": "forges requests and (hostile) replies, record by record, for the reply validator",
    "tests/test_schema.py": "pins the wire format's literal keys (a changed constant would break deployment across "
    "versions)",
}
# Keys that are also ordinary names elsewhere -> the places (a file, or a folder ending in '/') where they mean that:
ALSO_A_NAME = {
    "round": {
        "fedapps/reporting/": "the column of rounds.csv and rejections.csv",
        "fedapps_tools/": "the column of rounds.csv",
        "server_app.py": "the checkpoint's field",
        "fedapps/server/driver.py": "the field of the latest measurement (summary.json)",
        "strategies/cwfedavg.py": "a value of its parameter mix",
        "tests/": "the columns of rounds.csv and rejections.csv the tests read",
    },
    "config": {
        "fedapps/config.py": "the config itself",
        "fedapps_tools/": "the run's config (config.yaml, specs)",
        "server_app.py": "the checkpoint's field, config.yaml",
        "tests/": "the run's config (checkpoints, specs)",
    },
    "fingerprint": {"fedapps/flower/faults.py": "the name of a fault", "tests/test_faults.py": "the name of a fault"},
    "model.name": {
        "strategies/__init__.py": "the config key the wire key is named after",
        "fedapps/models/zoo.py": "the config key",
        "tests/test_cli_usability.py": "the config key",
        "tests/test_config.py": "the config key",
        "tests/test_shipped_configs.py": "the config key",
        "tests/test_pfedhn.py": "the config key",
    },
    "model.per_client": {"tests/test_cli_usability.py": "the config key"},
    "privacy.mode": {"fedapps/config.py": "the config key the wire key is named after"},
    "privacy.noise_multiplier": {"tests/test_privacy.py": "the config key"},
    "privacy.delta": {"tests/test_privacy.py": "the config key"},
    "privacy.epsilon_budget": {"tests/test_privacy.py": "the config key the budget refusal names"},
}
RUN_CONTEXT = ("strategies/base.py", "RunContext")  # rule (g): the class whose fields are construction inputs
CALLED_BY_TORCH = frozenset({"forward"})  # rule (h): methods torch calls for us (nn.Module.__call__)
# rule (h): the methods Flower's Strategy.start() calls on a drop-in strategy, a class whose bases name Flower's
# ``Strategy`` (flwr.serverapp.strategy.Strategy)
CALLED_BY_FLOWER = frozenset({"configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate"})
FLOWER_STRATEGY = "Strategy"
# rule (i): the core's layers, bottom (0) to top; a module is placed by its longest listed prefix
CORE_LEVELS = {
    "fedapps": 0,
    "fedapps.config": 0,
    "fedapps.params": 0,
    "fedapps.seeds": 0,
    "fedapps.checkpoint": 0,
    "fedapps.data": 0,
    "fedapps.models": 0,
    "fedapps.importpath": 0,
    "fedapps.wire": 1,
    "fedapps.client": 2,
    "fedapps.reporting": 2,
    "fedapps.flower": 3,
    "fedapps.server": 4,
}
PUBLIC_FLWR = ("flwr.app", "flwr.serverapp", "flwr.clientapp", "flwr.simulation")  # rule (j); and ``flwr`` itself
FLOWER_GLUE = "fedapps.flower"  # rule (j): the one place for Flower's private modules
FACADE = "fedapps.flower_strategies"  # rule (b): the drop-in strategies' public module, a top layer


# --------------------------------------------------------------------------- the graph


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every project module (a package is its __init__.py)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    for name in TOP_MODULES:
        if (root / f"{name}.py").is_file():
            out[name] = root / f"{name}.py"
    return out


def _project_prefix(name: str, modules: set[str]) -> str | None:
    """The longest prefix of a dotted name that is a project module (None: not ours)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: set[str]) -> dict[str, int]:
    """Project modules imported by one module (anywhere in it) -> line of the first such import."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_project_prefix(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module, level - 1 steps up
                package = module.split(".") if is_package else module.split(".")[:-1]
                base_parts = package[: len(package) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                add(sub if sub in modules else _project_prefix(base, modules), node.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported project module: line}."""
    files = module_files(root)
    names = set(files)
    return {m: imports_of(m, f, names) for m, f in files.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle (as a closed path a -> ... -> a) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan; the graph is small, recursion depth is no concern
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in components:
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph.get(comp[0], {}):
            continue
        start = min(comp)
        prev: dict[str, str] = {}
        queue = deque([start])
        seen = {start}
        while queue:  # BFS inside the component back to start
            v = queue.popleft()
            if start in graph.get(v, {}):
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                cycles.append([start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start])
                break
            for w in sorted(graph.get(v, {})):
                if w in members and w not in seen:
                    seen.add(w)
                    prev[w] = v
                    queue.append(w)
    return cycles


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _is_error_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last.endswith("errors") or last.endswith("exceptions")


def layer_violations(graph: dict[str, dict[str, int]], files: dict[str, Path] | None = None) -> list[str]:
    """Every import that points up a layer, as 'file:line: a imports b (rule)'."""
    files = files or module_files()
    out = []

    def report(src: str, dst: str, rule: str) -> None:
        where = files[src].relative_to(ROOT) if src in files else src
        out.append(f"{where}:{graph[src][dst]}: {src} imports {dst} ({rule})")

    for src in sorted(graph):
        for dst in sorted(graph[src]):
            if src == FACADE:
                if _in(dst, APPS + ENTRY_POINTS):
                    report(src, dst, f"{FACADE} below the apps and tools")
                continue  # a top layer: it imports the strategies and the core
            if _in(dst, (FACADE,)):
                report(src, dst, f"{FACADE} is a top layer: nothing in the project imports it")
                continue
            if _in(src, ("fedapps",)) and _in(dst, ("strategies",) + APPS + ENTRY_POINTS):
                report(src, dst, "fedapps below the strategies, apps and tools")
            if (
                src == CONFIG
                and _in(dst, PACKAGES + TOP_MODULES)
                and not (_in(dst, CONFIG_MAY_IMPORT) or _is_error_module(dst))
            ):
                report(src, dst, f"{CONFIG} imports only {', '.join(CONFIG_MAY_IMPORT)} and error modules")
            if _in(src, ("strategies",)) and _in(dst, APPS + ENTRY_POINTS):
                report(src, dst, "strategies below the apps and entry points")
            if _in(src, ("fedapps",)) and src != FACADE and _in(dst, ("fedapps",)) and core_part(src) != core_part(dst):
                src_level, dst_level = core_level(src), core_level(dst)
                if src_level is None or dst_level is None:
                    report(src, dst, "a core module with no layer in CORE_LEVELS: give it one")
                elif dst_level >= src_level and src_level > 0:
                    report(
                        src,
                        dst,
                        f"core layers: {core_part(src)} (level {src_level}) imports only lower levels, "
                        f"not {core_part(dst)} (level {dst_level})",
                    )
    return out


def core_part(module: str) -> str:
    """The CORE_LEVELS entry a core module belongs to (its longest listed prefix; "" when none)."""
    return max((p for p in CORE_LEVELS if _in(module, (p,))), key=len, default="")


def core_level(module: str) -> int | None:
    part = core_part(module)
    return CORE_LEVELS[part] if part and (part != "fedapps" or module == "fedapps") else None


def flwr_imports(path: Path) -> dict[str, int]:
    """Every ``flwr`` module one file imports (anywhere in it) -> line of the first such import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and not node.level and node.module
            else []
        )
        for name in names:
            if name == "flwr" or name.startswith("flwr."):
                found.setdefault(name, node.lineno)
    return found


def private_flower_imports(files: dict[str, Path] | None = None) -> list[str]:
    """'file:line: module imports flwr.x' for every import of a non-public Flower module outside the glue."""
    files = files or module_files()
    out = []
    for module, path in sorted(files.items()):
        if _in(module, (FLOWER_GLUE,)):
            continue
        for name, line in sorted(flwr_imports(path).items()):
            if is_private_flwr(name):
                out.append(
                    f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: {module} imports {name}"
                )
    return out


def is_private_flwr(name: str) -> bool:
    """A Flower module outside its public API (the ``flwr`` package itself is public: its version)."""
    return name != "flwr" and not _in(name, PUBLIC_FLWR)


# --------------------------------------------------------------------------- algorithm names in the worker


def registered_strategy_names(root: Path = ROOT) -> set[str]:
    """Values of ``name = "..."`` class attributes in strategies/*.py."""
    names = set()
    for f in sorted((root / "strategies").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    target = (
                        stmt.targets[0]
                        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                        else (stmt.target if isinstance(stmt, ast.AnnAssign) else None)
                    )
                    value = getattr(stmt, "value", None)
                    if (
                        isinstance(target, ast.Name)
                        and target.id == "name"
                        and isinstance(value, ast.Constant)
                        and isinstance(value.value, str)
                    ):
                        names.add(value.value)
    return names


def algorithm_names(root: Path = ROOT) -> list[str]:
    """Registered names (less ordinary words) and display names, lower-case, unique."""
    names = {n.lower() for n in registered_strategy_names(root) if n.strip()} - ORDINARY_WORDS
    return sorted(names | {n.lower() for n in DISPLAY_NAMES})


def algorithm_mentions(path: Path = WORKER, root: Path = ROOT) -> list[str]:
    """'file:line: name: the line' for every whole-word, case-insensitive mention of an algorithm name."""
    pattern = re.compile(
        r"(?<![a-z0-9])(" + "|".join(map(re.escape, algorithm_names(root))) + r")(?![a-z0-9])", re.IGNORECASE
    )
    out = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        hits = sorted({m.group(1) for m in pattern.finditer(line)})
        if hits:
            out.append(f"{path.relative_to(root)}:{no}: {', '.join(hits)}: {line.strip()}")
    return out


# --------------------------------------------------------------------------- algorithm maths and the one check


def defined_functions(path: Path) -> set[str]:
    """Names of the functions (at any depth) a file defines."""
    return {
        n.name
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def core_mentions(names: list[str], root: Path = ROOT) -> list[str]:
    """'file:line: the line' for every whole-word mention of one of ``names`` in a module under fedapps/."""
    pattern = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, names)) + r")(?![A-Za-z0-9_])")
    out = []
    for f in sorted((root / "fedapps").rglob("*.py")):
        for no, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                out.append(f"{f.relative_to(root)}:{no}: {line.strip()}")
    return out


def definers(function: str, root: Path = ROOT) -> list[str]:
    """The modules of fedapps/ and strategies/ that define ``function``."""
    return sorted(
        str(f.relative_to(root))
        for d in ("fedapps", "strategies")
        for f in sorted((root / d).rglob("*.py"))
        if function in defined_functions(f)
    )


def schema_keys(root: Path = ROOT) -> dict[str, str]:
    """The wire keys the schema modules declare: key -> key, for every ``key("...")`` / ``wire("...", ...)`` call
    there (the first argument, a string)."""
    out: dict[str, str] = {}
    for rel in SCHEMA:
        path = root / rel
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("key", "wire", "_seconds")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                out[node.args[0].value] = node.args[0].value
    return out


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module and of its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


def exempt(rel: str, key: str, forging: dict[str, str], also: dict[str, dict[str, str]]) -> bool:
    """Whether ``key`` may be spelled in the file ``rel`` (rule (f)'s exemptions)."""
    return rel in forging or any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in also.get(key, {}))


def wire_literal_sites(keys: Iterable[str], root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, key) for every string literal equal to one of ``keys`` in the project's modules and its tests,
    outside the schema module; docstrings do not count."""
    keys = set(keys)
    paths = [*module_files(root).values(), *sorted((root / "tests").glob("*.py"))]
    out = []
    for path in sorted(set(paths)):
        rel = path.relative_to(root).as_posix()
        if rel in (*SCHEMA, RULES):  # the schema spells the keys; this module names those it checks
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = docstrings(tree)
        out += [
            (rel, node.lineno, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in keys
            and id(node) not in skip
        ]
    return sorted(out)


def key_literals(
    keys: Iterable[str],
    root: Path = ROOT,
    forging: dict[str, str] | None = None,
    also: dict[str, dict[str, str]] | None = None,
) -> list[str]:
    """'file:line: key' for every wire-key literal (:func:`wire_literal_sites`) that no exemption allows."""
    forging = WIRE_FORGING_TESTS if forging is None else forging
    also = ALSO_A_NAME if also is None else also
    return [
        f"{rel}:{line}: {key!r}"
        for rel, line, key in wire_literal_sites(keys, root)
        if not exempt(rel, key, forging, also)
    ]


def stale_exemptions(
    keys: Iterable[str],
    root: Path = ROOT,
    forging: dict[str, str] | None = None,
    also: dict[str, dict[str, str]] | None = None,
) -> list[str]:
    """The exemptions of rule (f) that no literal needs any more (so that the list stays as narrow as the code)."""
    forging = WIRE_FORGING_TESTS if forging is None else forging
    also = ALSO_A_NAME if also is None else also
    sites = wire_literal_sites(keys, root)
    out = [f"{path}: forges nothing" for path in forging if not any(rel == path for rel, _, _ in sites)]
    for key, places in also.items():
        for p in places:
            if not any(k == key and exempt(rel, key, {}, {key: {p: ""}}) for rel, _, k in sites):
                out.append(f"{key!r} in {p}: not spelled there")
    return out


# --------------------------------------------------------------------------- construction and dead code


def class_fields(path: Path, cls: str) -> list[str]:
    """The annotated fields (``name: type = ...``) of class ``cls`` in ``path``, in order."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [b.target.id for b in node.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]
    raise LookupError(f"no class {cls} in {path}")


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment statement writes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while targets:
        t = targets.pop()
        targets.extend(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else out.append(t)
    return out


def attribute_writes(names: list[str], root: Path = ROOT) -> list[str]:
    """'file:line: .name' for every assignment to an attribute called one of ``names``, in the project's modules
    and its tests."""
    paths = [*module_files(root).values(), *sorted((root / "tests").glob("*.py"))]
    out = []
    for path in sorted(set(paths)):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            out += [
                f"{path.relative_to(root)}:{node.lineno}: .{t.attr}"
                for t in _assigned(node)
                if isinstance(t, ast.Attribute) and t.attr in names
            ]
    return out


def unreferenced_methods(root: Path = ROOT) -> list[str]:
    """'file:line: Class.method' for every method a class in strategies/ defines (dunders aside) whose name no
    module of the project mentions as an attribute, a name or a string constant."""
    named: set[str] = set()
    defined: list[tuple[str, int, str, str]] = []
    for path in module_files(root).values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                named.add(node.attr)
            elif isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.add(node.value)
            elif isinstance(node, ast.ClassDef) and path.relative_to(root).parts[0] == "strategies":
                flower = any(getattr(b, "id", getattr(b, "attr", None)) == FLOWER_STRATEGY for b in node.bases)
                defined += [
                    (str(path.relative_to(root)), f.lineno, node.name, f.name)
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not f.name.startswith("__")
                    and not (flower and f.name in CALLED_BY_FLOWER)
                ]
    return [
        f"{file}:{line}: {cls}.{name}"
        for file, line, cls, name in sorted(defined)
        if name not in named and name not in CALLED_BY_TORCH
    ]


# --------------------------------------------------------------------------- tests


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert {
        "fedapps.config",
        "fedapps.client.worker",
        "strategies",
        "strategies.base",
        "server_app",
        "client_app",
    } <= set(graph)
    assert "fedapps.client.worker" in graph["client_app"]  # an import inside a function (the first message's)
    assert "fedapps.config" in graph["server_app"]  # a top-level import
    assert "fedapps.data.errors" in graph["fedapps.data.federation"]  # a relative import
    assert {"fedapps.models.simple", "fedapps.models.vision"} <= set(graph["fedapps.models.zoo"])  # from . import x
    assert "fedapps_tools.compare" in graph["fedapps_tools.cli"]  # an import inside a function
    assert {"fedavg", "cosmos", "comet"} <= registered_strategy_names()


def test_the_helpers_on_a_made_up_graph():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"e": 1}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_point_down_only():
    violations = layer_violations(import_graph())
    assert not violations, "imports pointing up a layer:\n" + "\n".join(violations)


def test_core_layers_on_a_made_up_graph():
    graph = {
        "fedapps.wire.protocol": {"fedapps.client.worker": 3, "fedapps.config": 4},
        "fedapps.client.worker": {"fedapps.reporting.plots": 5, "fedapps.wire.protocol": 6, "fedapps.client.ops": 7},
        "fedapps.flower.inprocess": {"fedapps.client.worker": 8},
        "fedapps.client.ops": {},
        "fedapps.reporting.plots": {},
        "fedapps.config": {},
        "fedapps.newthing": {"fedapps.config": 9},
        "fedapps.server.driver": {"fedapps.flower.connect": 10, "fedapps.reporting.results": 11},
    }
    files = {m: ROOT / (m.replace(".", "/") + ".py") for m in graph}
    found = [v.split(": ", 1)[1] for v in layer_violations(graph, files)]
    assert found == [
        (
            "fedapps.client.worker imports fedapps.reporting.plots (core layers: fedapps.client (level 2) imports only "
            "lower levels, not fedapps.reporting (level 2))"
        ),
        "fedapps.newthing imports fedapps.config (a core module with no layer in CORE_LEVELS: give it one)",
        (
            "fedapps.wire.protocol imports fedapps.client.worker (core layers: fedapps.wire (level 1) imports only "
            "lower levels, not fedapps.client (level 2))"
        ),
    ]


def test_the_drop_in_facade_is_a_top_layer_on_a_made_up_graph():
    graph = {
        FACADE: {"strategies.cwfedavg": 1, "fedapps.server.dropin": 2, "fedapps_tools.cli": 3},
        "fedapps.server.dropin": {FACADE: 4, "strategies.cwfedavg": 5},
        "strategies.cwfedavg": {},
        "fedapps_tools.cli": {},
    }
    files = {m: ROOT / (m.replace(".", "/") + ".py") for m in graph}
    found = [v.split(": ", 1)[1] for v in layer_violations(graph, files)]
    assert found == [
        f"{FACADE} imports fedapps_tools.cli ({FACADE} below the apps and tools)",
        f"fedapps.server.dropin imports {FACADE} ({FACADE} is a top layer: nothing in the project imports it)",
        "fedapps.server.dropin imports strategies.cwfedavg (fedapps below the strategies, apps and tools)",
    ]


def test_every_core_module_has_a_layer():
    unplaced = [m for m in module_files() if _in(m, ("fedapps",)) and m != FACADE and core_level(m) is None]
    assert not unplaced, f"core modules with no layer in CORE_LEVELS: {unplaced}"


def test_only_the_flower_glue_imports_flowers_private_modules():
    found = private_flower_imports()
    assert not found, "private Flower modules imported outside fedapps/flower/:\n" + "\n".join(found)
    glue = [
        m for m, f in module_files().items() if _in(m, (FLOWER_GLUE,)) and any(map(is_private_flwr, flwr_imports(f)))
    ]
    assert glue, "the check has teeth: the glue does import private modules"


def test_the_private_flower_check_sees_a_violation(tmp_path):
    (tmp_path / "a.py").write_text(
        "import flwr\nfrom flwr.app import Message\n\ndef f():\n"
        "    from flwr.supercore.control import X\n    import flwr.proto.x_pb2\n"
    )
    assert flwr_imports(tmp_path / "a.py") == {
        "flwr": 1,
        "flwr.app": 2,
        "flwr.supercore.control": 5,
        "flwr.proto.x_pb2": 6,
    }
    found = private_flower_imports({"fedapps_tools.a": tmp_path / "a.py"})
    assert [f.split(": ", 1)[1] for f in found] == [
        "fedapps_tools.a imports flwr.proto.x_pb2",
        "fedapps_tools.a imports flwr.supercore.control",
    ]
    assert private_flower_imports({"fedapps.flower.a": tmp_path / "a.py"}) == []


def test_worker_names_no_algorithm():
    mentions = algorithm_mentions()
    assert not mentions, f"{len(mentions)} algorithm names in the generic client:\n" + "\n".join(mentions)


def test_cosmos_r_b_lives_in_its_module_and_not_in_the_core():
    for name, home in MOVED_OUT_OF_CORE.items():  # the check is not vacuous: each name is where it moved
        assert name in (ROOT / home).read_text(encoding="utf-8"), (name, home)
    assert {"robustness_penalty", "rb_term"} <= defined_functions(ROOT / "strategies" / "cosmos.py")
    mentions = core_mentions(sorted(MOVED_OUT_OF_CORE))
    assert not mentions, "names of COSMOS's r_B in the core (fedapps/):\n" + "\n".join(mentions)


def test_one_prediction_check():
    function, home = PREDICTION_CHECK
    assert definers(function) == [home]


def test_wire_keys_are_spelled_in_the_schema_module_only():
    keys = schema_keys()
    # the check has teeth: the schema lists the keys of every part of a message and a reply
    assert {"return-arrays", "arrays.keys", "state-dir", "predictions", "client-id", "ops", "round"} <= set(keys)
    assert {"config", "load-arrays", "public.fingerprint", "predict.output", "targets", "fingerprint"} <= set(keys)
    found = key_literals(keys.values())
    assert not found, (
        "wire keys spelled outside the schema modules (use fedapps.wire.protocol's constants, or its dataclasses):\n"
        + "\n".join(found)
    )


def test_every_exemption_of_the_wire_key_rule_is_still_needed():
    found = stale_exemptions(schema_keys().values())
    assert not found, "exemptions of rule (f) that nothing needs (remove them):\n" + "\n".join(found)


def test_the_maths_checks_see_a_violation(tmp_path):
    """On a made-up tree, both checks report what they must."""
    for sub in ("client", "wire"):
        (tmp_path / "fedapps" / sub).mkdir(parents=True)
    (tmp_path / "strategies").mkdir()
    (tmp_path / "fedapps" / "client" / "ops.py").write_text(
        "def robustness_penalty(x):\n    return x  # rb_lambdas is another word\n"
    )
    (tmp_path / "fedapps" / "wire" / "validation.py").write_text("def prediction_problem(w):\n    pass\n")
    (tmp_path / "strategies" / "pl.py").write_text("class A:\n    def prediction_problem(self):\n        pass\n")
    assert core_mentions(["robustness_penalty", "rb_lambda"], tmp_path) == [
        "fedapps/client/ops.py:1: def robustness_penalty(x):"
    ]
    assert definers("prediction_problem", tmp_path) == ["fedapps/wire/validation.py", "strategies/pl.py"]


def test_the_wire_key_check_sees_a_violation(tmp_path):
    """On a made-up tree: the keys are read off the schema's KEYS; a literal in a strategy and in a test is found, a
    docstring, a longer string and the schema module itself are not, and each kind of exemption works (and is
    reported once nothing needs it)."""
    for sub in ("fedapps/wire", "strategies", "tests", "fedapps_tools"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "fedapps" / "wire" / "keys.py").write_text(
        'OUTPUT = key("predict.output")\nROUND = key("round")\nOTHER = "not-listed"\n'
    )
    assert schema_keys(tmp_path) == {"predict.output": "predict.output", "round": "round"}
    (tmp_path / "strategies" / "pl.py").write_text(
        '"""Reads predict.output."""\nconfig = {"predict.output": 1, "x": "not-listed"}\n\n\n'
        'def f():\n    """predict.output"""\n    return "predict.output is a key"\n'
    )
    (tmp_path / "tests" / "test_x.py").write_text('def test():\n    assert {"predict.output": 1}["round"]\n')
    (tmp_path / "fedapps_tools" / "table.py").write_text('COLUMN = "round"\n')
    keys = ("predict.output", "round")
    assert key_literals(keys, tmp_path, {}, {}) == [
        "fedapps_tools/table.py:1: 'round'",
        "strategies/pl.py:2: 'predict.output'",
        "tests/test_x.py:2: 'predict.output'",
        "tests/test_x.py:2: 'round'",
    ]
    forging, also = {"tests/test_x.py": "forges"}, {"round": {"fedapps_tools/": "a column", "server_app.py": "a field"}}
    assert key_literals(keys, tmp_path, forging, also) == ["strategies/pl.py:2: 'predict.output'"]
    assert stale_exemptions(keys, tmp_path, forging, also) == ["'round' in server_app.py: not spelled there"]
    assert stale_exemptions(keys, tmp_path, {"tests/test_y.py": "forges"}, {}) == ["tests/test_y.py: forges nothing"]


def test_strategies_are_not_wired_after_construction():
    fields = class_fields(ROOT / RUN_CONTEXT[0], RUN_CONTEXT[1])
    assert {"on_round", "client_state", "server_state_dir", "excluded_nodes"} <= set(fields)  # the check has teeth
    found = attribute_writes(fields)
    assert not found, (
        "run context set on an object after its construction (pass it in RunContext instead):\n" + "\n".join(found)
    )


def test_no_strategy_method_is_left_uncalled():
    found = unreferenced_methods()
    assert not found, (
        "methods of strategies/ that nothing in the project names (dead hooks or adapters):\n" + "\n".join(found)
    )


def test_the_construction_checks_see_a_violation(tmp_path):
    """On a made-up tree, the wiring and dead-method checks report what they must, and only that."""
    (tmp_path / "strategies").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "strategies" / "base.py").write_text(
        "class RunContext:\n    on_round: object = None\n    excluded_nodes: frozenset = frozenset()\n\n"
        "class Base:\n    def start(self):\n        self.round()\n\n    def round(self):\n        pass\n\n"
        "    def configure_train(self):\n        pass\n\n"
        "class DropIn(Strategy):\n    def configure_train(self):\n        pass\n"
    )
    (tmp_path / "server_app.py").write_text("def run(s):\n    s.start()\n    s.context = 1\n")
    (tmp_path / "tests" / "test_x.py").write_text(
        "def test(s):\n    s.x, s.excluded_nodes = 1, {2}\n    s.configure_train()\n"
    )
    fields = class_fields(tmp_path / "strategies" / "base.py", "RunContext")
    assert fields == ["on_round", "excluded_nodes"]
    assert attribute_writes(fields, tmp_path) == ["tests/test_x.py:2: .excluded_nodes"]
    assert unreferenced_methods(tmp_path) == ["strategies/base.py:12: Base.configure_train"]  # a test's call: no


def main() -> int:
    """Print the layer violations, cycles and algorithm names in the worker; 1 if there are any."""
    graph = import_graph()
    problems = 0
    for title, lines in (
        ("layer violations", layer_violations(graph)),
        ("import cycles", [" -> ".join(c) for c in find_cycles(graph)]),
        ("private Flower imports outside fedapps/flower/", private_flower_imports()),
        ("algorithm names in fedapps/client/worker.py", algorithm_mentions()),
        ("names of COSMOS's r_B in fedapps/", core_mentions(sorted(MOVED_OUT_OF_CORE))),
        (
            "other definitions of the prediction check",
            [d for d in definers(PREDICTION_CHECK[0]) if d != PREDICTION_CHECK[1]],
        ),
        ("wire keys outside the schema modules", key_literals(schema_keys().values())),
        ("run context set after construction", attribute_writes(class_fields(ROOT / RUN_CONTEXT[0], RUN_CONTEXT[1]))),
        ("methods of strategies/ nothing names", unreferenced_methods()),
    ):
        print(f"{title}: {len(lines) or 'none'}")
        for line in lines:
            print("  " + line)
        problems += len(lines)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())


@pytest.mark.heavy
def test_the_clientapp_does_not_import_what_only_the_server_or_some_models_need():
    """Every message in deployment starts a fresh ClientApp process: torchvision (~1.3 s, only the vision models
    need it), scikit-learn's clustering (~1 s, server side of CFL / COMET) and numba (~0.5 s, COSMOS's server-side
    l1 distances) are imported where used."""
    import subprocess

    # what the ClientApp imports for its first message, then the heavy modules it must not have imported
    code = (
        "import sys, client_app, strategies, fedapps.client.worker; "
        "heavy = [m for m in ('torchvision', 'sklearn.cluster', 'numba') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).parents[1]))
