"""CTR training step: parameter servers vs collective allreduce, same model, same global batch,
same run, on emulated nodes with 1 Gbit links (run as root).

    sudo python benchmarks/ctr_training.py --steps 10 --batch 4096 --max-rows 1000000

Data: ``longboat.data.ctr`` (26 Zipf slots with Criteo's cardinalities capped at
``--max-rows``, 13 dense features). Model: ``longboat.models.ctr.CTRModel`` (one table of all
slots' rows x ``--dim``, a DLRM-like tower), Adagrad. The two setups:

* PS: ``longboat emulate --nodes 4 --server-nodes 2 --servers 2 --workers 2`` (2 server nodes,
  2 trainer nodes), the table in an ``lb.ps.SparseEmbedding`` (a step pulls and pushes only
  the rows its batch uses), sync mode. Where ``longboat emulate`` has no ``--server-nodes``,
  ``longboat launch --servers 2 --workers 2`` on this machine's loopback instead (reported).
* collective: ``longboat emulate --nodes 2``, the table in an ``nn.Embedding``: its dense
  ``rows x dim`` gradient is allreduced every step with the tower's.

Every trainer draws half of the global batch, one thread per process. Reported: trainer 0's
median step time over ``--steps`` steps after warm-up, samples/s of the global batch, the
table values a trainer sends (and receives) per step (PS: the rows of its batch's distinct
ids; collective: the whole gradient, as a 2-rank ring allreduce sends), and the ratio
collective / PS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

WARMUP = 3


def rank_main(a: argparse.Namespace) -> None:
    """One rank of either job (started by emulate or launch)."""
    import longboat as lb
    from longboat.data.ctr import CTRConfig, CTRData, criteo_vocab
    from longboat.models.ctr import CTRModel, make_optimizer

    if a.mode == "ps" and lb.is_server():
        lb.ps.run_server()
        return
    torch.set_num_threads(1)
    config = CTRConfig(vocab=criteo_vocab(a.max_rows))
    model = CTRModel(config, a.dim, sparse=a.mode == "ps")
    strategy = lb.Strategy(mode="ps", a_sync=False) if a.mode == "ps" else lb.Strategy()
    t0 = time.perf_counter()
    m, opt = lb.distribute(model, make_optimizer(model), strategy)
    setup_s = time.perf_counter() - t0
    if a.mode == "ps":
        trainer, trainers = m.engine.trainer, m.engine.trainers
    else:
        trainer, trainers = lb.rank(), lb.world_size()
    data = CTRData(config, a.batch, trainer, trainers)
    batches = [data.batch(s) for s in range(WARMUP + a.steps)]
    times, losses = [], []
    for b in batches:
        t = time.perf_counter()
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(m(b.dense, b.ids), b.labels)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    if a.mode == "ps":
        m.engine.close()
    if trainer == 0:
        rows = [int(b.ids.unique().numel()) for b in batches[WARMUP:]]
        out = {"times": times[WARMUP:], "losses": losses, "unique_rows": rows,
               "setup_s": setup_s, "trainers": trainers, "total_rows": config.total_rows}  # fmt: skip
        Path(a.rank).write_text(json.dumps(out))


def emulate_has_server_nodes() -> bool:
    done = subprocess.run([sys.executable, "-m", "longboat", "emulate", "--help"],
                          capture_output=True, text=True)  # fmt: skip
    return "--server-nodes" in done.stdout


def run_job(mode: str, a: argparse.Namespace, via: str) -> dict[str, Any]:
    """Run one job; return trainer 0's measurements."""
    tmp = Path(tempfile.mkdtemp(prefix=f"ctr-{mode}-"))
    out, log = tmp / "out.json", tmp / "log"
    job = [__file__, "--rank", str(out), "--mode", mode, "--steps", str(a.steps),
           "--batch", str(a.batch), "--max-rows", str(a.max_rows), "--dim", str(a.dim)]  # fmt: skip
    lb = [sys.executable, "-m", "longboat"]
    emulate = [
        *lb,
        "emulate",
        "--bandwidth",
        a.bandwidth,
        "--timeout",
        "900",
        "--log-dir",
        str(log),
    ]
    if via == "launch":
        cmd = [*lb, "launch", "--servers", "2", "--workers", "2", "--log-dir", str(log), *job]
    elif mode == "ps":
        cmd = [*emulate, "--nodes", "4", "--server-nodes", "2", "--servers", "2",
               "--workers", "2", "--", *job]  # fmt: skip
    else:
        cmd = [*emulate, "--nodes", "2", "--", *job]
    print("$", " ".join(cmd[2:]), flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    print(f"  {mode} job: {time.perf_counter() - start:.0f} s", flush=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{mode} job failed ({done.returncode}), logs in {log}:\n"
                           f"{done.stdout[-6000:]}{done.stderr[-3000:]}")  # fmt: skip
    result = json.loads(out.read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    p.add_argument("--batch", type=int, default=4096, help="global batch")
    p.add_argument("--max-rows", type=int, default=1_000_000, help="cap per slot")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--bandwidth", default="1gbit", help="emulated link rate")
    p.add_argument("--ps-via", choices=["auto", "emulate", "launch"], default="auto")
    p.add_argument("--rank", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["ps", "collective"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank:
        rank_main(a)
        return
    if os.geteuid() != 0:
        sys.exit("run as root: longboat emulate builds network namespaces")
    via = a.ps_via
    if via == "auto":
        via = "emulate" if emulate_has_server_nodes() else "launch"
    load = [os.getloadavg()[0]]
    ps = run_job("ps", a, via)
    load.append(os.getloadavg()[0])
    coll = run_job("collective", a, "emulate")
    load.append(os.getloadavg()[0])
    rows, dim = ps["total_rows"], a.dim
    print(f"\ntable {rows:,} rows x {dim} ({rows * dim * 4 / 1e6:.0f} MB float32), global batch "
          f"{a.batch}, 2 trainers, {a.steps} timed steps after {WARMUP} warm-up, "
          f"{a.bandwidth} links; PS via {via}\n")  # fmt: skip
    print("| setup | step ms (median) | samples/s | table MB each way per trainer and step |"
          " first / last loss |")  # fmt: skip
    print("|---|---|---|---|---|")
    uniq = statistics.median(ps["unique_rows"])  # trainer 0's distinct ids: pushed, and pulled
    sent = {"ps": uniq * dim * 4 / 1e6, "collective": rows * dim * 4 / 1e6}  # ids not counted
    med = {}
    for name, r in (("ps", ps), ("collective", coll)):
        med[name] = statistics.median(r["times"])
        label = ("PS: 2 server + 2 trainer nodes" if via == "emulate"
                 else "PS: 2 servers + 2 trainers, loopback") if name == "ps" else (
                 "collective: 2 trainer nodes, allreduce")  # fmt: skip
        print(f"| {label} | {med[name] * 1e3:.1f} | {a.batch / med[name]:,.0f} | "
              f"{sent[name]:.1f} | {r['losses'][0]:.3f} / {r['losses'][-1]:.3f} |")  # fmt: skip
    diff = max(abs(x - y) for x, y in zip(ps["losses"], coll["losses"], strict=True))
    loads = " / ".join(f"{x:.1f}" for x in load)
    print(f"\ncollective / PS step time: {med['collective'] / med['ps']:.2f}x")
    print(f"trainer 0's distinct rows per step: median {uniq:,.0f}; largest difference of "
          f"trainer 0's losses between the setups, step by step: {diff:.1e}; load average "
          f"(1 min) at start / between / end: {loads}")  # fmt: skip


if __name__ == "__main__":
    main()
