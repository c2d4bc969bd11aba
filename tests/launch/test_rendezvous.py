"""The elastic jobs' rendezvous: torch's c10d handler with sub-second timings, a lost node
noticed from its heartbeats, and a bound on store calls that stopped returning."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)

from longboat.launch import rendezvous
from longboat.launch.ports import free_port
from longboat.launch.store_watchdog import StoreWatchdog

pytestmark = pytest.mark.timeout(60)


def _handlers(count: int, min_nodes: int) -> tuple[TCPStore, list]:
    rendezvous.register()
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    handlers = [
        rendezvous_handler_registry.create_handler(
            RendezvousParameters(
                backend=rendezvous.BACKEND,
                endpoint=f"127.0.0.1:{port}",
                run_id="rdzv-test",
                min_nodes=min_nodes,
                max_nodes=count,
                join_timeout=30,
                is_host=False,
            )
        )
        for _ in range(count)
    ]
    return server, handlers


def _join_all(handlers: list) -> list:
    results: list = [None] * len(handlers)

    def join(i: int) -> None:
        results[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in results), "the round did not complete"
    return results


def test_the_handler_is_torchs_c10d_one_with_sub_second_timings() -> None:
    server, (handler,) = _handlers(1, 1)
    try:
        assert handler.get_backend() == rendezvous.BACKEND
        settings = handler.settings
        assert settings.keep_alive_interval == timedelta(seconds=rendezvous.KEEP_ALIVE_S)
        assert settings.keep_alive_max_attempt == rendezvous.KEEP_ALIVE_ATTEMPTS
        assert settings.timeout.last_call == timedelta(seconds=rendezvous.LAST_CALL_S)
        assert settings.timeout.join == timedelta(seconds=30)
        (info,) = _join_all([handler])
        assert info.world_size == 1 and info.rank == 0
    finally:
        handler.shutdown()
        del server


def test_a_node_whose_heartbeats_stop_is_missing_from_the_others_state() -> None:
    server, (alive, silent) = _handlers(2, 1)
    try:
        _join_all([alive, silent])
        alive.num_nodes_waiting()
        assert rendezvous.lost_participants(alive, 2) == 0
        assert rendezvous.synced_round(alive) is not None
        silent._stop_heartbeats()  # as if its machine went away
        window = rendezvous.KEEP_ALIVE_S * rendezvous.KEEP_ALIVE_ATTEMPTS
        deadline = time.monotonic() + 10 * window
        while rendezvous.lost_participants(alive, 2) == 0 and time.monotonic() < deadline:
            time.sleep(rendezvous.POLL_S)
            alive.num_nodes_waiting()  # syncs (and drops expired nodes from) the state
        assert rendezvous.lost_participants(alive, 2) == 1
    finally:
        alive.shutdown()
        del server


def test_lost_participants_is_zero_when_the_state_is_unknown() -> None:
    assert rendezvous.lost_participants(object(), 3) == 0
    assert rendezvous.synced_round(object()) is None


def test_the_store_watchdog_gives_up_on_a_call_that_overruns_only() -> None:
    fired: list[float] = []
    watch = StoreWatchdog(0.3, fired.append)
    with watch.bounded():
        pass
    time.sleep(1.2)
    assert fired == []
    with watch.bounded():
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
    assert fired == [0.3]
