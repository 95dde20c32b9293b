"""FedSelect (Tamirisa et al., CVPR 2024): each client grows a personal subset of its parameters, entry by entry.

Every client i has a mask m_i over the entries of its weight tensors (every parameter whose name ends in
``weight``, as the authors' code selects; biases are always shared): m = 1 personal, m = 0 shared. All masks
start at 0 (everything shared). Each round a sampled client receives, for every parameter tensor, the global
values at ITS shared entries and its mask (packed bits), writes those values into its own model, keeping its
personal entries (and its buffers) as they are, and trains by LocalAlt: ``client.epochs`` times one epoch on the
personal entries (shared ones frozen), then one epoch on the shared ones (personal ones frozen). It sends back
its shared entries only. The server averages each entry over the replying clients that share it, with equal
client weights (``weighting: uniform``, the authors' code) or by sample count (``samples``)
(:func:`masked_average`); an entry nobody shares keeps its value. Then, after every ``grow_every``-th training of
a client, its mask grows (:func:`grow_mask`), per tensor: of the entries still shared, the fraction ``rate`` that
moved most (lottery-ticket style) become personal, never beyond ``limit`` of the tensor; personal entries never go
back, are never averaged and keep their trained values. "Moved" (``delta``): ``span`` (the authors' code) —
|returned now − returned at the client's previous growth step| (the initial model before its first), a span of
``grow_every`` trainings with the server's averaging in between; ``last`` — |returned − sent| of this training
alone.

The mask lives on the server (it can compute every |Δ| it needs: what it sent and what came back, and for
``span`` the client's returned values at its last growth step, kept per client as arrays), so nothing about it
travels up and a restarted client gets it back with the next message. The deployed model after round r
is round r's shared values under client i's personal entries and buffers (loaded by ``fedselect-load``, the
deployed model's preparation, at the start of round r+1's message).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fedapps.client import ops
from fedapps.client.registry import ProtocolError, client_op
from fedapps.config import ExperimentConfig
from fedapps.params import param
from fedapps.server.strategy import DeployedModel, PersonalisedStrategy, RunContext
from fedapps.wire import protocol
from fedapps.wire.protocol import ClientReply
from fedapps.wire.validation import ArraySpec, ReplyValidator
from strategies.fedavg import initial_model_arrays

log = logging.getLogger("fedapps")

LOAD_OP = "fedselect-load"  # write the message's shared values into the client's model (the deployed model's prep)
TRAIN_OP = "fedselect-train"  # LocalAlt, then the shared entries go back
MASK_PREFIX = "mask:"  # arrays record key "mask:<parameter>": packed bits of the personal entries (no ':' in names)


# --------------------------------------------------------------------------- the maths (pure functions)


def selectable(name: str) -> bool:
    """Whether a parameter's entries may become personal: its name ends in ``weight`` (the authors' code)."""
    return name.rsplit(".", 1)[-1] == "weight"


def grow_mask(personal: np.ndarray, moved: np.ndarray, rate: float, limit: float) -> np.ndarray:
    """One growth step of a tensor's personal mask: of the still-shared entries, the round(rate × their count)
    (half up) with the largest ``moved`` become personal (ties: lower flat index first), never more than
    floor(limit × size) personal entries in all. Entries already personal stay personal."""
    personal = np.asarray(personal, dtype=bool)
    flat = personal.reshape(-1)
    shared = np.flatnonzero(~flat)
    budget = int(math.floor(limit * flat.size + 1e-9)) - int(flat.sum())
    k = min(int(math.floor(rate * shared.size + 0.5)), budget)
    if k <= 0:
        return personal.copy()
    order = np.argsort(-np.asarray(moved, dtype=np.float64).reshape(-1)[shared], kind="stable")[:k]
    out = flat.copy()
    out[shared[order]] = True
    return out.reshape(personal.shape)


def moved_entries(values: np.ndarray, since: np.ndarray, personal: np.ndarray) -> np.ndarray:
    """|values − since| at the shared entries, 0 at the personal ones (never candidates): what :func:`grow_mask`
    ranks. ``since`` is what the span of "moved" starts from (the values sent, or those returned at the client's
    previous growth step)."""
    diff = np.abs(np.asarray(values, dtype=np.float64) - np.asarray(since, dtype=np.float64))
    return np.where(np.asarray(personal, dtype=bool), 0.0, diff)


def masked_average(
    current: Mapping[str, np.ndarray],
    contributions: list[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray], float]],
) -> dict[str, np.ndarray]:
    """Per entry, Σ_i w_i·v_i / Σ_i w_i over the contributions (values v_i, personal masks m_i, weight w_i) that
    SHARE the entry (m_i = 0; a tensor absent from m_i is all shared); an entry shared by none keeps ``current``.
    A client's personal entries contribute nothing, whatever their values."""
    out: dict[str, np.ndarray] = {}
    for name, cur in current.items():
        num = np.zeros(cur.shape, dtype=np.float64)
        den = np.zeros(cur.shape, dtype=np.float64)
        for values, personal, weight in contributions:
            shared = ~np.asarray(personal.get(name, np.zeros(cur.shape, dtype=bool)), dtype=bool)
            num += weight * np.where(shared, values[name], 0.0)
            den += weight * shared
        out[name] = np.where(den > 0, num / np.where(den > 0, den, 1.0), cur).astype(cur.dtype)
    return out


