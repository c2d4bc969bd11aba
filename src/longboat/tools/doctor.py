"""`longboat doctor`: check this machine (and, under the launcher, the cluster) for training.

Each check reports PASS, WARN, FAIL or INFO with what it saw and the fix in one line:
torch and its backends, CUDA devices and GPU topology (``nvidia-smi topo -m``), network
interfaces (virtual ones flagged, ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` recommended),
the hostname resolving to loopback, the master port, ``/dev/shm``, the open-file limit,
``OMP_NUM_THREADS`` against the cores per rank, and the NCCL variables that are set.

    longboat doctor [--json] [--port 29500] [--nproc-per-node 2]
    longboat launch --nnodes 2 ... -m longboat.doctor --comm    # pairwise links and bandwidth

Exit status 1 when any check FAILs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, WARN, FAIL, INFO = "PASS", "WARN", "FAIL", "INFO"
DEFAULT_PORT = 29500
#: interface-name prefixes of virtual devices (containers, bridges, overlays)
VIRTUAL_PREFIXES = ("veth", "docker", "br-", "virbr", "cni", "flannel", "cali", "vxlan", "kube-")
SHM_MIN_BYTES = 1 << 30
NOFILE_MIN = 4096

#: ``nvidia-smi topo -m`` link codes, fastest first
TOPO_MEANING = {
    "NV#": "NVLink, # bonded links: the fastest GPU-to-GPU path",
    "PIX": "at most one PCIe bridge between the two",
    "PXB": "several PCIe bridges, without crossing the CPU's PCIe host bridge",
    "PHB": "through a PCIe host bridge (the CPU)",
    "NODE": "through PCIe and between PCIe host bridges inside one NUMA node",
    "SYS": "through PCIe and the SMP interconnect between NUMA nodes (QPI/UPI): the slowest",
}
_TOPO_RANK = {"NV": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}

#: NCCL variables (the common ones and their companions) and what they do
NCCL_MEANING = {
    "NCCL_SOCKET_IFNAME": "interfaces NCCL uses for sockets (prefix list; ^ excludes, = exact)",
    "NCCL_P2P_DISABLE": "1 disables direct GPU-to-GPU (P2P/NVLink) transfers",
    "NCCL_IB_DISABLE": "1 disables InfiniBand/RoCE (RDMA): NCCL falls back to TCP sockets",
    "NCCL_IB_CUDA_SUPPORT": "1 enables GPUDirect RDMA (older NCCL; now NCCL_NET_GDR_LEVEL)",
    "NCCL_NET_GDR_LEVEL": "how close NIC and GPU must be for GPUDirect RDMA",
    "NCCL_DEBUG": "log level: VERSION, WARN, INFO (INFO shows the interface and transport used)",
    "NCCL_DEBUG_SUBSYS": "which subsystems NCCL_DEBUG logs",
    "NCCL_IB_HCA": "which InfiniBand adapters/ports NCCL uses",
    "NCCL_ALGO": "forces the collective algorithm (Ring, Tree, ...)",
    "NCCL_PROTO": "forces the protocol (LL, LL128, Simple)",
    "NCCL_BLOCKING_WAIT": "1: waits block with the process-group timeout (torch)",
    "NCCL_ASYNC_ERROR_HANDLING": "torch: abort communicators on errors/timeouts",
}
_SLOWING = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}

#: every fix the doctor can print, by key; ``{field}``s are filled in by the check
FIXES: dict[str, str] = {
    "torch without distributed": (
        "install a torch build with distributed support (the pip wheels have it)"
    ),
    "no gloo": "install the official torch wheel (it includes Gloo)",
    "no nccl": "install a CUDA build of torch with NCCL",
    "slow gpu pairs": (
        "keep each job's GPUs on one NUMA node (CUDA_VISIBLE_DEVICES) or expect "
        "intra-node allreduce limited by the CPU interconnect"
    ),
    "socket ifname": "export GLOO_SOCKET_IFNAME={interface} NCCL_SOCKET_IFNAME={interface}",
    "no interface": "bring up a physical interface with an IPv4 address",
    "hostname unresolved": "add '<this node's IP> {host}' to /etc/hosts",
    "hostname loopback": (
        "map {host} to this node's real IP in /etc/hosts, or give longboat launch "
        "--master IP:PORT (an address, not a name) and set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME"
    ),
    "port taken": (
        "pick a free port for longboat launch --master HOST:PORT (check it with "
        "longboat doctor --port PORT) or stop {holder}"
    ),
    "no shm": "mount a tmpfs on /dev/shm (docker: --shm-size=8g or --ipc=host)",
    "small shm": "docker run --shm-size=8g (or --ipc=host)",
    "open files": "ulimit -n {limit}",
    "omp threads": (
        "export OMP_NUM_THREADS={threads} (longboat launch sets cores // ranks per node "
        "when it is unset)"
    ),
    "slowing nccl": "unset {var} unless this is a deliberate workaround",
    "check crashed": "a bug in longboat: report it with this output",
    "unreachable pair": "check routes/firewall between them and GLOO/NCCL_SOCKET_IFNAME",
    "slow pair": (
        "check this link's NIC speed, cabling and interface choice (NCCL_DEBUG=INFO shows it)"
    ),
    "slow node": "inspect that node's network first",
    "comm outside launcher": (
        "longboat doctor --comm runs on every rank: start it with "
        "`longboat launch --nproc-per-node N [--nnodes M ...] -m longboat.doctor --comm`"
    ),
}


def fix_text(key: str, **fields: object) -> str:
    """The fix ``key`` of :data:`FIXES` with its fields filled in."""
    return FIXES[key].format(**fields)


@dataclass
class Check:
    """One finding: what was checked, how it went, what was seen, and the fix."""

    name: str
    status: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# ---- torch, CUDA, GPU topology -----------------------------------------------------------------


def check_torch() -> list[Check]:
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return [
            Check(
                "torch",
                FAIL,
                f"torch {torch.__version__} built without torch.distributed",
                fix_text("torch without distributed"),
            )
        ]
    backends = {b: dist.is_backend_available(b) for b in ("gloo", "nccl", "mpi")}
    have = ", ".join(b for b, ok in backends.items() if ok) or "none"
    checks = [Check("torch", PASS, f"torch {torch.__version__}; backends: {have}", data=backends)]
    if not backends["gloo"]:
        checks.append(
            Check(
                "backend gloo",
                FAIL,
                "Gloo is not available: CPU training cannot run",
                fix_text("no gloo"),
            )
        )
    if torch.cuda.is_available() and not backends["nccl"]:
        checks.append(
            Check(
                "backend nccl",
                WARN,
                "CUDA is present but NCCL is not: GPU gradients go through Gloo",
                fix_text("no nccl"),
            )
        )
    return checks


def check_cuda(run: Callable[[list[str]], str | None] | None = None) -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("cuda", INFO, "no CUDA device: training runs on CPU with Gloo")]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    checks = [
        Check(
            "cuda",
            PASS,
            f"{len(names)} GPU(s): " + ", ".join(sorted(set(names))),
            data={"devices": names},
        )
    ]
    text = (run or _run)(["nvidia-smi", "topo", "-m"])
    if text:
        checks.append(topology_check(parse_topo(text)))
    return checks


@dataclass
class GpuTopology:
    """``nvidia-smi topo -m``: devices (GPUs, NICs) and the link code of every pair."""

    devices: list[str]
    links: dict[tuple[str, str], str]
    affinity: dict[str, str]

    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("GPU")]


def parse_topo(text: str) -> GpuTopology:
    """Parse the matrix of ``nvidia-smi topo -m`` (legend lines are ignored)."""
    lines = text.splitlines()
    head_at = next((i for i, line in enumerate(lines) if re.search(r"\bGPU0\b", line)), None)
    if head_at is None:
        return GpuTopology([], {}, {})
    devices = re.findall(r"\b(GPU\d+|NIC\d+|mlx\w+)\b", lines[head_at])
    links: dict[tuple[str, str], str] = {}
    affinity: dict[str, str] = {}
    for line in lines[head_at + 1 :]:
        if not line.strip() or line.strip().startswith("Legend"):
            break
        cells = [c.strip() for c in line.split("\t")] if "\t" in line else line.split()
        row, values = cells[0], cells[1:]
        if row not in devices:
            continue
        for col, code in zip(devices, values, strict=False):
            links[(row, col)] = code
        if row.startswith("GPU") and len(values) > len(devices):
            affinity[row] = values[len(devices)]
    return GpuTopology(devices, links, affinity)


def _code_rank(code: str) -> int:
    return _TOPO_RANK["NV"] if code.startswith("NV") else _TOPO_RANK.get(code, 9)


def topology_check(topo: GpuTopology) -> Check:
    gpus = topo.gpus()
    pairs = {(a, b): topo.links.get((a, b), "?") for i, a in enumerate(gpus) for b in gpus[i + 1 :]}
    if not pairs:
        return Check("gpu topology", INFO, f"{len(gpus)} GPU: no GPU pairs to connect")
    worst = max(_code_rank(c) for c in pairs.values())
    counts: dict[str, int] = {}
    for code in pairs.values():
        key = "NV#" if code.startswith("NV") else code
        counts[key] = counts.get(key, 0) + 1
    seen = ", ".join(
        f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: _code_rank(kv[0].rstrip("#")))
    )  # noqa: E501
    meaning = "; ".join(f"{k} = {TOPO_MEANING[k]}" for k in counts if k in TOPO_MEANING)
    data = {"links": {f"{a}-{b}": c for (a, b), c in pairs.items()}, "meaning": TOPO_MEANING}
    if worst >= _TOPO_RANK["NODE"]:
        slow = [
            f"{a}-{b} {c}" for (a, b), c in pairs.items() if _code_rank(c) >= _TOPO_RANK["NODE"]
        ]
        return Check(
            "gpu topology",
            WARN,
            f"GPU pairs: {seen} ({meaning}); slow pairs: "
            + ", ".join(slow[:6])
            + (" ..." if len(slow) > 6 else ""),
            fix_text("slow gpu pairs"),
            data,
        )
    return Check("gpu topology", PASS, f"GPU pairs: {seen} ({meaning})", data=data)


# ---- network -----------------------------------------------------------------------------------


@dataclass
class Interface:
    name: str
    up: bool
    loopback: bool
    ipv4: list[str]

    @property
    def virtual(self) -> bool:
        return self.name.startswith(VIRTUAL_PREFIXES)


def list_interfaces(run: Callable[[list[str]], str | None] | None = None) -> list[Interface]:
    """This network namespace's interfaces, from ``ip -j addr`` (names only without iproute2)."""
    text = (run or _run)(["ip", "-j", "addr", "show"])
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


