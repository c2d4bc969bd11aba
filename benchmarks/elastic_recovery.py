"""Recovery time after losing a node: elastic training vs torchrun's restart from a checkpoint.

    sudo python benchmarks/elastic_recovery.py [--repeats 2] [--bandwidth 1gbit] [--fault kill]
                                               [--markdown]

Both paths run `benchmarks/elastic_job.py` (a 25.2 M-parameter MLP, SGD with momentum, one
rank per node) on the same emulated cluster: 3 nodes, `--min-nodes 2`, rendezvous store
served by `longboat emulate`. After step 6 the rank of node 2 kills its launcher and itself
(`--fault kill`), or stops both with SIGSTOP (`--fault freeze`: a frozen machine or a dead link,
nothing more arrives from it, not even a reset). Both paths run with a 30 s collective timeout
(LONGBOAT_TIMEOUT, the elastic default).

- elastic: `longboat launch --nnodes 2:3`; survivors roll back to their last in-memory commit
  (every step), re-form the group and go on.
- restart: `torchrun --nnodes 2:3 --max-restarts 3` with the same rendezvous settings; rank 0
  checkpoints after every step, every rank is restarted and loads it.

Recovery = failure (the dying rank's timestamp) -> first step completed in the 2-node world.
Steps lost = failure step - last step the new world resumed from. Medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = Path(__file__).with_name("elastic_job.py")


def run_once(mode: str, bandwidth: str, fault: str, root: Path) -> dict[str, float]:
    out = root / mode
    out.mkdir(parents=True)
    launcher = "longboat" if mode == "elastic" else "torchrun"
    cmd = [
        sys.executable,
        "-m",
        "longboat",
        "emulate",
        "--nodes",
        "3",
        "--min-nodes",
        "2",
        "--bandwidth",
        bandwidth,
        "--launcher",
        launcher,
        "--keep-going",
        "--timeout",
        "300",
        "--log-dir",
        str(out / "logs"),
        str(JOB),
    ]
    env = dict(os.environ, BENCH_MODE=mode, BENCH_DIR=str(out), BENCH_FAULT=fault)
    env["LONGBOAT_TIMEOUT"] = "30"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=330)
    failure_file = out / "failure.json"
    if not failure_file.exists():
        raise RuntimeError(
            f"{mode}: no failure recorded\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    failure = json.loads(failure_file.read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    by_pid: dict[int, list[float]] = {}
    for s in steps:
        if s["world"] == 3:
            by_pid.setdefault(s["pid"], []).append(s["t"])
    after = sorted(
        (s for s in steps if s["world"] == 2 and s["t"] > failure["t"]), key=lambda s: s["t"]
    )
    if not after:
        raise RuntimeError(f"{mode}: no step completed after the failure\n{done.stdout[-3000:]}")
    first = after[0]
    step_times = [b - a for ts in by_pid.values() for a, b in zip(ts, ts[1:], strict=False)]
    return {
        "recovery_s": first["t"] - failure["t"],
        "steps_lost": failure["step"] - (first["step"] - 1),
        "step_s": statistics.median(step_times) if step_times else float("nan"),
        "finished": max(s["step"] for s in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--fault", choices=("kill", "freeze"), default="kill")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"elastic": [], "restart": []}
    with tempfile.TemporaryDirectory(prefix="longboat-recovery-") as tmp:
        for i in range(args.repeats):
            for mode in results:  # paired rounds: both paths on the same machine state
                results[mode].append(run_once(mode, args.bandwidth, args.fault, Path(tmp) / f"{i}"))
                print(mode, results[mode][-1], flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    ratio = med["restart"]["recovery_s"] / med["elastic"]["recovery_s"]
    rows = [
        ("elastic (lb.elastic, in-memory)", med["elastic"]),
        ("restart (torchrun + checkpoint)", med["restart"]),
    ]
    if args.markdown:
        print("| path | recovery s (median) | steps lost | step s (3 nodes) |")
        print("|---|---|---|---|")
        for name, m in rows:
            print(f"| {name} | {m['recovery_s']:.2f} | {m['steps_lost']:.0f} | {m['step_s']:.2f} |")
        print(f"\nrestart / elastic recovery time: {ratio:.1f}x ({args.repeats} paired rounds)")
    else:
        for name, m in rows:
            print(
                f"{name}: recovery {m['recovery_s']:.2f} s, steps lost {m['steps_lost']:.0f}, "
                f"step {m['step_s']:.2f} s"
            )
        print(f"restart / elastic recovery time: {ratio:.1f}x")


if __name__ == "__main__":
    main()
