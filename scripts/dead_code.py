"""Dead code, found by vulture (`make deadcode`): every function, class, method, attribute and variable of the
project's modules (fedapps/, strategies/, fedapps_tools/, the apps, scripts/ and bench/) that nothing in them names.
The tests do not count: a function only a test calls is dead in the product (its test goes with it, or the product
uses it).

Not dead, though nothing names them: the strategies the registry finds by subclassing (strategies.STRATEGIES, read
here), what the client registries' decorators register (found by name in a message), and the names below, each
called or read by a framework or kept as a record's field. Exit status 1 when anything else is found.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vulture import Vulture

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["fedapps", "strategies", "fedapps_tools", "server_app.py", "client_app.py", "scripts", "bench"]
REGISTRY_DECORATORS = ["@client_op", "@training_term", "@distill_term", "@distill_weighting", "@app.main"]
CALLED_ELSEWHERE = {
    "forward": "torch (nn.Module.__call__)",
    "reducer_override": "pickle (checkpoint.ArrayPickler)",
    "configure_train": "Flower's Strategy.start (the drop-in strategies)",
    "aggregate_train": "Flower's Strategy.start",
    "configure_evaluate": "Flower's Strategy.start",
    "aggregate_evaluate": "Flower's Strategy.start",
    "checkpoint_exclude": "read from every class of the MRO (PersonalisedStrategy._checkpoint_excluded)",
    "grad_sample": "Opacus reads it (fedapps/client/privacy.py)",
    "pull_interval": "Flower's simulation reads it (fedapps/flower/message_sweep.py)",
    "maxpool": "torchvision's ResNet.forward reads it (fedapps/models/vision.py)",
    "mtime_ns": "a cache key: a changed file is read again (fedapps/data/nodes.py)",
    "personalised_arrays": "public API of the drop-in strategies (docs/flower-apps.md)",
    "strategy_name": "a field of checkpoint.pt (fedapps/server/experiment.CheckpointPayload)",
    "swap_pairs": "a field of the data config (data.swap_pairs)",
    "test_indices": "a field of a client's data (read by the data tools)",
    "public_indices": "a field of a client's data",
    "option_string": "argparse.Action.__call__'s signature",
    "frame": "a signal handler's signature",
    "decoding": "a field of the reply's profile record (fedapps/wire/reply.MessageProfile), written by the worker",
}


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from strategies import STRATEGIES  # the registry: classes found by subclassing

    registered = {cls.__name__ for cls in STRATEGIES.values()}
    v = Vulture(ignore_names=sorted(CALLED_ELSEWHERE), ignore_decorators=REGISTRY_DECORATORS)
    v.scavenge([str(ROOT / p) for p in PATHS])
    found = [
        item for item in v.get_unused_code(min_confidence=60) if not (item.typ == "class" and item.name in registered)
    ]
    for item in found:
        print(item.get_report(add_size=False).replace(str(ROOT) + "/", ""))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
