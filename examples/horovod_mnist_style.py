"""Horovod's pytorch_mnist.py, unchanged but for its import (and digits in place of MNIST,
which would need a download).

    longboat launch -np 2 -H localhost:2 examples/horovod_mnist_style.py --epochs 3
    # was: horovodrun -np 2 -H localhost:2 python pytorch_mnist.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch import nn

import longboat.horovod.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example (Horovod style)")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size for training")
parser.add_argument("--test-batch-size", type=int, default=256, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(20 * 2 * 2, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 20 * 2 * 2)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def digits(train: bool) -> torch.utils.data.TensorDataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.3) / 0.4
    y = torch.tensor(d.target)
    split = int(len(x) * 0.8)
    part = slice(None, split) if train else slice(split, None)
    return torch.utils.data.TensorDataset(x[part], y[part])


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\t"
                f"Loss: {loss.item():.6f}"
            )


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(
            f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n"
        )


if __name__ == "__main__":
    args = parser.parse_args()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    # Horovod: use DistributedSampler to partition the training data.
    train_dataset = digits(train=True)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    test_dataset = digits(train=False)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test()
