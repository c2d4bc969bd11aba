"""The `longboat` command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

DESCRIPTION = """\
Data-parallel training for PyTorch: start and emulate jobs, check a machine, benchmark,
and predict a cluster's speed. `longboat COMMAND --help` shows a command's options."""

# sub-command -> module exposing `add_arguments(parser)` and `run(args) -> int`
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("longboat.tools.demo", "train a small model on 2 local ranks and check it"),
    "launch": ("longboat.launch.runner", "start ranks on this node through torch's elastic agent"),
    "emulate": (
        "longboat.launch.emulate",
        "emulate several nodes on this machine (network namespaces)",
    ),
    "doctor": ("longboat.tools.doctor", "check this machine and cluster for distributed training"),
    "bench": ("longboat.tools.bench", "benchmark allreduce (comm) or training throughput (train)"),
    "timeline": ("longboat.tools.timeline_cli", "overlap statistics and picture of a trace"),
    "sim": ("longboat.sim.cli", "predict step time, scaling and the best Strategy for a cluster"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (the others stay unloaded)."""
    parser = argparse.ArgumentParser(prog="longboat", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def version_line() -> str:
    """``longboat X (torch Y, Python Z)``, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    from longboat import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"longboat {__version__} (torch {torch}, Python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`longboat doctor --json | head`): end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
