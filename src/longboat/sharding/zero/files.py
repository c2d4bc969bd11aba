"""Sharded checkpoints: each rank writes its slices of the optimizer state to a file of its
own, and a JSON index says which parameter elements each file holds; a load at any world size
and ``sharding_degree`` reads only the slices its rank owns, from the files that hold them.

    lb.save_sharded_checkpoint("ckpt/last", optimizer, {"model": model.state_dict(), "step": s})
    state = lb.load_sharded_checkpoint("ckpt/last", optimizer)  # None: nothing saved there

The directory holds ``index.json`` (format, world, degree, stage, the optimizer class, every
parameter's name, shape and param group, each group's state keys with dtypes and scalars, each
file's segments), ``common-<token>.pt`` (rank 0: the param groups and your ``state``) and
``optimizer-<token>-<shard>-of-<degree>.pt`` (the ranks of the first shard group: their
slices). A save is collective; the index is replaced last, atomically, and files of earlier
saves are removed after it, so a crash leaves the previous checkpoint whole. Every file loads
with ``weights_only=True`` (and memory-mapped: only the slices read are read from disk).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from longboat.checkpoint import (
    CheckpointError,
    check_state,
    load_checkpoint,
    save_checkpoint,
    write_atomically,
)
from longboat.comm.exchange import allgather_bytes
from longboat.sharding.zero.slices import fill, local_slices, stateful
from longboat.sharding.zero.state import descriptions, load_param_groups
from longboat.sharding.zero.step import step_of

if TYPE_CHECKING:
    from longboat.sharding.zero.shard_optimizer import ShardOptimizer

INDEX = "index.json"
FORMAT = "longboat-sharded-optimizer"
VERSION = 1
_OURS = re.compile(r"^(?:common-(?P<a>[0-9a-f]+)|optimizer-(?P<b>[0-9a-f]+)-\d+-of-\d+)\.pt$")


def _require(optimizer: object, what: str) -> ShardOptimizer:
    step = step_of(optimizer)
    if step is None:
        raise ValueError(
            f"{what}: the optimizer is not sharded (pass the one lb.distribute returned with "
            "Strategy(sharding=True)); without sharding every rank holds the whole state: "
            "use lb.save_checkpoint with optimizer.state_dict()"
        )
    return step


def save_sharded_checkpoint(
    directory: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any] | None = None,
) -> bool:
    """Write the sharded ``optimizer``'s state to ``directory``: one file per shard (written
    by the rank of the first shard group that holds it), rank 0's file with the param groups
    and ``state`` (your other values, e.g. ``model.state_dict()``: what ``lb.save_checkpoint``
    takes), and ``index.json`` last. Collective: every rank calls it. Returns True on a rank
    that wrote a file. CheckpointError on every rank when any rank failed to write (the
    previous checkpoint in ``directory`` is kept)."""
    step = _require(optimizer, "save_sharded_checkpoint")
    if state is not None:
        check_state(state)
    target = Path(os.fspath(directory))
    token = allgather_bytes(secrets.token_hex(6).encode())[0].decode()
    groups = descriptions(step)  # collective over the shard group
    rank, degree = dist.get_rank(), step.groups.degree
    report: dict[str, Any] = {"rank": rank}
    try:
        if rank < degree:  # the first shard group holds every shard once
            report |= _write_shard(step, target, token)
        if rank == 0:
            common = {
                "token": token,
                "param_groups": step.user.state_dict()["param_groups"],
                "state": dict(state or {}),
            }
            save_checkpoint(target / f"common-{token}.pt", common, all_ranks=True)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    reports = [json.loads(r) for r in allgather_bytes(json.dumps(report).encode())]
    _raise_failed(reports, target)
    outcome = {"rank": rank}
    if rank == 0:
        try:
            files = sorted((r for r in reports if "file" in r), key=lambda r: r["shard"])
            index = _index(step, token, groups, files)
            write_atomically(target / INDEX, lambda f: f.write(json.dumps(index).encode()))
            _remove_other_saves(target, token)
        except Exception as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"
    _raise_failed([json.loads(r) for r in allgather_bytes(json.dumps(outcome).encode())], target)
    return "file" in report or rank == 0


def _write_shard(step: ShardOptimizer, target: Path, token: str) -> dict[str, Any]:
    """This rank's slices that hold state, to its file; what the index says of it."""
    segs, state = stateful(local_slices(step))
    pieces = [list(seg) for seg in segs]
    name = f"optimizer-{token}-{step.groups.index}-of-{step.groups.degree}.pt"
    payload = {"token": token, "pieces": pieces, "state": state}
    save_checkpoint(target / name, payload, all_ranks=True)
    return {"file": name, "shard": step.groups.index, "pieces": pieces}


def _raise_failed(reports: list[dict[str, Any]], target: Path) -> None:
    failed = [r for r in reports if "error" in r]
    if failed:
        detail = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
        raise CheckpointError(
            f"save_sharded_checkpoint: {target} was not written ({detail}); the previous "
            "checkpoint there is kept"
        )


