"""The elastic launcher's exit barrier on a real TCP store: it ends when every node of the
round checked in, when one can no longer, or on a signal, never in one blocking store call."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from longboat.launch.elastic_agent import exit_barrier
from tests.elastic._cluster import free_port

#: Far longer than any run of these tests: reaching it means the barrier did not end early.
NEVER = 120.0


@pytest.fixture
def store() -> Iterator[dist.Store]:
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    yield dist.PrefixStore("round-7", server)
    del server


def test_every_node_checks_in_and_all_leave_together(store):
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(exit_barrier(store, 3, str, NEVER)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NEVER)
    assert results == ["", "", ""]


def test_a_node_that_can_no_longer_arrive_ends_the_wait_with_its_reason(store):
    polls = iter(["", "", "1 node of the round left the rendezvous"])
    assert exit_barrier(store, 2, lambda: next(polls), NEVER, poll=0.01) == (
        "1 node of the round left the rendezvous"
    )


def test_a_node_checking_in_meanwhile_wins_over_a_reason(store):
    def gone() -> str:
        exit_barrier(store, 2, str, NEVER)  # the other node checks in now
        return "the rendezvous moved on"

    assert exit_barrier(store, 2, gone, NEVER, poll=0.01) == ""


def test_the_wait_is_bounded(store):
    assert exit_barrier(store, 2, str, 0.0, poll=0.01).startswith("not every node finished")


def test_each_store_call_is_bounded_by_the_given_guard(store):
    entered = []

    class Guard:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            pass

    polls = iter(["", "gone"])
    assert exit_barrier(store, 2, lambda: next(polls), NEVER, Guard, poll=0.01) == "gone"
    assert len(entered) == 4  # check in, two polls, the last look


class _Signalled(Exception):
    pass


def test_a_signal_ends_the_wait_at_once(store):
    def raise_it(signum: int, frame: object) -> None:
        raise _Signalled

    previous = signal.signal(signal.SIGUSR1, raise_it)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(_Signalled):
            exit_barrier(store, 2, str, NEVER)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
