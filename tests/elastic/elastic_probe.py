"""An elastic training run for the tests: small regression, history of every committed step.

Environment: PROBE_OUT (rank 0 writes the final parameters and history there as JSON),
PROBE_EPOCHS, PROBE_SAMPLES, PROBE_BATCH, PROBE_SLEEP (seconds per step, to leave time for
faults), PROBE_WAIT_FOR_WORLD="W@K[,W@K...]" (at commit K, wait until the world has W ranks:
a node joins or leaves there), PROBE_DIE="GROUP_RANK@COMMIT" (that node's rank kills its
launcher and itself once the job reached that many commits: a node lost as a whole),
PROBE_QUIT_AT=K (this rank ends at commit K with exit code 0, as if its training were done),
PROBE_DIGESTS (a directory: every rank appends a JSON line to ``digests-<pid>.jsonl`` each time
``train`` starts, i.e. after every sync of the state, and once at the end with its parameters),
PROBE_SHARDING=STAGE (shard the optimizer state over every rank at that stage; 3: the
parameters too), PROBE_DEGREE=N (its sharding_degree), PROBE_CHECKPOINT=DIR
(``State(checkpoint=DIR, checkpoint_every=2)``),
PROBE_KILL="NODE@COMMIT+DELAY[,...]" (once per job, the ranks of node NODE, or of every node
for ``all``, SIGKILL themselves DELAY seconds after reaching commit COMMIT; their launchers
live, unless the node is written ``NODE!``), PROBE_NODE_COPY=0 (``State(node_copy=False)``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import longboat as lb
from longboat.elastic.world import joined_round

SAMPLES = int(os.environ.get("PROBE_SAMPLES", "96"))
BATCH = int(os.environ.get("PROBE_BATCH", "4"))
EPOCHS = int(os.environ.get("PROBE_EPOCHS", "1"))
SLEEP = float(os.environ.get("PROBE_SLEEP", "0"))
WAIT_FOR = {
    int(at): int(world)
    for world, _, at in (
        spec.partition("@")
        for spec in os.environ.get("PROBE_WAIT_FOR_WORLD", "").split(",")
        if spec
    )
}  # commit -> world size to wait for there
QUIT_AT = int(os.environ.get("PROBE_QUIT_AT", "-1"))
DIGESTS = os.environ.get("PROBE_DIGESTS", "")
SHARDING = int(os.environ.get("PROBE_SHARDING", "0"))


def data(samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def gathered_batches(indices: list[int]) -> list[list[int]]:
    """Every rank's batch of this step (tensors padded with -1; nothing pickled)."""
    mine = torch.full((BATCH,), -1, dtype=torch.long)
    mine[: len(indices)] = torch.tensor(indices, dtype=torch.long)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [[int(i) for i in t if i >= 0] for t in out]


def maybe_hang(commits: int) -> None:
    """PROBE_HANG="GROUP_RANK@COMMIT": that node's rank stops answering (its process lives)."""
    node, _, at = os.environ.get("PROBE_HANG", "-1@0").partition("@")
    if commits == int(at) and int(os.environ["GROUP_RANK"]) == int(node) and lb.rank() != 0:
        print(f"probe: node {node} hangs at commit {commits}", flush=True)
        time.sleep(3600)


def maybe_die(commits: int) -> None:
    spec = os.environ.get("PROBE_DIE")
    if not spec:
        return
    node, _, at = spec.partition("@")
    if commits >= int(at) and int(os.environ["GROUP_RANK"]) == int(node) and lb.rank() != 0:
        print(f"probe: node {node} dies at commit {commits}", flush=True)
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill(commits: int) -> None:
    """PROBE_KILL: this rank dies DELAY s after commit COMMIT (a timer, so the step goes on
    meanwhile, as a crash lands mid-step), once per job: its restarted self does not. A node
    written ``N!`` loses its launcher too (the whole node)."""
    node = os.environ["GROUP_RANK"]
    for spec in filter(None, os.environ.get("PROBE_KILL", "").split(",")):
        who, _, rest = spec.partition("@")
        at, _, delay = rest.partition("+")
        whole = who.endswith("!")
        if commits != int(at) or who.rstrip("!") not in ("all", node):
            continue
        marker = os.path.join(
            os.environ["PROBE_PID_DIR"], f"killed-{node}-{os.environ['LOCAL_RANK']}"
        )
        if os.path.exists(marker):
            return
        with open(marker, "w") as f:  # when it dies, for the recovery time
            f.write(str(time.time() + float(delay or 0)))
        print(
            f"probe: node {node} rank {lb.rank()} dies {delay or 0} s after {commits}", flush=True
        )
        victims = [os.getppid(), os.getpid()] if whole else [os.getpid()]
        timer = threading.Timer(float(delay or 0), _kill, (victims,))
        timer.daemon = True
        timer.start()


