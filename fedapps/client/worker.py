"""The generic client: runs the operations a message asks for on its private data and private model.

No algorithm logic lives here: the server says which operations to run, in which order, with which settings
(a :class:`fedapps.wire.protocol.Request`, decoded once per message); each name is looked up in
:mod:`fedapps.client.registry`, where this module registers the common operations (evaluate, evaluate-received,
train, distill, predict) and every algorithm module registers its own. The private model persists in
``Context.state`` between rounds; where a state directory is named (node config ``state-dir``, else the message's
``state-dir``), also on disk, so that it survives the process (a run resumed from its checkpoint):
``<state-dir>/<client-id>.r<round>.pt``, the newest two rounds.
A message with privacy settings (:class:`fedapps.wire.protocol.Privacy`) runs its operations under
:mod:`fedapps.client.privacy` (DP-SGD on every loop on the client's data, its ledger kept beside the private model)
and its reply reports the client's ε. Every reply carries where the client's time on the message went
(:class:`fedapps.wire.protocol.MessageProfile`, measured by :mod:`fedapps.client.phases`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from torch import nn

from fedapps import checkpoint
from fedapps.client import ops, privacy
from fedapps.client.phases import PhaseClock, measuring
from fedapps.client.registry import (
    DISTILL_TERMS,
    DISTILL_WEIGHTINGS,
    TRAINING_TERMS,
    ProtocolError,
    client_op,
    parse_op,
)
from fedapps.data import (
    DATA_PATH,
    NODES,
    NUM_CLASSES,
    PUBLIC_PATH,
    ClientData,
    DataError,
    Federation,
    data_warnings_silenced,
    get_federation,
    node_federation,
    node_path,
    read_labelled,
    read_public,
    spec_key,
)
from fedapps.models import STATE_PARTS, build_model, classifier_name, state_part
from fedapps.seeds import GLOBAL_RNG_LOCK, derive_seed
from fedapps.wire import protocol, pseudolabels

log = logging.getLogger("fedapps")

STATE_MODEL = "private-model"
STATE_ARCH = "private-model-arch"
__all__ = ["ProtocolError", "Worker", "handle"]  # ProtocolError is defined in fedapps.client.registry

THREADS_KEY = "threads"  # node config: torch threads of this node's ClientApp
THREADS_ENV = "FEDAPPS_CLIENT_THREADS"  # environment: the same, where no node config gives it
# node config keys named as the wire names the same thing: the client's id, its architecture, its state directory
NODE_CLIENT_ID = protocol.CLIENT_ID
NODE_ARCH = protocol.INFO_ARCH
STATE_DIR_KEY = protocol.STATE_DIR  # node config (and message setting): where the client keeps its model on disk


@functools.lru_cache(maxsize=4)
def set_threads_once(requested: int = 0) -> int:
    """Give torch exactly the threads this worker was granted: node config ``threads`` (``requested``), else
    FEDAPPS_CLIENT_THREADS, else OMP_NUM_THREADS (Ray sets it per actor); none of them: torch's default."""
    n = int(requested) or int(os.environ.get(THREADS_ENV, os.environ.get("OMP_NUM_THREADS", "0")) or 0)
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def node_threads(context: Context) -> int:
    """Node config ``threads`` as a positive integer (0 when not given)."""
    value = context.node_config.get(THREADS_KEY)
    if value is None or str(value).strip() == "":
        return 0
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ProtocolError(
            f"node config '{THREADS_KEY}'={value!r} must be a positive integer (torch threads of "
            f'this node\'s ClientApp), e.g. --node-config "{THREADS_KEY}=2"'
        )
    return n


def client_id_of(context: Context) -> int:
    """Stable client id: node_config 'client-id' (deployment) or 'partition-id' (simulation)."""
    nc = context.node_config
    for key in (NODE_CLIENT_ID, "partition-id"):
        if key in nc:
            return int(nc[key])
    raise ProtocolError(
        "node_config has neither 'partition-id' nor 'client-id'; start the SuperNode with "
        '--node-config "partition-id=<i> num-partitions=<n>"'
    )


def data_spec(request: protocol.Request) -> dict[str, Any]:
    """The data spec the server put in the message (``data.*`` keys)."""
    spec = dict(request.setup.data)
    spec["synthetic_shape"] = list(spec.get("synthetic_shape", [3, 32, 32]))
    return spec


def needs_public(request: protocol.Request) -> bool:
    """Whether a message needs the public set U on the client: it names U's fingerprint or predicts/distils on U."""
    return request.public.fingerprint is not None or any(
        str(op).partition(":")[0] in ("predict", "distill") for op in request.ops
    )


_NODE_FEDERATIONS: dict[tuple, Federation] = {}  # one per spec, client and files (per process)


