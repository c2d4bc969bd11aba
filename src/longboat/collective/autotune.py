"""``Strategy(auto=True)``: time a few reducer settings on the first training steps, keep the fastest.

The tuned settings are the allreduce algorithm, the fusion size (``fuse_grad_size_in_MB``) and
the number of communicators (``nccl_comm_num``); fields the user set (any source but the
default) stay fixed. Each candidate is a complete, correct :class:`Reducer`, built through the
same path as the defaults' one, so training stays exact while candidates are tried.

Schedule (it depends only on the count of communicating steps, so every rank switches at the
same step): candidate ``i`` owns steps ``[i·p, (i+1)·p)`` with ``p = warm-up + trial steps``, the
defaults first. A step's time runs from one communicating ``forward`` to the next (forward,
backward, allreduce wait, optimizer step). After the last trial step every rank all-reduces its
vector of median times with MAX (the slowest rank decides), picks the fastest candidate, and
keeps it for the rest of training. The defaults stay unless a candidate beats them by at least
``MIN_GAIN``: three timed steps are noisy, and the choice must never be slower than the defaults.
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

TRIAL_STEPS = 3  # timed steps per candidate
WARMUP_STEPS = 1  # untimed steps per candidate after switching to it (buffers, connections)
MIN_GAIN = 0.03  # a candidate replaces the defaults only when this much faster (fraction)
FUSE_SIZES_MB = (8.0, 2.0)  # tried besides the plan's own bucket size
COMM_NUMS = (1, 2)
clock: Callable[[], float] = time.perf_counter  # replaceable in tests

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
        return len(self.candidates) * (self.warmup_steps + self.trial_steps)

    def before_step(self, model: DistributedModel) -> None:
        """At a communicating forward, before the reducer is prepared: time and switch."""
        if self.done:
            return
        now = self._clock()
        per = self.warmup_steps + self.trial_steps
        step = self._steps  # the step that begins now
        if step > 0:
            owner, position = divmod(step - 1, per)
            if position >= self.warmup_steps:
                self._times[owner].append(now - self._began)
        self._steps += 1
        if step == self.trial_length:
            self._decide(model)
        elif step > 0 and step % per == 0:
            self._install(model, step // per)
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
        mine = [statistics.median(t) for t in self._times]
        device = model.reducer.params[0].device
        slowest = torch.tensor(mine, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the same numbers, hence choice, on all
        self.medians = slowest.cpu().tolist()
        best = min(range(len(self.medians)), key=lambda i: (self.medians[i], i))
        gain = 1.0 - self.medians[best] / self.medians[0]
        winner = best if gain >= MIN_GAIN else 0
        if winner != self.active:
            self._install(model, winner)
        self.choice = self.candidates[winner]
        self._build = None  # drops the cached communicators of the losers
        if cluster.rank() == 0:
            log.info("%s", self.report(best, gain))

    def report(self, best: int, gain: float) -> str:
        """The trial's table and the decision, as logged on rank 0."""
        base = self.medians[0]
        lines = [
            f"auto: tried {len(self.candidates)} settings, {self.trial_steps} timed step(s) each "
            "(median step time of the slowest rank):",
            f"  {'algorithm':<13}{'fuse MB':>8}{'comms':>6}{'median ms':>11}{'vs defaults':>13}",
        ]
        for i, (c, t) in enumerate(zip(self.candidates, self.medians, strict=True)):
            mark = "  defaults" if i == 0 else ("  <- chosen" if c == self.choice else "")
            lines.append(
                f"  {c.algorithm:<13}{c.bucket_mb:>8g}{c.communicators:>6}"
                f"{t * 1e3:>11.2f}{t / base:>12.2f}x{mark}"
            )
        assert self.choice is not None
        if self.choice != self.candidates[0]:
            why = f"{gain:.1%} faster than the defaults"
        elif best == 0:
            why = "the defaults were the fastest"
        else:
            why = (
                f"kept the defaults: the fastest, {self.candidates[best].settings()}, was only "
                f"{gain:.1%} faster, under the {MIN_GAIN:.0%} needed to switch"
            )
        lines.append(f"auto: chose {self.choice.settings()} ({why})")
        return "\n".join(lines)


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
