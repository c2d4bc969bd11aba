"""Parameter-server trainers on the timeline (a ``ps`` lane of pushes and pulls per trainer) and
stall inspection of server replies (a warning naming the server, method, step and keys; exit 70
after ``stall_shutdown_seconds``). Servers are threads of the test process, trainers processes."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longboat.trace import STALL_EXIT_CODE, rank_stats
from longboat.trace.recorder import rank_path
from tests._dist import run_ranks
from tests.ps._harness import servers

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def train(
    rank: int,
    world: int,
    eps: list[str],
    token: str,
    steps: int = STEPS,
    late_s: float = 0.0,
    hold: Callable[[], None] | None = None,
    **fields: object,
) -> None:
    """``steps`` sync steps; with ``late_s`` trainer 1 sleeps that long before its step-1 push
    (with ``hold``, it calls that instead: a wait that ends on an event)."""
    import longboat as lb

    model = _model()
    strategy = lb.Strategy(mode="ps", a_sync=False, **fields)
    m, opt = lb.ps.distribute(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        strategy,
        servers=eps,
        trainer=rank,
        trainers=world,
        token=token,
    )
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        if step == 1 and rank == 1 and hold is not None:
            hold()  # the other trainer's pull of step 1 waits for this push
        elif step == 1 and rank == 1 and late_s:
            time.sleep(late_s)  # the other trainer's pull of step 1 waits for this push
        loss.backward()
        opt.step()
    m.engine.close()


def _timeline(rank: int, world: int, eps: list[str], token: str, path: str) -> None:
    train(rank, world, eps, token, timeline=path)


def test_ps_timeline_has_a_ps_lane_per_trainer(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    with servers(2) as (eps, token):
        run_ranks(_timeline, WORLD, eps, token, str(path), timeout=90)
    assert rank_path(path, 0).exists() and rank_path(path, 1).exists()
    doc = json.loads(path.read_text())  # rank 0 merged both trainers' files
    events = doc["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    procs = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0, 1}
    for pid in (0, 1):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        calls = [e for e in spans if lanes[(pid, e["tid"])].startswith("ps")]
        assert lanes[(pid, calls[0]["tid"])] in {"ps", "ps1", "ps2", "ps3"}
        names = {e["name"] for e in calls}
        # every step pushes to both servers, the step's last push asking for the next values
        # ("push+pull"; plus init, barrier and the first plain pulls)
        assert {"push+pull s0", "push+pull s1", "pull s0", "pull s1"} <= names, names
        pushes = [e for e in calls if e["name"].startswith("push")]
        pulls = [e for e in calls if "pull" in e["name"]]
        assert len(pushes) >= STEPS * 2 and len(pulls) >= STEPS * 2
        for e in pushes + pulls:
            assert e["cat"] == "ps" and e["dur"] >= 0 and e["ts"] >= 0
            assert e["args"]["bytes"] > 0 and e["args"]["server"] in (0, 1)
            assert e["name"].endswith(f"s{e['args']['server']}") and "step" in e["args"]
        assert {e["args"]["step"] for e in pushes} >= set(range(STEPS))
        # one call at a time per lane: spans of a lane never overlap (valid Chrome nesting)
        for tid in {e["tid"] for e in calls}:
            lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in calls if e["tid"] == tid)
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(lane, lane[1:], strict=False))
        by_name = [e["name"] for e in spans]
        assert by_name.count("forward") == STEPS and by_name.count("backward") == STEPS
        assert by_name.count("optimizer step") == STEPS
        assert "wait pull" in by_name and "wait barrier" in by_name
    stats = rank_stats(events)
    assert [s.rank for s in stats] == [0, 1]
    assert all(s.steps == STEPS and s.comm_ms > 0 for s in stats)


HOLD_S = 30.0  # the longest trainer 1 stays late waiting for trainer 0's warning


def _warnings(rank: int, world: int, eps: list[str], token: str, flags: str) -> list[str]:
    """Trainer 1 is late for its step-1 push until trainer 0 has warned about its pull of step
    1 (a file in ``flags``; at most HOLD_S seconds, then it goes on and the test says what is
    missing)."""
    records: list[str] = []
    warned = Path(flags, "warned")

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())
            if "has not answered pull of step 1" in record.getMessage():
                warned.touch()

    def hold() -> None:
        deadline = time.monotonic() + HOLD_S
        while not warned.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    logging.getLogger("longboat.stall").addHandler(Keep(logging.WARNING))
    train(rank, world, eps, token, hold=hold, stall_warning_seconds=1)
    return records


def test_late_push_warns_naming_server_method_step_and_keys(tmp_path: Path) -> None:
    with servers(2) as (eps, token):
        warned = run_ranks(_warnings, WORLD, eps, token, str(tmp_path), timeout=90)
    pulls = [w for w in warned[0] if "has not answered pull of step 1" in w]
    assert pulls, (
        f"trainer 0 waited up to {HOLD_S:g} s with stall_warning_seconds=1 but warned {warned[0]}"
    )
    text = pulls[0]
    server = int(re.search(r"parameter server (\d) ", text).group(1))  # type: ignore[union-attr]
    assert f"({eps[server]})" in text  # the endpoint
    assert text.startswith("trainer 0: parameter server ")
    assert "for keys [" in text and ("weight" in text or "bias" in text)
    assert "waits for trainer 1" in text
    waited = float(re.search(r"after ([\d.]+) s", text).group(1))  # type: ignore[union-attr]
    assert 1.0 <= waited < 3.0  # warned while trainer 1 was still asleep
    assert not [w for w in warned[1] if "pull of step 1" in w]  # trainer 1 did not wait


@pytest.mark.slow  # slow tier: a stalled job ended by its timeout
def test_stall_shutdown_exits_with_stall_code() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"
    with servers(2) as (eps, token):
        procs = []
        try:
            for rank in (0, 1):
                script = (
                    "from tests.ps.test_trace import train; "
                    f"train({rank}, 2, {eps!r}, {token!r}, 3, late_s=60.0, "
                    "stall_warning_seconds=1, stall_shutdown_seconds=2)"
                )
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", script],
                        cwd=ROOT,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
            out, _ = procs[0].communicate(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
                if p.stdout is not None:
                    p.stdout.close()
    assert procs[0].returncode == STALL_EXIT_CODE, out
    assert "has not answered pull of step 1" in out and "waits for trainer 1" in out
    assert "Shutting down (stall_shutdown_seconds=2): exit 70" in out


def test_stalled_trainer_learns_from_the_server_which_trainer_is_late() -> None:
    """3 trainers: trainers 0 and 2 pushed step 0, trainer 1 did not; trainer 0's warning for
    its pull of step 1 names trainer 1 as the server reports it (not "one or more of")."""
    from concurrent.futures import ThreadPoolExecutor

    import longboat as lb

    with servers(1) as (eps, token):

        def connect(rank: int):
            model = _model()
            return lb.ps.distribute(
                model, torch.optim.SGD(model.parameters(), lr=0.1),
                lb.Strategy(mode="ps", a_sync=False), servers=eps, trainer=rank, trainers=3,
                token=token,
            )  # fmt: skip

        with ThreadPoolExecutor(3) as pool:
            trainers = list(pool.map(connect, range(3)))

        def step(rank: int) -> None:
            m, opt = trainers[rank]
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1])).backward()
            opt.step()

        step(0)
        step(2)
        engine = trainers[0][0].engine
        # the pull of step 0's result, in flight: it rode on trainer 0's last push, which
        # step() does not wait for, so the server may not have applied the pushes yet
        pull = next(iter(engine._pending.values()))[0]
        try:
            deadline = time.monotonic() + 30
            text = engine.explain_wait(pull, 5.0)
            while "trainer 1 (the server says)" not in text and time.monotonic() < deadline:
                time.sleep(0.05)
                text = engine.explain_wait(pull, 5.0)
        finally:
            step(1)  # releases the pulls, so that close() does not wait for the deadline
            for m, _ in trainers:
                m.engine.close()
        assert "has not answered pull of step 0" in text
        assert "waits for trainer 1 (the server says)" in text, text


def test_server_names_missing_pushes_and_barrier_arrivals() -> None:
    from longboat.ps.server.state import ServerState
    from longboat.ps.shared.wire import Message

    state = ServerState(0, 1)
    spec = {"key": "k", "update": "assign"}
    state.init(Message({"trainers": 3, "sync": True, "blocks": [spec]}, {"k": torch.zeros(2)}))
    state.push(Message({"trainer": 2, "step": 0}, {"k": torch.ones(2)}))
    assert state.missing({"keys": ["k"], "version": 1}) == [0, 1]
    assert state.missing({"keys": ["k"], "version": 0}) == []  # already there
    import threading

    arrive = Message({"trainer": 1, "name": "kv", "generation": 1})
    waiter = threading.Thread(
        target=lambda: pytest.raises(TimeoutError, state.barrier, arrive, time.monotonic() + 2)
    )
    waiter.start()
    while ("kv", 1) not in state.barriers.arrived:
        time.sleep(0.01)
    assert state.missing({"barrier": ["kv", 1]}) == [0, 2]
    waiter.join()
