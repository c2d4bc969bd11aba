"""``lb.distribute`` for ``Strategy(mode="ps")``: trainers push gradients to sharded servers and
pull parameters back.

Modes (Paddle's names): **sync** (``a_sync=False``): servers average every trainer's gradient
per block and apply one update per step; **async** (``a_sync=True``, ``k_steps`` 0 or -1): a
background communicator merges and pushes gradients, servers apply each push on arrival;
**half_async** (async plus ``use_thread_barrier=True``): the same pushes, with a flush and a
barrier of all trainers every step; **geo** (``k_steps > 0``): trainers train locally and every
k steps push parameter deltas / N and pull the global values.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from longboat.log import get_logger
from longboat.ps import auth, settings
from longboat.ps.client import Call, Client, PSError, ReplyWatch
from longboat.ps.communicator import AsyncCommunicator, HookPusher
from longboat.ps.optim import describe_torch_optimizer
from longboat.ps.plan import DEFAULT_MIN_BLOCK_SIZE, Block, make_plan
from longboat.ps.sparse import SparseEmbedding
from longboat.ps.wire import Message, chunks_by_bytes
from longboat.trace.ps import make_observer
from longboat.trace.stall import shown

log = get_logger("longboat.ps")

MODES = ("sync", "async", "half_async", "geo")
_current: PSEngine | None = None
_NULL = contextlib.nullcontext()


@dataclass(frozen=True)
class PSConfig:
    """What the trainer-side engine does; ``from_strategy`` reads it off a Strategy."""

    mode: str = "sync"
    k_steps: int = 0
    update_on_server: bool = True
    max_merge: int = 1
    queue_size: int = 16
    wait_times: int = 1
    overlap: bool = True
    min_block_size: int = DEFAULT_MIN_BLOCK_SIZE
    bucket_bytes: int = 1 << 20

    @classmethod
    def from_strategy(cls, strategy: Any, **overrides: Any) -> PSConfig:
        c = strategy.a_sync_configs
        k = int(c["k_steps"])
        if not strategy.a_sync:
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
            update_on_server=bool(c["update_on_server"]),
            max_merge=int(c["max_merge_var_num"]),
            queue_size=int(c["send_queue_size"]),
            wait_times=int(c["send_wait_times"]),
        )
        return replace(cfg, **overrides)


# param-group keys that learning-rate schedulers change while training
_SCHEDULED = ("lr", "initial_lr")


def _plain_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The JSON-able hyper-parameters of every param group (numbers, flags, names)."""
    out = []
    for group in optimizer.param_groups:
        plain: dict[str, Any] = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, tuple | list) and all(isinstance(v, int | float) for v in value):
                value = list(value)
            if key != "params" and isinstance(value, bool | int | float | str | list | None):
                plain[key] = value
        out.append(plain)
    return out


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


def _part(t: torch.Tensor, b: Block) -> torch.Tensor:
    """Block ``b``'s rows of tensor ``t`` (a view)."""
    return (t.reshape(1) if t.dim() == 0 else t)[b.start : b.stop].reshape(b.shape)


