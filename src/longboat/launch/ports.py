"""Ports: a free one when none is given, and who holds a taken one when one is."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that the OS just handed out for port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def holder_of(port: int) -> str | None:
    """``name (pid N)`` of the process listening on ``port``, when ``ss`` can tell."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    try:
        out = subprocess.run(
            [ss, "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'users:\(\("([^"]+)",pid=(\d+)', out)
    return f"{match.group(1)} (pid {match.group(2)})" if match else None


def local_ip_towards(host: str) -> str:
    """The address of this machine's interface that reaches ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def is_own_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (it can be bound here)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    for address in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def unreachable_reason(host: str, port: int, timeout: float = 2.0) -> str | None:
    """Why ``host:port`` cannot be reached from here, or None when the host answers (a
    refused connection counts as an answer: node 0 may not listen yet)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return None
    except socket.gaierror:
        return "the name does not resolve"
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def master_note(host: str, port: int, node_ip: str) -> str | None:
    """One line when ``--master`` is neither an address of this node nor reachable from it."""
    if host in ("", "127.0.0.1", "localhost") or is_own_address(host):
        return None
    why = unreachable_reason(host, port)
    if why is None:
        return None
    return (
        f"longboat launch: --master {host}:{port} is not an address of this node ({node_ip}) "
        f"and cannot be reached from it ({why}); check the address: node 0 gives one of its "
        "own, every node the same, and it must be reachable from every node (routes, "
        "firewall; `longboat doctor` checks it)"
    )