def _kill(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def wait_for_world(state: lb.elastic.State) -> None:
    """Hold the job at commit K until the world has W ranks (a node joined: the membership
    check raises; a node left: the check fails as a lost peer)."""
    world = WAIT_FOR.get(state.commits)
    if world is None:
        return
    deadline = time.monotonic() + 120
    while dist.get_world_size() != world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the world did not become {world} within 120 s at {state.commits}")
        time.sleep(0.1)
        state.check_membership()


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The whole parameters of the model ``lb.distribute`` returned (collective at stage 3,
    whose module is sharded anew after a membership change)."""
    if SHARDING == 3:
        return list(model.state_dict().values())  # the probe's model has no buffers
    return [p.detach() for p in model.parameters()]


def state_digest(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the parameters and the optimizer's state tensors, bit for bit (the tests'
    own reference, independent of ``State.digest``)."""
    h = hashlib.sha256()
    tensors = list(params)
    for index, entry in sorted(optimizer.state_dict()["state"].items()):
        for key in sorted(entry):
            h.update(f"{index}/{key}".encode())
            tensors.append(torch.as_tensor(entry[key]))
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def record(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **fields: object) -> None:
    """Append what this rank holds now to its line file in PROBE_DIGESTS."""
    if not DIGESTS:
        return
    params = weights(model)
    joined = joined_round()
    line = {
        "pid": os.getpid(),
        "node": os.environ.get("PROBE_NODE", ""),
        "token": joined.token if joined is not None else "",
        "rank": lb.rank(),
        "world": dist.get_world_size(),
        "digest": state_digest(params, optimizer),
        "time": time.time(),
        **fields,
    }
    with open(os.path.join(DIGESTS, f"digests-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def main() -> None:
    if os.environ.get("PROBE_PID_DIR"):
        with open(os.path.join(os.environ["PROBE_PID_DIR"], f"pid.{os.getpid()}"), "w") as f:
            f.write(str(os.getpid()))
    lb.init()
    dataset = data()
    sampler = lb.elastic.ElasticSampler(len(dataset), BATCH, shuffle=True, seed=1)
    loader = DataLoader(dataset, batch_sampler=sampler)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    strategy = lb.Strategy()
    if SHARDING:
        degree = int(os.environ.get("PROBE_DEGREE", "0"))
        strategy.sharding = True
        strategy.sharding_configs = {"stage": SHARDING, "sharding_degree": degree}
    dmodel, optimizer = lb.distribute(net, optimizer, strategy)
    state = lb.elastic.State(
        model=dmodel,
        optimizer=optimizer,
        sampler=sampler,
        node_copy=os.environ.get("PROBE_NODE_COPY", "1") != "0",
        checkpoint=os.environ.get("PROBE_CHECKPOINT") or None,
        checkpoint_every=2 if os.environ.get("PROBE_CHECKPOINT") else 0,
        epoch=0,
        history=[],
    )

    @lb.elastic.run
    def train(state: lb.elastic.State) -> None:
        record(
            dmodel,
            optimizer,
            commits=state.commits,
            processed=sampler.processed_indices(),
            steps=len(state.history),
        )
        for epoch in range(state.epoch, EPOCHS):
            sampler.set_epoch(epoch)
            for batch_indices, (x, y) in zip(iter_indices(sampler), loader, strict=True):
                loss = torch.nn.functional.mse_loss(dmodel(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sampler.record_batch()
                state.history.append([dist.get_world_size(), gathered_batches(batch_indices)])
                if SLEEP:
                    time.sleep(SLEEP)
                state.commit()
                if state.commits == QUIT_AT:
                    print(f"probe: this rank ends at commit {QUIT_AT}", flush=True)
                    os._exit(0)
                wait_for_world(state)
                maybe_die(state.commits)
                maybe_kill(state.commits)
                maybe_hang(state.commits)
            state.epoch = epoch + 1

    train(state)
    params = [p.flatten().tolist() for p in weights(dmodel)]
    record(dmodel, optimizer, commits=state.commits, final=True, params=params)
    if lb.rank() == 0 and os.environ.get("PROBE_OUT"):
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(
                {
                    "params": params,
                    "history": state.history,
                    "processed": sampler.processed_indices(),
                },
                f,
            )
    lb.shutdown()


def iter_indices(sampler: lb.elastic.ElasticSampler):
    """The batches the loader will yield, in the same order (the sampler is deterministic)."""
    yield from iter(sampler)


if __name__ == "__main__":
    main()
