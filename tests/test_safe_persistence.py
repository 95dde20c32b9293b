"""Safe persistence (docs/reliability.md, "The run folder and the client's state folder"): every state file a run
reads back — checkpoint.pt, server-state/, a client's client-state/ file — loads with torch's weights-only unpickler,
so a pickle swapped into any of them runs no code; a damaged, empty or foreign file is an error naming the file and
what to do (exit 2 on the server; on a client, refused messages that make the run exit 1 saying why); what the
project writes still round-trips, and a state file never holds an object a resumption could not rebuild."""

import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedapps import checkpoint
from fedapps.config import ConfigError
from fedapps.wire import protocol
from tests.conftest import write_config


class RunsAShellCommand:
    """What an attacker puts in a state file: unpickling it would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def hostile_file(path: Path, marker: Path, payload_key: str = "format") -> None:
    """A torch-format file (zip + pickle) like ours, whose pickle calls os.system when loaded with full unpickling."""
    torch.save({payload_key: RunsAShellCommand(marker), "weights": torch.ones(2)}, path)


def test_a_hostile_pickle_runs_nothing_and_is_refused_naming_the_file(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "checkpoint.pt"
    hostile_file(path, marker)
    # the control: the payload is live — full unpickling (what load did before) runs the command
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(checkpoint.StateFileError) as info:
        checkpoint.load(path, "checkpoint", "do this")
    assert not marker.exists()
    text = str(info.value)
    assert str(path) in text and "nothing in it was run" in text and text.endswith("do this")
    assert "it asks to call or build posix.system" in text and "weights_only" not in text  # named, no bad advice


@pytest.mark.parametrize(
    "damage",
    ["empty", "truncated", "random bytes", "a json file", "a zip without a pickle", "a plain pickle"],
)
def test_damaged_or_foreign_state_files_are_an_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "checkpoint.pt"
    checkpoint.atomic_save({"format": checkpoint.FORMAT, "w": np.ones((40, 40), np.float32)}, path)
    whole = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(whole[: len(whole) // 2])
    elif damage == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif damage == "a json file":
        path.write_text('{"format": 1}')
    elif damage == "a zip without a pickle":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x/readme.txt", "hello")
    else:
        import pickle

        path.write_bytes(pickle.dumps({"format": 1}))
    with pytest.raises(ConfigError) as info:  # StateFileError is a ConfigError: exit 2 on the server
        checkpoint.load_checkpoint(tmp_path)
    text = str(info.value)
    assert str(path) in text and "restore the run folder" in text
    if damage == "empty":
        assert "(empty:" in text


def test_what_we_write_round_trips_and_objects_are_refused_when_saved(tmp_path):
    """numpy values of every plain dtype come back with their dtype, shape, byte order and scalar-ness; the
    containers torch rebuilds are kept; a class instance, a named tuple or a defaultdict is refused at save time
    (a resumption could not rebuild it), not discovered when a run is resumed."""
    from collections import Counter, OrderedDict, defaultdict, namedtuple

    state = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "transposed": np.arange(6).reshape(2, 3).T,
        "f16": np.ones(3, np.float16),
        "bool": np.array([True, False]),
        "text": np.array(["x", "yz"]),
        "u64": np.array([2**63 + 5], np.uint64),
        "big-endian": np.arange(4, dtype=">i4"),
        "zero-d": np.array(3.0),
        "empty-u64": np.array([], dtype=np.uint64),
        "empty-text": np.zeros((0, 2), dtype="<U3"),
        "scalars": [np.float64(2.5), np.int64(-3), np.bool_(True), np.uint64(2**64 - 1)],
        "tensor": torch.arange(3.0),
        "plain": {"set": {1, 2}, "tuple": (1, None, "a"), "bytes": b"\x00", "od": OrderedDict(a=1), "c": Counter("ab")},
        "rng": np.random.default_rng(3).bit_generator.state,
    }
    path = tmp_path / "s.pt"
    checkpoint.atomic_save(state, path)
    back = checkpoint.load(path)
    for key in ("f32", "transposed", "f16", "bool", "text", "u64", "big-endian", "zero-d", "empty-u64", "empty-text"):
        want, got = state[key], back[key]
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape, key
        assert np.array_equal(got, want), key
    for want, got in zip(state["scalars"], back["scalars"], strict=True):
        assert type(got) is type(want) and got == want
    assert torch.equal(back["tensor"], state["tensor"])
    assert back["plain"] == state["plain"] and type(back["plain"]["od"]) is OrderedDict
    assert back["rng"] == state["rng"]
    with zipfile.ZipFile(path) as z:  # arrays torch knows are stored as tensors (raw storage, not numpy's pickling)
        storages = [n for n in z.namelist() if "/data/" in n and not n.endswith(".pkl")]
    assert len(storages) >= 5

    class Holder:
        pass

    point = namedtuple("point", "x y")
    for bad in (Holder(), point(1, 2), defaultdict(list), np.array([object()], dtype=object)):
        with pytest.raises(TypeError, match="state file"):
            checkpoint.atomic_save({"x": bad}, tmp_path / "bad.pt")


def interrupted_run(tmp_path: Path, rounds: int = 3, **sections) -> tuple[Path, Path]:
    """A run stopped by an exception right after round 1's checkpoint: (its config, its folder)."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    class Stop(Exception):
        pass

    config = write_config(tmp_path / "cfg.yaml", rounds=rounds, **sections)

    def after_round(rnd: int) -> None:
        if rnd == 1:
            raise Stop

    with pytest.raises(Stop):
        server_app.run_experiment(InProcessGrid(4), str(config), "", str(tmp_path / "out"), after_round=after_round)
    return config, next((tmp_path / "out").iterdir())


