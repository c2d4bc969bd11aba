"""One reduced validation: 2 local ranks train convnet for real; the calibrated prediction
must land within 50 % (the machine is shared and noisy: a generous bound)."""

from __future__ import annotations

import statistics

import pytest

from longboat.tools.bench.train import MODELS, Config

pytestmark = pytest.mark.timeout(300)


def _rank(model: str) -> float | None:
    import torch

    import longboat as lb
    from longboat.tools.bench.train import System, _batches, _round

    lb.init()
    torch.set_num_threads(1)
    spec = MODELS[model]
    net = spec.build()
    net, opt = lb.distribute(net, torch.optim.SGD(net.parameters(), lr=0.01), lb.Strategy())
    batches = _batches(spec, Config(model, 2, 3, 3, "memory", 0, {}), lb.rank())
    _round(System(net, opt), batches, 2)
    rounds = [_round(System(net, opt), batches, 3)[0] for _ in range(3)]
    return statistics.median(rounds) if lb.rank() == 0 else None


def test_prediction_within_half_of_measurement() -> None:
    import dataclasses

    from longboat.launch.local import launch_local
    from longboat.sim import profile_model, simulate
    from longboat.sim.calibrate import local_cluster, measure_local

    prof = profile_model("convnet", repeats=3, warmup=1)
    cluster = local_cluster(measure_local(2, 3, sizes=(1 << 16, 1 << 20, 4 << 20)))
    cluster = dataclasses.replace(cluster, nodes=1, devices_per_node=2)
    predicted = simulate(prof, cluster).step_s
    measured = launch_local(_rank, ("convnet",), nproc=2)[0]
    assert predicted == pytest.approx(measured, rel=0.5)
