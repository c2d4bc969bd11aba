"""`longboat launch`'s argparse definition: its options, their groups and help, and the
argparse types that parse ``--nnodes`` and ports (validation: `longboat.launch.options`)."""

from __future__ import annotations

import argparse
import copy

from longboat.launch.ps_endpoints import count_or_endpoints


class _DashHelpFormatter(argparse.HelpFormatter):
    """Help shows the dash spelling of an option; its underscore twin is accepted unlisted."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        names = action.option_strings
        shown = [n for n in names if not ("_" in n and n.replace("_", "-") in names)]
        if shown != names:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `longboat launch` (and `python -m longboat.launch`)."""
    p.formatter_class = _DashHelpFormatter
    procs = p.add_argument_group("processes")
    procs.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        help="ranks on this node (default: number of --gpus, else 1)",
    )
    procs.add_argument(
        "--gpus",
        "--devices",
        dest="devices",
        default=None,
        help="comma list of device ids, one rank per device (pins each rank)",
    )
    procs.add_argument(
        "-np",
        "--num-proc",
        "--num_proc",
        dest="num_proc",
        type=int,
        default=None,
        help="horovodrun's -np: total ranks (one host: --nproc-per-node; see -H)",
    )
    procs.add_argument(
        "-H",
        "--hosts",
        dest="hosts",
        default=None,
        help="horovodrun's host list h1:slots,h2:slots (several hosts: --ips and equal slots; "
        "run the same command on every host)",
    )
    procs.add_argument(
        "--servers",
        "--server-num",
        "--server_num",
        type=count_or_endpoints,
        default=0,
        help="parameter-server mode: server processes on this node (0 on a trainer-only node "
        "of a multi-node job), or every server's ip:port (Paddle style: the same list on "
        "every node; each node runs the entries with its own ip)",
    )
    procs.add_argument(
        "--workers",
        "--worker-num",
        "--worker_num",
        type=count_or_endpoints,
        default=0,
        help="parameter-server mode: trainer processes on this node (0 on a server-only node "
        "of a multi-node job), or every trainer's ip:port (with --servers ip:port,...)",
    )
    procs.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="parameter-server mode: where servers write checkpoints (lb.ps.save(), "
        "LONGBOAT_PS_CHECKPOINT_EVERY) and restart from; sets LONGBOAT_PS_CHECKPOINT_DIR "
        "for every rank",
    )
    cluster = p.add_argument_group("cluster")
    cluster.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's one-node mode: 127.0.0.1 and a free port (the default on one node; "
        "MASTER_ADDR/MASTER_PORT in the environment are then ignored)",
    )
    cluster.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        metavar="N|MIN:MAX",
        help="number of nodes (default 1); MIN:MAX runs an elastic job that goes on while at "
        "least MIN nodes are alive and admits nodes that join, up to MAX (see docs/elastic.md)",
    )
    cluster.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        help="this node's index (default 0, or its position in --ips)",
    )
    cluster.add_argument(
        "--master",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous endpoint on node 0 (default: MASTER_ADDR and MASTER_PORT from the "
        "environment, else 127.0.0.1 and a free port)",
    )
    cluster.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="HOST",
        help="torchrun's spelling of the HOST of --master",
    )
    cluster.add_argument(
        "--master-port",
        "--master_port",
        type=_port,
        default=None,
        metavar="PORT",
        help="torchrun's spelling of the PORT of --master",
    )
    cluster.add_argument(
        "--ips",
        default=None,
        help="Paddle-style comma list of node addresses; the first is the master",
    )
    run = p.add_argument_group("run")
    run.add_argument("--log-dir", "--log_dir", default="log", help="per-rank logs (default log/)")
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restart the whole group up to this many times after a failure (each restart is "
        "reported on the console)",
    )
    run.add_argument(
        "--failure-timeout",
        "--failure_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a collective waits for a silent peer before it counts as lost "
        "(exported as LONGBOAT_TIMEOUT; default 300, elastic jobs 30)",
    )
    run.add_argument("--config", default=None, help="a Strategy YAML/JSON file exported to ranks")
    run.add_argument(
        "--tee",
        choices=["0", "all"],
        default="0",
        help="ranks shown on this console: 0 (trainer 0, the default) or all",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for rendezvous and for servers to accept (default 300)",
    )
    p.add_argument("-m", "--module", action="store_true", help="run TARGET as a module")
    p.add_argument("target", metavar="TARGET", help="the training script (or module with -m)")
    p.add_argument("target_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _port(text: str) -> int:
    """An argparse type: a TCP port in 1..65535."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {text!r}")
    return int(text)


def _nnodes(text: str) -> tuple[int | None, int]:
    """``N`` -> (None, N); ``MIN:MAX`` -> (MIN, MAX), an elastic job."""
    low, colon, high = text.partition(":")
    try:
        values = (int(low), int(high)) if colon else (None, int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a node count: give N, or MIN:MAX for an elastic job (e.g. 2:4)"
        ) from None
    first, most = values
    if most < 1 or (first is not None and not 1 <= first <= most):
        raise argparse.ArgumentTypeError(
            f"{text!r}: node counts must be >= 1 and MIN <= MAX (e.g. 2:4)"
        )
    return first, most
