"""One progress display for long work (`bench`, `demo`): rich's bar with elapsed time and ETA on
a terminal, nothing at all when the output is a file or a pipe (logs stay clean)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def progress(
    description: str, total: int | None, show: bool = True, **fields: Any
) -> Iterator[Callable[..., None]]:
    """Yield ``advance(steps=1, **fields)``: move the bar and update ``fields``, shown as
    ``name value`` after the bar (``loss=0.1234``). A no-op when ``show`` is false or stderr
    is not a terminal."""
    from rich.console import Console

    console = Console(stderr=True)
    if not (show and console.is_terminal):
        yield lambda steps=1, **_: None
        return
    shown = "  ".join(f"{name} {{task.fields[{name}]}}" for name in fields)
    with make_bar(console, shown) as bar:
        task = bar.add_task(description, total=total, **{k: _fmt(v) for k, v in fields.items()})

        def advance(steps: int = 1, **update: Any) -> None:
            bar.update(task, advance=steps, **{k: _fmt(v) for k, v in update.items()})

        yield advance


def make_bar(console: Any, fields: str) -> Any:
    """A rich Progress: description, bar, done/total, ``fields`` (a column template), elapsed
    time and ETA (also `lb.log_every`'s bar)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(fields),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
    )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
