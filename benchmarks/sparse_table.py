"""Lazy sparse tables on parameter servers next to single-process ``nn.EmbeddingBag``, same run.

    python benchmarks/sparse_table.py --markdown                   # rates, ratio per optimizer
    python benchmarks/sparse_table.py --memory-rows 20000000       # 20 M x 16 Adagrad, 2 servers

Ids are Criteo-like: ``--slots`` categorical slots, each with its own vocabulary (sizes spread
over 3 orders of magnitude, ``--vocab`` rows in all), values Zipf-distributed (exponent
``--zipf``) within a slot. One step looks up ``--batch`` examples x slots ids and updates the
rows they touched (sum-pooled per example, a fixed linear loss). Paths, each timed over
``--steps`` steps after ``--warmup`` steps, median of ``--repeat`` rounds, in ids per second:

- ``EmbeddingBag``: one process, ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SparseAdam``
  or ``torch.optim.Adagrad`` over the dense-numbered ids (the baseline);
- ``server (in-process)``: the same steps against one ``ServerState`` (no gRPC) with a lazy
  table keyed by the raw 64-bit ids (rows created on first update);
- ``server (gRPC)``: one real server process over gRPC, the trainer (this process) merging
  duplicates, pulling, computing the pooled gradient and pushing, as ``SparseLookups`` does.

The ratio is the gRPC server's rate over the baseline's (one server's throughput against one
process). ``--memory-rows N`` instead fills a lazy ``N`` x ``--dim`` Adagrad table on 2 server
processes and prints each server's resident memory and bytes per row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from longboat.ps.server.state import ServerState
from longboat.ps.shared import wire
from longboat.ps.shared.auth import generate_token
from longboat.ps.shared.wire import Message
from longboat.ps.trainer import table_admin
from longboat.ps.trainer.client import Client

OPTIMIZERS = {"adagrad": "Adagrad", "adam": "SparseAdam"}


class CriteoIds:
    """Batches of (dense ids for EmbeddingBag, raw 64-bit ids for the servers), per slot Zipf."""

    def __init__(self, slots: int, vocab: int, zipf: float, key: int = 0) -> None:
        weights = np.logspace(0, 3, slots)
        self.sizes = np.maximum((weights / weights.sum() * vocab).astype(np.int64), 10)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.rows, self.zipf = int(self.sizes.sum()), zipf
        self.rng = np.random.default_rng(key)

    def batch(self, examples: int) -> tuple[torch.Tensor, torch.Tensor]:
        values = (self.rng.zipf(self.zipf, (examples, len(self.sizes))) - 1) % self.sizes
        dense = torch.from_numpy(values + self.offsets)
        raw = torch.from_numpy((np.arange(len(self.sizes)) << 40) + values)
        return dense, raw


def _rate(step: Callable[[int], None], steps: int, warmup: int, ids: int) -> float:
    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    return ids * steps / (time.perf_counter() - start)


def baseline(optimizer: str, batches: list, dim: int, rows: int, lr: float) -> Callable:
    emb = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
    opt = getattr(torch.optim, OPTIMIZERS[optimizer])(emb.parameters(), lr=lr)
    target = torch.randn(len(batches[0][0]), dim)

    def step(i: int) -> None:
        loss = (emb(batches[i % len(batches)][0]) * target).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def _trainer_step(pull: Callable, push: Callable, raw: torch.Tensor, target: torch.Tensor) -> None:
    """What a trainer does per step: merge duplicates, pull, pool, gradient, push."""
    uniq, inverse = torch.unique(raw.reshape(-1), return_inverse=True)
    rows = pull(uniq).requires_grad_(True)
    pooled = rows[inverse].reshape(*raw.shape, -1).sum(1)
    (pooled * target).sum().backward()
    push(uniq, rows.grad)


def table_spec(optimizer: str, dim: int, lr: float, expected: int = 0) -> dict:
    return {"name": "t", "dim": dim, "lazy": True, "optimizer": optimizer,
            "hparams": {"lr": lr}, "expected_rows": expected}  # fmt: skip


def in_process(optimizer: str, batches: list, dim: int, lr: float) -> Callable:
    state = ServerState(0, 1, max_table_bytes=1 << 40)
    state.init(Message({"trainers": 1, "tables": [table_spec(optimizer, dim, lr)]}))
    target = torch.randn(len(batches[0][1]), dim)

    def pull(ids: torch.Tensor) -> torch.Tensor:
        msg = Message({"keys": []}, {"t@ids": ids})
        return wire.decode(state.pull(msg, time.monotonic() + 60)).tensors["t@rows"].clone()

    def push(ids: torch.Tensor, grad: torch.Tensor) -> None:
        state.push(Message({"trainer": 0}, {"t@ids": ids, "t@grad": grad}))

    return lambda i: _trainer_step(pull, push, batches[i % len(batches)][1], target)


def over_grpc(
    client: Client, name: str, optimizer: str, batches: list, dim: int, lr: float
) -> Callable:
    spec = {**table_spec(optimizer, dim, lr), "name": name}
    client.call(0, "init", Message({"trainers": 1, "tables": [spec]}))
    target = torch.randn(len(batches[0][1]), dim)

    def pull(ids: torch.Tensor) -> torch.Tensor:
        reply = client.call(0, "pull", Message({"keys": []}, {f"{name}@ids": ids}))
        return reply.tensors[f"{name}@rows"].clone()

    def push(ids: torch.Tensor, grad: torch.Tensor) -> None:
        client.call(0, "push", Message({"trainer": 0}, {f"{name}@ids": ids, f"{name}@grad": grad}))

    return lambda i: _trainer_step(pull, push, batches[i % len(batches)][1], target)


def start_servers(n: int, token: str) -> tuple[list[subprocess.Popen], list[str]]:
    procs, files = [], []
    env = {**os.environ, "LONGBOAT_PS_TOKEN": token, "OMP_NUM_THREADS": "1"}
    for i in range(n):
        port_file = Path(tempfile.mkdtemp(prefix="lb-bench-"), "endpoint")
        args = [sys.executable, "-m", "longboat.ps.server", "--endpoint", "127.0.0.1:0",
                "--index", str(i), "--servers", str(n), "--port-file", str(port_file)]  # fmt: skip
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL))
        files.append(port_file)
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise RuntimeError("servers did not start")
        time.sleep(0.05)
    time.sleep(0.05)
    return procs, [f.read_text() for f in files]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def rates(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    gen = CriteoIds(args.slots, args.vocab, args.zipf)
    batches = [gen.batch(args.batch) for _ in range(args.steps + args.warmup)]
    ids = args.batch * args.slots
    token = generate_token()
    procs, endpoints = start_servers(1, token)
    client = Client(endpoints, token, timeout=600)
    out = []
    try:
        for optimizer in args.optimizers:
            got: dict[str, list[float]] = {"EmbeddingBag": [], "in-process": [], "gRPC": []}
            for round_ in range(args.repeat):  # a fresh table every round
                steps = {
                    "EmbeddingBag": baseline(optimizer, batches, args.dim, gen.rows, 0.01),
                    "in-process": in_process(optimizer, batches, args.dim, 0.01),
                    "gRPC": over_grpc(
                        client, f"{optimizer}{round_}", optimizer, batches, args.dim, 0.01
                    ),
                }
                for path, step in steps.items():
                    got[path].append(_rate(step, args.steps, args.warmup, ids))
                del steps
            for path, values in got.items():
                out.append((optimizer, path, statistics.median(values)))
    finally:
        client.close()
        for p in procs:
            p.kill()
    return out


def memory(args: argparse.Namespace) -> None:
    """Fill a lazy ``--memory-rows`` x ``--dim`` Adagrad table on 2 server processes."""
    token = generate_token()
    procs, endpoints = start_servers(2, token)
    client = Client(endpoints, token, timeout=600)
    try:
        before = [rss(p.pid) for p in procs]
        spec = table_spec("adagrad", args.dim, 0.01, expected=args.memory_rows)
        init = Message({"trainers": 1, "tables": [spec]})
        client.call_all("init", {0: init, 1: init})
        chunk = 1 << 20
        start = time.perf_counter()
        for first in range(0, args.memory_rows, chunk):
            ids = torch.arange(first, min(first + chunk, args.memory_rows)) * 7919 + (1 << 41)
            grad = torch.randn(len(ids), args.dim)
            calls = []
            for s in range(2):
                m = ids % 2 == s
                msg = Message({"trainer": 0}, {"t@ids": ids[m], "t@grad": grad[m]})
                calls.append(client.start(s, "push", msg))
            for c in calls:
                c.result()
        took = time.perf_counter() - start
        stats = table_admin.table_stats(client)
        for s, p in enumerate(procs):
            st = stats[s]["t"]
            print(
                f"server {s}: {st['rows']} rows, table {st['bytes'] / 2**30:.2f} GiB "
                f"({st['bytes_per_row']:.1f} B/row: weight {st['weight_bytes_per_row']:.1f}, "
                f"state {st['state_bytes_per_row']:.1f}, index {st['index_bytes_per_row']:.1f}; "
                f"float32 row {st['float32_row_bytes']}), RSS {rss(p.pid) / 2**30:.2f} GiB "
                f"(at start {before[s] / 2**30:.2f})"
            )
        print(f"filled {args.memory_rows} rows in {took:.1f} s")
    finally:
        client.close()
        for p in procs:
            p.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--slots", type=int, default=26)
    p.add_argument("--vocab", type=int, default=2_000_000)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--memory-rows", type=int, default=0)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.memory_rows:
        memory(args)
        return
    results = rates(args)
    base = {opt: r for opt, path, r in results if path == "EmbeddingBag"}
    if args.markdown:
        print("| optimizer | path | ids/s (median) | vs EmbeddingBag |")
        print("|---|---|---|---|")
    for opt, path, r in results:
        ratio = r / base[opt]
        if args.markdown:
            print(f"| {opt} | {path} | {r / 1e6:.2f} M | {ratio:.0%} |")
        else:
            print(f"{opt:8s} {path:14s} {r / 1e6:8.2f} M ids/s  {ratio:6.1%} of EmbeddingBag")


if __name__ == "__main__":
    main()
