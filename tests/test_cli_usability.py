"""The command line as a new user meets it: every sub-command listed and explained, --version, help for every
positional and for --seeds, one seed-list syntax, one meaning of --output-dir, plain-text help, a marked headline in
human units, warnings printed once, hints that validate when followed, ignored keys reported, Flower's noise left
out by exact text (and nothing else)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import run_folder
from fedapps.config import ConfigError, load_config
from fedapps_tools import cli
from fedapps_tools import run as run_command
from fedapps_tools.logfilter import FLOWER_NOISE, LogFilter, is_flower_noise, parse_line
from fedapps_tools.options import (
    SeedsAction,
    package_version,
    parse_seeds,
    parsers_of,
    pyproject_version,
)
from fedapps_tools.summary import MARK, human_bytes, human_duration, summary_lines
from strategies import ignored_settings, resolve

# help texts are shown on a terminal and copied into the CLI reference: plain text, no reStructuredText
RST_MARKUP = re.compile(r"``|:(?:func|meth|class|mod|attr|data|obj|ref|doc):`")


def help_texts(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for every text a parser shows: its description and epilog, each sub-command's one-line
    help and each argument's help."""
    for path, p in parsers_of(parser):
        for where, text in (("description", p.description), ("epilog", p.epilog)):
            if text:
                yield f"{path} {where}", text
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    yield f"{path} {choice.dest}", choice.help or ""
            elif action.help and action.help != argparse.SUPPRESS:
                yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help


ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "paper").glob("*.yaml"))
SUB_COMMANDS = {"run", "compare", "tune", "report", "tables", "attacks", "privacy-curves", "deploy"}


