"""What a trainer's parameter-server engine does (``PSConfig``) and where the job's servers
are (``cluster_from_env``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from longboat.cluster.env import variable
from longboat.ps.trainer.plan import DEFAULT_MIN_BLOCK_SIZE
from longboat.recompute import RecomputeConfig
from longboat.trace.config import TraceConfig

if TYPE_CHECKING:
    from longboat.strategy import Strategy


@dataclass(frozen=True)
class PSConfig:
    """What the trainer-side engine does; ``from_strategy`` reads it off a Strategy.

    ``mode`` names a registered mode (``longboat.ps.trainer.modes``): the Strategy's
    ``a_sync_configs['mode']`` names any of them (a mode of one's own too), or, at ``auto``,
    ``a_sync``, ``k_steps`` and ``use_thread_barrier`` select sync, async, half_async or geo;
    ``lb.ps.distribute(..., mode=name)`` overrides it.
    """

    mode: str = "sync"
    k_steps: int = 0
    update_on_server: bool = True
    max_merge: int = 1
    queue_size: int = 16
    wait_times: int = 1
    overlap: bool = True
    min_block_size: int = DEFAULT_MIN_BLOCK_SIZE
    bucket_bytes: int = 1 << 20
    #: sync with overlap: after timing a few steps, merge push buckets that would start too
    #: close to the end of backward to hide anything (``HookPusher``)
    tune_buckets: bool = True
    #: steps of pushed gradients kept to replay after a server restarts from its checkpoint,
    #: by modes that are ``recoverable`` (sync); 0: off; default twice
    #: ``LONGBOAT_PS_CHECKPOINT_EVERY``
    recovery_window: int = 0
    #: the timeline and the stall inspection of server replies (None: both off)
    trace: TraceConfig | None = None
    #: submodules that recompute their activations in backward (None: off)
    recompute: RecomputeConfig | None = None

    @classmethod
    def from_strategy(cls, strategy: Strategy, **overrides: Any) -> PSConfig:
        c = strategy.a_sync_configs
        k = c["k_steps"]
        chosen = c["mode"]
        if chosen != "auto":  # a registered mode by name (the Strategy checked the name)
            mode = chosen
        elif not strategy.a_sync:
            if k > 0:
                raise ValueError(
                    f"Strategy.a_sync=False (sync) with a_sync_configs['k_steps']={k}: geo-SGD "
                    "needs a_sync=True; set a_sync=True for geo or k_steps=0 for sync"
                )
            mode = "sync"
        elif k > 0:
            mode = "geo"
        else:
            mode = "half_async" if strategy.use_thread_barrier else "async"
        cfg = cls(
            mode=mode,
            k_steps=k,
            update_on_server=c["update_on_server"],
            max_merge=c["max_merge_var_num"],
            queue_size=c["send_queue_size"],
            wait_times=c["send_wait_times"],
            recovery_window=2 * checkpoint_every(),  # used where the mode is recoverable
            trace=TraceConfig.of(strategy),
            recompute=RecomputeConfig.of(strategy.recompute, strategy.recompute_configs),
        )
        return replace(cfg, **overrides)


def checkpoint_every(env: Mapping[str, str] | None = None) -> int:
    """The servers' checkpoint period (``LONGBOAT_PS_CHECKPOINT_EVERY``, 0: none), which the
    launcher gives every rank of the job."""
    return int(variable("LONGBOAT_PS_CHECKPOINT_EVERY", env, default=0))


def cluster_from_env(env: Mapping[str, str] | None = None) -> tuple[list[str], int, int]:
    """(server endpoints, this trainer's index, number of trainers) from the launcher's env."""
    env = os.environ if env is None else env
    servers = [e for e in env.get("PADDLE_PSERVERS_IP_PORT_LIST", "").split(",") if e]
    if not servers:
        raise ValueError(
            "no parameter servers: PADDLE_PSERVERS_IP_PORT_LIST is not set; start with "
            "`longboat launch --servers N --workers M train.py` or pass servers=[...]"
        )
    trainer = int(env.get("PADDLE_TRAINER_ID", env.get("RANK", "0")))
    trainers = int(env.get("PADDLE_TRAINERS_NUM", env.get("WORLD_SIZE", "1")))
    return servers, trainer, trainers
