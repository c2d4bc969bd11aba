"""Stall inspector on Gloo: a late rank is named with the tensors it is missing; shutdown exits."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longboat.trace.stall import STALL_EXIT_CODE, finished, missing_report
from tests._dist import run_ranks
from tests.trace.stall_probe import train

PROBE = Path(__file__).with_name("stall_probe.py")
PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias"]


HOLD_S = 30.0  # the longest a late rank waits for rank 0's warning before it goes on anyway


def _keep_warnings(records: list[str], flags: Path, stage: list[str]) -> None:
    """Append this rank's stall warnings to ``records``; each one also marks, in the directory
    ``flags`` shared by the ranks, that a warning was logged during ``stage[0]``."""

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())
            (flags / f"warned-{stage[0]}").touch()

    logging.getLogger("longboat.stall").addHandler(Keep(logging.WARNING))


def _late_until_warned(flags: Path, stage: str) -> None:
    """Stay late until rank 0 has warned during ``stage`` (at most HOLD_S seconds: without a
    warning the late rank goes on, and the test's assertions say what is missing)."""
    deadline = time.monotonic() + HOLD_S
    while not (flags / f"warned-{stage}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _warned(rank: int, world_size: int, flags: str) -> list[str]:
    records: list[str] = []
    _keep_warnings(records, Path(flags), ["step"])
    train(
        sleep_s=0.0,
        warning_s=1.0,
        shutdown_s=0.0,
        hold=lambda: _late_until_warned(Path(flags), "step"),
    )
    return records


def test_late_rank_is_named_with_its_missing_tensors(tmp_path: Path) -> None:
    warned = run_ranks(_warned, 2, str(tmp_path), timeout=120)
    assert warned[1] == []  # rank 1 never waited
    assert warned[0], (
        f"rank 0 waited {HOLD_S:g} s with stall_warning_seconds=1 but logged no warning"
    )
    text = warned[0][0]
    assert text.startswith("rank 0 has waited ")
    assert "for the allreduce of bucket 0" in text
    missing = text.split("Missing ranks: ", 1)[1]
    assert missing.startswith("1: [")  # rank 1, and only rank 1
    assert all(name in missing for name in PARAMS)  # one bucket: all of it is missing
    assert "raise stall_warning_seconds" in text


def test_stall_shutdown_ends_the_job_non_zero(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "longboat", "launch", "--nproc-per-node", "2"]
    cmd += ["--log-dir", str(tmp_path / "log"), str(PROBE), "60", "1", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"rank 0 exited with code {STALL_EXIT_CODE}" in text  # the launcher names it
    assert "Missing ranks: 1: [" in text
    assert "stall_shutdown_seconds=2" in text


@pytest.mark.slow  # slow tier: waits out a job timeout
def test_hung_rank_ends_a_default_job_at_the_job_timeout(tmp_path: Path) -> None:
    """Default strategy, LONGBOAT_TIMEOUT=6: rank 1 sleeps 600 s before its backward. The
    gradient communicator carries the job's timeout (torch's default would be 30 minutes), so
    the job ends, and rank 0's last report names rank 1 and its tensors."""
    cmd = [sys.executable, "-m", "longboat", "launch", "--nproc-per-node", "2"]
    cmd += ["--log-dir", str(tmp_path / "log"), str(PROBE), "600"]
    env = {**os.environ, "LONGBOAT_TIMEOUT": "6"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    # the launcher's failure summary leads with the rank rank 0 waited for
    summary = text.split("longboat launch: rank 1 stopped responding", 1)[1]
    assert "waiting for it, rank 0 exited" in summary.splitlines()[0], summary
    assert "--- stall report of rank 0 " in summary, summary
    report = summary.split("--- stall report of rank 0 ", 1)[1].splitlines()[1]
    assert "rank 0 has waited" in report and "Missing ranks: 1: [" in report, report
    assert all(name in report for name in PARAMS), report


def test_missing_report_spans_buckets_and_unpublished_ranks() -> None:
    buckets = [["c.weight"], ["b.weight"], ["a.weight"]]
    # waiting on launch 6 (bucket 2 of the second step); rank 1 launched 4 (bucket 0 of it)
    text = missing_report(6, {0: 6, 1: 4, 2: None, 3: 6}, buckets)
    assert text == (
        "Missing ranks: 1: [b.weight, a.weight]; 2: [no progress published: not started, or dead]"
    )
    assert missing_report(3, {0: 3, 1: 3}, buckets).endswith("none (all arrived; slow network?)")


@pytest.mark.parametrize("value", [True, False])
def test_finished_reads_future_state(value: bool) -> None:
    import torch

    f: torch.futures.Future = torch.futures.Future()
    if value:
        f.set_result(None)
    assert finished(f) is value


def _named_waits(rank: int, world_size: int, flags: str) -> list[str]:
    """Rank 1 is late (until rank 0 has warned) for a barrier, a SyncBatchNorm forward and a
    local-SGD averaging; rank 0 (stall_warning_seconds=1) returns its warnings."""
    from collections import OrderedDict

    import torch
    from torch import nn
    from torch.nn import functional as F

    import longboat as lb

    records: list[str] = []
    stage = ["setup"]
    _keep_warnings(records, Path(flags), stage)

    def late(name: str) -> None:
        stage[0] = name
        if rank == 1:
            _late_until_warned(Path(flags), name)

    strategy = lb.Strategy(
        stall_warning_seconds=1,
        sync_batch_norm=True,
        localsgd=True,
        localsgd_configs={"k_steps": 1, "begin_step": 1},
    )
    lb.init(strategy)
    torch.manual_seed(0)
    layers = [("fc", nn.Linear(4, 4)), ("bn1", nn.BatchNorm1d(4)), ("head", nn.Linear(4, 2))]
    model = nn.Sequential(OrderedDict(layers))
    model, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    late("barrier")
    lb.barrier()  # rank 0 waits here: "barrier"
    records.append("-- barrier done")
    late("forward")
    loss = F.cross_entropy(model(x), y)  # rank 0 waits in bn1's forward allreduce
    records.append("-- forward done")
    loss.backward()
    late("step")
    opt.step()  # rank 0 waits in the parameter averaging
    records.append("-- step done")
    return records


@pytest.mark.slow  # slow tier: three more stalled jobs
def test_barrier_sync_bn_and_local_sgd_waits_are_named(tmp_path: Path) -> None:
    warned = run_ranks(_named_waits, 2, str(tmp_path), timeout=120)
    assert [w for w in warned[1] if not w.startswith("--")] == []  # rank 1 never waited
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for w in warned[0]:
        if w.startswith("--"):
            stages[w], current = current, []
        else:
            current.append(w)
    barrier = stages["-- barrier done"]
    assert barrier and barrier[0].startswith("rank 0 has waited 1.")
    # after the settings check, the model check and the broadcast of lb.distribute
    assert "for the barrier (collective #4)" in barrier[0]
    assert (
        "Missing ranks: 1: [not at it yet; last collective: after #3 broadcast of parameters]"
        in barrier[0]
    )
    bn = stages["-- forward done"]
    assert bn and "for the sync BN statistics of bn1 (collective #5)" in bn[0]
    assert "Missing ranks: 1: [not at it yet; last collective: after #4 barrier]" in bn[0]
    averaging = stages["-- step done"]
    assert averaging and "for the local SGD averaging of bucket 0 (collective #" in averaging[0]
    assert "sync BN gradient statistics of bn1" in averaging[0]  # rank 1's last one: backward


def test_bucket_names_follow_an_auto_reducer_switch() -> None:
    """Launch m maps to a bucket of the reducer installed when m was launched: after a switch at
    launch 3 from 3 buckets to 2, launch 4 is the new bucket 0 (not (4 - 1) % 2 = 1)."""
    import functools
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from longboat.collective.autotune import AutoTuner
    from longboat.collective.model import DistributedModel
    from longboat.collective.plan import Placement, resolve_comm
    from longboat.strategy import Strategy
    from longboat.trace.stall import StallWatch

    store = dist.HashStore()
    old = [["c.weight"], ["b.weight"], ["a.weight"]]
    new = [["y.weight", "x.weight"], ["z.weight"]]
    watch = StallWatch(store, "switch", 0, 2, old, warning_s=60.0)
    try:
        for b in range(3):  # one step of the old reducer, completed
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            watch.launched(b, done)
        watch.end_wait()
        # the tuner installs another reducer at the next forward (as AutoTuner._install does)
        reducer = SimpleNamespace(observer=None, bucket_members=lambda: new, params=[])
        old_reducer = SimpleNamespace(observer=SimpleNamespace(watch=watch), remove_hooks=lambda: 0)
        model = SimpleNamespace(
            reducer=old_reducer, compressors=(), plan=None, settle_parameters=lambda: None
        )
        model.replace_reducer = functools.partial(DistributedModel.replace_reducer, model)
        plan = resolve_comm(Strategy(env={}), Placement.of((0, 0), "gloo"))
        tuner = AutoTuner([plan] * 2, lambda c: (reducer, []))
        tuner._install(model, 1)
        assert model.reducer is reducer and watch.buckets == new
        pending: torch.futures.Future = torch.futures.Future()
        watch.launched(0, pending)  # launch 4: bucket 0 of the new reducer, in flight
        watch.begin_wait()
        peers = dist.PrefixStore("longboat/stall/switch/", store)
        peers.set("1", "3")  # rank 1 finished the old reducer's step only
        text = watch.describe(2.0)
        assert "allreduce of bucket 0 (launch 4)" in text
        assert text.endswith("Missing ranks: 1: [y.weight, x.weight]")
        peers.set("1", "2")  # rank 1 is still in the old reducer's last bucket
        assert watch.describe(2.0).endswith("Missing ranks: 1: [a.weight, y.weight, x.weight]")
        pending.set_result(None)
    finally:
        watch.close()
