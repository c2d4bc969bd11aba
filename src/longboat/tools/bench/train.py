"""`longboat bench train`: training throughput and scaling, longboat and torch DDP side by side.

DLPerf's method: per rank count, every rank holds the same model twice, once under
``lb.distribute`` and once under ``DistributedDataParallel``; warm-up steps are discarded, then
timed rounds of ``--steps`` steps alternate between the two (order flipped every round, so
machine noise hits both alike), and the median round gives the step time. Reported per system and
rank count: samples/s (global batch / step time), speedup and scaling efficiency versus 1 rank,
and the longboat/DDP step-time ratio (median of adjacent round pairs). With ``--data loader`` the
batches come from a DataLoader over a synthetic dataset and the time spent waiting for them is
measured: a run that waits for input for more than `INPUT_BOUND_FRACTION` of its step is flagged
input-bound (more ranks will not make it faster; add loader workers).

``--device cuda`` runs one rank per GPU over NCCL (``resnet50`` and ``gpt2-small`` are sized
like ResNet-50 and GPT-2 small, with no torchvision needed); with ``--set amp=true`` the DDP and
no-sync baselines run under the same ``torch.autocast`` (and a GradScaler for float16), so every
system does the same arithmetic. The no-sync row is the plain training loop. DDP runs twice: at
its defaults, and "lean" (``broadcast_buffers=False, gradient_as_bucket_view=True``, what its
docs suggest for speed, and what longboat does by default); each ratio is paired round by round.
With ``--compile`` every system runs compiled: longboat through ``lb.compile`` (its graph cut at
longboat's buckets), DDP and the no-sync floor through ``torch.compile`` (DDP's graph cut at its
own buckets by torch), so the ratios compare compiled steps with compiled steps.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from longboat.tools.progress import progress

INPUT_BOUND_FRACTION = 0.1
CPU = torch.device("cpu")
NO_SYNC = "no sync"  # the same model stepped with no gradient exchange: the compute floor
#: DDP tuned as its docs suggest: no buffer broadcast per forward, gradients as bucket views
DDP_LEAN = "ddp lean"


# ---- models --------------------------------------------------------------------------------------


class _Block(nn.Module):
    """ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet(width: int = 16, classes: int = 10) -> nn.Module:
    """A CIFAR-style ResNet (3 stages of 2 basic blocks) for 3x32x32 inputs."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        for block in range(2):
            layers.append(_Block(cin, cout, 2 if stage and not block else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class TinyTransformer(nn.Module):
    """Token embedding, a pre-norm encoder and mean-pooled classification."""

    def __init__(self, vocab: int, dim: int, layers: int, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class _Bottleneck(nn.Module):
    """ResNet bottleneck block (1x1, 3x3, 1x1 convolutions, expansion 4)."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.short(x))