def all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser a user can reach: fedapps and every sub-command under it (deploy's steps included)."""
    return list(parsers_of(cli.build_parser()))


def sub_commands(parser: argparse.ArgumentParser) -> dict[str, str]:
    """name -> one-line help of a parser's sub-commands."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {c.dest: c.help for c in action._choices_actions}


def set_items(text: str) -> list[list[str]]:
    """The override lists of every ``--set a=b c=d`` a message suggests (up to the closing bracket or the end)."""
    return [shlex.split(m) for m in re.findall(r"--set ([^)\n]+?)(?:\)|  |$)", text)]


# --------------------------------------------------------------------------- help, version


def test_top_level_help_lists_every_sub_command_with_a_line(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    listed = sub_commands(cli.build_parser())
    assert set(listed) == SUB_COMMANDS
    for name, line in listed.items():
        assert len(line) > 20, name
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), f"{name} is not listed with its line in --help"
    for name in ("tables", "attacks", "privacy-curves", "deploy"):  # listed AND reachable: their own --help works
        with pytest.raises(SystemExit) as exited:
            cli.main([name, "--help"])
        assert exited.value.code == 0 and f"fedapps {name}" in capsys.readouterr().out


def test_version_is_the_packages(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedapps {importlib.metadata.version('fedapps')}"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert package_version() == declared


def test_pyproject_version_without_tomllib(tmp_path, monkeypatch):
    f = tmp_path / "pyproject.toml"
    f.write_text('[tool.x]\nversion = "9.9"\n\n[project]\nname = "p"\nversion = "1.2.3"\n\n[other]\nversion = "0"\n')
    assert pyproject_version(f) == "1.2.3"
    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python 3.10: no tomllib, the [project] table read by hand
    assert pyproject_version(f) == "1.2.3"
    assert pyproject_version(tmp_path / "missing.toml") == "unknown"


def test_every_positional_and_seeds_option_has_help():
    seen_seeds = []
    for path, parser in all_parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            if not action.option_strings:
                assert action.help and action.help != argparse.SUPPRESS, f"{path}: positional {action.dest} has no help"
            if "--seeds" in action.option_strings:
                seen_seeds.append(path.split()[-1])
                assert action.help and len(action.help) > 20, f"{path}: --seeds has no help"
    assert {"run", "compare", "tune"} <= set(seen_seeds)


def test_help_is_plain_text():
    texts = list(help_texts(cli.build_parser()))
    assert len(texts) > 60  # every parser's texts were reached
    for where, text in texts:
        assert not RST_MARKUP.search(text), f"{where}: reStructuredText markup in help: {text!r}"
        outside = ("spec" + "s/", "../" + "shared")  # in pieces: this file must not cite them either (test_docs)
        assert not any(o in text for o in outside), f"{where} cites a file outside the repository"
    assert RST_MARKUP.search("see ``x``") and RST_MARKUP.search(":func:`f`") and not RST_MARKUP.search("`fedapps`")


def test_building_the_parsers_starts_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli.build_parser()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- --seeds


@pytest.mark.parametrize("items", [["0,1,2"], ["0", "1", "2"], ["0,1", "2"], [" 0 ,1,", "2"]])
def test_seed_lists_read_alike(items):
    assert parse_seeds(items) == [0, 1, 2]


@pytest.mark.parametrize(
    "items, words",
    [
        (["0,x"], "'x' is not an integer"),
        (["-1"], "negative"),
        (["0,0"], "0 is repeated"),
        ([","], "at least one seed"),
        (["cfg.yaml"], "write the configs before --seeds"),
    ],
)
def test_bad_seed_lists_name_the_item(items, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_seeds(items)


@pytest.mark.parametrize("command", ["compare", "tune"])
@pytest.mark.parametrize("written", [["0,1,2"], ["0", "1", "2"], ["0,1", "2"]])
def test_compare_and_tune_take_both_seed_syntaxes(command, written):
    extra = ["--grid", "client.lr=0.1"] if command == "tune" else []
    args = cli.build_parser().parse_args([command, "configs/fedavg.yaml", *extra, "--seeds", *written])
    assert args.seeds == [0, 1, 2]


def test_one_seed_option_everywhere():
    """run, compare and tune read --seeds with the same action (tables passes lists in either syntax)."""
    parser = cli.build_parser()
    for name in ("run", "compare", "tune"):
        sub = dict(parsers_of(parser))[f"fedapps {name}"]
        (action,) = [a for a in sub._actions if "--seeds" in a.option_strings]
        assert isinstance(action, SeedsAction), name


def test_run_takes_one_seed_and_points_to_compare_for_more(tiny_config, capsys):
    args = cli.build_parser().parse_args(["run", "cfg.yaml", "--seeds", "3", "--set", "rounds=1"])
    assert run_command.run_overrides(args) == ["rounds=1", "seed=3"]
    assert cli.main(["run", str(tiny_config()), "--seeds", "0,1", "--engine", "inprocess"]) == 2
    err = capsys.readouterr().err
    assert "fedapps compare" in err and "--seeds 0,1" in err


def test_bad_seeds_exit_2_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["compare", "configs/fedavg.yaml", "--seeds", "0,x"])
    assert exited.value.code == 2 and "'x' is not an integer" in capsys.readouterr().err


def test_compare_runs_every_seed_of_a_comma_list(tiny_config, tmp_path):
    cfg = tiny_config(rounds=1)
    assert (
        cli.main(
            ["compare", str(cfg), "--seeds", "0,1", "--engine", "inprocess", "--output-dir", str(tmp_path), "--quiet"]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "comparison" / "runs").iterdir()) == [f"{cfg.stem}-s0", f"{cfg.stem}-s1"]


# --------------------------------------------------------------------------- --output-dir


def test_output_dir_help_is_the_same_root_in_run_compare_and_tune():
    helps = {}
    for path, parser in parsers_of(cli.build_parser()):
        for action in parser._actions:
            if "--output-dir" in action.option_strings:
                helps[path.split()[-1]] = action.help
    assert set(helps) == {"run", "compare", "tune"}
    first = {h.split(";")[0] for h in helps.values()}
    assert len(first) == 1 and "results root" in first.pop()


def test_output_dir_defaults_to_the_configs_output_dir_in_every_command(tiny_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory's results/
    root = tmp_path / "root"
    cfg = tiny_config(rounds=1, output_dir=str(root))
    assert cli.main(["run", str(cfg), "--engine", "inprocess"]) == 0
    assert (run_folder(root) / "summary.json").is_file()
    assert cli.main(["compare", str(cfg), "--seeds", "0", "--engine", "inprocess", "--quiet"]) == 0
    assert (root / "comparison" / "comparison.csv").is_file()
    args = cli.build_parser().parse_args(["tune", str(cfg), "--grid", "client.lr=0.1"])
    from fedapps_tools.tune import tuning_folder

    assert tuning_folder(args, str(root), cfg) == root / f"tune-{cfg.stem}"
    args = cli.build_parser().parse_args(
        ["tune", str(cfg), "--grid", "client.lr=0.1", "--output-dir", "o", "--name", "t"]
    )
    assert tuning_folder(args, str(root), cfg) == tmp_path / "o" / "t"
    assert not (tmp_path / "results").exists()


def test_tune_refuses_an_output_dir_that_holds_an_earlier_tuning(tmp_path):
    from fedapps_tools.tune import tuning_folder

    old = tmp_path / "old"
    (old / "runs" / "p1-s0").mkdir(parents=True)
    parse = cli.build_parser().parse_args
    with pytest.raises(ConfigError, match=rf"--out {re.escape(str(old))}"):
        tuning_folder(parse(["tune", "c.yaml", "--grid", "a=1", "--output-dir", str(old)]), "results", Path("c.yaml"))
    assert (
        tuning_folder(parse(["tune", "c.yaml", "--grid", "a=1", "--out", str(old)]), "results", Path("c.yaml")) == old
    )
    with pytest.raises(ConfigError, match="drop --output-dir"):
        tuning_folder(
            parse(["tune", "c.yaml", "--grid", "a=1", "--out", "x", "--name", "y"]), "results", Path("c.yaml")
        )


def test_compare_refuses_to_leave_an_earlier_comparison_behind(tiny_config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "comparison").mkdir(parents=True)
    (tmp_path / "results" / "comparison" / "comparison.csv").write_text("config\n")
    cfg = tiny_config(rounds=1, output_dir=str(tmp_path / "elsewhere"))
    assert cli.main(["compare", str(cfg), "--seeds", "0", "--engine", "inprocess"]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {tmp_path / 'results'}" in err and "elsewhere" in err
    other = tiny_config(rounds=1, output_dir=str(tmp_path / "third"))
    assert cli.main(["compare", str(cfg), str(other), "--seeds", "0", "--engine", "inprocess"]) == 2
    assert "different output_dir" in capsys.readouterr().err


# --------------------------------------------------------------------------- the summary


def test_human_units():
    assert human_bytes(950) == "950 B"
    assert human_bytes(2.2 * 1024**2) == "2.2 MiB"
    assert human_bytes(221691) == "216 KiB"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
    assert human_duration(2.52) == "2.5 s"
    assert human_duration(29.4) == "29 s"
    assert human_duration(89) == "1 min 29 s"
    assert human_duration(7500) == "2 h 05 min"


def test_summary_marks_the_headline_and_prints_human_units(tmp_path):
    s = {
        "strategy": "cwfedavg",
        "dataset": "digits",
        "partition": "iid",
        "model": "mlp",
        "num_clients": 4,
        "rounds": 3,
        "seed": 0,
        "final_round": 3,
        "final_round_measured_clients": 4,
        "evaluated_on": "test",
        "accuracy_mean": 0.81234,
        "accuracy_weighted": 0.79876,
        "accuracy_worst10": 0.5,
        "accuracy_std": 0.1,
        "accuracy_after_training_mean": 0.9,
        "bytes_up_per_client_round": 2.2 * 1024**2,
        "bytes_down_per_client_round": 1024,
        "wall_seconds": 89.0,
        "final_est_l1": 0.25,
        "final_round_had_no_replies": False,
        "deployed_model": "client i's own model",
        "problems": [],
    }
    lines = summary_lines(s, tmp_path)
    headline = [ln for ln in lines if ln.startswith(MARK)]
    assert "HEADLINE" in headline[0] and "deployed models after round 3" in headline[0]
    assert any("0.8123" in ln and "mean over clients" in ln for ln in headline)
    assert any("0.7988" in ln and "sample-weighted" in ln for ln in headline)
    assert not any("0.5000" in ln for ln in headline)  # fairness numbers are not the headline
    text = "\n".join(lines)
    assert "up 2.2 MiB/client/round, down 1.0 KiB/client/round" in text and "1 min 29 s" in text
    assert "final_est_l1 0.2500" in text and text.count("final_round") == 0
    s.update(evaluated_on="validation", final_round_had_no_replies=True, problems=["x broke"])
    text = "\n".join(summary_lines(s, tmp_path))
    assert "validation accuracy" in text and "not test results" in text and "x broke" in text
    assert "no usable reply" in text


def test_run_prints_the_headline_and_leaves_summary_json_alone(tiny_config, tmp_path, capsys):
    assert cli.main(["run", str(tiny_config(rounds=1)), "--engine", "inprocess", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    run = run_folder(tmp_path)
    s = json.loads((run / "summary.json").read_text())
    assert isinstance(s["bytes_up_per_client_round"], float) and isinstance(s["wall_seconds"], float)
    assert f"{MARK}   {s['accuracy_mean']:.4f}  mean over clients" in out
    assert f"{MARK}   {s['accuracy_weighted']:.4f}  sample-weighted" in out
    assert f"up {human_bytes(s['bytes_up_per_client_round'])}/client/round" in out


# --------------------------------------------------------------------------- hints that work when followed


@pytest.mark.parametrize(
    "config",
    [c for c in CONFIGS if load_config(c).strategy.name != "fedavg"],
    ids=lambda p: p.relative_to(ROOT / "configs").as_posix(),
)
def test_the_fedavg_hint_of_every_shipped_config_validates(config):
    from fedapps_tools.summary import fedavg_config, fedavg_overrides

    cfg = load_config(config)
    hinted = fedavg_config(config, fedavg_overrides(cfg))
    assert hinted.strategy.name == "fedavg" and not hinted.model.per_client
    assert (hinted.data, hinted.client, hinted.rounds, hinted.seed) == (cfg.data, cfg.client, cfg.rounds, cfg.seed)


def test_the_end_of_run_hint_works_when_followed(tiny_config, tmp_path, capsys):
    """A model-agnostic run's hint (FedAvg on per-client models needs model.per_client cleared): followed as printed,
    the FedAvg run lands where the summary looks and its number is shown beside the run's."""
    cfg = tiny_config(
        rounds=1, strategy={"name": "local"}, model={"name": "mlp", "per_client": ["mlp", "mlp"]}, run_name="mine"
    )
    base = ["run", str(cfg), "--engine", "inprocess", "--output-dir", str(tmp_path)]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    (hint,) = [ln for ln in out.splitlines() if ln.startswith("FedAvg's number")]
    (items,) = set_items(hint.split("to the command")[0])
    (twin,) = [i.removeprefix("run_name=") for i in items if i.startswith("run_name=")]
    assert re.fullmatch(r"fedavg-digits-iid-s0-[0-9a-f]{8}", twin)  # a name the user chose: the twin's is derived
    assert {"strategy.name=fedavg", "model.per_client=[]", f"run_name={twin}"} == set(items)
    assert cli.main(base + ["--set", *items]) == 0
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "mine")]) == 0
    assert f"FedAvg on the same setting ({twin}): accuracy_mean" in capsys.readouterr().out


