"""The console longboat prints its tables to."""

from __future__ import annotations

import os

from rich.console import Console

#: Width of tables written to a file or a pipe (a CI log), where no terminal says how wide.
LOG_WIDTH = 160


def table_console(stderr: bool = False) -> Console:
    """The terminal's width on a terminal (``COLUMNS`` when set); in a log or a pipe, wide
    enough that cells are never folded mid-number."""
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=LOG_WIDTH)
    return console
