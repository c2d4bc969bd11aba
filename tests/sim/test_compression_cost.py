"""Compressors are priced by the cost they declare at registration, never by name: a toy one
in one file is priced by its declaration, one without a declaration is named beside the figure,
and every built-in declares one."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from longboat.comm.compress import Bucket, Wire, make_compressor, scaled_cost
from longboat.registry import COMPRESSORS
from longboat.sim import cluster as cluster_mod
from longboat.sim import report
from longboat.sim.devices import PRECISIONS
from longboat.sim.predict import simulate
from longboat.sim.recommend import candidates
from longboat.strategy import Strategy
from tests.sim.helpers import linear_profile

GPU = cluster_mod.from_dict({"nodes": 2, "devices_per_node": 8, "device": "A100"})
PROFILE = linear_profile([2048] * 7, backward_s=0.05)
SIM = Path(__file__).parents[2] / "src" / "longboat" / "sim"


def _identity(inner: Any, group: Any, config: Mapping[str, Any]) -> Any:
    """Sends buckets as they are (the factory is never called by the simulator)."""
    return make_compressor("none", inner, group)


def test_every_builtin_compressor_declares_a_cost() -> None:
    assert COMPRESSORS.having("cost") == COMPRESSORS.names()


def test_no_compressor_name_in_the_simulator() -> None:
    """sim/ asks the registry; a quoted compressor name there is a branch on it (the device
    precisions fp16/bf16 aside, unless the gradient compression is being set to one)."""
    names = "|".join(n for n in COMPRESSORS.names() if n not in PRECISIONS)
    every = "|".join(COMPRESSORS.names())
    pattern = rf"""["']({names})["']|gradient_compression["']?\s*[:=]\s*["']({every})["']"""
    found = [
        f"{path.name}: {m.group(0)}"
        for path in sorted(SIM.glob("*.py"))
        for m in re.finditer(pattern, path.read_text())
    ]
    assert not found


def test_a_toy_compressor_is_priced_by_its_declared_cost() -> None:
    with COMPRESSORS.scoped():
        COMPRESSORS.register("toy_onebit", lossy=True, cost=scaled_cost(1 / 32, 16, True))(
            _identity
        )
        plain = simulate(PROFILE, GPU, Strategy())
        toy = simulate(PROFILE, GPU, Strategy(gradient_compression="toy_onebit"))
        tried = [f.get("gradient_compression") for f in candidates(GPU, lossy=True)]
        assert "toy_onebit" in tried  # lossy: only proposed with --lossy
        assert "toy_onebit" not in [f.get("gradient_compression") for f in candidates(GPU)]
    assert toy.bytes_sent == pytest.approx(plain.bytes_sent / 32, rel=1e-3)
    assert toy.step_s < plain.step_s
    assert toy.memory["compressor_state"] == pytest.approx(sum(p.nbytes for p in PROFILE.params))
    assert not any("declared cost" in n for n in toy.notes)


def test_a_cost_sees_the_bucket_and_its_config() -> None:
    seen: list[Bucket] = []

    def cost(bucket: Bucket) -> Wire:
        seen.append(bucket)
        return Wire((bucket.nbytes / 4,), allgather=8.0, flops=1e6)

    with COMPRESSORS.scoped():
        COMPRESSORS.register("toy_seen", cost=cost)(_identity)
        simulate(PROFILE, GPU, Strategy(gradient_compression="toy_seen"))
    assert sum(len(b.grads) for b in seen) == len(PROFILE.params)
    assert {b.world for b in seen} == {GPU.world}
    assert sum(b.extra_bytes for b in seen) == 4 * len(PROFILE.params)


def test_a_compressor_without_a_cost_is_named_beside_the_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with COMPRESSORS.scoped():
        COMPRESSORS.register("toy_unpriced")(_identity)
        plain = simulate(PROFILE, GPU, Strategy())
        toy = simulate(PROFILE, GPU, Strategy(gradient_compression="toy_unpriced"))
        assert all("toy_unpriced" not in str(f) for f in candidates(GPU, lossy=True))
    assert toy.step_s == plain.step_s  # priced as uncompressed ...
    note = "compressor 'toy_unpriced' has no declared cost; priced as uncompressed"
    assert any(n.startswith(note) for n in toy.notes)  # ... and said so
    report.breakdown(PROFILE, GPU, toy)
    lines = [line for line in capsys.readouterr().out.splitlines() if note in line]
    assert len(lines) == 1
