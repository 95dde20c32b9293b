"""Flower ClientApp: a generic worker. It runs the operations each message asks for (see fedapps.worker)."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedapps.worker import handle

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """A round message: e.g. evaluate → train → send the model, or distill → train → predict."""
    return handle(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """An evaluation-only message (e.g. a COSMOS cluster model evaluated on the local test split)."""
    return handle(msg, context)
