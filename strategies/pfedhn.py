"""pFedHN (Shamsian et al., ICML 2021): a hypernetwork on the server generates every client's model.

The server holds a hypernetwork h(·; φ) and one learned embedding v_i per client (an M × d table). Client i's
model is θ_i = h(v_i; φ): v_i goes through an MLP trunk (Linear(d → H), then ``hidden_layers`` × [ReLU,
Linear(H → H)]) to a feature vector f_i, and one linear head per parameter tensor of the target model turns f_i
into that tensor (flattened, then reshaped). Each round a sampled client receives θ_i, trains it for its local
epochs with the generic ``train`` operation, and sends the trained parameters θ̃_i back. The server forms
Δθ_i = θ_i − θ̃_i (generated minus trained) and back-propagates it through h: the gradient for φ and v_i is
(∂θ_i/∂φ)ᵀ Δθ_i, which is the gradient of ½‖h(v_i; φ) − θ̃_i‖² (θ̃_i held fixed): a descent step pulls the
generated model towards the one the client trained (the authors' code passes ``inner_state − final_state`` as
the output gradient of ``torch.autograd.grad`` and then takes an SGD step; the sign is pinned by a test).

A round's replies are processed at the φ that generated their models (no step happens between the messages and
the replies): one batched forward and backward of h over the replying clients, the gradients summed, clipped once to
``clip_norm``, then one SGD step (momentum, weight decay; the embeddings may have their own learning rate). With
one client per round that is exactly the authors' step; with K clients it is K of their per-client gradients
taken at the same φ and applied together (their code trains one client after another).

The deployed model of client i after round r is h(v_i; φ) after round r's step: what i receives in round r+1,
evaluated by the base class on that message before training.

Clients the server has not heard from yet. Every node is identified before its first round (``node_to_client``,
:meth:`PersonalisedStrategy.identify`), so a client gets h(v_i; φ) from round 1. A node whose identity is not known
(it did not answer the identify message, or was rejected there) gets the model generated from the mean of all M
embeddings, taken as a constant (the chain rule of its reply then reaches the trunk and the heads, no embedding);
from its next round on it gets its own.

Only parameters are generated. Buffers (BatchNorm running statistics) are not: they stay on each client, in its
private model, updated by its own training (the message carries ``arrays.keys: params``). The 4-layer CNN and
the MLP have no buffers.

Server cost, with P target parameters, hidden width H, L hidden layers, M clients, embedding size d: h has
(H + 1)·P + (d + 1)·H + L·(H + 1)·H + M·d parameters — the heads dominate, ≈ (H + 1)·P. Between rounds the
server keeps them and their SGD momentum (2 × 4 bytes per parameter); while a round is aggregated also their
gradient and, with weight decay, the copy torch's SGD makes of it (up to 4 × 4 bytes). Per message one forward
of h (H·P multiply-adds), per round one batched forward and backward over the replies (≈ 3·K·H·P for K
replies). A model whose h would exceed ``max_hn_params`` is refused with a ConfigError.

The reply carries θ̃_i rather than Δθ_i (the same bytes; the server knows θ_i), through the generic machinery.

Robust option ``median_clip`` (off by default): every client's Δθ_i reaches the shared trunk and heads, so one
scaled model steers the model the hypernetwork generates for everybody (``clip_norm`` bounds the round's summed
gradient, not one client's share of it; and clipping Δθ_i itself is not enough: a Δθ_i along θ_i — "scale the
model up" — is the direction h amplifies most: docs/algorithms/pfedhn.md#findings). With
``median_clip`` = c > 0 each client's own gradient g_i = (∂θ_i/∂φ)ᵀ Δθ_i is measured first (one backward per reply)
and its Δθ_i scaled by s_i = min(1, c·m/‖g_i‖), m the round's median ‖g_i‖ (:func:`fedapps.server.robust.median_bound`);
g is linear in Δθ, so the round's gradient is Σ_i s_i·g_i: no client pulls h further than c times the cohort's
typical client. It costs one more backward of h per reply. A hostile client's pull points the same way every round
while the honest ones vary, and SGD's momentum adds up what repeats: measured, c = 1 still lets one scaled model pull
a victim 0.5 below its accuracy on some seeds, c = 0.5 does not (docs/results/capture.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from torch import Tensor, nn

from fedapps.client import ops
from fedapps.config import DEVICES, ConfigError, ExperimentConfig
from fedapps.data import DataError, spec_info
from fedapps.models import build_model
from fedapps.params import param
from fedapps.seeds import derive_seed
from fedapps.server.dropin import (
    PersonalisedFlowerStrategy,
    array_record,
    numpy_arrays,
    only_arrays,
    only_metrics,
    parameter_keys,
)
from fedapps.server.robust import median_bound
from fedapps.server.state import state_value
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply

BYTES_PER_PARAMETER = 4  # float32
log = logging.getLogger("flwr")  # the drop-in strategy logs where Flower's own strategies do
REPLY_CHUNK = 16  # replies back-propagated together (memory: a few × REPLY_CHUNK × the target model)
PEAK_COPIES = (
    4  # h's parameters and momentum; while a round is aggregated also its gradient and SGD's weight-decay copy
)


# --------------------------------------------------------------------------- the hypernetwork


def embedding_size(num_clients: int, embed_dim: int) -> int:
    """d: ``embed_dim``, or where it is 0 the authors' rule int(1 + M/4)."""
    return int(embed_dim) if embed_dim > 0 else 1 + int(num_clients) // 4


