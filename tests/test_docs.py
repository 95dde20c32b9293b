"""Docs that cannot drift.

(a) The site builds with ``mkdocs build --strict`` (a broken link, anchor or snippet fails), the reference pages
    generated from the code are current (fedapps_tools/docgen.py), and the nav has a page for every strategy.
(b) Every command in a ``<!-- runnable -->`` bash block of docs/**/*.md and README.md runs and exits 0: ``fedapps
    run|compare|tune`` with tiny settings appended (in-process engine, 1 round, digits, an MLP, 3 clients), other
    commands as written, each block in a temporary folder holding copies of configs/, experiments/, bench/, scripts/.
(c) Every ``docs/<page>.md`` or ``docs/<page>.md#anchor`` that the code cites exists, the anchor computed as the
    site's table of contents computes it.
(d) The code cites no heading of the front page and no file outside the repository (the team's notes are not
    shipped): such a citation is a promise nobody checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
HAS_MKDOCS = importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("material") is not None
needs_mkdocs = pytest.mark.skipif(
    not HAS_MKDOCS, reason='mkdocs / mkdocs-material not installed: they come with pip install -e ".[test]"'
)
QUIET_ENV = {"NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0, printed on every build

# The code whose comments, docstrings and messages are checked by (c) and (d).
CODE_DIRS = ("fedapps", "strategies", "fedapps_tools", "bench", "scripts", "tests", "configs", "experiments", "deploy")
CODE_FILES = ("server_app.py", "client_app.py", "Makefile", "pyproject.toml", "mkdocs.yml")
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".toml", ".sh", ".md", ".txt")
# Files the lead is editing (they still hold such citations; each is fixed with the lead's change). A file listed
# here that no longer cites anything forbidden fails the test: take it off the list.

FRONT_PAGE = "READ" + "ME"  # spelt in two halves so that this file does not cite it either
FORBIDDEN = (
    (re.compile(rf"\b{FRONT_PAGE}\b(?!\.md)"), f"cites the {FRONT_PAGE} (its headings move; cite a docs/ page)"),
    (re.compile(r"(?<![\w.])\.\./shared\b|/work/share[d]\b"), "cites a path outside the repository"),
    (
        re.compile(r"(?<![\w/])specs/[\w.-]+"),
        (
            "cites the team's spec notes, which are not in the repository "
            "(docs/evaluation.md says the evaluation protocol)"
        ),
    ),
    (re.compile(r"\b(?:DESIGN|FLOWER)\.md\b"), "cites the team's design notes, which are not in the repository"),
)
DOC_CITATION = re.compile(r"(?<![\w/.-])docs/((?:[\w-]+/)*[\w.-]+\.md)(?:#([\w-]+))?")


def code_files() -> list[Path]:
    out = [ROOT / f for f in CODE_FILES if (ROOT / f).is_file()]
    for d in CODE_DIRS:
        out += sorted(
            p
            for p in (ROOT / d).rglob("*")
            if p.is_file() and p.suffix in CODE_SUFFIXES and "__pycache__" not in p.parts
        )
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- (a) the site and its generated pages


@needs_mkdocs
@pytest.mark.heavy
def test_site_builds_strict(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **QUIET_ENV},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed (make docs shows the same):\n{proc.stderr[-6000:]}"


def test_generated_reference_pages_are_current():
    from fedapps_tools import docgen

    stale = docgen.stale()
    assert not stale, (
        f"generated docs pages differ from the code: {', '.join(stale)}; regenerate them with "
        f"`{docgen.REGENERATE}` (or `make docs-reference`) and commit the result"
    )


def test_a_changed_default_makes_its_page_stale(tmp_path, monkeypatch):
    """The staleness check compares content: a parameter's default changed without regenerating is caught."""
    from fedapps_tools import docgen
    from strategies.fedprox import FedProxParams

    page = Path("docs") / "reference" / "params" / "fedprox.md"
    before = docgen.pages()[page]
    mu = next(f for f in dataclasses.fields(FedProxParams) if f.name == "mu")
    monkeypatch.setattr(mu, "default", 0.5)
    after = docgen.pages()[page]
    assert after != before and "| `mu` | float | `0.5` |" in after
    assert str(page) in docgen.stale()  # the file on disk still says 0.01


def undocumented_params(docgen, strategies) -> list[str]:
    """``strategy.params.<name>.<key>`` of every declared parameter without help text."""
    return [
        f"strategy.params.{name}.{f.name}"
        for name, cls in sorted(strategies.items())
        for f in dataclasses.fields(cls.Params)
        if not getattr(docgen.constraint(f), "help", "")
    ]


