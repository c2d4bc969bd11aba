"""`longboat bench comm` (allreduce bandwidth) and `longboat bench train` (throughput, scaling)."""

from __future__ import annotations

import argparse
import importlib

_KINDS = {
    "comm": ("longboat.tools.bench.comm", "allreduce algbw/busbw per algorithm and size"),
    "train": ("longboat.tools.bench.train", "samples/s, speedup and efficiency vs torch DDP"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    for name, (module, help_text) in _KINDS.items():
        importlib.import_module(module).add_arguments(
            sub.add_parser(name, help=help_text, description=help_text)
        )


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(_KINDS[args.kind][0]).run(args) or 0)
