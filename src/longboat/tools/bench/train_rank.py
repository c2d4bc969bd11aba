"""One rank of `longboat bench train`: longboat, DDP (default and lean) and the no-sync floor
built side by side, warmed up, then timed in alternating rounds. With sharding in the Strategy,
the same Strategy without sharding and DDP with torch's ``ZeroRedundancyOptimizer`` join them
(at stage 3, torch's FSDP2 applied by hand to the same units in its place: `train_fsdp`), and
every system's memory per rank is taken after its warm-up (`train_memory`)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from longboat.tools.bench.train_fsdp import FSDP_BY_HAND, fully_shard_by_hand, stage3
from longboat.tools.bench.train_memory import DeviceMemory, held_bytes, max_over_ranks
from longboat.tools.bench.train_models import MODELS, ModelSpec, SyntheticDataset

CPU = torch.device("cpu")
NO_SYNC = "no sync"  # the same model stepped with no gradient exchange: the compute floor
#: DDP tuned as its docs suggest: no buffer broadcast per forward, gradients as bucket views
DDP_LEAN = "ddp lean"
#: with sharding on: longboat with the same Strategy but sharding off
UNSHARDED = "longboat unsharded"
#: with sharding on: DDP (at its defaults) stepping torch's ZeroRedundancyOptimizer
DDP_ZERO = "ddp zero"
OPTIMIZER: tuple[type[torch.optim.Optimizer], dict[str, float]] = (
    torch.optim.SGD,
    {"lr": 0.01, "momentum": 0.9},
)
"""Every system's optimizer: class and hyper-parameters."""


@dataclass(frozen=True)
class Config:
    model: str
    warmup: int
    steps: int
    rounds: int
    data: str  # "memory" or "loader"
    workers: int
    strategy: dict[str, Any]
    device: str = "cpu"  # "cpu" or "cuda" (one GPU per rank)
    compile: bool = False  # every system under torch.compile (longboat's through lb.compile)


def _batches(
    spec: ModelSpec, config: Config, rank: int, device: torch.device = CPU
) -> Iterator[tuple[torch.Tensor, ...]]:
    layout = _layout(spec, device)
    if config.data == "memory":
        x, y = zip(
            *(spec.sample(torch.Generator().manual_seed(i)) for i in range(spec.batch)), strict=True
        )  # noqa: E501
        batch = (torch.stack(x).to(device, memory_format=layout), torch.stack(y).to(device))
        while True:
            yield batch
    total = spec.batch * (config.warmup + config.steps * config.rounds + 1)
    loader = torch.utils.data.DataLoader(
        SyntheticDataset(spec, total, seed=rank),
        batch_size=spec.batch,
        num_workers=config.workers,
        pin_memory=device.type == "cuda",
    )
    while True:
        for x, y in loader:
            yield (
                x.to(device, non_blocking=True, memory_format=layout),
                y.to(device, non_blocking=True),
            )


def _layout(spec: ModelSpec, device: torch.device) -> torch.memory_format:
    """channels_last for convolutions on a GPU (what cuDNN runs fastest), else as is."""
    if device.type == "cuda" and spec.kind in ("image", "imagenet"):
        return torch.channels_last
    return torch.preserve_format


@dataclass
class System:
    """One contender: a model, its optimizer and how its steps run (autocast, scaler)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    autocast: torch.dtype | None = None  # applied here; longboat's AMP applies its own
    scaler: Any = None  # torch.amp.GradScaler for float16 baselines


def _settle(device: torch.device) -> None:
    """Every rank at the same point, with no device work queued (honest wall-clock edges)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(system: System, x: torch.Tensor, y: torch.Tensor) -> None:
    """zero_grad, forward, loss, backward, step: the loop every system runs."""
    system.opt.zero_grad()
    # autocast around the forward only, as longboat's AMP applies it: the loss sees the same
    # (low-precision) logits in every system
    with torch.autocast(x.device.type, system.autocast, enabled=system.autocast is not None):
        out = system.model(x)
    loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
    if system.scaler is None:
        loss.backward()
        system.opt.step()
        return
    system.scaler.scale(loss).backward()
    system.scaler.step(system.opt)
    system.scaler.update()


def _round(
    system: System,
    batches: Iterator[tuple[torch.Tensor, ...]],
    steps: int,
    device: torch.device = CPU,
) -> tuple[float, float]:
    """(seconds per step, seconds per step waiting for input) over ``steps`` steps."""
    _settle(device)
    waited = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        x, y = next(batches)
        waited += time.perf_counter() - t
        train_step(system, x, y)
    _settle(device)
    return (time.perf_counter() - start) / steps, waited / steps


def _amp_dtype(strategy: dict[str, Any]) -> torch.dtype | None:
    """The autocast dtype longboat's side runs under, for the baselines to match."""
    if not strategy.get("amp"):
        return None
    dtype = dict(strategy.get("amp_configs") or {}).get("dtype", "float16")
    return torch.bfloat16 if dtype == "bfloat16" else torch.float16


def _device(config: Config) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    import longboat as lb

    return torch.device("cuda", lb.local_rank())