def resnet50(classes: int = 1000) -> nn.Module:
    """ResNet-50's layout (3-4-6-3 bottlenecks, 25.6 M parameters) for 3x224x224 inputs."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for block in range(blocks):
            layers.append(_Bottleneck(cin, width, 2 if stage and not block else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class CausalLM(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm causal blocks, LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(
            dim, dim // 64, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        h = self.embed(tokens) + self.position.weight[:seq]
        h = self.blocks(h, mask=self.mask[:seq, :seq], is_causal=True)
        return self.head(self.norm(h))  # (batch, seq, vocab): next-token logits


def mlp(widths: Sequence[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def convnet() -> nn.Module:
    """A small VGG-style convnet for 3x32x32 inputs."""

    def block(a: int, b: int) -> list[nn.Module]:
        return [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32),
        *block(32, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        *block(64, 64),
        nn.MaxPool2d(2),
        *block(64, 128),
        *block(128, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: how to build it, one sample's input, its batch per rank."""

    name: str
    batch: int
    kind: str  # "vector", "image", "imagenet", "tokens" or "lm"
    arg: Any

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        if self.kind == "vector":
            return mlp(self.arg)
        if self.name.startswith("convnet"):
            return convnet()
        if self.kind == "image":
            return resnet(self.arg)
        if self.kind == "imagenet":
            return resnet50()
        vocab, dim, layers, seq = self.arg
        if self.kind == "lm":
            return CausalLM(vocab, dim, layers, seq)
        return TinyTransformer(vocab, dim, layers)

    def sample(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "vector":
            x = torch.randn(self.arg[0], generator=generator)
        elif self.kind in ("image", "imagenet"):
            size = 224 if self.kind == "imagenet" else 32
            x = torch.randn(3, size, size, generator=generator)
        else:
            vocab, _, _, seq = self.arg
            x = torch.randint(0, vocab, (seq,), generator=generator)
            if self.kind == "lm":  # next-token targets
                return x, torch.randint(0, vocab, (seq,), generator=generator)
        return x, torch.randint(0, 10, (), generator=generator)


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", 64, "vector", (512, 2048, 2048, 512, 10)),
    "mlp-0.3M": ModelSpec("mlp-0.3M", 64, "vector", (256, 512, 256, 128, 10)),
    "convnet": ModelSpec("convnet", 32, "image", None),
    "resnet": ModelSpec("resnet", 32, "image", 16),
    "transformer": ModelSpec("transformer", 16, "tokens", (1000, 128, 2, 64)),
    # GPU-sized: ResNet-50 (25.6 M parameters) and GPT-2 small (124 M, 163 M with its LM head
    # untied)
    "resnet50": ModelSpec("resnet50", 128, "imagenet", None),
    "gpt2-small": ModelSpec("gpt2-small", 8, "lm", (50257, 768, 12, 1024)),
    # tiny variants: end-to-end tests and quick checks
    "mlp-tiny": ModelSpec("mlp-tiny", 8, "vector", (16, 32, 10)),
    "resnet-tiny": ModelSpec("resnet-tiny", 4, "image", 4),
    "transformer-tiny": ModelSpec("transformer-tiny", 4, "tokens", (50, 16, 1, 8)),
    "gpt2-tiny": ModelSpec("gpt2-tiny", 2, "lm", (64, 64, 1, 16)),
}


class SyntheticDataset(torch.utils.data.Dataset):
    """Random samples made on access (the cost a real pipeline's decoding would have)."""

    def __init__(self, spec: ModelSpec, length: int, seed: int):
        self.spec, self.length, self.seed = spec, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.spec.sample(torch.Generator().manual_seed(self.seed * 1_000_003 + i))