def target_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of the model's parameters (not its buffers), in the model's order: what h generates."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def hypernetwork_size(
    num_clients: int, shapes: Mapping[str, tuple[int, ...]], embed_dim: int, hidden_dim: int, hidden_layers: int
) -> int:
    """Number of parameters of h: the embedding table, the trunk and one linear head per target tensor."""
    trunk = (embed_dim + 1) * hidden_dim + hidden_layers * (hidden_dim + 1) * hidden_dim
    heads = sum((hidden_dim + 1) * math.prod(shape) for shape in shapes.values())
    return num_clients * embed_dim + trunk + heads


class HyperNetwork(nn.Module):
    """Client embedding → MLP trunk → one linear head per target parameter tensor (PyTorch's default init;
    embeddings N(0, 1), as ``nn.Embedding`` draws them)."""

    def __init__(
        self,
        num_clients: int,
        shapes: Mapping[str, tuple[int, ...]],
        embed_dim: int,
        hidden_dim: int,
        hidden_layers: int,
    ) -> None:
        super().__init__()
        self.names = list(shapes)
        self.shapes = {k: tuple(int(s) for s in v) for k, v in shapes.items()}
        self.embeddings = nn.Embedding(num_clients, embed_dim)
        layers: list[nn.Module] = [nn.Linear(embed_dim, hidden_dim)]
        for _ in range(hidden_layers):
            layers += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.trunk = nn.Sequential(*layers)
        # a ModuleList in the target's order: parameter names contain dots, which a ModuleDict refuses
        self.heads = nn.ModuleList(nn.Linear(hidden_dim, math.prod(self.shapes[k])) for k in self.names)

    def embedding(self, client: int | None) -> Tensor:
        """v_client; for an unknown client (None) the mean of all embeddings, as a constant (no gradient)."""
        if client is None:
            return self.embeddings.weight.detach().mean(0)
        return self.embeddings.weight[int(client)]

    def generate(self, client: int | None) -> dict[str, Tensor]:
        """θ = h(v_client; φ): one tensor per target parameter, in the target's shapes."""
        features = self.trunk(self.embedding(client))
        return {k: head(features).view(self.shapes[k]) for k, head in zip(self.names, self.heads)}

    def generate_batch(self, clients: Sequence[int | None]) -> dict[str, Tensor]:
        """h for several clients in one pass (one matrix product per layer): tensors of shape (K, *target shape)."""
        features = self.trunk(torch.stack([self.embedding(c) for c in clients]))
        return {k: head(features).view(len(clients), *self.shapes[k]) for k, head in zip(self.names, self.heads)}

    def forward(self, client: int | None) -> dict[str, Tensor]:
        return self.generate(client)