@pytest.mark.parametrize(
    "config, overrides, key",
    [
        ("configs/cosmos.yaml", ["data.num_clients=6"], "strategy.min_clients"),
        ("configs/fedavg.yaml", ["strategy.expected_clients=30"], "strategy.expected_clients"),
        ("configs/ifca.yaml", ["strategy.params.ifca.clusters=99"], "strategy.params.ifca.clusters"),
    ],
)
def test_too_many_clients_suggests_fixes_that_validate(config, overrides, key):
    with pytest.raises(ConfigError) as refused:
        resolve(load_config(ROOT / config, overrides))
    message = str(refused.value)
    suggestions = set_items(message)
    assert key in message and "data.num_clients" in message and len(suggestions) == 2, message
    assert {s[0].split("=")[0] for s in suggestions} == {key, "data.num_clients"}
    for items in suggestions:  # each way out, followed, validates
        resolve(load_config(ROOT / config, overrides + items))


# --------------------------------------------------------------------------- keys set but ignored


def test_keys_a_run_ignores_are_named_with_why():
    cosmos = ROOT / "configs" / "cosmos.yaml"
    assert ignored_settings(load_config(cosmos)) == []  # model.name: cnn is one of its per_client models
    ignored = dict(ignored_settings(load_config(cosmos, ["model.name=mlp"]), ["model.name=mlp"]))
    assert set(ignored) == {"model.name"} and "model.per_client" in ignored["model.name"]
    (fix,) = set_items(ignored["model.name"])
    fixed = load_config(cosmos, ["model.name=mlp", *fix])
    resolve(fixed)
    assert fixed.model.per_client == ["mlp"] and ignored_settings(fixed) == []
    assert "model.name" in dict(ignored_settings(load_config(cosmos, ["model.name=resnet18"])))  # not in the list
    overrides = [
        "data.alpha=0.5",
        "data.validation_fraction=0.3",
        "strategy.trim_fraction=0.2",
        "strategy.aggregation=median",
        "strategy.max_weight_share=0.5",
        "client.optimizer=adam",
        "client.momentum=0.9",
        "tracking_dir=x",
        "data.synthetic_samples=100",
    ]
    ignored = dict(ignored_settings(load_config(ROOT / "configs" / "fedavg.yaml", overrides), overrides))
    assert set(ignored) == {
        "data.alpha",
        "data.validation_fraction",
        "strategy.trim_fraction",
        "strategy.max_weight_share",
        "client.momentum",
        "tracking_dir",
        "data.synthetic_samples",
    }
    assert "median" in ignored["strategy.max_weight_share"] and "adam" in ignored["client.momentum"]
    # used, so not reported: alpha under dirichlet, trim_fraction under trimmed-mean, momentum with sgd
    used = [
        "data.partition=dirichlet",
        "data.alpha=0.5",
        "strategy.aggregation=trimmed-mean",
        "strategy.trim_fraction=0.2",
        "client.momentum=0.9",
        "data.evaluate_on=validation",
        "data.validation_fraction=0.3",
    ]
    assert ignored_settings(load_config(ROOT / "configs" / "fedavg.yaml", used), used) == []


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_set_nothing_they_ignore(config):
    assert ignored_settings(load_config(config)) == []


