"""The ClientApp, as Flower's quickstart-pytorch writes it."""

from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quickstart_twin.task import Net, load_data
from quickstart_twin.task import test as test_fn
from quickstart_twin.task import train as train_fn

app = ClientApp()
torch.set_num_threads(1)


def dump_dir(msg: Message, context: Context) -> Path | None:
    """Where the test reads what this client was sent: dump-dir, or its folder for the strategy now running (the
    server's ``phase`` entry, when it runs several); None when not asked."""
    if not context.run_config["dump-dir"]:
        return None
    folder = Path(context.run_config["dump-dir"], msg.content["config"].get("phase", ""))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@app.train()
def train(msg: Message, context: Context):
    model = Net()
    received = msg.content["arrays"]
    # FedAMP: the client trains its own model, kept between rounds (one per strategy when the server runs several)
    phase = msg.content["config"].get("phase", "")
    phases = [p for p in str(context.run_config["keep-model-phases"]).split(",") if p]
    keep = context.run_config["keep-model"] and (not phases or phase in phases)
    kept = f"model-{phase}" if phase else "model"
    model.load_state_dict((context.state[kept] if keep and kept in context.state else received).to_torch_state_dict())
    mu = msg.content["config"].get("proximal-mu", 0.0)  # FedAMP's pull towards the anchor it is sent
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    server_round = msg.content["config"]["server-round"]
    trainloader, _, counts = load_data(partition_id, num_partitions, context.run_config, server_round)
    epochs, lr = context.run_config["local-epochs"], context.run_config["lr"]
    train_loss = train_fn(model, trainloader, epochs, lr, "cpu", anchor=received.to_torch_state_dict(), mu=mu)
    if keep:
        context.state[kept] = ArrayRecord(model.state_dict())
    dump = dump_dir(msg, context)
    if dump:  # the test's window on what each client was sent to train
        arrays = {k: v.numpy() for k, v in received.items()}
        np.savez(dump / f"client{partition_id}-train{server_round}.npz", **arrays)
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    if context.run_config["send-class-counts"]:
        metrics["class-counts"] = [int(c) for c in counts]
    if context.run_config["send-partition-id"]:
        metrics["partition-id"] = partition_id
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition_id = context.node_config["partition-id"]
    _, testloader, _ = load_data(partition_id, context.node_config["num-partitions"], context.run_config)
    eval_loss, eval_acc = test_fn(model, testloader, "cpu")
    dump = dump_dir(msg, context)
    if dump:  # the test's window on what each client was sent
        server_round = msg.content["config"]["server-round"]
        arrays = {k: v.numpy() for k, v in msg.content["arrays"].items()}
        np.savez(dump / f"client{partition_id}-round{server_round}.npz", acc=eval_acc, **arrays)
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(testloader.dataset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
