"""Elastic training across emulated nodes (network namespaces on one bridge, 1 Gbit links):
3 nodes with one rank each, node 2 killed mid-epoch by `longboat emulate --kill-node`;
training finishes on 2 and equals a single-process replay of the committed global batches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longboat.launch import netns
from tests.elastic._cluster import PROBE
from tests.elastic.test_elastic_launch import SAMPLES, _check_against_replay
from tests.launch.test_emulate import _leftovers, needs_netns, run_id  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(150),
]  # slow tier: elastic nodes killed, cut and added across emulated nodes


def _emulate(
    job: str, tmp_path: Path, fault: list[str], worlds: tuple[int, int] = (3, 2), **env: str
) -> tuple[str, dict]:
    """Run the probe on emulated nodes (MIN 2) with ``fault``, the world going from
    ``worlds[0]`` to ``worlds[1]`` ranks; console text, probe result."""
    first, last = worlds
    out = tmp_path / "out.json"
    cmd = [
        *(sys.executable, "-m", "longboat", "emulate", "--nodes", str(first), "--min-nodes", "2"),
        *fault,
        *("--run-id", job, "--log-dir", str(tmp_path / "logs"), "--timeout", "120"),
        str(PROBE),
    ]
    env = dict(os.environ, PROBE_OUT=str(out), PROBE_SLEEP="0.1", PROBE_SAMPLES=str(SAMPLES), **env)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    assert "membership changed" in text and f"world size {first} -> {last}" in text, text[-4000:]
    result = json.loads(out.read_text())
    seen = [w for w, _ in result["history"]]
    assert seen[0] == first and seen[-1] == last, seen
    _check_against_replay(result)
    assert _leftovers(job) == []
    assert not netns.leftovers(f"{netns.PREFIX}{job}")
    return text, result


@needs_netns
def test_three_emulated_nodes_lose_one_and_finish_on_two(run_id: str, tmp_path: Path) -> None:  # noqa: F811
    text, _ = _emulate(run_id, tmp_path, ["--kill-node", "2@step=4"])
    assert "killed node 2" in text, text[-4000:]


@needs_netns
def test_a_node_whose_link_is_cut_is_dropped_and_the_others_finish(
    run_id: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    # the survivors' launchers notice the silent node from its rendezvous heartbeats in about
    # 1.5 s and publish a round without it; their ranks, blocked in a collective with it, close
    # their connections to it then and leave long before the (here 10 minute) failure timeout
    began = time.monotonic()
    text, _ = _emulate(run_id, tmp_path, ["--cut-link", "2@step=4"], LONGBOAT_TIMEOUT="600")
    assert "node 2" in text and "link" in text, text[-4000:]
    ranks = "".join(f.read_text() for f in (tmp_path / "logs").glob("node*/workerlog.*"))
    assert re.search(r"has no node at [0-9.]+: closed [1-9]\d* connection", ranks), ranks[-4000:]
    assert time.monotonic() - began < 600  # the failure timeout did not end the wait


@needs_netns
def test_a_node_added_mid_run_gets_the_state_and_widens_the_world(
    run_id: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    # the job holds at commit 6 until the added node is in, so it cannot finish first
    text, _ = _emulate(
        run_id, tmp_path, ["--add-node", "step=4"], worlds=(2, 3), PROBE_WAIT_FOR_WORLD="3@6"
    )
    assert "joined" in text, text[-4000:]