def test_an_ignored_key_and_a_data_warning_are_printed_once(tiny_config, tmp_path, capsys):
    """The check before the run and the in-process ServerApp both report them: the command prints each once."""
    from fedapps.data import clear_federation_cache

    clear_federation_cache()  # the partition is built (and its warning logged) in this test
    cfg = tiny_config(
        rounds=1,
        strategy={"name": "local"},
        model={"name": "mlp", "per_client": ["mlp", "mlp"]},
        data={"partition": "pathological", "num_clients": 3, "classes_per_client": 2},
    )
    assert (
        cli.main(["run", str(cfg), "--engine", "inprocess", "--output-dir", str(tmp_path), "--set", "model.name=cnn"])
        == 0
    )
    err = capsys.readouterr().err
    assert err.count("'model.name' = 'cnn' is ignored") == 1, err
    assert err.count("pathological partition: no free client slots") == 1, err
    assert "WARNING fedapps: 'model.name'" in err


def test_a_client_does_not_repeat_the_datas_warnings():
    import logging

    from fedapps.client.worker import client_federation
    from fedapps.data import clear_federation_cache, get_federation

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    data_log = logging.getLogger("fedapps.data")
    data_log.addHandler(handler)
    spec = load_config(None, ["data.source=digits", "data.partition=pathological", "data.num_clients=3"]).to_dict()[
        "data"
    ]
    try:
        clear_federation_cache()
        client_federation(SimpleNamespace(node_config={}), spec, 0, public=False)
        assert not [r for r in records if r.levelname == "WARNING"]
        clear_federation_cache()
        get_federation(spec)  # the server's build reports it
        assert any("no free client slots" in r.getMessage() for r in records)
    finally:
        data_log.removeHandler(handler)
        clear_federation_cache()