def accumulate_delta_gradient(
    hn: HyperNetwork,
    clients: Sequence[int | None],
    trained: Sequence[Mapping[str, Tensor]],
    scales: Sequence[float] | None = None,
) -> list[float]:
    """Add Σ_i s_i·(∂θ_i/∂φ)ᵀ Δθ_i to the ``.grad`` of h's parameters, θ_i = h(v_i; φ) at the current φ and
    Δθ_i = θ_i − θ̃_i (generated minus ``trained[i]``), s_i = ``scales[i]`` (default 1): the gradient of
    Σ_i ½·s_i·‖h(v_i; φ) − θ̃_i‖². One batched forward and one backward of h for all of them. Returns ‖Δθ_i‖ per
    client (over all its tensors, before scaling)."""
    generated = hn.generate_batch(clients)
    deltas = [generated[k].detach() - torch.stack([t[k] for t in trained]).to(generated[k].dtype) for k in hn.names]
    squares = functools.reduce(operator.add, (d.flatten(1).double().pow(2).sum(1) for d in deltas))
    grads = deltas
    if scales is not None:
        s = torch.as_tensor(list(scales), dtype=deltas[0].dtype, device=deltas[0].device)
        grads = [d * s.view(-1, *([1] * (d.dim() - 1))) for d in deltas]
    torch.autograd.backward([generated[k] for k in hn.names], grad_tensors=grads)
    return [float(v) for v in squares.sqrt()]


def client_gradient_norms(
    hn: HyperNetwork, clients: Sequence[int | None], trained: Sequence[Mapping[str, Tensor]]
) -> list[float]:
    """‖(∂θ_i/∂φ)ᵀ Δθ_i‖ of each client alone (one backward each; h's ``.grad`` is left empty): how far its reply
    alone would pull h."""
    norms = []
    for client, t in zip(clients, trained):
        hn.zero_grad(set_to_none=True)
        accumulate_delta_gradient(hn, [client], [t])
        squares = [p.grad.double().pow(2).sum() for p in hn.parameters() if p.grad is not None]
        norms.append(float(torch.stack(squares).sum().sqrt()) if squares else 0.0)
    hn.zero_grad(set_to_none=True)
    return norms


def median_clip_scales(norms: Sequence[float], factor: float) -> list[float]:
    """s_i = min(1, bound / norm_i) with bound = ``factor`` × the median norm
    (:func:`fedapps.server.robust.median_bound`):
    what each client's contribution is multiplied by so that none is longer than the bound."""
    bound = median_bound(norms, factor)
    return [1.0 if n <= bound else bound / n for n in norms]


