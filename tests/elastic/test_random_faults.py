"""Randomised faults against the elastic guarantees, replayable by seed.

Each trial starts 3 launchers (``--nnodes 2:3``, 2 restarts each) on the elastic probe and
injects one fault drawn from a seeded generator: every rank killed at once, two ranks killed
within 2 s of each other, one rank killed, or one whole node (launcher and rank) killed, at a
random commit and delay. Whatever the fault, the run must end with every live launcher
successful, every sample used once, parameters equal to a one-process replay of the committed
batches, no rank training from scratch and no committed step trained again.

CI runs ``FAULT_TRIALS`` trials (default 4, one of each kind) from ``FAULT_SEED`` (default
0); run more by hand, e.g. ``FAULT_TRIALS=20 python -m pytest -m slow
tests/elastic/test_random_faults.py -s`` (``-s`` prints one line per trial: kind, fault,
recovery time). A failing trial names its seed: ``FAULT_SEED=<seed>
FAULT_TRIALS=1`` replays it.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.elastic.test_elastic_crash import crash, starts_of
from tests.elastic.test_elastic_launch import _check_against_replay

pytestmark = pytest.mark.slow  # slow tier: launchers on this machine, ranks and nodes killed

NODES = 3
SAMPLES = 384  # 32 steps on 3 nodes: every fault lands while the job still runs
TRIALS = int(os.environ.get("FAULT_TRIALS", "4"))
FIRST_SEED = int(os.environ.get("FAULT_SEED", "0"))
KINDS = ("every rank", "two ranks within 2 s", "one rank", "one node")


@dataclass(frozen=True)
class Fault:
    """One drawn fault, as the probe's PROBE_KILL spells it."""

    kind: str
    kill: str

    @property
    def whole_node(self) -> int | None:
        """The node whose launcher dies too, if any."""
        for spec in self.kill.split(","):
            if spec.partition("@")[0].endswith("!"):
                return int(spec.partition("!")[0])
        return None


def draw(seed: int) -> Fault:
    """The fault of trial ``seed`` (the same on every machine)."""
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)] if seed < len(KINDS) else rng.choice(KINDS)
    at = rng.randint(3, 6)
    nodes = rng.sample(range(NODES), 2)
    delay = round(rng.uniform(0.0, 0.3), 2)
    kills = {
        "every rank": f"all@{at}+{delay}",
        "two ranks within 2 s": f"{nodes[0]}@{at}+{delay},"
        f"{nodes[1]}@{at}+{round(delay + rng.uniform(0.0, 2.0), 2)}",
        "one rank": f"{nodes[0]}@{at}+{delay}",
        "one node": f"{nodes[0]}!@{at}+{delay}",
    }
    return Fault(kind, kills[kind])


def recovery_seconds(pid_dir: Path, records: list[dict]) -> float:
    """From the first kill until the last rank of the new world started training again."""
    kills = [float(p.read_text()) for p in pid_dir.glob("killed-*")]
    first, last = min(kills), max(kills)
    resumed: dict[int, float] = {}
    for line in records:
        if not line.get("final") and line["time"] > last:
            resumed.setdefault(line["pid"], line["time"])
    return max(resumed.values()) - first


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + TRIALS))
def test_a_random_fault_loses_no_commit_and_training_equals_the_replay(
    seed: int, tmp_path: Path
) -> None:
    fault = draw(seed)
    ends, records = crash(tmp_path, NODES, fault.kill, min_nodes=2, samples=SAMPLES)
    pid_dir = tmp_path / "pids"
    where = f"seed {seed}: {fault.kind} ({fault.kill})"
    for node, (code, console) in enumerate(ends):
        if node == fault.whole_node:
            continue
        assert code == 0, f"{where}: node {node} ended with {code}\n{console[-3000:]}"
    starts = starts_of(records)
    assert starts.count(0) == NODES, f"{where}: trained from scratch {starts}"
    logs = "".join(p.read_text() for p in tmp_path.glob("node*/workerlog.*"))
    assert "trained again" not in logs, f"{where}: committed steps were lost"
    _check_against_replay(json.loads((tmp_path / "out.json").read_text()), SAMPLES)
    print(f"\n{where}: recovered in {recovery_seconds(pid_dir, records):.2f} s")
