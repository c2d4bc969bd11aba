"""Network checks: interfaces (virtual ones flagged, the socket interface recommended), the
hostname resolving to loopback, and the master port."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from longboat.tools.doctor.checks import FAIL, INFO, PASS, WARN, Check, run_command
from longboat.tools.doctor.fixes import fix_text

#: interface-name prefixes of virtual devices (containers, bridges, overlays)
VIRTUAL_PREFIXES = ("veth", "docker", "br-", "virbr", "cni", "flannel", "cali", "vxlan", "kube-")


@dataclass
class Interface:
    """A network interface: its name, whether it is up or loopback, its IPv4 addresses."""

    name: str
    up: bool
    loopback: bool
    ipv4: list[str]

    @property
    def virtual(self) -> bool:
        """Named like a container, bridge or overlay device."""
        return self.name.startswith(VIRTUAL_PREFIXES)


def list_interfaces(run: Callable[[list[str]], str | None] | None = None) -> list[Interface]:
    """This network namespace's interfaces, from ``ip -j addr`` (names only without iproute2)."""
    text = (run or run_command)(["ip", "-j", "addr", "show"])
    if text:
        with contextlib.suppress(ValueError):
            return [
                Interface(
                    i["ifname"],
                    "UP" in i.get("flags", []) or i.get("operstate") == "UP",
                    "LOOPBACK" in i.get("flags", []),
                    [a["local"] for a in i.get("addr_info", []) if a.get("family") == "inet"],
                )
                for i in json.loads(text)
            ]
    return [Interface(n, True, n == "lo", []) for _, n in socket.if_nameindex()]


def recommend_interface(interfaces: Sequence[Interface], master: str | None) -> str | None:
    """The interface to name in GLOO/NCCL_SOCKET_IFNAME: the one routing to the master, else
    the first physical-looking one that is up and has an IPv4 address."""
    usable = [i for i in interfaces if i.up and not i.loopback and not i.virtual and i.ipv4]
    if master and not master.startswith("127.") and master != "localhost":
        from longboat.launch.ports import local_ip_towards

        with contextlib.suppress(OSError):
            towards = local_ip_towards(socket.gethostbyname(master))
            for i in interfaces:
                if towards in i.ipv4:
                    return i.name
    return usable[0].name if usable else None


_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _named_with_addresses(i: Interface) -> str:
    """``eth0 10.0.0.2/10.0.0.3``: the name and any IPv4 addresses."""
    return f"{i.name}{' ' + '/'.join(i.ipv4) if i.ipv4 else ''}"


def _listing(interfaces: Sequence[Interface]) -> str:
    """Every interface, virtual ones marked, with its IPv4 addresses."""
    return ", ".join(
        f"{i.name}{' (virtual)' if i.virtual else ''}{' ' + '/'.join(i.ipv4) if i.ipv4 else ''}"
        for i in interfaces
    )


def _ifname_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The socket-interface variables that are set (non-empty), in a fixed order."""
    return {v: env[v] for v in _IFNAME_VARS if env.get(v)}


def _selected(var: str, value: str, names: set[str]) -> list[str]:
    """The interface names a GLOO/NCCL_SOCKET_IFNAME value selects: Gloo's (and NCCL's with
    ``=``) by exact name, NCCL's otherwise by prefix."""
    wanted = [w for w in value.lstrip("^=").split(",") if w]
    exact = var == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    return [n for n in names if any(n == w if exact else n.startswith(w) for w in wanted)]


def _check_ifname(
    var: str, value: str, names: set[str], listing: str, fix: str, data: dict[str, Any]
) -> Check | None:
    """One socket-interface variable against the interfaces; None for an exclusion list
    (``^...``), which cannot be checked against one interface."""
    if value.startswith("^"):
        return None
    matched = _selected(var, value, names)
    if not matched:
        return Check(var, FAIL, f"{var}={value} matches no interface here ({listing})", fix, data)
    if all(n.startswith(VIRTUAL_PREFIXES) for n in matched):
        return Check(
            var,
            WARN,
            f"{var}={value} selects virtual interface(s) "
            f"{', '.join(sorted(matched))}: other nodes may not reach them",
            fix,
            data,
        )
    return Check(var, PASS, f"{var}={value} selects {', '.join(sorted(matched))}")


def _interfaces_check(
    interfaces: Sequence[Interface],
    listing: str,
    ifname_set: bool,
    best: str | None,
    fix: str,
    data: dict[str, Any],
) -> Check:
    """The summary: a WARN for virtual interfaces that are up when no socket interface is
    named, else the listing and the recommendation."""
    virtual = [i for i in interfaces if i.virtual and i.up]
    if virtual and not ifname_set:
        shown = ", ".join(_named_with_addresses(i) for i in virtual)
        return Check(
            "interfaces",
            WARN,
            f"virtual interface(s) {shown} are up; NCCL and "
            f"Gloo may pick one and hang across nodes. All: {listing}",
            fix,
            data,
        )
    return Check(
        "interfaces",
        PASS,
        f"{listing}; recommended: {best or 'none'}",
        fix if best and not ifname_set else "",
        data,
    )


def check_interfaces(interfaces: Sequence[Interface], env: Mapping[str, str]) -> list[Check]:
    """The interfaces (virtual ones flagged) and GLOO/NCCL_SOCKET_IFNAME against them."""
    names = {i.name for i in interfaces}
    best = recommend_interface(interfaces, env.get("MASTER_ADDR"))
    listing = _listing(interfaces)
    data: dict[str, Any] = {
        "interfaces": [asdict(i) | {"virtual": i.virtual} for i in interfaces],
        "recommended": best,
    }
    fix = fix_text("socket ifname", interface=best) if best else fix_text("no interface")
    set_vars = _ifname_settings(env)
    checked = [_check_ifname(v, value, names, listing, fix, data) for v, value in set_vars.items()]
    summary = _interfaces_check(interfaces, listing, bool(set_vars), best, fix, data)
    return [summary, *(c for c in checked if c is not None)]


def check_hostname(multi_node: bool) -> Check:
    """This host's name resolving to loopback (a FAIL across nodes)."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        return Check(
            "hostname",
            WARN,
            f"{host!r} does not resolve ({exc})",
            fix_text("hostname unresolved", host=host),
        )
    if address.startswith("127."):
        return Check(
            "hostname",
            FAIL if multi_node else WARN,
            f"{host!r} resolves to {address} (loopback): across nodes, peers told to "
            "connect to this name reach themselves and the job hangs",
            fix_text("hostname loopback", host=host),
        )
    return Check("hostname", PASS, f"{host!r} resolves to {address}")


def check_port(port: int, under_launcher: bool) -> Check:
    """Whether the master port is free, and who holds it when not."""
    from longboat.launch.ports import holder_of, is_free

    if under_launcher:
        return Check("master port", INFO, f"port {port} is the running job's own rendezvous")
    if is_free("0.0.0.0", port):
        return Check("master port", PASS, f"port {port} is free")
    holder = holder_of(port)
    who = f"in use by {holder}" if holder else "in use (the holder is not visible: try `ss -ltnp`)"
    return Check(
        "master port",
        FAIL,
        f"port {port} is {who}",
        fix_text("port taken", holder=holder or "the process holding it"),
        {"port": port, "holder": holder},
    )
