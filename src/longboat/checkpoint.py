"""Atomic checkpoints that resume a training job after a crash or a launcher restart.

    import longboat as lb   # or: from longboat.checkpoint import save_checkpoint, load_checkpoint

    lb.init()
    model, optimizer = lb.distribute(model, optimizer)
    state = lb.load_checkpoint("ckpt/last.pt")          # None on a fresh start
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    for step in range(start, steps):
        train_step(...)
        if step % 100 == 0:                              # rank 0 writes, the others return False
            lb.save_checkpoint("ckpt/last.pt", {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            })

Under ``longboat launch --max-restarts R`` a crashed group restarts and resumes from the last
checkpoint. A save writes a temporary file next to ``path``, fsyncs it, checks that it loads
with ``weights_only=True``, renames it onto ``path`` and fsyncs the directory: a crash at any
moment leaves either the previous checkpoint or the new one, never a torn file. Loading uses
``weights_only=True``: a checkpoint on a shared filesystem is untrusted input, so only tensors,
numbers, strings and plain containers (what ``state_dict()`` holds) come back, never arbitrary
objects.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from longboat.cluster import rank as _rank

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

_TMP_INFIX = ".tmp-"  # temporary files are ".<name>.tmp-<pid>-<random>" in the same directory


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or a file at the checkpoint path could not be loaded."""


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}{_TMP_INFIX}"


def check_state(state: Any) -> None:
    """TypeError unless ``state`` is a mapping with str keys (what save_checkpoint takes)."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"save_checkpoint: state must be a mapping with str keys, e.g. "
            f'{{"model": model.state_dict(), "step": step}}; got {type(state).__name__}'
        )
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        shown = ", ".join(f"{k!r} ({type(k).__name__})" for k in bad[:5])
        raise TypeError(f"save_checkpoint: state keys must be str; got {shown}")


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories can't be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_tmp(path: Path, older_than: float) -> None:
    """Delete temporary files of earlier saves of ``path`` that crashed before their rename."""
    prefix = _tmp_prefix(path)
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            if not entry.name.startswith(prefix):
                continue
            with contextlib.suppress(OSError):
                dead = not _pid_alive(entry.name[len(prefix) :].partition("-")[0])
                if dead or entry.stat(follow_symlinks=False).st_mtime < older_than:
                    os.unlink(entry.path)


def _pid_alive(pid_text: str) -> bool:
    """Whether the process that named a temp file still runs here (unknown counts as alive)."""
    if not pid_text.isdigit():
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _weights_only_detail(exc: BaseException) -> str | None:
    """torch's reason when weights_only refused the file's contents, else None."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return None
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    return text.splitlines()[0].strip()


def save_checkpoint(
    path: str | os.PathLike[str], state: Mapping[str, Any], *, all_ranks: bool = False
) -> bool:
    """Atomically write ``state`` to ``path`` with torch.save; return True if this process wrote.

    Only rank 0 (``longboat.rank()``; works before ``init()``) writes unless ``all_ranks``
    (then give each rank its own path). Parent directories are created. The previous file at
    ``path`` survives a crash at any point: the new one is written to a temporary file in the
    same directory, fsynced, verified to load with ``weights_only=True``, renamed onto ``path``
    and the directory fsynced. Temporary files left by crashed earlier saves are removed.
    Raises TypeError for a state that is not a str-keyed mapping and CheckpointError for a
    state that ``load_checkpoint`` could not load back (e.g. an instance of a custom class).
    """
    check_state(state)
    if not all_ranks and _rank() != 0:
        return False
    target = Path(os.fspath(path))
    if target.is_dir():
        raise IsADirectoryError(f"save_checkpoint: {target} is a directory; give a file path")
    write_atomically(target, lambda f: torch.save(dict(state), f), verify=_verify)
    return True


