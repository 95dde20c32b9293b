"""Every shipped config runs: 2 rounds (ONE_ROUND: 1) on synthetic data of its real input shape and class count (few
samples, two clients), every client replies in every round and the headline metric is a number. And every zoo model runs
2 rounds under every parameter-sharing strategy with all clients replying (BatchNorm buffers included), or the
strategy refuses the model with a ConfigError naming the keys (pFedHN's hypernetwork for the large ones); the two
largest models run FedAvg (the whole state at their size) and FedPer (a split of it) only: their layouts are those of
VGG11 and the CNN, which run under every strategy.

The configs keep their strategy, partition, models and parameters; only sizes shrink: the data source becomes
``synthetic`` with the source's shape and classes, 2 clients (and at most 2 groups), every ``*epochs`` parameter
1, the server model of COSMOS as configured (VGG16 in the paper configs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import server_app
from fedapps.config import ConfigError, load_config
from fedapps.data import source_info
from fedapps.flower.inprocess import InProcessGrid
from fedapps.models import MODEL_NAMES
from fedapps.reporting.results import read_csv
from fedapps.server.driver import RoundDriver
from strategies import STRATEGIES, RunContext, resolve

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "paper").glob("*.yaml"))
CLIENTS = 2
# The two largest models (AlexNet: 30 M parameters, 4096-wide linear layers; VGG16: 15 M) cost the most by far (108 of
# the grid's 235 CPU-seconds when they ran under every strategy) and take GiBs at their peak. What a strategy does
# with a model's layout (the output layer it finds, the body/head split, BatchNorm buffers, masks, a second model) is
# the same for them as for a smaller model of the same layout: VGG16 is VGG11 with more layers (features with
# BatchNorm, a Sequential classifier), AlexNet a CNN without BatchNorm whose head is its last Linear layer, as the
# zoo's `cnn`; VGG11 and the CNN run under every strategy. What is theirs alone is size: they run FedAvg (the whole
# state at that size, encoded, sent, averaged, loaded) and FedPer (a split of it, the body averaged and each head
# kept), the paths whose cost grows with the model.
LARGE_MODELS = ("alexnet", "vgg16")
LARGE_MODEL_STRATEGIES = ("fedavg", "fedper")
LARGE_GROUP = pytest.mark.xdist_group("large-models")  # the large models' tests, on one worker one after another
# COSMOS on Tiny ImageNet runs ONE round: its three models at 64×64 (MobileNetV2 and SqueezeNet clients, the VGG16
# server) cost ~60 CPU-seconds for two, and round 1 already trains, predicts with and evaluates each of them at that
# shape; round 2 adds the clients' distillation on U, which the CIFAR and EMNIST COSMOS configs run with the same
# three models.
ONE_ROUND = ("paper/cosmos-tinyimagenet.yaml",)


def shrink(path: Path) -> list[str]:
    """Overrides that keep a config's shape, classes, strategy and models but make it small."""
    raw = yaml.safe_load(path.read_text()) or {}
    cfg = load_config(path)
    d = cfg.data
    classes, shape = source_info(d.source, d.synthetic_classes, tuple(d.synthetic_shape))
    rounds = 1 if str(path.relative_to(ROOT / "configs")) in ONE_ROUND else 2
    out = [
        f"rounds={rounds}",
        "data.source=synthetic",
        f"data.synthetic_classes={classes}",
        f"data.synthetic_shape=[{','.join(str(v) for v in shape)}]",
        f"data.synthetic_samples={max(classes, 60)}",
        f"data.num_clients={CLIENTS}",
        f"data.groups={min(d.groups, CLIENTS)}",
        "data.min_samples=2",
        "client.epochs=1",
        f"strategy.min_clients={CLIENTS}",
        "strategy.fraction=1.0",
    ]
    name = cfg.strategy.name
    fields = {f.name for f in dataclasses.fields(STRATEGIES[name].Params)}
    section = ((raw.get("strategy") or {}).get("params") or {}).get(name) or {}
    for key in sorted(fields):
        if key.endswith("epochs") and (key in section or key == "server_epochs"):
            out.append(f"strategy.params.{name}.{key}=1")
    if "clusters" in section:  # K cluster models need at least K clients
        out.append(f"strategy.params.{name}.clusters={min(int(section['clusters']), CLIENTS)}")
    return out