def hypernetwork_step(hn: HyperNetwork, optimizer: torch.optim.Optimizer, clip_norm: float) -> float:
    """One optimiser step on the accumulated gradient, clipped to ``clip_norm`` (0: not clipped) as
    ``torch.nn.utils.clip_grad_norm_`` does; the gradient is freed after. Returns its norm before clipping."""
    params = [p for p in hn.parameters() if p.grad is not None]
    norm = (
        float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
        if params
        else 0.0
    )
    if clip_norm > 0:
        nn.utils.clip_grad_norm_(params, clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def build_hypernetwork(
    seed: int,
    num_clients: int,
    shapes: Mapping[str, tuple[int, ...]],
    embed_dim: int,
    hidden_dim: int,
    hidden_layers: int,
) -> HyperNetwork:
    """h as the app initialises it for config seed ``seed`` (drawn under ``derive_seed(seed, "pfedhn-init")``; the
    caller's RNG is left as it was): the same M, shapes and widths give the same h."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "pfedhn-init"))
        return HyperNetwork(num_clients, shapes, embed_dim, hidden_dim, hidden_layers)


def generated_arrays(hn: HyperNetwork, client: int | None) -> dict[str, np.ndarray]:
    """h(v_client; φ) as float32 numpy arrays (the mean embedding's model for None)."""
    with torch.no_grad():
        return {k: v.detach().cpu().numpy() for k, v in hn.generate(client).items()}


def trained_tensors(arrays: Mapping[str, Any], names: Sequence[str], device: torch.device | str) -> dict[str, Tensor]:
    """θ̃ of a reply (its arrays named ``names``) as float32 tensors on ``device``."""
    return {k: torch.as_tensor(np.asarray(arrays[k], dtype=np.float32), device=device) for k in names}


def hypernetwork_update(
    hn: HyperNetwork,
    optimizer: torch.optim.Optimizer,
    sources: Sequence[int | None],
    trained: Sequence[Mapping[str, Tensor]],
    clip_norm: float,
    median_clip: float = 0.0,
) -> dict[str, Any]:
    """One round of the server: Σ_i s_i·(∂θ_i/∂φ)ᵀ(θ_i − θ̃_i) over the replies at the φ that generated θ_i
    (``sources[i]``: the embedding that generated reply i's model, None for the mean one; ``trained[i]``: θ̃_i),
    back-propagated ``REPLY_CHUNK`` replies at a time, s_i = 1 or, with ``median_clip`` > 0, each client's share
    bounded by :func:`median_clip_scales`; then one clipped optimiser step. Returns the round's diagnostics."""
    optimizer.zero_grad(set_to_none=True)
    extra: dict[str, Any] = {}
    scales = [1.0] * len(sources)
    if median_clip > 0:
        norms = client_gradient_norms(hn, sources, trained)
        scales = median_clip_scales(norms, median_clip)
        extra = {"clip_bound": median_bound(norms, median_clip), "clipped": sum(1 for v in scales if v < 1.0)}
    # θ_i is generated again at the same φ (in a batch: equal to what was sent up to float rounding)
    deltas: list[float] = []
    for start in range(0, len(sources), REPLY_CHUNK):
        end = start + REPLY_CHUNK
        deltas += accumulate_delta_gradient(hn, sources[start:end], trained[start:end], scales[start:end])
    grad_norm = hypernetwork_step(hn, optimizer, clip_norm)
    return {
        "hn_delta_norm_mean": float(np.mean(deltas)),
        "hn_grad_norm": grad_norm,
        "hn_from_mean_embedding": sum(1 for s in sources if s is None),
        **extra,
    }


def make_optimizer(
    hn: HyperNetwork, lr: float, embed_lr: float, momentum: float, weight_decay: float
) -> torch.optim.SGD:
    """SGD with momentum and weight decay over h; the embedding table in its own group (``embed_lr``, 0 = lr)."""
    embeddings = [hn.embeddings.weight]
    rest = [p for n, p in hn.named_parameters() if not n.startswith("embeddings.")]
    groups: list[dict[str, Any]] = [{"params": rest}, {"params": embeddings, "lr": embed_lr if embed_lr > 0 else lr}]
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)


# --------------------------------------------------------------------------- the strategy


@dataclass
class PFedHNParams:
    """pFedHN's parameters (defaults: the authors' code, experiments/pfedhn/trainer.py)."""

    embed_dim: int = param(0, ge=0, help="0 = 1 + num_clients // 4, the authors' rule")
    hidden_dim: int = param(100, gt=0, help="width H of the trunk; every head is H → size of its tensor")
    hidden_layers: int = param(3, ge=0, help="[ReLU, Linear(H→H)] blocks after the first Linear(d→H)")
    lr: float = param(1e-2, gt=0, help="SGD learning rate of the hypernetwork")
    embed_lr: float = param(0.0, ge=0, help="learning rate of the client embeddings; 0 = lr")
    momentum: float = param(0.9, ge=0, lt=1, help="SGD momentum of the hypernetwork")
    weight_decay: float = param(1e-3, ge=0, help="SGD weight decay of the hypernetwork")
    clip_norm: float = param(50.0, ge=0, help="the round's gradient norm is clipped to this; 0 = off")
    max_hn_params: int = param(100_000_000, gt=0, help="refuse a model whose hypernetwork would be larger")
    median_clip: float = param(
        0.0,
        ge=0,
        help="robust option, 0 = off: each client's gradient into the hypernetwork "
        "(its Δθ back-propagated) is scaled down to at most this multiple of "
        "the round's median client gradient norm (e.g. 0.5; measured: 1 is not "
        "always enough, docs/results/capture.md)",
    )
    server_device: str = param(
        "auto", choices=DEVICES, help="where the hypernetwork lives and steps: auto (CUDA when present), cpu or cuda"
    )


def check_size(
    cfg: ExperimentConfig, params: PFedHNParams, num_classes: int, input_shape: tuple[int, int, int]
) -> dict[str, tuple[int, ...]]:
    """The target model's parameter shapes; ConfigError (naming the keys to change) where h would have more than
    ``max_hn_params`` parameters."""
    with torch.device("meta"):  # shapes only: nothing is allocated
        shapes = target_shapes(build_model(cfg.model.name, num_classes, input_shape))
    m, d = cfg.data.num_clients, embedding_size(cfg.data.num_clients, params.embed_dim)
    size = hypernetwork_size(m, shapes, d, params.hidden_dim, params.hidden_layers)
    if size > params.max_hn_params:
        target = sum(math.prod(s) for s in shapes.values())
        gib = size * BYTES_PER_PARAMETER * PEAK_COPIES / 2**30
        raise ConfigError(
            f"strategy 'pfedhn': the hypernetwork for model.name '{cfg.model.name}' ({target:,} parameters in "
            f"{len(shapes)} tensors) would hold {size:,} parameters (up to {gib:.1f} GiB on the server with their "
            f"momentum and gradient), above 'strategy.params.pfedhn.max_hn_params' ({params.max_hn_params:,}); lower "
            f"'strategy.params.pfedhn.hidden_dim' ({params.hidden_dim}), choose a smaller 'model.name' (cnn, mlp), "
            "or raise max_hn_params where the server has the memory"
        )
    return shapes


class PFedHN(PersonalisedStrategy):
    """A server-side hypernetwork generates each client's parameters from its embedding; the clients' updates
    train it by the chain rule."""

    name = "pfedhn"
    Params = PFedHNParams
    deployed = DeployedModel(
        "the model the hypernetwork generates from client i's embedding after round r's "
        "update (what i receives in round r+1)",
        source="message",
    )
    checkpoint_exclude = frozenset({"hn", "optimizer", "device", "sent_from"})  # hn and optimizer: state_dict below

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: Any) -> None:
        super().check_config(cfg, params)
        try:
            num_classes, shape = spec_info(dataclasses.asdict(cfg.data))
        except DataError:
            return  # data.source 'nodes' before the describe phase: checked when the strategy is built
        check_size(cfg, params, num_classes, shape)

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        p: PFedHNParams = self.params
        num_classes, shape = spec_info(dataclasses.asdict(cfg.data))  # under 'nodes': what the nodes described
        shapes = check_size(cfg, p, num_classes, shape)
        self.device = ops.resolve_device(p.server_device)
        self.embed_dim = embedding_size(cfg.data.num_clients, p.embed_dim)
        self.hn = build_hypernetwork(
            cfg.seed, cfg.data.num_clients, shapes, self.embed_dim, p.hidden_dim, p.hidden_layers
        )
        self.hn.to(self.device)
        self.optimizer = make_optimizer(self.hn, p.lr, p.embed_lr, p.momentum, p.weight_decay)
        self.sent_from: dict[
            int, int | None
        ] = {}  # node -> the client whose embedding generated its model (None: mean)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The generic state, plus h's parameters and the optimiser's momentum as CPU tensors."""
        state = super().state_dict()
        state["hn"] = {k: v.detach().cpu().clone() for k, v in self.hn.state_dict().items()}
        state["optimizer"] = state_value(self.optimizer.state_dict(), "PFedHN.optimizer")
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        hn, optimizer = state.pop("hn"), state.pop("optimizer")
        super().load_state_dict(state)
        self.hn.load_state_dict(hn)
        self.optimizer.load_state_dict(optimizer)

    # ------------------------------------------------------------------ the hypernetwork's models
    def client_of(self, node: int) -> int | None:
        """The client a node is known to be (None before it is identified)."""
        return self.nodes.node_to_client.get(int(node))

    def generated(self, client: int | None) -> dict[str, np.ndarray]:
        """h(v_client; φ) as float32 arrays (the mean embedding's model for None)."""
        return generated_arrays(self.hn, client)

    def hypernetwork_parameters(self) -> int:
        return sum(p.numel() for p in self.hn.parameters())

    # ------------------------------------------------------------------ the round
    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            ["train"],
            load=protocol.Load(into_model=True),
            returns=protocol.Return(arrays=True, part="params"),
        )
        self.sent_from = {}
        messages = []
        for n in node_ids:
            client = self.client_of(n)
            self.sent_from[int(n)] = client
            arrays = self.generated(client)
            messages.append(protocol.Draft(n, request, arrays=arrays))
        return messages

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        """Σ over the replies of (∂θ_i/∂φ)ᵀ(θ_i − θ̃_i) at the φ that generated θ_i, clipped, one SGD step."""
        usable = []
        for r in replies:
            if r.arrays is None or int(r.node_id) not in self.sent_from or set(r.arrays) != set(self.hn.names):
                self.replies.skip_reply(server_round, r, "its arrays answer no model this round sent it")
                continue
            usable.append(r)
        if not usable:
            return {}
        sources = [self.sent_from[int(r.node_id)] for r in usable]
        trained = [self.trained(r) for r in usable]
        return hypernetwork_update(
            self.hn, self.optimizer, sources, trained, float(self.params.clip_norm), float(self.params.median_clip)
        )

    def trained(self, r: ClientReply) -> dict[str, Tensor]:
        """θ̃_i of a reply as float32 tensors on the server's device."""
        return trained_tensors(r.required_arrays, self.hn.names, self.device)

    def final_summary(self) -> dict[str, Any]:
        n = self.hypernetwork_parameters()
        return {
            "hypernetwork_parameters": n,
            "hypernetwork_embed_dim": self.embed_dim,
            "hypernetwork_peak_bytes": n * BYTES_PER_PARAMETER * PEAK_COPIES,
        }


