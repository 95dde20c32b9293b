"""cosmos-quickstart: a Flower ClientApp whose model never leaves it; COSMOS's two handlers."""

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from cosmos_quickstart.task import NUM_CLASSES, Net, load_data, test, train
from fedapps.flower_strategies import cosmos_evaluate, cosmos_train, count_classes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.set_num_threads(1)  # one core per simulated node

app = ClientApp()


@app.train("pseudolabels")
def train_round(msg: Message, context: Context) -> Message:
    """Distil on the cluster's pseudo-labels, train on the local data, send the predictions on U."""
    trainloader, _, public_x = load_data(context)
    lr = context.run_config["lr"]
    return cosmos_train(
        msg,
        context,
        model_fn=Net,
        public_x=public_x,
        train_fn=lambda net, epochs: train(net, trainloader, epochs, lr, DEVICE),
        class_counts=count_classes(trainloader.dataset.tensors[1], NUM_CLASSES),
        device=DEVICE.type,
    )


@app.evaluate("pseudolabels")
def evaluate_round(msg: Message, context: Context) -> Message:
    """Test the cluster model the server sent (and this node's own model) on the local test data."""
    _, testloader, _ = load_data(context)
    return cosmos_evaluate(
        msg,
        context,
        model_fn=Net,
        server_model_fn=Net,
        test_fn=lambda net: test(net, testloader, DEVICE),
        num_examples=len(testloader.dataset),
        device=DEVICE.type,
    )
