"""`longboat.comm.waiting`: a wait that an installed interrupt can end."""

from __future__ import annotations

import threading

import pytest
from torch.futures import Future

from longboat.comm import waiting

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _no_interrupt():
    yield
    waiting.set_interrupt(None)
    waiting.abandoned().clear()


def test_without_an_interrupt_it_is_the_handles_own_wait() -> None:
    future: Future = Future()
    threading.Timer(0.3, future.set_result, args=(None,)).start()
    waiting.wait(future)
    assert future.done() and waiting.abandoned() == []


def test_a_collective_that_finishes_is_waited_for_across_slices() -> None:
    checks: list[int] = []

    def check() -> BaseException | None:
        checks.append(1)
        return None

    waiting.set_interrupt(check)
    future: Future = Future()
    threading.Timer(3 * waiting.SLICE_S, future.set_result, args=(None,)).start()
    waiting.wait(future)
    assert future.done() and checks and waiting.abandoned() == []


def test_the_collectives_own_error_is_raised() -> None:
    waiting.set_interrupt(lambda: None)
    future: Future = Future()
    future.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="closed by peer"):
        waiting.wait(future)


def test_the_interrupt_ends_a_hopeless_wait_and_keeps_the_collective() -> None:
    calls: list[int] = []

    def check() -> BaseException | None:
        calls.append(1)
        return LookupError("node gone") if len(calls) >= 2 else None

    waiting.set_interrupt(check)
    future: Future = Future()  # never completes
    with pytest.raises(LookupError, match="node gone"):
        waiting.wait(future)
    assert waiting.abandoned() == [future] and len(calls) == 2
