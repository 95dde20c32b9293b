"""The generic client: runs the operations a message asks for on its private data and private model.

No algorithm logic lives here: the server says which operations to run, in which order, with which settings
(see :mod:`fedapps.protocol`); each name is looked up in :mod:`fedapps.clientops`, where this module registers
the common operations (evaluate, evaluate-received, train, distill, predict) and every algorithm module
registers its own. The private model persists in ``Context.state`` between rounds; where a state directory is
named (node config ``state-dir``, else the message's ``state-dir``), also on disk, so that it survives the
process (a run resumed from its checkpoint): ``<state-dir>/<client-id>.r<round>.pt``, the newest two rounds.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn

from fedapps import checkpoint, ops, protocol, pseudolabels
from fedapps.seeds import derive_seed
from fedapps.clientops import DISTILL_WEIGHTINGS, TRAINING_TERMS, ProtocolError, client_op, parse_op
from fedapps.data import ClientData, Federation, get_federation
from fedapps.models import STATE_PARTS, build_model, classifier_name, state_part

log = logging.getLogger("fedapps")

STATE_MODEL = "private-model"
STATE_ARCH = "private-model-arch"
__all__ = ["ProtocolError", "Worker", "handle"]  # ProtocolError is defined in fedapps.clientops

@functools.lru_cache(maxsize=1)
def set_threads_once() -> int:
    """Give torch exactly the threads this worker was granted (Ray sets OMP_NUM_THREADS per actor)."""
    n = int(os.environ.get("FEDAPPS_CLIENT_THREADS", os.environ.get("OMP_NUM_THREADS", "0")) or 0)
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def client_id_of(context: Context) -> int:
    """Stable client id: node_config 'client-id' (deployment) or 'partition-id' (simulation)."""
    nc = context.node_config
    for key in ("client-id", "partition-id"):
        if key in nc:
            return int(nc[key])
    raise ProtocolError("node_config has neither 'partition-id' nor 'client-id'; start the SuperNode with "
                        "--node-config \"partition-id=<i> num-partitions=<n>\"")


def data_spec(config: Mapping[str, Any]) -> dict[str, Any]:
    """The data spec the server put in the message (``data.*`` keys)."""
    spec = protocol.section(config, "data")
    spec["synthetic_shape"] = list(spec.get("synthetic_shape", [3, 32, 32]))
    return spec


def model_arch(config: Mapping[str, Any], context: Context, client_id: int) -> str:
    """Architecture of this client's private model: node_config 'arch', else the per-client list, else one name."""
    if "arch" in context.node_config:
        return str(context.node_config["arch"])
    per_client = list(config.get("model.per_client", []))
    return str(per_client[client_id % len(per_client)]) if per_client else str(config["model.name"])


def private_model(context: Context, config: Mapping[str, Any], fed: Federation, client_id: int, device: torch.device) -> tuple[nn.Module, str]:
    """The client's model: restored from Context.state, or built fresh on first contact."""
    if STATE_ARCH in context.state:
        arch = str(context.state[STATE_ARCH]["arch"])
    else:
        arch = model_arch(config, context, client_id)
    seed = int(config.get("model.seed", 0))
    model, initial = model_skeleton(arch, fed.num_classes, tuple(fed.input_shape), seed)
    if STATE_MODEL in context.state:
        model.load_state_dict(context.state[STATE_MODEL].to_torch_state_dict())
    else:
        model.load_state_dict(initial)
    return model.to(device), arch


