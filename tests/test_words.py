"""Counts agree in number: the helper, and lines that use it."""

from longboat.words import plural


def test_plural_agrees_with_the_count():
    assert plural(1, "rank") == "1 rank"
    assert [plural(n, "node") for n in (0, 2)] == ["0 nodes", "2 nodes"]
    assert plural(3, "child", "children") == "3 children"


def test_sharding_line_counts_one_rank_in_the_singular():
    from longboat.sharding.config import ShardingPlan

    line = ShardingPlan(stage=2, degree=0, dp_degree=1).describe(1)
    assert "split over 1 rank; " in line