# --------------------------------------------------------------------------- the streamed log


# Flower's lines on every simulated run, as `flwr log` streams them (colour codes included)
FLOWER_NOTES = [
    "\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n",
    "\x1b[92mINFO \x1b[0m:      To change federation size, use the following command:\n",
    "\x1b[92mINFO \x1b[0m:      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>\n",
    "Successfully installed fedapps to /tmp/fedapps-flwr-x/apps/fedapps.fedapps.0.1.0.e05ae3fd.\n",
    "\x1b[92mINFO \x1b[0m:      \n",
    "\x1b[36m(ClientAppActor pid=21875)\x1b[0m \x1b[93mWARNING \x1b[0m:   Manually terminating ClientAppActor\n",
]
KEPT = [
    "\x1b[92mINFO \x1b[0m:      Starting Flower Simulation\n",
    "\x1b[92mINFO \x1b[0m:      Federation `@none/default` (3 simulated SuperNodes)\n",
    "\x1b[93mWARNING \x1b[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 3.\n",  # not the text
    "\x1b[91mERROR \x1b[0m:     Manually terminating ClientAppActor\n",  # not the level
    "\x1b[93mWARNING \x1b[0m:   Manually terminating ClientAppActor because of an error\n",
    "INFO fedapps: round 1/1  clients 3\n",
    "WARNING fedapps: round 2: 1 of the replies asked for did not arrive within 600 s\n",
    "\x1b[36m(ClientAppActor pid=1)\x1b[0m Traceback (most recent call last):\n",
]