def check_interfaces(interfaces: Sequence[Interface], env: Mapping[str, str]) -> list[Check]:
    names = {i.name for i in interfaces}
    virtual = [i for i in interfaces if i.virtual and i.up]
    best = recommend_interface(interfaces, env.get("MASTER_ADDR"))
    listing = ", ".join(
        f"{i.name}{' (virtual)' if i.virtual else ''}{' ' + '/'.join(i.ipv4) if i.ipv4 else ''}"
        for i in interfaces
    )
    data = {
        "interfaces": [asdict(i) | {"virtual": i.virtual} for i in interfaces],
        "recommended": best,
    }
    fix = fix_text("socket ifname", interface=best) if best else fix_text("no interface")
    checks: list[Check] = []
    set_vars = {v: env[v] for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if env.get(v)}
    for var, value in set_vars.items():
        wanted = [w for w in value.lstrip("^=").split(",") if w]
        if value.startswith("^"):
            continue  # an exclusion list cannot be checked against one interface
        exact = var == "GLOO_SOCKET_IFNAME" or value.startswith("=")
        matched = [n for n in names if any(n == w if exact else n.startswith(w) for w in wanted)]
        if not matched:
            checks.append(
                Check(var, FAIL, f"{var}={value} matches no interface here ({listing})", fix, data)
            )
        elif all(n.startswith(VIRTUAL_PREFIXES) for n in matched):
            checks.append(
                Check(
                    var,
                    WARN,
                    f"{var}={value} selects virtual interface(s) "
                    f"{', '.join(sorted(matched))}: other nodes may not reach them",
                    fix,
                    data,
                )
            )
        else:
            checks.append(Check(var, PASS, f"{var}={value} selects {', '.join(sorted(matched))}"))
    if virtual and not set_vars:
        shown = ", ".join(f"{i.name}{' ' + '/'.join(i.ipv4) if i.ipv4 else ''}" for i in virtual)
        checks.insert(
            0,
            Check(
                "interfaces",
                WARN,
                f"virtual interface(s) {shown} are up; NCCL and "
                f"Gloo may pick one and hang across nodes. All: {listing}",
                fix,
                data,
            ),
        )
    else:
        checks.insert(
            0,
            Check(
                "interfaces",
                PASS,
                f"{listing}; recommended: {best or 'none'}",
                fix if best and not set_vars else "",
                data,
            ),
        )
    return checks


