"""Calibrating the contention from one measured multi-device step (`longboat.sim.fit`)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from longboat.cli import main
from longboat.sim import cluster as cluster_mod
from longboat.sim import fit
from longboat.sim.cluster import ClusterError
from longboat.sim.predict import simulate
from longboat.strategy import Strategy
from tests.sim.helpers import resnet50_like

# 2 nodes of 8 V100 on one 100 Gb/s NIC each: ResNet-50's allreduce overlaps most of backward.
NODES = {
    "nodes": 2,
    "devices_per_node": 8,
    "device": "V100",
    "intra": {"kind": "nvlink", "links": 6},
    "inter": {"bandwidth": "100Gb/s", "nics_per_node": 1},
}
#: One allreduce of every gradient after backward: nothing overlaps it.
AFTER_BACKWARD = Strategy(
    fuse_grad_size_in_MB=1e6, fuse_grad_size_in_TFLOPS=1e5, last_comm_group_size_MB=1e6
)


def nodes() -> cluster_mod.Cluster:
    return cluster_mod.from_dict(NODES)


def test_a_measured_step_gives_back_the_contention_that_produced_it() -> None:
    prof, cluster = resnet50_like(), nodes()
    measured = simulate(prof, dataclasses.replace(cluster, contention=0.4)).step_s
    assert measured > simulate(prof, dataclasses.replace(cluster, contention=0.0)).step_s
    assert fit.contention(prof, cluster, measured) == pytest.approx(0.4, rel=1e-4)
    again = fit.calibrated_contention(prof, cluster, measured)
    assert again.contention == pytest.approx(0.4, rel=1e-4)
    assert simulate(prof, again).step_s == pytest.approx(measured, rel=1e-6)


def test_what_contention_cannot_explain_is_refused() -> None:
    prof, cluster = resnet50_like(), nodes()
    without = simulate(prof, dataclasses.replace(cluster, contention=0.0)).step_s
    with pytest.raises(ClusterError, match="faster than predicted without any contention"):
        fit.contention(prof, cluster, 0.9 * without)
    with pytest.raises(ClusterError, match="slower than predicted even with contention 3"):
        fit.contention(prof, cluster, 10 * without)
    with pytest.raises(ClusterError, match="no collective overlaps backward"):
        fit.contention(prof, cluster, 1.1 * without, AFTER_BACKWARD)
    with pytest.raises(ClusterError, match="2 or more devices"):
        fit.contention(prof, cluster.with_devices(1), without)


def test_command_line(tmp_path, capsys) -> None:  # noqa: ANN001
    path, out = tmp_path / "p.json", tmp_path / "out.json"
    resnet50_like().save(path)
    cluster = tmp_path / "c.yaml"
    cluster.write_text(json.dumps(NODES))
    measured = simulate(resnet50_like(), dataclasses.replace(nodes(), contention=0.4)).step_s
    args = ["sim", "predict", "--profile", str(path), "--cluster", str(cluster)]
    spec = f"16={measured * 1e3:.6f}ms"
    assert main([*args, "--measured-step-at", spec, "--json", str(out)]) == 0
    assert "contention 0.4000: 16 V100 take" in capsys.readouterr().out
    assert json.loads(out.read_text())["cluster"]["compute"]["contention"] == pytest.approx(
        0.4, rel=1e-3
    )
    assert main([*args, "--measured-step-at", "16:100ms"]) == 2
    assert "DEVICES=TIME" in capsys.readouterr().err
    assert main([*args, "--measured-step-at", "16=100ms", "--contention", "0.2"]) == 2
    assert "drop one of the two" in capsys.readouterr().err
