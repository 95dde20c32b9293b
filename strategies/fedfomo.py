"""FedFomo (Zhang et al., ICLR 2021): each client downloads the most useful other clients' models and mixes.

Each client holds out ``holdout_fraction`` of its training split (the same samples every round) and trains on
the rest. From round 2 on, the server sends each sampled client up to ``candidates`` other clients' latest
models: those with the highest affinity P_ij so far (ties: lower id), each slot replaced with probability ε by
a random other known client (ε-greedy exploration; ε = ``epsilon``·``epsilon_decay``^(round−1)). The client
scores every candidate n on its held-out split by w_n = max(0, (L_own − L_n)/‖θ_n − θ_own‖), normalises,
moves its model to θ_own + Σ_n w_n(θ_n − θ_own), trains (that model is its deployed model) and sends its
model and the weights back; the server adds the weights to P_i·. Download cost: ``candidates`` models per client.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from fedapps.client import ops
from fedapps.client.registry import ProtocolError, client_op
from fedapps.config import ExperimentConfig
from fedapps.params import param
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply

WEIGHTS = "fedfomo-weights"  # the metric the client reports its weights in

# --------------------------------------------------------------------------- maths


def fomo_weights(own_loss: float, candidate_losses: list[float], distances: list[float]) -> list[float]:
    """FedFomo's first-order weights: max(0, (L_own − L_n) / ‖θ_n − θ_own‖) per candidate, normalised to sum 1
    when any is positive (all zero otherwise: nobody helps, the client keeps its model)."""
    raw = [max(0.0, (own_loss - loss) / d) if d > 0 else 0.0 for loss, d in zip(candidate_losses, distances)]
    total = sum(raw)
    return [w / total for w in raw] if total > 0 else raw


def mix_towards(own: dict[str, Tensor], candidates: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    """θ_own + Σ_n w_n·(θ_n − θ_own) on floating-point entries; integer buffers keep the client's own."""
    out = {}
    for key, value in own.items():
        if not value.is_floating_point():
            out[key] = value.clone()
            continue
        mixed = value.clone()
        for state, w in zip(candidates, weights):
            if w:
                mixed += w * (state[key].to(value.dtype) - value)
        out[key] = mixed
    return out


def state_distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Euclidean distance between two models over their floating-point entries."""
    total = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a if a[k].is_floating_point())
    return math.sqrt(total)


# --------------------------------------------------------------------------- client side


@client_op("fomo-mix")
def fomo_mix(w, tag: str) -> None:
    """Score each model in the message on the held-out split against the client's own, move the own model
    towards the helpful ones (:func:`fomo_weights`, :func:`mix_towards`) and report the weights."""
    if len(w.val_y) == 0:
        raise ProtocolError("fomo-mix needs a held-out split: set holdout-fraction > 0 in the message")
    candidates = w.candidate_models("fomo-mix")
    own = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
    own_loss = ops.evaluate(w.model, w.val_x, w.val_y)["loss"]
    losses = ops.losses_of(w.model, candidates, w.val_x, w.val_y)  # leaves the last candidate loaded
    distances = [state_distance(state, own) for state in candidates]
    weights = fomo_weights(own_loss, losses, distances)
    w.model.load_state_dict(mix_towards(own, candidates, weights))
    w.metrics[WEIGHTS] = [float(v) for v in weights]


# --------------------------------------------------------------------------- server side


def choose_candidates(
    affinity: dict[int, float], others: list[int], m: int, epsilon: float, rng: np.random.Generator
) -> list[int]:
    """Up to m distinct clients of ``others``: highest affinity first (ties: lower id), each slot replaced with
    probability ε by a random client not chosen yet."""
    ranked = sorted(others, key=lambda j: (-affinity.get(j, 0.0), j))
    chosen: list[int] = []
    for j in ranked:
        if len(chosen) == min(m, len(others)):
            break
        if j in chosen:  # already taken by an exploring slot
            continue
        if rng.random() < epsilon:
            j = int(rng.choice([o for o in others if o not in chosen]))
        chosen.append(j)
    # an exploring slot may have taken a ranked client that the loop then skipped: fill up in rank order
    chosen += [j for j in ranked if j not in chosen][: min(m, len(others)) - len(chosen)]
    return chosen


@dataclass
class FedFomoParams:
    """FedFomo's parameters."""

    candidates: int = param(5, ge=1, help="M: other clients' models each client downloads per round")
    epsilon: float = param(0.3, ge=0, le=1, help="ε-greedy exploration probability in round 1")
    epsilon_decay: float = param(0.95, gt=0, le=1, help="ε is multiplied by this every round")
    holdout_fraction: float = param(
        0.2, gt=0, lt=1, help="share of each client's training split held out to score the candidates"
    )


class FedFomo(PersonalisedStrategy):
    """First-order model optimisation: personalised mixing of other clients' models, weighted on held-out data."""

    name = "fedfomo"
    sample_privacy_refused = (
        "each client weighs the received models by their loss on a held-out share of its "
        "training data, without noise, and reports the weights"
    )
    Params = FedFomoParams
    deployed = DeployedModel("client i's own model after its mixing and local training in round r")

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.models: dict[int, dict[str, np.ndarray]] = {}  # client id -> latest model
        self.affinity: dict[int, dict[int, float]] = {}  # P_ij (client -> candidate -> summed weight)
        self.sent_candidates: dict[int, list[int]] = {}  # node -> candidate client ids of this round

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            ["fomo-mix", "train"],
            training=protocol.Training(holdout_fraction=float(self.params.holdout_fraction)),
            load=protocol.Load(multi=True),
            returns=protocol.Return(arrays=True, part="state"),
        )
        epsilon = self.params.epsilon * self.params.epsilon_decay ** (server_round - 1)
        self.sent_candidates = {}
        messages = []
        for n in node_ids:
            client = self.nodes.node_to_client.get(n, -1)
            others = sorted(c for c in self.models if c != client)
            chosen = choose_candidates(self.affinity.get(client, {}), others, self.params.candidates, epsilon, self.rng)
            self.sent_candidates[n] = chosen
            if chosen:
                arrays = protocol.pack_models([self.models[c] for c in chosen])
                messages.append(protocol.Draft(n, request, arrays=arrays))
            else:  # nobody to learn from yet (round 1)
                messages.append(protocol.Draft(n, dataclasses.replace(request, ops=("train",))))
        return messages

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        helpful: list[int] = []
        for r in replies:
            if r.arrays is not None:
                self.models[r.client_id] = r.arrays
            chosen = self.sent_candidates.get(r.node_id, [])
            weights = r.metrics.get(WEIGHTS)
            if chosen and (not isinstance(weights, list) or len(weights) != len(chosen)):
                got = f"{len(weights)} weights" if isinstance(weights, list) else f"weights {weights!r}"
                self.replies.skip_reply(
                    server_round, r, f"{got} for {len(chosen)} candidates; its affinities unchanged"
                )
                continue
            for j, w in zip(chosen, weights or []):
                row = self.affinity.setdefault(r.client_id, {})
                row[j] = row.get(j, 0.0) + float(w)
            if chosen:
                assert isinstance(weights, list)  # a reply to candidates without a list of weights was skipped above
                helpful.append(sum(1 for w in weights if w > 0))
        return {"helpful_candidates_mean": float(np.mean(helpful)) if helpful else None}