def _build(spec: ModelSpec, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = spec.build().to(device, memory_format=_layout(spec, device))
    cls, hparams = OPTIMIZER
    return model, cls(model.parameters(), **hparams)


def sharded(strategy: dict[str, Any]) -> bool:
    """Whether longboat's side runs with sharding (then the sharding systems join)."""
    return bool(strategy.get("sharding"))


def _unsharded(strategy: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in strategy.items() if k not in ("sharding", "sharding_configs")}


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's switch for "no buffer broadcast before each forward": ``forward_sync_buffers``
    where torch has it (2.13 deprecates ``broadcast_buffers``), else ``broadcast_buffers``."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def rank_main(config: Config) -> dict[str, Any] | None:
    """Every rank: time longboat and DDP in alternating rounds; rank 0 returns the samples."""
    import longboat as lb

    lb.init()
    torch.set_num_threads(1)
    spec = MODELS[config.model]
    device = _device(config)
    amp = _amp_dtype(config.strategy)
    scaled = amp == torch.float16
    ids = [device.index] if device.type == "cuda" else None

    def baseline(model: nn.Module, opt: torch.optim.Optimizer) -> System:
        scaler = torch.amp.GradScaler(device.type) if scaled else None
        return System(torch.compile(model) if config.compile else model, opt, amp, scaler)

    def longboat(strategy: dict[str, Any]) -> System:
        model, opt = lb.distribute(*_build(spec, device), lb.Strategy(**strategy))
        if config.compile:
            lb.compile(model)
        return System(model, opt)

    def ddp(lean: bool = False) -> System:
        model, opt = _build(spec, device)
        options = dict(gradient_as_bucket_view=True, **_no_forward_buffer_sync()) if lean else {}
        return baseline(nn.parallel.DistributedDataParallel(model, device_ids=ids, **options), opt)

    def ddp_zero() -> System:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = spec.build().to(device, memory_format=_layout(spec, device))
        cls, hparams = OPTIMIZER
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **hparams)
        return baseline(nn.parallel.DistributedDataParallel(model, device_ids=ids), opt)

    def fsdp_by_hand() -> System:
        model = spec.build().to(device, memory_format=_layout(spec, device))
        fully_shard_by_hand(model, config.strategy, device)
        cls, hparams = OPTIMIZER
        return System(model, cls(model.parameters(), **hparams))

    builders: dict[str, Callable[[], System]] = {"longboat": lambda: longboat(config.strategy)}
    if sharded(config.strategy):
        builders[UNSHARDED] = lambda: longboat(_unsharded(config.strategy))
    builders["ddp"] = ddp
    builders[DDP_LEAN] = lambda: ddp(lean=True)
    if stage3(config.strategy):
        builders[FSDP_BY_HAND] = fsdp_by_hand
    elif sharded(config.strategy):
        builders[DDP_ZERO] = ddp_zero
    # the compute floor: the same steps with no gradient exchange, which no allreduce beats
    builders[NO_SYNC] = lambda: baseline(*_build(spec, device))
    systems, batches, memory = _warm_up(builders, spec, config, device)
    held = max_over_ranks(memory) if sharded(config.strategy) else {}
    out: dict[str, Any] = {name: {"step_s": [], "data_s": []} for name in systems}
    order = list(systems)
    for r in range(config.rounds):
        for name in order if r % 2 == 0 else reversed(order):
            step, data = _round(systems[name], batches[name], config.steps, device)
            out[name]["step_s"].append(step)
            out[name]["data_s"].append(data)
    if lb.rank() != 0:
        return None
    for name, columns in held.items():
        out[name]["memory"] = columns
    params = sum(p.numel() for p in systems[NO_SYNC].model.parameters())
    return {
        "params": params,
        "batch_per_rank": spec.batch,
        "world_size": lb.world_size(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compiled": config.compile,
        "sharding": dict(config.strategy.get("sharding_configs") or {})
        if sharded(config.strategy)
        else None,
        **out,
    }


def _warm_up(
    builders: dict[str, Callable[[], System]],
    spec: ModelSpec,
    config: Config,
    device: torch.device,
) -> tuple[dict[str, System], dict[str, Iterator], dict[str, list[float | None]]]:
    """Build each system and run its warm-up steps (discarded), one system after the other;
    then what it holds: optimizer state and gradient bytes, and on a GPU the bytes it keeps
    allocated and its peak (`longboat.tools.bench.train_memory`); only with sharding on."""
    import longboat as lb

    measure = sharded(config.strategy)
    gpu = DeviceMemory(device) if device.type == "cuda" and measure else None
    systems, batches, memory = {}, {}, {}
    for name, build in builders.items():
        if gpu is not None:
            gpu.start()
        systems[name] = system = build()
        batches[name] = _batches(spec, config, lb.rank(), device)
        if config.warmup:
            _round(system, batches[name], config.warmup, device)
        if measure:
            kept, peak = gpu.stop() if gpu is not None else (None, None)
            memory[name] = [*held_bytes(system.model, system.opt), kept, peak]
    return systems, batches, memory
