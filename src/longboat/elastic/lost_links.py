"""End a rank's wait on a node that went silent as soon as the launchers drop that node.

A node whose link is cut, or whose power is lost, sends nothing: no reset reaches the
survivors, so a collective with it would wait until the failure timeout. The launchers notice
the silence from the rendezvous heartbeats within seconds and publish a round without that
node (`longboat.elastic.membership`). A watch thread in each rank reads that publication and
shuts down (``shutdown(2)``) this process's TCP connections to the dropped node's address:
the blocked receive then fails at once as "connection closed", the usual peer-failure path
rolls the rank back to its last commit and it joins the published round.

Only connections to an address that no node of the new round has are closed, never those to
this node's own address or to the rendezvous store (several launchers on one host share an
address: then nothing is closed and the failure timeout still bounds the wait). Sockets are
found through ``/proc/self/fd`` and ``/proc/self/net/tcp{,6}`` (Linux).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Collection
from pathlib import Path

from longboat.elastic.membership import Membership, read_membership
from longboat.log import get_logger

_log = get_logger("longboat.elastic")
_POLL_S = 0.1
_LISTEN = "0A"  # socket state in /proc/net/tcp


def node_host(address: str) -> str:
    """The host part of a node entry of a round (``10.0.0.2[1234]`` -> ``10.0.0.2``)."""
    return address.partition("[")[0]


def _resolve(host: str) -> str | None:
    """``host`` as an IP address string (resolved once if it is a name), None if unknown."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def lost_addresses(joined: Membership, published: Membership) -> set[str]:
    """IP addresses of nodes of ``joined`` that no node of ``published`` has, minus this
    node's own address and the rendezvous store's."""
    before = {node_host(n) for n in joined.nodes}
    after = {node_host(n) for n in published.nodes}
    keep = set(after)
    if 0 <= joined.group_rank < len(joined.nodes):
        keep.add(node_host(joined.nodes[joined.group_rank]))
    kept = {_resolve(h) for h in keep} | {store_endpoint(joined)[0]}
    kept.discard(None)
    lost = {_resolve(h) for h in before - keep} - {None}
    return {a for a in lost if a is not None and a not in kept}


def _decode(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} (32-bit words in host byte order) as a string."""
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip.ipv4_mapped or ip)


def tcp_peers() -> dict[int, tuple[str, int]]:
    """Socket inode -> remote (IP address, port) of the TCP sockets of this process's network
    namespace (listening sockets left out)."""
    peers: dict[int, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] == _LISTEN:
                continue
            address, _, port = fields[2].partition(":")
            peers[int(fields[9])] = (_decode(address), int(port, 16))
    return peers


def socket_inodes() -> dict[int, int]:
    """Socket inode -> file descriptor of every socket this process has open."""
    found = {}
    for entry in os.scandir("/proc/self/fd"):
        try:
            target = os.readlink(entry.path)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(entry.name)
    return found


def sockets_to(
    addresses: set[str],
    skip_inodes: Collection[int] = (),
    skip_peer: tuple[str | None, int] | None = None,
) -> list[tuple[int, int]]:
    """(fd, inode) of this process's TCP sockets connected to any of ``addresses``, leaving
    out the sockets ``skip_inodes`` and the one connected to ``skip_peer`` (address, port)."""
    peers = tcp_peers()
    return [
        (fd, inode)
        for inode, fd in socket_inodes().items()
        if inode in peers
        and peers[inode][0] in addresses
        and inode not in skip_inodes
        and peers[inode] != skip_peer
    ]


def store_endpoint(membership: Membership) -> tuple[str | None, int]:
    """The rendezvous store's (IP address, port) of ``membership``."""
    return endpoint(membership.store)


def endpoint(address: str) -> tuple[str | None, int]:
    """``HOST:PORT`` as (IP address, port), as /proc/net/tcp shows a peer."""
    host, _, port = address.rpartition(":")
    return _resolve(host.strip("[]")), int(port)


def shut_down(sockets: list[tuple[int, int]]) -> int:
    """``shutdown(SHUT_RDWR)`` each socket still open as the same inode; how many were."""
    done = 0
    for fd, inode in sockets:
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inode:  # the number was closed and reused
                continue
            with socket.socket(fileno=dup) as sock:
                dup = -1  # the socket object owns (and closes) the duplicate now
                with contextlib.suppress(OSError):  # already shut down or reset
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
        finally:
            if dup >= 0:
                os.close(dup)
    return done


class LostNodeWatch:
    """A daemon thread that cuts this rank's connections to nodes the launchers dropped, and
    the connections of this rank's round, closed when the rank leaves it."""

    def __init__(self, joined: Membership, directory: Path, opened_before: set[int]):
        self._joined = joined
        self._directory = directory
        self._before = opened_before
        self._stop = threading.Event()
        self._cut: set[str] = set()
        self._seen = joined.token
        self._thread = threading.Thread(target=self._run, name="longboat-lost-nodes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch (the process group is shut down)."""
        self._stop.set()

    def close_round_connections(self) -> int:
        """Shut down the connections this process opened since it joined the round to the
        round's nodes, except the rendezvous store's: a peer still waiting on this rank in the
        old process group fails now instead of at the failure timeout. How many were closed."""
        hosts = {h for h in (_resolve(node_host(n)) for n in self._joined.nodes) if h}
        store = store_endpoint(self._joined)
        return shut_down(sockets_to(hosts, skip_inodes=self._before, skip_peer=store))

    def _run(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                published = read_membership(self._directory)
            except (OSError, ValueError, TypeError):  # being replaced, or foreign: next poll
                continue
            if published is None or published.token == self._seen:
                continue
            self._seen = published.token
            lost = lost_addresses(self._joined, published) - self._cut
            if lost:
                self._cut |= lost
                closed = shut_down(sockets_to(lost))
                _log.warning(
                    "round %s has no node at %s: closed %d connection(s) of this rank to it, "
                    "so that a collective waiting on it fails now",
                    published.token,
                    ", ".join(sorted(lost)),
                    closed,
                )


_current: LostNodeWatch | None = None


def watch_lost_nodes(joined: Membership, directory: Path, opened_before: set[int]) -> None:
    """Start watching ``directory`` for rounds that drop nodes of ``joined`` (the round this
    rank just formed its process group in; ``opened_before``: inodes of the sockets it had
    open before). Stopped when the process group is shut down."""
    from longboat.cluster import on_shutdown

    global _current
    if _current is not None:
        _current.stop()
    _current = LostNodeWatch(joined, directory, opened_before)
    on_shutdown(_current.stop)


def leave_round() -> int:
    """Close this rank's connections of its current round (see
    `LostNodeWatch.close_round_connections`); 0 outside an elastic round."""
    return _current.close_round_connections() if _current is not None else 0