def resume(config: Path, run_dir: Path) -> dict:
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    return server_app.run_experiment(InProcessGrid(4), str(config), "", str(run_dir.parent), resume_dir=str(run_dir))


def test_a_tampered_checkpoint_is_refused_by_fedapps_run_with_exit_2(tmp_path, capsys):
    from fedapps_tools import cli

    config, run_dir = interrupted_run(tmp_path)
    marker = tmp_path / "pwned"
    hostile_file(run_dir / "checkpoint.pt", marker)
    rc = cli.main(["run", str(config), "--engine", "inprocess", "--resume", str(run_dir)])
    assert rc == 2 and not marker.exists()
    err = capsys.readouterr().err
    assert "checkpoint.pt" in err and "cannot be loaded" in err


def test_a_tampered_server_state_file_is_refused_and_runs_nothing(tmp_path):
    config, run_dir = interrupted_run(
        tmp_path, strategy={"name": "cwfedavg"}, data={"partition": "pathological", "classes_per_client": 3}
    )
    files = sorted((run_dir / "server-state" / "stack").glob("*.pt"))
    assert files  # cwFedAvg keeps its per-client stack there
    marker = tmp_path / "pwned"
    hostile_file(files[0], marker)
    with pytest.raises(checkpoint.StateFileError, match=f"server-state file {files[0]}"):
        resume(config, run_dir)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["hostile pickle", "truncated"])
def test_a_tampered_client_state_file_fails_its_client_and_the_run_says_so(tmp_path, damage):
    """Local keeps each client's private model in client-state/: the client whose file was swapped refuses its
    messages (nothing runs), the others go on, and the run's exit status is 1 with the reason in summary.json."""
    from fedapps.reporting.results import EXIT_FAILED, UnusableRun

    config, run_dir = interrupted_run(tmp_path, strategy={"name": "local"})
    files = sorted((run_dir / "client-state").rglob("*.pt"))
    assert len(files) == 4
    victim, marker = files[0], tmp_path / "pwned"
    if damage == "hostile pickle":
        hostile_file(victim, marker)
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(UnusableRun) as info:
        resume(config, run_dir)
    assert info.value.exit_status == EXIT_FAILED and not marker.exists()
    text = str(info.value)
    assert protocol.PRIVATE_STATE_UNREADABLE in text and victim.name in text and "delete that file" in text
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_status"] == EXIT_FAILED
    assert any(protocol.PRIVATE_STATE_UNREADABLE in p for p in summary["problems"])
    assert summary["final_round_measured_clients"] == 3  # the other clients went on


def test_an_intact_client_state_resume_exits_0(tmp_path):
    """The control of the test above: the same interrupted run, untouched, resumes to a clean end."""
    config, run_dir = interrupted_run(tmp_path, strategy={"name": "local"})
    summary = resume(config, run_dir)
    assert summary["exit_status"] == 0 and summary["problems"] == []


def test_the_allowed_rebuilders_make_plain_arrays_only():
    """The three callables a state file may name cannot be turned into an object array (which would unpickle)."""
    raw = torch.zeros(8, dtype=torch.uint8)
    for dtype in ("|O", "O", [("a", "O")]):
        with pytest.raises((ValueError, TypeError)):
            checkpoint.ndarray_from_bytes(raw, dtype, (1,))
    assert checkpoint.ndarray_from_bytes(raw, "<u8", (1,)).tolist() == [0]


def test_the_client_level_dp_ledger_resumes_as_data(tmp_path):
    """A dataclass attribute (COSMOS's client-level DP ledger under privacy.mode client) is checkpointed as its fields
    and restored into the object the resumed run's config builds: the resumed run ends with the uninterrupted run's
    ledger (every client's count of releases) and accuracies."""
    import server_app
    from fedapps.flower.inprocess import InProcessGrid

    sections = dict(
        strategy={"name": "fedmd", "params": {"fedmd": {"consensus": "probs", "pretrain_epochs": 1}}},
        data={"public_fraction": 0.2},
        privacy={"mode": "client", "noise_multiplier": 1.0, "reproducible_noise": True},
    )
    reference = write_config(tmp_path / "ref.yaml", rounds=3, **sections)
    full = server_app.run_experiment(InProcessGrid(4), str(reference), "", str(tmp_path / "full"))
    config, run_dir = interrupted_run(tmp_path, **sections)
    ledger = checkpoint.load_checkpoint(run_dir)["state"]["strategy"]["client_dp"]
    assert ledger["class"] == "ClientLevelDP" and ledger["dataclass-fields"]["releases"] == dict.fromkeys(range(4), 1)
    resumed = resume(config, run_dir)
    assert resumed["exit_status"] == 0
    assert resumed["accuracy_mean"] == full["accuracy_mean"]
    import csv

    def epsilons(folder: Path) -> list[dict[str, str]]:
        with next(folder.rglob("rounds.csv")).open() as fh:
            return [{k: v for k, v in r.items() if k.startswith("epsilon")} for r in csv.DictReader(fh)]

    got, want = epsilons(run_dir.parent), epsilons(tmp_path / "full")
    assert got == want and float(got[-1]["epsilon_max"]) > float(got[0]["epsilon_max"]) > 0