# --------------------------------------------------------------------------- the drop-in Flower strategy

# the train-reply metric a client may send to name its embedding (Flower's node_config key of a simulated node's data)
PARTITION_ID = "partition-id"


class FlowerPFedHN(PersonalisedFlowerStrategy):
    """pFedHN as a drop-in Flower strategy (``fedapps.flower_strategies.PFedHN``): the server's hypernetwork generates
    each node's model from that node's embedding; the node trains what it receives and sends it back; the replies train
    the hypernetwork by the chain rule (:func:`hypernetwork_update`, the app's round). h is initialised as the app
    initialises it for config seed ``seed`` (:func:`build_hypernetwork`); every other pFedHN argument means what it
    means in the app (defaults: the app's), the rest are Flower's FedAvg's.

    Which embedding a node gets. The table has ``num_nodes`` rows (None: as many as nodes are connected when round 1
    is sampled). A node is bound to a row at its first usable training reply: the row its ``id_metric`` metric names
    (``"partition-id"``: one line in the ClientApp) when it sends one, else the lowest row no node holds yet (the
    round's new nodes in node-id order). Until then, in its first round, it is sent the model generated from the mean
    of all embeddings, taken as a constant (the app's rule for a node it cannot identify); its reply trains the trunk
    and the heads. A node for which no row is left keeps getting that model. Bindings are per node id, for the run.

    What is generated: the model's parameters (``model`` given) or every floating-point array; the other arrays (e.g.
    BatchNorm statistics) are each node's own, from its last upload (the initial ones before it)."""

    def __init__(
        self,
        *,
        num_nodes: int | None = None,
        id_metric: str | None = PARTITION_ID,
        seed: int = 0,
        model: nn.Module | None = None,
        embed_dim: int = PFedHNParams.embed_dim,
        hidden_dim: int = PFedHNParams.hidden_dim,
        hidden_layers: int = PFedHNParams.hidden_layers,
        lr: float = PFedHNParams.lr,
        embed_lr: float = PFedHNParams.embed_lr,
        momentum: float = PFedHNParams.momentum,
        weight_decay: float = PFedHNParams.weight_decay,
        clip_norm: float = PFedHNParams.clip_norm,
        median_clip: float = PFedHNParams.median_clip,
        max_hn_params: int = PFedHNParams.max_hn_params,
        server_device: str = "cpu",
        **flower_args: Any,
    ) -> None:
        super().__init__(**flower_args)
        if num_nodes is not None and num_nodes < 1:
            raise ValueError(f"PFedHN: num_nodes is {num_nodes}; give the number of clients (>= 1) or None")
        self.num_nodes, self.id_metric, self.seed, self.model = num_nodes, id_metric, seed, model
        self.hn_args = dict(embed_dim=embed_dim, hidden_dim=hidden_dim, hidden_layers=hidden_layers)
        self.opt_args = dict(lr=lr, embed_lr=embed_lr, momentum=momentum, weight_decay=weight_decay)
        self.clip_norm, self.median_clip, self.max_hn_params = clip_norm, median_clip, max_hn_params
        self.device = ops.resolve_device(server_device)
        self.hn: HyperNetwork | None = None
        self.grid: Grid | None = None
        self.embedding_of: dict[int, int] = {}  # node id -> its row of the embedding table
        self.sent_from: dict[int, int | None] = {}  # node -> the row that generated this round's model (None: mean)
        self.own_arrays: dict[int, dict[str, np.ndarray]] = {}  # node -> its arrays that are not generated
        self.unplaced: set[int] = set()  # nodes told once that no row is left for them

    def settings(self) -> list[tuple[str, object]]:
        return [("Embeddings", self.num_nodes or "one per node connected at round 1"),
                ("Embedding from metric", self.id_metric or "no (first-seen order)"), ("seed", self.seed)]  # fmt: skip

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.grid, self.sent_from = grid, {}
        return super().configure_train(server_round, arrays, config, grid)

    def build(self, arrays: ArrayRecord) -> HyperNetwork:
        """h, its optimiser and the arrays it generates, from the initial arrays (once)."""
        if self.hn is not None:
            return self.hn
        initial = numpy_arrays(arrays)
        self.keys = list(initial)
        names = parameter_keys(self.model, initial)
        self.initial_rest = {k: v for k, v in initial.items() if k not in names}
        shapes = {k: tuple(initial[k].shape) for k in names}
        m = self.num_nodes or max(len(list(self.grid.get_node_ids())) if self.grid is not None else 0, 1)
        self.num_nodes = m
        d = embedding_size(m, int(self.hn_args["embed_dim"]))
        size = hypernetwork_size(m, shapes, d, int(self.hn_args["hidden_dim"]), int(self.hn_args["hidden_layers"]))
        if size > self.max_hn_params:
            raise ValueError(
                f"PFedHN: the hypernetwork for this model ({sum(math.prod(s) for s in shapes.values()):,} generated "
                f"values) would hold {size:,} parameters, above max_hn_params={self.max_hn_params:,}; lower hidden_dim "
                "or raise max_hn_params where the server has the memory"
            )
        hn = build_hypernetwork(self.seed, m, shapes, d, int(self.hn_args["hidden_dim"]),
                                int(self.hn_args["hidden_layers"])).to(self.device)  # fmt: skip
        self.optimizer = make_optimizer(hn, **{k: float(v) for k, v in self.opt_args.items()})
        self.hn = hn
        return hn

    def node_arrays(self, node_id: int, arrays: ArrayRecord, for_training: bool) -> ArrayRecord:
        """h(v_row) for the node's row (the mean embedding's model before it is bound), its own other arrays."""
        hn = self.build(arrays)
        row = self.embedding_of.get(node_id)
        if for_training:
            self.sent_from[node_id] = row
        own = self.own_arrays.get(node_id, self.initial_rest)
        return array_record({**own, **generated_arrays(hn, row)}, self.keys)

    def aggregate_arrays(self, server_round: int, replies: list[Message]) -> ArrayRecord | None:
        """New nodes bound to their rows; one step of h on the matching replies (at the rows that generated their
        models). Returns the model of the mean embedding (what an unbound node is sent) with the initial other
        arrays."""
        hn = self.hn
        usable: list[tuple[int, dict[str, np.ndarray]]] = []
        for msg in replies:
            node, arrays = msg.metadata.src_node_id, numpy_arrays(only_arrays(msg))
            if (
                node not in self.sent_from
                or list(arrays) != self.keys
                or hn is None
                or any(arrays[k].shape != hn.shapes[k] for k in hn.names)
            ):
                log.warning("PFedHN round %d: node %d sent arrays that answer no model it was sent this round; "
                            "left out", server_round, node)  # fmt: skip
                continue
            usable.append((node, arrays))
            self.own_arrays[node] = {k: v for k, v in arrays.items() if k in self.initial_rest}
        if hn is None or not usable:
            return None
        self.bind([node for node, _ in usable], {m.metadata.src_node_id: only_metrics(m) for m in replies})
        usable.sort(key=lambda item: (self.embedding_of.get(item[0], math.inf), item[0]))
        hypernetwork_update(
            hn,
            self.optimizer,
            [self.sent_from[node] for node, _ in usable],
            [trained_tensors(arrays, hn.names, self.device) for _, arrays in usable],
            float(self.clip_norm),
            float(self.median_clip),
        )
        return array_record({**self.initial_rest, **generated_arrays(hn, None)}, self.keys)

    def bind(self, nodes: list[int], metrics: Mapping[int, Any]) -> None:
        """Bind the nodes not bound yet: to the row their ``id_metric`` names, else to the lowest free rows (in
        node-id order); a node left without a row keeps the mean embedding's model."""
        m = int(self.num_nodes or 0)
        first_seen = []
        for node in sorted(n for n in nodes if n not in self.embedding_of):
            claimed = metrics[node].get(self.id_metric) if self.id_metric else None
            if claimed is None:
                first_seen.append(node)
            elif isinstance(claimed, int) and not isinstance(claimed, bool) and 0 <= claimed < m:
                if claimed in self.embedding_of.values():
                    log.warning("PFedHN: node %d names embedding %d, which another node holds; they share it",
                                node, claimed)  # fmt: skip
                self.embedding_of[node] = claimed
            else:
                log.warning("PFedHN: node %d sent %s=%r, not a row of the %d-row table (num_nodes must exceed "
                            "every id); placed in first-seen order", node, self.id_metric, claimed, m)  # fmt: skip
                first_seen.append(node)
        for node in first_seen:
            free = sorted(set(range(m)) - set(self.embedding_of.values()))
            if free:
                self.embedding_of[node] = free[0]
            elif node not in self.unplaced:
                self.unplaced.add(node)
                log.warning("PFedHN: no embedding left for node %d (num_nodes=%d): it is sent the mean embedding's "
                            "model", node, m)  # fmt: skip
