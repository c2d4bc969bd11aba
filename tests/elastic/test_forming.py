"""Forming a round's process group: the attempt is abandoned as soon as a newer round is
published (`longboat.elastic.forming`), and a failed attempt does not shift the keys the next
one meets the other ranks under (`longboat.elastic.world`)."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from longboat.elastic import world
from longboat.elastic.forming import abandoned_when_replaced
from longboat.elastic.membership import Membership, write_membership


def _round(token: str) -> Membership:
    return Membership(token, 2, 0, 2, {0: 0}, "127.0.0.1:29500", ["127.0.0.1[1]", "127.0.0.1[2]"])


def test_a_wait_of_the_forming_round_ends_when_a_newer_round_is_published(
    tmp_path: Path,
) -> None:
    write_membership(tmp_path, _round("old"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        got: list[bytes] = []
        store = f"127.0.0.1:{server.getsockname()[1]}"
        with abandoned_when_replaced(tmp_path, "old", store) as watch:
            client = socket.create_connection(server.getsockname())  # opened while forming
            peer, _ = server.accept()
            reader = threading.Thread(target=lambda: got.append(client.recv(16)), daemon=True)
            reader.start()
            time.sleep(0.3)
            assert reader.is_alive() and not watch.newer  # the round is still current
            write_membership(tmp_path, _round("new"))
            reader.join(timeout=10)
        assert got == [b""] and watch.newer == "new"  # ended as "connection closed"
        client.close()
        peer.close()


def test_connections_to_peers_are_left_alone(tmp_path: Path) -> None:
    write_membership(tmp_path, _round("old"))
    with (
        socket.create_server(("127.0.0.1", 0)) as peer_server,
        socket.create_server(("127.0.0.1", 0)) as store_server,
    ):
        store = f"127.0.0.1:{store_server.getsockname()[1]}"
        with abandoned_when_replaced(tmp_path, "old", store) as watch:
            client = socket.create_connection(peer_server.getsockname())
            peer, _ = peer_server.accept()
            write_membership(tmp_path, _round("new"))
            deadline = time.monotonic() + 10
            while not watch.newer and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        peer.sendall(b"ok")
        assert watch.newer == "new" and client.recv(16) == b"ok"
        client.close()
        peer.close()


def test_connections_open_before_forming_are_left_alone(tmp_path: Path) -> None:
    write_membership(tmp_path, _round("old"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        store = f"127.0.0.1:{server.getsockname()[1]}"
        with abandoned_when_replaced(tmp_path, "old", store) as watch:
            write_membership(tmp_path, _round("new"))
            deadline = time.monotonic() + 10
            while not watch.newer and time.monotonic() < deadline:
                time.sleep(0.05)
        peer.sendall(b"ok")
        assert watch.newer == "new" and client.recv(16) == b"ok"
        client.close()
        peer.close()


def test_a_failed_attempt_does_not_shift_the_next_groups_keys() -> None:
    """A fresh process names its first default group "0": a survivor whose attempt failed
    must too, or it waits under other keys than the ranks restarted meanwhile."""
    names = dist.distributed_c10d._world
    assert not dist.is_initialized()
    before = names.group_count
    with pytest.raises(Exception):  # noqa: B017 - torch raises several kinds of timeout
        dist.init_process_group(
            "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=2,
            timeout=datetime.timedelta(seconds=1),
        )
    assert names.group_count == before + 1
    world._restart_group_names()
    assert names.group_count == 0
