"""`longboat demo`: the distributed run must match its single-process replay."""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from longboat.cli import main
from longboat.launch.local import launch_local
from longboat.tools.demo import compare, headline, speed_note
from longboat.tools.demo_train import DemoConfig, global_batches, load_digits_split, make_sampler
from tests._cli import longboat_argv

pytestmark = pytest.mark.timeout(180)


def _index_loader(n: int, cfg: DemoConfig, rank: int, epoch: int) -> list[list[int]]:
    """The batches of dataset positions a rank's DataLoader yields, as the demo builds it."""
    positions = TensorDataset(torch.arange(n))
    sampler = make_sampler(positions, cfg, num_replicas=cfg.nproc, rank=rank)
    sampler.set_epoch(epoch)
    loader = DataLoader(positions, batch_size=cfg.rank_batch, sampler=sampler)
    return [batch.tolist() for (batch,) in loader]


@pytest.mark.parametrize(("n", "nproc", "batch"), [(1437, 2, 64), (100, 3, 48), (7, 4, 8)])
def test_reference_batches_are_the_ranks_batches_concatenated(n: int, nproc: int, batch: int):
    cfg = DemoConfig(nproc=nproc, epochs=2, global_batch=batch, lr=0.1, momentum=0.9, seed=3)
    data = TensorDataset(torch.zeros(n))
    for epoch in range(cfg.epochs):
        per_rank = [_index_loader(n, cfg, r, epoch) for r in range(nproc)]
        expected = [sum(step, []) for step in zip(*per_rank, strict=True)]
        assert global_batches(data, cfg, epoch) == expected
    assert global_batches(data, cfg, 0) != global_batches(data, cfg, 1)  # reshuffled per epoch


def sampler_order(cfg: DemoConfig) -> list[list[int]]:
    """Inside a launched rank: the sampler's order per epoch, rank taken from the cluster."""
    import longboat as lb

    lb.init()
    try:
        train, _ = load_digits_split()
        sampler = make_sampler(train, cfg)
        order = []
        for epoch in range(cfg.epochs):
            sampler.set_epoch(epoch)
            order.append(list(sampler))
        return order
    finally:
        lb.shutdown()


def test_launched_ranks_draw_the_reference_order():
    cfg = DemoConfig(nproc=2, epochs=2, global_batch=64, lr=0.1, momentum=0.9, seed=5)
    out = launch_local(sampler_order, (cfg,), nproc=2, timeout=120)
    train, _ = load_digits_split()
    b = cfg.rank_batch
    for epoch in range(cfg.epochs):
        for step, batch in enumerate(global_batches(train, cfg, epoch)):
            for rank in range(2):
                mine = out[rank][epoch][step * b : (step + 1) * b]
                assert batch[rank * len(mine) : (rank + 1) * len(mine)] == mine


def _result(params: dict[str, torch.Tensor]) -> dict[str, object]:
    return {"params": params}


def test_headline_and_speed_note_count_in_number():
    cfg = DemoConfig(nproc=1, epochs=1, global_batch=64, lr=0.1, momentum=0.9, seed=3)
    assert headline(cfg).startswith("longboat demo: 1 rank, 1 epoch, global batch 64 ")
    assert speed_note(2, 1.0, cores=1).startswith("2 ranks on 1 core, ")


def test_compare_catches_mismatches():
    p = {"w": torch.ones(3), "b": torch.zeros(2)}
    ok = compare({0: _result(p), 1: _result(dict(p))}, {"params": dict(p)})
    assert ok.ok and ok.reference_max_diff == 0.0
    off = {"w": torch.ones(3) + 1e-3, "b": torch.zeros(2)}
    assert not compare({0: _result(p), 1: _result(p)}, {"params": off}).ok
    split = compare({0: _result(p), 1: _result(off)}, None)
    assert not split.ok and split.ranks_max_diff == pytest.approx(1e-3, rel=1e-3)


def test_demo_matches_single_process(capsys: pytest.CaptureFixture[str]):
    assert main(["demo", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "match single-process" in out
    assert "yes (max |diff| =" in out
    assert "test accuracy" in out


@pytest.mark.slow  # slow tier: another whole demo run
def test_demo_method_reports_compressed_bytes(capsys: pytest.CaptureFixture[str]):
    assert main(["demo", "--epochs", "2", "--method", "bf16_allreduce"]) == 0
    out = capsys.readouterr().out
    # 38,282 float32 gradients as bfloat16 on 2 ranks: 2·S·(N−1)/N = 76,564 bytes + 8 flags
    assert "76,580 sent by rank 0" in out
    assert "not checked" in out  # only baseline is compared with single-process training


def test_demo_rejects_uneven_batch(capsys: pytest.CaptureFixture[str]):
    assert main(["demo", "--batch-size", "63"]) == 1
    assert "multiple of --nproc" in capsys.readouterr().out


@pytest.mark.slow  # a whole end-to-end run: the slow tier (CI runs it after the quick one)
def test_console_script_runs_demo():
    proc = subprocess.run(
        [*longboat_argv(), "demo", "--epochs", "1"], capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "match single-process" in proc.stdout


@pytest.mark.slow  # slow tier: another whole demo run
def test_demo_sharding_matches_single_process_and_sends_half(capsys: pytest.CaptureFixture[str]):
    assert main(["demo", "--epochs", "1", "--method", "sharding"]) == 0
    out = capsys.readouterr().out
    assert "match single-process" in out and "yes (max |diff| =" in out
    # stage 2 reduce-scatters: 38,282 float32 gradients over 2 ranks, S·(N−1)/N = 76,564 bytes
    # (half the allreduce's 153,128), + 32 bytes of used-parameter flags
    assert "76,596 sent by rank 0" in out