def test_every_config_key_and_strategy_parameter_has_help():
    """The generated reference is only as good as the help text in the code (docgen refuses a config key without
    one; strategy parameters are listed here)."""
    from fedapps_tools import docgen
    from strategies import STRATEGIES

    docgen.configuration_page(STRATEGIES)  # raises naming a config key without help
    missing = sorted(undocumented_params(docgen, STRATEGIES))
    assert not missing, f"parameters without help= in their param(...): {missing}"


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in nav_pages(value)]
    return []


def test_nav_has_a_page_for_every_strategy():
    from strategies import STRATEGIES

    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {p.removeprefix("algorithms/").removesuffix(".md") for p in nav if p.startswith("algorithms/")}
    assert pages - {"index"} == set(STRATEGIES), "mkdocs.yml's Algorithms section and strategies/ disagree"


# --------------------------------------------------------------------------- (b) runnable snippets


@dataclasses.dataclass(frozen=True)
class Block:
    """A ``<!-- runnable -->`` bash block: where it is and its commands (continuation lines joined)."""

    path: str
    line: int
    commands: tuple[str, ...]


def runnable_blocks(text: str, path: str) -> list[Block]:
    """The bash blocks directly preceded by the line ``<!-- runnable -->``."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        if line.strip() != "<!-- runnable -->":
            continue
        if lines[i + 1].strip() not in ("```bash", "```sh", "```shell"):
            raise AssertionError(f"{path}:{i + 1}: '<!-- runnable -->' must be directly followed by a ```bash block")
        body, j = [], i + 2
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j])
            j += 1
        commands, pending = [], ""
        for raw in body:
            if raw.rstrip().endswith("\\"):
                pending += raw.strip()[:-1].rstrip() + " "
                continue
            command = (pending + raw.strip()).strip()
            pending = ""
            if command and not command.startswith("#"):
                commands.append(command)
        out.append(Block(path, i + 2, tuple(commands)))
    return out


def all_blocks() -> list[Block]:
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [b for f in files if f.is_file() for b in runnable_blocks(f.read_text(), rel(f))]


FEDAPPS = ("fedapps", ".venv/bin/fedapps")
TINY_COMMANDS = ("run", "compare", "tune")
TINY = [
    "rounds=1",
    "data.source=digits",
    "data.num_clients=3",
    "data.min_samples=2",
    "client.epochs=1",
    "strategy.min_clients=1",
    "strategy.expected_clients=0",
]
NOT_RUNNABLE = {
    "make": "a make target runs full experiments or the suite",
    "pip": "it changes the environment",
    "pytest": "the suite would run itself",
    "git": "it changes the checkout",
}
SHELL_SYNTAX = re.compile(r"[|;&<>`]|\$\(")


def tiny_settings(argv: list[str], folder: Path) -> list[str]:
    """What makes ``fedapps run|compare|tune CONFIG...`` take seconds: the engine, 1 round of digits with 3 clients
    and an MLP, and every strategy's epochs at 1, cluster counts within 3 clients, server models an MLP. A run keeps
    the folder name its config gives (the data source is part of a derived name), so that later commands find it."""
    from fedapps.config import load_config
    from fedapps.models import MODEL_NAMES
    from fedapps.params import constraint
    from strategies import STRATEGIES

    overrides = set_values(argv)
    configs = [a for a in argv[2:] if a.endswith((".yaml", ".yml")) and (folder / a).is_file()]
    extra = list(TINY)
    for path in configs:
        cfg = load_config(folder / path, overrides)
        if argv[1] == "run":  # the folder the docs name is the one the doc's own settings give (compare and tune
            extra.append(f"run_name={cfg.resolved_run_name()}")  # name their runs themselves)
        extra.append(f"data.groups={min(cfg.data.groups, 2)}")
        extra.append("model.per_client=[mlp]" if cfg.model.per_client else "model.name=mlp")
        name = cfg.strategy.name
        for f in dataclasses.fields(STRATEGIES[name].Params):
            c = constraint(f)
            choices = c.allowed_choices() if c is not None else None
            if f.name.endswith("epochs"):
                extra.append(f"strategy.params.{name}.{f.name}=1")
            elif f.name in ("clusters", "max_clusters"):
                extra.append(f"strategy.params.{name}.{f.name}=2")
            elif choices is not None and set(choices) == set(MODEL_NAMES):
                extra.append(f"strategy.params.{name}.{f.name}=mlp")
    return ["--engine", "inprocess", "--set", *dict.fromkeys(extra)]


def set_values(argv: list[str]) -> list[str]:
    """The KEY=VALUE overrides given after ``--set`` options."""
    out, inside = [], False
    for token in argv:
        if token.startswith("-"):
            inside = token == "--set"
        elif inside:
            out.append(token)
    return out


def prepared(command: str, folder: Path) -> str:
    """The command as the test runs it: ``fedapps run|compare|tune`` gets the tiny settings appended."""
    if SHELL_SYNTAX.search(command):
        return command
    argv = shlex.split(command)
    if argv and argv[0] in NOT_RUNNABLE:
        raise AssertionError(
            f"'{command}' cannot be run by a test ({NOT_RUNNABLE[argv[0]]}): remove its "
            "'<!-- runnable -->' mark or move it to a block of its own"
        )
    if len(argv) > 1 and argv[0] in FEDAPPS and argv[1] in TINY_COMMANDS:
        return shlex.join(argv + tiny_settings(argv, folder))
    return command


def workspace(folder: Path) -> dict[str, str]:
    """A folder to run a block in: copies of what commands read, `fedapps` and `python` shims; its environment."""
    for name in ("configs", "experiments", "bench", "scripts"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shims = folder / ".venv" / "bin"
    shims.mkdir(parents=True)
    for name, target in (
        ("fedapps", f"{shlex.quote(sys.executable)} -m fedapps_tools.cli"),
        ("python", shlex.quote(sys.executable)),
        ("python3", shlex.quote(sys.executable)),
    ):
        (shims / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (shims / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "FEDAPPS_BENCH_RESULTS": str(folder / "bench-results"),
    }


def run_block(block: Block, folder: Path) -> subprocess.CompletedProcess:
    env = workspace(folder)
    script = "set -euo pipefail\n" + "".join(
        f"echo '$ '{shlex.quote(c)}\n{c}\n" for c in (prepared(c, folder) for c in block.commands)
    )
    return subprocess.run(["bash", "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=900)


BLOCKS = all_blocks()


@pytest.mark.heavy
@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.path}:{b.line}" for b in BLOCKS])
def test_runnable_snippet(block, tmp_path):
    proc = run_block(block, tmp_path)
    assert proc.returncode == 0, (
        f"{block.path}:{block.line}: a runnable command failed (exit {proc.returncode}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )


def test_runnable_blocks_are_found_and_commands_joined():
    text = textwrap.dedent("""\
        Intro.

        <!-- runnable -->
        ```bash
        # a comment
        fedapps run configs/fedavg.yaml \\
            --set client.lr=0.01
        fedapps report results/x
        ```

        ```bash
        make run
        ```
        """)
    (block,) = runnable_blocks(text, "page.md")
    assert block.line == 4
    assert block.commands == ("fedapps run configs/fedavg.yaml --set client.lr=0.01", "fedapps report results/x")
    with pytest.raises(AssertionError, match="directly followed"):
        runnable_blocks("<!-- runnable -->\ntext\n", "page.md")


def test_the_readme_tour_is_getting_starteds_and_bench_tour_reads_it():
    """One tour: README.md's bash block under "A five-minute tour" is getting-started's, command for command, and it
    is the block bench/tour.py times (its figure: docs/performance.md#tour)."""
    spec = importlib.util.spec_from_file_location("bench_tour", ROOT / "bench" / "tour.py")
    assert spec is not None and spec.loader is not None
    tour = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tour)
    readme = tour.tour_block((ROOT / "README.md").read_text())
    guide = tour.tour_block((ROOT / "docs" / "getting-started.md").read_text())
    assert readme == guide and len(readme) >= 5
    # the runs are short (in-process, or few rounds where the point is `flwr run`)
    for command in readme:
        argv = shlex.split(command)
        if argv[1] in TINY_COMMANDS:
            assert "rounds=2" in argv, command
    (block,) = [b for b in BLOCKS if b.path == "docs/getting-started.md" and b.commands == tuple(guide)]


