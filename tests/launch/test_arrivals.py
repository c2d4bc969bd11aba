"""A node waiting at the rendezvous says who has arrived, and gives up in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
from torch.distributed import DistNetworkError, DistStoreError

from longboat.launch.arrivals import RendezvousWait, arrived_nodes, gave_up_line
from tests._dist import free_port
from tests.launch._launcher import run_launcher


class _Node(NamedTuple):  # what torch's _NodeDesc offers here
    addr: str


def _handler(*addrs: str, waiting: tuple[str, ...] = ()) -> SimpleNamespace:
    nodes = {_Node(a): i for i, a in enumerate(addrs)}
    state = SimpleNamespace(participants=nodes, wait_list={_Node(a) for a in waiting})
    return SimpleNamespace(_state_holder=SimpleNamespace(state=state))


def test_waiting_lines_name_the_nodes_that_arrived() -> None:
    said: list[str] = []
    wait = RendezvousWait(said.append, "10.0.0.1:29500", "2:4", 300, every_s=None)
    wait.start(_handler("10.0.0.2", waiting=("10.0.0.1",)))
    assert wait.line().startswith(
        "longboat launch: waiting at the rendezvous on 10.0.0.1:29500 for 2:4 nodes ("
    )
    assert wait.line().endswith("2 here (10.0.0.1, 10.0.0.2)")
    assert arrived_nodes(SimpleNamespace()) is None  # a static rendezvous does not say


def test_giving_up_is_one_line_with_the_count_and_what_to_check() -> None:
    wait = RendezvousWait(lambda _: None, "10.0.0.1:29500", "2", 10, every_s=None)
    static = DistStoreError("Timed out after 11 seconds waiting for clients. 1/2 clients joined.")
    line = gave_up_line(wait, static, "10.0.0.1")
    assert line.startswith("longboat launch: 1 of 2 nodes reached the rendezvous on 10.0.0.1:29500")
    assert "--master 10.0.0.1:29500" in line and "--timeout" in line and "\n" not in line
    unreachable = gave_up_line(wait, DistNetworkError("client socket timed out"), "10.0.0.7")
    assert "this node could not connect to the rendezvous" in unreachable


@pytest.mark.slow  # two launches that wait out their rendezvous timeout
@pytest.mark.parametrize("nnodes", ["2", "2:4"])
def test_a_lonely_node_reports_while_waiting_and_ends_in_one_line(tmp_path: Path, nnodes: str):
    script = tmp_path / "train.py"
    script.write_text("import longboat as lb\nlb.init()\n")
    master = f"127.0.0.1:{free_port()}"
    extra = ["--node-rank", "0"] if ":" not in nnodes else []
    done = run_launcher(
        tmp_path, "--nnodes", nnodes, *extra, "--master", master, "--timeout", "7", str(script),
        timeout=60,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Traceback" not in out, out[-3000:]
    assert f"waiting at the rendezvous on {master} for {nnodes} nodes (5 s of 7 s)" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("longboat launch: 1 ") and f"rendezvous on {master} within 7 s" in last
    assert (f"nnodes: {nnodes} (elastic)" if ":" in nnodes else f"nnodes: {nnodes}") in out
    if ":" in nnodes:
        assert "node_rank: assigned at the rendezvous" in out