def test_flowers_noise_is_left_out_by_exact_text_and_nothing_else():
    f = LogFilter()
    assert [f.show(line) for line in FLOWER_NOTES] == [False] * len(FLOWER_NOTES)
    assert [f.show(line) for line in KEPT] == [True] * len(KEPT)
    assert len(FLOWER_NOISE) == len(FLOWER_NOTES)  # each listed message is one of the lines above


def test_the_noise_list_matches_the_installed_flower():
    """Flower's source still logs these exact messages (a Flower upgrade that rewords one fails here)."""
    import flwr

    source = "".join(
        p.read_text()
        for p in Path(flwr.__file__).parent.rglob("*.py")
        if p.name in ("app.py", "ray_actor.py", "install.py")
    )
    for text in (
        "Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.",
        "To change federation size, use the following command:",
        "flwr federation simulation-config ",
        "<superlink> --num-supernodes <N>",
        '"Manually terminating %s"',
        "Successfully installed {project_name} to {install_path}.",
    ):
        assert text in source, text
    assert is_flower_noise(*parse_line(FLOWER_NOTES[0])) and parse_line(FLOWER_NOTES[0])[0] == "WARNING"


def test_a_warning_the_command_printed_is_not_shown_again_from_the_run():
    f = LogFilter()
    message = "pathological partition: no free client slots left for classes [6]"
    assert f.first_time(message) and not f.first_time(message)
    assert not f.show(f"WARNING fedapps: {message}\n")  # the ServerApp's
    assert not f.show(f"\x1b[36m(ClientAppActor pid=7)\x1b[0m {message}\n")  # a client process's
    assert f.show(f"ERROR fedapps: {message}\n")  # another level is another line
    assert f.show("WARNING fedapps: something else\n")
    assert f.repeats == 3


def test_fedamp_step_that_erases_the_client_exits_2_naming_the_largest_lambda_that_runs(tmp_path, capsys):
    """The issue's command: lr·λ/α_K = 0.05·0.2/0.01 = 1 exits 2 before round 1, naming the key, the product and the
    largest λ that passes; that λ runs (one round, in process)."""
    base = ["run", str(ROOT / "configs" / "default.yaml"), "--engine", "inprocess", "--output-dir", str(tmp_path)]
    fedamp = ["strategy.name=fedamp", "client.lr=0.05", "strategy.params.fedamp.alpha_k=0.01", "rounds=1"]
    assert cli.main([*base, "--set", *fedamp, "strategy.params.fedamp.lam=0.2"]) == 2
    err = capsys.readouterr().err
    found = re.search(r"'strategy\.params\.fedamp\.lam'.*lr·λ/α_K = 1 .*largest λ that passes[^0-9]*([0-9.]+)", err)
    assert found, err
    assert not list(tmp_path.iterdir())  # refused before anything ran
    assert cli.main([*base, "--set", *fedamp, f"strategy.params.fedamp.lam={found.group(1)}"]) == 0
    assert (run_folder(tmp_path) / "summary.json").is_file()
