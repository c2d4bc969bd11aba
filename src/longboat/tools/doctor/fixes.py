"""Every fix the doctor can print, by key, and the helper that fills one in."""

from __future__ import annotations

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
