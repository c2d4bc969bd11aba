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

from longboat.tools.doctor.checks import FAIL, INFO, PASS, WARN, Check, run_command
from longboat.tools.doctor.cli import (
    DEFAULT_PORT,
    add_arguments,
    local_checks,
    main,
    render,
    run,
    to_json,
)
from longboat.tools.doctor.comm import comm_checks, pair_checks
from longboat.tools.doctor.fixes import FIXES, fix_text
from longboat.tools.doctor.host import (
    NCCL_MEANING,
    NOFILE_MIN,
    SHM_MIN_BYTES,
    TOPO_MEANING,
    GpuTopology,
    check_cuda,
    check_nccl_env,
    check_nofile,
    check_omp,
    check_shm,
    check_torch,
    parse_topo,
    topology_check,
)
from longboat.tools.doctor.network import (
    VIRTUAL_PREFIXES,
    Interface,
    check_hostname,
    check_interfaces,
    check_port,
    list_interfaces,
    recommend_interface,
)

__all__ = [
    "DEFAULT_PORT",
    "FAIL",
    "FIXES",
    "INFO",
    "NCCL_MEANING",
    "NOFILE_MIN",
    "PASS",
    "SHM_MIN_BYTES",
    "TOPO_MEANING",
    "VIRTUAL_PREFIXES",
    "WARN",
    "Check",
    "GpuTopology",
    "Interface",
    "add_arguments",
    "check_cuda",
    "check_hostname",
    "check_interfaces",
    "check_nccl_env",
    "check_nofile",
    "check_omp",
    "check_port",
    "check_shm",
    "check_torch",
    "comm_checks",
    "fix_text",
    "list_interfaces",
    "local_checks",
    "main",
    "pair_checks",
    "parse_topo",
    "recommend_interface",
    "render",
    "run",
    "run_command",
    "to_json",
    "topology_check",
]