def test_tiny_settings_are_appended_to_runs_only(tmp_path):
    workspace(tmp_path)
    run = shlex.split(prepared("fedapps run configs/cosmos.yaml --set client.lr=0.01", tmp_path))
    assert run[:5] == ["fedapps", "run", "configs/cosmos.yaml", "--set", "client.lr=0.01"]
    tail = run[5:]
    assert tail[:3] == ["--engine", "inprocess", "--set"]
    for setting in (
        "rounds=1",
        "data.source=digits",
        "data.num_clients=3",
        "model.per_client=[mlp]",
        "strategy.params.cosmos.server_model=mlp",
        "strategy.params.cosmos.server_epochs=1",
    ):
        assert setting in tail
    assert "run_name=cosmos-mnist5k-cosmos-groups-s0" in tail
    assert "model.name=mlp" not in tail  # COSMOS's clients take model.per_client
    plain = shlex.split(prepared(".venv/bin/fedapps compare configs/fedavg.yaml configs/local.yaml", tmp_path))
    assert "model.name=mlp" in plain and "--engine" in plain
    assert prepared("fedapps report results/x", tmp_path) == "fedapps report results/x"
    assert prepared("python bench/startup.py | tail -1", tmp_path) == "python bench/startup.py | tail -1"
    with pytest.raises(AssertionError, match="cannot be run by a test"):
        prepared("make run", tmp_path)


