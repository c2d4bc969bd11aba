"""Every Strategy variant through the lagging backend, against single-process references.

``run_all(device)`` initialises the lagging backend (`tests/_lagging_backend.py`) as rank 0 of
``VIRTUAL_RANKS`` virtual ranks, trains each variant with ``lb.distribute`` on the same batch
every virtual rank holds, and returns each variant's parameters next to its reference:

* ``"single"``: one process, no longboat, the same batch. Every virtual rank holds the same
  data, so the average gradient is this process's, sync BN's global statistics are its own
  and local SGD's averaging is the identity: an exact Strategy must match it.
* ``"host"``: lossy variants (half-precision allreduce, DGC, PowerSGD) the same virtual run
  on CPU tensors, where every collective completes on the host before anything reads it
  (the CPU suite proves those runs against their own references).

On a GPU every collective's result lands only after a deliberate delay on the backend's own
stream, so any reader that is not made to wait for it (the optimizer, the overflow check, the
used-parameter counts, the next bucket pack) reads the bucket before the reduction: off by
``VIRTUAL_RANKS``, and the variant fails its reference. On CPU the same harness runs with
host completion: CI proves the harness and its references, a GPU proves the ordering.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.futures import Future
from torch.nn import functional as F

from tests import _lagging_backend as backend

VIRTUAL_RANKS = 4
STEPS = 6
BATCH, IN, HIDDEN, CLASSES = 16, 32, 256, 10
POISONED_STEP = 2  # float16 AMP: an overflow on "another rank" at this step must skip it

# name -> (Strategy fields, reference: "single" or "host")
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "default": ({}, "single"),
    "serial off": ({"sync_nccl_allreduce": False}, "single"),
    "3 communicators": ({"nccl_comm_num": 3, "fuse_grad_size_in_MB": 0.05}, "single"),
    "fp16 allreduce": ({"fp16_allreduce": True}, "host"),
    "bf16 allreduce": ({"gradient_compression": "bf16"}, "host"),
    "amp float16 (overflow decision)": (
        {"amp": True, "amp_configs": {"dtype": "float16"}},
        "single",
    ),
    "amp bfloat16": ({"amp": True, "amp_configs": {"dtype": "bfloat16"}}, "single"),
    "find_unused_parameters": ({"find_unused_parameters": True}, "single"),
    "gradient merge k=2": (
        {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": True}},
        "single",
    ),
    "dgc": ({"dgc": True, "dgc_configs": {"rampup_begin_step": 2}}, "host"),
    "powersgd": (
        {
            "gradient_compression": "powersgd",
            "powersgd_configs": {"rank": 2, "start_step": 2, "min_compression_bytes": 0},
        },
        "host",
    ),
    "local sgd k=2": ({"localsgd": True, "localsgd_configs": {"k_steps": 2}}, "single"),
    "sync batch norm": ({"sync_batch_norm": True}, "single"),
    # sharding over shard groups of one rank, averaged across the 4: each virtual rank owns the
    # whole slice, so its all-gather and the reduce-scatter then replica sum are exact here;
    # by default the gather runs inside the step, with comm_overlap during the next forward
    **{
        f"sharding stage {stage}" + (", gather in the next forward" if overlap else ""): (
            {
                "sharding": True,
                "sharding_configs": {
                    "stage": stage,
                    "sharding_degree": 1,
                    **({"comm_overlap": True} if overlap else {}),
                },
                "fuse_grad_size_in_MB": 0.05,
            },
            "single",
        )
        for stage in (1, 2)
        for overlap in (False, True)
    },
}
CONTROL = "elastic control flags"  # State.sync, its digests, any_rank: not a training run
#: the defect the harness exists to catch, put back on purpose: it must fail on a GPU
NEGATIVE = "negative control: host-completed bucket futures"
#: how the negative control can fail besides stale gradients: the per-step usage counts, read
#: before their reduction landed, claim that parameters received no gradient
STALE_SYMPTOM = "received no gradient"
TOLERANCE = {"single": 1e-5, "amp": 2e-3, "host": 1e-4}
#: a lossy variant against the single-process run: what CI checks on CPU (no GPU to pair with)
LOSSY_TOLERANCE = 5e-2


class Net(nn.Module):
    """An MLP with LayerNorm or BatchNorm, and a spare head for find_unused_parameters."""

    def __init__(self, batch_norm: bool, spare: bool):
        super().__init__()
        norm = nn.BatchNorm1d if batch_norm else nn.LayerNorm
        self.fc1, self.norm1 = nn.Linear(IN, HIDDEN), norm(HIDDEN)
        self.fc2, self.norm2 = nn.Linear(HIDDEN, HIDDEN), norm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.spare = nn.Linear(HIDDEN, CLASSES) if spare else None

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = torch.tanh(self.norm1(self.fc1(x)))
        h = torch.tanh(self.norm2(self.fc2(h)))
        out = self.head(h)
        return out + self.spare(h) if use_spare and self.spare is not None else out


def _model(name: str, device: torch.device) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net("batch norm" in name, spare=name == "find_unused_parameters").to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _data(micro_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(micro_steps, BATCH, IN, generator=g)
    return x, torch.randint(0, CLASSES, (micro_steps, BATCH), generator=g)


def merge_steps(fields: dict[str, Any]) -> int:
    """Micro-steps per optimizer step under gradient merge (1 without)."""
    return int(fields.get("gradient_merge_configs", {}).get("k_steps", 1))


def autocast_dtype(fields: dict[str, Any]) -> torch.dtype | None:
    """The AMP dtype the Strategy fields ask for, None without AMP."""
    if not fields.get("amp"):
        return None
    return torch.float16 if fields["amp_configs"]["dtype"] == "float16" else torch.bfloat16


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by name, on the CPU (to compare across devices and processes)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _uses_spare(i: int) -> bool:
    return i % 2 == 0  # the spare head takes part every other micro-step, on every rank


def _poisoned(name: str, step: int) -> bool:
    return name.startswith("amp float16") and step == POISONED_STEP


@contextlib.contextmanager
def host_completed_handles() -> Iterator[None]:
    """Every bucket's handle replaced by a fresh ``Future()`` completed from a done-callback
    of the collective's own future: no device events, so waiting on it orders nothing on
    the GPU (on the CPU, where futures complete with the data, it is harmless)."""
    from longboat.comm import serial
    from longboat.comm.handles import FutureHandle, future_of

    original = serial.SerialAllreduce.__call__

    def unordered(self, tensor, fn=None):  # noqa: ANN001, ANN202 - SerialAllreduce.__call__
        source = future_of(original(self, tensor, fn))
        bare: Future = Future()
        source.add_done_callback(lambda _: bare.set_result(None))
        return FutureHandle(bare)

    serial.SerialAllreduce.__call__ = unordered
    try:
        yield
    finally:
        serial.SerialAllreduce.__call__ = original


def distributed_run(name: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Train variant ``name`` with lb.distribute over the lagging backend: its parameters."""
    if name == NEGATIVE:
        with host_completed_handles():
            return distributed_run("default", device)
    import longboat as lb

    fields, _ = VARIANTS[name]
    if device.type == "cpu":  # host completion: pin the algorithm NCCL's defaults choose
        fields = {"allreduce_algorithm": "native", **fields}
    model, opt = _model(name, device)
    dmodel, dopt = lb.distribute(model, opt, lb.Strategy(**fields))
    k = merge_steps(fields)
    x, y = _data(STEPS * k)
    for i in range(x.shape[0]):
        if i % k == 0:
            dopt.zero_grad()
        if _poisoned(name, i // k):
            backend.poison(1)  # the first bucket's sum overflows, as if on another rank
        out = dmodel(x[i].to(device), use_spare=_uses_spare(i))
        F.cross_entropy(out, y[i].to(device)).backward()
        dopt.step()
    dmodel.settle_parameters()  # comm_overlap: the last step's gathers are still pending
    return params(model)


def single_reference(
    name: str, device: torch.device, skip_overflow: bool = True
) -> dict[str, torch.Tensor]:
    """One process, plain torch, the batch every virtual rank holds; ``skip_overflow`` False:
    also take the step the emulated overflow must skip (to show the poison matters)."""
    if name == NEGATIVE:
        return single_reference("default", device)
    fields, _ = VARIANTS[name]
    model, opt = _model(name, device)
    k = merge_steps(fields)
    x, y = _data(STEPS * k)
    dtype = autocast_dtype(fields)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(k):
            i = step * k + micro
            with torch.autocast(device.type, dtype, enabled=dtype is not None):
                out = model(x[i].to(device), use_spare=_uses_spare(i))
                loss = F.cross_entropy(out, y[i].to(device))
            (loss / k).backward()
        if not (skip_overflow and _poisoned(name, step)):  # an overflow skips it everywhere
            opt.step()
    return params(model)


def control_flags(device: torch.device) -> str:
    """The elastic control-plane collectives on this group: State.sync (an all-gather of
    commit counts into empty tensors, then digests compared), any_rank both ways."""
    import longboat as lb
    from longboat.comm.exchange import any_rank

    model, opt = _model(CONTROL, device)
    state = lb.elastic.State(model=model, optimizer=opt)
    state.commit()
    source = state.sync()  # raises StateMismatchError if a digest was read before it landed
    if source != 0:
        raise AssertionError(f"State.sync chose rank {source}: counts read before they landed")
    if not any_rank(True) or any_rank(False):
        raise AssertionError("any_rank disagrees with the flags every rank set")
    return "State.sync, digests and any_rank agree"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def tolerance(name: str, against: str) -> float:
    fields, _ = VARIANTS.get(name, ({}, "single"))
    if against == "host":
        return TOLERANCE["host"]
    return TOLERANCE["amp" if fields.get("amp") else "single"]


@contextlib.contextmanager
def virtual_world(device: torch.device) -> Iterator[None]:
    """This process as rank 0 of ``VIRTUAL_RANKS`` over the lagging backend; torn down after."""
    import longboat as lb

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(var, None)  # no launcher: longboat adopts the group as it is
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend.init(VIRTUAL_RANKS, on_device=True)  # NCCL's kind: longboat's GPU paths
    else:
        backend.init(VIRTUAL_RANKS, on_device=False, delay_cycles=0)
    lb.init()
    try:
        yield
    finally:
        lb.shutdown()


def run_all(_rank: int, _world: int, device: str, names: list[str] | None) -> dict[str, Any]:
    """Each variant's parameters (or its error) and, on CPU, the references; a rank function
    for ``tests._dist.run_ranks`` with one rank (a fresh process)."""
    dev = torch.device(device)
    names = names if names is not None else [*VARIANTS, CONTROL, NEGATIVE]
    out: dict[str, Any] = {}
    with virtual_world(dev):
        for name in names:
            try:
                if name == CONTROL:
                    out[name] = {"control": control_flags(dev)}
                    continue
                out[name] = {"run": distributed_run(name, dev)}
            except Exception:  # noqa: BLE001 - reported per variant, the others go on
                out[name] = {"error": traceback.format_exc(limit=-4)}
        out["collectives"] = backend.SETTINGS.collectives
        out["poison left"] = backend.SETTINGS.poisoned
    return out
