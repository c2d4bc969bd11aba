"""A stand-in for an elastic node under `longboat emulate` fault tests: no torch, no training.

    fault_probe.py --log-dir DIR [--steps N] [--interval S] [-- LAUNCHER ARGV...]

Writes 1, 2, ..., N into ``DIR/.elastic/commits-0`` (whole-file replace), one every S seconds,
as an elastic rank records its committed steps, then exits 0. The launcher command emulate
would have run (after ``--``) is printed as ``probe launcher: ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("launcher", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    launcher = args.launcher[1:] if args.launcher[:1] == ["--"] else args.launcher
    print(f"probe launcher: {' '.join(launcher)}", flush=True)
    directory = Path(args.log_dir) / ".elastic"
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "commits-0"
    for step in range(1, args.steps + 1):
        time.sleep(args.interval)
        scratch = directory / f".commits-0.{os.getpid()}"
        scratch.write_text(str(step))
        scratch.replace(target)
        print(f"probe step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
