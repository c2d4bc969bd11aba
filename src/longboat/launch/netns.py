"""Network-namespace plumbing for `longboat emulate`: N nodes on one bridge, each link rate-limited.

Every object a run creates is named ``lbem<id>...`` (``<id>``: 6 hex digits, unique per run), so
runs never collide and leftovers of a crashed run can be found by name (`cleanup_stale`):

    bridge        lbem<id>b           (root namespace; no address, elastic runs: 10.<x>.<y>.254)
    namespace     lbem<id>-node<i>
    veth, node    lbem<id>n<i>        (inside the namespace; address 10.<x>.<y>.<i+1>/24)
    veth, bridge  lbem<id>h<i>        (root namespace, enslaved to the bridge)

Elastic runs (faults, ``--min-nodes``) also plan spare nodes for ``--add-node`` and give the
bridge the subnet's last host address, where the rendezvous store lives (no node has it).

Each veth end gets ``tbf`` on egress: the node end caps what the node sends, the bridge end caps
what it receives. All commands run through `ip`/`tc` with argument lists (no shell).
Rates and latencies are read by `longboat.launch.link_rates` (its parsers are re-exported here).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from longboat.launch.link_rates import burst_for, format_rate, parse_latency, parse_rate
from longboat.log import get_logger

__all__ = [
    "PREFIX",
    "NetnsError",
    "Node",
    "Plan",
    "cleanup_stale",
    "format_rate",
    "kill_namespace",
    "kill_namespace_processes",
    "make_plan",
    "netem_available",
    "parse_latency",
    "parse_rate",
    "set_link",
    "setup",
    "teardown",
]

#: Every emulated object's name starts with this (cleanup only ever touches such names).
PREFIX = "lbem"
_ID_LEN = 6
#: /24 subnet: hosts .1 .. .254.
MAX_NODES = 254
#: tbf's queue bound: a packet waits at most this long for tokens before it is dropped.
TBF_LATENCY = "50ms"
_CMD_TIMEOUT_S = 30
# owner files: which process created which run id (so --cleanup spares live runs)
_OWNER_DIR = Path(tempfile.gettempdir()) / "longboat-emulate-owners"

_log = get_logger("longboat.emulate")


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be created; the message names the command."""


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, its two veth ends and its address."""

    index: int
    namespace: str
    ifname: str  # veth end inside the namespace
    bridge_port: str  # veth end in the root namespace, on the bridge
    address: str


@dataclass(frozen=True)
class Plan:
    """Everything a run builds, by name; `setup` creates it and `teardown` removes it."""

    run_id: str
    bridge: str
    subnet: ipaddress.IPv4Network
    nodes: tuple[Node, ...]
    rate_bps: int
    burst_bytes: int
    latency_s: float | None
    #: the last ``spares`` of ``nodes`` are built but not started (``--add-node``)
    spares: int = 0
    #: the bridge's address in the root namespace (elastic runs), else None
    bridge_address: str | None = None

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.run_id}"

    @property
    def initial_nodes(self) -> tuple[Node, ...]:
        """The nodes started with the run (all but the spares)."""
        return self.nodes[: len(self.nodes) - self.spares]

    @property
    def rate(self) -> str:
        return format_rate(self.rate_bps)


# ---------------------------------------------------------------- commands


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; with ``check`` a failure raises NetnsError naming the command and its stderr."""
    try:
        done = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` did not finish within {_CMD_TIMEOUT_S} s") from None
    if check and done.returncode != 0:
        raise NetnsError(
            f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done


def _ns(namespace: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *cmd]


def _new_run_id() -> str:
    return secrets.token_hex(_ID_LEN // 2)


# ---------------------------------------------------------------- subnet


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the root namespace's addresses and routes (all tables)."""
    found: list[ipaddress.IPv4Network] = []
    addrs = json.loads(_run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]")
    for link in addrs:
        for a in link.get("addr_info", []):
            found.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    for r in routes:
        dst = r.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return found


def choose_subnet(run_id: str, used: Sequence[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """10.<x>.<y>.0/24 derived from ``run_id``, the first candidate no address or route overlaps."""
    for attempt in range(256):
        digest = hashlib.sha256(f"{run_id}:{attempt}".encode()).digest()
        net = ipaddress.IPv4Network(f"10.{digest[0]}.{digest[1]}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError(
        "no free 10.x.y.0/24 subnet found for the emulated nodes: the root namespace's "
        "addresses/routes cover all candidates; free part of 10.0.0.0/8"
    )


# ---------------------------------------------------------------- plan


def make_plan(
    nnodes: int,
    rate_bps: int,
    latency_s: float | None = None,
    run_id: str | None = None,
    spares: int = 0,
    bridge_address: bool = False,
) -> Plan:
    """Names, addresses and shaping for ``nnodes`` nodes plus ``spares``; reads the routing
    table, creates nothing. With ``bridge_address`` the bridge gets the subnet's last host."""
    most = MAX_NODES - 1 if bridge_address else MAX_NODES
    if not 1 <= nnodes <= most:
        raise ValueError(f"--nodes must be between 1 and {most}, got {nnodes}")
    if spares < 0 or nnodes + spares > most:
        raise ValueError(
            f"--nodes {nnodes} plus {spares} added node(s) exceed {most} nodes on one /24"
        )
    run_id = run_id or _new_run_id()
    if not re.fullmatch(rf"[0-9a-f]{{{_ID_LEN}}}", run_id):
        raise ValueError(f"run id {run_id!r} must be {_ID_LEN} lowercase hex digits")
    subnet = choose_subnet(run_id, _used_networks())
    hosts = list(subnet.hosts())
    base = f"{PREFIX}{run_id}"
    nodes = tuple(
        Node(i, f"{base}-node{i}", f"{base}n{i}", f"{base}h{i}", str(hosts[i]))
        for i in range(nnodes + spares)
    )
    bridge = str(hosts[-1]) if bridge_address else None
    return Plan(
        run_id, f"{base}b", subnet, nodes, rate_bps, burst_for(rate_bps), latency_s, spares, bridge
    )


# ---------------------------------------------------------------- netem


def netem_available(run_id: str | None = None) -> bool:
    """Whether the kernel has sch_netem: try it on a scratch veth pair, removed at once."""
    base = f"{PREFIX}{run_id or _new_run_id()}"
    a, b = f"{base}x", f"{base}y"
    _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
    try:
        probe = _run(["tc", "qdisc", "add", "dev", a, "root", "netem", "delay", "1ms"], check=False)
        return probe.returncode == 0
    finally:
        _run(["ip", "link", "del", a], check=False)


# ---------------------------------------------------------------- build / teardown


def _shape_commands(plan: Plan, dev: str) -> list[list[str]]:
    """tc commands for one veth end: tbf (rate cap), with netem under it when latency is asked.

    A one-way node-to-node path crosses two shaped ends (sender's node end, receiver's bridge
    end), so each end delays by half the requested latency.
    """
    tbf = [
        "tbf",
        "rate",
        f"{plan.rate_bps}bit",
        "burst",
        str(plan.burst_bytes),
        "latency",
        TBF_LATENCY,
    ]
    cmds = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
    if plan.latency_s:
        delay = f"{plan.latency_s / 2 * 1e6:.0f}us"
        cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"])
        cmds[-1] += ["netem", "delay", delay]
    return cmds


def _setup_node(plan: Plan, node: Node) -> None:
    prefixlen = plan.subnet.prefixlen
    _run(["ip", "netns", "add", node.namespace])
    _run(["ip", "link", "add", node.bridge_port, "type", "veth", "peer", "name", node.ifname])
    _run(["ip", "link", "set", node.ifname, "netns", node.namespace])
    _run(["ip", "link", "set", node.bridge_port, "master", plan.bridge])
    _run(["ip", "link", "set", node.bridge_port, "up"])
    _run(_ns(node.namespace, "ip", "link", "set", "lo", "up"))
    _run(
        _ns(node.namespace, "ip", "addr", "add", f"{node.address}/{prefixlen}", "dev", node.ifname)
    )
    _run(_ns(node.namespace, "ip", "link", "set", node.ifname, "up"))
    for cmd in _shape_commands(plan, node.ifname):
        _run(_ns(node.namespace, *cmd))
    for cmd in _shape_commands(plan, node.bridge_port):
        _run(cmd)


def setup(plan: Plan) -> None:
    """Create the bridge and every node; on failure the caller's `teardown` removes the rest."""
    _write_owner(plan.run_id)
    _run(["ip", "link", "add", plan.bridge, "type", "bridge"])
    if plan.bridge_address:  # goes with the bridge in teardown/cleanup
        address = f"{plan.bridge_address}/{plan.subnet.prefixlen}"
        _run(["ip", "addr", "add", address, "dev", plan.bridge])
    _run(["ip", "link", "set", plan.bridge, "up"])
    for node in plan.nodes:
        _setup_node(plan, node)


def set_link(plan: Plan, node: Node, up: bool) -> None:
    """Take ``node``'s veth link down or up, both ends (the node's and the bridge's)."""
    state = "up" if up else "down"
    _run(_ns(node.namespace, "ip", "link", "set", node.ifname, state))
    _run(["ip", "link", "set", node.bridge_port, state])


def namespace_pids(namespace: str) -> list[int]:
    """Processes running in ``namespace`` (empty if it does not exist)."""
    out = _run(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(namespace: str, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process in ``namespace``; returns how many were signalled."""
    pids = [p for p in namespace_pids(namespace) if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    return len(pids)


def _wait_namespace_empty(namespace: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while namespace_pids(namespace) and time.monotonic() < deadline:
        kill_namespace_processes(namespace)
        time.sleep(0.05)


def kill_namespace(namespace: str, timeout: float = 5.0) -> int:
    """SIGKILL every process in ``namespace`` until none is left (or ``timeout``); returns how
    many were signalled first."""
    killed = kill_namespace_processes(namespace)
    _wait_namespace_empty(namespace, timeout)
    return killed


def _delete_namespace(namespace: str) -> None:
    kill_namespace_processes(namespace)
    _wait_namespace_empty(namespace)
    _run(["ip", "netns", "del", namespace], check=False)


def _delete_link(name: str) -> None:
    _run(["ip", "link", "del", name], check=False)


def teardown(plan: Plan) -> None:
    """Remove everything `setup` may have created; tolerant of half-built state, idempotent."""
    _remove(
        [n.namespace for n in plan.nodes],
        [n.bridge_port for n in plan.nodes] + [plan.bridge],
    )
    _remove_owner(plan.run_id)


def _remove(namespaces: Sequence[str], links: Sequence[str]) -> list[str]:
    """Delete those of ``namespaces`` and ``links`` that exist (links in the order given) and
    wait until the kernel has finished: a namespace's veth pair disappears asynchronously."""
    present_ns = set(_list_namespaces())
    present_links = set(_list_links())
    removed = [n for n in namespaces if n in present_ns] + [n for n in links if n in present_links]
    for ns in namespaces:
        if ns in present_ns:
            _delete_namespace(ns)  # takes its veth end, and so the pair, with it
    for name in links:
        if name in present_links:
            _delete_link(name)
    _wait_gone(removed)
    return removed


def _wait_gone(names: Sequence[str], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    left = set(names)
    while time.monotonic() < deadline:
        left = set(names) & set(_list_namespaces() + _list_links())
        if not left:
            return
        for name in left & set(_list_links()):
            _delete_link(name)
        time.sleep(0.05)
    _log.warning("still present after teardown: %s", ", ".join(sorted(left)))


# ---------------------------------------------------------------- stale runs


def _list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces and links whose names start with ``prefix`` (nothing is changed)."""
    return [n for n in _list_namespaces() + _list_links() if n.startswith(prefix)]


def _run_id_of(name: str) -> str:
    return name[len(PREFIX) : len(PREFIX) + _ID_LEN]


def _owner_path(run_id: str) -> Path:
    return _OWNER_DIR / run_id


def _write_owner(run_id: str) -> None:
    _OWNER_DIR.mkdir(parents=True, exist_ok=True)
    _owner_path(run_id).write_text(str(os.getpid()))


def _remove_owner(run_id: str) -> None:
    with contextlib.suppress(OSError):
        _owner_path(run_id).unlink()


def _owner_alive(run_id: str) -> bool:
    """Whether the process that built ``run_id`` is still running (and is not us)."""
    try:
        pid = int(_owner_path(run_id).read_text().strip())
    except (OSError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # a killed, unreaped owner is a zombie


def cleanup_stale(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Remove namespaces, veths and bridges named ``prefix...`` left by crashed runs.

    ``prefix`` must start with "lbem" (only longboat's objects are ever touched). Runs whose
    creating process is still alive are spared unless ``include_live``. Processes still inside a
    stale namespace are killed first. Returns the names removed.
    """
    if not prefix.startswith(PREFIX):
        raise ValueError(f"cleanup_stale: prefix {prefix!r} must start with {PREFIX!r}")

    def stale(name: str) -> bool:
        return name.startswith(prefix) and (include_live or not _owner_alive(_run_id_of(name)))

    namespaces = [n for n in _list_namespaces() if stale(n)]
    # bridge ports (and scratch veths) before bridges; a deleted veth takes its peer along
    links = sorted((n for n in _list_links() if stale(n)), key=lambda n: n.endswith("b"))
    removed = _remove(namespaces, links)
    for run_id in {_run_id_of(n) for n in removed}:
        _remove_owner(run_id)
    return removed


@contextlib.contextmanager
def built(plan: Plan) -> Iterator[Plan]:
    """``setup`` on entry, ``teardown`` on exit, whatever happened in between."""
    try:
        setup(plan)
        yield plan
    finally:
        teardown(plan)
