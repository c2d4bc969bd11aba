"""What ``auto`` reports: a change only beyond the noise its paired rounds measured, the choice
in Strategy terms, and what the ratio column means."""

from __future__ import annotations

from longboat.collective.autotune import AutoTuner, candidates
from longboat.collective.plan import Placement, resolve_comm
from longboat.strategy import Strategy

ONE = Placement.of((0, 0), "gloo")  # 2 Gloo ranks on one node


def _tuner() -> tuple[AutoTuner, int]:
    """A tuner over the one-node candidates, and the index of 8 MB buckets on 2 communicators."""
    options = candidates(resolve_comm(Strategy(env={}, auto=True), ONE), ["native", "shm"])
    base = options[0]
    index = next(
        i for i, c in enumerate(options)
        if (c.algorithm, c.bucket_mb, c.communicators) == (base.algorithm, 8.0, 2)
    )  # fmt: skip
    return AutoTuner(options, lambda plan: (None, [])), index  # type: ignore[arg-type,return-value]


def _rounds(n: int, defaults: list[float], fast: list[float], index: int) -> list[list[float]]:
    """Step times per candidate and round: the defaults, ``fast`` at ``index``, the rest 2%
    slower than the defaults."""
    slower = [t * 1.02 for t in defaults]
    return [defaults if i == 0 else fast if i == index else slower for i in range(n)]


def test_a_gain_within_the_noise_keeps_the_defaults():
    tuner, index = _tuner()
    # 24% faster in two rounds, slower in the third: the rounds disagree
    rounds = _rounds(len(tuner.candidates), [10.0, 14.0, 10.0], [7.6, 10.6, 10.9], index)
    best, winner = tuner.judge(rounds)
    assert best == index and winner == 0
    assert tuner.choice == tuner.candidates[0] and tuner.chosen == {}
    report = tuner.report(best)
    assert "auto: no clear winner: keeping the defaults" in report
    assert "faster than the defaults" not in report


def test_a_clear_gain_is_reported_in_strategy_terms():
    tuner, index = _tuner()
    rounds = _rounds(len(tuner.candidates), [10.0, 10.2, 10.1], [7.6, 7.7, 7.7], index)
    best, winner = tuner.judge(rounds)
    assert best == winner == index
    assert tuner.chosen == {"fuse_grad_size_in_MB": 8.0, "nccl_comm_num": 2}
    report = tuner.report(best)
    last = report.splitlines()[-1]
    assert last.startswith("auto: chose fuse_grad_size_in_MB=8, nccl_comm_num=2 (24.")
    assert "faster in every round" in last
    assert "below 1.00x is faster" in report and "CommPlan(" not in report
    assert "0.76x" in report
    assert max(len(line) for line in report.splitlines() if line.startswith("  ")) <= 100
