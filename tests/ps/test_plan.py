"""The sharding plan: block sizes, balance, determinism, printing."""

from __future__ import annotations

import random

import pytest

from longboat.ps.trainer.plan import make_plan, split_rows


def test_blocks_are_at_least_min_block_size_and_cover_every_row() -> None:
    assert split_rows((1024, 64), 4, 8192, 1 << 30) == [(0, 256), (256, 512), (512, 768),
                                                         (768, 1024)]  # fmt: skip
    assert split_rows((100, 100), 4, 8192, 1 << 30) == [(0, 100)]  # 10000 < 2 * 8192
    assert split_rows((), 4, 8192, 1 << 30) == [(0, 1)]
    assert len(split_rows((1000, 1000), 2, 8192, 100_000)) == 10  # the per-block cap


def test_loads_differ_by_at_most_one_block_and_plan_is_deterministic() -> None:
    rng = random.Random(0)
    for _ in range(50):
        shapes = [(f"p{i}", (rng.randrange(1, 3000), rng.choice([1, 8, 64]))) for i in range(30)]
        servers = rng.randrange(1, 6)
        plan = make_plan(shapes, servers, min_block_size=1024)
        loads = plan.loads()
        largest = max(b.numel for b in plan.blocks)
        assert max(loads) - min(loads) <= largest
        for name, shape in shapes:
            blocks = plan.of_param(name)
            assert blocks[0].start == 0 and blocks[-1].stop == shape[0]
            assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:], strict=False))
            if len(blocks) > 1:
                assert min(b.numel for b in blocks) >= 1024
        assert make_plan(shapes, servers, min_block_size=1024) == plan  # same on every trainer


def test_plan_prints_every_block_and_load() -> None:
    plan = make_plan([("w", (512, 64)), ("b", (64,))], 2)
    text = plan.describe()
    assert "w/0" in text and "w/1" in text and "b/0" in text
    assert f"plan {plan.digest()}: 3 blocks; server 0: " in text


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="num_servers"):
        make_plan([("w", (4,))], 0)
    with pytest.raises(ValueError, match="unique"):
        make_plan([("w", (4,)), ("w", (4,))], 1)
