"""A CUDA device the clients or the ServerApp cannot see is refused before round 1 (exit 2, naming the key), under
both engines; the rules by hand (fedapps_tools/devicecheck.py)."""

from __future__ import annotations

import pytest

from conftest import write_config
from fedapps.config import ConfigError, load_config
from fedapps_tools import cli
from fedapps_tools.devicecheck import check_devices, cuda_visible, server_cuda_keys


def config(tmp_path, **sections):
    return load_config(write_config(tmp_path / "c.yaml", **sections))


def test_client_cuda_needs_a_gpu_the_clients_see(tmp_path):
    cfg = config(tmp_path, client={"device": "cuda"})
    for engine in ("inprocess", "flower"):
        with pytest.raises(ConfigError, match="'client.device: cuda' but no CUDA GPU is visible"):
            check_devices(cfg, engine, 0.25, cuda=lambda: False)
    # a GPU here: in process the clients see it; Ray hides it from a client actor that reserved no share
    check_devices(cfg, "inprocess", 0, cuda=lambda: True)
    check_devices(cfg, "flower", 0.25, cuda=lambda: True)
    with pytest.raises(ConfigError, match="--gpus-per-client"):
        check_devices(cfg, "flower", 0, cuda=lambda: True)
    # the clients run elsewhere: their machines are not this one's
    check_devices(cfg, "flower", 0, superlink=True, cuda=lambda: False)
    check_devices(cfg, "flower", 0, ray_cluster=True, cuda=lambda: False)
    # auto and cpu never ask for a GPU
    for device in ("auto", "cpu"):
        check_devices(config(tmp_path, client={"device": device}), "flower", 0, cuda=lambda: False)


def test_server_cuda_needs_a_gpu_on_this_machine(tmp_path):
    cfg = config(tmp_path, strategy={"name": "pfedhn", "params": {"pfedhn": {"server_device": "cuda"}}})
    assert server_cuda_keys(cfg) == ["strategy.params.pfedhn.server_device"]
    with pytest.raises(ConfigError, match=r"'strategy.params.pfedhn.server_device: cuda' but no CUDA GPU"):
        check_devices(cfg, "inprocess", 0, cuda=lambda: False)
    with pytest.raises(ConfigError, match="server_device"):
        check_devices(cfg, "flower", 0, ray_cluster=True, cuda=lambda: False)  # the ServerApp still runs here
    check_devices(cfg, "flower", 0, superlink=True, cuda=lambda: False)  # the SuperLink's machine runs it
    check_devices(cfg, "inprocess", 0, cuda=lambda: True)
    # another strategy's section is not read
    other = config(tmp_path, strategy={"name": "fedavg", "params": {"pfedhn": {"server_device": "cuda"}}})
    assert server_cuda_keys(other) == []


@pytest.mark.skipif(cuda_visible(), reason="this machine has a CUDA GPU: the refusal is for machines without one")
@pytest.mark.parametrize("engine", ["inprocess", "flower"])
def test_cuda_on_a_cpu_machine_exits_2_before_any_round(engine, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml")
    out = tmp_path / "out"
    rc = cli.main(["run", str(cfg), "--engine", engine, "--output-dir", str(out), "--set", "client.device=cuda"])
    captured = capsys.readouterr()
    assert rc == 2, captured.err
    assert "config error: 'client.device: cuda' but no CUDA GPU is visible" in captured.err
    assert "round 1" not in captured.out + captured.err
    assert not any(out.iterdir()), "no run folder is written"
