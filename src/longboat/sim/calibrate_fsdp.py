"""Sharding stage 3's costs on this machine, for `longboat sim calibrate`.

On ``nproc`` local Gloo ranks, every rank starting each timed call together (a barrier):

* the backend's own all-gather and reduce-scatter into one tensor, as FSDP2 issues them
  (``all_gather_into_tensor``, ``reduce_scatter_tensor``), at each size: fitted to
  ``t = a + b S`` (the fastest of the repeats) and stored as corrections of the alpha-beta rule (`sim.cost`:
  `all_gather_tensor`, `reduce_scatter_tensor`), as the ring allreduce's are;
* FSDP2's host work: small models of ``U`` units of ``L`` linear layers, each step under
  ``fully_shard`` paired with the same model's plain step (alternating; the median of the
  differences). What the simulator already prices in that difference (the units' collectives
  with the corrections above, FSDP2's copies through memory) is subtracted, and the rest is
  fitted to ``step + U unit + P param + B byte`` (``P`` parameter tensors, ``B`` bytes the
  collectives move) by least squares: the pre/post forward and backward hooks, the DTensor
  wrapping and the optimizer stepping DTensors (momentum SGD), per step, per unit and per
  parameter tensor, and the collectives' fresh buffers per byte.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from longboat.sim.cluster import AlgorithmCost, Cluster, Fsdp2Cost
from longboat.sim.stage3 import Piece, Stage3

SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20)
#: (units, linear layers per unit, width) of the host-work models: the units, the parameter
#: tensors and the bytes gathered vary independently
SHAPES = ((1, 1, 32), (6, 1, 32), (1, 8, 32), (6, 8, 32), (1, 1, 1024), (1, 1, 2048))
BATCH = 8
STEPS = 21  # paired timed steps per shape


def _collective(name: str) -> Callable[..., object]:
    """torch's call for ``name``: the ``*_single`` spelling where torch has it (FSDP2's)."""
    import torch.distributed as dist

    spelled = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    older = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
    return getattr(dist, spelled[name], None) or getattr(dist, older[name])


def time_collectives(sizes: Sequence[int], repeats: int) -> dict[str, dict[str, float]]:
    """The fastest seconds of each collective per size (bytes of the whole tensor): on a
    shared host other work only ever adds time. The allreduce beside them is for reference."""
    import torch
    import torch.distributed as dist

    from longboat.sim.probe import fastest_s

    n = dist.get_world_size()
    gather, scatter = _collective("all_gather"), _collective("reduce_scatter")
    out: dict[str, dict[str, float]] = {"all_gather": {}, "reduce_scatter": {}, "all_reduce": {}}
    for size in sizes:
        numel = size // 4 // n * n
        whole, part = torch.ones(numel), torch.ones(numel // n)
        out["all_gather"][str(size)] = fastest_s(lambda w=whole, p=part: gather(w, p), repeats)
        out["reduce_scatter"][str(size)] = fastest_s(lambda w=whole, p=part: scatter(p, w), repeats)
        out["all_reduce"][str(size)] = fastest_s(lambda w=whole: dist.all_reduce(w), repeats)
    return out


def _model(units: int, layers: int, width: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]) for _ in range(units)]
    )


def _train(model: Any, opt: Any, x: Any) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def time_host_work(shapes: Sequence[tuple[int, int, int]], steps: int) -> list[dict[str, float]]:
    """Per shape: the median over paired steps of (FSDP2 step - plain step) seconds, the two
    alternating, so that both meet the same load on a shared host."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = []
    for units, layers, width in shapes:
        x = torch.randn(BATCH, width)
        plain, sharded = _model(units, layers, width), _model(units, layers, width)
        for unit in sharded:
            fully_shard(unit, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        pairs = [
            (m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)) for m in (plain, sharded)
        ]
        for _ in range(3):
            for m, opt in pairs:
                _train(m, opt, x)
        extra = []
        for _ in range(steps):
            took = []
            for m, opt in pairs:
                dist.barrier()
                start = time.perf_counter()
                _train(m, opt, x)
                took.append(time.perf_counter() - start)
            extra.append(took[1] - took[0])
        out.append(
            {"units": units, "layers": layers, "width": width, "extra_s": statistics.median(extra)}
        )
    return out


