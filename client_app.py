"""Flower ClientApp: a generic worker (fedapps.client.worker) that runs the operations each message asks for.

Importing ``strategies`` registers every algorithm's own client operations, training terms and weightings
(:mod:`fedapps.client.registry`); the worker knows none of them by name. Both are imported on the first message, not
when
this module loads: Flower's simulation loads the ClientApp in its main thread BEFORE it starts Ray, so a module that
imports only Flower lets Ray's processes boot while the ServerApp thread imports torch (docs/performance.md).
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedapps.flower import message_sweep

# Flower's simulation loads this module in the process that then starts its message sweep: make the sweep one pass
# over the stored messages instead of one per node (fedapps/flower/message_sweep.py; a no-op in Ray workers and
# SuperNodes).
message_sweep.install()


def serve(msg: Message, context: Context) -> Message:
    """Serve one message with the generic worker (the algorithms' client behaviour registered first)."""
    from fedapps.importpath import check_own_modules

    check_own_modules()  # a user's module named like ours (strategies) is said so, before it is imported instead
    import strategies  # registers the algorithms' client behaviour (fedapps.client.registry)
    from fedapps.client.worker import handle

    del strategies  # imported for its registrations only
    return handle(msg, context)


def faults(msg: Message, context: Context, call_next):
    """fedapps.flower.faults.faults_mod: a no-op unless the node config 'faults' or the env FEDAPPS_FAULTS asks for
    fault
    injection (tests)."""
    from fedapps.flower.faults import faults_mod

    return faults_mod(msg, context, call_next)


app = ClientApp(mods=[faults])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """A round message: e.g. evaluate → train → send the model, or distill → train → predict."""
    return serve(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """An evaluation-only message (e.g. a cluster model evaluated on the local test split)."""
    return serve(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """A question about the node, no training: ``describe`` (data.source 'nodes', before round 1)."""
    return serve(msg, context)
