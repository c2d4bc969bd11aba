"""`longboat emulate`'s command-line options (the run itself: `longboat.launch.emulate`)."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 29500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `longboat emulate`'s options on ``parser``."""
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument(
        "--bandwidth",
        default="1gbit",
        help="each node's link rate, both directions, in tc units (default 1gbit)",
    )
    parser.add_argument(
        "--latency",
        default=None,
        help="one-way node-to-node delay, e.g. 10ms (needs the kernel's netem qdisc)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="when a node fails, let the other nodes run on instead of stopping them",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_PORT,
        help="rendezvous port on node 0 (elastic runs: on the bridge, hosted by emulate)",
    )
    ps = parser.add_argument_group(
        "parameter-server runs",
        "--server-nodes K --servers S --workers W: the first K nodes run only servers (S spread "
        "evenly), the other nodes only trainers (W spread evenly); replaces --nproc-per-node",
    )
    ps.add_argument(
        "--server-nodes", type=int, default=None, metavar="K", help="nodes that run only servers"
    )
    ps.add_argument("--servers", type=int, default=None, metavar="S", help="servers in the job")
    ps.add_argument("--workers", type=int, default=None, metavar="W", help="trainers in the job")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="static runs: each node's launcher restarts its ranks up to this many times",
    )
    elastic = parser.add_argument_group(
        "elastic runs and faults",
        "Any of these makes the run elastic: launchers get --nnodes MIN:MAX (MAX = --nodes plus "
        "one per --add-node) and a rendezvous hosted by emulate on the bridge. WHEN is a time "
        "since all nodes started (10s, 2.5s) or a training step (step=5: once any node's "
        "highest committed step reaches 5). A node emulate killed, or whose link it cut, does "
        "not fail the run.",
    )
    elastic.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        metavar="M",
        help="run elastic with --nnodes M:MAX (1 <= M <= --nodes; default 1 when faults are given)",
    )
    elastic.add_argument(
        "--kill-node",
        action="append",
        default=[],
        metavar="NODE@WHEN",
        help="SIGKILL every process of node NODE (launcher and ranks) at WHEN; repeatable",
    )
    elastic.add_argument(
        "--cut-link",
        action="append",
        default=[],
        metavar="NODE@WHEN",
        help="take node NODE's link down (both veth ends) at WHEN; repeatable",
    )
    elastic.add_argument(
        "--restore-link",
        action="append",
        default=[],
        metavar="NODE@WHEN",
        help="bring node NODE's link up again at WHEN (after a --cut-link of it); repeatable",
    )
    elastic.add_argument(
        "--add-node",
        action="append",
        default=[],
        metavar="WHEN",
        help="start one more node (a spare namespace, the next index) at WHEN; repeatable",
    )
    parser.add_argument(
        "--log-dir", default=None, help="per-node launcher logs go to LOG_DIR/node<i>"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop all nodes after this many seconds"
    )
    parser.add_argument(
        "--launcher",
        choices=("longboat", "torchrun"),
        default="longboat",
        help="what each node runs: `longboat launch` (default) or plain torchrun",
    )
    parser.add_argument(
        "--run-id", default=None, help="6 hex digits naming this run's objects (default: random)"
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces/links left by crashed earlier runs, then exit",
    )
    parser.add_argument("script", nargs="?", help="training script each rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