def client_federation(context: Context, spec: dict[str, Any], client_id: int, public: bool) -> Federation:
    """This client's data: its node's own files (node config ``data-path``, data.source 'nodes'), else the partition
    of the spec's source (simulation, demos). Every problem with the node's files is a ProtocolError naming the node
    config key, the path and the fix; so is data that does not fit the classes / shape the server expects."""
    node_config = context.node_config
    own = str(node_config.get(DATA_PATH, "")).strip()
    source = str(spec.get("source", ""))
    if source != NODES:
        for key in (DATA_PATH, PUBLIC_PATH):
            if str(node_config.get(key, "")).strip():
                raise ProtocolError(
                    f"node config '{key}' is set, but the server's data.source is '{source}' (it builds "
                    f"every client's data from that source); run with data.source: nodes, or start this "
                    f"SuperNode without '{key}'"
                )
        try:
            with data_warnings_silenced():  # the server built the same federation from this spec and reported it
                return get_federation(spec)
        except DataError as exc:
            raise ProtocolError(f"client {client_id}: the data spec cannot be served here: {exc}") from exc
    if not own:
        raise ProtocolError(
            f"data.source is 'nodes' but this node has no node config '{DATA_PATH}'; start the SuperNode "
            f"with --node-config \"{DATA_PATH}='/path/to/own.npz' client-id=<i>\" (an .npz with x, y or "
            "a folder of class sub-folders)"
        )
    try:
        labelled = read_labelled(own, DATA_PATH, node_config.get(NUM_CLASSES))
        u = None
        if public:
            if not str(node_config.get(PUBLIC_PATH, "")).strip():
                raise DataError(
                    f"this run needs the public set U, but the node has no node config '{PUBLIC_PATH}'; "
                    f"add --node-config \"{PUBLIC_PATH}='/path/to/U.npz'\" (a copy of the server's "
                    "data.public_path)"
                )
            u_path = node_path(node_config[PUBLIC_PATH], PUBLIC_PATH)
            u = read_public(u_path, f"node config '{PUBLIC_PATH}'={str(u_path)!r}")
        check_fits(spec, labelled, u)
        fed_key = (
            spec_key(spec),
            client_id,
            labelled.path,
            id(labelled.x),
            labelled.declared_classes,
            None if u is None else id(u[0]),
        )
        if fed_key not in _NODE_FEDERATIONS:
            if len(_NODE_FEDERATIONS) > 4:
                _NODE_FEDERATIONS.clear()
            _NODE_FEDERATIONS[fed_key] = node_federation(spec, client_id, labelled, u)
        return _NODE_FEDERATIONS[fed_key]
    except DataError as exc:
        raise ProtocolError(str(exc)) from exc


def check_fits(spec: Mapping[str, Any], labelled: Any, public: tuple[torch.Tensor, Any] | None) -> None:
    """The node's data against the classes and input shape the server expects (the message's ``data.num_classes``
    / ``data.input_shape``; unset in the describe message, then nothing to check)."""
    k = int(spec.get("num_classes", 0) or 0)
    shape = tuple(int(d) for d in spec.get("input_shape", []) or [])
    where = f"node config '{DATA_PATH}'={labelled.path!r}"
    if shape and labelled.input_shape != shape:
        raise DataError(
            f"{where}: images of shape {labelled.input_shape} (C, H, W), but the federation's are {shape}; "
            "give this node data of the federation's input shape"
        )
    if k:
        if labelled.declared_classes is not None and labelled.declared_classes != k:
            raise DataError(
                f"{where}: this node declares {labelled.declared_classes} classes, the federation has {k}; "
                f"fix the class sub-folders / 'num_classes' of the file, or node config '{NUM_CLASSES}'"
            )
        if int(labelled.y.max()) >= k:
            raise DataError(
                f"{where}: label {int(labelled.y.max())} is outside the federation's {k} classes "
                f"(0..{k - 1}); fix the labels"
            )
    if public is not None:
        u_shape = tuple(int(d) for d in public[0].shape[1:])
        if u_shape != labelled.input_shape:
            raise DataError(
                f"node config '{PUBLIC_PATH}': U's images are {u_shape}, this node's data {labelled.input_shape}; "
                "U must have the clients' input shape"
            )


def model_arch(request: protocol.Request, context: Context, client_id: int) -> str:
    """Architecture of this client's private model: node_config 'arch', else the per-client list, else one name."""
    if NODE_ARCH in context.node_config:
        return str(context.node_config[NODE_ARCH])
    model = request.setup.model
    if model.per_client:
        return str(model.per_client[client_id % len(model.per_client)])
    if model.name is None:
        raise ProtocolError("the message names no model (model.name) and this node no architecture (node config arch)")
    return model.name


def private_arch(context: Context, request: protocol.Request, client_id: int) -> str:
    """The architecture of the client's private model: the kept one's, else the configured one."""
    if STATE_ARCH in context.state:
        return str(context.state[STATE_ARCH][NODE_ARCH])
    return model_arch(request, context, client_id)


def skeleton_key(arch: str, fed: Federation, request: protocol.Request) -> SkeletonKey:
    """The :class:`SkeletonPool` key of a client model of ``arch`` for this data and message."""
    c, h, w = fed.input_shape
    return arch, int(fed.num_classes), (int(c), int(h), int(w)), int(request.setup.model.seed or 0)


