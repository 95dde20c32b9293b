"""One meaning per flag across the sub-commands, the flag table of every sub-command, run folders that cannot collide
by accident (the digest of the resolved config in the name, --overwrite to replace on purpose, the end-of-run hint
followed as printed), and `compare` refusing rows of different settings unless --allow-mixed."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from fedapps.config import ConfigError, load_config
from fedapps_tools import attacks, cli, report, runnames
from fedapps_tools.options import SeedsAction, parsers_of
from strategies import resolve

# every sub-command's arguments, in the order --help lists them (positionals by their metavar)
FLAG_TABLE = {
    "fedapps": [],
    "fedapps run": [
        "CONFIG", "--resume", "--overwrite", "--seeds", "--set", "--output-dir", "--engine", "--supernodes",
        "--cpus-per-client", "--gpus-per-client", "--federation-config", "--superlink", "--ray-address",
        "--keep-superlink", "--keep-state", "--quiet",
    ],
    "fedapps compare": [
        "CONFIG", "--seeds", "--name", "--allow-mixed", "--set", "--output-dir", "--engine", "--supernodes",
        "--cpus-per-client", "--gpus-per-client", "--federation-config", "--superlink", "--ray-address",
        "--keep-superlink", "--keep-state", "--quiet",
    ],
    "fedapps tune": [
        "CONFIG", "--grid", "--seeds", "--max-points", "--name", "--out", "--set", "--output-dir", "--engine",
        "--supernodes", "--cpus-per-client", "--gpus-per-client", "--federation-config", "--superlink",
        "--ray-address", "--keep-superlink", "--keep-state", "--quiet",
    ],
    "fedapps report": ["RESULT_DIR", "--html", "--out"],
    "fedapps tables": [
        "SPEC", "--work", "--out", "--settings", "--methods", "--stages", "--seeds", "--set", "--engine", "--jobs",
        "--rerun-published",
    ],
    "fedapps privacy-curves": ["SPEC", "--work", "--out", "--stages", "--methods", "--seeds", "--set", "--jobs"],
    "fedapps attacks": [
        "--strategies", "--modes", "--rounds", "--seeds", "--seed", "--set", "--work", "--out", "--update", "--doc",
        "--from-csv",
    ],
    "fedapps deploy": [],
    "fedapps deploy certs": ["DIR", "--host", "--days"],
    "fedapps deploy node-key": ["DIR", "NAME", "--client-id", "--max-num-examples"],
    "fedapps deploy node-cap": ["DIR", "--node", "--client-id", "--max-num-examples"],
    "fedapps deploy superlink": ["--state", "--host", "--port", "--certs", "--auth", "--insecure"],
    "fedapps deploy supernode": [
        "--state", "--name", "--superlink", "--node-config", "--port", "--ca", "--key", "--insecure", "--check-seconds",
    ],
    "fedapps deploy connect": ["NAME", "--address", "--ca", "--insecure"],
    "fedapps deploy register": ["NAME", "KEY.pub"],
    "fedapps deploy run": [
        "CONFIG", "--link", "--set", "--remote-output-dir", "--fetch-to", "--fetch-from", "--quiet",
    ],
    "fedapps deploy stop": ["--state", "--only"],
}  # fmt: skip
DEPRECATED = {("fedapps attacks", "--seed")}  # old spellings still read (hidden from --help), with a message
# one meaning per flag: its metavar wherever it appears (a folder, a seed list, dotted overrides, ...)
METAVARS = {
    "--out": "DIR",
    "--output-dir": "DIR",
    "--work": "DIR",
    "--seeds": "SEED",
    "--set": "KEY=VALUE",
    "--jobs": "N",
    "--rounds": "N",
    "--stages": "A,B",
    "--methods": "A,B",
}


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)
    return [a for a in parser._actions if not isinstance(a, skip)]


def name(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else str(action.metavar or action.dest)


def test_the_flag_table_of_every_sub_command():
    got = {path: [name(a) for a in arguments(p)] for path, p in parsers_of(cli.build_parser())}
    assert got == FLAG_TABLE


def test_one_meaning_per_flag_and_every_option_explained_with_its_default():
    seen: dict[str, set[str]] = {}
    for path, parser in parsers_of(cli.build_parser()):
        for action in arguments(parser):
            flag = name(action)
            if (path, flag) in DEPRECATED:
                assert action.help == argparse.SUPPRESS
                continue
            assert action.help and len(action.help) > 10, f"{path} {flag} has no help"
            if flag in METAVARS:
                seen.setdefault(flag, set()).add(path)
                assert action.metavar == METAVARS[flag], f"{path} {flag}: {action.metavar}"
            if flag == "--seeds":
                assert isinstance(action, SeedsAction), path
            if flag == "--set":
                assert action.dest == "overrides" and action.nargs == "+", path
            shown = action.default not in (None, False, "", [], argparse.SUPPRESS) and action.option_strings
            if shown and not action.required:
                assert "default" in action.help, f"{path} {flag}: the default {action.default!r} is not said"
    # --seeds and --set wherever configs are run; --out wherever a command writes a product of its own
    assert {p.split(" ", 1)[1] for p in seen["--seeds"]} == {
        "run", "compare", "tune", "tables", "privacy-curves", "attacks",
    }  # fmt: skip
    assert {p.split(" ", 1)[1] for p in seen["--set"]} == {
        "run", "compare", "tune", "tables", "privacy-curves", "attacks", "deploy run",
    }  # fmt: skip
    assert {p.split(" ", 1)[1] for p in seen["--out"]} == {"tune", "report", "tables", "privacy-curves", "attacks"}


def test_tables_help_says_where_the_report_goes_by_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tables", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "docs/results/ (the published tables)" in text and "(default: docs/results)" in text


def test_old_spellings_still_work_with_a_deprecation_message(capsys, tmp_path):
    args = cli.build_parser().parse_args(["attacks", "--seed", "3"])
    assert args.seeds == [3] and "--seed is deprecated" in capsys.readouterr().err
    assert report.html_file(str(tmp_path / "page.html")) == str(tmp_path / "page.html")
    assert "deprecated" in capsys.readouterr().err
    assert report.html_file(str(tmp_path)) == str(tmp_path / "report.html")
    assert attacks.csv_path(str(tmp_path / "rows.csv")) == tmp_path / "rows.csv"
    assert "deprecated" in capsys.readouterr().err
    assert attacks.csv_path(str(tmp_path)) == tmp_path / attacks.DEFAULT_CSV


def test_attacks_takes_one_seed(capsys):
    assert cli.main(["attacks", "--seeds", "0,1", "--strategies", "fedavg"]) == 2
    assert "--seeds 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- run folders


def resolved(path: Path, *overrides: str):
    cfg = load_config(path, list(overrides))
    return resolve(cfg).config(cfg)


def test_the_derived_name_carries_the_digest_of_what_the_run_computes(tiny_config):
    path = tiny_config()
    name = runnames.derived_name(resolved(path))
    assert re.fullmatch(r"fedavg-digits-iid-s0-[0-9a-f]{8}", name)
    assert runnames.derived_name(resolved(path)) == name  # the same config, the same folder
    assert runnames.derived_name(resolved(path, "rounds=3")) != name  # rounds alone: another folder
    assert runnames.derived_name(resolved(path, "client.lr=0.01")) != name
    assert runnames.derived_name(resolved(path, "output_dir=elsewhere")) == name  # where it writes is not what
    # a parameter section of a strategy the run does not use changes nothing it computes
    assert runnames.derived_name(resolved(path, "strategy.params.fedprox.mu=0.5")) == name
    assert runnames.has_derived_name(resolved(path, f"run_name={name}"))
    assert not runnames.has_derived_name(resolved(path, "run_name=mine"))


def test_overwrite_removes_only_a_run_folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    assert runnames.replace_run(run) and not run.exists()
    assert not runnames.replace_run(run)  # nothing there
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_text("x")
    with pytest.raises(ConfigError, match="does not look like a run folder"):
        runnames.replace_run(other)
    assert (other / "a.jpg").is_file()


def hint_items(out: str) -> list[str]:
    """The arguments the end-of-run hint says to add to the command, as printed."""
    (hint,) = [ln for ln in out.splitlines() if ln.startswith("FedAvg's number")]
    return shlex.split(hint.split("add  ", 1)[1].split("  to the command")[0])


@pytest.mark.heavy
def test_runs_of_other_lengths_never_collide_and_the_hint_runs_as_printed(tiny_config, tmp_path, capsys):
    """The tour's case: a FedAvg run of another length is already there; a Local run's hint, followed as printed,
    runs (exit 0) into a folder of its own, and the summary then shows FedAvg's number. The same config again is
    refused naming --overwrite, which replaces it."""
    out = tmp_path / "res"
    base = ["--engine", "inprocess", "--output-dir", str(out), "--quiet"]
    fedavg = tiny_config(rounds=2)
    assert cli.main(["run", str(fedavg), *base]) == 0
    local = tiny_config(rounds=1, strategy={"name": "local"})
    assert cli.main(["run", str(local), *base]) == 0
    items = hint_items(capsys.readouterr().out)
    assert items == ["--set", "strategy.name=fedavg"]
    assert cli.main(["run", str(local), *base, *items]) == 0
    folders = sorted(d.name for d in out.iterdir())
    assert len(folders) == 3 and len([f for f in folders if f.startswith("fedavg-digits-iid-s0-")]) == 2
    local_run = next(out.glob("local-*"))
    capsys.readouterr()
    assert cli.main(["report", str(local_run)]) == 0
    printed = capsys.readouterr().out
    assert "FedAvg on the same setting (fedavg-digits-iid-s0-" in printed
    assert f"digest {local_run.name[-8:]}" in printed  # the summary shows the digest its folder carries
    # the same config again: refused (exit 2), naming --overwrite; with it the run is replaced
    assert cli.main(["run", str(local), *base, *items]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["run", str(local), *base, *items, "--overwrite"]) == 0
    assert "removed the earlier run" in capsys.readouterr().out
    assert sorted(d.name for d in out.iterdir()) == folders


@pytest.mark.heavy
def test_compare_refuses_mixed_settings_unless_allowed_and_shows_each_rows_setting(tiny_config, tmp_path, capsys):
    """FedAvg on IID beside Local on pathological: refused before any run (exit 2, naming the key and the way
    out); with --allow-mixed the table shows both settings."""
    fedavg = tiny_config(rounds=1)
    local = tiny_config(rounds=1, strategy={"name": "local"}, data={"partition": "pathological"})
    argv = ["compare", str(fedavg), str(local), "--seeds", "0", "--engine", "inprocess", "--output-dir", str(tmp_path)]
    assert cli.main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "data.partition" in err and "'iid'" in err and "'pathological'" in err and "--allow-mixed" in err
    assert not (tmp_path / "comparison").exists()
    hint = re.search(r"add (--set .+?) to compare them all", err).group(1)  # the way out, followed as printed
    assert hint == "--set data.partition=iid"
    assert cli.main([*argv, "--quiet", "--name", "same", *shlex.split(hint)]) == 0
    assert "digits iid, 4 clients" in (tmp_path / "same" / "comparison.md").read_text()
    assert cli.main([*argv, "--quiet", "--allow-mixed"]) == 0
    md = (tmp_path / "comparison" / "comparison.md").read_text()
    assert "| setting |" in md
    assert "digits iid, 4 clients, 1 rounds, mlp" in md and "digits pathological 2 classes/client, 4 clients" in md
    with open(tmp_path / "comparison" / "comparison.csv") as f:
        header = f.readline().strip().split(",")
    assert header[:7] == ["config", "strategy", "data_source", "partition", "clients", "rounds", "model"]


def test_the_cli_reference_is_generated_from_the_parsers_themselves(monkeypatch):
    """docgen reads the parser tree the command parses with: an option a command adds is on the page at once."""
    from fedapps_tools import docgen

    real = report.add_parser

    def with_one_more(subparsers):
        parser = real(subparsers)
        parser.add_argument("--shiny", action="store_true", help="an option added a moment ago")
        return parser

    monkeypatch.setattr(report, "add_parser", with_one_more)
    page = docgen.cli_page()
    assert "| `--shiny` |" in page and "an option added a moment ago" in page
    assert "usage: fedapps report [-h] [--html] [--out DIR] [--shiny] RESULT_DIR" in page
