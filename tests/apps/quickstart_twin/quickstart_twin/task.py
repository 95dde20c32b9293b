"""The model, data loading, training and test, as Flower's quickstart-pytorch writes them (our data through a
loader)."""

import dataclasses

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from fedapps.config import DataConfig
from fedapps.data import get_federation
from fedapps.flower_strategies import proximal_penalty
from fedapps.seeds import derive_seed


class Net(nn.Module):
    """A two-hidden-layer MLP (the same layout as the app's ``mlp``, so the same initial arrays load into it)."""

    def __init__(self, in_features: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Sequential(nn.Linear(in_features, 200), nn.ReLU(inplace=True))
        self.fc2 = nn.Sequential(nn.Linear(200, 200), nn.ReLU(inplace=True))
        self.fc = nn.Linear(200, num_classes)

    def forward(self, x):
        return self.fc(self.fc2(self.fc1(torch.flatten(x, 1))))


def batch_seed(seed: int, server_round: int, partition_id: int) -> int:
    """The seed the app's client shuffles its minibatches with (the twin's one departure from the quickstart)."""
    return derive_seed(seed, "client-batches", server_round, partition_id)


def load_data(partition_id, num_partitions, run_config, server_round=0):
    """This node's train and test loaders, from fedapps' data layer."""
    fed = get_federation(
        dataclasses.asdict(
            DataConfig(
                source=run_config["source"],
                partition=run_config["partition"],
                num_clients=num_partitions,
                classes_per_client=run_config["classes-per-client"],
            )
        )
    )
    data = fed.client(partition_id)
    # the sampler draws its permutation from the seeded generator first thing (a DataLoader given the generator
    # itself would first draw its workers' base seed from it)
    trainset = TensorDataset(data.train_x, data.train_y)
    shuffle = torch.Generator().manual_seed(batch_seed(run_config["seed"], server_round, partition_id))
    batch_size = run_config["batch-size"]
    trainloader = DataLoader(trainset, batch_size, sampler=RandomSampler(trainset, generator=shuffle), drop_last=True)
    testloader = DataLoader(TensorDataset(data.test_x, data.test_y), batch_size=batch_size)
    return trainloader, testloader, fed.train_counts[partition_id]


def train(net, trainloader, epochs, lr, device, anchor=None, mu=0.0):
    """Quickstart's loop; with ``mu`` > 0 the proximal pull (μ/2)‖w − anchor‖² is added to the loss (FedAMP)."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            if mu > 0:
                loss = loss + proximal_penalty(net, anchor, mu)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / max(len(trainloader) * epochs, 1)


def test(net, testloader, device):
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item()
            correct += (torch.max(outputs.data, 1)[1] == labels.to(device)).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
