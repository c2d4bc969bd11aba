"""Sharded checkpoints at stage 3: each rank writes its own shards of the model and optimizer
with torch's distributed checkpoint (DCP), never gathered, and a load at any world size and
``sharding_degree`` reads the pieces of its shards (DCP reshards).

``directory`` holds ``fsdp-<token>/`` (DCP's ``.metadata`` and one ``.distcp`` file per rank,
plus rank 0's ``extra.pt`` with your ``state``) and ``fsdp.json``, which names the complete
one: rank 0 replaces it atomically after every rank wrote, then removes older saves, so a
crash during a save leaves the previous checkpoint whole.

``lb.save_sharded_checkpoint`` / ``lb.load_sharded_checkpoint`` come here for a stage 3
optimizer and go on to stages 1 and 2's per-rank files otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from longboat.checkpoint import CheckpointError, check_state, load_checkpoint, save_checkpoint
from longboat.comm.exchange import allgather_bytes
from longboat.sharding.optimizer import FullyShardedStep, stage3_step

POINTER = "fsdp.json"
FORMAT = "longboat-fsdp-dcp"
VERSION = 1


def _collective_files() -> Any:
    import longboat.sharding.zero.files as files

    return files


def save_sharded_checkpoint(
    directory: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any] | None = None,
) -> bool:
    """Write the sharded optimizer's state (at stage 3 the model's shards too) to
    ``directory``; collective: every rank calls it. See docs/sharding.md."""
    step = stage3_step(optimizer)
    if step is None:
        return _collective_files().save_sharded_checkpoint(directory, optimizer, state)
    if state is not None:
        check_state(state)
    target = Path(os.fspath(directory))
    token = allgather_bytes(secrets.token_hex(6).encode())[0].decode()
    name = f"fsdp-{token}"
    root = step.model
    step.sync_hparams()
    shards = {
        "model": get_model_state_dict(root),
        "optimizer": get_optimizer_state_dict(root, step.optimizer),
    }
    failure = ""
    try:
        dcp.save(shards, checkpoint_id=str(target / name))
        if dist.get_rank() == 0:
            save_checkpoint(target / name / "extra.pt", {"state": dict(state or {})})
    except Exception as error:  # every rank learns of it below
        failure = f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    failures = [f for f in (b.decode() for b in allgather_bytes(failure.encode())) if f]
    if failures:
        raise CheckpointError(f"save_sharded_checkpoint({target}) failed: {failures[0]}")
    if dist.get_rank() == 0:
        _point_at(target, name, step)
    dist.barrier()
    return True


def _point_at(target: Path, name: str, step: FullyShardedStep) -> None:
    """Rank 0: make ``fsdp.json`` name the save ``name`` (atomically), remove older ones."""
    pointer = {
        "format": FORMAT,
        "version": VERSION,
        "checkpoint": name,
        "world": dist.get_world_size(),
        "degree": step.degree,
        "optimizer": type(step.optimizer).__name__,
    }
    tmp = target / f".{POINTER}.{name}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(pointer, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target / POINTER)
    for old in target.glob("fsdp-*"):
        if old.name != name and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def saved_version(directory: str | os.PathLike[str]) -> str | None:
    """Which save of a sharded checkpoint (any stage) this process sees in ``directory``: its
    save's name, or None where it sees none. Ranks compare it before a collective load."""
    target = Path(os.fspath(directory))
    try:
        if (target / POINTER).exists():
            return str(json.loads((target / POINTER).read_text(encoding="utf-8"))["checkpoint"])
        index = _collective_files().read_index(target)
    except (OSError, ValueError, KeyError, CheckpointError) as error:
        return f"unreadable ({type(error).__name__})"
    return None if index is None else str(index["token"])


def load_sharded_checkpoint(
    directory: str | os.PathLike[str], optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Load what ``save_sharded_checkpoint`` wrote into the sharded optimizer (at stage 3
    the model's shards too); returns the saved ``state``, or None when nothing was saved."""
    step = stage3_step(optimizer)
    if step is None:
        return _collective_files().load_sharded_checkpoint(directory, optimizer)
    target = Path(os.fspath(directory))
    pointer_file = target / POINTER
    if not pointer_file.exists():
        if (target / "index.json").exists():
            raise CheckpointError(
                f"{target} holds a stage 1/2 checkpoint (per-rank optimizer files), and this "
                "optimizer is at stage 3: load it at stage 1 or 2, save model.state_dict() and "
                "optimizer.state_dict() there, and load those here"
            )
        return None
    pointer = json.loads(pointer_file.read_text(encoding="utf-8"))
    if pointer.get("format") != FORMAT:
        raise CheckpointError(f"{pointer_file} is not a longboat stage 3 checkpoint")
    if pointer["optimizer"] != type(step.optimizer).__name__:
        raise CheckpointError(
            f"{target} holds {pointer['optimizer']} state, and this optimizer is "
            f"{type(step.optimizer).__name__}: load it into the same optimizer class"
        )
    saved = target / pointer["checkpoint"]
    load_into(step.model, step, saved)
    return dict(load_checkpoint(saved / "extra.pt")["state"])


def load_into(root: nn.Module, step: FullyShardedStep, saved: Path) -> None:
    """Read the DCP checkpoint at ``saved`` into the sharded model and optimizer."""
    shards = {
        "model": get_model_state_dict(root),
        "optimizer": get_optimizer_state_dict(root, step.optimizer),
    }
    dcp.load(shards, checkpoint_id=str(saved))
    set_model_state_dict(root, shards["model"])
    set_optimizer_state_dict(root, step.optimizer, shards["optimizer"])
    for theirs, mine in zip(step.user.param_groups, step.optimizer.param_groups, strict=True):
        theirs.update({k: v for k, v in mine.items() if k not in ("params", "param_names")})


def read_whole(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A stage 3 checkpoint read into one process without a process group (any world size
    saved it): ``{"model": state dict of your module, "optimizer": the plain optimizer's
    state dict, "state": your state}``, whole tensors on the CPU."""
    target = Path(os.fspath(directory))
    pointer = json.loads((target / POINTER).read_text(encoding="utf-8"))
    saved = target / pointer["checkpoint"]
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp, "whole.pt")
        dcp_to_torch_save(saved, whole)
        shards = torch.load(whole, weights_only=True)
    return {
        "model": shards["model"],
        "optimizer": plain_optimizer_state(shards["optimizer"]),
        "state": dict(load_checkpoint(saved / "extra.pt")["state"]),
    }


def plain_optimizer_state(by_name: Mapping[str, Any]) -> dict[str, Any]:
    """torch's optimizer layout (state per parameter index) of DCP's (state per parameter
    name; each param group lists its parameters' names, in order)."""
    index: dict[str, int] = {}
    groups = []
    for group in by_name["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    state = {index[name]: dict(v) for name, v in by_name["state"].items()}
    return {"state": state, "param_groups": groups}
