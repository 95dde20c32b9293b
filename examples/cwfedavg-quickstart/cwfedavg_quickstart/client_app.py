"""cwfedavg-quickstart: a Flower ClientApp, as in Flower's quickstart-pytorch (nothing in it is fedapps')."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from cwfedavg_quickstart.task import Net, load_data
from cwfedavg_quickstart.task import test as test_fn
from cwfedavg_quickstart.task import train as train_fn

app = ClientApp()
torch.set_num_threads(1)


def data(context: Context):
    cfg = context.run_config
    node = context.node_config
    return load_data(node["partition-id"], node["num-partitions"], cfg["batch-size"], cfg["classes-per-client"])


@app.train()
def train(msg: Message, context: Context):
    """Train the model it was sent on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = data(context)
    train_loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"], "cpu")
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    if context.run_config["send-class-counts"]:  # the one line that lets cwFedAvg skip estimating them
        metrics["class-counts"] = torch.bincount(trainloader.dataset.tensors[1], minlength=10).tolist()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model it was sent on local test data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = data(context)
    eval_loss, eval_acc = test_fn(model, testloader, "cpu")
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(testloader.dataset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
