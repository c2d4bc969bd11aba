"""benchmarks/gpu_check.py stays runnable without a GPU: its equivalence part on CPU tensors."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # spawned ranks import it by name too
    return importlib.import_module("gpu_check")


def test_equivalence_part_runs_on_cpu_tensors(gpu_check) -> None:
    rows = []
    names = ["default", "sync batch norm", "amp bfloat16", "powersgd", "local sgd k=2"]
    gpu_check.check_equivalence(rows, device="cpu", names=names)
    assert [r.check for r in rows] == names
    failed = [r for r in rows if not r.ok]
    assert not failed, gpu_check.table(failed)
    assert "| equivalence | default | yes |" in gpu_check.table(rows)


@pytest.mark.slow  # tests/collective/test_virtual_ranks.py checks the harness in the quick tier
def test_ordering_part_runs_on_cpu_tensors(gpu_check) -> None:
    """Host completion: every variant matches its reference, the negative control too."""
    rows = []
    gpu_check.check_ordering(rows, device="cpu")
    failed = [r for r in rows if not r.ok]
    assert not failed, gpu_check.table(failed)
    assert len(rows) == len(gpu_check.lagging.VARIANTS) + 3


def test_every_setting_it_names_is_a_valid_strategy(gpu_check) -> None:
    import longboat as lb

    settings = [*gpu_check.EQUIVALENCE.values(), *gpu_check.SYNCS.values()]
    for fields, _ in [*settings, *gpu_check.lagging.VARIANTS.values()]:
        lb.Strategy(**fields).check()
    for _, _, fields in gpu_check.OVERHEAD:
        lb.Strategy(**fields).check()
