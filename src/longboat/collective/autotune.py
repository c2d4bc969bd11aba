"""``Strategy(auto=True)``: time a few reducer settings on the first training steps, keep the fastest.

The tuned settings are the allreduce algorithm, the fusion size (``fuse_grad_size_in_MB``) and
the number of communicators (``nccl_comm_num``); fields the user set (any source but the
default) stay fixed. Each candidate is a complete, correct :class:`Reducer`, built through the
same path as the defaults' one, so training stays exact while candidates are tried.

Schedule (it depends only on the count of communicating steps, so every rank switches at the
same step): ``TRIAL_STEPS`` paired rounds; in each round every candidate, the defaults first,
runs ``WARMUP_STEPS`` untimed steps and one timed step. A step's time runs from one
communicating ``forward`` to the next (forward, backward, allreduce wait, optimizer step). After
the last round every rank all-reduces its times with MAX (the slowest rank decides). Each
candidate's ratio to the defaults is taken round by round, so machine noise hits both alike. The
fastest candidate (lowest median ratio) replaces the defaults only when it was faster in every
round and its gain exceeds both ``MIN_GAIN`` and the defaults' own spread between rounds (the
noise measured); otherwise the defaults stay: "no clear winner".
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import longboat.cluster as cluster
from longboat.collective.plan import CollectivePlan, CommPlan
from longboat.collective.reducer import Reducer
from longboat.log import get_logger
from longboat.registry import ALGORITHMS, COMPRESSORS

if TYPE_CHECKING:
    from longboat.collective.model import DistributedModel

log = get_logger("longboat.collective")

TRIAL_STEPS = 3  # paired rounds: one timed step per candidate in each
WARMUP_STEPS = 1  # untimed steps per candidate after switching to it (buffers, connections)
MIN_GAIN = 0.03  # a candidate replaces the defaults only when this much faster (fraction)
FUSE_SIZES_MB = (8.0, 2.0)  # tried besides the plan's own bucket size
COMM_NUMS = (1, 2)
clock: Callable[[], float] = time.perf_counter  # replaceable in tests

#: the tuned CommPlan settings -> the Strategy fields that set them
STRATEGY_FIELDS = (
    ("algorithm", "allreduce_algorithm"),
    ("bucket_mb", "fuse_grad_size_in_MB"),
    ("communicators", "nccl_comm_num"),
)

Builder = Callable[[CommPlan], tuple[Reducer, list]]  # a candidate: a variant of the CommPlan


def topology_algorithms() -> list[str]:
    """Algorithms worth trying on this cluster: those whose declared topologies suit it (the
    ``auto`` algorithm's rule) and that are declared tunable."""
    from longboat.comm.algorithms import auto

    return [a for a in auto.candidates(dist.group.WORLD) if ALGORITHMS.entry(a).tune]


def candidates(base: CommPlan, algorithms: Sequence[str]) -> list[CommPlan]:
    """The settings to try, ``base`` (the plan's) first; settings the user set are not tuned."""
    algos = [base.algorithm]
    if "algorithm" in base.tunable:
        algos += algorithms
    fuses = [base.bucket_mb]
    if "bucket_mb" in base.tunable:
        fuses += FUSE_SIZES_MB
    comms = [base.communicators]
    if "communicators" in base.tunable:
        comms += COMM_NUMS
    grid = itertools.product(*(dict.fromkeys(v) for v in (algos, fuses, comms)))
    options = [base.with_settings(a, f, n) for a, f, n in grid]
    return [base] + [c for c in options if c != base]


def untunable(plan: CollectivePlan, world_size: int) -> str | None:
    """Why ``plan`` cannot be tuned on ``world_size`` ranks, or None."""
    if world_size == 1:
        return "one rank has no gradients to communicate"
    if plan.local_sgd is not None:
        return "local SGD averages parameters instead of allreducing gradients"
    entry = COMPRESSORS.entry(plan.compression.name)
    if entry.state or entry.lossy:
        return f"{entry.label} keeps {entry.state or 'error feedback'} in one reducer's compressors"
    return None


class AutoTuner:
    """Owns the candidate reducers of one DistributedModel and switches between them."""

    def __init__(
        self,
        options: Sequence[CommPlan],
        build: Builder,
        *,
        trial_steps: int | None = None,
        warmup_steps: int | None = None,
    ):
        self.candidates = list(options)
        self.trial_steps = TRIAL_STEPS if trial_steps is None else trial_steps
        self.warmup_steps = WARMUP_STEPS if warmup_steps is None else warmup_steps
        self.active = 0  # index of the candidate whose reducer is installed
        self.choice: CommPlan | None = None  # set when the trial is over
        self.medians: list[float] = []  # slowest rank's median step time per candidate (s)
        self.rounds: list[list[float]] = []  # slowest rank's step time per candidate and round
        self.ratios: list[list[float]] = []  # over the defaults', per candidate and round
        self._build: Builder | None = build
        self._times: list[list[float]] = [[] for _ in self.candidates]
        self._steps = 0  # communicating steps begun so far
        self._began = 0.0
        self._compressors: list[Any] = []
        self._clock = clock

    @property
    def done(self) -> bool:
        return self.choice is not None

    @property
    def trial_length(self) -> int:
        """Communicating steps the trial takes."""
        return len(self.candidates) * (self.warmup_steps + 1) * self.trial_steps

    def before_step(self, model: DistributedModel) -> None:
        """At a communicating forward, before the reducer is prepared: time and switch."""
        if self.done:
            return
        now = self._clock()
        per = self.warmup_steps + 1  # one visit of a candidate
        step = self._steps  # the step that begins now
        if step > 0 and (step - 1) % per == self.warmup_steps:  # the visit's timed step ended
            owner = (step - 1) // per % len(self.candidates)
            self._times[owner].append(now - self._began)
        self._steps += 1
        if step == self.trial_length:
            self._decide(model)
        elif step > 0 and step % per == 0:
            self._install(model, step // per % len(self.candidates))
        self._began = self._clock()

    def _install(self, model: DistributedModel, index: int) -> None:
        assert self._build is not None
        candidate = self.candidates[index]
        reducer, compressors = self._build(candidate)
        if not self._compressors:
            self._compressors = list(model.compressors)
        self._compressors += compressors  # bytes_sent stays cumulative over every candidate
        plan = dataclasses.replace(model.plan, comm=candidate) if model.plan else None
        model.replace_reducer(reducer, self._compressors, plan)
        self.active = index

    def _decide(self, model: DistributedModel) -> None:
        device = model.reducer.params[0].device
        slowest = torch.tensor(self._times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the same numbers, hence choice, on all
        best, winner = self.judge(slowest.cpu().tolist())
        if winner != self.active:
            self._install(model, winner)
        self._build = None  # drops the cached communicators of the losers
        if cluster.rank() == 0:
            log.info("%s", self.report(best))

    def judge(self, rounds: list[list[float]]) -> tuple[int, int]:
        """From the slowest rank's step times per candidate and round: the fastest candidate
        and the one kept (the fastest if its gain is clear, else the defaults)."""
        self.rounds = rounds
        self.medians = [statistics.median(times) for times in rounds]
        self.ratios = [[t / b for t, b in zip(ts, rounds[0], strict=True)] for ts in rounds]
        best = min(range(len(self.ratios)), key=lambda i: (statistics.median(self.ratios[i]), i))
        winner = best if self.clear_gain(best) else 0
        self.choice = self.candidates[winner]
        return best, winner

    def noise(self) -> float:
        """How much the defaults' own step time varied between rounds (fraction of its median)."""
        base = self.rounds[0]
        return (max(base) - min(base)) / statistics.median(base)

    def gain(self, index: int) -> float:
        """Candidate ``index``'s median gain over the defaults, paired round by round."""
        return 1.0 - statistics.median(self.ratios[index])

    def clear_gain(self, index: int) -> bool:
        """Faster than the defaults in every round, by more than the noise and ``MIN_GAIN``."""
        return (
            index != 0
            and max(self.ratios[index]) < 1.0
            and self.gain(index) > max(MIN_GAIN, self.noise())
        )

    def changes(self, plan: CommPlan) -> dict[str, Any]:
        """The Strategy fields in which ``plan`` differs from the defaults' candidate."""
        base = self.candidates[0]
        return {
            name: getattr(plan, attr)
            for attr, name in STRATEGY_FIELDS
            if getattr(plan, attr) != getattr(base, attr)
        }

    @property
    def chosen(self) -> dict[str, Any] | None:
        """The choice as Strategy fields changed from the defaults ({}: the defaults stay);
        None until the trial is over."""
        return None if self.choice is None else self.changes(self.choice)

    def report(self, best: int) -> str:
        """The trial's table and the decision, as logged on rank 0."""
        lines = [
            f"auto: tried {len(self.candidates)} settings in {self.trial_steps} paired round(s) "
            "(the slowest rank's step time; ratio: the setting's step time over the defaults' "
            "in the same round, median and range; below 1.00x is faster):",
            f"  {'algorithm':<13}{'fuse MB':>8}{'comms':>6}{'median ms':>11}{'ratio':>8}  range",
        ]
        for i, (c, t) in enumerate(zip(self.candidates, self.medians, strict=True)):
            mark = "  defaults" if i == 0 else ("  <- chosen" if c == self.choice else "")
            ratios = self.ratios[i]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if i else "-"
            lines.append(
                f"  {c.algorithm:<13}{c.bucket_mb:>8g}{c.communicators:>6}{t * 1e3:>11.2f}"
                f"{statistics.median(ratios):>7.2f}x  {spread:<9}{mark}"
            )
        noise = f"the defaults varied {self.noise():.1%} between rounds"
        if self.choice is not None and self.choice != self.candidates[0]:
            lines.append(
                f"auto: chose {_fields(self.changes(self.choice))} ({self.gain(best):.1%} faster "
                f"than the defaults, faster in every round; {noise})"
            )
        elif best == 0:
            lines.append("auto: no clear winner: keeping the defaults (they were the fastest)")
        else:
            lines.append(
                f"auto: no clear winner: keeping the defaults (the fastest, "
                f"{_fields(self.changes(self.candidates[best]))}, was {self.gain(best):.1%} "
                f"faster, within the noise: {noise}, and a change needs more than "
                f"{MIN_GAIN:.0%} in every round)"
            )
        return "\n".join(lines)


def _fields(fields: dict[str, Any]) -> str:
    """``fuse_grad_size_in_MB=8, nccl_comm_num=2``."""
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )


def make_tuner(plan: CollectivePlan, build: Builder) -> AutoTuner | None:
    """The tuner for ``plan`` (``auto=True``), or None (logged why) when nothing is tuned."""
    reason = untunable(plan, dist.get_world_size())
    options = [] if reason else candidates(plan.comm, topology_algorithms())
    if not reason and len(options) == 1:
        reason = "every tuned field was set explicitly"
    if reason:
        if cluster.rank() == 0:
            log.info("auto: kept %s: %s", plan.comm.settings(), reason)
        return None
    tuner = AutoTuner(options, build)
    if cluster.rank() == 0:
        log.info(
            "auto: trying %d settings over the first %d communicating steps",
            len(options),
            tuner.trial_length,
        )
    return tuner