def check_hostname(multi_node: bool) -> Check:
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


# ---- process limits ----------------------------------------------------------------------------


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Check(
            "/dev/shm",
            WARN,
            f"{path} unavailable ({exc})",
            fix_text("no shm"),
        )
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{path}: {size / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
    if size < SHM_MIN_BYTES:
        return Check(
            "/dev/shm",
            WARN,
            detail + ": DataLoader workers and the shm allreduce need more",
            fix_text("small shm"),
        )
    return Check("/dev/shm", PASS, detail)


def check_nofile() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    detail = f"open-file limit {soft} (hard {hard})"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_MIN:
        return Check(
            "open files",
            WARN,
            detail + ": every rank holds sockets to every other "
            "rank per communicator, plus DataLoader files",
            fix_text(
                "open files", limit=65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
            ),
        )
    return Check("open files", PASS, detail)


def check_omp(env: Mapping[str, str], nproc: int) -> Check:
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    share = max(1, cores // nproc)
    value = env.get("OMP_NUM_THREADS")
    fix = fix_text("omp threads", threads=share)
    if value is None:
        return Check(
            "OMP_NUM_THREADS",
            WARN if nproc > 1 else INFO,
            f"unset: each of {nproc} rank(s) may use all {cores} cores (oversubscription)",
            fix if nproc > 1 else "",
        )
    try:
        threads = int(value)
    except ValueError:
        return Check("OMP_NUM_THREADS", FAIL, f"OMP_NUM_THREADS={value!r} is not a number", fix)
    if threads * nproc > cores:
        return Check(
            "OMP_NUM_THREADS", WARN, f"{threads} threads x {nproc} ranks > {cores} cores", fix
        )
    return Check("OMP_NUM_THREADS", PASS, f"{threads} threads x {nproc} ranks <= {cores} cores")


def check_nccl_env(env: Mapping[str, str]) -> list[Check]:
    found = sorted(v for v in env if v.startswith("NCCL_"))
    if not found:
        return [Check("NCCL env", INFO, "no NCCL_* variable set (NCCL's defaults)")]
    checks = []
    for var in found:
        meaning = NCCL_MEANING.get(var, "not in longboat's table: see NCCL's environment docs")
        if _SLOWING.get(var) == env[var]:
            checks.append(
                Check(
                    var,
                    WARN,
                    f"{var}={env[var]}: {meaning}",
                    fix_text("slowing nccl", var=var),
                )
            )
        elif var != "NCCL_SOCKET_IFNAME":  # checked against the interfaces above
            checks.append(Check(var, INFO, f"{var}={env[var]}: {meaning}"))
    return checks


# ---- putting it together -----------------------------------------------------------------------


def _run(cmd: list[str]) -> str | None:
    """A command's stdout, or None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def local_checks(
    port: int | None = None,
    nproc: int | None = None,
    multi_node: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Check]:
    """Every check of this machine; a check that crashes is reported, not raised."""
    env = os.environ if env is None else env
    under_launcher = "RANK" in env and "MASTER_PORT" in env
    port = port or int(env.get("MASTER_PORT") or DEFAULT_PORT)
    nproc = nproc or int(env.get("LOCAL_WORLD_SIZE") or 1)
    if multi_node is None:
        multi_node = int(env.get("LONGBOAT_NNODES") or env.get("GROUP_WORLD_SIZE") or 1) > 1
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("torch", check_torch),
        ("cuda", check_cuda),
        ("interfaces", lambda: check_interfaces(list_interfaces(), env)),
        ("hostname", lambda: check_hostname(bool(multi_node))),
        ("master port", lambda: check_port(port, under_launcher)),
        ("/dev/shm", check_shm),
        ("open files", check_nofile),
        ("OMP_NUM_THREADS", lambda: check_omp(env, nproc)),
        ("NCCL env", lambda: check_nccl_env(env)),
    ]
    checks: list[Check] = []
    for name, step in steps:
        try:
            result = step()
        except Exception as exc:  # noqa: BLE001 - one broken probe must not hide the others
            result = Check(
                name,
                WARN,
                f"the check itself failed: {type(exc).__name__}: {exc}",
                fix_text("check crashed"),
            )
        checks += result if isinstance(result, list) else [result]
    return checks


# ---- --comm: pairwise connectivity and bandwidth under the launcher -----------------------------


def comm_checks(
    size_bytes: int = 16 << 20, repeats: int = 3, timeout_s: float = 60.0
) -> list[Check]:
    """Every pair of nodes (of ranks, on one node): one small and timed large allreduces.

    Collective: every rank calls it. Returns the checks on rank 0, [] elsewhere.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import longboat as lb
    from longboat.comm.exchange import allgather_bytes

    lb.init()
    topo = lb.topology()
    per_node = topo.nodes > 1
    units = topo.leaders() if per_node else list(range(lb.world_size()))
    label = (lambda r: f"node {topo.node_of[r]}") if per_node else (lambda r: f"rank {r}")
    me = lb.rank()
    results: dict[str, dict[str, Any]] = {}
    for i, a in enumerate(units):
        for b in units[i + 1 :]:
            key = f"{label(a)} <-> {label(b)}"
            group = dist.new_group([a, b], timeout=timedelta(seconds=timeout_s))
            if me in (a, b):
                results[key] = _measure_pair(group, size_bytes, repeats, torch)
            dist.barrier()
    gathered = allgather_bytes(json.dumps(results).encode())  # JSON bytes: nothing unpickled
    if me != 0:
        return []
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered:
        merged.update(json.loads(part))
    return pair_checks(merged, size_bytes)


def _measure_pair(group: Any, size_bytes: int, repeats: int, torch: Any) -> dict[str, Any]:
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.ones(1), group=group)
        tensor = torch.ones(size_bytes // 4)
        dist.all_reduce(tensor, group=group)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            times.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - reported as an unreachable pair
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    seconds = statistics.median(times)
    return {"ok": True, "seconds": seconds, "gbps": size_bytes / seconds / 1e9}


def pair_checks(pairs: Mapping[str, Mapping[str, Any]], size_bytes: int) -> list[Check]:
    """PASS/WARN/FAIL per pair; a pair below half the median bandwidth is slow, and a member
    common to every slow pair is named as the slow node."""
    rates = [p["gbps"] for p in pairs.values() if p.get("ok")]
    median = statistics.median(rates) if rates else 0.0
    checks: list[Check] = []
    slow: list[set[str]] = []
    for key, p in pairs.items():
        if not p.get("ok"):
            checks.append(
                Check(
                    f"link {key}",
                    FAIL,
                    f"unreachable: {p['error']}",
                    fix_text("unreachable pair"),
                    dict(p),
                )
            )
            continue
        text = (
            f"allreduce of {size_bytes >> 20} MB: {p['seconds'] * 1e3:.1f} ms, "
            f"algbw = busbw {p['gbps']:.2f} GB/s (2 ranks)"
        )
        if len(rates) > 1 and p["gbps"] < 0.5 * median:
            slow.append(set(key.split(" <-> ")))
            checks.append(
                Check(
                    f"link {key}",
                    WARN,
                    f"{text}: below half the median {median:.2f} GB/s",
                    fix_text("slow pair"),
                    dict(p),
                )
            )
        else:
            checks.append(Check(f"link {key}", PASS, text, data=dict(p)))
    if slow:
        common = set.intersection(*slow)
        if common and len(pairs) > len(slow):
            checks.append(
                Check(
                    "slow node",
                    WARN,
                    f"{', '.join(sorted(common))} is in every slow pair",
                    fix_text("slow node"),
                )
            )
    return checks


# ---- output ------------------------------------------------------------------------------------


def render(checks: Sequence[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    colour = {PASS: "green", WARN: "yellow", FAIL: "red", INFO: "cyan"}
    table = Table(title="longboat doctor", show_lines=False)
    for column in ("check", "status", "found", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.fix)
    console = Console()
    console.print(table)
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, INFO)}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()))


