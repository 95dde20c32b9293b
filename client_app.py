"""Flower ClientApp: a generic worker (fedapps.worker) that runs the operations each message asks for.

Importing ``strategies`` registers every algorithm's own client operations, training terms and weightings
(:mod:`fedapps.clientops`); the worker knows none of them by name.
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import strategies  # noqa: F401  (registers the algorithms' client behaviour)
from fedapps.faults import faults_mod
from fedapps.worker import handle

# faults_mod is a no-op unless the node config 'faults' or the env FEDAPPS_FAULTS asks for fault injection (tests)
app = ClientApp(mods=[faults_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """A round message: e.g. evaluate → train → send the model, or distill → train → predict."""
    return handle(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """An evaluation-only message (e.g. a cluster model evaluated on the local test split)."""
    return handle(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """A question about the node, no training: ``describe`` (data.source 'nodes', before round 1)."""
    return handle(msg, context)