def private_model(
    context: Context,
    request: protocol.Request,
    fed: Federation,
    client_id: int,
    device: torch.device,
    incoming: Mapping[str, torch.Tensor] | None = None,
    taken: list[tuple[SkeletonKey, tuple[nn.Module, dict]]] | None = None,
) -> tuple[nn.Module, str]:
    """The client's model: restored from Context.state, or built fresh on first contact. ``incoming``: the arrays
    the message loads into it next (``load-arrays``); when they cover its whole state (e.g. a global model sent whole)
    nothing is loaded first, since every value would be overwritten (one state copy less per message). The module
    comes from :data:`SKELETONS`; it is appended to ``taken`` (the caller gives it back after the message)."""
    arch = private_arch(context, request, client_id)
    key = skeleton_key(arch, fed, request)
    item = SKELETONS.take(key)
    if taken is not None:
        taken.append((key, item))
    model, initial = item
    overwritten = incoming is not None and initial.keys() <= incoming.keys()  # every value is loaded next
    if not overwritten:
        saved = STATE_MODEL in context.state
        model.load_state_dict(record_tensors(context.state.array_records[STATE_MODEL]) if saved else initial)
    return on_device(model, device), arch


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """The model on ``device``; ``Module.to`` walks every tensor even when nothing moves (a cost per message:
    docs/performance.md), so it is called only when some parameter or buffer is elsewhere."""
    if any(t.device != device for t in itertools.chain(model.parameters(), model.buffers())):
        model = model.to(device)
    return model


SkeletonKey = tuple[str, int, tuple[int, int, int], int]  # architecture, classes, input shape, seed


class SkeletonPool:
    """Model modules reused across messages (each message loads a full state into its module first; building a
    model per message costs more than loading), with their seeded initial state. A module is taken for one message
    and given back after it, so messages served at the same time on several threads (the in-process engine) never
    share one; a process serving one message at a time (a Ray actor, a SuperNode) reuses one per architecture.
    At most ``keys`` architectures are kept (the least recently used is dropped), ``per_key`` modules each."""

    def __init__(self, keys: int = 8, per_key: int = 8) -> None:
        self.keys, self.per_key = keys, per_key
        self._free: OrderedDict[SkeletonKey, list[tuple[nn.Module, dict]]] = OrderedDict()
        self._draws: dict[SkeletonKey, bool] = {}
        self._lock = threading.Lock()

    def take(self, key: SkeletonKey) -> tuple[nn.Module, dict]:
        """A module of ``key`` no other message holds, and the seeded initial state (do not modify it)."""
        with self._lock:
            free = self._free.get(key)
            if free:
                self._free.move_to_end(key)
                return free.pop()
        arch, num_classes, input_shape, seed = key
        model = build_model(arch, num_classes, input_shape, seed=seed)
        return model, {k: v.clone() for k, v in model.state_dict().items()}

    def give(self, key: SkeletonKey, item: tuple[nn.Module, dict]) -> None:
        """Give a module back for the next message."""
        with self._lock:
            free = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(free) < self.per_key:
                free.append(item)
            while len(self._free) > self.keys:
                dropped, _ = self._free.popitem(last=False)
                self._draws.pop(dropped, None)

    def draws_global_rng(self, key: SkeletonKey) -> bool:
        """Whether training this architecture draws from torch's global RNG (a dropout layer)."""
        with self._lock:
            known = self._draws.get(key)
        if known is None:
            item = self.take(key)
            known = any(
                isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0  # noqa: SLF001 - torch's dropout layers share no public base
                for m in item[0].modules()
            )
            self.give(key, item)
            with self._lock:
                self._draws[key] = known
        return known


SKELETONS = SkeletonPool()


