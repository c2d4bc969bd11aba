"""Shared by the `longboat sim` benchmarks: calibrate emulated links, profile models, run
bench train's step loop as a real job on `longboat emulate` (needs root) and predict it.

Run as ``python _emulated_runs.py rank-worker OUT MODEL FIELDS_JSON``, it is one rank of such a
job (`longboat emulate` starts it on every emulated node).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

WARMUP, STEPS, ROUNDS = 4, 4, 7


@dataclasses.dataclass(frozen=True)
class Job:
    """One emulated job: a bench train model on ``nodes`` x ``ppn`` ranks at link ``rate``."""

    name: str
    model: str
    nodes: int
    ppn: int
    rate: str
    strategy: dict[str, Any]


def worker(out: str, model: str, fields_json: str) -> None:
    """One rank of a measured job: bench train's loop on longboat only. Rank 0 writes the
    round times, their median and the allreduce settings the job ran with (topology-chosen
    defaults resolved)."""
    import torch

    import longboat as lb
    from longboat.tools.bench.train_models import MODELS
    from longboat.tools.bench.train_rank import Config, System, _batches, _round

    lb.init()
    torch.set_num_threads(1)
    fields = json.loads(fields_json)
    spec = MODELS[model]
    net = spec.build()
    strategy = lb.Strategy(**fields)
    net, opt = lb.distribute(
        net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), strategy
    )
    config = Config(model, WARMUP, STEPS, ROUNDS, "memory", 0, fields)
    batches = _batches(spec, config, lb.rank())
    _round(System(net, opt), batches, WARMUP)
    rounds = [_round(System(net, opt), batches, STEPS)[0] for _ in range(ROUNDS)]
    if lb.rank() == 0:
        result = {
            "rounds": rounds,
            "median": statistics.median(rounds),
            "settings": settings_text(
                net.plan.comm.algorithm, net.plan.comm.bucket_mb, net.plan.comm.communicators
            ),
        }
        Path(out).write_text(json.dumps(result))


def settings_text(algorithm: str, cap_mb: float, comms: int) -> str:
    """E.g. ``hierarchical, 2 MB x 2 comms``."""
    return f"{algorithm}, {cap_mb:g} MB x {comms} comm{'s' if comms > 1 else ''}"


def run_job(job: Job, tmp: Path, timeout_s: float = 600) -> dict[str, Any]:
    """Run ``job`` under `longboat emulate`; rank 0's result (see `worker`). On any failure or
    interruption emulate gets SIGTERM first, so it removes its network namespaces."""
    out = tmp / f"{job.name}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "longboat", "emulate", "--nodes", str(job.nodes),
        "--nproc-per-node", str(job.ppn), "--bandwidth", job.rate, "--timeout", str(int(timeout_s)),
        "--log-dir", str(tmp / "logs" / job.name), __file__, "rank-worker", str(out),
        job.model, json.dumps(job.strategy),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s + 60)
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if proc.returncode or not out.exists():
        raise RuntimeError(f"{job.name}: exit {proc.returncode}\n{output[-3000:]}")
    return dict(json.loads(out.read_text()))


def calibrated_links(rates: list[str], out: Path, reuse: bool) -> dict[str, Any]:
    """`longboat sim calibrate --emulate RATE` for each rate (files cached in ``out``)."""
    from longboat.sim import cluster
    from longboat.sim.calibrate import (
        local_cluster,
        measure_emulated,
        measure_local,
        with_emulated_link,
    )

    paths = {rate: out / f"calibrated-{rate}.yaml" for rate in rates}
    if reuse and all(p.exists() for p in paths.values()):
        return {rate: cluster.load(p) for rate, p in paths.items()}
    from longboat.sim import calibrate_fsdp

    # as `longboat sim calibrate` does: the backend's own all-gather and reduce-scatter too
    # (sharding's collectives across nodes), and FSDP2's host work
    local = local_cluster(measure_local(2, 7))
    local = calibrate_fsdp.with_fsdp2(local, calibrate_fsdp.measure(2, 7))
    result = {}
    for rate in rates:
        result[rate] = with_emulated_link(local, measure_emulated(rate, 7), rate)
        cluster.save(result[rate], paths[rate])
    return result


def profiles(models: list[str], out: Path, reuse: bool) -> dict[str, Any]:
    """`longboat sim profile` of each model, one thread (files cached in ``out``)."""
    from longboat.sim import load_profile, profile_model

    result = {}
    for model in models:
        path = out / f"profile-{model}.json"
        if reuse and path.exists():
            result[model] = load_profile(path)
            continue
        result[model] = profile_model(model, repeats=10, warmup=3)
        result[model].save(path)
    return result


def job_cluster(job: Job, calibrated: dict[str, Any]) -> Any:
    """The calibrated cluster of the job's link rate, cut to its nodes and ranks."""
    return dataclasses.replace(calibrated[job.rate], nodes=job.nodes, devices_per_node=job.ppn)


def predicted_settings(job: Job, calibrated: dict[str, Any]) -> str:
    """The allreduce settings `longboat.sim` predicts the job with (as `worker` reports them)."""
    from longboat.sim.predict import collective_plan
    from longboat.strategy import Strategy

    s = collective_plan(Strategy(**job.strategy), job_cluster(job, calibrated)).comm
    return settings_text(s.algorithm, s.bucket_mb, s.communicators)


def predict(job: Job, profile: Any, calibrated: dict[str, Any]) -> Any:
    """`longboat.sim.simulate` of the job (a Prediction)."""
    from longboat.sim import simulate
    from longboat.strategy import Strategy

    return simulate(profile, job_cluster(job, calibrated), Strategy(**job.strategy))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rank-worker":
    worker(*sys.argv[2:5])
