"""The ``fleet`` object: Paddle Fleet's flow on ``lb.init`` / ``lb.distribute``.

Collective mode maps one to one: ``fleet.init(is_collective=True)`` is ``lb.init``,
``fleet.distributed_optimizer`` + ``fleet.distributed_model`` are one ``lb.distribute`` call
(whichever comes second makes it), ``minimize(loss)`` is backward + step + clear_grad.
Parameter-server mode (``fleet.init()`` without ``is_collective``) runs on ``longboat.ps``:
``init_server`` / ``run_server`` in server processes (serving until every worker called
``stop_worker``), and in workers ``distributed_optimizer`` + ``distributed_model`` connect the
model to the servers (``lb.distribute`` with ``mode="ps"``; the strategy's ``a_sync`` and
``a_sync_configs`` pick sync / async / half-async / geo).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import longboat.cluster as cluster
from longboat import session
from longboat.checkpoint import load_checkpoint, save_checkpoint
from longboat.collective.model import DistributedModel
from longboat.dispatch import distribute, enter
from longboat.fleet.role_maker import PaddleCloudRoleMaker, RoleMakerBase
from longboat.ps.server import Server, make_server, serve_until_done
from longboat.ps.shared import auth
from longboat.ps.trainer.engine import PSModel
from longboat.ps.trainer.kv import KVClient
from longboat.strategy import Strategy

PERSISTABLES = "persistables.pt"

# Strategy fields that change the optimizer itself, so lb.distribute must see it
_OPTIMIZER_FIELDS = (
    "gradient_merge",
    "localsgd",
    "adaptive_localsgd",
    "lars",
    "lamb",
    "amp",
    "dgc",
    "fuse_all_optimizer_ops",
)


class FleetError(RuntimeError):
    """The fleet calls came in an order or mode that cannot work; the message says the fix."""


class DistributedOptimizer:
    """What ``fleet.distributed_optimizer`` returns: the optimizer, made data-parallel once
    ``fleet.distributed_model`` has run. Other attributes pass through to it."""

    def __init__(self, fleet: Fleet, optimizer: torch.optim.Optimizer, strategy: Strategy):
        self._fleet = fleet
        self.inner_opt = optimizer
        self.user_defined_strategy = strategy
        self._bound: torch.optim.Optimizer | None = None

    def _optimizer(self) -> torch.optim.Optimizer:
        if self._bound is None:
            raise FleetError(
                "the optimizer is not connected to a model yet: call "
                "model = fleet.distributed_model(model) before training (in PyTorch the model "
                "carries the gradient synchronisation)"
            )
        return self._bound

    def step(self) -> None:
        self._optimizer().step()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        self._optimizer().zero_grad(set_to_none=not set_to_zero)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer().zero_grad(set_to_none=set_to_none)

    def minimize(
        self,
        loss: torch.Tensor,
        startup_program: Any = None,
        parameters: Any = None,
        no_grad_set: Any = None,
    ) -> tuple[None, None]:
        """Backward, the synchronised step, and clear_grad (one static-graph ``exe.run``)."""
        optimizer = self._optimizer()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return None, None

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer().state_dict()

    def set_state_dict(self, state: dict[str, Any]) -> None:
        self._optimizer().load_state_dict(state)

    load_state_dict = set_state_dict

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._bound if self._bound is not None else self.inner_opt, name)


class Fleet:
    """One per process (``longboat.fleet.fleet``); the module-level functions are its methods."""

    def __init__(self) -> None:
        self._role: RoleMakerBase | None = None
        self._strategy: Strategy | None = None
        self._optimizer: DistributedOptimizer | None = None
        self._model: DistributedModel | PSModel | None = None
        self._server: Server | None = None
        self._kv: KVClient | None = None  # PS-mode barriers and stop, beside the model's engine

    # -- set-up ---------------------------------------------------------------------------------

    def init(
        self,
        role_maker: RoleMakerBase | None = None,
        is_collective: bool = False,
        strategy: Strategy | None = None,
    ) -> None:
        """Read the roles; in collective mode also join the cluster (``lb.init``)."""
        if role_maker is None:
            role_maker = PaddleCloudRoleMaker(is_collective=is_collective)
        elif is_collective:
            role_maker.is_collective = True
        self._role = role_maker
        self._strategy = strategy
        self._optimizer, self._model, self._server, self._kv = None, None, None, None
        if role_maker.is_collective:
            info = session.init(strategy)
            if (role_maker.worker_index(), role_maker.worker_num()) != (
                info.rank,
                info.world_size,
            ):
                raise FleetError(
                    f"{role_maker!r} says worker {role_maker.worker_index()} of "
                    f"{role_maker.worker_num()}, but the launcher started rank {info.rank} of "
                    f"{info.world_size}: start the job with `longboat launch --nproc-per-node "
                    f"{role_maker.worker_num()}` (or torchrun), or use PaddleCloudRoleMaker"
                )

    def _role_maker(self) -> RoleMakerBase:
        if self._role is None:
            raise FleetError("call fleet.init(...) first")
        return self._role

    def is_collective(self) -> bool:
        return self._role_maker().is_collective

    def worker_index(self) -> int:
        return self._role_maker().worker_index()

    def worker_num(self) -> int:
        return self._role_maker().worker_num()

    def is_first_worker(self) -> bool:
        return self._role_maker().is_first_worker()

    def is_worker(self) -> bool:
        return self._role_maker().is_worker()

    def is_server(self) -> bool:
        return self._role_maker().is_server()

    def server_num(self) -> int:
        return self._role_maker().server_num()

    def server_index(self) -> int:
        return self._role_maker().server_index()

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        eps = self._role_maker().worker_endpoints()
        return ",".join(eps) if to_string else eps

    def server_endpoints(self, to_string: bool = False) -> list[str] | str:
        eps = self._role_maker().server_endpoints()
        return ",".join(eps) if to_string else eps

    def barrier_worker(self) -> None:
        """Wait for every worker (collective: bounded by the job timeout; parameter-server
        mode: through the servers, bounded by LONGBOAT_PS_TIMEOUT, after this worker's last
        parameter pull has landed in the model)."""
        if self.is_collective():
            cluster.barrier()
            return
        kv = self._worker_kv("barrier_worker")
        if isinstance(self._model, PSModel):
            self._model.engine.synchronize()
        kv.barrier("fleet")

    # -- parameter-server mode --------------------------------------------------------------------

    def _need(self, what: str, server: bool) -> None:
        role = self._role_maker()
        if role.is_collective:
            raise FleetError(
                f"fleet.{what}() belongs to parameter-server mode, but fleet.init(...) was "
                "collective: call fleet.init() without is_collective=True (and start the job "
                "with `longboat launch --servers N --workers M`)"
            )
        if role.is_server() != server:
            here, there = ("a worker", "server") if server else ("a server", "worker")
            raise FleetError(
                f"fleet.{what}() runs in a {there} process, but this process is {here} "
                f"({role!r}); branch on fleet.is_server() / fleet.is_worker()"
            )

    def _ps_location(self) -> dict[str, Any]:
        """Servers and this worker's index for longboat.ps (role maker's endpoints if any)."""
        role = self._role_maker()
        servers = role.server_endpoints() or None
        return {"servers": servers, "trainer": role.worker_index(), "trainers": role.worker_num()}

    def _worker_kv(self, what: str) -> KVClient:
        self._need(what, server=False)
        if self._kv is None:
            where = self._ps_location()
            if where["servers"] is None:
                raise FleetError(
                    f"fleet.{what}(): no parameter servers known; start with `longboat launch "
                    "--servers N --workers M` or give UserDefinedRoleMaker(server_endpoints=...)"
                )
            self._kv = KVClient(
                where["servers"],
                auth.load_token(),
                trainer=where["trainer"],
                trainers=where["trainers"],
            )
        return self._kv

    def init_worker(self, scopes: Any = None) -> None:
        """Check this is a worker and its servers answer (the connection of the model happens
        in distributed_model, which needs the optimizer and the model)."""
        self._worker_kv("init_worker")

    def init_server(self, dirname: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        """Create this process's parameter server (not serving yet). ``dirname``: a server
        checkpoint directory (``lb.ps.save``) to restore from and save to."""
        self._need("init_server", server=True)
        role = self._role_maker()
        endpoints = role.server_endpoints()
        self._server = make_server(
            endpoints[role.server_index()] if endpoints else None,
            index=role.server_index(),
            num_servers=len(endpoints) or None,
            checkpoint_dir=os.fspath(dirname) if dirname is not None else None,
        )

    def run_server(self) -> None:
        """Serve until every worker called ``stop_worker`` (or the process is terminated)."""
        self._need("run_server", server=True)
        if self._server is None:
            self.init_server()
        assert self._server is not None
        serve_until_done(self._server.start())

    def stop_worker(self) -> None:
        """Flush this worker's updates, disconnect, and tell the servers it is done."""
        kv = self._worker_kv("stop_worker")
        if isinstance(self._model, PSModel):
            self._model.engine.close()
        try:
            kv.stop()
        finally:
            kv.close()
            self._kv = None

    # -- training -------------------------------------------------------------------------------

    def _the_strategy(self) -> Strategy:
        return self._strategy if self._strategy is not None else Strategy()

    def _used_strategy(self) -> Strategy:
        """The strategy as this process's mode uses it (parameter-server mode: a copy with
        mode='ps', whatever it says), checked: conflicts and fields outside data parallelism
        are refused here, whatever order they were set in."""
        strategy = self._the_strategy()
        if not self.is_collective():
            strategy = strategy.copy()
            strategy.mode = "ps"
        strategy.check()
        return strategy

    def distributed_optimizer(
        self, optimizer: torch.optim.Optimizer, strategy: Strategy | None = None
    ) -> DistributedOptimizer:
        """Wrap ``optimizer``; ``strategy`` (else fleet.init's) configures the training."""
        if not self.is_collective():
            self._need("distributed_optimizer", server=False)
        if strategy is not None:
            self._strategy = strategy
        self._used_strategy()
        self._optimizer = DistributedOptimizer(self, optimizer, self._the_strategy())
        if self._model is not None and not self.is_collective():
            raise FleetError(
                "parameter-server mode: call fleet.distributed_optimizer(...) before "
                "fleet.distributed_model(...), which sends the optimizer to the servers"
            )
        if self._model is not None:  # distributed_model came first
            needs = [f for f in _OPTIMIZER_FIELDS if getattr(self._the_strategy(), f)]
            if needs:
                raise FleetError(
                    f"the strategy sets {', '.join(needs)}, which changes the optimizer: call "
                    "fleet.distributed_optimizer(...) before fleet.distributed_model(...)"
                )
            self._optimizer._bound = optimizer
        return self._optimizer

    def distributed_model(self, model: nn.Module) -> DistributedModel | PSModel:
        """``lb.distribute(model, <the distributed optimizer>, strategy)``; returns the model
        (in parameter-server mode connected to the servers, which the first worker seeds)."""
        if not self.is_collective():
            return self._ps_model(model)
        inner = self._optimizer.inner_opt if self._optimizer is not None else None
        wrapped, optimizer = distribute(model, inner, self._the_strategy())
        if self._optimizer is not None:
            self._optimizer._bound = optimizer
        self._model = wrapped
        return wrapped

    def _ps_model(self, model: nn.Module) -> PSModel:
        self._need("distributed_model", server=False)
        if self._optimizer is None:
            raise FleetError(
                "parameter-server mode: call fleet.distributed_optimizer(optimizer, strategy) "
                "before fleet.distributed_model(model); the servers run that optimizer"
            )
        strategy = self._used_strategy()
        wrapped, optimizer = enter(
            model, self._optimizer.inner_opt, strategy, token=auth.load_token(),
            **self._ps_location(),
        )  # fmt: skip
        assert isinstance(wrapped, PSModel)
        self._optimizer._bound = optimizer
        self._model = wrapped
        return wrapped

    # -- persistence ----------------------------------------------------------------------------

    def _state_owner(self, main_program: Any) -> nn.Module:
        model = main_program if isinstance(main_program, nn.Module) else self._model
        if isinstance(model, PSModel):
            model.engine.synchronize()  # the pulled parameters of the last step
        if model is None:
            raise FleetError(
                "nothing to save or load: call fleet.distributed_model(model) first, or pass "
                "the model as main_program"
            )
        return model.module if isinstance(model, DistributedModel | PSModel) else model

    def save_persistables(
        self,
        executor: Any = None,
        dirname: str | os.PathLike[str] | None = None,
        main_program: Any = None,
        mode: int = 0,
    ) -> Path:
        """Atomically save the model and optimizer state to ``dirname/persistables.pt``
        (written by the first worker; ``save_persistables(dirname)`` works too)."""
        if dirname is None and isinstance(executor, (str, os.PathLike)):
            dirname = executor
        if dirname is None:
            raise TypeError(
                "save_persistables needs dirname, e.g. fleet.save_persistables(exe, dir)"
            )
        path = Path(dirname, PERSISTABLES)
        state: dict[str, Any] = {"model": self._state_owner(main_program).state_dict()}
        if self._optimizer is not None and self._optimizer._bound is not None:
            state["optimizer"] = self._optimizer.state_dict()
        save_checkpoint(path, state)
        return path

    def load_persistables(
        self, dirname: str | os.PathLike[str], main_program: Any = None
    ) -> dict[str, Any]:
        """Load what save_persistables wrote into the model (and optimizer); returns it."""
        path = Path(dirname, PERSISTABLES)
        state = load_checkpoint(path)
        if state is None:
            raise FileNotFoundError(f"load_persistables: no {path}; save_persistables writes it")
        self._state_owner(main_program).load_state_dict(state["model"])
        opt = self._optimizer
        if "optimizer" in state and opt is not None and opt._bound is not None:
            opt.set_state_dict(state["optimizer"])
        return state

    load_model = load_persistables
