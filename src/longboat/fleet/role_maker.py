"""Fleet's role makers: who is a worker or a server, from the environment or from the user.

``PaddleCloudRoleMaker`` reads what ``longboat launch`` (or paddle.distributed.launch) exports:
PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ENDPOINTS and, in parameter-server
mode, TRAINING_ROLE, PADDLE_PSERVERS_IP_PORT_LIST, POD_IP and PADDLE_PORT. In collective mode
without those variables it falls back to longboat's cluster discovery (torchrun, Slurm, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from enum import IntEnum

import longboat.cluster as cluster


class Role(IntEnum):
    """Paddle's role numbering."""

    WORKER = 1
    SERVER = 2


def _split(text: str | None) -> list[str]:
    return [e.strip() for e in (text or "").split(",") if e.strip()]


class RoleMakerBase:
    """The questions fleet asks a role maker (public names, plus Paddle's underscored ones)."""

    is_collective: bool = False
    _role: Role = Role.WORKER
    _index: int = 0
    _workers: int = 1
    _worker_endpoints: list[str]
    _server_endpoints: list[str]

    def worker_index(self) -> int:
        return self._index if self._role == Role.WORKER else 0

    def worker_num(self) -> int:
        return self._workers

    def is_worker(self) -> bool:
        return self._role == Role.WORKER

    def is_server(self) -> bool:
        return self._role == Role.SERVER

    def is_first_worker(self) -> bool:
        return self.is_worker() and self.worker_index() == 0

    def server_index(self) -> int:
        return self._index if self._role == Role.SERVER else 0

    def server_num(self) -> int:
        return len(self._server_endpoints)

    def worker_endpoints(self) -> list[str]:
        return list(self._worker_endpoints)

    def server_endpoints(self) -> list[str]:
        return list(self._server_endpoints)

    # Paddle's spellings, used by code that talks to role makers directly
    _worker_index = worker_index
    _worker_num = worker_num
    _is_worker = is_worker
    _is_server = is_server
    _is_first_worker = is_first_worker
    _server_index = server_index
    _server_num = server_num
    _get_trainer_endpoints = worker_endpoints
    _get_pserver_endpoints = server_endpoints

    def __repr__(self) -> str:
        index = self.worker_index() if self.is_worker() else self.server_index()
        return (
            f"{type(self).__name__}(role={self._role.name}, index={index}, "
            f"workers={self.worker_num()}, servers={self.server_num()}, "
            f"collective={self.is_collective})"
        )


class PaddleCloudRoleMaker(RoleMakerBase):
    """Roles from the launcher's environment (Paddle's variables, else longboat's cluster)."""

    def __init__(
        self, is_collective: bool = False, env: Mapping[str, str] | None = None, **kwargs: object
    ):
        env = os.environ if env is None else env
        self.is_collective = bool(is_collective)
        self._worker_endpoints = _split(env.get("PADDLE_TRAINER_ENDPOINTS"))
        self._server_endpoints = _split(env.get("PADDLE_PSERVERS_IP_PORT_LIST"))
        if self.is_collective:
            info = cluster.cluster()
            self._role = Role.WORKER
            self._index = int(env.get("PADDLE_TRAINER_ID", info.rank))
            self._workers = int(env.get("PADDLE_TRAINERS_NUM", info.world_size))
            return
        role = env.get("TRAINING_ROLE", "TRAINER").upper()
        if role not in ("TRAINER", "PSERVER"):
            raise ValueError(f"TRAINING_ROLE={role!r}: expected TRAINER or PSERVER")
        self._role = Role.SERVER if role == "PSERVER" else Role.WORKER
        self._workers = int(env.get("PADDLE_TRAINERS_NUM", "1"))
        if self._role == Role.WORKER:
            self._index = int(env.get("PADDLE_TRAINER_ID", "0"))
        else:
            me = f"{env.get('POD_IP', '')}:{env.get('PADDLE_PORT', '')}"
            fallback = int(env.get("LONGBOAT_ROLE_RANK", "0"))
            eps = self._server_endpoints
            self._index = eps.index(me) if me in eps else fallback


class UserDefinedRoleMaker(RoleMakerBase):
    """Roles given in code: ``UserDefinedRoleMaker(current_id, role, worker_num,
    server_endpoints)`` (Paddle's order; all keyword-able)."""

    def __init__(
        self,
        current_id: int = 0,
        role: Role = Role.WORKER,
        worker_num: int = 0,
        server_endpoints: Sequence[str] | None = None,
        is_collective: bool = False,
        worker_endpoints: Sequence[str] | None = None,
        **kwargs: object,
    ):
        self.is_collective = bool(is_collective)
        self._role = Role(int(role))
        self._index = int(current_id)
        self._workers = int(worker_num) or (1 if self._role == Role.WORKER else 0)
        self._server_endpoints = list(server_endpoints or [])
        self._worker_endpoints = list(worker_endpoints or [])
        if self._index < 0:
            raise ValueError(f"UserDefinedRoleMaker: current_id={current_id} must be >= 0")
        if self._role == Role.WORKER and self._index >= self._workers:
            raise ValueError(
                f"UserDefinedRoleMaker: current_id={current_id} is not below worker_num="
                f"{self._workers}"
            )
        if self._role == Role.SERVER and self._index >= len(self._server_endpoints):
            raise ValueError(
                f"UserDefinedRoleMaker: server current_id={current_id} needs that many "
                f"server_endpoints (got {len(self._server_endpoints)})"
            )


__all__ = ["PaddleCloudRoleMaker", "Role", "RoleMakerBase", "UserDefinedRoleMaker"]
