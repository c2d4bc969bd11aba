"""broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object.

Objects travel as ``torch.save`` archives and are read back with
``torch.load(weights_only=True)``, the same safe format as longboat's checkpoints: tensors,
numbers, str, None, dtypes, devices and dict/list/tuple/OrderedDict of them. Nothing a peer
sends can run code on the receiver (Horovod uses cloudpickle). An object outside that format
(an instance of your own class) is refused on the rank that sends it, with the fix, and every
other rank raises too instead of waiting.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import torch

from longboat.horovod.torch import basics
from longboat.horovod.torch.ops import ProcessSet, global_process_set, synchronize
from longboat.horovod.torch.optimizer import local_step
from longboat.horovod.torch.scatter_gather import allgather, broadcast_, broadcast_async_

_REFUSED = -1


def broadcast_parameters(
    params: Any, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Overwrite ``params`` (a state_dict, named_parameters() or a list of tensors) in place
    with ``root_rank``'s values."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p, root_rank, name, process_set) for name, p in items]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters.

    A fresh optimizer's empty state is materialised first, as Horovod does: one local step
    on zero gradients, which stay in ``p.grad`` afterwards.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        _materialise(optimizer)
        state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        return  # a stateless optimizer (plain SGD): nothing to broadcast, as in Horovod
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    occurrences: collections.Counter[str] = collections.Counter()
    where: dict[str, tuple[int, str]] = {}
    for group in state_dict["param_groups"]:
        for pid in group["params"]:
            for name, value in state_dict["state"].get(pid, {}).items():
                occurrences[name] += 1
                key = f"{name}.{occurrences[name]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    where[key] = (pid, name)
    options = [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
    broadcast_parameters(tensors, root_rank, process_set)
    root = broadcast_object(
        {"scalars": scalars, "options": options}, root_rank, "optimizer_state", process_set
    )
    for key, value in root["scalars"].items():
        pid, name = where[key]
        state_dict["state"][pid][name] = value
    for group, theirs in zip(state_dict["param_groups"], root["options"], strict=True):
        group.update(theirs)
    optimizer.load_state_dict(state_dict)


def _materialise(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's way to create a fresh optimizer's state: every trainable parameter gets a zero
    gradient (left in place afterwards, as Horovod leaves it) and the wrapped optimizer takes
    one local step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                grad = torch.zeros_like(p)
                p.grad = grad.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else grad
    local_step(optimizer)()


def _dumps(obj: Any) -> bytes | str:
    """``obj`` as a torch.save archive, or why the receivers could not load it safely."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - becomes the message every rank raises
        return (
            f"{type(obj).__name__} cannot travel in longboat.horovod's safe object format "
            f"(torch.save read back with weights_only=True): {str(exc).splitlines()[0]}. Send "
            "tensors, numbers, str, None and dict/list/tuple of them (e.g. dataclasses.asdict), "
            "or allow your class on every rank with torch.serialization.add_safe_globals([...])"
        )
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``root_rank``'s ``obj`` on every rank (safe format; see the module docstring)."""
    name = name or type(obj).__name__
    me = basics.rank()
    payload: bytes | str = _dumps(obj) if me == root_rank else b""
    size = torch.tensor([_REFUSED if isinstance(payload, str) else len(payload)])
    broadcast_(size, root_rank, f"{name}.sz", process_set)
    if int(size) == _REFUSED:
        raise ValueError(
            payload
            if isinstance(payload, str)
            else f"rank {root_rank}'s object {name!r} "
            "could not be serialised safely; see the error on that rank"
        )
    if me == root_rank:
        assert isinstance(payload, bytes)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(size), dtype=torch.uint8)
    broadcast_(data, root_rank, f"{name}.t", process_set)
    return obj if me == root_rank else _loads(data.numpy().tobytes())


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Every rank's ``obj``, in rank order (safe format; see the module docstring)."""
    name = name or type(obj).__name__
    payload = _dumps(obj)
    refused = isinstance(payload, str)
    size = torch.tensor([_REFUSED if refused else len(payload)])
    sizes = allgather(size, f"{name}.sz", process_set).tolist()
    if _REFUSED in sizes:
        bad = [r for r, s in enumerate(sizes) if s == _REFUSED]
        raise ValueError(
            payload
            if refused
            else f"allgather_object {name!r}: the object of rank(s) {bad} "
            "could not be serialised safely; see the error on those ranks"
        )
    assert isinstance(payload, bytes)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = allgather(data, f"{name}.t", process_set).numpy().tobytes()
    out, offset = [], 0
    for n in sizes:
        out.append(_loads(gathered[offset : offset + n]))
        offset += n
    return out
