"""`longboat sim profile`: measure a real model's step on this machine.

Forward, backward and optimizer are timed separately over several repeats (medians); during
backward a post-accumulate-grad hook on every parameter records when its gradient is ready, the
moment the reducer would copy it into its bucket. Leaf-module forward times come from module
hooks; FLOPs from ``torch.utils.flop_counter``. On CUDA (``device="cuda"``) every time is a
CUDA event on the current stream (the hooks record one where the gradient's kernel was
queued), read after the step synchronises; leaf-module times are not taken there.
"""

from __future__ import annotations

import importlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from longboat.collective.buckets import layer_of
from longboat.sim.profile import Param, Profile
from longboat.sim.stage3_units import module_tree

Batch = tuple[torch.Tensor, torch.Tensor]


def load_model(
    spec: str, batch: int | None, shape: Sequence[int] | None, classes: int = 10
) -> tuple[str, nn.Module, Batch]:
    """A bench model name (``longboat.tools.bench.train.MODELS``) or ``pkg.module:factory``,
    with a synthetic batch: bench's own samples, or ``randn(batch, *shape)`` and class labels."""
    from longboat.tools.bench.train import MODELS

    if spec in MODELS:
        model_spec = MODELS[spec]
        n = batch or model_spec.batch
        gen = torch.Generator().manual_seed(0)
        xs, ys = zip(*(model_spec.sample(gen) for _ in range(n)), strict=True)
        return spec, model_spec.build(), (torch.stack(xs), torch.stack(ys))
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(
            f"model {spec!r}: expected one of {', '.join(MODELS)} or an import path pkg.module:factory"
        )
    factory = getattr(importlib.import_module(module_name), attr)
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    if not shape:
        raise ValueError(f"model {spec}: give the sample shape, e.g. --input-shape 3,224,224")
    n = batch or 32
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(0))
    return spec, model, (x, torch.randint(0, classes, (n,)))


def count_flops(model: nn.Module, batch: Batch) -> float:
    """FLOPs of one forward+backward (torch's flop counter; 0 if it cannot run)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(batch[0]), batch[1]).backward()
        model.zero_grad(set_to_none=True)
        return float(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - models with ops the counter cannot trace
        return 0.0


def measure(
    name: str,
    model: nn.Module,
    batch: Batch,
    repeats: int = 10,
    warmup: int = 3,
    threads: int = 1,
    amp: bool = False,
    done: Callable[..., None] | None = None,
    device: str = "cpu",
) -> Profile:
    """Time ``repeats`` steps of momentum SGD on ``batch``; medians make the profile."""
    torch.set_num_threads(threads)
    dev = _device(device)
    model = model.to(dev)
    batch = (batch[0].to(dev), batch[1].to(dev))
    clock = _Clock(dev)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)
    grads = _GradStamps(named, clock)
    leaves = _LeafTimes(model, timed=not clock.cuda)
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if amp else _nullcontext()
    samples = _Samples(len(named))
    for r in range(warmup + repeats):
        stamps = _step(model, batch, opt, clock, ctx)
        if r >= warmup:
            samples.add(clock, stamps, grads.stamps)
        if done is not None:
            done()
    grads.remove()
    leaves.remove()
    flops = count_flops(model, batch)
    return Profile(
        model=name,
        batch=len(batch[0]),
        forward_s=statistics.median(samples.fwd),
        backward_s=statistics.median(samples.bwd),
        optimizer_s=statistics.median(samples.step),
        flops=flops,
        params=_params(named, samples.ready),
        layers=leaves.medians(warmup),
        threads=threads,
        amp=amp,
        host=_host(clock, dev),
        device=dev.type,
        modules=module_tree(model),
    )


_Stamps = tuple[object, object, object, object]


def _step(
    model: nn.Module,
    batch: Batch,
    opt: torch.optim.Optimizer,
    clock: _Clock,
    ctx: AbstractContextManager[object],
) -> _Stamps:
    """One training step; stamps before forward, backward, the optimizer step and after it."""
    opt.zero_grad(set_to_none=True)
    clock.sync()
    t0 = clock.stamp()
    with ctx:
        loss = F.cross_entropy(model(batch[0]), batch[1])
    t1 = clock.stamp()
    loss.backward()
    t2 = clock.stamp()
    opt.step()
    t3 = clock.stamp()
    clock.sync()
    return t0, t1, t2, t3


class _GradStamps:
    """A stamp per parameter, taken when its gradient is accumulated (kept across steps)."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], clock: _Clock) -> None:
        self.stamps: list[object] = [None] * len(named)
        self._hooks = [
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: self.stamps.__setitem__(i, clock.stamp())
            )
            for i, (_, p) in enumerate(named)
        ]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class _LeafTimes:
    """Forward seconds of every leaf module, per call (host clock; not taken unless ``timed``)."""

    def __init__(self, model: nn.Module, timed: bool) -> None:
        leaves = {n: m for n, m in model.named_modules() if not list(m.children())}
        self._starts: dict[str, float] = {}
        self.spent: dict[str, list[float]] = {n: [] for n in leaves}
        self._hooks: list[RemovableHandle] = []
        for n, m in leaves.items() if timed else ():
            self._hooks.append(m.register_forward_pre_hook(lambda *_, n=n: self._begin(n)))
            self._hooks.append(m.register_forward_hook(lambda *_, n=n: self._end(n)))

    def _begin(self, name: str) -> None:
        self._starts[name] = time.perf_counter()

    def _end(self, name: str) -> None:
        self.spent[name].append(time.perf_counter() - self._starts[name])

    def medians(self, warmup: int) -> dict[str, float]:
        """Median seconds of each leaf over the calls after ``warmup``."""
        return {n: statistics.median(v[warmup:]) for n, v in self.spent.items() if len(v) > warmup}

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class _Samples:
    """Phase seconds and gradient-ready offsets of the timed steps."""

    def __init__(self, params: int) -> None:
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.step: list[float] = []
        self.ready: list[list[float]] = [[] for _ in range(params)]

    def add(self, clock: _Clock, stamps: _Stamps, grads: Sequence[object]) -> None:
        t0, t1, t2, t3 = stamps
        self.fwd.append(clock.seconds(t0, t1))
        self.bwd.append(clock.seconds(t1, t2))
        self.step.append(clock.seconds(t2, t3))
        for i, s in enumerate(grads):
            self.ready[i].append(max(0.0, clock.seconds(t1, s)) if s is not None else 0.0)


def _params(
    named: Sequence[tuple[str, nn.Parameter]], ready: Sequence[list[float]]
) -> tuple[Param, ...]:
    """Each parameter's shape, dtype, layer and median gradient-ready offset."""
    return tuple(
        Param(
            n,
            tuple(p.shape),
            str(p.dtype).removeprefix("torch."),
            layer_of(n),
            statistics.median(r),
        )
        for (n, p), r in zip(named, ready, strict=True)
    )


def _host(clock: _Clock, dev: torch.device) -> str:
    where = torch.cuda.get_device_name(dev) if clock.cuda else platform.processor()
    return f"{platform.machine()} {where or platform.system()}, torch {torch.__version__}"


class _Clock:
    """Time stamps: host seconds on CPU, CUDA events (read after a synchronise) on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: object, end: object) -> float:
        if not self.cuda:
            return float(end) - float(start)  # type: ignore[arg-type]
        return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"profile device {name!r}: cpu or cuda (cuda:N for one GPU)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("profile device cuda: no CUDA device is available here")
    return device


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