def _index(
    step: ShardOptimizer, token: str, groups: dict[int, Any], files: list[dict[str, Any]]
) -> dict[str, Any]:
    """The JSON index: what was saved, and which elements each file holds."""
    group_of = step.group_of
    return {
        "format": FORMAT,
        "version": VERSION,
        "token": token,
        "world": dist.get_world_size(),
        "sharding_degree": step.groups.degree,
        "stage": step.stage,
        "optimizer": type(step.user).__name__,
        "params": [
            {"name": name, "shape": list(p.shape), "group": g}
            for name, p, g in zip(step.names, step.params, group_of, strict=True)
        ],
        "groups": {str(g): info for g, info in sorted(groups.items())},
        "common": f"common-{token}.pt",
        "files": [{k: f[k] for k in ("file", "shard", "pieces")} for f in files],
    }


def _remove_other_saves(target: Path, token: str) -> None:
    """Delete the files of earlier saves (only names this module writes)."""
    for entry in os.scandir(target):
        match = _OURS.match(entry.name)
        if match and (match["a"] or match["b"]) != token:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def load_sharded_checkpoint(
    directory: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    *,
    map_location: Any = "cpu",
) -> dict[str, Any] | None:
    """Load the checkpoint ``save_sharded_checkpoint`` wrote to ``directory`` into the sharded
    ``optimizer`` (any world size and ``sharding_degree``): the param groups, and the state of
    the slices this rank owns, read from the files that hold them. Returns the ``state`` that
    was saved with it (loaded with ``map_location``), or None when ``directory`` holds no
    index. Not collective. CheckpointError for a checkpoint of another model or optimizer
    class, a missing or foreign file, or elements no file holds."""
    step = _require(optimizer, "load_sharded_checkpoint")
    target = Path(os.fspath(directory))
    index = read_index(target)
    if index is None:
        return None
    position = _match_params(step, index, target)
    common = load_checkpoint(target / index["common"], map_location=map_location)
    if common is None or common.get("token") != index["token"]:
        raise CheckpointError(f"load_sharded_checkpoint: {target / index['common']} {_FOREIGN}")
    load_param_groups(step, common["param_groups"])
    if step.optimizer is None:  # this rank owns no elements
        return common["state"]
    files = index["files"]
    holdings = {f: [(position[p], a, b) for p, a, b in e["pieces"]] for f, e in enumerate(files)}
    opened: dict[int, dict[str, Any]] = {}

    def read(f: int, j: int) -> dict[str, torch.Tensor]:
        if f not in opened:
            opened[f] = _open(target / files[f]["file"], index["token"])
        return opened[f]["state"][j]

    step.optimizer.state.clear()
    groups = {int(g): info for g, info in index["groups"].items()}
    lost = fill(step, groups, holdings, read)
    if lost:
        p, a, b = lost[0]
        raise CheckpointError(
            f"load_sharded_checkpoint: no file of {target / INDEX} holds elements {a}:{b} of "
            f"{step.names[p]} ({len(lost)} such ranges): the index is damaged"
        )
    return common["state"]


_FOREIGN = (
    "belongs to another save than the index (the directory mixes files of two saves, or the "
    "file was replaced): restore the directory as save_sharded_checkpoint left it"
)


def read_index(target: Path) -> dict[str, Any] | None:
    try:
        index = json.loads((target / INDEX).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"load_sharded_checkpoint: {target / INDEX}: {exc}") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(
            f"load_sharded_checkpoint: {target / INDEX} is not the index of a sharded "
            "checkpoint (save_sharded_checkpoint writes it)"
        )
    if index.get("version") != VERSION:
        raise CheckpointError(
            f"load_sharded_checkpoint: {target / INDEX} has format version "
            f"{index.get('version')}; this longboat reads version {VERSION}"
        )
    return index


def _match_params(step: ShardOptimizer, index: dict[str, Any], target: Path) -> list[int]:
    """Saved parameter index -> this model's; CheckpointError naming what differs."""
    where = f"load_sharded_checkpoint: {target}"
    if index["optimizer"] != type(step.user).__name__:
        raise CheckpointError(
            f"{where} holds the state of {index['optimizer']}, not of "
            f"{type(step.user).__name__}: load it into the optimizer class that saved it"
        )
    names = {n: i for i, n in enumerate(step.names)}
    group_of = step.group_of
    position, seen = [], set()
    for saved in index["params"]:
        i = names.get(saved["name"])
        if i is None or list(step.params[i].shape) != saved["shape"]:
            shape = "absent" if i is None else f"of shape {tuple(step.params[i].shape)}"
            raise CheckpointError(
                f"{where} holds {saved['name']} of shape {tuple(saved['shape'])}, which this "
                f"model's trained parameters have {shape}: load it into the same model"
            )
        if group_of[i] != saved["group"]:
            raise CheckpointError(
                f"{where}: {saved['name']} was in param group {saved['group']}, here in "
                f"{group_of[i]}: build the optimizer's param groups as the saving job did"
            )
        position.append(i)
        seen.add(i)
    names_of = step.names
    unsaved = [names_of[i] for i, g in enumerate(group_of) if g is not None and i not in seen]
    if unsaved:
        raise CheckpointError(f"{where} has no state for {', '.join(unsaved[:5])}")
    return position


def _open(path: Path, token: str) -> dict[str, Any]:
    """A shard file, memory-mapped; CheckpointError when missing, unreadable or foreign."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(
            f"load_sharded_checkpoint: {path} is missing (the index names it): restore it, "
            "or load an older checkpoint"
        ) from None
    except Exception as exc:
        raise CheckpointError(
            f"load_sharded_checkpoint: {path} cannot be read ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(data, dict) or data.get("token") != token:
        raise CheckpointError(f"load_sharded_checkpoint: {path} {_FOREIGN}")
    return data
