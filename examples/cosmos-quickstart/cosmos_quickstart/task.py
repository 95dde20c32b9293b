"""cosmos-quickstart: the model, the data and the training loop, as Flower's quickstart-pytorch writes them."""

import torch
from flwr.app import Context
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedapps.flower_strategies import load_partition, load_public

NUM_CLASSES = 10


class Net(nn.Module):
    """A small CNN for 28×28 grey images (two 5×5 conv blocks, two linear layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(64 * 4 * 4, 512), nn.ReLU())
        self.fc = nn.Linear(512, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.conv1(x))
        return self.fc(self.fc1(torch.flatten(x, 1)))


def data_settings(context: Context) -> dict:
    """How the data set is split: the same keys on every node and on the server."""
    cfg = context.run_config
    return {
        "source": cfg["dataset"],
        "partition": "cosmos-groups",
        "groups": cfg["groups"],
        "alpha": cfg["alpha"],
        "public_fraction": cfg["public-fraction"],
    }


def load_data(context: Context) -> tuple[DataLoader, DataLoader, torch.Tensor]:
    """This node's train and test loaders, and the public set U (unlabelled, the same on every node)."""
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    part = load_partition(partition_id, num_partitions, **data_settings(context))
    batch_size = context.run_config["batch-size"]
    trainloader = DataLoader(TensorDataset(part.train_x, part.train_y), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(TensorDataset(part.test_x, part.test_y), batch_size=256)
    return trainloader, testloader, part.public_x


def load_server_public(context: Context) -> torch.Tensor:
    """U on the server: the same samples, in the same order, as every node's."""
    return load_public(**data_settings(context))


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """Train the model on the training set; return the mean loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / max(epochs * len(trainloader), 1)


def test(net: nn.Module, testloader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Validate the model on the test set; return (loss, accuracy)."""
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item() * len(labels)
            correct += (torch.max(outputs, 1)[1] == labels.to(device)).sum().item()
    n = len(testloader.dataset)
    return loss / n, correct / n
