"""What the server's check of one client reply costs (fedapps.wire.validation), at the largest reply it accepts and at a
metric flood it refuses.

The worst accepted reply answers a message asking for everything at once: a model's full state (``--model``, default
ResNet-18, 100 classes, 32×32×3), predictions on ``--public`` rows of U (float32 probabilities), an evaluation, and
beside them metrics and info at every limit of the reply's budget (:func:`fedapps.wire.validation.reply_budget`):
MAX_METRICS metrics of which METRIC_LISTS are lists of the longest length allowed (``--clients``, the classes: at least
4,096) and 16 info entries of 1,024 characters. Its check reads every value: timed over ``--repeat`` checks, the median
reported (``worst_accepted_s``; the target is 1 s on the machine's cores, one thread).

The flood is the reply of a client that fills every count and length limit with lists: 1,018 lists of 4,096 floats
beside its 6 own metrics (1,024 metrics, 4,169,734 values). ``flood_refused_ms``: the time the validator takes to refuse
it (its budget, on lengths alone); ``flood_values_s``: what checking its values would take (the per-value check alone,
:func:`fedapps.wire.validation.check_metrics`, called directly: the cost the budget spares the server, once per such
reply). Flower's own (de)serialisation of a reply happens before the validator sees it and is not counted.
The LAST line printed is ``worst_accepted_s=<s> flood_refused_ms=<ms> flood_values_s=<s> target_s=1``.

    python bench/reply_cost.py
    python bench/reply_cost.py --model mlp --classes 10 --public 500 --repeat 3   # a quick look
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fedapps.flower.inprocess import InProcessGrid  # noqa: E402
from fedapps.models import build_model  # noqa: E402
from fedapps.wire import protocol, validation  # noqa: E402
from fedapps_tools.benchrecord import record  # noqa: E402

TARGET_S = 1.0
FINGERPRINT = "bench"


def model_state(name: str, classes: int, shape: tuple[int, int, int]) -> dict[str, np.ndarray]:
    model = build_model(name, classes, shape, seed=0)
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def the_request(public: int) -> protocol.Draft:
    """A round message asking for the model's state, predictions on U (probabilities, float32) and an evaluation."""
    settings = {
        "ops": ["train", "evaluate", "predict"],
        "round": 1,
        "return-arrays": True,
        "predict.output": "probs",
        "predict.encoding": "float32",
        "public.fingerprint": FINGERPRINT,
    }
    return protocol.Draft(100, protocol.Request.decode(settings))


def base_metrics() -> dict:
    return {"client-id": 0, "num-examples": 500, "eval-acc": 0.5, "eval-loss": 1.0, "eval-n": 100, "eval-correct": 50}


def worst_reply(to: Message, state: dict[str, np.ndarray], public: int, classes: int, max_list: int) -> Message:
    """The largest reply the budget accepts: every limit met."""
    metrics = base_metrics()
    rng = np.random.default_rng(0)
    for i in range(validation.METRIC_LISTS):
        metrics[f"list-{i}"] = rng.random(max_list).tolist()
    for i in range(validation.MAX_METRICS - len(metrics)):
        metrics[f"scalar-{i}"] = float(i)
    probs = rng.random((public, classes)).astype(np.float32)
    probs /= probs.sum(axis=1, keepdims=True)
    info = {"fingerprint": FINGERPRINT, **{f"note-{i}": "x" * validation.INFO_MAX_SIZE for i in range(15)}}
    content = RecordDict(
        {
            "metrics": MetricRecord(metrics),
            "arrays": protocol.arrays_record(state),
            "predictions": protocol.arrays_record({protocol.PREDICTION_ARRAY: probs}),
            "info": ConfigRecord(info),
        }
    )
    return Message(content, reply_to=to)


def flood_reply(to: Message) -> Message:
    metrics = base_metrics()
    metrics.update({f"flood-{i}": [0.5] * 4096 for i in range(validation.MAX_METRICS - len(metrics))})
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=to)


def timed(
    v: validation.ReplyValidator, to: protocol.Draft, reply: Message, repeat: int
) -> tuple[float, validation.Outcome]:
    seconds, out = [], validation.Outcome()
    for _ in range(repeat):
        v.expect([to])
        t0 = time.perf_counter()
        out = v.check(1, [reply])
        seconds.append(time.perf_counter() - t0)
        v.node_client.clear()
        v.client_node.clear()
    return statistics.median(seconds), out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--public", type=int, default=5000, help="rows of U the predictions cover")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    InProcessGrid(1)  # Message() outside Flower's runtime needs a task identity; the in-process engine sets one
    shape = (1, 8, 8) if args.model == "mlp" else (3, 32, 32)
    state = model_state(args.model, args.classes, shape)
    v = validation.ReplyValidator(
        args.clients,
        train_sizes=[500] * args.clients,
        test_sizes=[100] * args.clients,
        model_part=lambda part: state,
        public_size=args.public,
        num_classes=args.classes,
    )
    to = the_request(args.public)
    sent = to.message()
    worst = worst_reply(sent, state, args.public, args.classes, v.max_list)
    worst_s, out = timed(v, to, worst, args.repeat)
    if not out.accepted:
        raise SystemExit(f"the worst reply the budget allows was rejected: {out.rejections[0].reason}")
    params = sum(a.size for a in state.values())
    values = sum(len(x) if isinstance(x, list) else 1 for x in dict(worst.content["metrics"]).values())
    print(
        f"worst accepted reply: {args.model} state ({params:,} values), predictions {args.public}×{args.classes}, "
        f"{values:,} metric values, info at its limits: {worst_s:.3f} s (median of {args.repeat})"
    )
    flood = flood_reply(sent)
    refused_s, out = timed(v, to, flood, args.repeat)
    if out.accepted:
        raise SystemExit("the flood was accepted")
    print(f"flood refused in {refused_s * 1e3:.2f} ms: {out.rejections[0].reason}")
    metrics = dict(flood.content["metrics"])
    t0 = time.perf_counter()
    validation.check_metrics(metrics, max_list=v.max_list)  # what reading its values would cost
    values_s = time.perf_counter() - t0
    print(f"checking the flood's values instead: {values_s:.2f} s")
    print(
        f"worst_accepted_s={worst_s:.4f} flood_refused_ms={refused_s * 1e3:.3f} flood_values_s={values_s:.3f} "
        f"target_s={TARGET_S:g}"
    )
    record(
        "reply_cost",
        {
            "worst_accepted_s": round(worst_s, 4),
            "flood_refused_ms": round(refused_s * 1e3, 3),
            "flood_values_s": round(values_s, 3),
            "model": args.model,
        },
    )


if __name__ == "__main__":
    main()
