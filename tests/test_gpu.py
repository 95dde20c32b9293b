"""GPU readiness: device choice, bf16 mixed precision on CUDA (the CUDA cases run where a GPU is visible, e.g. via
bench/gpu_check.sh's machine; they skip elsewhere), and the config rule for mixed precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedapps.client import ops
from fedapps.config import ConfigError, load_config

CUDA = torch.cuda.is_available()


def test_auto_device_picks_cuda_when_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ops.resolve_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ops.resolve_device("auto").type == "cpu"
    with pytest.raises(RuntimeError, match="client.device"):
        ops.resolve_device("cuda")


def _train_recording_dtypes(device: str, mixed: bool) -> tuple[set[torch.dtype], nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)
    seen: set[torch.dtype] = set()
    model[1].register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    x, y = torch.randn(40, 1, 4, 4), torch.randint(0, 3, (40,))
    settings = ops.OptimSettings(epochs=2, batch_size=8, lr=0.1, mixed_precision=mixed)
    ops.train(model, x, y, settings, None, torch.Generator().manual_seed(1))
    return seen, model


def test_mixed_precision_has_no_effect_on_cpu():
    plain_dtypes, plain = _train_recording_dtypes("cpu", False)
    mixed_dtypes, mixed = _train_recording_dtypes("cpu", True)
    assert plain_dtypes == mixed_dtypes == {torch.float32}
    for a, b in zip(plain.parameters(), mixed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible")
def test_mixed_precision_runs_forward_in_bf16_on_cuda():
    dtypes, model = _train_recording_dtypes("cuda", True)
    assert dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    plain_dtypes, _ = _train_recording_dtypes("cuda", False)
    assert plain_dtypes == {torch.float32}


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible")
def test_client_trains_on_cuda_in_process(tmp_path):
    from fedapps.flower.inprocess import InProcessGrid
    from server_app import run_experiment

    grid = InProcessGrid(3)
    out = run_experiment(
        grid,
        "configs/fedavg.yaml",
        [
            "data.source=digits",
            "data.num_clients=3",
            "rounds=1",
            "strategy.min_clients=3",
            "client.device=cuda",
            "client.mixed_precision=true",
        ],
        str(tmp_path),
    )
    assert torch.cuda.max_memory_allocated() > 0
    assert out is not None


def test_mixed_precision_on_cpu_device_is_a_config_error():
    with pytest.raises(ConfigError, match="client.mixed_precision"):
        load_config("configs/fedavg.yaml", ["client.device=cpu", "client.mixed_precision=true"])
