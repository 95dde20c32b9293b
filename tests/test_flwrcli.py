"""fedapps_tools.flwrcli: the app's files handed to `flwr run` give the same FAB as the whole app folder, without
walking the folders the .gitignore ignores (the virtual environment)."""

from __future__ import annotations

from pathlib import Path

from flwr.cli.build import build_fab_from_disk, build_fab_from_files
from flwr.cli.utils import collect_files, filter_paths_for_publish

from fedapps.config import APP_DIR
from fedapps_tools.flwrcli import app_files, staged_app


def fab_set(files) -> set[str]:
    return set(filter_paths_for_publish(files))


def test_this_apps_files_filter_to_the_same_fab_as_flowers_own_walk():
    ours = app_files(APP_DIR)
    theirs = collect_files(APP_DIR.resolve())
    assert fab_set(ours) == fab_set(theirs)
    assert "pyproject.toml" in ours and "server_app.py" in ours and "configs/default.yaml" in ours
    if (APP_DIR / ".venv").is_dir():  # make's set-up: the venv is inside the app folder and never walked
        assert not any(k.startswith(".venv/") for k in ours) and any(k.startswith(".venv/") for k in theirs)


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


PYPROJECT = (APP_DIR / "pyproject.toml").read_text()


def test_pruning_follows_the_gitignore_and_a_negation_turns_it_off(tmp_path):
    files = {
        "pyproject.toml": PYPROJECT,
        "a.py": "x = 1\n",
        "pkg/b.py": "y = 2\n",
        "big/lib/c.py": "z\n",
        "out/r.yaml": "k: 1\n",
        "keep/out.py": "w\n",
        "pkg/c.pyc": "",
        "x/ignored.json": "{}",
    }
    root = tree(tmp_path / "app", {**files, ".gitignore": "big/\nout/\n*.pyc\nx/ignored.json\n"})
    ours = app_files(root)
    assert not any(k.startswith(("big/", "out/")) for k in ours)  # ignored folders not entered
    assert "keep/out.py" in ours and "x/ignored.json" in ours  # a file pattern prunes no folder
    assert fab_set(ours) == fab_set(collect_files(root.resolve()))
    negated = tree(tmp_path / "neg", {**files, ".gitignore": "big/\n!big/lib/c.py\n"})
    assert set(app_files(negated)) == set(collect_files(negated.resolve()))  # nothing pruned


def test_the_staged_app_builds_the_same_fab(tmp_path):
    """Staged copies build the FAB the app's files build (whose file set equals Flower's walk, test above)."""
    staged = staged_app(APP_DIR, tmp_path / "app")
    assert build_fab_from_disk(staged) == build_fab_from_files(app_files(APP_DIR))[0]
