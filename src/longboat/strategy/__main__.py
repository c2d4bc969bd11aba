"""``python -m longboat.strategy``: print the effective strategy, the generated field reference
or the registered plug-ins; refresh the generated reference and typing stub."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from longboat.strategy.core import Strategy
from longboat.strategy.render import plugins_markdown, reference_markdown, replace_generated
from longboat.strategy.stub import STUB_PATH, write_stub
from longboat.strategy.values import StrategyError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longboat.strategy", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print the field reference")
    parser.add_argument(
        "--plugins",
        action="store_true",
        help="print the registered allreduce algorithms and gradient compressors",
    )
    parser.add_argument(
        "--write-docs",
        metavar="PATH",
        help="refresh the generated block of a markdown file, and the typing stub that type "
        f"checkers and editors read ({STUB_PATH.name} in the package)",
    )
    parser.add_argument("--config", metavar="PATH", help="load a .yaml/.json strategy first")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(reference_markdown())
        return 0
    if args.plugins:
        sys.stdout.write(plugins_markdown())
        return 0
    if args.write_docs:
        path = Path(args.write_docs)
        path.write_text(replace_generated(path.read_text(encoding="utf-8")), encoding="utf-8")
        write_stub()
        return 0
    try:
        strategy = Strategy.load(args.config) if args.config else Strategy()
    except StrategyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(strategy.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