def rank_main(
    sizes: Sequence[int], repeats: int, shapes: Sequence[tuple[int, int, int]], steps: int
) -> dict[str, Any] | None:
    """Every rank measures; rank 0 returns the report."""
    import torch
    import torch.distributed as dist

    import longboat as lb

    lb.init()
    torch.set_num_threads(1)
    report = {
        "world": dist.get_world_size(),
        **time_collectives(sizes, repeats),
        "fsdp2": time_host_work(shapes, steps),
    }
    return report if lb.rank() == 0 else None


def measure(nproc: int = 2, repeats: int = 5) -> dict[str, Any]:
    """The report of `rank_main` on ``nproc`` local ranks."""
    from longboat.launch.local import launch_local

    return launch_local(rank_main, (list(SIZES), repeats, list(SHAPES), STEPS), nproc=nproc)[0]


def correction(modelled: Callable[[float], float], measured: Mapping[Any, float]) -> AlgorithmCost:
    """What makes ``modelled`` (seconds of a size) reproduce ``measured`` ({size: seconds}):
    the ratio of its slope to the measured one and the difference of the intercepts (at
    least 0), the measured line fitted as `calibrate.fit` does."""
    from longboat.sim.calibrate import fit

    a, b = fit(measured)
    small, large = 1 << 20, 16 << 20
    slope = (modelled(large) - modelled(small)) / (large - small)
    intercept = modelled(small) - slope * small
    return AlgorithmCost(slope / b, max(0.0, a - intercept))


def collectives(cluster: Cluster, report: Mapping[str, Any]) -> dict[str, AlgorithmCost]:
    """The all-gather's and reduce-scatter's corrections of ``cluster``'s rule (one node of
    ``report['world']`` ranks)."""
    from longboat.sim import cost

    group = cluster.with_devices(int(report["world"]))
    bare = dataclasses.replace(group, collectives={})
    n = group.world
    rules: dict[str, Callable[[float], float]] = {
        "all_gather": lambda s: sum(cost.all_gather_tensor(s / n, bare)),
        "reduce_scatter": lambda s: sum(cost.reduce_scatter_tensor(s, bare)),
    }
    return {
        name: correction(rule, {int(s): t for s, t in report[name].items()})
        for name, rule in rules.items()
    }


def _step(cluster: Cluster, units: int, layers: int, width: int) -> Stage3:
    """A host-work model's stage 3 step (`longboat.sim.stage3.Stage3`), no host work."""

    numel = layers * (width * width + width)
    unit = Piece(numel, 2 * layers, 4 * numel, 4 * numel, 4 * numel, 0.0, 0.0)
    step = Stage3(
        degree=cluster.world,
        replicas=1,
        root=Piece(0, 0, 0, 0, 0, 0.0, 0.0),
        units=(unit,) * units,
        group=cluster,
        replica_group=None,
        overlap=False,
    )
    return step


def host_work(cluster: Cluster, report: Mapping[str, Any]) -> Fsdp2Cost:
    """FSDP2's host work fitted to ``report``'s shapes on ``cluster`` (its collectives
    corrected), each coefficient at least 0."""
    group = cluster.with_devices(int(report["world"]))
    rows, left = [], []
    for shape in report["fsdp2"]:
        units, layers, width = (int(shape[k]) for k in ("units", "layers", "width"))
        step = _step(group, units, layers, width)
        copied = step.copied_bytes(True)
        rows.append([1.0, float(units), float(2 * units * layers), float(copied)])
        priced = step.comm_s(True) + copied / group.mem_bw
        left.append(float(shape["extra_s"]) - priced)
    return Fsdp2Cost(*nonnegative_lstsq(np.array(rows), np.array(left)))


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Least squares of ``a x = b`` with ``x >= 0``: a coefficient that comes out negative is
    held at 0 and the others fitted again (enough for a handful of columns)."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale  # columns of one magnitude (counts beside bytes)
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        solved = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (solved >= 0).all():
            x[free] = solved
            break
        free.pop(int(np.argmin(solved)))
    return [float(v) for v in x / scale]


def with_fsdp2(cluster: Cluster, report: Mapping[str, Any]) -> Cluster:
    """``cluster`` with the corrections and host work measured in ``report``."""
    fitted = dataclasses.replace(cluster, collectives=collectives(cluster, report))
    return dataclasses.replace(fitted, fsdp2=host_work(fitted, report))
