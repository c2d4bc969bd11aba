"""longboat.horovod's ops run on its negotiation thread: on a GPU that thread must start after
the submitting stream's kernels and the waiter's stream must wait for the thread's. Proved on
the CPU with a recording stand-in for CUDA's stream calls (no GPU needed)."""

from __future__ import annotations

import threading

import pytest
import torch

from longboat.comm import streams
from tests.comm.test_handles import RecordingSync


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    sync = RecordingSync()
    monkeypatch.setitem(streams.SYNCS, "cpu", sync)  # CPU tensors take the device path
    import longboat as lb
    import longboat.horovod.torch as hvd

    hvd.init()
    try:
        yield sync, hvd
    finally:
        hvd.shutdown()
        lb.shutdown()  # hvd.shutdown keeps longboat's cluster, as Horovod keeps MPI


def test_an_op_starts_after_the_submitting_stream_and_its_waiter_waits_for_it(recorded) -> None:
    sync, hvd = recorded
    caller = threading.get_ident()
    sync.log.clear()
    handle = hvd.allreduce_async(torch.ones(4), name="ordered", op=hvd.Sum)
    result = hvd.synchronize(handle)
    assert torch.equal(result, torch.ones(4))
    marks = [entry for entry in sync.log if entry[0] == "mark"]
    enters = [entry for entry in sync.log if entry[0] == "enter"]
    assert marks and marks[0][1] == caller  # recorded at submission, in the caller's thread
    assert enters, "the negotiation thread never waited for the submitting stream"
    assert sync.log.index(marks[0]) < sync.log.index(enters[0])
    work_futures = [f for f in sync.futures if f.done()]
    assert work_futures and all(f.completed_inside for f in work_futures)  # on the side stream
    assert all(f.waited_by == {caller} for f in work_futures)  # the waiter's stream waits


def test_every_kind_of_op_is_ordered(recorded) -> None:
    sync, hvd = recorded
    sync.log.clear()
    hvd.broadcast(torch.ones(3), root_rank=0, name="b")
    hvd.allgather(torch.ones(2, 2), name="g")
    hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], name="grouped")
    assert all(f.completed_inside for f in sync.futures if f.done())
    assert sum(1 for e in sync.log if e[0] == "enter") >= 4


def test_an_optimizer_is_distributed_by_one_wrapper_only(recorded) -> None:
    """hvd.DistributedOptimizer and lb.distribute each average gradients: handing one's
    optimizer to the other would average them twice, at twice the communication."""
    _, hvd = recorded
    import longboat as lb

    model = torch.nn.Linear(3, 2)
    wrapped = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    with pytest.raises(ValueError, match="already passed to hvd.DistributedOptimizer"):
        lb.distribute(model, wrapped, lb.Strategy())
    other = torch.nn.Linear(3, 2)
    _, staged = lb.distribute(other, torch.optim.SGD(other.parameters(), lr=0.1), lb.Strategy())
    with pytest.raises(ValueError, match="already passed to lb.distribute.*plain optimizer"):
        hvd.DistributedOptimizer(staged, named_parameters=other.named_parameters())
