"""The validation pipeline end to end at a reduced size: profile, calibrate the local links,
predict, and measure 2 local ranks training the same model. How close prediction and
measurement are is a benchmark's question (benchmarks/sim_validation.py, docs/sim.md): on a
shared machine a timing bound would only make this test flaky."""

from __future__ import annotations

import statistics

import pytest

from longboat.tools.bench.train import MODELS, Config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow tier: times real training


def _rank(model: str) -> float | None:
    import torch

    import longboat as lb
    from longboat.tools.bench.train_rank import System, _batches, _round

    lb.init()
    torch.set_num_threads(1)
    spec = MODELS[model]
    net = spec.build()
    net, opt = lb.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01), lb.Strategy())
    batches = _batches(spec, Config(model, 2, 3, 3, "memory", 0, {}), lb.rank())
    _round(System(net, opt), batches, 2)
    rounds = [_round(System(net, opt), batches, 3)[0] for _ in range(3)]
    return statistics.median(rounds) if lb.rank() == 0 else None


def test_profile_calibrate_predict_and_measure_run_end_to_end() -> None:
    import dataclasses

    from longboat.launch.local import launch_local
    from longboat.sim import profile_model, simulate
    from longboat.sim.calibrate import local_cluster, measure_local

    prof = profile_model("convnet", repeats=3, warmup=1)
    cluster = local_cluster(measure_local(2, 3, sizes=(1 << 16, 1 << 20, 4 << 20)))
    cluster = dataclasses.replace(cluster, nodes=1, devices_per_node=2)
    prediction = simulate(prof, cluster)
    measured = launch_local(_rank, ("convnet",), nproc=2)[0]
    assert 0 < prediction.compute_s <= prediction.step_s < float("inf")
    assert prediction.comm_s > 0 and prediction.bytes_sent > 0  # 2 ranks exchange gradients
    assert measured is not None and 0 < measured < float("inf")