@pytest.mark.heavy
def test_a_runnable_block_runs_in_its_own_folder_with_tiny_settings(tmp_path):
    """The machinery end to end on a block of its own: a run at tiny settings, then a command as written that
    reads the run's folder; a failing command fails the block."""
    block = Block(
        "page.md",
        1,
        (
            "fedapps run configs/fedavg.yaml --set run_name=tiny",
            "test -f results/tiny/summary.json",
            "fedapps report results/tiny",
        ),
    )
    proc = run_block(block, tmp_path / "ok")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rounds" in proc.stdout and (tmp_path / "ok" / "results" / "tiny" / "summary.json").is_file()
    failing = run_block(Block("page.md", 1, ("fedapps report results/none",)), tmp_path / "bad")
    assert failing.returncode != 0


# --------------------------------------------------------------------------- (c) cited pages and anchors exist


def page_anchors(page: Path) -> set[str]:
    """The ids of a docs page as the built site has them: headings through the site's markdown extensions (toc,
    attr_list ...) and any other element id in the page."""
    import markdown
    from mkdocs.config import load_config

    cfg = load_config(str(ROOT / "mkdocs.yml"))
    md = markdown.Markdown(extensions=cfg["markdown_extensions"], extension_configs=cfg["mdx_configs"])
    cwd = os.getcwd()
    os.chdir(ROOT)  # snippets' base_path is relative to where mkdocs runs
    try:
        html = md.convert(page.read_text())
    finally:
        os.chdir(cwd)

    def ids(tokens):
        for t in tokens:
            yield t["id"]
            yield from ids(t["children"])

    return set(ids(md.toc_tokens)) | set(re.findall(r'\bid="([^"]+)"', html))


def citations() -> list[tuple[str, int, str, str | None]]:
    out = []
    for f in code_files():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            out += [(rel(f), n, m.group(1), m.group(2)) for m in DOC_CITATION.finditer(line)]
    return out


@needs_mkdocs
def test_cited_docs_pages_and_anchors_exist():
    problems, anchors = [], {}
    for where, line, page, anchor in citations():
        path = ROOT / "docs" / page
        if not path.is_file():
            problems.append(f"{where}:{line}: docs/{page} does not exist")
            continue
        if anchor:
            if page not in anchors:
                anchors[page] = page_anchors(path)
            if anchor not in anchors[page]:
                problems.append(
                    f"{where}:{line}: docs/{page} has no heading with the anchor #{anchor} "
                    f"(it has: {', '.join(sorted(anchors[page])) or 'none'})"
                )
    assert not problems, "\n".join(problems)


def test_citation_pattern():
    d = "docs" + "/"  # not a citation of this file's own
    found = [
        (m.group(1), m.group(2))
        for m in DOC_CITATION.finditer(
            f"see {d}evaluation.md#equal-budget, {d}algorithms/cosmos.md. and {d}reference/params/<name>.md "
            f"or my{d}x.md, ../{d}y.md"
        )
    ]
    assert found == [("evaluation.md", "equal-budget"), ("algorithms/cosmos.md", None)]


@needs_mkdocs
def test_anchors_are_computed_as_the_site_computes_them(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# Title\n\n## Equal tuning budget\n\n## Splits: train / validation\n\n## Named {#own-id}\n\n"
        "## Equal tuning budget\n"
    )
    assert {
        "title",
        "equal-tuning-budget",
        "splits-train-validation",
        "own-id",
        "equal-tuning-budget_1",
    } <= page_anchors(page)


# --------------------------------------------------------------------------- (d) no citation that cannot be checked


def forbidden_citations(text: str) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out += [(n, why) for pattern, why in FORBIDDEN if pattern.search(line)]
    return out


def test_code_cites_no_front_page_heading_and_no_file_outside_the_repository():
    problems = []
    for f in code_files():
        problems += [f"{rel(f)}:{n}: {why}" for n, why in forbidden_citations(f.read_text(errors="replace"))]
    assert not problems, "\n".join(problems)


def test_forbidden_patterns():
    front, shared, specs = FRONT_PAGE, "shared" + "/", "specs" + "/"  # in pieces: this file cites none of them
    bad = [
        f'(see {front} "Data sources")',
        f"{front}'s table",
        f"../{shared}{specs}evaluation.md",
        f"the spec ({specs}evaluation.md)",
        f"/work/{shared}" + "DESI" + "GN.md",
    ]
    good = [f"{front}.md", "docs/evaluation.md", "the data spec's fractions", "tests/specs_test.py"]
    assert all(forbidden_citations(t) for t in bad)
    assert not any(forbidden_citations(t) for t in good)
