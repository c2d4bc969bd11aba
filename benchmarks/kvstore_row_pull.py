"""``row_sparse_pull`` of a few rows next to a full ``pull`` of a large embedding key.

    python benchmarks/kvstore_row_pull.py --rows 1000000 --dim 16 --ids 1000 --repeats 5

One worker of a ``dist_sync`` store on 2 parameter servers (threads of this process, gRPC over
127.0.0.1) inits a ``rows x dim`` float32 key, then times a full pull and a row pull of ``ids``
random distinct rows, alternating. Prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import longboat.kvstore as kvstore
from longboat.ps.server import Server
from longboat.ps.shared.auth import generate_token


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--ids", type=int, default=1000, help="rows asked by each row pull")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    token = generate_token()
    servers = [Server(index=i, num_servers=2, token=token).start() for i in range(2)]
    kv = kvstore.create("dist_sync", servers=[s.endpoint for s in servers], token=token,
                        rank=0, num_workers=1)  # fmt: skip
    try:
        kv.init("emb", torch.randn(a.rows, a.dim))
        ids = torch.randperm(a.rows, generator=torch.Generator().manual_seed(0))[: a.ids]
        out = kvstore.RowSparse.zeros((a.rows, a.dim))
        full = median_s(lambda: kv.pull("emb"), a.repeats)
        rows = median_s(lambda: kv.row_sparse_pull("emb", out=out, row_ids=ids), a.repeats)
        print(
            f"{a.rows} x {a.dim} float32, {a.ids} rows: full pull {full * 1e3:.2f} ms, "
            f"row_sparse_pull {rows * 1e3:.2f} ms (median of {a.repeats}; {full / rows:.0f}x)"
        )
    finally:
        kv.close()
        for s in servers:
            s.stop(0)


if __name__ == "__main__":
    main()
