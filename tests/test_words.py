"""Counts agree in number."""

from longboat.words import plural


def test_plural_agrees_with_the_count():
    assert plural(1, "rank") == "1 rank"
    assert [plural(n, "node") for n in (0, 2)] == ["0 nodes", "2 nodes"]
    assert plural(3, "child", "children") == "3 children"