def to_json(checks: Sequence[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, INFO)}
    return json.dumps({"checks": [asdict(c) for c in checks], "summary": counts}, indent=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"master port to check (default: MASTER_PORT or {DEFAULT_PORT})",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks you plan per node (for OMP_NUM_THREADS; default LOCAL_WORLD_SIZE or 1)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="nodes you plan (loopback hostname is a FAIL when > 1)",
    )
    p.add_argument(
        "--comm",
        action="store_true",
        help="under `longboat launch`: allreduce "
        "between every pair of nodes, naming slow or unreachable ones",
    )
    p.add_argument("--comm-mb", type=int, default=16, help="--comm message size in MB (default 16)")


def run(args: argparse.Namespace) -> int:
    multi = None if args.nnodes is None else args.nnodes > 1
    checks = local_checks(args.port, args.nproc_per_node, multi)
    if args.comm:
        if "RANK" not in os.environ:
            print(fix_text("comm outside launcher"))
            return 2
        pairs = comm_checks(args.comm_mb << 20)
        if int(os.environ["RANK"]) != 0:
            return 0
        checks += pairs
    elif "RANK" in os.environ and int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0  # one report per node
    if args.json:
        print(to_json(checks))
    else:
        render(checks)
    return 1 if any(c.status == FAIL for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="longboat doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
