"""`longboat bench comm`: allreduce bandwidth per algorithm, next to raw Gloo and the machine's limits.

For each registered algorithm (`longboat.comm.algorithms`) usable on this cluster and each size it
reports the median time and nccl-tests' definitions: ``algbw = S / t`` and
``busbw = algbw * 2 (n - 1) / n`` (the per-link traffic of a ring allreduce of S bytes over n
ranks). "gloo" is ``torch.distributed.all_reduce`` called directly (the baseline); "native" is
the same collective through longboat's algorithm interface. The limits are measured on the spot:
one loopback TCP stream between two threads, and a large memory copy.

Run plainly it starts ``--nproc`` local ranks; under a launcher (RANK set) every rank takes part
and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from longboat import cluster
from longboat.tools.progress import progress
from longboat.words import plural

DEFAULT_SIZES = "1K,16K,256K,1M,4M,16M,64M,256M"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """``"1K,4M"`` -> ``[1024, 4194304]`` (bytes; multiples of 4, float32 elements)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().upper().removesuffix("B")
        scale = _UNITS.get(item[-1:], 1)
        number = item[:-1] if item[-1:] in _UNITS else item
        try:
            size = int(float(number) * scale)
        except ValueError:
            raise ValueError(f"--sizes: {item!r} is not a size such as 4K or 16M") from None
        if size < 4 or size % 4:
            raise ValueError(f"--sizes: {item!r} must be a positive multiple of 4 bytes")
        sizes.append(size)
    return sizes


def human(n: int) -> str:
    """1024 -> '1 KB', 1048576 -> '1 MB'."""
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB" if n >= 1 << 10 else f"{n} B"


def default_repeats(size: int) -> int:
    return 20 if size <= 1 << 20 else 7 if size <= 16 << 20 else 3


