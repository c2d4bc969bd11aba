"""Predictions: strategies change what they should; sweeps and --recommend work end to end."""

from __future__ import annotations

import pytest

from longboat.cli import main
from longboat.sim import cluster as cluster_mod
from longboat.sim.predict import simulate
from longboat.sim.sweep import device_counts, sweep
from longboat.strategy import Strategy
from tests.sim.helpers import linear_profile, resnet50_like

A100 = cluster_mod.from_dict(
    {
        "nodes": 512,
        "devices_per_node": 8,
        "device": "A100",
        "inter": {"bandwidth": "100gbit", "latency": "5us", "nics_per_node": 4},
        "ps": {"servers": 8, "bandwidth": "100gbit"},
    }
)
SLOW = cluster_mod.from_dict(
    {
        "nodes": 4,
        "devices_per_node": 2,
        "intra": {"kind": "loopback"},
        "inter": {"bandwidth": "1gbit"},
    }
)


def test_one_device_has_no_communication() -> None:
    p = simulate(resnet50_like(), A100.with_devices(1))
    assert p.exposed_comm_s == 0 and p.bytes_sent == 0
    assert p.step_s == pytest.approx(p.compute_s + p.optimizer_s)


def test_strategies_move_the_prediction_the_right_way() -> None:
    prof = linear_profile([2048] * 7, backward_s=0.05)
    base = simulate(prof, SLOW)
    assert simulate(prof, SLOW, Strategy(gradient_compression="fp16")).bytes_sent == pytest.approx(
        base.bytes_sent / 2, rel=0.01
    )
    assert (
        simulate(prof, SLOW, Strategy(gradient_compression="powersgd")).bytes_sent
        < base.bytes_sent / 10
    )
    assert simulate(prof, SLOW, Strategy(dgc=True)).bytes_sent < base.bytes_sent / 10
    local = simulate(prof, SLOW, Strategy(localsgd=True, localsgd_configs={"k_steps": 4}))
    assert local.exposed_comm_s < base.exposed_comm_s
    merged = simulate(
        prof, SLOW, Strategy(gradient_merge=True, gradient_merge_configs={"k_steps": 4})
    )
    assert merged.exposed_comm_s == pytest.approx(base.exposed_comm_s / 4, rel=0.05)
    far = cluster_mod.from_dict(
        {"nodes": 32, "devices_per_node": 4, "inter": {"bandwidth": "10gbit", "latency": "1ms"}}
    )
    hier = simulate(prof, far, Strategy(allreduce_algorithm="hierarchical"))
    assert hier.step_s < simulate(prof, far, Strategy(allreduce_algorithm="ring")).step_s
    ps = simulate(prof, A100.with_devices(64), Strategy(mode="ps", a_sync=False))
    assert "ps sync" in ps.algorithm and ps.step_s > ps.compute_s


def test_amp_on_a_device_is_faster() -> None:
    prof = resnet50_like()
    one = A100.with_devices(8)
    assert simulate(prof, one, Strategy(amp=True)).compute_s < simulate(prof, one).compute_s


def test_sweep_to_4096_devices() -> None:
    counts = device_counts(A100, 4096)
    assert counts[0] == 1 and counts[-1] == 4096 and 8 in counts
    points = sweep(resnet50_like(), A100, Strategy(), counts, show=False)
    assert [p.prediction.devices for p in points] == counts
    assert points[0].efficiency == pytest.approx(1.0)
    assert all(0 < p.efficiency <= 1.0 + 1e-9 for p in points)
    effs = [p.efficiency for p in points]
    assert effs[-1] <= effs[1] + 1e-9


def test_recommend_writes_a_loadable_strategy(tmp_path, capsys) -> None:  # noqa: ANN001
    prof = tmp_path / "p.json"
    resnet50_like().save(prof)
    best = tmp_path / "best.yaml"
    png = tmp_path / "eff.png"
    code = main(
        ["sim", "predict", "--profile", str(prof), "--nodes", "16", "--devices-per-node", "8",
         "--device", "H100", "--inter-bandwidth", "25gbit", "--max-devices", "256",
         "--recommend", "--write", str(best), "--png", str(png)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "predicted scaling" in out and "--recommend" in out
    loaded = Strategy.load(best)
    assert loaded.fuse_grad_size_in_MB > 0
    assert png.stat().st_size > 1000


def test_cli_reports_bad_cluster(tmp_path, capsys) -> None:  # noqa: ANN001
    prof = tmp_path / "p.json"
    linear_profile([8, 8]).save(prof)
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes: 2\n")
    assert main(["sim", "predict", "--profile", str(prof), "--cluster", str(bad)]) == 2
    assert "devices_per_node" in capsys.readouterr().err


def test_help(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--help"])
    assert exc.value.code == 0
    assert "profile" in capsys.readouterr().out


def test_ps_modes_are_the_engine_s_reading_of_the_strategy() -> None:
    """The simulator takes the mode from PSConfig.from_strategy, as the engine does: half-async
    (async with use_thread_barrier) pays a barrier per step that async does not."""
    cl = cluster_mod.from_dict(
        {"nodes": 2, "devices_per_node": 4, "ps": {"servers": 2, "bandwidth": "10gbit"}}
    )
    prof = linear_profile([1024] * 5)
    run = {
        name: simulate(prof, cl, Strategy(mode="ps", **fields))
        for name, fields in {
            "sync": {"a_sync": False},
            "async": {"a_sync": True},
            "half_async": {"a_sync": True, "use_thread_barrier": True},
        }.items()
    }
    for name, prediction in run.items():
        assert prediction.algorithm.startswith(f"ps {name},")
    assert run["half_async"].step_s > run["async"].step_s
    with pytest.raises(ValueError, match="geo-SGD needs a_sync=True"):
        simulate(prof, cl, Strategy(mode="ps", a_sync=False, a_sync_configs={"k_steps": 4}))
