"""Checks of this host: torch and its backends, CUDA and the GPU topology, ``/dev/shm``, the
open-file limit, ``OMP_NUM_THREADS`` and the NCCL variables that are set."""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from longboat.tools.doctor.checks import FAIL, INFO, PASS, WARN, Check, run_command
from longboat.tools.doctor.fixes import fix_text
from longboat.words import plural

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


def check_torch() -> list[Check]:
    """torch's version and distributed backends (Gloo required, NCCL where CUDA is)."""
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
    """The CUDA devices and, with ``nvidia-smi``, how each GPU pair is linked."""
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
    text = (run or run_command)(["nvidia-smi", "topo", "-m"])
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
    """WARN when a GPU pair crosses a PCIe host bridge or NUMA nodes."""
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


def check_shm(path: str = "/dev/shm") -> Check:
    """``/dev/shm``'s size: DataLoader workers and the shm allreduce need 1 GiB or more."""
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
    """The open-file limit against the sockets and files every rank holds."""
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
    """``OMP_NUM_THREADS`` against the cores each of ``nproc`` ranks gets."""
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
            f"unset: each of {nproc} ranks may use all {plural(cores, 'core')} (oversubscription)"
            if nproc > 1
            else f"unset: the one rank may use all {plural(cores, 'core')} (no oversubscription)",
            fix if nproc > 1 else "",
        )
    try:
        threads = int(value)
    except ValueError:
        return Check("OMP_NUM_THREADS", FAIL, f"OMP_NUM_THREADS={value!r} is not a number", fix)
    use = f"{plural(threads, 'thread')} x {plural(nproc, 'rank')}"
    if threads * nproc > cores:
        return Check("OMP_NUM_THREADS", WARN, f"{use} > {plural(cores, 'core')}", fix)
    return Check("OMP_NUM_THREADS", PASS, f"{use} <= {plural(cores, 'core')}")


def check_nccl_env(env: Mapping[str, str]) -> list[Check]:
    """Every ``NCCL_*`` variable set, explained; the ones that slow NCCL flagged."""
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
