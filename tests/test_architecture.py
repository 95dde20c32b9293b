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
(c) ``fedapps/client/worker.py`` (the generic client) names no algorithm: no registered strategy name (the
    ``name = "..."`` class attributes in ``strategies/*.py``) and no algorithm display name appears in it,
    case-insensitively, as a whole word (letters and digits only form words: ``ditto_lam`` and ``FedAvg's``
    both count), in code, strings or comments;
(d) an algorithm's own maths stays in its module: COSMOS's r_B (:data:`MOVED_OUT_OF_CORE`: the function, its term
    builder and its message settings) is defined in ``strategies/cosmos.py`` and named nowhere in ``fedapps/``;
(e) each reply is checked once, with one prediction check: ``prediction_problem`` is defined in
    ``fedapps/wire/validation.py`` and in no other module of ``fedapps/`` or ``strategies/``;
(f) the wire keys of the public set U (:data:`PROTOCOL_KEYS`: the ``public.fingerprint`` / ``predict.*`` settings and
    the array names of the predictions and targets records) are spelled in ``fedapps/wire/protocol.py`` only: no other
    module of the project holds a string literal equal to one of them (docstrings, comments and longer strings that
    contain one do not count);
(g) a strategy is given its run context at construction, never wired afterwards: no module of the project and no test
    assigns an attribute named after a field of ``strategies.base.RunContext`` (``x.client_state = ...``);
(h) no dead hooks or adapters: every method a class in ``strategies/`` defines is named somewhere in the project's
    modules (called, referenced or looked up by a string; tests do not count), torch's ``forward`` aside.

Run ``python tests/test_architecture.py`` to print the graph's layer violations and cycles (exit status 1
when there are any). A standard alternative for looking at the graph is ``pydeps`` (e.g.
``pydeps fedapps --show-cycles``) or ``import-linter`` for layer contracts; this module needs neither.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedapps", "strategies", "fedapps_tools")
TOP_MODULES = ("server_app", "client_app")
ENTRY_POINTS = ("fedapps_tools",)  # the layer above the apps
APPS = ("server_app", "client_app")
CONFIG = "fedapps.config"
CONFIG_MAY_IMPORT = ("fedapps.params",)  # beside error modules
DISPLAY_NAMES = ("FedAvg", "cwFedAvg", "COSMOS", "FedMD", "FedCT", "COMET", "FedAMP", "FedFomo", "CFL", "IFCA",
                 "Ditto", "FedBABU", "FedPer", "FedRep", "FedProx", "WDR")
# A registered name that is an ordinary word ('local' training/epochs/data) says nothing about an algorithm.
ORDINARY_WORDS = frozenset({"local"})
WORKER = ROOT / "fedapps" / "client" / "worker.py"
# names that left the core for their algorithm's module (rule d): name -> the module that defines or reads it
MOVED_OUT_OF_CORE = {"robustness_penalty": "strategies/cosmos.py", "rb_term": "strategies/cosmos.py",
                     "rb_lambda": "strategies/cosmos.py", "rb_sigma": "strategies/cosmos.py"}
PREDICTION_CHECK = ("prediction_problem", "fedapps/wire/validation.py")  # rule (e): the one prediction check, where
PROTOCOL = "fedapps/wire/protocol.py"
PROTOCOL_KEYS = ("public.fingerprint", "predict.output", "predict.encoding", "predictions", "targets",
                 "distill-indices", "predict-indices")  # rule (f); the rest of the keys: issue #27's typed schema
RUN_CONTEXT = ("strategies/base.py", "RunContext")  # rule (g): the class whose fields are construction inputs
CALLED_BY_TORCH = frozenset({"forward"})  # rule (h): methods torch calls for us (nn.Module.__call__)


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
            if _in(src, ("fedapps",)) and _in(dst, ("strategies",) + APPS + ENTRY_POINTS):
                report(src, dst, "fedapps below the strategies, apps and tools")
            if src == CONFIG and _in(dst, PACKAGES + TOP_MODULES) and not (
                    _in(dst, CONFIG_MAY_IMPORT) or _is_error_module(dst)):
                report(src, dst, f"{CONFIG} imports only {', '.join(CONFIG_MAY_IMPORT)} and error modules")
            if _in(src, ("strategies",)) and _in(dst, APPS + ENTRY_POINTS):
                report(src, dst, "strategies below the apps and entry points")
    return out


# --------------------------------------------------------------------------- algorithm names in the worker


def registered_strategy_names(root: Path = ROOT) -> set[str]:
    """Values of ``name = "..."`` class attributes in strategies/*.py."""
    names = set()
    for f in sorted((root / "strategies").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else (
                        stmt.target if isinstance(stmt, ast.AnnAssign) else None)
                    value = getattr(stmt, "value", None)
                    if (isinstance(target, ast.Name) and target.id == "name" and isinstance(value, ast.Constant)
                            and isinstance(value.value, str)):
                        names.add(value.value)
    return names


def algorithm_names(root: Path = ROOT) -> list[str]:
    """Registered names (less ordinary words) and display names, lower-case, unique."""
    names = {n.lower() for n in registered_strategy_names(root) if n.strip()} - ORDINARY_WORDS
    return sorted(names | {n.lower() for n in DISPLAY_NAMES})


def algorithm_mentions(path: Path = WORKER, root: Path = ROOT) -> list[str]:
    """'file:line: name: the line' for every whole-word, case-insensitive mention of an algorithm name."""
    pattern = re.compile(r"(?<![a-z0-9])(" + "|".join(map(re.escape, algorithm_names(root))) + r")(?![a-z0-9])",
                         re.IGNORECASE)
    out = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        hits = sorted({m.group(1) for m in pattern.finditer(line)})
        if hits:
            out.append(f"{path.relative_to(root)}:{no}: {', '.join(hits)}: {line.strip()}")
    return out


# --------------------------------------------------------------------------- algorithm maths and the one check


def defined_functions(path: Path) -> set[str]:
    """Names of the functions (at any depth) a file defines."""
    return {n.name for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


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
    return sorted(str(f.relative_to(root)) for d in ("fedapps", "strategies") for f in sorted((root / d).rglob("*.py"))
                  if function in defined_functions(f))


def key_literals(keys: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """'file:line: key' for every string literal equal to one of ``keys`` outside fedapps/wire/protocol.py."""
    out = []
    for _name, path in sorted(module_files(root).items()):
        rel = str(path.relative_to(root))
        if rel == PROTOCOL:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys:
                out.append(f"{rel}:{node.lineno}: {node.value!r}")
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
            out += [f"{path.relative_to(root)}:{node.lineno}: .{t.attr}" for t in _assigned(node)
                    if isinstance(t, ast.Attribute) and t.attr in names]
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
                defined += [(str(path.relative_to(root)), f.lineno, node.name, f.name) for f in node.body
                            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("__")]
    return [f"{file}:{line}: {cls}.{name}" for file, line, cls, name in sorted(defined)
            if name not in named and name not in CALLED_BY_TORCH]


# --------------------------------------------------------------------------- tests


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert {"fedapps.config", "fedapps.client.worker", "strategies", "strategies.base", "server_app", "client_app"} <= set(graph)
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


def test_public_set_keys_are_spelled_in_the_protocol_module_only():
    text = (ROOT / PROTOCOL).read_text(encoding="utf-8")
    assert all(f'"{k}"' in text for k in PROTOCOL_KEYS)  # each key is spelled there
    found = key_literals(PROTOCOL_KEYS)
    assert not found, "protocol keys spelled outside fedapps/wire/protocol.py (use its constants):\n" + "\n".join(found)


def test_the_maths_checks_see_a_violation(tmp_path):
    """On a made-up tree, both checks report what they must."""
    for sub in ("client", "wire"):
        (tmp_path / "fedapps" / sub).mkdir(parents=True)
    (tmp_path / "strategies").mkdir()
    (tmp_path / "fedapps" / "client" / "ops.py").write_text(
        "def robustness_penalty(x):\n    return x  # rb_lambdas is another word\n")
    (tmp_path / "fedapps" / "wire" / "validation.py").write_text("def prediction_problem(w):\n    pass\n")
    (tmp_path / "strategies" / "pl.py").write_text("class A:\n    def prediction_problem(self):\n        pass\n")
    assert core_mentions(["robustness_penalty", "rb_lambda"], tmp_path) == [
        "fedapps/client/ops.py:1: def robustness_penalty(x):"]
    assert definers("prediction_problem", tmp_path) == ["fedapps/wire/validation.py", "strategies/pl.py"]
    (tmp_path / "fedapps" / "wire" / "protocol.py").write_text('KEY = "predict.output"\n')
    (tmp_path / "strategies" / "pl.py").write_text('"""Reads predict.output."""\nconfig = {"predict.output": 1}\n')
    assert key_literals(("predict.output",), tmp_path) == ["strategies/pl.py:2: 'predict.output'"]


def test_strategies_are_not_wired_after_construction():
    fields = class_fields(ROOT / RUN_CONTEXT[0], RUN_CONTEXT[1])
    assert {"on_round", "client_state", "server_state_dir", "excluded_nodes"} <= set(fields)  # the check has teeth
    found = attribute_writes(fields)
    assert not found, ("run context set on an object after its construction (pass it in RunContext instead):\n"
                       + "\n".join(found))


def test_no_strategy_method_is_left_uncalled():
    found = unreferenced_methods()
    assert not found, "methods of strategies/ that nothing in the project names (dead hooks or adapters):\n" + \
        "\n".join(found)


def test_the_construction_checks_see_a_violation(tmp_path):
    """On a made-up tree, the wiring and dead-method checks report what they must, and only that."""
    (tmp_path / "strategies").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "strategies" / "base.py").write_text(
        "class RunContext:\n    on_round: object = None\n    excluded_nodes: frozenset = frozenset()\n\n"
        "class Base:\n    def start(self):\n        self.round()\n\n    def round(self):\n        pass\n\n"
        "    def configure_train(self):\n        pass\n")
    (tmp_path / "server_app.py").write_text("def run(s):\n    s.start()\n    s.context = 1\n")
    (tmp_path / "tests" / "test_x.py").write_text("def test(s):\n    s.x, s.excluded_nodes = 1, {2}\n"
                                                  "    s.configure_train()\n")
    fields = class_fields(tmp_path / "strategies" / "base.py", "RunContext")
    assert fields == ["on_round", "excluded_nodes"]
    assert attribute_writes(fields, tmp_path) == ["tests/test_x.py:2: .excluded_nodes"]
    assert unreferenced_methods(tmp_path) == ["strategies/base.py:12: Base.configure_train"]  # a test's call: no


def main() -> int:
    """Print the layer violations, cycles and algorithm names in the worker; 1 if there are any."""
    graph = import_graph()
    problems = 0
    for title, lines in (("layer violations", layer_violations(graph)),
                         ("import cycles", [" -> ".join(c) for c in find_cycles(graph)]),
                         ("algorithm names in fedapps/client/worker.py", algorithm_mentions()),
                         ("names of COSMOS's r_B in fedapps/", core_mentions(sorted(MOVED_OUT_OF_CORE))),
                         ("other definitions of the prediction check",
                          [d for d in definers(PREDICTION_CHECK[0]) if d != PREDICTION_CHECK[1]]),
                         ("public-set keys outside fedapps/wire/protocol.py", key_literals(PROTOCOL_KEYS)),
                         ("run context set after construction",
                          attribute_writes(class_fields(ROOT / RUN_CONTEXT[0], RUN_CONTEXT[1]))),
                         ("methods of strategies/ nothing names", unreferenced_methods())):
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
    code = ("import sys, client_app, strategies, fedapps.client.worker; "
            "heavy = [m for m in ('torchvision', 'sklearn.cluster', 'numba') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).parents[1]))
