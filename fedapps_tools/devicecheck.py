"""Before a run starts: a CUDA device the config asks for must be one the process that uses it can see.

``client.device: cuda`` is used by the clients, ``strategy.params.<name>.server_device: cuda`` (COSMOS, pFedHN) by the
ServerApp. Without such a check a run on a machine without a GPU starts, every client's training message fails, and
the run ends after its last round with no usable reply. What the clients see depends on the engine:

- ``--engine inprocess``: the clients run in this process: they see this machine's GPUs;
- ``--engine flower`` with a Ray instance of the run's own: each client is a Ray actor, and Ray hides every GPU from
  an actor that reserved none (it sets ``CUDA_VISIBLE_DEVICES`` empty), so clients see a GPU only with
  ``--gpus-per-client`` (or ``client-resources-num-gpus``) above 0 — and this machine must have one;
- a running SuperLink (``--superlink``) or a Ray cluster (``--ray-address``): the clients run on other machines; not
  checked here (the cluster check counts the cluster's GPUs).

The ServerApp runs on this machine under both local engines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedapps.config import ConfigError, ExperimentConfig


def cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def server_cuda_keys(cfg: ExperimentConfig) -> list[str]:
    """The keys of the chosen strategy's params that put the server's models on CUDA (``server_device: cuda``)."""
    name = cfg.strategy.name
    section: Any = cfg.strategy.params.get(name) or {}
    return [
        f"strategy.params.{name}.{key}"
        for key, value in sorted(section.items())
        if key.endswith("device") and str(value).strip().lower() == "cuda"
    ]


def check_devices(
    cfg: ExperimentConfig,
    engine: str,
    gpus_per_client: float,
    superlink: bool = False,
    ray_cluster: bool = False,
    cuda: Callable[[], bool] = cuda_visible,
) -> None:
    """Refuse (ConfigError, exit 2) a CUDA device the clients or the server would not see (module docstring).
    ``gpus_per_client``: the GPU share each Ray client actor reserves; ``superlink``: the run goes to a running
    SuperLink (clients and ServerApp elsewhere); ``ray_cluster``: the clients run on a Ray cluster's nodes; ``cuda``:
    whether this machine has a visible CUDA GPU."""
    problems = []
    if cfg.client.device == "cuda" and not (superlink or ray_cluster):
        if not cuda():
            problems.append(
                "'client.device: cuda' but no CUDA GPU is visible on this machine, where the clients run; set "
                "client.device to auto (CUDA when present, else the CPU) or cpu"
            )
        elif engine == "flower" and gpus_per_client <= 0:
            problems.append(
                "'client.device: cuda' but the clients reserve no GPU (--gpus-per-client 0), and Ray hides the GPUs "
                "from a client that reserved none; pass --gpus-per-client (e.g. 0.25 shares one GPU between four "
                "clients), or set client.device to auto or cpu"
            )
    if not superlink and not cuda():
        for key in server_cuda_keys(cfg):
            problems.append(
                f"'{key}: cuda' but no CUDA GPU is visible on this machine, where the ServerApp runs; set it to "
                "auto or cpu"
            )
    if problems:
        raise ConfigError("; ".join(problems))
