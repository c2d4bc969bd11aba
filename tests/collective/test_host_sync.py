"""A training step under lb.distribute never makes the host wait for the GPU.

Proven on the CPU with `tests.collective._host_sync.HostSyncCounter` (CI has no GPU): the
reducer runs its GPU policy (``reads_block`` forced on), and every operation that would block
the host on a GPU is counted from forward to the end of ``optimizer.step()``. The default
Strategy must cost none, at world size 1 and 2; float16 loss scaling and
find_unused_parameters at most one per step; sharding (stage 1 and 2, with the all-gather left
to the next forward) none. ``benchmarks/gpu_check.py`` checks the same on a real GPU under
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.collective._host_sync import HostSyncCounter, device_tensors_of

STEPS = 3
BATCH, IN, OUT = 8, 12, 5

# scenario -> (Strategy fields, largest number of host stalls allowed per step)
SCENARIOS: dict[str, tuple[dict, int]] = {
    "default": ({}, 0),
    "three communicators, small buckets": (
        {"nccl_comm_num": 3, "fuse_grad_size_in_MB": 0.001},
        0,
    ),
    "gradient merge": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}, 0),
    "fp16 allreduce": ({"fp16_allreduce": True}, 0),
    "bf16 amp": ({"amp": True, "amp_configs": {"dtype": "bfloat16"}}, 0),
    "fp16 amp (overflow decision)": ({"amp": True, "amp_configs": {"dtype": "float16"}}, 1),
    "find_unused_parameters": ({"find_unused_parameters": True}, 1),
    "sync batch norm": ({"sync_batch_norm": True}, 0),
    "sharding stage 1": (
        {"sharding": True, "sharding_configs": {"stage": 1, "comm_overlap": True}},
        0,
    ),
    "sharding stage 2": (
        {"sharding": True, "sharding_configs": {"stage": 2, "comm_overlap": True}},
        0,
    ),
}


class _Net(nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(IN, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, OUT)
        self.spare = nn.Linear(32, OUT) if unused else None  # never takes part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


def _stalls_per_step(rank: int, world: int, names: list[str]) -> dict[str, list]:
    import longboat as lb
    import longboat.collective.reducer as reducer_module

    reducer_module.reads_block = lambda device: True  # the policy tensors on a GPU get
    lb.init()
    results = {}
    for name in names:
        fields, _ = SCENARIOS[name]
        torch.manual_seed(0)
        net = _Net(unused=name == "find_unused_parameters")
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        model, optimizer = lb.distribute(net, optimizer, lb.Strategy(**fields))
        k = int(fields.get("gradient_merge_configs", {}).get("k_steps", 1))
        g = torch.Generator().manual_seed(rank)
        batches = [
            (torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g))
            for _ in range(k * (STEPS + 2))
        ]

        def step(x: torch.Tensor, y: torch.Tensor, model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        for x, y in batches[: 2 * k]:  # warm-up: optimizer state and caches exist
            step(x, y)
        counter = HostSyncCounter(device_tensors_of(model.module, model.reducer, optimizer))
        with counter, _fresh_buffers_on_device(counter):
            for x, y in batches[2 * k :]:
                step(x, y)
        results[name] = [len(batches) - 2 * k, [op for _, op in counter.events]]
    return results


@contextlib.contextmanager
def _fresh_buffers_on_device(counter: HostSyncCounter) -> Iterator[None]:
    """What sharding allocates each step with ``torch.empty(..., device=<the parameters'>)``
    (stage 2's full buckets, the gather's buffers) lives on the device on a GPU: the counter
    is told so, as it cannot see a CPU tensor's intent."""
    from longboat.sharding.zero.gather import ParameterGather
    from longboat.sharding.zero.scatter import SliceScatter

    empty = torch.empty

    def placed(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = empty(*args, **kwargs)
        counter.place(t)
        return t

    def allocating_on_device(method: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            torch.empty = placed  # type: ignore[assignment]
            try:
                return method(*args, **kwargs)
            finally:
                torch.empty = empty  # type: ignore[assignment]

        return wrapper

    targets = [(SliceScatter, "buffer"), (ParameterGather, "_launch")]
    saved = [getattr(cls, name) for cls, name in targets]
    for (cls, name), method in zip(targets, saved, strict=True):
        setattr(cls, name, allocating_on_device(method))
    try:
        yield
    finally:
        for (cls, name), method in zip(targets, saved, strict=True):
            setattr(cls, name, method)


def _two_rank_cases(rank: int, world: int) -> dict[str, object]:
    """Every 2-rank run of this file in one spawn, each with its own model and lb.distribute:
    channels-last first (under the CPU policy, before the GPU policy is forced on), the
    deferred unused parameter last (it ends in an error)."""
    out: dict[str, object] = {"channels_last": _channels_last(rank, world)}
    out["stalls"] = _stalls_per_step(rank, world, list(SCENARIOS))
    out["deferred_unused"] = _deferred_unused(rank, world)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_rank_cases, 2, timeout=300)


@pytest.mark.parametrize("world", [1, 2])
def test_training_steps_stall_the_host_at_most_as_allowed(world, request):
    names = list(SCENARIOS)
    if world == 2:
        per_rank = [r["stalls"] for r in request.getfixturevalue("two_ranks")]
    else:  # sharding at one rank: Gloo's own copy when its reduce-scatter is waited for
        names = [n for n in names if not n.startswith("sharding")]
        per_rank = run_ranks(_stalls_per_step, world, names, timeout=240)
    for rank, results in enumerate(per_rank):
        for name in names:
            steps, events = results[name]
            allowed = SCENARIOS[name][1]
            assert len(events) <= allowed * steps, (
                f"rank {rank}, {name}: {len(events)} host stalls in {steps} steps "
                f"(allowed {allowed} per step): {events}"
            )
    default_steps, default_events = per_rank[0]["default"]
    assert default_steps >= STEPS and default_events == []


def test_counter_sees_a_python_scalar_written_into_a_device_tensor():
    flags = torch.zeros(4)
    with HostSyncCounter([flags]) as counter:
        flags[1] = 1.0  # a pageable host-to-device copy on a GPU
        flags.narrow(0, 2, 1).fill_(1.0)  # a kernel: fine
        bool((flags == 1).all())  # a device read
        flags.tolist()  # a device read
        torch.empty(4).copy_(flags, non_blocking=True)  # asynchronous: fine
    assert counter.counts() == {"copy": 1, "read": 2}


def test_unused_parameter_found_on_another_rank_is_reported_at_the_next_step(two_ranks):
    messages = [r["deferred_unused"] for r in two_ranks]
    for msg in messages:
        assert "extra" in msg and "find_unused_parameters=True" in msg


def _deferred_unused(rank: int, world: int) -> str:
    """GPU policy: the rank that used everything learns of the other's miss one step later."""
    import longboat as lb
    import longboat.collective.reducer as reducer_module
    from longboat.collective.reducer import UnusedParametersError
    from tests.collective._workloads import Config, build_model, data

    reducer_module.reads_block = lambda device: True
    lb.init()
    cfg = Config(unused="partial")  # the extra layer takes part on rank 0 only
    model, _ = lb.distribute(build_model(cfg, seed=0), None, lb.Strategy())
    x, y = data(cfg)
    for step in range(3):
        try:
            F.cross_entropy(model(x[step], rank), y[step]).backward()
        except UnusedParametersError as e:
            return str(e)
    raise AssertionError("no rank reported the unused parameter")


def _channels_last(rank: int, world: int) -> dict[str, torch.Tensor]:
    import longboat as lb

    lb.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten())
    net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, opt = lb.distribute(net, opt, lb.Strategy())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 8, 3, 8, 8, generator=g)
    for step in range(3):
        opt.zero_grad()
        shard = x[step][rank * 4 : (rank + 1) * 4].to(memory_format=torch.channels_last)
        model(shard).square().mean().backward()
        for p in net.parameters():
            assert p.grad.stride() == p.stride(), "the gradient lost the parameter's layout"
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_channels_last_gradients_keep_the_parameter_layout_and_values(two_ranks):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten())
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 8, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    for step in range(3):
        opt.zero_grad()
        torch.stack(
            [net(x[step][r * 4 : (r + 1) * 4]).square().mean() for r in range(2)]
        ).mean().backward()
        opt.step()
    for ranks in (r["channels_last"] for r in two_ranks):
        for name, p in net.named_parameters():
            torch.testing.assert_close(ranks[name], p.detach(), rtol=1e-5, atol=1e-6)
