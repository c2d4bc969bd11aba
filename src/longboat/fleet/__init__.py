"""Paddle Fleet's API on longboat (Paddle's collective Fleet flow, in PyTorch).

    import longboat.fleet as fleet            # or: from longboat.fleet import fleet

    fleet.init(is_collective=True)             # or fleet.init(fleet.PaddleCloudRoleMaker(True))
    strategy = fleet.DistributedStrategy()     # = lb.Strategy
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
    model = fleet.distributed_model(model)
    for x, y in loader:
        optimizer.minimize(loss_fn(model(x), y))   # backward + synchronised step + clear_grad
    fleet.save_persistables(dirname="ckpt")

See docs/fleet.md.
"""

from longboat.fleet import role_maker
from longboat.fleet.base import PERSISTABLES, DistributedOptimizer, Fleet, FleetError
from longboat.fleet.role_maker import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker
from longboat.strategy import Strategy as DistributedStrategy

fleet = Fleet()

init = fleet.init
is_collective = fleet.is_collective
worker_index = fleet.worker_index
worker_num = fleet.worker_num
is_first_worker = fleet.is_first_worker
is_worker = fleet.is_worker
is_server = fleet.is_server
server_num = fleet.server_num
server_index = fleet.server_index
worker_endpoints = fleet.worker_endpoints
server_endpoints = fleet.server_endpoints
barrier_worker = fleet.barrier_worker
init_worker = fleet.init_worker
init_server = fleet.init_server
run_server = fleet.run_server
stop_worker = fleet.stop_worker
distributed_optimizer = fleet.distributed_optimizer
distributed_model = fleet.distributed_model
save_persistables = fleet.save_persistables
load_persistables = fleet.load_persistables
load_model = fleet.load_model


def shrink(threshold: object = None) -> dict[str, int]:
    """``fleet.shrink()``: end a pass of the lazy sparse tables (``lb.ps.shrink``); each
    table's ``evict_after`` decides what is dropped (``threshold`` is not used)."""
    from longboat.ps.trainer.table_admin import shrink as end_pass

    return end_pass()


__all__ = [
    "PERSISTABLES",
    "DistributedOptimizer",
    "DistributedStrategy",
    "Fleet",
    "FleetError",
    "PaddleCloudRoleMaker",
    "Role",
    "UserDefinedRoleMaker",
    "barrier_worker",
    "distributed_model",
    "distributed_optimizer",
    "fleet",
    "init",
    "init_server",
    "init_worker",
    "is_collective",
    "is_first_worker",
    "is_server",
    "is_worker",
    "load_model",
    "load_persistables",
    "role_maker",
    "run_server",
    "save_persistables",
    "server_endpoints",
    "server_index",
    "server_num",
    "shrink",
    "stop_worker",
    "worker_endpoints",
    "worker_index",
    "worker_num",
]
