"""Per-rank logs as Paddle names them: ``<log_dir>/workerlog.<rank>`` (``serverlog.<n>``)."""

from __future__ import annotations

import os
from collections.abc import Container

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from longboat.launch.roles import role_of


def log_name(rank: int, servers: int = 0) -> str:
    """``workerlog.<n>`` (trainer n), or ``serverlog.<n>`` for parameter server n."""
    role, index = role_of(rank, servers)
    return f"serverlog.{index}" if role == "server" else f"workerlog.{index}"


class WorkerLogs(LogsSpecs):
    """Each rank's stdout (stderr is merged into it by the bootstrap) in one flat file.

    ``tee_ranks`` are also shown on the console by torch's tailer with a ``[rank N]`` prefix.
    A restart keeps the previous attempt's log as ``workerlog.<rank>.attempt<k>``.
    ``local_servers`` (multi-node parameter-server jobs): logs are named by this node's own
    role numbers (``serverlog.<i>``/``workerlog.<i>`` counted on this node) and the console
    shows this node's first trainer (every rank if ``tee_ranks`` is everything).
    """

    def __init__(
        self,
        log_dir: str,
        tee_ranks: Container[int],
        servers: int = 0,
        local_servers: int | None = None,
    ):
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir)
        self._tee_ranks = tee_ranks
        self._servers = servers
        self._local_servers = local_servers
        self.names: dict[int, str] = {}  # global rank -> its log's name, once started

    def _name_and_tee(self, env: dict[str, str]) -> tuple[str, bool]:
        if self._local_servers is None:
            rank = int(env["RANK"])
            return log_name(rank, self._servers), rank in self._tee_ranks
        local = int(env["LOCAL_RANK"])
        tee = getattr(self._tee_ranks, "all", False) or local == self._local_servers
        return log_name(local, self._local_servers), tee

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local_rank, env in envs.items():
            attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
            name, tee = self._name_and_tee(env)
            self.names[int(env["RANK"])] = name
            path = os.path.join(self.root_log_dir, name)
            if attempt != "0" and os.path.exists(path):
                os.replace(path, f"{path}.attempt{int(attempt) - 1}")
            errors = os.path.join(self.root_log_dir, ".errors", f"attempt{attempt}")
            os.makedirs(errors, exist_ok=True)
            error_file = os.path.join(errors, f"{env['RANK']}.json")
            if os.path.exists(error_file):
                os.remove(error_file)
            env["TORCHELASTIC_ERROR_FILE"] = error_file
            env["LONGBOAT_LOG_FILE"] = path
            dest.stdouts[local_rank] = path
            dest.stderrs[local_rank] = ""  # the console, until the bootstrap merges it
            dest.error_files[local_rank] = error_file
            if tee:
                dest.tee_stdouts[local_rank] = path
        return dest