@functools.lru_cache(maxsize=8)
def model_skeleton(arch: str, num_classes: int, input_shape: tuple[int, int, int], seed: int) -> tuple[nn.Module, dict]:
    """One module object per architecture per process, reused across messages (each message loads a full
    state into it first), and its seeded initial state; building a model per message costs more than loading."""
    model = build_model(arch, num_classes, input_shape, seed=seed)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def load_arrays(model: nn.Module, received: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Load received arrays into the model; keys not sent keep the model's own values (local buffers)."""
    own = model.state_dict()
    unknown = [k for k in received if k not in own]
    mismatched = [k for k in received if k in own and tuple(received[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in received]
    if unknown or mismatched or (strict and missing):
        raise ProtocolError(f"received arrays do not fit the model: unknown={unknown[:3]} "
                            f"shape-mismatch={mismatched[:3]} missing={missing[:3] if strict else []}")
    model.load_state_dict(received, strict=False)


def state_dir(config: Mapping[str, Any], context: Context) -> Path | None:
    """The directory where this client keeps its private model on disk: node config first, then the message."""
    value = context.node_config.get("state-dir", config.get("state-dir", ""))
    return Path(str(value)) if value else None


def state_files(directory: Path, client_id: int) -> dict[int, Path]:
    """Round -> file of this client's saved private models."""
    out: dict[int, Path] = {}
    for path in directory.glob(f"{int(client_id)}.r*.pt"):
        tail = path.name[len(f"{int(client_id)}.r"):-len(".pt")]
        if tail.isdigit():
            out[int(tail)] = path
    return out


def restore_private_state(context: Context, config: Mapping[str, Any], client_id: int) -> None:
    """A process that has not served this client yet (a resumed run): the newest saved private model of an
    EARLIER round of the same run (state-run token) goes into Context.state. A file of the current round is
    skipped: it was written by a round the server never checkpointed and now repeats."""
    directory = state_dir(config, context)
    if directory is None or STATE_MODEL in context.state or not directory.is_dir():
        return
    rnd, token = int(config.get("round", 0)), str(config.get("state-run", ""))
    for saved_round, path in sorted(state_files(directory, client_id).items(), reverse=True):
        if saved_round >= rnd:
            continue
        saved = checkpoint.load(path)
        if saved.get("run") != token:
            return  # another run's file
        context.state[STATE_MODEL] = ArrayRecord({k: v for k, v in saved["state"].items()})
        context.state[STATE_ARCH] = ConfigRecord({"arch": str(saved["arch"])})
        return


def save_private_state(context: Context, config: Mapping[str, Any], client_id: int, model: nn.Module, arch: str) -> None:
    """Write the private model to the state directory (atomically) for this round; keep the newest earlier
    round's file too (the one a resumption from the last checkpoint needs), remove older ones."""
    directory = state_dir(config, context)
    if directory is None:
        return
    rnd = int(config.get("round", 0))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    checkpoint.atomic_save({"run": str(config.get("state-run", "")), "round": rnd, "arch": arch, "state": state},
                           directory / f"{int(client_id)}.r{rnd}.pt")
    earlier = sorted(r for r in state_files(directory, client_id) if r < rnd)
    for r in earlier[:-1]:
        state_files(directory, client_id)[r].unlink(missing_ok=True)


def model_arrays(model: nn.Module, which: str) -> ArrayRecord:
    """The model as an ArrayRecord: 'state', 'params' or 'body' (see :func:`fedapps.models.state_part`)."""
    if which not in STATE_PARTS:
        raise ProtocolError(f"unknown arrays.keys '{which}'; allowed: {', '.join(STATE_PARTS)}")
    return ArrayRecord({k: v.detach().cpu() for k, v in state_part(model, which).items()})


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
    for key, tensor in arrays.to_torch_state_dict().items():
        prefix, _, name = key.partition(".")
        if not (prefix.startswith("m") and prefix[1:].isdigit() and name):
            raise ProtocolError(f"multi-model arrays need keys 'm<k>.<parameter>', got '{key}'")
        models.setdefault(int(prefix[1:]), {})[name] = tensor
    if sorted(models) != list(range(len(models))):
        raise ProtocolError(f"multi-model arrays must number their models 0..K-1, got {sorted(models)}")
    return [models[k] for k in range(len(models))]


def optim_settings(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> ops.OptimSettings:
    """OptimSettings from a message section, falling back to the client section."""
    merged = {**defaults, **values}
    keys = ops.OptimSettings.__dataclass_fields__
    return ops.OptimSettings(**{k: merged[k] for k in keys if k in merged})


class Worker:
    """Serves one message for one client: parse, run the named operations, reply.

    What an operation may use: ``config`` (the message's settings), ``data`` / ``fed`` (this client's data and
    the data spec's federation), ``train_x`` / ``train_y`` (the training split less any held-out share),
    ``val_x`` / ``val_y`` (the held-out share), ``eval_x`` / ``eval_y`` (THE evaluation split: every evaluation
    reads its data there and nowhere else, see :meth:`evaluate`), ``model`` (the private model), ``received``
    (the message's arrays as tensors), ``generator`` (seeded per client and round), ``metrics`` and ``reply``
    (what goes back), and ``outgoing``: the model whose arrays ``return-arrays`` sends (default: the private model).
    """

    def __init__(self, msg: Message, context: Context) -> None:
        set_threads_once()
        self.msg = msg
        self.context = context
        self.config = dict(msg.content[protocol.CONFIG])
        self.client_id = client_id_of(context)
        self.fed = get_federation(data_spec(self.config))
        self.data: ClientData = self.fed.client(self.client_id)
        # a held-out share of the training split (scored on by operations that need one); training uses the rest
        self.train_x, self.train_y = self.data.train_x, self.data.train_y
        self.val_x, self.val_y = self.data.train_x[:0], self.data.train_y[:0]
        holdout = float(self.config.get("holdout-fraction", 0.0))
        if holdout:
            fit, held_out = holdout_split(len(self.data.train_y), holdout,
                                           derive_seed(int(self.config.get("data.seed", 0)), "holdout", self.client_id))
            self.train_x, self.train_y = self.data.train_x[fit], self.data.train_y[fit]
            self.val_x, self.val_y = self.data.train_x[held_out], self.data.train_y[held_out]
        self.device = ops.resolve_device(str(self.config.get("client.device", "auto")))
        if self.config.get("persist-model", True):
            restore_private_state(context, self.config, self.client_id)
        self.model, self.arch = private_model(context, self.config, self.fed, self.client_id, self.device)
        self.outgoing: nn.Module | None = None  # set by an operation that returns another model than the private one
        self.metrics: dict[str, Any] = {protocol.CLIENT_ID: self.client_id, protocol.NUM_EXAMPLES: len(self.data.train_y)}
        self.reply = RecordDict()
        rnd = int(self.config.get("round", 0))
        seed = int(self.config.get("model.seed", 0))
        self.generator = torch.Generator().manual_seed(derive_seed(seed, "client-batches", rnd, self.client_id))
        # ops that draw from torch's global RNG (dropout) see a stream fixed by (seed, round, client) too
        torch.manual_seed(derive_seed(seed, "client-global", rnd, self.client_id))

    # ------------------------------------------------------------------ entry point
    def run(self) -> Message:
        """Run every operation in the message, save the private model, and build the reply."""
        t0 = time.perf_counter()
        self._check_public_set()
        steps = [parse_op(op) for op in self.config["ops"]]  # refuse an unknown operation before running any
        if self.received is not None and self.config.get("load-arrays", False):
            load_arrays(self.model, self.received, strict=False)
        for op, tag in steps:
            start = time.perf_counter()
            op.run(self, tag)
            self.metrics[f"t-{tag}"] = time.perf_counter() - start
        if self.config.get("return-arrays", False):
            returned = self.outgoing if self.outgoing is not None else self.model
            self.reply[protocol.ARRAYS] = model_arrays(returned, str(self.config.get("arrays.keys", "state")))
        if self.config.get("persist-model", True) and self.config.get("save-model", True):
            # the private model lives in Context.state between rounds; strategies that send the whole model
            # every round switch this off, which halves what travels with each message in simulation. An
            # evaluation-only message reads the private model (persist-model) but never writes it (save-model false)
            self.context.state[STATE_MODEL] = model_arrays(self.model.cpu(), "state")
            self.context.state[STATE_ARCH] = ConfigRecord({"arch": self.arch})
            save_private_state(self.context, self.config, self.client_id, self.model, self.arch)
        self.metrics["t-total"] = time.perf_counter() - t0
        self.reply[protocol.METRICS] = protocol.metrics_record(self.metrics)
        self.reply[protocol.INFO] = ConfigRecord({"arch": self.arch, "fingerprint": self.fed.fingerprint})
        return Message(content=self.reply, reply_to=self.msg)

    @functools.cached_property
    def received(self) -> dict[str, torch.Tensor] | None:
        """The message's model arrays as tensors, decoded once on first use: loaded into the model
        (``load-arrays``), the anchor of a training term, or a model evaluated or trained apart. None without
        arrays, or when they hold several models (``arrays.multi``, see :meth:`candidate_models`)."""
        if protocol.ARRAYS not in self.msg.content or self.config.get("arrays.multi", False):
            return None
        return self.msg.content[protocol.ARRAYS].to_torch_state_dict()

    def candidate_models(self, op: str) -> list[dict[str, torch.Tensor]]:
        """The several models of an ``arrays.multi`` message, as state dicts in the order the server packed them."""
        if protocol.ARRAYS not in self.msg.content or not self.config.get("arrays.multi", False):
            raise ProtocolError(f"{op} needs several models in the message (arrays.multi)")
        return split_models(self.msg.content[protocol.ARRAYS])

    def model_from(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A separate model of the client's architecture holding the given (complete) state."""
        model = build_model(self.arch, self.fed.num_classes, tuple(self.fed.input_shape)).to(self.device)
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
        return optim_settings(protocol.section(self.config, section_name), protocol.section(self.config, "client"))

    def record_eval(self, tag: str, result: Mapping[str, float]) -> None:
        """Evaluation results as the metrics ``<tag>-acc``, ``<tag>-loss``, ``<tag>-n``, ``<tag>-correct``."""
        for k in protocol.EVAL_FIELDS:
            self.metrics[protocol.metric_name(tag, k)] = result[k]

    def public_rows(self, key: str) -> torch.Tensor | None:
        """Row indices of U named in the targets record (e.g. an alignment subset), or None = all of U."""
        if protocol.TARGETS in self.msg.content and key in self.msg.content[protocol.TARGETS]:
            return torch.as_tensor(self.msg.content[protocol.TARGETS][key].numpy().astype(np.int64))
        return None

    def training_terms(self, section: Mapping[str, Any]) -> ops.Regulariser | None:
        """The sum of every registered training term that the ``train.*`` settings switch on (None: none is)."""
        terms = [t for t in (build(self, dict(section)) for build in TRAINING_TERMS.values()) if t is not None]
        return (lambda m: sum(t(m) for t in terms)) if terms else None

    def _check_public_set(self) -> None:
        expected = self.config.get("public.fingerprint")
        if expected is not None and expected != self.fed.fingerprint:
            raise ProtocolError(
                f"public set mismatch: the server's U has fingerprint '{expected}', this client's has "
                f"'{self.fed.fingerprint}'. Both sides must build U from the same data spec (data.* keys)."
            )


# ---------------------------------------------------------------------- the common operations


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
    arch = str(w.config.get("received.model", w.arch))
    scratch = build_model(arch, w.fed.num_classes, tuple(w.fed.input_shape)).to(w.device)
    load_arrays(scratch, w.msg.content[protocol.EVAL_ARRAYS].to_torch_state_dict(), strict=True)
    w.evaluate(scratch, tag)


@client_op("train")
def train(w: Worker, tag: str) -> None:
    """CE on the local data (+ registered training terms). Settings: ``train.*``, overridden for a tagged op
    ``train:<tag>`` by ``train:<tag>.*``; ``freeze`` (head | body) keeps one part of the model fixed."""
    section = {**protocol.section(w.config, "train"), **protocol.section(w.config, f"train:{tag}")}
    settings = optim_settings(section, protocol.section(w.config, "client"))
    with ops.frozen(w.model, part_names(w.model, str(section.get("freeze", "none")))):
        result = ops.train(w.model, w.train_x, w.train_y, settings, w.training_terms(section), w.generator)
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]


@client_op("distill")
def distill(w: Worker, tag: str) -> None:
    """Fit the private model on U (or the rows in ``distill-indices``) towards the message's targets.
    Settings ``distill.*``: optimiser, ``loss`` (kl | mae | ce), ``weighting`` (none or a registered one), r_B."""
    if protocol.TARGETS not in w.msg.content:
        return  # nothing to distil on yet (e.g. the first round)
    if w.fed.public_x is None:
        raise ProtocolError("distill needs a public set U: set data.public_fraction > 0")
    section = protocol.section(w.config, "distill")
    settings = optim_settings(section, protocol.section(w.config, "client"))
    targets = pseudolabels.decode(w.msg.content[protocol.TARGETS]["targets"].numpy(), w.fed.num_classes)
    rows = w.public_rows("distill-indices")
    x = w.fed.public_x if rows is None else w.fed.public_x[rows]
    if len(targets) != len(x):
        raise ProtocolError(f"targets cover {len(targets)} samples but U (subset) has {len(x)}")
    loss = str(section.get("loss", "kl"))
    hard = targets.ndim == 1
    if hard and loss != "ce":
        targets, hard = pseudolabels.one_hot(targets, w.fed.num_classes), False
    weights = distill_weights(w, str(section.get("weighting", "none")), targets, rows)
    if hard:
        abstain = targets >= w.fed.num_classes
        if abstain.any():
            keep = torch.as_tensor(~abstain)
            weights = keep.float() if weights is None else weights * keep.float()
            targets = np.where(abstain, 0, targets)
    result = ops.distill(
        w.model, x, torch.as_tensor(targets), settings,
        ops.DistillSettings(loss=loss, rb_lambda=float(section.get("rb_lambda", 0.0)), rb_sigma=float(section.get("rb_sigma", 0.05))),
        sample_weights=weights, generator=w.generator,
    )
    w.metrics[protocol.metric_name(tag, "loss")] = result["loss"]


def distill_weights(w: Worker, weighting: str, targets: np.ndarray, rows: torch.Tensor | None) -> torch.Tensor | None:
    """Per-sample weights on U: 'none' (None), or a weighting registered with :func:`clientops.distill_weighting`."""
    if weighting == "none":
        return None
    if weighting not in DISTILL_WEIGHTINGS:
        raise ProtocolError(f"unknown distill.weighting '{weighting}'; allowed: none, {', '.join(sorted(DISTILL_WEIGHTINGS))}")
    return DISTILL_WEIGHTINGS[weighting](w, targets, rows)


@client_op("predict")
def predict(w: Worker, tag: str) -> None:
    """Encoded predictions of the private model on U (or ``predict-indices``): ``predict.output``, ``.encoding``."""
    if w.fed.public_x is None:
        raise ProtocolError("predict needs a public set U: set data.public_fraction > 0")
    section = protocol.section(w.config, "predict")
    rows = w.public_rows("predict-indices")
    x = w.fed.public_x if rows is None else w.fed.public_x[rows]
    output = str(section.get("output", "probs"))
    encoding = str(section.get("encoding", "float32"))
    values = ops.predict(w.model, x, output="logits" if output == "logits" else "probs").numpy()
    wire = pseudolabels.encode(values, encoding, w.fed.num_classes)
    w.reply[protocol.PREDICTIONS] = protocol.arrays_record({"predictions": wire})


def handle(msg: Message, context: Context) -> Message:
    """Serve one message (the ClientApp's handlers call this)."""
    return Worker(msg, context).run()
