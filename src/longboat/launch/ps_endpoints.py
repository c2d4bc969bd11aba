"""Paddle's spelling of parameter-server roles: ``--servers ip:port,... --workers ip:port,...``.

Every node is given the same two lists and runs the entries whose ip is its own, on the ports
listed. The nodes are the distinct ips in the order they first appear (servers, then
workers); the first is the master.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def count_or_endpoints(text: str) -> int | list[tuple[str, int]]:
    """An argparse type: a process count, or a comma list of ``ip:port``."""
    if text.strip().lstrip("-").isdigit():
        return int(text)
    out = []
    for item in text.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a count or a comma list of ip:port (e.g. 10.0.0.1:6170)"
            )
        out.append((host, int(port)))
    return out


@dataclass(frozen=True)
class NodeRoles:
    """What the endpoint lists mean: the job's nodes, and per node its servers' and trainers'
    ports (servers first)."""

    nodes: list[str]
    servers: dict[str, list[int]]
    workers: dict[str, list[int]]

    def ports(self, node: str) -> list[int]:
        return self.servers.get(node, []) + self.workers.get(node, [])

    def count(self, node: str) -> tuple[int, int]:
        """(servers, trainers) of ``node``."""
        return len(self.servers.get(node, [])), len(self.workers.get(node, []))


def node_roles(servers: list[tuple[str, int]], workers: list[tuple[str, int]]) -> NodeRoles:
    """Group the lists by node; each list must name its nodes in node order (so the job's
    server and trainer order is the order given) and no endpoint twice."""
    nodes: list[str] = []
    for host, _ in servers + workers:
        if host not in nodes:
            nodes.append(host)
    seen = set()
    for flag, entries in (("--servers", servers), ("--workers", workers)):
        order = [nodes.index(h) for h, _ in entries]
        if order != sorted(order):
            raise ValueError(
                f"{flag}: list each node's endpoints together, nodes in the order they first "
                f"appear ({', '.join(nodes)}), so the job's order is the order given"
            )
        for entry in entries:
            if entry in seen:
                raise ValueError(f"{flag}: {entry[0]}:{entry[1]} is listed twice")
            seen.add(entry)
    by_node: list[dict[str, list[int]]] = [{}, {}]
    for roles, entries in zip(by_node, (servers, workers), strict=True):
        for host, port in entries:
            roles.setdefault(host, []).append(port)
    return NodeRoles(nodes, by_node[0], by_node[1])
