"""``evaluate_every``: one top-level key for how often the models are measured (COSMOS's ``eval_every`` moved there),
refused where it used to be, checked, and without effect on the hashes of the runs recorded before it existed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedapps.checkpoint import config_differences
from fedapps.config import ConfigError, config_hash, dump_yaml, load_config
from strategies import resolve

ROOT = Path(__file__).resolve().parent.parent


def resolved_hash(path: Path, overrides: str = "") -> str:
    cfg = load_config(path, overrides)
    return config_hash(resolve(cfg).config(cfg))


@pytest.mark.parametrize("strategy", ["cosmos", "fedmd"])  # the chosen section, and a section only checked
def test_cosmos_eval_every_is_refused_pointing_at_evaluate_every(strategy):
    cfg = load_config(
        ROOT / "configs" / "settings" / "agnostic-rotated.yaml",
        f"strategy.name={strategy} strategy.params.cosmos.eval_every=4",
    )
    with pytest.raises(
        ConfigError,
        match=r"'strategy\.params\.cosmos\.eval_every' is now the top-level key "
        r"'evaluate_every'.*--set evaluate_every=4",
    ):
        resolve(cfg)


def test_evaluate_every_must_be_positive():
    with pytest.raises(ConfigError, match="'evaluate_every' must be a positive integer"):
        load_config(None, "evaluate_every=0")


@pytest.mark.parametrize(
    "config,overrides,recorded",
    [  # config_hash of the resolved configs as computed before evaluate_every existed (COSMOS then had eval_every)
        ("configs/cosmos.yaml", "", "2021d71f3e576017434fe9b5ffbdfe21c6c1714310e96d5889cc1e50d49f01d7"),
        (
            "configs/settings/agnostic-rotated.yaml",
            "strategy.name=fedmd",
            "e0abc82502d2fd3482ac258cbc48456f1b3f97f4bc4519f01a623a61ed4551cb",
        ),
        ("configs/default.yaml", "", "78da7242ff7fa0fbdcb0faf9ee74e3e88a485be746967149e63f976b8c549b7e"),
    ],
)
def test_runs_recorded_before_the_key_keep_their_hash(config, overrides, recorded):
    assert resolved_hash(ROOT / config, overrides) == recorded


def test_another_evaluate_every_is_another_hash():
    path = ROOT / "configs" / "cosmos.yaml"
    assert resolved_hash(path, "evaluate_every=2") != resolved_hash(path)
    path = ROOT / "configs" / "default.yaml"
    assert resolved_hash(path, "evaluate_every=2") != resolved_hash(path)


def test_a_cosmos_checkpoint_written_with_eval_every_resumes_under_evaluate_every():
    """A checkpoint's config.yaml from before the move holds strategy.params.cosmos.eval_every and no evaluate_every:
    it compares equal to today's config of the same computation, and unequal to another evaluate_every."""
    cfg = load_config(ROOT / "configs" / "cosmos.yaml")
    today = resolve(cfg).config(cfg).to_dict()
    for k in (1, 3):
        before = {key: v for key, v in today.items() if key != "evaluate_every"}
        before["strategy"] = {**before["strategy"], "params": {"cosmos": {**today["strategy"]["params"]["cosmos"]}}}
        before["strategy"]["params"]["cosmos"]["eval_every"] = k
        given = load_config(ROOT / "configs" / "cosmos.yaml", f"evaluate_every={k}")
        assert config_differences(yaml.safe_dump(before), dump_yaml(resolve(given).config(given))) == []
        assert config_differences(yaml.safe_dump(before), dump_yaml(resolve(cfg).config(cfg))) == (
            [] if k == 1 else [f"evaluate_every: checkpoint {k}, given '<absent>'"]
        )
