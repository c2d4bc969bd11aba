"""Closing a rank's connections to a node the launchers dropped (`longboat.elastic.lost_links`):
address decoding, which nodes count as lost, and a receive blocked on a silent peer ending
once a round without that peer is published."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from longboat.elastic.lost_links import (
    LostNodeWatch,
    _decode,
    lost_addresses,
    shut_down,
    sockets_to,
)
from longboat.elastic.membership import Membership, write_membership

# 127.0.0.2 is a loopback address distinct from 127.0.0.1: the "other node" of these tests
OTHER = "127.0.0.2"


def _round(token: str, nodes: list[str], store: str = "127.0.0.1:29500") -> Membership:
    return Membership(
        token=token,
        world_size=len(nodes),
        group_rank=0,
        group_world_size=len(nodes),
        ranks={0: 0},
        store=store,
        nodes=nodes,
    )


def test_addresses_of_proc_net_tcp_are_decoded() -> None:
    assert _decode("0100007F") == "127.0.0.1"
    assert _decode("0200A8C0") == "192.168.0.2"
    assert _decode("0000000000000000FFFF00000200007F") == "127.0.0.2"  # v4-mapped in tcp6
    assert _decode("00000000000000000000000001000000") == "::1"


def test_only_addresses_gone_from_the_new_round_count_as_lost() -> None:
    three = _round("a", ["10.0.0.1[11]", "10.0.0.2[12]", "10.0.0.3[13]"], store="10.0.0.1:29400")
    assert lost_addresses(three, _round("b", ["10.0.0.1[11]", "10.0.0.2[12]"])) == {"10.0.0.3"}
    assert lost_addresses(three, _round("b", three.nodes + ["10.0.0.4[14]"])) == set()
    # a launcher restarted on the same host (new pid) keeps its address: nothing is lost
    assert (
        lost_addresses(three, _round("b", ["10.0.0.1[11]", "10.0.0.2[12]", "10.0.0.3[99]"]))
        == set()
    )
    # never this node's own address, nor the rendezvous store's
    on_store = _round("a", ["10.0.0.1[11]", "10.0.0.2[12]"], store="10.0.0.2:29400")
    assert lost_addresses(on_store, _round("b", ["10.0.0.1[11]"])) == set()
    # several launchers on one host share its address: nothing can be told apart
    local = _round("a", ["127.0.0.1[1]", "127.0.0.1[2]"], store="127.0.0.1:29400")
    assert lost_addresses(local, _round("b", ["127.0.0.1[1]"])) == set()


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A client connected from 127.0.0.1 to a server on 127.0.0.2, and the server's end."""
    with socket.create_server((OTHER, 0)) as server:
        client = socket.create_connection(server.getsockname()[:2], timeout=30)
        peer, _ = server.accept()
    with client, peer:
        yield client, peer


def _blocked_receive(sock: socket.socket) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(sock.recv(16)), daemon=True)
    thread.start()
    return thread, got


def test_the_sockets_to_an_address_are_found_and_a_blocked_receive_ends(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    client, peer = connection
    found = sockets_to({OTHER})
    assert [fd for fd, _ in found] == [client.fileno()]  # not the server's end (peer 127.0.0.1)
    thread, got = _blocked_receive(client)
    assert shut_down(found) == 1
    thread.join(timeout=30)
    assert got == [b""]  # the receive ended as "connection closed", not by a timeout
    assert peer.recv(16) == b""  # the other end sees the close too


def test_the_watch_cuts_a_dropped_node_and_leaves_a_widened_round_alone(
    connection: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    client, peer = connection
    joined = _round("a", ["127.0.0.1[1]", f"{OTHER}[2]"])
    write_membership(tmp_path, joined)
    watch = LostNodeWatch(joined, tmp_path, set())
    try:
        thread, got = _blocked_receive(client)
        write_membership(tmp_path, _round("b", [*joined.nodes, "127.0.0.3[3]"]))  # a node joined
        thread.join(timeout=1.0)
        assert thread.is_alive(), "a round that only adds a node must not cut connections"
        peer.sendall(b"x")
        thread.join(timeout=30)
        assert got == [b"x"]
        thread, got = _blocked_receive(client)
        write_membership(tmp_path, _round("c", ["127.0.0.1[1]"]))  # the other node dropped
        thread.join(timeout=30)
        assert got == [b""]
    finally:
        watch.stop()