@pytest.fixture
def released(request):
    """After a test of the large models (marked for their worker, LARGE_MODELS), the memory its models held goes back
    to the system (gc for their reference cycles, malloc_trim for the allocator's free lists), so that the next test
    on this worker starts as small. Not after the others: a full gc costs ~0.2 s with torch loaded, 140 times over."""
    yield
    if not any(m.args == LARGE_GROUP.args for m in request.node.iter_markers("xdist_group")):
        return
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def config_param(path: Path):
    """A shipped config as a test case; one that mentions a large model (COSMOS's VGG16 server) runs on the large
    models' worker (LARGE_MODELS)."""
    large = any(name in path.read_text() for name in LARGE_MODELS)
    marks = [LARGE_GROUP] if large else []
    return pytest.param(path, id=str(path.relative_to(ROOT / "configs")), marks=marks)


@pytest.mark.parametrize("path", [config_param(p) for p in CONFIGS])
@pytest.mark.heavy  # the papers' models at their input shapes: seconds to a minute each
def test_shipped_config_runs_two_rounds(path, tmp_path, released):
    overrides = " ".join(shrink(path))
    cfg = load_config(path, overrides)
    grid = InProcessGrid(CLIENTS, record=True)
    summary = server_app.run_experiment(grid, str(path), overrides, str(tmp_path))
    rows = read_csv(tmp_path / cfg.resolved_run_name() / "rounds.csv")
    assert [r["clients"] for r in rows] == [CLIENTS] * cfg.rounds
    errors = [m.error.reason for m in grid.replies if m.has_error()]
    assert not errors, errors
    assert isinstance(summary["accuracy_mean"], float)
    if cfg.strategy.name == "cosmos":
        assert isinstance(summary["cluster_model_accuracy"], float)


PARAMETER_SHARING = sorted(n for n, c in STRATEGIES.items() if not c.model_agnostic and not c.needs_public_set)


def zoo_pairs():
    for model in MODEL_NAMES:
        for name in PARAMETER_SHARING:
            if model in LARGE_MODELS and name not in LARGE_MODEL_STRATEGIES:
                continue
            # the large models on one pytest-xdist worker, one after another: two at their peak at once would
            # crowd a 2-core, 24-GiB machine's memory
            marks = [LARGE_GROUP] if model in LARGE_MODELS else []
            yield pytest.param(model, name, id=f"{model}-{name}", marks=marks)


@pytest.mark.parametrize(("model", "name"), list(zoo_pairs()))
@pytest.mark.heavy
def test_every_zoo_model_under_every_parameter_sharing_strategy(model, name, tiny_config, released):
    """2 clients, 2 rounds, on the smallest input every zoo model takes (1×8×8: SqueezeNet's minimum). What is
    tested is the exchange of each model's full state (BatchNorm buffers included), which does not depend on the
    input size (every model at the datasets' shapes: test_models.py, and the shipped configs above). One test per
    (model, strategy) pair, the large models under FedAvg and FedPer only (LARGE_MODELS above)."""
    data = {
        "source": "synthetic",
        "partition": "iid",
        "num_clients": CLIENTS,
        "synthetic_classes": 4,
        "synthetic_shape": [1, 8, 8],
        "synthetic_samples": 40,
    }
    path = tiny_config(rounds=2, data=data, model={"name": model}, client={"epochs": 1, "batch_size": 16, "lr": 0.01})
    extra = " strategy.params.fedamp.lam=0.5" if name == "fedamp" else ""  # lr·λ/α_K = 0.5 (FedAMP.check: < 1)
    cfg = load_config(path, f"strategy.name={name}{extra}")
    try:
        resolved = resolve(cfg)
    except ConfigError as exc:  # a strategy whose server cannot hold what this model needs says so, naming
        # the keys (pFedHN's hypernetwork: about 101 × the model's parameters); the papers' CNN and MLP it runs
        assert model not in ("cnn", "mlp") and "model.name" in str(exc) and f"strategy.params.{name}." in str(exc), (
            f"{model} under {name}: {exc}"
        )
        return
    logs: list = []
    grid = InProcessGrid(CLIENTS, record=True)
    # the strategy's own round loop, without the app's checkpoints and files: what is tested is the exchange
    RoundDriver(resolved.build(resolved.config(cfg), RunContext(on_round=logs.append))).start(grid)
    errors = [m.error.reason for m in grid.replies if m.has_error()]
    assert not errors, f"{model} under {name}: {errors}"
    assert [len(e.replies) for e in logs] == [CLIENTS, CLIENTS], f"{model} under {name}"
    assert [e.replies_rejected for e in logs] == [0, 0], f"{model} under {name}: {logs[-1].rejections}"
    accs = [r.metrics.get("after-acc") for r in logs[-1].replies]
    accs += [r.metrics.get("deployed-acc") for e in logs for m in e.measurements for r in m.replies]
    assert len(accs) == 3 * CLIENTS and all(isinstance(a, float) for a in accs), f"{model} under {name}: {accs}"