def shared_values(full: np.ndarray, personal: np.ndarray | None) -> np.ndarray:
    """The entries of a tensor at its shared positions, flattened (C order); all of them without a mask."""
    flat = np.asarray(full).reshape(-1)
    return flat.copy() if personal is None else flat[~np.asarray(personal, dtype=bool).reshape(-1)]


def scatter_shared(values: np.ndarray, personal: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`shared_values`: a tensor of ``shape`` with ``values`` at the shared positions and 0
    at the personal ones."""
    out = np.zeros(int(np.prod(shape)), dtype=np.asarray(values).dtype)
    if personal is None:
        out[:] = values
    else:
        out[~np.asarray(personal, dtype=bool).reshape(-1)] = values
    return out.reshape(shape)


def pack_mask(personal: np.ndarray) -> np.ndarray:
    """A boolean mask as it travels: one bit per entry (np.packbits, C order), ceil(size / 8) bytes."""
    return np.packbits(np.asarray(personal, dtype=bool).reshape(-1))


def unpack_mask(bits: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`pack_mask`."""
    size = int(np.prod(shape))
    bits = np.asarray(bits, dtype=np.uint8).reshape(-1)
    if bits.size != (size + 7) // 8:
        raise ValueError(f"a mask of {size} entries takes {(size + 7) // 8} bytes, got {bits.size}")
    return np.unpackbits(bits, count=size).astype(bool).reshape(shape)


# --------------------------------------------------------------------------- client side


# torch's optimiser-step hooks are process-wide (a dict every optimiser step iterates): a block that registers one
# runs alone, so that clients trained on other threads of this process (the in-process engine) neither fire it nor
# see the dict change under their own step
_STEP_HOOK_LOCK = threading.RLock()


@contextmanager
def entries_frozen(model: nn.Module, frozen: Mapping[str, Tensor]) -> Iterator[None]:
    """Within the block, the entries where ``frozen[name]`` is True get no gradient and keep their values through
    every optimiser step (restored after each step, so weight decay cannot move them either); a parameter frozen
    entirely is frozen as a whole (``requires_grad`` off). Restored afterwards. One such block at a time per
    process (:data:`_STEP_HOOK_LOCK`)."""
    with _STEP_HOOK_LOCK:
        yield from _entries_frozen(model, frozen)


def _entries_frozen(model: nn.Module, frozen: Mapping[str, Tensor]) -> Iterator[None]:
    params = dict(model.named_parameters())
    whole: list[nn.Parameter] = []
    kept: list[tuple[nn.Parameter, Tensor, Tensor]] = []
    handles = []
    for name, mask in frozen.items():
        p = params[name]
        mask = mask.to(p.device).reshape(p.shape)
        if not p.requires_grad or not bool(mask.any()):
            continue
        if bool(mask.all()):
            p.requires_grad_(False)
            whole.append(p)
            continue
        keep = (~mask).to(p.dtype)
        handles.append(p.register_hook(lambda g, keep=keep: g * keep))
        kept.append((p, mask, p.detach().clone()))

    def restore(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        with torch.no_grad():
            for p, mask, saved in kept:
                p.copy_(torch.where(mask, saved, p))

    if kept:
        handles.append(register_optimizer_step_post_hook(restore))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for p in whole:
            p.requires_grad_(True)


def local_alt(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    personal: Mapping[str, Tensor],
    settings: ops.OptimSettings,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """LocalAlt: ``settings.epochs`` times one epoch on the personal entries (the shared ones frozen; skipped
    while nothing is personal), then one epoch on the shared ones (the personal ones frozen); plain
    cross-entropy. Returns the mean loss over all steps."""
    params = dict(model.named_parameters())
    personal = {n: m.to(params[n].device) for n, m in personal.items() if bool(m.any())}
    # frozen in the personal epoch: every shared entry (whole tensors without personal entries); in the shared
    # epoch: every personal entry
    shared_entries = {
        n: ~personal[n] if n in personal else torch.ones_like(p, dtype=torch.bool) for n, p in params.items()
    }
    phases = [shared_entries, personal] if personal else [personal]
    one = dataclasses.replace(settings, epochs=1)
    total, steps = 0.0, 0.0
    for _ in range(settings.epochs):
        for frozen in phases:
            with entries_frozen(model, frozen):
                result = ops.train(model, x, y, one, None, generator)
            total += result["loss"] * result["steps"]
            steps += result["steps"]
    return {"loss": total / max(steps, 1.0), "steps": steps}


def message_masks(w) -> dict[str, Tensor]:
    """The personal masks the message carries, one boolean tensor per parameter that has personal entries."""
    received = w.received
    if received is None:
        raise ProtocolError(f"{LOAD_OP} / {TRAIN_OP} need the shared values in the message's arrays")
    params = dict(w.model.named_parameters())
    out: dict[str, Tensor] = {}
    for key, bits in received.items():
        if not key.startswith(MASK_PREFIX):
            continue
        name = key[len(MASK_PREFIX) :]
        if name not in params:
            raise ProtocolError(f"the message has a mask for '{name}', which this model has no parameter of")
        try:
            mask = unpack_mask(bits.cpu().numpy(), tuple(params[name].shape))
        except ValueError as exc:
            raise ProtocolError(f"mask of '{name}': {exc}") from exc
        out[name] = torch.from_numpy(mask).to(params[name].device)
    return out


@client_op(LOAD_OP)
def fedselect_load(w, tag: str) -> None:
    """Write the message's global values into the private model at this client's shared entries; its personal
    entries and its buffers stay as they are."""
    masks = message_masks(w)
    received = w.received
    params = dict(w.model.named_parameters())
    unknown = [k for k in received if not k.startswith(MASK_PREFIX) and k not in params]
    if unknown:
        raise ProtocolError(f"the message carries arrays this model has no parameter of: {unknown[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            if name not in received:
                raise ProtocolError(f"the message lacks the shared values of '{name}'")
            values = received[name].to(p.device, p.dtype).reshape(-1)
            shared = (
                ~masks[name].reshape(-1) if name in masks else torch.ones(p.numel(), dtype=torch.bool, device=p.device)
            )
            if values.numel() != int(shared.sum()):
                raise ProtocolError(f"'{name}': {values.numel()} shared values for {int(shared.sum())} shared entries")
            p.view(-1)[shared] = values


@client_op(TRAIN_OP, default_tag="train")
def fedselect_train(w, tag: str) -> None:
    """LocalAlt on the private model (``train.*`` settings over ``client.*``); the reply's arrays are the trained
    values at the shared entries only, flattened per parameter, written here (``return-arrays`` would send whole
    tensors)."""
    masks = message_masks(w)
    result = local_alt(w.model, w.train_x, w.train_y, masks, w.settings("train"), w.generator)
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]
    values = {
        name: shared_values(p.detach().cpu().numpy(), masks[name].cpu().numpy() if name in masks else None)
        for name, p in w.model.named_parameters()
    }
    w.reply.arrays = protocol.arrays_record(values, w.request.array_transport)


# --------------------------------------------------------------------------- server side


class SharedEntriesValidator(ReplyValidator):
    """The reply validator of FedSelect's rounds: a training reply must carry, for every parameter, exactly as many
    values as the message sent it (its shared entries), in a floating dtype; the generic checks do the rest."""

    def expect(self, drafts: Any) -> None:
        drafts = list(drafts)
        super().expect(drafts)
        for draft in drafts:
            if TRAIN_OP not in [str(op).partition(":")[0] for op in draft.request.ops]:
                continue
            exp = self.expected[draft.message_type][draft.node]
            exp.arrays = {
                k: ArraySpec(tuple(a.shape), np.dtype(np.float32))
                for k, a in draft.arrays.items()
                if not k.startswith(MASK_PREFIX)
            }


@dataclass
class FedSelectParams:
    """FedSelect's parameters (defaults: the authors' code, its ``--invert`` path, which grows the personal set)."""

    rate: float = param(
        0.25,
        gt=0,
        le=1,
        help="p: at each growth step this fraction of a tensor's still-shared "
        "entries (those that moved most) becomes personal",
    )
    limit: float = param(0.8, ge=0, le=1, help="α: at most this fraction of each weight tensor becomes personal")
    grow_every: int = param(3, ge=1, help="a client's mask grows after every this-many of its local trainings")
    delta: str = param(
        "span",
        choices=("span", "last"),
        help="what 'moved' measures at a growth step: span = returned values minus those returned at the client's "
        "previous growth step (the initial model before its first; the authors' code), last = returned minus sent "
        "in this training alone",
    )
    weighting: str = param(
        "uniform",
        choices=("uniform", "samples"),
        help="each shared entry's average over the clients sharing it: uniform = equal client weights (the authors' "
        "code), samples = weighted by the clients' sample counts",
    )


class FedSelect(PersonalisedStrategy):
    """Per-client personal entries grown by how far they move; the shared rest averaged over its sharers."""

    name = "fedselect"
    Params = FedSelectParams
    checkpoint_exclude = frozenset({"initial_params"})  # rebuilt from the config
    deployed = DeployedModel(
        "round r's shared values (each entry averaged over the clients sharing it) under "
        "client i's personal entries and buffers",
        source="message",
        prepare=(LOAD_OP,),
    )

    def __init__(self, cfg: ExperimentConfig, params: Any = None, context: RunContext | None = None) -> None:
        super().__init__(cfg, params, context)
        self.global_params = initial_model_arrays(cfg, "params")
        self.initial_params = {k: v.copy() for k, v in self.global_params.items() if selectable(k)}
        self.masks: dict[int, dict[str, np.ndarray]] = {}  # client id -> parameter -> personal entries (bool)
        self.trainings: dict[int, int] = {}  # client id -> accepted local trainings so far
        # delta span: client id -> weight tensor -> the values it returned at its last growth step (its entries
        # personal then hold 0: they are never candidates again); a client absent: the initial model
        self.reference: dict[int, dict[str, np.ndarray]] = {}

    def reply_validator(self) -> ReplyValidator:
        """A training reply carries a client's shared entries only (:class:`SharedEntriesValidator`)."""
        return SharedEntriesValidator.from_config(self.cfg)

    def client_masks(self, client_id: int | None) -> dict[str, np.ndarray]:
        """Client's personal masks (only the tensors with personal entries; none: everything shared)."""
        return {} if client_id is None else self.masks.get(client_id, {})

    def client_arrays(self, masks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What a client with these masks is sent: each parameter's global values at its shared entries, and the
        packed masks of the tensors where it has personal entries."""
        out = {name: shared_values(v, masks.get(name)) for name, v in self.global_params.items()}
        out.update({MASK_PREFIX + name: pack_mask(m) for name, m in masks.items() if m.any()})
        return out

    def round_messages(self, server_round: int, node_ids: list[int]) -> list[protocol.Draft]:
        request = self.request(
            server_round,
            [LOAD_OP, TRAIN_OP],
            load=protocol.Load(into_model=False),
            returns=protocol.Return(arrays=False),
        )
        everything_shared = None
        messages = []
        for n in node_ids:
            masks = self.client_masks(self.nodes.node_to_client.get(n))
            if not any(m.any() for m in masks.values()):
                if everything_shared is None:  # one record for every client without personal entries
                    everything_shared = self.client_arrays({})
                arrays = everything_shared
            else:
                arrays = self.client_arrays(masks)
            messages.append(protocol.Draft(n, request, arrays=arrays))
        return messages

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, Any]:
        sent = self.global_params
        usable: list[tuple[ClientReply, dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        for r in replies:
            masks = self.client_masks(r.client_id)
            expected = {name: shared_values(v, masks.get(name)).shape for name, v in sent.items()}
            if r.arrays is None or set(r.arrays) != set(sent) or any(r.arrays[k].shape != expected[k] for k in sent):
                log.warning(
                    "round %d: client %d's reply does not hold its shared entries; left out", server_round, r.client_id
                )
                continue
            values = {name: scatter_shared(r.arrays[name], masks.get(name), v.shape) for name, v in sent.items()}
            usable.append((r, masks, values))
        uniform = self.params.weighting == "uniform"
        self.global_params = masked_average(
            sent, [(v, m, 1.0 if uniform else float(r.num_examples)) for r, m, v in usable]
        )
        grown = 0
        for r, masks, values in usable:
            self.trainings[r.client_id] = self.trainings.get(r.client_id, 0) + 1
            if self.trainings[r.client_id] % self.params.grow_every:
                continue
            since = sent if self.params.delta == "last" else self.reference.get(r.client_id, self.initial_params)
            new = dict(masks)
            for name, v in sent.items():
                if not selectable(name):
                    continue
                personal = masks.get(name, np.zeros(v.shape, dtype=bool))
                moved = moved_entries(values[name], since[name], personal)
                new[name] = grow_mask(personal, moved, self.params.rate, self.params.limit)
            self.masks[r.client_id] = new
            if self.params.delta == "span":
                self.reference[r.client_id] = {k: values[k].copy() for k in self.initial_params}
            grown += 1
        fractions = [self.personal_fraction(c) for c in sorted(self.trainings)]
        return {"masks_grown": grown, "personal_fraction_mean": float(np.mean(fractions)) if fractions else 0.0}

    def personal_fraction(self, client_id: int) -> float:
        """The share of client's selectable entries (all weight tensors together) that are personal."""
        total = sum(v.size for name, v in self.global_params.items() if selectable(name))
        personal = sum(int(m.sum()) for m in self.client_masks(client_id).values())
        return personal / total if total else 0.0

    def final_summary(self) -> dict[str, Any]:
        return {"personal_fraction": {str(c): round(self.personal_fraction(c), 6) for c in sorted(self.trainings)}}
