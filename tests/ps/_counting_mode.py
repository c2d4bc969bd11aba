"""A toy parameter-server mode for tests: sync, counting its steps; registered on demand."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from longboat.ps.trainer import modes
from longboat.ps.trainer.modes.sync import SyncStep

NAME = "counting_sync"


class CountingSync(SyncStep):
    """The sync step, counting how often it ran."""

    def __init__(self, ctx: modes.ModeContext) -> None:
        super().__init__(ctx)
        self.steps = 0

    def step(self) -> None:
        super().step()
        self.steps += 1


@contextlib.contextmanager
def registered() -> Iterator[type[CountingSync]]:
    """``CountingSync`` selectable as ``mode=NAME`` inside the block."""
    modes.register(NAME)(CountingSync)
    try:
        yield CountingSync
    finally:
        modes.unregister(NAME)