class PSEngine:
    """One trainer's side of a parameter-server job (built by ``distribute``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: PSConfig,
        client: Client,
        trainer: int,
        trainers: int,
        strategy: Any = None,
    ) -> None:
        """``strategy`` (optional) turns on the timeline (``timeline``) and the stall inspection
        of server replies (``stall_warning_seconds`` / ``stall_shutdown_seconds``)."""
        if cfg.mode not in MODES:
            raise ValueError(f"unknown parameter-server mode {cfg.mode!r}; one of {MODES}")
        if not cfg.update_on_server and cfg.mode != "sync":
            raise ValueError(
                f"a_sync_configs['update_on_server']=False needs sync mode (got {cfg.mode}): "
                "only then do the servers hold one averaged gradient per step"
            )
        if not 0 <= trainer < trainers:
            raise ValueError(f"trainer index {trainer} is not in [0, {trainers})")
        self.model, self.optimizer, self.cfg, self.client = model, optimizer, cfg, client
        self.trainer, self.trainers = trainer, trainers
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.tables = [m for m in model.modules() if isinstance(m, SparseEmbedding)]
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"SparseEmbedding names must be unique, got {names}")
        self.plan = make_plan(
            [(n, tuple(p.shape)) for n, p in self.params],
            len(client),
            cfg.min_block_size,
            max(cfg.min_block_size, client.max_bytes // 8 // 4),
        )
        self.blocks = [self.plan.of_param(n) for n, _ in self.params]
        self.step_no = 0
        self._chunk_bytes = client.max_bytes // 2
        self._pending: dict[int, list[Call]] = {}
        self._lookups: list[tuple[SparseEmbedding, torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._latest: dict[str, torch.Tensor] | None = None
        self._barrier_gen = 0
        self._restores = 0
        self._update = {
            "sync": "optimizer",
            "async": "optimizer",
            "half_async": "optimizer",
            "geo": "delta",
        }[cfg.mode]
        if not cfg.update_on_server:
            self._update = "sum"
        self._opt_name, self._groups = "", []
        if self._update == "optimizer":
            self._opt_name, self._groups = describe_torch_optimizer(optimizer)
        ids = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
        self._group_of = {n: ids.get(id(p), 0) for n, p in self.params}
        for t in self.tables:
            t._lookup = self.lookup
        # model.state_dict() (torch.save after the last step) waits for the pulls in flight
        self._state_hook = model.register_state_dict_pre_hook(self._before_state_dict)
        self.trace = None  # the timeline's PSObserver (Strategy.timeline)
        if strategy is not None:
            self.trace = make_observer(strategy, trainer, trainers, lambda: self.step_no)
            warning = float(strategy.stall_warning_seconds)
            if warning > 0:
                shutdown = float(strategy.stall_shutdown_seconds)
                client.stall = ReplyWatch(warning, shutdown, self.explain_wait)
        client.observer = self.trace
        self._init_servers()
        self._base = [p.detach().clone() for _, p in self.params] if cfg.mode == "geo" else []
        self._pusher: HookPusher | None = None
        if cfg.mode == "sync" and cfg.overlap:
            self._pusher = HookPusher(
                [p for _, p in self.params], self._push_params, cfg.bucket_bytes
            )
        self._comm: AsyncCommunicator | None = None
        if cfg.mode in ("async", "half_async"):
            self._comm = AsyncCommunicator(
                self._send_async,
                max_merge=cfg.max_merge,
                queue_size=cfg.queue_size,
                wait_times=cfg.wait_times,
                timeout=client.timeout,
            )

    # ---- set-up -------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Everything that shapes this trainer's exchange with the servers: each server and
        every later trainer must agree (``longboat.ps.settings``)."""
        if self._update == "optimizer":
            opt_name, groups = self._opt_name, self._groups
        else:  # the trainers run it: the servers do not, but the other trainers must match
            opt_name, groups = type(self.optimizer).__name__, _plain_groups(self.optimizer)
        # every push carries the learning rates, so a scheduler may change them, also between
        # a checkpoint and the restart from it: they are not compared
        groups = [{k: v for k, v in g.items() if k not in _SCHEDULED} for g in groups]
        return {
            "trainers": self.trainers,
            "mode": self.cfg.mode,
            "k_steps": self.cfg.k_steps if self.cfg.mode == "geo" else 0,
            "update_on_server": self.cfg.update_on_server,
            "optimizer": opt_name,
            "param_groups": groups,
            "param_group_of": [self._group_of[n] for n, _ in self.params],
            "min_block_size": self.cfg.min_block_size,
            "dense_params": len(self.params),
            "dense_elements": sum(p.numel() for _, p in self.params),
            "plan": self.plan.digest(),
            "tables": {t.name: t.spec() for t in self.tables},
        }

    def _init_servers(self) -> None:
        self.client.connect()
        settings.agree(self.client, "engine", self.trainer, self.settings())
        msgs: dict[int, Message] = {}
        for s in range(len(self.client)):
            specs, values = [], {}
            for (name, p), blocks in zip(self.params, self.blocks, strict=True):
                for b in blocks:
                    if b.server != s:
                        continue
                    spec: dict[str, Any] = {"key": b.key, "update": self._update}
                    if self._update == "optimizer":
                        g = self._group_of[name]
                        spec |= {
                            "optimizer": self._opt_name,
                            "hparams": self._groups[g],
                            "group": g,
                        }
                    specs.append(spec)
                    if self.trainer == 0:
                        values[b.key] = _part(p.detach(), b)
            meta = {
                "trainer": self.trainer,
                "trainers": self.trainers,
                "sync": self.cfg.mode == "sync",
                "digest": self.plan.digest(),
                "blocks": specs,
                "tables": [t.spec() for t in self.tables],
            }
            msgs[s] = Message(meta, values)
        replies = self.client.call_all("init", msgs)
        self.step_no = max(int(r.meta.get("version", 0)) for r in replies.values())
        self._barrier()
        self._pull_into_params(self.step_no)
        if self.trainer == 0:
            loads = ", ".join(str(n) for n in self.plan.loads())
            log.info(
                "parameter servers: %s mode, %d trainers, plan %s (%d blocks; elements per "
                "server %s)",
                self.cfg.mode,
                self.trainers,
                self.plan.digest(),
                len(self.plan.blocks),
                loads,
            )
            log.debug("sharding plan:\n%s", self.plan.describe())

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> None:
        """One optimizer step in the configured mode."""
        if self.trace is None:
            self._step()
            return
        with self.trace.step(self.cfg.mode):
            self._step()

    def _waiting(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """A wait of the training thread, on the timeline when it records."""
        return _NULL if self.trace is None else self.trace.wait(what)

    def _step(self) -> None:
        self.synchronize()
        mode = self.cfg.mode
        if mode == "sync":
            self._sync_step()
        elif mode == "geo":
            self._geo_step()
        else:
            self._async_step()
        self.step_no += 1

    def _sync_step(self) -> None:
        with self._waiting("push"):
            if self._pusher is not None:
                for started in self._pusher.finish():
                    for call in started.result():
                        call.result()
            else:
                self._wait(self._push_params(range(len(self.params))))
            self._wait(self._push_sparse(self.step_no, every_server=True))
        if self.cfg.update_on_server:
            self._pending = self._start_pulls(self.step_no + 1)
            if not self.cfg.overlap:
                self.synchronize()
            return
        with self._waiting("pull"):
            means = self._collect(self._start_pulls(self.step_no + 1))
        for (_, p), blocks in zip(self.params, self.blocks, strict=True):
            grad = torch.empty_like(p)
            for b in blocks:
                _part(grad, b).copy_(means[b.key])
            p.grad = grad
        self._local_optimizer_step()

    def _local_optimizer_step(self) -> None:
        if self.trace is None:
            self.optimizer.step()
            return
        with self.trace.local_optimizer():
            self.optimizer.step()

    def _async_step(self) -> None:
        assert self._comm is not None
        with self._waiting("send queue"):
            self._comm.put(self._grads())
        with self._waiting("push"):
            self._wait(self._push_sparse(-1, every_server=False))
        if self.cfg.mode == "half_async":
            with self._waiting("push"):
                self._comm.flush()
            self._barrier()
            self._pull_into_params(0)
            return
        with self._lock:
            latest, self._latest = self._latest, None
        if latest is not None:
            self._copy_into_params(latest)

    def _send_async(self, grads: list[torch.Tensor]) -> None:
        self._wait(self._push_tensors(range(len(self.params)), grads, -1))
        if self.cfg.mode == "async":
            values = self._collect(self._start_pulls(0))
            with self._lock:
                self._latest = values

    def _geo_step(self) -> None:
        self._local_optimizer_step()
        with self._waiting("push"):
            self._wait(self._push_sparse(-1, every_server=False))
        if (self.step_no + 1) % self.cfg.k_steps:
            return
        deltas = [
            (p.detach() - base) / self.trainers
            for (_, p), base in zip(self.params, self._base, strict=True)
        ]
        with self._waiting("push"):
            self._wait(self._push_tensors(range(len(self.params)), deltas, -1))
        self._pull_into_params(0)
        self._base = [p.detach().clone() for _, p in self.params]

    # ---- pushes and pulls -------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.params]

    def _push_params(self, indices: Iterable[int]) -> list[Call]:
        idx = list(indices)
        grads = [self.params[i][1].grad for i in idx]
        tensors = [
            g if g is not None else torch.zeros_like(self.params[i][1])
            for i, g in zip(idx, grads, strict=True)
        ]
        return self._push_tensors(idx, tensors, self.step_no, aligned=True)

    def _push_tensors(
        self,
        indices: Iterable[int],
        tensors: Sequence[torch.Tensor],
        step: int,
        aligned: bool = False,
    ) -> list[Call]:
        """Push ``tensors`` (one per index, or one per parameter unless ``aligned``)."""
        idx = list(indices)
        per_server: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for j, i in enumerate(idx):
            t = tensors[j] if aligned else tensors[i]
            for b in self.blocks[i]:
                per_server.setdefault(b.server, []).append((b.key, _part(t, b)))
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        meta = {"trainer": self.trainer, "step": step, "lrs": lrs}
        return [
            self.client.start(s, "push", Message(meta, dict(chunk)))
            for s, items in per_server.items()
            for chunk in chunks_by_bytes(
                ((item, item[1].numel() * item[1].element_size()) for item in items),
                self._chunk_bytes,
            )
        ]

    def _start_pulls(self, version: int) -> dict[int, list[Call]]:
        pulls: dict[int, list[Call]] = {}
        for s in range(len(self.client)):
            sized = [(b.key, math.prod(b.shape) * 4) for b in self.plan.of_server(s)]  # float32
            for keys in chunks_by_bytes(sized, self._chunk_bytes):
                meta = {"keys": keys, "version": version}
                pulls.setdefault(s, []).append(self.client.start(s, "pull", Message(meta)))
        return pulls

    def _collect(self, pulls: Mapping[int, list[Call]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for calls in pulls.values():
            for call in calls:
                out.update(call.result().tensors)
        return out

    def _copy_into_params(self, values: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for (_, p), blocks in zip(self.params, self.blocks, strict=True):
                for b in blocks:
                    if b.key in values:
                        _part(p.data, b).copy_(values[b.key])

    def _pull_into_params(self, version: int) -> None:
        with self._waiting("pull"):
            values = self._collect(self._start_pulls(version))
        self._copy_into_params(values)

    def refresh(self) -> None:
        """Send everything queued, then load the servers' current parameters into the model
        (e.g. before evaluating an async job; in geo mode it discards unsent local steps)."""
        self.synchronize()
        if self._comm is not None:
            self._comm.flush()
        self._pull_into_params(0)

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for the parameter pulls still in flight and write them into the model."""
        pending, self._pending = self._pending, {}
        if pending:
            with self._waiting("pull"):
                values = self._collect(pending)
            self._copy_into_params(values)

    def _barrier(self) -> None:
        self._barrier_gen += 1
        meta = {"trainer": self.trainer, "name": "", "generation": self._barrier_gen}
        with self._waiting("barrier"):
            self.client.call_all("barrier", {s: Message(meta) for s in range(len(self.client))})

    def explain_wait(self, call: Call, waited: float) -> str:
        """The stall warning for ``call``, unanswered after ``waited`` seconds: the server and
        endpoint, the method, the step and keys, and whom the server waits for."""
        meta = call.msg.meta if call.msg is not None else {}
        others = [t for t in range(self.trainers) if t != self.trainer]
        whom = self._whom(call, meta) or (
            f"trainer {others[0]}" if len(others) == 1 else f"one or more of trainers {others}"
        )
        if call.method == "pull" and int(meta.get("version", 0)) > 0 and self.cfg.mode == "sync":
            step = int(meta["version"]) - 1
            what = f"pull of step {step}"
            why = (
                f"it answers once every trainer's push of step {step} reached it; this trainer "
                f"({self.trainer}) pushed, so it waits for {whom}"
                if others
                else "this is the only trainer: the server is slow or stuck"
            )
        elif call.method in ("barrier", "restore") and others:
            what = f"{call.method} at step {self.step_no}"
            why = (
                f"it answers once all {self.trainers} trainers reached it; this trainer "
                f"({self.trainer}) has, so it waits for {whom}"
            )
        else:
            step = int(meta.get("step", -1)) if call.method == "push" else -1
            what = f"push of step {step}" if step >= 0 else f"{call.method} at step {self.step_no}"
            why = (
                f"a {call.method} does not wait for other trainers: the server is slow, stuck "
                "or unreachable"
            )
        return (
            f"trainer {self.trainer}: parameter server {call.server} ({call.endpoint}) has not "
            f"answered {what} for keys [{shown(call.keys())}] after {waited:.1f} s; {why}"
        )

    def _whom(self, call: Call, meta: Mapping[str, Any]) -> str:
        """Ask the stalled call's server which trainers it still lacks ("" if it cannot say)."""
        if call.method == "barrier":
            question: dict[str, Any] = {"barrier": [meta.get("name", ""), meta.get("generation")]}
        elif call.method == "pull":
            tables = [n[:-4] for n in (call.msg.tensors if call.msg else {}) if n.endswith("@ids")]
            question = {"keys": meta.get("keys") or [], "tables": tables,
                        "version": meta.get("version", 0)}  # fmt: skip
        else:
            return ""
        try:
            reply = self.client.start(call.server, "ping", Message(question), 2.0, False).result()
        except PSError:
            return ""
        lacking = reply.meta.get("waiting_for")
        if not isinstance(lacking, list) or not lacking:
            return ""
        names = ", ".join(str(t) for t in lacking)
        return f"trainer{'s' if len(lacking) > 1 else ''} {names} (the server says)"

    @staticmethod
    def _wait(calls: Iterable[Call]) -> None:
        for call in calls:
            call.result()

    # ---- sparse tables --------------------------------------------------------------------
    def lookup(self, table: SparseEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``table`` for ``ids``: pull each distinct id once, record for the push."""
        self.synchronize()
        uniq, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)
        servers = len(self.client)
        version = self.step_no if self.cfg.mode == "sync" else 0
        rows = torch.empty(len(uniq), table.embedding_dim, dtype=table.dtype)
        calls = {}
        for s in range(servers):
            mask = uniq % servers == s
            if bool(mask.any()):
                meta = {"keys": [], "version": version}
                msg = Message(meta, {f"{table.name}@ids": uniq[mask]})
                calls[s] = (mask, self.client.start(s, "pull", msg))
        with self._waiting("pull"):
            for mask, call in calls.values():
                rows[mask] = call.result().tensors[f"{table.name}@rows"]
        if torch.is_grad_enabled() and self.model.training:
            rows.requires_grad_(True)
            self._lookups.append((table, uniq, rows))
        return rows[inverse].reshape(*ids.shape, table.embedding_dim)

    def _push_sparse(self, step: int, every_server: bool) -> list[Call]:
        lookups, self._lookups = self._lookups, []
        if not self.tables or (not lookups and not every_server):
            return []
        servers = len(self.client)
        merged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for table in self.tables:
            mine = [(u, r) for t, u, r in lookups if t is table]
            ids = torch.cat([u for u, _ in mine]) if mine else torch.empty(0, dtype=torch.int64)
            grads = [r.grad if r.grad is not None else torch.zeros_like(r) for _, r in mine]
            dim = table.embedding_dim
            merged[table.name] = (
                ids,
                torch.cat(grads) if grads else torch.empty(0, dim, dtype=table.dtype),
            )
        calls = []
        for s in range(servers):
            tensors = {}
            for name, (ids, grads) in merged.items():
                mask = ids % servers == s
                if every_server or bool(mask.any()):
                    tensors[f"{name}@ids"], tensors[f"{name}@grad"] = ids[mask], grads[mask]
            if tensors:
                meta = {"trainer": self.trainer, "step": step}
                calls.append(self.client.start(s, "push", Message(meta, tensors)))
        return calls

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self) -> int:
        """Make every server checkpoint its blocks and optimizer state; return the step saved."""
        self.synchronize()
        replies = self.client.call_all("save", {s: Message() for s in range(len(self.client))})
        steps = {int(r.meta["step"]) for r in replies.values()}
        if len(steps) != 1:
            raise PSError(f"servers saved different steps {sorted(steps)}; save between steps")
        return steps.pop()

    def restore(self, step: int | None = None, timeout: float | None = None) -> int:
        """After a server restarted from its checkpoint: roll every server back to that step,
        pull the parameters and return the step to resume the training loop from."""
        self._pending, self._lookups = {}, []
        if self._pusher is not None:
            self._pusher.abandon()
        self.client.connect(timeout)
        pings = self.client.call_all("ping", {s: Message() for s in range(len(self.client))})
        if step is None:
            restored = [r.meta.get("restored") for r in pings.values()]
            restored = [int(v) for v in restored if v is not None]
            if not restored:
                raise PSError("no server reports a restart from a checkpoint; pass step=")
            step = min(restored)
        self._restores += 1
        meta = {"trainer": self.trainer, "step": step, "generation": self._restores}
        self.client.call_all("restore", {s: Message(meta) for s in range(len(self.client))})
        self.step_no = step
        self._pull_into_params(step)
        return step

    def close(self) -> None:
        """Stop the background threads and close the connections."""
        global _current
        try:
            self.synchronize()
            if self._comm is not None:
                self._comm.flush()
        finally:
            if self._comm is not None:
                self._comm.close()
            if self._pusher is not None:
                self._pusher.close()
            for t in self.tables:
                t._lookup = None
            self._state_hook.remove()
            self.client.close()
            if self.trace is not None:
                self.trace.close()
            if _current is self:
                _current = None


class PSModel(nn.Module):
    """The model as the trainer uses it; ``.module`` is the original, ``.engine`` the engine."""

    def __init__(self, module: nn.Module, engine: PSEngine) -> None:
        super().__init__()
        self.module = module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.synchronize()
        trace = self.engine.trace
        if trace is None:
            return self.module(*args, **kwargs)
        trace.forward_begin()
        output = self.module(*args, **kwargs)
        trace.forward_end(output)
        return output


class PSOptimizer:
    """The optimizer as the trainer uses it: ``step()`` runs the parameter-server step."""

    def __init__(self, engine: PSEngine, inner: torch.optim.Optimizer) -> None:
        self.engine, self.inner = engine, inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("the parameter-server optimizer takes no closure")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: Any,
    *,
    servers: Sequence[str] | None = None,
    trainer: int | None = None,
    trainers: int | None = None,
    token: str | None = None,
    timeout: float | None = None,
    **overrides: Any,
) -> tuple[PSModel, PSOptimizer]:
    """Connect ``model`` and ``optimizer`` to the job's servers (``lb.distribute`` calls this for
    ``mode="ps"``). Servers and trainer ids come from the launcher's environment unless given;
    ``timeout`` bounds every call (default ``LONGBOAT_PS_TIMEOUT`` or 120 s); ``overrides`` set
    PSConfig fields (``overlap``, ``min_block_size``, ``bucket_bytes``)."""
    global _current
    strategy.check_implemented()
    if optimizer is None:
        raise ValueError("parameter-server mode needs the optimizer: lb.distribute(model, opt, s)")
    if isinstance(model, PSModel):
        raise ValueError("this model was already passed to lb.distribute")
    cfg = PSConfig.from_strategy(strategy, **overrides)
    if servers is None or trainer is None or trainers is None:
        env_servers, env_trainer, env_trainers = cluster_from_env()
        servers = env_servers if servers is None else servers
        trainer = env_trainer if trainer is None else trainer
        trainers = env_trainers if trainers is None else trainers
    client = Client(servers, token or auth.load_token(), timeout=timeout)
    try:
        engine = PSEngine(model, optimizer, cfg, client, trainer, trainers, strategy)
    except BaseException:
        client.close()
        raise
    _current = engine
    return PSModel(model, engine), PSOptimizer(engine, optimizer)


def current() -> PSEngine:
    """The engine of the last ``distribute`` in this process."""
    if _current is None:
        raise RuntimeError("no parameter-server engine: call lb.distribute with mode='ps' first")
    return _current


def save() -> int:
    """``lb.ps.save()``: checkpoint every server (started with a checkpoint dir) at this step."""
    return current().save()
