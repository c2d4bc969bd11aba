"""Where a new round resumes: never below the job's highest commit without a word.

Each node records the commits its ranks reached (``commits-<local rank>`` in its elastic
directory). When a round forms, every rank says what it holds (its commit count, or -1 for
none) and what its node recorded. The round resumes from the newest state some rank holds
(a survivor's memory, its node's copy, or a checkpoint it loaded). If that is below the
highest recorded commit, the ranks say how many steps are trained again; if no rank holds
anything while the job had committed steps, every copy is lost and the job ends with one
line instead of silently training again from commit 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from longboat.elastic.membership import ElasticError
from longboat.log import get_logger

_log = get_logger("longboat.elastic")


class StateLostError(ElasticError):
    """Every copy of the committed state is gone: the job stops instead of starting over."""


@dataclass(frozen=True)
class Resume:
    """What the ranks of a round hold (-1: nothing) and the highest commit any node recorded."""

    held: list[int]
    recorded: int

    @property
    def best(self) -> int:
        return max(self.held)


def check(resume: Resume, copies: str) -> None:
    """Raise `StateLostError` (the same on every rank: ``resume`` is the round's) when no rank
    holds state but the job had committed steps; warn when the round resumes below the highest
    recorded commit. ``copies`` says where node copies were looked for (or that they are off)."""
    best, recorded = resume.best, resume.recorded
    if best >= 0 and best >= recorded:
        return
    if best >= 0:
        _log.warning(
            "resuming from commit %d, the newest state that survived: the job had reached "
            "commit %d, so %d committed step%s %s trained again",
            best,
            recorded,
            recorded - best,
            "" if recorded - best == 1 else "s",
            "is" if recorded - best == 1 else "are",
        )
        return
    if recorded <= 0:
        return  # a fresh job: every rank starts from the same initial state
    raise StateLostError(
        f"every copy of the committed state is lost: the job had reached commit {recorded}, "
        f"but no rank of this round holds it, no node copy was found ({copies}) and no "
        "checkpoint was loaded. Starting again from commit 0 would silently throw away "
        f"{recorded} committed steps, so the job stops here. Keep a copy on disk with "
        "lb.elastic.State(checkpoint=PATH, checkpoint_every=N) and call state.load_checkpoint() "
        "before train(state); to start over on purpose, launch the job again"
    )