def load_arrays(model: nn.Module, received: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Load received arrays into the model; keys not sent keep the model's own values (local buffers)."""
    own = model.state_dict()
    unknown = [k for k in received if k not in own]
    mismatched = [k for k in received if k in own and tuple(received[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in received]
    if unknown or mismatched or (strict and missing):
        raise ProtocolError(
            f"received arrays do not fit the model: unknown={unknown[:3]} "
            f"shape-mismatch={mismatched[:3]} missing={missing[:3] if strict else []}"
        )
    model.load_state_dict(received, strict=False)


def state_dir(request: protocol.Request, context: Context) -> Path | None:
    """The directory where this client keeps its private model on disk: node config ``state-dir`` first (``~``
    expanded here, on the node; ``<state-dir>/<run token>/``), then the message's (the run folder's, a path of the
    server's machine)."""
    if str(context.node_config.get(STATE_DIR_KEY, "")).strip():
        base = Path(os.path.expanduser(str(context.node_config[STATE_DIR_KEY]).strip()))
        # one sub-folder per run (its state-run token): a node serving several runs at once never mixes their files
        token = str(request.bookkeeping.state_run or "").strip()
        if token and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", token):
            raise ProtocolError(f"state-run token {token!r} is not a plain name; refusing to use it as a folder")
        return base / token if token else base
    value = request.bookkeeping.state_dir
    return Path(str(value)) if value else None


def state_dir_is_nodes(context: Context) -> bool:
    """Whether the state directory is the node's own (node config) rather than the message's."""
    return bool(str(context.node_config.get(STATE_DIR_KEY, "")).strip())


def state_files(directory: Path, client_id: int) -> dict[int, Path]:
    """Round -> file of this client's saved private models."""
    out: dict[int, Path] = {}
    for path in directory.glob(f"{int(client_id)}.r*.pt"):
        tail = path.name[len(f"{int(client_id)}.r") : -len(".pt")]
        if tail.isdigit():
            out[int(tail)] = path
    return out


@dataclass(frozen=True)
class SavedModel:
    """A private model's file in the state directory (``<client-id>.r<round>.pt``): the run's token, the round that
    wrote it, the model's architecture and its state."""

    run: str
    round: int
    arch: str
    state: dict[str, torch.Tensor]


class PrivateStateError(ProtocolError):
    """A client's saved private model cannot be loaded safely (damaged, foreign, or a pickle asking to run code): the
    message is refused with this reason, and the server makes the run's exit status say so
    (:data:`fedapps.wire.reply.PRIVATE_STATE_UNREADABLE` in the reason)."""


def read_saved_model(path: Path, client_id: int) -> SavedModel:
    """A private model's file, loaded without running any code in it (:func:`fedapps.checkpoint.load`); a file that
    fails to load or is not a private model is a :class:`PrivateStateError` naming it and the fix."""
    fix = (
        "delete that file to restart this client from the model the server sends (its private progress is lost), "
        "or restore it from a copy you trust"
    )
    what = f"client {client_id}: {protocol.PRIVATE_STATE_UNREADABLE}:"
    try:
        data = checkpoint.load(path, what, fix)
        saved = SavedModel(**data)
        if not (isinstance(saved.state, dict) and all(isinstance(v, torch.Tensor) for v in saved.state.values())):
            raise TypeError("its 'state' is not a dict of tensors")
        return SavedModel(str(saved.run), int(saved.round), str(saved.arch), saved.state)
    except checkpoint.StateFileError as exc:
        raise PrivateStateError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise PrivateStateError(f"{what} {path} is not a private model's file ({exc}); {fix}") from None


def restore_private_state(context: Context, request: protocol.Request, client_id: int) -> None:
    """A process that has not served this client yet (a resumed run): the newest saved private model of an
    EARLIER round of the same run (state-run token) goes into Context.state. A file of the current round is
    skipped: it was written by a round the server never checkpointed and now repeats."""
    directory = state_dir(request, context)
    if directory is None or STATE_MODEL in context.state:
        return
    try:
        if not directory.is_dir():
            return
    except OSError:
        return
    rnd, token = request.round, str(request.bookkeeping.state_run or "")
    for saved_round, path in sorted(state_files(directory, client_id).items(), reverse=True):
        if saved_round >= rnd:
            continue
        saved = read_saved_model(path, client_id)
        if saved.run != token:
            return  # another run's file
        context.state[STATE_MODEL] = ArrayRecord(dict(saved.state))
        context.state[STATE_ARCH] = ConfigRecord({NODE_ARCH: str(saved.arch)})
        return


def save_private_state(
    context: Context, request: protocol.Request, client_id: int, model: nn.Module, arch: str
) -> None:
    """Write the private model to the state directory (atomically) for this round; keep the newest earlier
    round's file too (the one a resumption from the last checkpoint needs), remove older ones."""
    directory = state_dir(request, context)
    if directory is None:
        return
    rnd = request.round
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    try:
        checkpoint.atomic_save(
            vars(SavedModel(str(request.bookkeeping.state_run or ""), rnd, arch, state)),
            directory / f"{int(client_id)}.r{rnd}.pt",
        )
        earlier = sorted(r for r in state_files(directory, client_id) if r < rnd)
        for r in earlier[:-1]:
            state_files(directory, client_id)[r].unlink(missing_ok=True)
    except OSError as exc:
        if state_dir_is_nodes(context):
            raise ProtocolError(
                f"node config '{STATE_DIR_KEY}'={str(directory)!r}: cannot write the private model there "
                f"({exc.strerror or exc}); give a folder this node can write"
            ) from exc
        # the message's state-dir is the server's run folder: on another machine it may not be writable
        log.warning(
            "client %d: the run's state-dir %s is not writable on this node (%s); the private model stays in "
            "memory only: set node config '%s' to keep it across restarts",
            client_id,
            directory,
            exc.strerror or exc,
            STATE_DIR_KEY,
        )


def model_arrays(model: nn.Module, which: str, transport: str = "float32") -> ArrayRecord:
    """The model as an ArrayRecord: 'state', 'params' or 'body' (see :func:`fedapps.models.state_part`), its
    floating arrays encoded for ``transport`` (float32: as the model holds them; see :func:`protocol.encode_arrays`)."""
    if which not in STATE_PARTS:
        raise ProtocolError(f"unknown arrays.keys '{which}'; allowed: {', '.join(STATE_PARTS)}")
    return protocol.arrays_record({k: v.detach().cpu().numpy() for k, v in state_part(model, which).items()}, transport)


def received_state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """A received ArrayRecord as a state dict, float16 tensors (``arrays.transport: float16``) cast back to float32,
    the dtype of every model in the zoo; integer buffers and float32 tensors as they came."""
    return {k: v.float() if v.dtype == torch.float16 else v for k, v in record_tensors(record).items()}


def record_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """An ArrayRecord as tensors by name, as Flower's ``to_torch_state_dict`` gives them (writable, in the arrays' own
    dtypes), read by :func:`fedapps.wire.protocol.record_values`."""
    return {k: torch.from_numpy(v) for k, v in protocol.record_values(record).items()}


def holdout_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (fit, held out) of n training samples, ``fraction`` held out at random; the same every round."""
    if not 0.0 <= fraction < 1.0:
        raise ProtocolError(f"holdout-fraction must be in [0, 1), got {fraction}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = int(round(fraction * n))
    return torch.sort(order[held:]).values, torch.sort(order[:held]).values


MODEL_PARTS = ("none", "head", "body")


def part_names(model: nn.Module, part: str) -> set[str]:
    """Parameter names of a part of the model: its classifier head, everything else (body), or none."""
    if part not in MODEL_PARTS:
        raise ProtocolError(f"unknown model part '{part}' to freeze; allowed: {', '.join(MODEL_PARTS)}")
    if part == "none":
        return set()
    head = classifier_name(model) + "."
    return {n for n, _ in model.named_parameters() if n.startswith(head) == (part == "head")}


def split_models(arrays: ArrayRecord) -> list[dict[str, torch.Tensor]]:
    """Several models in one record, keys 'm<k>.<name>' (see :func:`protocol.pack_models`) -> one state dict per k."""
    models: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in received_state(arrays).items():
        prefix, _, name = key.partition(".")
        if not (prefix.startswith("m") and prefix[1:].isdigit() and name):
            raise ProtocolError(f"multi-model arrays need keys 'm<k>.<parameter>', got '{key}'")
        models.setdefault(int(prefix[1:]), {})[name] = tensor
    if sorted(models) != list(range(len(models))):
        raise ProtocolError(f"multi-model arrays must number their models 0..K-1, got {sorted(models)}")
    return [models[k] for k in range(len(models))]


def optim_settings(section: protocol.Section, defaults: Mapping[str, Any]) -> ops.OptimSettings:
    """OptimSettings from a message section, falling back to the client section (``client.*``)."""
    merged = {**defaults, **section.optimiser()}
    keys = ops.OptimSettings.__dataclass_fields__
    return ops.OptimSettings(**{k: merged[k] for k in keys if k in merged})


class Worker:
    """Serves one message for one client: parse, run the named operations, reply.

    What an operation may use: ``request`` (the message's settings, :class:`fedapps.wire.protocol.Request`),
    ``targets`` (its targets record, :class:`fedapps.wire.protocol.Targets`), ``data`` / ``fed`` (this client's data and
    the data spec's federation), ``train_x`` / ``train_y`` (the training split less any held-out share),
    ``val_x`` / ``val_y`` (the held-out share), ``eval_x`` / ``eval_y`` (THE evaluation split: every evaluation
    reads its data there and nowhere else, see :meth:`evaluate`), ``model`` (the private model), ``received``
    (the message's arrays as tensors), ``generator`` (seeded per client and round), ``metrics`` and ``reply``
    (what goes back: :class:`fedapps.wire.protocol.Reply`, whose ``metrics`` ``metrics`` is), and ``outgoing``: the
    model whose arrays ``return-arrays`` sends (default: the private model).
    """

    def __init__(self, msg: Message, context: Context) -> None:
        self.clock = PhaseClock()  # where the time goes (the reply's profile): from here to the reply encoded
        self.t0 = time.perf_counter()  # t-total: from here (data and model lookup included) to the reply's arrays
        set_threads_once(node_threads(context))
        self.msg = msg
        self.context = context
        with self.clock.phase("decoding"):
            try:
                self.request = protocol.request_of(msg)
            except protocol.MessageError as exc:
                raise ProtocolError(f"malformed message: {exc}") from exc
        self.client_id = client_id_of(context)
        with self.clock.phase("data"):
            self.fed = client_federation(context, data_spec(self.request), self.client_id, needs_public(self.request))
            self.data: ClientData = self.fed.client(self.client_id)
            # a held-out share of the training split (scored on by operations that need one); training uses the rest
            self.train_x, self.train_y = self.data.train_x, self.data.train_y
            self.val_x, self.val_y = self.data.train_x[:0], self.data.train_y[:0]
            holdout = float(self.request.training.holdout_fraction or 0.0)
            if holdout:
                fit, held_out = holdout_split(
                    len(self.data.train_y),
                    holdout,
                    derive_seed(int(self.request.setup.data.get("seed", 0)), "holdout", self.client_id),
                )
                self.train_x, self.train_y = self.data.train_x[fit], self.data.train_y[fit]
                self.val_x, self.val_y = self.data.train_x[held_out], self.data.train_y[held_out]
        self.device = ops.resolve_device(str(self.request.setup.client.get("device", "auto")))
        if self.request.keep.persists:
            with self.clock.phase("model"):
                restore_private_state(context, self.request, self.client_id)
        self.arch = private_arch(context, self.request, self.client_id)
        self.outgoing: nn.Module | None = None  # set by an operation that returns another model than the private one
        self.reply = protocol.Reply(self.client_id, len(self.data.train_y))
        self.metrics: dict[str, Any] = self.reply.metrics
        rnd = self.request.round
        seed = int(self.request.setup.model.seed or 0)
        self.generator = torch.Generator().manual_seed(derive_seed(seed, "client-batches", rnd, self.client_id))
        self.global_seed = derive_seed(seed, "client-global", rnd, self.client_id)  # see :meth:`global_rng`
        self.taken: list[tuple[SkeletonKey, tuple[nn.Module, dict]]] = []  # modules of SKELETONS, given back by run

    @contextlib.contextmanager
    def global_rng(self) -> Iterator[None]:
        """Ops that draw from torch's global RNG (dropout) see a stream fixed by (seed, round, client) too: it is
        seeded here, at the start of the message. Where the private model has dropout, the whole message holds
        :data:`GLOBAL_RNG_LOCK`, so that clients served on other threads of this process (the in-process engine)
        neither re-seed nor draw from the stream meanwhile. On the CPU only its generator is seeded
        (torch.manual_seed also queues every accelerator's: a cost per message, docs/performance.md)."""
        builds = any(str(op).partition(":")[0] != DESCRIBE_OP for op in self.request.ops)  # a model
        draws = builds and SKELETONS.draws_global_rng(skeleton_key(self.arch, self.fed, self.request))
        with GLOBAL_RNG_LOCK if draws else contextlib.nullcontext():
            with GLOBAL_RNG_LOCK:
                if self.device.type == "cpu":
                    torch.default_generator.manual_seed(self.global_seed)
                else:
                    torch.manual_seed(self.global_seed)
            yield

    # ------------------------------------------------------------------ entry point
    def run(self) -> Message:
        """Run every operation in the message, save the private model, and build the reply (the model modules the
        message took from :data:`SKELETONS` are given back at the end)."""
        try:
            with self.global_rng(), measuring(self.clock):
                return self._run()
        finally:
            for key, item in self.taken:
                SKELETONS.give(key, item)
            self.taken = []

    def _run(self) -> Message:
        self._check_public_set()
        steps = [parse_op(op) for op in self.request.ops]  # refuse an unknown operation before running any
        req = self.request
        if self.received is not None and req.load.into_model:
            with self.clock.phase("model"):
                load_arrays(self.model, self.received, strict=False)
        with self.clock.phase("other"):
            private = privacy.start(
                req,
                self.context,
                self.client_id,
                self.arch,
                state_dir(req, self.context),
                state_dir_is_nodes(self.context),
            )
            with ops.privately(private.training if private is not None else None):
                for op, tag in steps:
                    start = time.perf_counter()
                    op.run(self, tag)
                    self.metrics[protocol.timing_name(tag)] = time.perf_counter() - start
            if private is not None:  # the ops succeeded: their steps count, whatever leaves with the reply
                self.metrics[protocol.PRIVACY_EPSILON] = private.commit()
        if req.returns.arrays:
            with self.clock.phase("encoding"):
                returned = self.outgoing if self.outgoing is not None else self.model
                self.reply.arrays = model_arrays(returned, req.returns.which, req.array_transport)
        if req.keep.saves:
            # the private model lives in Context.state between rounds; strategies that send the whole model
            # every round switch this off, which halves what travels with each message in simulation. An
            # evaluation-only message reads the private model (persist-model) but never writes it (save-model false).
            # The arrays are copied to the host; the module stays on its device for the next message (SKELETONS)
            with self.clock.phase("keep"):
                self.context.state[STATE_MODEL] = model_arrays(self.model, "state")
                self.context.state[STATE_ARCH] = ConfigRecord({NODE_ARCH: self.arch})
                save_private_state(self.context, self.request, self.client_id, self.model, self.arch)
        self.metrics[protocol.TOTAL_TIME] = time.perf_counter() - self.t0
        with self.clock.phase("encoding"):
            self.reply.info = protocol.ReplyInfo(arch=self.arch, fingerprint=self.fed.fingerprint)
            content = self.reply.encode()
        self.reply.profile = self.clock.profile()
        content[protocol.PROFILE] = self.reply.profile.encode()  # last: its own encoding is all it leaves out
        return Message(content=content, reply_to=self.msg)

    @functools.cached_property
    def model(self) -> nn.Module:
        """The private model (restored or built on first use: a message that needs none, e.g. ``describe``,
        builds none)."""
        incoming = self.received if self.request.load.into_model else None
        with self.clock.phase("model"):
            return private_model(
                self.context, self.request, self.fed, self.client_id, self.device, incoming, self.taken
            )[0]

    @functools.cached_property
    def received(self) -> dict[str, torch.Tensor] | None:
        """The message's model arrays as tensors (float16 on the wire cast back to float32, :func:`received_state`),
        decoded once on first use: loaded into the model (``load-arrays``), the anchor of a training term, or a
        model evaluated or trained apart. None without arrays, or when they hold several models (``arrays.multi``,
        see :meth:`candidate_models`)."""
        if protocol.ARRAYS not in self.msg.content or self.request.load.multi:
            return None
        with self.clock.phase("decoding"):
            return received_state(self.msg.content.array_records[protocol.ARRAYS])

    def candidate_models(self, op: str) -> list[dict[str, torch.Tensor]]:
        """The several models of an ``arrays.multi`` message, as state dicts in the order the server packed them."""
        if protocol.ARRAYS not in self.msg.content or not self.request.load.multi:
            raise ProtocolError(f"{op} needs several models in the message (arrays.multi)")
        with self.clock.phase("decoding"):
            return split_models(self.msg.content.array_records[protocol.ARRAYS])

    def model_from(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A separate model of the client's architecture holding the given (complete) state."""
        with self.clock.phase("model"):
            model = build_model(self.arch, self.fed.num_classes, self.fed.input_shape).to(self.device)
            model.load_state_dict(state, strict=True)
            return model

    @property
    def eval_x(self) -> torch.Tensor:
        """Inputs of the client's evaluation split: its local test split (the data layer decides what that holds,
        e.g. a validation split while tuning). The one place an evaluation reads its data from."""
        return self.data.test_x

    @property
    def eval_y(self) -> torch.Tensor:
        """Labels of the evaluation split (see :attr:`eval_x`)."""
        return self.data.test_y

    def evaluate(self, model: nn.Module, tag: str) -> None:
        """Evaluate ``model`` on the evaluation split and report it under ``tag`` (see :meth:`record_eval`)."""
        self.record_eval(tag, ops.evaluate(model, self.eval_x, self.eval_y))

    def settings(self, section_name: str) -> ops.OptimSettings:
        """Optimiser settings of a message section (e.g. ``train``), falling back to the ``client`` section."""
        return optim_settings(self.request.training.section(section_name), self.request.setup.client)

    def record_eval(self, tag: str, result: Mapping[str, float]) -> None:
        """Evaluation results as the metrics ``<tag>-acc``, ``<tag>-loss``, ``<tag>-n``, ``<tag>-correct``."""
        for k in protocol.EVAL_FIELDS:
            self.metrics[protocol.metric_name(tag, k)] = result[k]

    @functools.cached_property
    def targets(self) -> protocol.Targets:
        """The message's targets record (decoded on first use; empty without one)."""
        if protocol.TARGETS not in self.msg.content:
            return protocol.Targets()
        try:
            with self.clock.phase("decoding"):
                return protocol.Targets.decode(self.msg.content[protocol.TARGETS])
        except protocol.MessageError as exc:
            raise ProtocolError(f"malformed message: {exc}") from exc

    def training_terms(self, section: protocol.Section) -> ops.Regulariser | None:
        """The sum of every registered training term that the ``train.*`` settings switch on (None: none is)."""
        built = {name: build(self, section) for name, build in TRAINING_TERMS.items()}
        terms = [t for t in built.values() if t is not None]
        privacy.refuse_data_terms(name for name, t in built.items() if t is not None)
        return (lambda m: sum(t(m) for t in terms)) if terms else None

    def distill_terms(self, section: protocol.Section) -> ops.DistillTerm | None:
        """The sum of every registered distillation term that the ``distill.*`` settings switch on (None: none is;
        a single term is returned as it is)."""
        terms = [t for t in (build(self, section) for build in DISTILL_TERMS.values()) if t is not None]
        if len(terms) <= 1:
            return terms[0] if terms else None
        return lambda m, x, logits, weights: sum(t(m, x, logits, weights) for t in terms)

    def _check_public_set(self) -> None:
        expected = self.request.public.fingerprint
        if expected is not None and expected != self.fed.fingerprint:
            if str(self.context.node_config.get(PUBLIC_PATH, "")).strip():
                raise ProtocolError(
                    f"public set mismatch: node config '{PUBLIC_PATH}'={str(self.context.node_config[PUBLIC_PATH])!r} "
                    f"holds a U with fingerprint '{self.fed.fingerprint}', the server's U has '{expected}'; give this "
                    f"node a copy of the server's U file (data.public_path) as '{PUBLIC_PATH}'"
                )
            raise ProtocolError(
                f"public set mismatch: the server's U has fingerprint '{expected}', this client's has "
                f"'{self.fed.fingerprint}'. Both sides must build U from the same data spec (data.* keys)."
            )


# ---------------------------------------------------------------------- the common operations


# what a node reports about its data in the describe message (data.source 'nodes', before round 1)
DESCRIBE_OP = "describe"
DESCRIBE_SHAPE = "data-shape"  # [C, H, W] of its images
DESCRIBE_CLASSES = "data-classes"  # the class count it declares (0: none declared, see DESCRIBE_MAX_LABEL)
DESCRIBE_MAX_LABEL = "data-max-label"  # its largest label
DESCRIBE_TRAIN = "data-train-counts"  # per class: samples of its training split
DESCRIBE_EVAL = "data-eval-counts"  # per class: samples of its evaluation split (test, or validation)


@client_op(DESCRIBE_OP)
def describe(w: Worker, tag: str) -> None:
    """The node's data as the server needs to know it before round 1: input shape, declared class count, largest
    label and per-class counts of its splits. Nothing is trained, no model is built."""
    own = str(w.context.node_config.get(DATA_PATH, "")).strip()
    declared = 0
    if own:
        declared = read_labelled(own, DATA_PATH, w.context.node_config.get(NUM_CLASSES)).declared_classes or 0
    w.metrics[DESCRIBE_SHAPE] = [int(d) for d in w.fed.input_shape]
    w.metrics[DESCRIBE_CLASSES] = int(declared)
    w.metrics[DESCRIBE_MAX_LABEL] = max([-1, *(int(t.max()) for t in (w.data.train_y, w.data.test_y) if t.numel())])
    w.metrics[DESCRIBE_TRAIN] = [int(v) for v in w.fed.train_counts[w.client_id]]
    w.metrics[DESCRIBE_EVAL] = [int(v) for v in w.fed.test_counts[w.client_id]]


@client_op("evaluate", default_tag="eval")
def evaluate(w: Worker, tag: str) -> None:
    """The private model (as the message's arrays left it) on the evaluation split."""
    w.evaluate(w.model, tag)


@client_op("evaluate-received", default_tag="received")
def evaluate_received(w: Worker, tag: str) -> None:
    """The model sent for evaluation only (record ``eval-arrays``; architecture ``received.model``, default the
    client's own) on the evaluation split; the private model is untouched."""
    if protocol.EVAL_ARRAYS not in w.msg.content:
        raise ProtocolError("evaluate-received needs a model in the message's 'eval-arrays' record")
    arch = w.request.evaluation.received_model or w.arch
    with w.clock.phase("decoding"):
        state = received_state(w.msg.content.array_records[protocol.EVAL_ARRAYS])
    with w.clock.phase("model"):
        scratch = build_model(arch, w.fed.num_classes, w.fed.input_shape).to(w.device)
        load_arrays(scratch, state, strict=True)
    w.evaluate(scratch, tag)


@client_op("train")
def train(w: Worker, tag: str) -> None:
    """CE on the local data (+ registered training terms). Settings: ``train.*``, overridden for a tagged op
    ``train:<tag>`` by ``train:<tag>.*``; ``freeze`` (head | body) keeps one part of the model fixed."""
    training = w.request.training
    section = training.section(protocol.train_section(tag)).over(training.section(protocol.TRAIN))
    settings = optim_settings(section, w.request.setup.client)
    with ops.frozen(w.model, part_names(w.model, section.freeze or "none")):
        result = ops.train(w.model, w.train_x, w.train_y, settings, w.training_terms(section), w.generator)
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]


@client_op("distill")
def distill(w: Worker, tag: str) -> None:
    """Fit the private model on U (or the rows in ``distill-indices``) towards the message's targets.
    Settings ``distill.*``: optimiser, ``loss`` (kl | mae | ce), ``weighting`` (none or a registered one), and
    those of the registered distillation terms (:func:`fedapps.client.registry.distill_term`)."""
    if w.targets.values is None:
        return  # nothing to distil on yet (e.g. the first round)
    if w.fed.public_x is None:
        raise ProtocolError("distill needs a public set U: set data.public_fraction > 0")
    section = w.request.training.section(protocol.DISTILL)
    rows = public_rows(w.targets.distill_rows)
    result = distill_towards(
        w.model,
        w.fed.public_x if rows is None else w.fed.public_x[rows],
        w.targets.values,
        w.fed.num_classes,
        optim_settings(section, w.request.setup.client),
        section.loss or "kl",
        lambda targets: distill_weights(w, section.weighting or "none", targets, rows),
        w.generator,
        w.distill_terms(section),
    )
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]


def distill_towards(
    model: nn.Module,
    x: torch.Tensor,
    wire_targets: np.ndarray,
    num_classes: int,
    settings: ops.OptimSettings,
    loss: str,
    weights_of: Callable[[np.ndarray], torch.Tensor | None],
    generator: torch.Generator | None,
    term: ops.DistillTerm | None,
    optimizer: ops.OptimizerFactory | None = None,
) -> dict[str, float]:
    """``distill``'s fit of the model on U's rows ``x`` towards the server's targets as they came on the wire
    (:mod:`fedapps.wire.pseudolabels`): hard labels one-hot unless the loss is ``ce``, the abstain marker weighted 0;
    ``weights_of(decoded targets)``: the per-sample weights (None: none). The generic client's operation and the
    drop-in client helpers (:mod:`strategies.pseudolabel_dropin`) both fit through here."""
    targets = pseudolabels.decode(wire_targets, num_classes)
    if len(targets) != len(x):
        raise ProtocolError(f"targets cover {len(targets)} samples but U (subset) has {len(x)}")
    hard = targets.ndim == 1
    if hard and loss != "ce":
        targets, hard = pseudolabels.one_hot(targets, num_classes), False
    weights = weights_of(targets)
    if hard:
        abstain = targets >= num_classes
        if abstain.any():
            keep = torch.as_tensor(~abstain)
            weights = keep.float() if weights is None else weights * keep.float()
            targets = np.where(abstain, 0, targets)
    return ops.distill(
        model,
        x,
        torch.as_tensor(targets),
        settings,
        ops.DistillSettings(loss=loss),
        sample_weights=weights,
        generator=generator,
        term=term,
        optimizer=optimizer,
    )


def public_rows(rows: np.ndarray | None) -> torch.Tensor | None:
    """Row indices of U from the targets record (e.g. an alignment subset) as a tensor, or None = all of U."""
    return None if rows is None else torch.as_tensor(rows.astype(np.int64))


def distill_weights(w: Worker, weighting: str, targets: np.ndarray, rows: torch.Tensor | None) -> torch.Tensor | None:
    """Per-sample weights on U: 'none' (None), or a weighting registered with :func:`registry.distill_weighting`."""
    if weighting == "none":
        return None
    if weighting not in DISTILL_WEIGHTINGS:
        raise ProtocolError(
            f"unknown distill.weighting '{weighting}'; allowed: none, {', '.join(sorted(DISTILL_WEIGHTINGS))}"
        )
    return DISTILL_WEIGHTINGS[weighting](w, targets, rows)


@client_op("predict")
def predict(w: Worker, tag: str) -> None:
    """Encoded predictions of the private model on U (or ``predict-indices``): ``predict.output``, ``.encoding``."""
    if w.fed.public_x is None:
        raise ProtocolError("predict needs a public set U: set data.public_fraction > 0")
    rows = public_rows(w.targets.predict_rows)
    x = w.fed.public_x if rows is None else w.fed.public_x[rows]
    output, encoding = w.request.public.predict_output, w.request.public.predict_encoding
    values = ops.predict(w.model, x, output="logits" if output == "logits" else "probs").numpy()
    w.reply.predictions = pseudolabels.encode(values, encoding, w.fed.num_classes)


def handle(msg: Message, context: Context) -> Message:
    """Serve one message (the ClientApp's handlers call this)."""
    return Worker(msg, context).run()
