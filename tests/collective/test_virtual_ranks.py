"""The lagging backend and its Strategy harness, on CPU (host completion).

On a GPU, ``benchmarks/gpu_check.py`` runs the same harness with every collective landing
late on its own stream; here CI proves the backend's arithmetic, that every variant of the
harness matches its single-process reference at N virtual ranks, and that the references
are sharp enough to see what the GPU run must catch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import _lagging_backend as backend
from tests import _lagging_harness as harness
from tests._dist import run_ranks

CPU = torch.device("cpu")


def _backend_ops(_rank: int, _world: int) -> dict[str, object]:
    backend.init(3, on_device=False, delay_cycles=0)
    try:
        out: dict[str, object] = {}
        t = torch.tensor([1.0, -2.0])
        dist.all_reduce(t)
        out["sum"] = t.tolist()
        t = torch.tensor([1.0, -2.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["max"] = t.tolist()
        gathered = [torch.empty(2) for _ in range(3)]
        dist.all_gather(gathered, torch.tensor([5.0, 6.0]))
        out["gather"] = [g.tolist() for g in gathered]
        whole = torch.empty(6)
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_single(whole, torch.tensor([7.0, 8.0]))
        out["gather_base"] = whole.tolist()
        part = torch.empty(2)
        scatter_single = getattr(dist, "reduce_scatter_single", None)
        (scatter_single or dist.reduce_scatter_tensor)(part, torch.arange(6.0))
        out["reduce_scatter"] = part.tolist()
        backend.poison(1)
        t = torch.tensor([1.0, 1.0])
        dist.all_reduce(t)
        out["poisoned"] = t.tolist()
        work = dist.all_reduce(torch.ones(1), async_op=True)
        out["future"] = work.get_future().wait()[0].tolist()
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def test_backend_reduces_as_n_ranks_holding_the_same_tensor():
    (out,) = run_ranks(_backend_ops, 1, timeout=60)
    assert out["sum"] == [3.0, -6.0]  # three ranks' sum
    assert out["max"] == [1.0, -2.0]
    assert out["gather"] == [[5.0, 6.0]] * 3
    assert out["gather_base"] == [7.0, 8.0] * 3
    assert out["reduce_scatter"] == [0.0, 3.0]  # rank 0's chunk, summed over three ranks
    assert out["poisoned"] == [float("inf"), 3.0]
    assert out["future"] == [3.0]


@pytest.fixture(scope="module")
def harness_results() -> dict:
    (out,) = run_ranks(harness.run_all, 1, "cpu", None, timeout=240)
    return out


@pytest.mark.parametrize("name", [*harness.VARIANTS, harness.NEGATIVE])
def test_variant_matches_its_single_process_reference(harness_results: dict, name: str):
    result = harness_results[name]
    assert "error" not in result, result.get("error")
    reference = harness.single_reference(name, CPU)
    diff = harness.max_diff(result["run"], reference)
    lossy = harness.VARIANTS.get(name, ({}, "single"))[1] == "host"
    tol = harness.LOSSY_TOLERANCE if lossy else harness.tolerance(name, "single")
    assert diff <= tol, f"{name}: max diff {diff:.2e} > {tol:.0e}"


def test_control_flags_agree(harness_results: dict):
    assert harness_results[harness.CONTROL] == {"control": "State.sync, digests and any_rank agree"}


def test_the_references_see_what_a_gpu_run_must_catch(harness_results: dict):
    """An early read of a bucket holds grad / N: as training with lr / N, which the exact
    tolerance must see; and the emulated overflow must have been skipped, not trained on."""
    assert harness_results["collectives"] > 100
    assert harness_results["poison left"] == 0
    reference = harness.single_reference("default", CPU)
    torch.manual_seed(0)
    n = harness.VIRTUAL_RANKS
    slow = harness.Net(batch_norm=False, spare=False)
    opt = torch.optim.SGD(slow.parameters(), lr=0.05 / n, momentum=0.9)
    x, y = harness._data(harness.STEPS)
    for i in range(harness.STEPS):
        opt.zero_grad()
        out = slow(x[i], use_spare=False)
        torch.nn.functional.cross_entropy(out, y[i]).backward()
        opt.step()
    early = {k: v.detach() for k, v in slow.named_parameters()}
    assert harness.max_diff(early, reference) > 100 * harness.tolerance("default", "single")
    name = "amp float16 (overflow decision)"
    trained_on = harness.single_reference(name, CPU, skip_overflow=False)
    run = harness_results[name]["run"]
    assert harness.max_diff(run, trained_on) > 10 * harness.tolerance(name, "single")
