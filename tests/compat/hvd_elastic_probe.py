"""Horovod's elastic PyTorch flow, unchanged but for the import, for the tests.

Environment: PROBE_OUT (each rank writes its final parameters and the history of committed
global batches to PROBE_OUT.<rank> as JSON), PROBE_SAMPLES, PROBE_BATCH, PROBE_EPOCHS,
PROBE_SLEEP (seconds per step), PROBE_DIE="GROUP_RANK@COMMIT" (that node's rank kills its
launcher and itself once it committed that many steps: a node lost as a whole),
PROBE_WAIT_FOR_WORLD="W@K" (at commit K, wait until W ranks run: a node joins there; a joiner
replays the script up to ``train(state)``, so the run leaves out the ``hvd.broadcast_*``
calls, which the first ``state.sync()`` makes unnecessary in an elastic job).
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch.utils.data import DataLoader, TensorDataset

import longboat.horovod.torch as hvd

SAMPLES = int(os.environ.get("PROBE_SAMPLES", "96"))
BATCH = int(os.environ.get("PROBE_BATCH", "4"))
EPOCHS = int(os.environ.get("PROBE_EPOCHS", "1"))
SLEEP = float(os.environ.get("PROBE_SLEEP", "0"))
WAIT_FOR = os.environ.get("PROBE_WAIT_FOR_WORLD", "")  # "WORLD@COMMIT"
LR = 0.05


def data(samples: int = SAMPLES) -> TensorDataset:
    """(index, x, y) rows of a small regression."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(torch.arange(samples), x, y)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def gathered_batches(indices: torch.Tensor) -> list[list[int]]:
    """Every rank's batch of this step, through hvd.allgather (padded with -1)."""
    mine = torch.full((1, BATCH), -1, dtype=torch.long)
    mine[0, : len(indices)] = indices
    everyone = hvd.allgather(mine, name="probe.batches")
    return [[int(i) for i in row if i >= 0] for row in everyone]


def maybe_die(commits: int) -> None:
    spec = os.environ.get("PROBE_DIE")
    if not spec:
        return
    node, _, at = spec.partition("@")
    if commits >= int(at) and int(os.environ["GROUP_RANK"]) == int(node) and hvd.rank() != 0:
        print(f"probe: node {node} dies at commit {commits}", flush=True)
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for_world(state: hvd.elastic.TorchState) -> None:
    """Hold the job at commit K until a node joined (check_host_updates raises then)."""
    if not WAIT_FOR:
        return
    size, _, at = WAIT_FOR.partition("@")
    deadline = time.monotonic() + 120
    while state.commits == int(at) and hvd.size() < int(size):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no node joined within 120 s at commit {at}")
        time.sleep(0.1)
        state.check_host_updates()


def main() -> None:
    if os.environ.get("PROBE_PID_DIR"):
        with open(os.path.join(os.environ["PROBE_PID_DIR"], f"pid.{os.getpid()}"), "w") as f:
            f.write(str(os.getpid()))
    hvd.init()
    dataset = data()
    net = model(seed=hvd.rank())  # differs per rank until the broadcast
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    if not WAIT_FOR:
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1, batch_size=BATCH)
    loader = DataLoader(dataset, batch_sampler=sampler)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, EPOCHS):  # noqa: B020 - Horovod's idiom
            state.train_sampler.set_epoch(state.epoch)
            for batch_idx, (indices, x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.mse_loss(net(x), y)
                loss.backward()
                optimizer.step()
                state.train_sampler.record_batch(batch_idx, BATCH)
                state.history.append([hvd.size(), gathered_batches(indices)])
                if SLEEP:
                    time.sleep(SLEEP)
                state.batch += 1
                state.commit()
                wait_for_world(state)
                maybe_die(state.commits)
            state.batch = 0

    def on_state_reset() -> None:
        state.resets += 1

    state = hvd.elastic.TorchState(
        net, optimizer, train_sampler=sampler, batch=0, epoch=0, history=[], resets=0
    )
    state.register_reset_callbacks([on_state_reset])
    train(state)
    if os.environ.get("PROBE_OUT"):
        with open(f"{os.environ['PROBE_OUT']}.{hvd.rank()}", "w") as f:
            json.dump(
                {
                    "params": [p.detach().flatten().tolist() for p in net.parameters()],
                    "history": state.history,
                    "processed": sorted(sampler.processed_indices),
                    "resets": state.resets,
                    "size": hvd.size(),
                },
                f,
            )
    hvd.shutdown()


if __name__ == "__main__":
    main()
