"""Fault injection for `longboat emulate`: what to break, and when (parsing and validation only).

    --kill-node NODE@WHEN      SIGKILL every process of that node's namespace
    --cut-link NODE@WHEN       take the node's veth link down (both ends)
    --restore-link NODE@WHEN   bring it up again (needs an earlier --cut-link of that node)
    --add-node WHEN            start one more node (a spare namespace built up front)

WHEN is a time since all nodes started (``10s``, ``2.5s``) or a training step (``step=5``:
once any node's highest committed step reaches 5). Any fault makes the run elastic. Everything
here is pure: `longboat.launch.emulate` fires the events.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from longboat.elastic.membership import highest_commits

__all__ = [
    "Fault",
    "FaultError",
    "FaultPlan",
    "When",
    "highest_step",
    "parse_fault",
    "parse_when",
    "plan_faults",
]

KINDS = ("kill", "cut", "restore", "add")
#: The command-line flag of each kind (error messages name it).
FLAGS = {
    "kill": "--kill-node",
    "cut": "--cut-link",
    "restore": "--restore-link",
    "add": "--add-node",
}
_WHEN_FORMAT = "a time such as 10s or 2.5s, or a step such as step=5"


class FaultError(ValueError):
    """A fault flag is malformed or inconsistent with the run; the message names it."""


@dataclass(frozen=True)
class When:
    """A trigger: ``seconds`` after all nodes started, or once a node committed ``step``."""

    seconds: float | None = None
    step: int | None = None

    def due(self, elapsed: float, step: int) -> bool:
        """Whether the trigger has come, ``elapsed`` s after the start with ``step`` committed."""
        if self.step is not None:
            return step >= self.step
        return elapsed >= (self.seconds or 0.0)

    def before(self, other: When) -> bool | None:
        """Whether this trigger comes strictly first; None when a time and a step are compared."""
        if self.step is not None and other.step is not None:
            return self.step < other.step
        if self.seconds is not None and other.seconds is not None:
            return self.seconds < other.seconds
        return None

    def __str__(self) -> str:
        return f"step={self.step}" if self.step is not None else f"{self.seconds:g}s"


@dataclass(frozen=True)
class Fault:
    """One injected event: ``kind`` (kill, cut, restore, add) of ``node`` at ``when``.

    ``node`` is None for ``add`` (the added node gets the next free index when it starts).
    """

    kind: str
    node: int | None
    when: When

    @property
    def flag(self) -> str:
        target = "" if self.node is None else f"{self.node}@"
        return f"{FLAGS[self.kind]} {target}{self.when}"


@dataclass(frozen=True)
class FaultPlan:
    """The run's faults and its elastic shape.

    ``elastic``: launchers get ``--nnodes min_nodes:max_nodes`` (``max_nodes`` = the initial
    nodes plus one per ``--add-node``) and a rendezvous hosted by emulate itself.
    """

    faults: tuple[Fault, ...] = ()
    nodes: int = 1
    min_nodes: int | None = None

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None

    @property
    def spares(self) -> int:
        """Namespaces built up front for ``--add-node``."""
        return sum(f.kind == "add" for f in self.faults)

    @property
    def max_nodes(self) -> int:
        return self.nodes + self.spares


def parse_when(text: str, flag: str = "WHEN") -> When:
    """``10s`` / ``2.5s`` -> seconds; ``step=5`` -> step 5."""
    value = text.strip()
    step = re.fullmatch(r"step=(\d+)", value)
    if step:
        return When(step=int(step.group(1)))
    seconds = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)s", value)
    if seconds:
        return When(seconds=float(seconds.group(1)))
    raise FaultError(f"{flag} {text!r}: WHEN {text!r} is not {_WHEN_FORMAT}")


def parse_fault(kind: str, text: str) -> Fault:
    """``NODE@WHEN`` (kill, cut, restore) or ``WHEN`` (add) -> a `Fault`."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")
    flag = f"{FLAGS[kind]} {text}"
    if kind == "add":
        return Fault(kind, None, parse_when(text, flag))
    node, at, when = text.partition("@")
    if not at or not re.fullmatch(r"\s*\d+\s*", node):
        raise FaultError(
            f"{flag!r} is not NODE@WHEN: give a node index, '@' and {_WHEN_FORMAT} "
            "(e.g. 1@10s or 1@step=5)"
        )
    return Fault(kind, int(node), parse_when(when, flag))


def plan_faults(
    nodes: int,
    min_nodes: int | None = None,
    kill: Sequence[str] = (),
    cut: Sequence[str] = (),
    restore: Sequence[str] = (),
    add: Sequence[str] = (),
) -> FaultPlan:
    """Parse the fault flags of a run of ``nodes`` nodes and check them against each other.

    Any fault makes the run elastic (``min_nodes`` defaults to 1 then); ``min_nodes`` must lie
    in 1..nodes; a NODE must be an initial or an added node; every restore needs a cut of the
    same node that does not come later (a time and a step are not compared).
    """
    faults = tuple(
        parse_fault(kind, text)
        for kind, texts in (("kill", kill), ("cut", cut), ("restore", restore), ("add", add))
        for text in texts
    )
    if min_nodes is not None and not 1 <= min_nodes <= nodes:
        raise FaultError(f"--min-nodes {min_nodes} must be between 1 and --nodes ({nodes})")
    if faults and min_nodes is None:
        min_nodes = 1
    plan = FaultPlan(faults, nodes, min_nodes)
    for fault in faults:
        if fault.node is not None and fault.node >= plan.max_nodes:
            added = f" plus {plan.spares} added by --add-node" if plan.spares else ""
            raise FaultError(
                f"{fault.flag!r}: there is no node {fault.node}; nodes are 0..{plan.max_nodes - 1}"
                f" (--nodes {nodes}{added})"
            )
    for fault in faults:
        if fault.kind == "restore" and not any(_undoes(fault, c) for c in faults):
            raise FaultError(
                f"{fault.flag!r} has no earlier --cut-link {fault.node}@WHEN to undo; "
                f"cut the link first (e.g. --cut-link {fault.node}@5s --restore-link "
                f"{fault.node}@10s)"
            )
    return plan


def _undoes(restore: Fault, cut: Fault) -> bool:
    """Whether ``cut`` is a cut of the restored node that may come first."""
    if cut.kind != "cut" or cut.node != restore.node or cut.when == restore.when:
        return False
    return restore.when.before(cut.when) is not True


def highest_step(directories: Sequence[Path]) -> int:
    """The highest committed step in ``<dir>/commits-*`` of any directory (-1 if none)."""
    return highest_commits(directories)
