"""The generic client: runs the operations a message asks for on its private data and private model.

No algorithm logic lives here: the server says which operations to run, in which order, with which
settings (see :mod:`fedapps.protocol`). The private model persists in ``Context.state`` between rounds.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn

from fedapps import ops, protocol, pseudolabels
from fedapps.data import ClientData, Federation, get_federation
from fedapps.models import STATE_PARTS, build_model, classifier_name, state_part

log = logging.getLogger("fedapps")

STATE_MODEL = "private-model"
STATE_ARCH = "private-model-arch"
DATA_KEYS_INT = ("num_clients", "classes_per_client", "min_samples", "groups", "seed", "synthetic_classes", "synthetic_samples")


class ProtocolError(RuntimeError):
    """The message cannot be served (wrong public set, unknown operation, incompatible arrays)."""


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
    """Several models in one record, keys 'm<k>.<name>' (IFCA's cluster models) -> one state dict per k."""
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


def frequency_weights(class_counts: np.ndarray, labels: np.ndarray) -> torch.Tensor:
    """Per-sample weight = the client's local frequency of each sample's (pseudo-)label (COSMOS w_i(x))."""
    freq = class_counts / max(class_counts.sum(), 1)
    freq = np.append(freq, 0.0)  # abstain marker -> weight 0
    return torch.as_tensor(freq[np.clip(labels, 0, len(freq) - 1)], dtype=torch.float32)


class Worker:
    """Serves one message for one client: parse, run operations, reply."""

    def __init__(self, msg: Message, context: Context) -> None:
        set_threads_once()
        self.msg = msg
        self.context = context
        self.config = dict(msg.content[protocol.CONFIG])
        self.client_id = client_id_of(context)
        self.fed = get_federation(data_spec(self.config))
        self.data: ClientData = self.fed.client(self.client_id)
        # a held-out share of the training split (FedFomo scores other models on it); training uses the rest
        self.train_x, self.train_y = self.data.train_x, self.data.train_y
        self.val_x, self.val_y = self.data.train_x[:0], self.data.train_y[:0]
        holdout = float(self.config.get("holdout-fraction", 0.0))
        if holdout:
            fit, held_out = holdout_split(len(self.data.train_y), holdout, int(self.config.get("data.seed", 0)) * 7919 + self.client_id)
            self.train_x, self.train_y = self.data.train_x[fit], self.data.train_y[fit]
            self.val_x, self.val_y = self.data.train_x[held_out], self.data.train_y[held_out]
        self.device = ops.resolve_device(str(self.config.get("client.device", "auto")))
        self.model, self.arch = private_model(context, self.config, self.fed, self.client_id, self.device)
        self.metrics: dict[str, Any] = {"client-id": self.client_id, "num-examples": len(self.data.train_y)}
        self.reply = RecordDict()
        self.trained_copy: nn.Module | None = None  # the received model after 'train-received' (Ditto's global branch)
        rnd = int(self.config.get("round", 0))
        seed = int(self.config.get("model.seed", 0))
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rnd * 10_007 + self.client_id)

    # ------------------------------------------------------------------ entry point
    def run(self) -> Message:
        """Run every operation in the message, save the private model, and build the reply."""
        t0 = time.perf_counter()
        self._check_public_set()
        if self.received is not None and self.config.get("load-arrays", False):
            load_arrays(self.model, self.received, strict=False)
        for op in self.config["ops"]:
            base, tag = protocol.op_name(str(op))
            start = time.perf_counter()
            getattr(self, "op_" + base.replace("-", "_"))(tag)
            self.metrics[f"t-{tag}"] = time.perf_counter() - start
        if self.config.get("return-arrays", False):
            returned = self.trained_copy if self.config.get("arrays.from", "private") == "received" else self.model
            if returned is None:
                raise ProtocolError("arrays.from 'received' needs the 'train-received' operation in the message")
            self.reply[protocol.ARRAYS] = model_arrays(returned, str(self.config.get("arrays.keys", "state")))
        if self.config.get("return-class-counts", False):
            self.metrics["class-counts"] = [int(v) for v in self.fed.train_counts[self.client_id]]
        if self.config.get("persist-model", True):
            # the private model lives in Context.state between rounds; strategies that send the whole model
            # every round (FedAvg) switch this off, which halves what travels with each message in simulation
            self.context.state[STATE_MODEL] = model_arrays(self.model.cpu(), "state")
            self.context.state[STATE_ARCH] = ConfigRecord({"arch": self.arch})
        self.metrics["t-total"] = time.perf_counter() - t0
        self.reply[protocol.METRICS] = protocol.metrics_record(self.metrics)
        self.reply[protocol.INFO] = ConfigRecord({"arch": self.arch, "fingerprint": self.fed.fingerprint})
        return Message(content=self.reply, reply_to=self.msg)

    @functools.cached_property
    def received(self) -> dict[str, torch.Tensor] | None:
        """The message's model arrays as tensors, decoded once on first use: loaded into the model
        (``load-arrays``), the anchor of a proximal term (FedAMP's u_i, Ditto's global model), or a model
        evaluated or trained apart. None without arrays, or when they hold several models (``arrays.multi``)."""
        if protocol.ARRAYS not in self.msg.content or self.config.get("arrays.multi", False):
            return None
        return self.msg.content[protocol.ARRAYS].to_torch_state_dict()

    def _check_public_set(self) -> None:
        expected = self.config.get("public.fingerprint")
        if expected is not None and expected != self.fed.fingerprint:
            raise ProtocolError(
                f"public set mismatch: the server's U has fingerprint '{expected}', this client's has "
                f"'{self.fed.fingerprint}'. Both sides must build U from the same data spec (data.* keys)."
            )

    def _public_rows(self, key: str) -> torch.Tensor | None:
        """Row indices of U named in the targets record (e.g. FedMD's alignment subset), or None = all."""
        if protocol.TARGETS in self.msg.content and key in self.msg.content[protocol.TARGETS]:
            return torch.as_tensor(self.msg.content[protocol.TARGETS][key].numpy().astype(np.int64))
        return None

    # ------------------------------------------------------------------ operations
    def op_evaluate(self, tag: str) -> None:
        self._record_eval(tag, ops.evaluate(self.model, self.data.test_x, self.data.test_y))

    def op_evaluate_received(self, tag: str) -> None:
        arch = str(self.config.get("received.model", self.arch))
        if self.received is None:
            raise ProtocolError("evaluate-received needs model arrays in the message")
        scratch = build_model(arch, self.fed.num_classes, tuple(self.fed.input_shape)).to(self.device)
        load_arrays(scratch, self.received, strict=True)
        self._record_eval(tag, ops.evaluate(scratch, self.data.test_x, self.data.test_y))

    def _record_eval(self, tag: str, result: Mapping[str, float]) -> None:
        for k in ("acc", "loss", "n", "correct"):
            self.metrics[f"{tag}-{k}"] = result[k]

    def op_train(self, tag: str) -> None:
        """CE on the local data (+ regularisers). Settings: ``train.*``, overridden for a tagged op ``train:<tag>``
        by ``train:<tag>.*`` (FedRep's head and body phases); ``freeze`` (head | body) keeps one part fixed."""
        section = {**protocol.section(self.config, "train"), **protocol.section(self.config, f"train:{tag}")}
        settings = optim_settings(section, protocol.section(self.config, "client"))
        with ops.frozen(self.model, part_names(self.model, str(section.get("freeze", "none")))):
            result = ops.train(self.model, self.train_x, self.train_y, settings, self._regulariser(section), self.generator)
        self.metrics[f"{tag}-loss"] = result["loss"]

    def op_evaluate_finetuned(self, tag: str) -> None:
        """Evaluate a copy of the model after training its head alone on the local data (FedBABU's evaluation;
        settings ``finetune.*``); the model itself is left as it was."""
        copy = self._model_from(self.model.state_dict())
        settings = optim_settings(protocol.section(self.config, "finetune"), protocol.section(self.config, "client"))
        with ops.frozen(copy, part_names(copy, "body")):
            ops.train(copy, self.train_x, self.train_y, settings, None, self.generator)
        self._record_eval(tag, ops.evaluate(copy, self.data.test_x, self.data.test_y))

    def op_train_received(self, tag: str) -> None:
        """Train a copy of the received model on the local data, plainly (Ditto's global branch); the private
        model is untouched and the copy is what ``arrays.from: received`` sends back."""
        if self.received is None:
            raise ProtocolError("train-received needs model arrays in the message")
        copy = self._model_from(self.received)
        settings = optim_settings(protocol.section(self.config, "train"), protocol.section(self.config, "client"))
        result = ops.train(copy, self.train_x, self.train_y, settings, None, self.generator)
        self.trained_copy = copy
        self.metrics[f"{tag}-loss"] = result["loss"]

    def _model_from(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A separate model of the client's architecture holding the given (complete) state."""
        model = build_model(self.arch, self.fed.num_classes, tuple(self.fed.input_shape)).to(self.device)
        model.load_state_dict(state, strict=True)
        return model

    def op_select_model(self, tag: str) -> None:
        """IFCA: of the K models in the message, load the one with the lowest loss on the local TRAIN data."""
        candidates = self._candidate_models("select-model")
        losses = self._losses_of(candidates, self.train_x, self.train_y)
        best = int(np.argmin(losses))
        self.model.load_state_dict(candidates[best], strict=True)
        self.metrics[f"{tag}-index"] = best
        self.metrics[f"{tag}-losses"] = [float(v) for v in losses]

    def op_fomo_mix(self, tag: str) -> None:
        """FedFomo: score each of the models in the message on the held-out split against the client's own,
        move the own model towards the helpful ones (:func:`ops.fomo_weights`), report the weights."""
        if len(self.val_y) == 0:
            raise ProtocolError("fomo-mix needs a held-out split: set holdout-fraction > 0 in the message")
        candidates = self._candidate_models("fomo-mix")
        own = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        own_loss = ops.evaluate(self.model, self.val_x, self.val_y)["loss"]
        losses = self._losses_of(candidates, self.val_x, self.val_y)  # leaves the last candidate loaded
        distances = [ops.state_distance(state, own) for state in candidates]
        weights = ops.fomo_weights(own_loss, losses, distances)
        self.model.load_state_dict(ops.mix_towards(own, candidates, weights))
        self.metrics[f"{tag}-weights"] = [float(w) for w in weights]

    def _candidate_models(self, op: str) -> list[dict[str, torch.Tensor]]:
        """The several models of an ``arrays.multi`` message (IFCA's clusters, FedFomo's candidates)."""
        if protocol.ARRAYS not in self.msg.content or not self.config.get("arrays.multi", False):
            raise ProtocolError(f"{op} needs several models in the message (arrays.multi)")
        return split_models(self.msg.content[protocol.ARRAYS])

    def _losses_of(self, states: list[dict[str, torch.Tensor]], x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """Mean cross-entropy of each model state on (x, y), loaded in turn into the client's model."""
        losses = []
        for state in states:
            self.model.load_state_dict(state, strict=True)
            losses.append(ops.evaluate(self.model, x, y)["loss"])
        return losses

    def _regulariser(self, section: Mapping[str, Any]) -> ops.Regulariser | None:
        """The training regularisers a message asks for: WDR (cwFedAvg) and a proximal term to the received arrays."""
        regularisers = []
        wdr = float(section.get("wdr_lambda", 0.0))
        if wdr > 0:
            weight = self.model.get_submodule(classifier_name(self.model)).weight
            counts = torch.as_tensor(self.fed.train_counts[self.client_id], dtype=torch.float32, device=self.device)
            target = counts / counts.sum()
            regularisers.append(lambda m: ops.wdr_penalty(weight, target, wdr))
        mu = float(section.get("prox_mu", 0.0))
        if mu > 0:
            if self.received is None:
                raise ProtocolError("train.prox_mu > 0 needs arrays in the message (the proximal anchor)")
            anchor = {k: v.to(self.device) for k, v in self.received.items()}
            regularisers.append(lambda m: ops.proximal_penalty(m, anchor, mu))
        return (lambda m: sum(r(m) for r in regularisers)) if regularisers else None

    def op_train_public(self, tag: str) -> None:
        """CE on U with its TRUE labels (FedMD's labelled-public pre-training; settings ``train-public.*``)."""
        if self.fed.public_x is None or self.fed.public_y is None:
            raise ProtocolError("train-public needs a labelled public set U (data.public_fraction > 0)")
        settings = optim_settings(protocol.section(self.config, "train-public"), protocol.section(self.config, "client"))
        result = ops.train(self.model, self.fed.public_x, self.fed.public_y, settings, None, self.generator)
        self.metrics[f"{tag}-loss"] = result["loss"]

    def op_distill(self, tag: str) -> None:
        if protocol.TARGETS not in self.msg.content:
            return  # nothing to distil on yet (e.g. the first round)
        if self.fed.public_x is None:
            raise ProtocolError("distill needs a public set U: set data.public_fraction > 0")
        section = protocol.section(self.config, "distill")
        settings = optim_settings(section, protocol.section(self.config, "client"))
        targets = pseudolabels.decode(self.msg.content[protocol.TARGETS]["targets"].numpy(), self.fed.num_classes)
        rows = self._public_rows("distill-indices")
        x = self.fed.public_x if rows is None else self.fed.public_x[rows]
        if len(targets) != len(x):
            raise ProtocolError(f"targets cover {len(targets)} samples but U (subset) has {len(x)}")
        loss = str(section.get("loss", "kl"))
        hard = targets.ndim == 1
        if hard and loss != "ce":
            targets, hard = pseudolabels.one_hot(targets, self.fed.num_classes), False
        weights = self._distill_weights(str(section.get("weighting", "none")), targets, rows)
        if hard:
            abstain = targets >= self.fed.num_classes
            if abstain.any():
                keep = torch.as_tensor(~abstain)
                weights = keep.float() if weights is None else weights * keep.float()
                targets = np.where(abstain, 0, targets)
        t = torch.as_tensor(targets)
        result = ops.distill(
            self.model, x, t, settings,
            ops.DistillSettings(loss=loss, rb_lambda=float(section.get("rb_lambda", 0.0)), rb_sigma=float(section.get("rb_sigma", 0.05))),
            sample_weights=weights, generator=self.generator,
        )
        self.metrics[f"{tag}-loss"] = result["loss"]

    def _distill_weights(self, weighting: str, targets: np.ndarray, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Per-sample weights on U: none, label-free (frequency of the target's argmax), or oracle (true label)."""
        if weighting == "none":
            return None
        counts = self.fed.train_counts[self.client_id]
        if weighting == "label-free":
            labels = targets if targets.ndim == 1 else targets.argmax(axis=-1)
            return frequency_weights(counts, labels)
        if weighting == "oracle":
            if self.fed.public_y is None:
                raise ProtocolError("distill.weighting 'oracle' needs the true labels of U")
            y = self.fed.public_y if rows is None else self.fed.public_y[rows]
            return frequency_weights(counts, y.numpy())
        raise ProtocolError(f"unknown distill.weighting '{weighting}'; allowed: none, label-free, oracle")

    def op_predict(self, tag: str) -> None:
        if self.fed.public_x is None:
            raise ProtocolError("predict needs a public set U: set data.public_fraction > 0")
        section = protocol.section(self.config, "predict")
        rows = self._public_rows("predict-indices")
        x = self.fed.public_x if rows is None else self.fed.public_x[rows]
        output = str(section.get("output", "probs"))
        encoding = str(section.get("encoding", "float32"))
        values = ops.predict(self.model, x, output="logits" if output == "logits" else "probs").numpy()
        wire = pseudolabels.encode(values, encoding, self.fed.num_classes)
        self.reply[protocol.PREDICTIONS] = protocol.arrays_record({"predictions": wire})


def handle(msg: Message, context: Context) -> Message:
    """Serve one message (the ClientApp's handlers call this)."""
    return Worker(msg, context).run()
