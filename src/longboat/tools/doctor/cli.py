"""``longboat doctor``: every local check in turn, ``--comm``, and the table or JSON output."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict

from longboat.tools.doctor.checks import FAIL, INFO, PASS, WARN, Check
from longboat.tools.doctor.comm import comm_checks
from longboat.tools.doctor.fixes import fix_text
from longboat.tools.doctor.host import (
    check_cuda,
    check_nccl_env,
    check_nofile,
    check_omp,
    check_shm,
    check_torch,
)
from longboat.tools.doctor.network import (
    check_hostname,
    check_interfaces,
    check_port,
    list_interfaces,
)

DEFAULT_PORT = 29500


def local_checks(
    port: int | None = None,
    nproc: int | None = None,
    multi_node: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Check]:
    """Every check of this machine; a check that crashes is reported, not raised."""
    env = os.environ if env is None else env
    under_launcher = "RANK" in env and "MASTER_PORT" in env
    port = port or int(env.get("MASTER_PORT") or DEFAULT_PORT)
    nproc = nproc or int(env.get("LOCAL_WORLD_SIZE") or 1)
    if multi_node is None:
        multi_node = int(env.get("LONGBOAT_NNODES") or env.get("GROUP_WORLD_SIZE") or 1) > 1
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("torch", check_torch),
        ("cuda", check_cuda),
        ("interfaces", lambda: check_interfaces(list_interfaces(), env)),
        ("hostname", lambda: check_hostname(bool(multi_node))),
        ("master port", lambda: check_port(port, under_launcher)),
        ("/dev/shm", check_shm),
        ("open files", check_nofile),
        ("OMP_NUM_THREADS", lambda: check_omp(env, nproc)),
        ("NCCL env", lambda: check_nccl_env(env)),
    ]
    checks: list[Check] = []
    for name, step in steps:
        try:
            result = step()
        except Exception as exc:  # noqa: BLE001 - one broken probe must not hide the others
            result = Check(
                name,
                WARN,
                f"the check itself failed: {type(exc).__name__}: {exc}",
                fix_text("check crashed"),
            )
        checks += result if isinstance(result, list) else [result]
    return checks


def render(checks: Sequence[Check]) -> None:
    """The checks as a coloured table and a count per status, on the terminal."""
    from rich.console import Console
    from rich.table import Table

    colour = {PASS: "green", WARN: "yellow", FAIL: "red", INFO: "cyan"}
    table = Table(title="longboat doctor", show_lines=False)
    for column in ("check", "status", "found"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail)
    console = Console()
    console.print(table)
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, INFO)}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
    for line in fix_lines(checks):  # whole lines, never wrapped: commands copy as they are
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def fix_lines(checks: Sequence[Check]) -> list[str]:
    """``fix CHECK: ...`` for each WARN or FAIL with a fix, then ``tip CHECK: ...`` for the
    advice of checks that passed."""
    fixes = [f"fix {c.name}: {c.fix}" for c in checks if c.fix and c.status in (FAIL, WARN)]
    tips = [f"tip {c.name}: {c.fix}" for c in checks if c.fix and c.status in (PASS, INFO)]
    return fixes + tips


def to_json(checks: Sequence[Check]) -> str:
    """The checks and a count per status as JSON."""
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, INFO)}
    return json.dumps({"checks": [asdict(c) for c in checks], "summary": counts}, indent=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``longboat doctor``'s options."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"master port to check (default: MASTER_PORT or {DEFAULT_PORT})",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks you plan per node (for OMP_NUM_THREADS; default LOCAL_WORLD_SIZE or 1)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="nodes you plan (loopback hostname is a FAIL when > 1)",
    )
    p.add_argument(
        "--comm",
        action="store_true",
        help="under `longboat launch`: allreduce "
        "between every pair of nodes, naming slow or unreachable ones",
    )
    p.add_argument("--comm-mb", type=int, default=16, help="--comm message size in MB (default 16)")


def run(args: argparse.Namespace) -> int:
    """Run the checks ``args`` ask for and print them; 1 when any FAILs, 2 misuse, else 0."""
    multi = None if args.nnodes is None else args.nnodes > 1
    checks = local_checks(args.port, args.nproc_per_node, multi)
    if args.comm:
        if "RANK" not in os.environ:
            print(fix_text("comm outside launcher"))
            return 2
        pairs = comm_checks(args.comm_mb << 20)
        if int(os.environ["RANK"]) != 0:
            return 0
        checks += pairs
    elif "RANK" in os.environ and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0  # one report per node
    if args.json:
        print(to_json(checks))
    else:
        render(checks)
    return 1 if any(c.status == FAIL for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m longboat.doctor``: parse ``argv`` and run; the exit status."""
    from longboat.tools import doctor

    parser = argparse.ArgumentParser(
        prog="longboat doctor",
        description=doctor.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