# ---- one rank's measurement ----------------------------------------------------------------------


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
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


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

    def baseline(model: nn.Module, opt: torch.optim.Optimizer) -> System:
        scaler = torch.amp.GradScaler(device.type) if scaled else None
        return System(torch.compile(model) if config.compile else model, opt, amp, scaler)

    systems: dict[str, System] = {}
    ours, opt = _build(spec, device)
    model, opt = lb.distribute(ours, opt, lb.Strategy(**config.strategy))
    if config.compile:
        lb.compile(model)
    systems["longboat"] = System(model, opt)
    theirs, opt = _build(spec, device)
    ids = [device.index] if device.type == "cuda" else None
    systems["ddp"] = baseline(nn.parallel.DistributedDataParallel(theirs, device_ids=ids), opt)
    lean, opt = _build(spec, device)
    systems[DDP_LEAN] = baseline(
        nn.parallel.DistributedDataParallel(
            lean, device_ids=ids, gradient_as_bucket_view=True, **_no_forward_buffer_sync()
        ),
        opt,
    )
    # the compute floor: the same steps with no gradient exchange, which no allreduce beats
    systems[NO_SYNC] = baseline(*_build(spec, device))
    batches = {name: _batches(spec, config, lb.rank(), device) for name in systems}
    for name, system in systems.items():
        if config.warmup:
            _round(system, batches[name], config.warmup, device)  # discarded
    out: dict[str, Any] = {name: {"step_s": [], "data_s": []} for name in systems}
    order = list(systems)
    for r in range(config.rounds):
        for name in order if r % 2 == 0 else reversed(order):
            step, data = _round(systems[name], batches[name], config.steps, device)
            out[name]["step_s"].append(step)
            out[name]["data_s"].append(data)
    if lb.rank() != 0:
        return None
    params = sum(p.numel() for p in ours.parameters())
    return {
        "params": params,
        "batch_per_rank": spec.batch,
        "world_size": lb.world_size(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compiled": config.compile,
        **out,
    }


# ---- the matrix of rank counts, and reporting ------------------------------------------------------


def summarise(raw: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows per (system, nproc): samples/s, speedup and efficiency vs 1 rank (None without a
    1-rank run), input-boundness, the longboat/DDP ratio and the no-sync floor's ratio to DDP
    (the same steps without any gradient exchange: the best any allreduce could reach)."""
    rows = []
    base: dict[str, float] = {}
    for nproc in sorted(raw):
        r = raw[nproc]
        ratio, (q1, q3) = paired(r, "longboat", "ddp")
        floor = paired(r, NO_SYNC, "ddp")[0] if NO_SYNC in r else None
        lean = paired(r, "longboat", DDP_LEAN) if DDP_LEAN in r else None
        over_plain = paired(r, "longboat", NO_SYNC) if NO_SYNC in r else None
        for system in ("longboat", "ddp"):
            step = statistics.median(r[system]["step_s"])
            data = statistics.median(r[system]["data_s"])
            throughput = r["batch_per_rank"] * nproc / step
            if nproc == 1:
                base[system] = throughput
            speedup = throughput / base[system] if system in base else None  # needs a 1-rank run
            rows.append(
                {
                    "system": system,
                    "nproc": nproc,
                    "step_ms": step * 1e3,
                    "samples_per_s": throughput,
                    "speedup": speedup,
                    "efficiency": speedup / nproc if speedup is not None else None,
                    "data_fraction": data / step,
                    "input_bound": data / step > INPUT_BOUND_FRACTION,
                    "longboat_over_ddp": ratio,
                    "longboat_over_ddp_p25_p75": [q1, q3],
                    "no_sync_over_ddp": floor,
                    "longboat_over_ddp_lean": lean[0] if lean else None,
                    "longboat_over_ddp_lean_p25_p75": list(lean[1]) if lean else None,
                    "longboat_over_no_sync": over_plain[0] if over_plain else None,
                    "longboat_over_no_sync_p25_p75": list(over_plain[1]) if over_plain else None,
                    "params": r["params"],
                    "device": r.get("device", "cpu"),
                    "compiled": r.get("compiled", False),
                    "batch_per_rank": r["batch_per_rank"],
                    "rounds": len(r[system]["step_s"]),
                }
            )
    return rows


def paired(
    raw: dict[str, Any], system: str, baseline: str
) -> tuple[float, tuple[float, float]]:
    """Median and quartiles of ``system``/``baseline`` step-time ratios, round by round (the
    two ran back to back in each round, so machine noise hits both alike)."""
    ratios = sorted(
        a / b for a, b in zip(raw[system]["step_s"], raw[baseline]["step_s"], strict=True)
    )
    median = statistics.median(ratios)
    if len(ratios) < 2:
        return median, (median, median)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return median, (q1, q3)


def _ratio(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _label(model: str, rows: Sequence[dict[str, Any]]) -> str:
    """The model's name, marked when every system ran compiled."""
    return f"{model} (compiled)" if rows and rows[0].get("compiled") else model


def render(model: str, rows: Sequence[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"bench train: {_label(model, rows)} ({rows[0]['params'] / 1e6:.2f} M params, batch {rows[0]['batch_per_rank']}/rank, {rows[0].get('device', 'cpu')})"
    )  # noqa: E501
    for column in (
        "system",
        "ranks",
        "step ms",
        "samples/s",
        "speedup",
        "efficiency",
        "input wait",
        "longboat/DDP",
        "longboat/DDP lean",
        "no-sync/DDP",
    ):  # noqa: E501
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["system"],
            str(r["nproc"]),
            f"{r['step_ms']:.2f}",
            f"{r['samples_per_s']:.1f}",
            _ratio(r["speedup"], "{:.2f}x"),
            _ratio(r["efficiency"], "{:.0%}"),
            f"{r['data_fraction']:.0%}" + (" INPUT-BOUND" if r["input_bound"] else ""),
            f"{r['longboat_over_ddp']:.3f}",
            _ratio(r.get("longboat_over_ddp_lean"), "{:.3f}"),
            _ratio(r.get("no_sync_over_ddp"), "{:.3f}"),
        )
    console = Console()
    console.width = max(console.width, 110)
    console.print(table)


def markdown(model: str, rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | system | ranks | step ms | samples/s | speedup | efficiency | input wait | longboat/DDP | longboat/DDP lean | no-sync/DDP |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    label = _label(model, rows)
    for r in rows:
        flag = " (input-bound)" if r["input_bound"] else ""
        lines.append(
            f"| {label} | {r['system']} | {r['nproc']} | {r['step_ms']:.2f} | {r['samples_per_s']:.1f} "
            f"| {_ratio(r['speedup'], '{:.2f}x')} | {_ratio(r['efficiency'], '{:.0%}')} "
            f"| {r['data_fraction']:.0%}{flag} "
            f"| {r['longboat_over_ddp']:.3f} | {_ratio(r.get('longboat_over_ddp_lean'), '{:.3f}')} "
            f"| {_ratio(r.get('no_sync_over_ddp'), '{:.3f}')} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.5), squeeze=False)
    for ax, (model, rows) in zip(axes[0], results.items(), strict=True):
        for system, style in (("longboat", "o-"), ("ddp", "s--")):
            mine = [r for r in rows if r["system"] == system]
            ax.plot(
                [r["nproc"] for r in mine], [r["samples_per_s"] for r in mine], style, label=system
            )  # noqa: E501
        ax.set_title(model)
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_model(
    config: Config, nprocs: Sequence[int], done: Callable[..., None] | None = None
) -> list[dict[str, Any]]:
    """Launch each rank count (local ranks), or measure in place under a launcher;
    ``done(last=...)`` is called after each rank count."""
    if "RANK" in os.environ:
        result = rank_main(config)
        return summarise({int(os.environ["WORLD_SIZE"]): result}) if result else []
    from longboat.launch.local import launch_local

    env = {"LONGBOAT_BACKEND": "nccl"} if config.device == "cuda" else None
    raw = {}
    for n in nprocs:
        raw[n] = launch_local(rank_main, (config,), nproc=n, env=env, timeout=3600)[0]
        if done is not None:
            done(last=f"{config.model} x{n}")
    return summarise(raw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="mlp", help=f"comma list of {', '.join(MODELS)} (default mlp)"
    )
    p.add_argument("--nproc", default="1,2", help="rank counts to run (default 1,2)")
    p.add_argument("--strategy", default=None, help="Strategy YAML/JSON file for longboat's side")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a Strategy field for longboat's side (YAML value), repeatable",
    )
    p.add_argument("--warmup", type=int, default=5, help="discarded warm-up steps (default 5)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed round (default 10)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per system (default 7)")
    p.add_argument(
        "--data",
        choices=("memory", "loader"),
        default="memory",
        help="input from one tensor in memory, or a DataLoader over synthetic samples",
    )
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers with --data loader")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (Gloo) or cuda (one GPU per rank, NCCL; --nproc at most the GPUs seen)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run every system under torch.compile: longboat through lb.compile (cut at its "
        "buckets), DDP and no-sync through torch.compile",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--png", default=None, metavar="FILE", help="also plot samples/s vs ranks")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")


def strategy_fields(path: str | None, sets: Sequence[str]) -> dict[str, Any]:
    """Fields from ``--strategy FILE`` (non-default ones) and ``--set`` on top."""
    import yaml

    from longboat.strategy import Strategy

    fields: dict[str, Any] = {}
    if path:
        loaded = Strategy.load(path)
        fields = {k: v for k, v in loaded.to_dict().items() if loaded.source(k) != "default"}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. nccl_comm_num=2")
        fields[key] = yaml.safe_load(value)
    Strategy(**fields)  # refuse bad fields here, before any rank starts
    return fields


def run(args: argparse.Namespace) -> int:
    models = args.model.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"longboat bench train: unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
        return 2
    nprocs = sorted({int(n) for n in args.nproc.split(",")})
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0 or max(nprocs) > gpus:
            print(
                f"longboat bench train: --device cuda runs one rank per GPU; {gpus} GPU(s) "
                f"seen, --nproc asks for up to {max(nprocs)}"
            )
            return 2
    fields = strategy_fields(args.strategy, args.set)
    results: dict[str, list[dict[str, Any]]] = {}
    runs = len(models) * len(nprocs)
    with progress("bench train", runs, "RANK" not in os.environ, last="-") as done:
        for model in models:
            config = Config(
                model,
                args.warmup,
                args.steps,
                args.rounds,
                args.data,
                args.workers,
                fields,
                args.device,
                args.compile,
            )
            rows = run_model(config, nprocs, done)
            if rows:  # none on a non-zero rank under a launcher
                results[model] = rows
    for model, rows in results.items():
        print(markdown(model, rows)) if args.markdown else render(model, rows)
    if results and args.json:
        with open(args.json, "w") as f:
            json.dump({"strategy": fields, "results": results}, f, indent=1)
    if results and args.png:
        plot(results, args.png)
    return 0
