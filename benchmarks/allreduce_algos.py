"""Allreduce bandwidth per algorithm, next to raw Gloo and the machine's limits, in one run.

    python benchmarks/allreduce_algos.py --nproc 2
    longboat emulate --nodes 2 --nproc-per-node 2 --bandwidth 1gbit -- benchmarks/allreduce_algos.py

A thin caller of `longboat bench comm` (``longboat.tools.bench.comm``) printing a Markdown table
for docs/BENCHMARKS.md; see that module for the definitions (nccl-tests' algbw and busbw).
"""

from __future__ import annotations

import argparse
import sys

from longboat.tools.bench import comm


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    comm.add_arguments(parser)
    parser.set_defaults(algorithms="native,ring,shm,hierarchical", markdown=True)
    return comm.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
