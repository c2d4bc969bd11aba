"""benchmarks/sim_gpu_validation.py: the published GPU scaling tables stay within the bounds
(a pure computation from the published numbers, no GPU and no timing)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def validation():  # noqa: ANN201
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import sim_gpu_validation

        yield sim_gpu_validation, sim_gpu_validation.validate()
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_three_models_from_one_gpu_to_the_largest_count(validation) -> None:  # noqa: ANN001
    module, rows = validation
    models = {r.model.split("-pretraining")[0].split("-squad")[0] for r in rows}
    assert {"resnet50", "bert-large", "transformer-xl-base", "transformer-xl-large"} <= models
    assert max(r.gpus for r in rows) == 256
    for table in {r.table for r in rows}:
        gpus = [r.gpus for r in rows if r.table == table]
        assert max(gpus) > 1
    calibration = [r for r in rows if r.calibration]
    assert calibration and all(abs(r.error) < 1e-9 for r in calibration)


def test_rows_within_ten_percent_and_median_within_five(validation) -> None:  # noqa: ANN001
    module, rows = validation
    misses = module.known_misses()
    predicted = [r for r in rows if r.predicts]
    assert statistics.median(abs(r.error) for r in predicted) <= 0.05
    assert module.summary(rows)["rows"] == len(predicted)
    outside = [
        (r.table, r.gpus, f"{r.error:+.1%}")
        for r in predicted
        if abs(r.error) > 0.10 and (r.table, r.gpus) not in misses
    ]
    assert not outside, f"rows beyond 10 % that docs/sim.md does not list: {outside}"


def test_known_misses_are_still_misses(validation) -> None:  # noqa: ANN001
    """The list of rows the model misses stays true: a fixed row leaves the list."""
    module, rows = validation
    by_row = {(r.table, r.gpus): r for r in rows}
    for key, why in module.known_misses().items():
        assert key in by_row, f"known miss {key} is not a row"
        assert abs(by_row[key].error) > 0.10, f"{key} is now within 10 %: drop it from the list"
        assert why


def test_markdown_names_sources_and_exclusions(validation) -> None:  # noqa: ANN001
    module, _ = validation
    text = module.markdown(module.validate(only="resnet50 dgx-a100"))
    assert "resnet50 dgx-a100 tf32" in text and "(calibration)" in text
    assert "Excluded: bert-large pretrain seq512 dgx1-32g fp32" in text
    data = module.load()
    assert data["source"]["commit"] and all("path" in t and "section" in t for t in data["tables"])


def test_the_held_out_row_is_where_the_loader_default_comes_from(validation) -> None:  # noqa: ANN001
    """The default rate of one loader process is the held-out row's throughput over its loader
    processes, and that row is not counted as a prediction."""
    from longboat.sim.cluster import DEFAULT_WORKER_RATE

    module, rows = validation
    held = [r for r in rows if r.held_out]
    assert len(held) == 1 and not held[0].predicts
    table = next(t for t in module.load()["tables"] if t["name"] == held[0].table)
    per_process = held[0].published / table["input"]["workers"]
    assert abs(DEFAULT_WORKER_RATE / per_process - 1) < 0.01
    loaders = [r for r in rows if r.model == "resnet50" and r.gpus > 1 and r.predicts]
    assert loaders and all(abs(r.error) <= 0.10 for r in loaders)


def test_the_recorded_error_per_interconnect_is_the_rows(validation) -> None:  # noqa: ANN001
    """`longboat.sim.error` (the margin of `--recommend`) holds each GPU kind's median |error|
    over the published rows of that kind."""
    from longboat.sim.error import EMULATED_HOSTS, KNOWN, kind_of

    module, rows = validation
    data = module.load()
    tables = {t["name"]: t for t in data["tables"]}
    errors: dict[str, list[float]] = {}
    for r in rows:
        if r.predicts:
            kind = kind_of(module.cluster_of(data, tables[r.table], r.gpus))
            assert kind is not None, f"{r.table} at {r.gpus} GPUs is of no validated kind"
            errors.setdefault(kind.kind, []).append(abs(r.error))
    recorded = {k.kind: k.median for k in KNOWN if k is not EMULATED_HOSTS}
    assert {k: round(statistics.median(e), 3) for k, e in errors.items()} == recorded
