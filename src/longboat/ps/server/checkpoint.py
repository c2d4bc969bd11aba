"""Server checkpoints: ``<dir>/server<i>-step<v>.pt`` written atomically, the newest kept.

A sync job's servers save at the same step ``v`` (``lb.ps.save`` or every ``period`` steps),
so a restarted server and its peers can all return to ``v`` together (``restore``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from longboat.checkpoint import load_checkpoint, save_checkpoint

KEEP = 3
_NAME = re.compile(r"server(\d+)-step(\d+)\.pt$")


def path_for(directory: str | Path, index: int, step: int) -> Path:
    return Path(directory) / f"server{index}-step{step}.pt"


def steps_saved(directory: str | Path, index: int) -> list[int]:
    """Steps with a checkpoint of server ``index`` in ``directory``, ascending."""
    found = []
    for p in Path(directory).glob(f"server{index}-step*.pt"):
        m = _NAME.search(p.name)
        if m and int(m.group(1)) == index:
            found.append(int(m.group(2)))
    return sorted(found)


def save(directory: str | Path, index: int, step: int, state: dict[str, Any]) -> Path:
    """Write server ``index``'s ``state`` at ``step``; drop all but the newest ``KEEP``."""
    path = path_for(directory, index, step)
    save_checkpoint(path, state, all_ranks=True)
    for old in steps_saved(directory, index)[:-KEEP]:
        path_for(directory, index, old).unlink(missing_ok=True)
    return path


def load(directory: str | Path, index: int, step: int | None = None) -> dict[str, Any] | None:
    """Server ``index``'s checkpoint at ``step`` (default: the newest), or None if there is none."""
    steps = steps_saved(directory, index)
    if step is None:
        step = steps[-1] if steps else None
    if step is None:
        return None
    if step not in steps:
        raise FileNotFoundError(
            f"no checkpoint of server {index} at step {step} in {directory} (have: {steps})"
        )
    return load_checkpoint(path_for(directory, index, step))


def rows_path(directory: str | Path, index: int, step: int, table: int) -> Path:
    """The chunked row file of the ``table``-th lazy table in server ``index``'s checkpoint."""
    return Path(directory) / f"server{index}-step{step}.table{table}.rows"


def save_streaming(directory: str | Path, index: int, step: int, server: Any) -> Path:
    """``save`` of a ``ServerState``: its lazy tables stream their rows to ``rows_path`` files
    and their admission counters to ``.admission.rows`` files beside them (chunks, never a
    copy of the table) written before the checkpoint that names them; such files of steps no
    longer kept are removed."""
    Path(directory).mkdir(parents=True, exist_ok=True)  # the row files come first
    state = server.state_dict(lambda k: rows_path(directory, index, step, k))
    path = save(directory, index, step, state)
    kept = set(steps_saved(directory, index))
    for p in Path(directory).glob(f"server{index}-step*.table*.rows"):
        m = re.search(r"server(\d+)-step(\d+)\.table\d+(\.admission)?\.rows$", p.name)
        if m and int(m.group(1)) == index and int(m.group(2)) not in kept:
            p.unlink(missing_ok=True)
    return path