def busbw_factor(world: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2 (n - 1) / n."""
    return 2 * (world - 1) / world


def time_collective(run: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``run`` (one warm-up discarded), ranks aligned by a barrier each time."""
    run()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(
    algorithms: Sequence[str], sizes: Sequence[int], repeats: int | None = None
) -> dict[str, dict[int, float]]:
    """Median seconds per (algorithm, size); collective: every rank calls it."""
    from longboat.comm import algorithms as registry

    group = cluster.new_group()
    fns = {name: registry.make(name, group) for name in algorithms}
    out: dict[str, dict[int, float]] = {"gloo": {}} | {name: {} for name in algorithms}
    with progress("bench comm", len(sizes), cluster.rank() == 0, size="-") as done:
        for size in sizes:
            tensor = torch.ones(size // 4)
            n = repeats or default_repeats(size)
            out["gloo"][size] = time_collective(lambda t=tensor: dist.all_reduce(t, group=group), n)
            for name, fn in fns.items():
                out[name][size] = time_collective(lambda t=tensor, f=fn: f(t).wait(), n)
            done(size=human(size))
    return out


def loopback_tcp_limit(nbytes: int = 256 << 20) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 between two threads of this process."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    chunk = bytearray(min(4 << 20, nbytes))

    def sink() -> None:
        conn, _ = server.accept()
        buf = bytearray(4 << 20)
        got = 0
        while got < nbytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        conn.close()

    reader = threading.Thread(target=sink)
    reader.start()
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    start = time.perf_counter()
    sent = 0
    while sent < nbytes:
        client.sendall(chunk)
        sent += len(chunk)
    client.close()
    reader.join(60)
    server.close()
    return sent / (time.perf_counter() - start)


def memcpy_limit(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a large tensor copy (a copy of S bytes counted as S)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples)


def usable_algorithms(requested: Sequence[str] | None, nodes: int) -> list[str]:
    """Requested (default: every registered) algorithms that apply to ``nodes`` nodes."""
    from longboat.comm import algorithms as registry

    names = list(requested) if requested else registry.names()
    return [
        a
        for a in names
        if not (a == "shm" and nodes > 1) and not (a == "hierarchical" and nodes == 1)
    ]


def rank_main(
    algorithms: Sequence[str] | None, sizes: Sequence[int], repeats: int | None = None
) -> dict[str, Any] | None:
    """Every rank: measure; rank 0 also measures the limits and returns the report."""
    import longboat as lb

    lb.init()
    torch.set_num_threads(1)
    topo = lb.topology()
    usable = usable_algorithms(algorithms, topo.nodes)
    times = measure(usable, sizes, repeats)
    if lb.rank() != 0:
        return None
    world = lb.world_size()
    limit_bytes = max(sizes[-1], 16 << 20)
    return {
        "world_size": world,
        "nodes": topo.nodes,
        "sizes": list(sizes),
        "busbw_factor": busbw_factor(world),
        "results": {
            name: {
                str(size): {
                    "seconds": t,
                    "algbw_GBps": size / t / 1e9,
                    "busbw_GBps": size / t * busbw_factor(world) / 1e9,
                }
                for size, t in per_size.items()
            }
            for name, per_size in times.items()
        },
        "loopback_tcp_GBps": loopback_tcp_limit(limit_bytes) / 1e9,
        "memcpy_GBps": memcpy_limit(limit_bytes) / 1e9,
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table (time and busbw per algorithm) plus the limits line."""
    names = list(report["results"])
    head = "| size | " + " | ".join(f"{n} time | {n} busbw GB/s" for n in names) + " |"
    rows = [head, "|" + "---|" * (1 + 2 * len(names))]
    for size in report["sizes"]:
        cells = []
        for n in names:
            r = report["results"][n][str(size)]
            cells += [f"{r['seconds'] * 1e3:.3f} ms", f"{r['busbw_GBps']:.2f}"]
        rows.append(f"| {human(size)} | " + " | ".join(cells) + " |")
    return "\n".join([*rows, "", limits_line(report)])


def limits_line(report: dict[str, Any]) -> str:
    return (
        f"loopback TCP stream limit: {report['loopback_tcp_GBps']:.2f} GB/s; memory copy limit: "
        f"{report['memcpy_GBps']:.2f} GB/s (measured now); busbw = algbw x "
        f"{report['busbw_factor']:.2f} for {plural(report['world_size'], 'rank')}"
    )


def render(report: dict[str, Any]) -> None:
    """One row per (algorithm, size): time, algbw, busbw and the time ratio to raw Gloo."""
    from rich.table import Table

    from longboat.console import table_console

    table = Table(
        title=f"allreduce, {plural(report['world_size'], 'rank')} on "
        f"{plural(report['nodes'], 'node')}, float32"
    )
    for column in ("algorithm", "size", "time ms", "algbw GB/s", "busbw GB/s", "time / gloo"):
        table.add_column(column, justify="left" if column == "algorithm" else "right")
    gloo = report["results"]["gloo"]
    for name, per_size in report["results"].items():
        for size in report["sizes"]:
            r = per_size[str(size)]
            ratio = r["seconds"] / gloo[str(size)]["seconds"]
            table.add_row(
                name,
                human(size),
                f"{r['seconds'] * 1e3:.3f}",
                f"{r['algbw_GBps']:.3f}",
                f"{r['busbw_GBps']:.3f}",
                f"{ratio:.2f}",
            )
        table.add_section()
    console = table_console()
    console.print(table)
    console.print(limits_line(report))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2)")
    p.add_argument(
        "--algorithms", default=None, help="comma list (default: every registered algorithm)"
    )
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per size (default 20/7/3)"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")


def run(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.sizes)
    algorithms = args.algorithms.split(",") if args.algorithms else None
    if "RANK" in os.environ:
        report = rank_main(algorithms, sizes, args.repeats)
    else:
        from longboat.launch.local import launch_local

        report = launch_local(rank_main, (algorithms, sizes, args.repeats), nproc=args.nproc)[0]
    if report is None:
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        print(markdown(report))
    else:
        render(report)
    return 0
