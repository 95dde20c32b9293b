"""FedProx, docs/development.md's worked example of an algorithm with client behaviour of its own: the proximal
term by hand (value and gradient), and the strategy end to end against FedAvg."""

import numpy as np
import pytest
import torch
from torch import nn

from deployed_toy import evaluate, tensors
from fedapps.client.registry import TRAINING_TERMS
from fedapps.config import load_config
from fedapps.flower.inprocess import InProcessGrid
from fedapps.server.driver import RoundDriver
from fedapps.wire import protocol
from strategies import resolve
from strategies.fedprox import PROX_MU, proximal_penalty


def test_proximal_penalty_value_and_gradient_by_hand():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    anchor = {"weight": torch.tensor([[0.0, 1.0]]), "bias": torch.tensor([0.0])}
    value = proximal_penalty(model, anchor, mu=0.4)
    # (0.4/2) * ((1-0)^2 + (-2-1)^2 + 0.5^2) = 0.2 * 10.25
    assert value.item() == pytest.approx(2.05)
    value.backward()
    # d/dw (mu/2)||w - a||^2 = mu (w - a): pulls TOWARDS the anchor
    np.testing.assert_allclose(model.weight.grad.numpy(), 0.4 * np.array([[1.0, -3.0]]), rtol=1e-6)
    np.testing.assert_allclose(model.bias.grad.numpy(), [0.2], rtol=1e-6)


# found by `make mutate`
def test_an_empty_anchor_costs_nothing() -> None:
    assert proximal_penalty(nn.Linear(2, 1), {}, 1.0).item() == 0.0


def test_proximal_term_is_registered_and_off_at_zero():
    assert "proximal" in TRAINING_TERMS
    assert TRAINING_TERMS["proximal"](object(), protocol.Section(extra={PROX_MU: 0.0})) is None


def run(tiny_config, mu, strategy="fedprox", rounds=2):
    cfg = load_config(tiny_config(rounds=rounds, strategy={"name": strategy, "params": {"fedprox": {"mu": mu}}}))
    resolved = resolve(cfg)
    strategy_obj = resolved.build(cfg)
    grid = InProcessGrid(cfg.data.num_clients, record=True)
    result = RoundDriver(strategy_obj).start(grid)
    return strategy_obj, grid, result


def test_fedprox_at_zero_is_fedavg(tiny_config):
    _, _, prox = run(tiny_config, 0.0)
    _, _, avg = run(tiny_config, 0.0, strategy="fedavg")
    for rnd in (1, 2):
        assert prox.evaluate_metrics_clientapp[rnd]["acc_mean"] == avg.evaluate_metrics_clientapp[rnd]["acc_mean"]
        assert (
            prox.train_metrics_clientapp[rnd]["acc_after_training_mean"]
            == avg.train_metrics_clientapp[rnd]["acc_after_training_mean"]
        )
    for k in avg.arrays:
        np.testing.assert_array_equal(prox.arrays[k].numpy(), avg.arrays[k].numpy())


def test_fedprox_sends_mu_and_a_large_mu_keeps_clients_near_the_global_model(tiny_config):
    free, grid, _ = run(tiny_config, 0.0, rounds=1)
    tied, grid_tied, _ = run(tiny_config, 5.0, rounds=1)  # lr·μ = 0.25: stable
    assert all(
        protocol.request_of(m).training.section(protocol.TRAIN).extra[PROX_MU] == 5.0
        for m in grid_tied.sent
        if m.metadata.message_type == protocol.MESSAGE_TYPE
    )
    from strategies.fedavg import initial_model_arrays

    start = initial_model_arrays(free.cfg)
    moved = lambda s: sum(float(((s.global_arrays[k] - start[k]) ** 2).sum()) for k in start)  # noqa: E731
    assert 0 < moved(tied) < 0.5 * moved(free)


# ------------------------------------------------------------------ the deployed model by hand (tests/deployed_toy.py)


def deployed_by_hand(s, grid, cid, data, rnd):
    """FedProx's deployed model after round rnd: the global model aggregated in that round (FedAvg's server)."""
    return evaluate(tensors(s.global_arrays), data)


DEPLOYED_BY_HAND = {"fedprox": deployed_by_hand}
