"""init / shutdown / who am I, and the ``*_built()`` / ``*_enabled()`` queries.

``hvd.init()`` is ``lb.init()`` (the cluster from torchrun, ``longboat launch``, horovodrun's
HOROVOD_* variables, Slurm or mpirun) plus this rank's negotiation thread. ``hvd.shutdown()``
stops the thread after every rank reached it and forgets the Horovod state; the process group
itself stays until ``lb.shutdown()`` or exit, so ``hvd.init()`` after ``hvd.shutdown()`` starts
a fresh negotiation (new groups, empty caches, handle and name counters reset) at once.
``lb.shutdown()`` runs ``hvd.shutdown()`` first (`longboat.cluster.on_shutdown`), so
``hvd.init()`` after it joins the next process group afresh.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import longboat.cluster as cluster
from longboat import session
from longboat.horovod.torch import process_sets as psets
from longboat.horovod.torch.negotiation import (
    BARRIER,
    Controller,
    HorovodInternalError,
    Request,
    Work,
)
from longboat.horovod.torch.process_sets import ProcessSet, global_process_set

log = logging.getLogger("longboat.horovod")

_controller: Controller | None = None  # this process's negotiation; see `controller`


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job (idempotent). ``process_sets``: a list of :class:`ProcessSet` to register
    now (every rank passes the same list), or ``"dynamic"`` to allow ``add_process_set`` later.
    ``comm`` (an MPI communicator) is not supported."""
    global _controller
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) takes an MPI communicator; longboat runs without MPI. Call "
            "hvd.init() and start the ranks with `longboat launch`, torchrun or mpirun"
        )
    if process_sets not in (None, "dynamic") and not isinstance(process_sets, (list, tuple)):
        raise ValueError('process_sets must be a list of hvd.ProcessSet, or "dynamic"')
    if _controller is not None:
        return
    info = session.init()
    strategy = cluster.current_strategy()
    algorithm, options = "native", None
    if strategy is not None:  # the strategy's choice on this placement, as lb.distribute's
        from longboat.collective.live import live_placement
        from longboat.collective.plan import resolve_comm

        comm = resolve_comm(strategy, live_placement())
        algorithm, options = comm.algorithm, comm.options
    timeout_s = cluster.job_timeout().total_seconds()
    _controller = Controller(info.rank, info.world_size, timeout_s, algorithm, options=options)
    cluster.on_shutdown(shutdown)  # before lb.shutdown destroys the process group
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)  # runs before lb's own atexit shutdown (LIFO)
    global_process_set.ranks = list(range(info.world_size))
    psets.set_dynamic(process_sets == "dynamic")
    if isinstance(process_sets, (list, tuple)):
        for process_set in process_sets:
            psets.register(process_set, _start_set)


def _start_set(rank: int, world: int, groups: tuple[Any, Any]) -> Controller:
    """The negotiation thread of a process set this rank belongs to."""
    timeout_s = cluster.job_timeout().total_seconds()
    return Controller(rank, world, timeout_s, "native", groups)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after init (dynamic process sets only; every rank, members or
    not, in the same order). Returns the registered :class:`ProcessSet`."""
    controller()
    if not psets.dynamic_enabled():
        raise ValueError(
            "adding process sets after hvd.init() needs dynamic process sets: "
            'hvd.init(process_sets="dynamic") or HOROVOD_DYNAMIC_PROCESS_SETS=1'
        )
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return psets.register(process_set, _start_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank, same order); False for the global set."""
    controller()
    if not psets.dynamic_enabled():
        raise ValueError(
            "removing process sets needs dynamic process sets: "
            'hvd.init(process_sets="dynamic") or HOROVOD_DYNAMIC_PROCESS_SETS=1'
        )
    return psets.unregister(process_set)


def _forget() -> Controller | None:
    """Forget this session (the controller and the outstanding handles); returns the controller
    for the caller to stop."""
    global _controller
    ctl, _controller = _controller, None
    from longboat.horovod.torch.ops import reset_handles

    reset_handles()
    return ctl


def _close_at_exit() -> None:
    """A script that never calls shutdown(): stop the threads before the groups go away."""
    ctl = _forget()
    if ctl is not None:
        psets.close_all()
        ctl.close(grace_s=1.0)


def shutdown() -> None:
    """Stop negotiating, once every rank has called shutdown(); safe to call twice, and after
    a failed op."""
    ctl = _forget()
    if ctl is None:
        return
    if ctl.world > 1 and not ctl.broken:
        error: BaseException | None = None
        try:
            work = ctl.submit(Work(Request("longboat.shutdown", BARRIER), None))
            if not work.done.wait(ctl.timeout_s):
                error = TimeoutError("timed out")
            error = error or work.error
        except (HorovodInternalError, ValueError) as exc:
            error = exc
        if error is not None:
            log.warning(
                "rank %d: hvd.shutdown() did not meet every other rank within %.0fs (%s); "
                "stopping anyway",
                ctl.rank,
                ctl.timeout_s,
                error,
            )
    psets.close_all()
    ctl.close()
    global_process_set.ranks = None


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _controller is not None


def controller() -> Controller:
    """The running negotiation; ValueError (as Horovod raises) before init()."""
    if _controller is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _controller


def size() -> int:
    """Number of ranks."""
    return controller().world


def rank() -> int:
    """This process's global rank."""
    return controller().rank


def local_size() -> int:
    """Number of ranks on this node."""
    controller()
    return len(cluster.topology().local_ranks())


def local_rank() -> int:
    """This process's rank among the ranks on its node."""
    ctl = controller()
    return cluster.topology().local_ranks().index(ctl.rank)


def cross_size() -> int:
    """Number of nodes."""
    controller()
    return cluster.topology().nodes


def cross_rank() -> int:
    """This process's node index."""
    controller()
    return cluster.topology().node


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    controller()
    return cluster.topology().is_homogeneous


def mpi_threads_supported() -> bool:
    """False: there is no MPI underneath (Horovod raises before init; so does this)."""
    controller()
    return False


def mpi_built(verbose: bool = False) -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def gloo_built(verbose: bool = False) -> bool:
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """True when the job's process group is Gloo's (before init: whether it would be)."""
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend()) == "gloo"
    return gloo_built() and not torch.cuda.is_available()


def nccl_built(verbose: bool = False) -> int:
    """NCCL's version as an int (e.g. 22005) when torch has it, else 0 (as Horovod)."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False


def cuda_built(verbose: bool = False) -> bool:
    return torch.version.cuda is not None


def rocm_built(verbose: bool = False) -> bool:
    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError(
        "Horovod's timeline is not part of longboat.horovod; profile with torch.profiler"
    )


def stop_timeline() -> None:
    raise NotImplementedError(
        "Horovod's timeline is not part of longboat.horovod; profile with torch.profiler"
    )