def write_atomically(
    target: Path,
    write: Callable[[BinaryIO], None],
    verify: Callable[[Path, Path], None] | None = None,
) -> None:
    """``write`` a temporary file next to ``target`` (parents created), fsync it, ``verify(tmp,
    target)`` it, rename it onto ``target`` and fsync the directory: a crash at any moment
    leaves the previous ``target`` or the new one. Temporary files of crashed earlier writes
    of ``target`` are removed."""
    started = time.time()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target, older_than=started)
    tmp = target.with_name(f"{_tmp_prefix(target)}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if verify is not None:
            verify(tmp, target)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _verify(tmp: Path, target: Path) -> None:
    """Load the unpickled structure of ``tmp`` as load_checkpoint will (mmap: tensors not read)."""
    try:
        loaded = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        detail = _weights_only_detail(exc)
        if detail is None:
            raise CheckpointError(
                f"save_checkpoint: the file just written for {target} does not load back "
                f"({type(exc).__name__}: {exc}); the previous checkpoint was kept"
            ) from exc
        raise CheckpointError(
            f"save_checkpoint: state for {target} holds objects that load_checkpoint refuses "
            f"under weights_only=True ({detail}); store tensors, numbers, str, None and "
            "dict/list/tuple of them (e.g. dataclasses.asdict(cfg)), or register the class "
            "with torch.serialization.add_safe_globals([...]) in the loading process too. "
            "The previous checkpoint was kept"
        ) from None
    del loaded


def _unreadable(target: Path, exc: Exception) -> CheckpointError:
    """The error for a file torch.load could not read: refused objects, not an archive, or a
    damaged one; each says what the file is and what to do."""
    if not zipfile.is_zipfile(target):  # garbage bytes, or an archive cut before its index
        return CheckpointError(
            f"load_checkpoint: {target} is not a complete torch checkpoint ({target.stat().st_size}"
            " bytes, no zip archive index): truncated, or written by something else. An "
            "interrupted save_checkpoint leaves the previous file in place; restore this one or "
            "delete it to start from scratch"
        )
    detail = _weights_only_detail(exc)
    if detail is not None:
        return CheckpointError(
            f"load_checkpoint: {target} holds objects that weights_only=True refuses to "
            f"unpickle ({detail}). Checkpoints are untrusted input; if you trust this file "
            "and its class, allowlist it with torch.serialization.add_safe_globals([...])"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return CheckpointError(
        f"load_checkpoint: {target} is a damaged torch checkpoint ({type(exc).__name__}: "
        f"{first}). An interrupted save_checkpoint leaves the previous file in place, so this "
        "one was written by something else; restore it or delete it to start from scratch"
    )


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: Any = "cpu"
) -> dict[str, Any] | None:
    """The dict saved at ``path``, or None if there is no file there.

    Loads with ``torch.load(weights_only=True)``: only tensors, numbers, str, None, dtypes,
    devices and plain containers are rebuilt, so a file from a shared filesystem cannot run
    code. ``map_location`` is passed to torch.load (default "cpu"). Temporary files of crashed
    saves are ignored. Raises CheckpointError naming the path for a corrupt or truncated file
    (save_checkpoint never leaves one: something else wrote it) and for a file holding objects
    that weights_only refuses.
    """
    target = Path(os.fspath(path))
    try:
        state = torch.load(target, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        return None
    except IsADirectoryError as exc:
        raise CheckpointError(
            f"load_checkpoint: {target} is a directory, not a checkpoint file; give the path of "
            "the file save_checkpoint wrote"
        ) from exc
    except OSError as exc:  # permissions, I/O errors
        raise CheckpointError(
            f"load_checkpoint: {target} cannot be read ({exc.strerror or exc}); check its "
            "permissions and the filesystem it lives on"
        ) from exc
    except Exception as exc:
        raise _unreadable(target, exc) from exc
    if not isinstance(state, dict):
        raise CheckpointError(
            f"load_checkpoint: {target} holds a {type(state).__name__}, not the dict that "
            "save_checkpoint writes; it was written by something else"
        )
    return state
