"""``lb.distribute`` for ``Strategy(mode="ps")``: trainers push gradients to sharded servers and
pull parameters back.

The engine connects a trainer to the servers and counts its steps; what a step does is the
mode's (``longboat.ps.trainer.modes``: sync, async, half_async, geo, or one registered by the user),
chosen by ``PSConfig.mode``. Dense parameters travel through ``params.DenseParams``, sparse
tables through ``sparse.SparseLookups``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from longboat.log import get_logger
from longboat.ownership import admit
from longboat.ps.shared import auth
from longboat.ps.shared.optim import describe_torch_optimizer
from longboat.ps.shared.request import DROPPED
from longboat.ps.shared.wire import Message
from longboat.ps.trainer import modes, settings, table_admin
from longboat.ps.trainer.active_engine import current, make_current, release
from longboat.ps.trainer.client import Call, Client, PSError, ReplyWatch
from longboat.ps.trainer.config import PSConfig, cluster_from_env
from longboat.ps.trainer.params import DenseParams, part
from longboat.ps.trainer.plan import make_plan
from longboat.ps.trainer.recovery import Recovery, RecoveryContext
from longboat.ps.trainer.sparse import SparseEmbedding, SparseLookups
from longboat.ps.trainer.table_configs import apply_sparse_table_configs
from longboat.ps.trainer.wrappers import PSModel, PSOptimizer
from longboat.recompute import apply_recompute
from longboat.trace.ps import StallExplainer, make_observer
from longboat.words import plural

if TYPE_CHECKING:
    from longboat.strategy import Strategy

__all__ = ["PSConfig", "PSEngine", "PSModel", "PSOptimizer", "cluster_from_env",
           "current", "distribute", "save"]  # fmt: skip

log = get_logger("longboat.ps")

_NULL = contextlib.nullcontext()


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


class PSEngine:
    """One trainer's side of a parameter-server job (built by ``distribute``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: PSConfig,
        endpoints: Sequence[str],
        token: str,
        trainer: int,
        trainers: int,
        timeout: float | None = None,
    ) -> None:
        """Connect to the servers at ``endpoints``. ``cfg.trace`` (optional) turns on the
        timeline and the stall inspection of server replies; ``timeout`` bounds every call."""
        mode = modes.get(cfg.mode)
        if not cfg.update_on_server and not mode.trainer_optimizer:
            raise ValueError(
                f"a_sync_configs['update_on_server']=False needs sync mode (got {cfg.mode}): "
                "only then do the servers hold one averaged gradient per step"
            )
        if not 0 <= trainer < trainers:
            raise ValueError(f"trainer index {trainer} is not in [0, {trainers})")
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.trainer, self.trainers, self._mode_cls = trainer, trainers, mode
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.tables = [m for m in model.modules() if isinstance(m, SparseEmbedding)]
        self.step_no = 0
        self.recovery: Recovery | None = None
        self._restores = 0
        self.closed = False  # close() ran
        self.trace = None  # the timeline's PSObserver (Strategy.timeline)
        stall = None
        if cfg.trace is not None:
            self.trace = make_observer(cfg.trace, trainer, trainers, lambda: self.step_no)
            if cfg.trace.inspects_stalls:
                stall = ReplyWatch(
                    cfg.trace.stall_warning_seconds,
                    cfg.trace.stall_shutdown_seconds,
                    self.explain_wait,
                )
        self._explainer = StallExplainer(
            trainer, trainers, mode.sync, lambda: self.step_no,
            lambda server, question: self.client.waiting_for(server, question),
        )  # fmt: skip
        self.client = Client(endpoints, token, timeout=timeout, stall=stall, observer=self.trace)
        try:
            self._start()
        except BaseException:
            self.client.close()
            raise

    def _start(self) -> None:
        """Plan the blocks, initialise the servers, then start the mode."""
        cfg, client, mode = self.cfg, self.client, self._mode_cls
        self.sparse = SparseLookups(
            self.tables, client, self.trainer,
            version=lambda: self.step_no if mode.sync else 0,
            before=self.synchronize,
            training=lambda: self.model.training,
            waiting=self._waiting,
            recover=lambda exc: self._recover(exc, self.step_no - 1),
        )  # fmt: skip
        self.plan = make_plan(
            [(n, tuple(p.shape)) for n, p in self.params],
            len(client),
            cfg.min_block_size,
            max(cfg.min_block_size, client.max_bytes // 8 // 4),
        )
        self.dense = DenseParams(
            self.params, self.plan, client, self.optimizer, self.trainer, self._waiting
        )
        self.blocks = self.dense.blocks
        self._update = mode.update if cfg.update_on_server else "sum"
        self._opt_name, self._groups = "", []
        if self._update == "optimizer":
            self._opt_name, self._groups = describe_torch_optimizer(self.optimizer)
        ids = {id(p): g for g, grp in enumerate(self.optimizer.param_groups) for p in grp["params"]}
        self._group_of = {n: ids.get(id(p), 0) for n, p in self.params}
        self._init_servers()
        ctx = modes.ModeContext(
            cfg, self.dense, self.sparse, self.optimizer, self.trainers,
            lambda: self.step_no, self._waiting, self._local_step,
        )  # fmt: skip
        self.mode = mode(ctx)
        self.recovery = self._make_recovery()
        self.sparse.attach()
        # model.state_dict() (torch.save after the last step) waits for the pulls in flight
        self._state_hook = self.model.register_state_dict_pre_hook(self._before_state_dict)

    def _make_recovery(self) -> Recovery | None:
        """The replay log of a sync trainer whose servers checkpoint periodically (dense
        parameters and sparse tables)."""
        replayable = self.mode.recoverable and self._update == "optimizer"
        if self.cfg.recovery_window <= 0 or not replayable:
            return None
        ctx = RecoveryContext(
            self.trainer, self.client, self.dense, self.sparse, self.optimizer.param_groups,
            lambda: self.step_no, self._restart_at, lambda step, wait: self.restore(step, wait),
        )  # fmt: skip
        return Recovery(ctx, self.cfg.recovery_window)

    def _restart_at(self, step: int) -> None:
        self.step_no = step

    # ---- set-up -------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Everything that shapes this trainer's exchange with the servers: each server and
        every later trainer must agree (``longboat.ps.trainer.settings``)."""
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
            "k_steps": self.cfg.k_steps if self._mode_cls.uses_k_steps else 0,
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
                        values[b.key] = part(p.detach(), b)
            meta = {
                "trainer": self.trainer,
                "trainers": self.trainers,
                "sync": self._mode_cls.sync,
                "digest": self.plan.digest(),
                "blocks": specs,
                "tables": [t.spec() for t in self.tables],
            }
            msgs[s] = Message(meta, values)
        replies = self.client.call_all("init", msgs)
        step = max(int(r.meta.get("version", 0)) for r in replies.values())
        self.step_no, rejoined = self._join(step)
        if rejoined and self.step_no > 0:
            self._check_can_rejoin()
        if not rejoined or self.dense._barrier_gen == 0:  # else the others are past it
            self.dense.barrier()
        self.dense.pull(self.step_no)
        if self.trainer == 0:
            loads = ", ".join(str(n) for n in self.plan.loads())
            log.info(
                "parameter servers: %s mode, %s, plan %s (%s; elements per server %s)",
                self.cfg.mode,
                plural(self.trainers, "trainer"),
                self.plan.digest(),
                plural(len(self.plan.blocks), "block"),
                loads,
            )
            log.debug("sharding plan:\n%s", self.plan.describe())

    def _join(self, step: int) -> tuple[int, bool]:
        """Tell every server to expect this trainer from sync ``step`` on (or the latest step
        one of them has begun, asking again with that): (the step, whether this trainer had
        joined before, e.g. a restarted process)."""
        for _ in range(16):
            meta = {"trainer": self.trainer, "step": step}
            replies = self.client.call_all(
                "join", {s: Message(dict(meta)) for s in range(len(self.client))}
            )
            steps = {int(r.meta["step"]) for r in replies.values()}
            rejoined = any(bool(r.meta.get("rejoined")) for r in replies.values())
            if rejoined:  # the engine's barrier goes on from the others' generation
                self.dense._barrier_gen = max(int(r.meta["barrier"]) for r in replies.values())
            if steps == {step}:
                return step, rejoined
            step = max(steps)
        raise PSError(
            f"trainer {self.trainer} could not rejoin: the servers kept moving past the step it "
            f"asked for (last {step})"
        )

    def _check_can_rejoin(self) -> None:
        if self._update == "sum":
            raise PSError(
                f"trainer {self.trainer} cannot rejoin a running job with "
                "a_sync_configs['update_on_server']=False: the servers hold gradients, not the "
                "parameters it would resume from"
            )

    def rejoin(self) -> int:
        """After the servers dropped this trainer (silent longer than their trainer timeout):
        forget what is in flight, take part again from the servers' current step, pull the
        parameters and return that step (``step()`` does this by itself on a refusal)."""
        self._check_can_rejoin()
        self.dense.pending = {}
        self.sparse.clear()
        self.mode.abandon()
        pings = self.client.call_all("ping", {s: Message() for s in range(len(self.client))})
        self.step_no, _ = self._join(max(int(r.meta.get("step", 0)) for r in pings.values()))
        self.dense.pull(self.step_no)
        return self.step_no

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> None:
        """One optimizer step in the configured mode."""
        if self.trace is None:
            self._step()
            return
        with self.trace.step(self.cfg.mode):
            self._step()

    def _step(self) -> None:
        if self.recovery is not None:
            self.recovery.record()
        try:
            self.dense.synchronize()  # a failure here is recovered through this step too
            self.mode.step()
        except PSError as exc:
            self._failed(exc, self.step_no)  # ends at step_no + 1 or rejoined
            return
        self.step_no += 1

    def _failed(self, exc: PSError, step: int) -> None:
        """A call of ``step`` failed: a trainer the servers dropped rejoins; otherwise ride out
        a server restart (``_recover``), or raise."""
        if not (exc.code == "FAILED_PRECONDITION" and DROPPED in str(exc)):
            self._recover(exc, step)
            return
        log.warning(
            "trainer %d %s (silent too long; its step %d is discarded): it rejoins",
            self.trainer,
            DROPPED,
            step,
        )
        log.warning("trainer %d rejoined at step %d", self.trainer, self.rejoin())

    def _waiting(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """A wait of the training thread, on the timeline when it records."""
        return _NULL if self.trace is None else self.trace.wait(what)

    def _local_step(self) -> None:
        if self.trace is None:
            self.optimizer.step()
            return
        with self.trace.local_optimizer():
            self.optimizer.step()

    @property
    def _pending(self) -> dict[int, list[Call]]:
        """The parameter pulls in flight, per server."""
        return self.dense.pending

    def refresh(self) -> None:
        """Send everything queued, then load the servers' current parameters into the model
        (e.g. before evaluating an async job; in geo mode it discards unsent local steps)."""
        self.synchronize()
        self.mode.flush()
        self.dense.pull(0)

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for the parameter pulls still in flight and write them into the model (after a
        server restart, sync trainers with a replay log recover here: ``longboat.ps.trainer.recovery``)."""
        try:
            self.dense.synchronize()
        except PSError as exc:  # the pull may ride on the last push of the step before
            self._failed(exc, self.step_no - 1)

    def _recover(self, exc: PSError, through: int) -> None:
        """Ride out a server restart (``longboat.ps.trainer.recovery``): replay the logged steps up to
        ``through`` and end at step ``through + 1``; raise ``exc`` if this trainer cannot."""
        if self.recovery is None or not self.recovery.handles(exc):
            raise exc
        self.recovery.recover(exc, through)

    def explain_wait(self, call: Call, waited: float) -> str:
        """The stall warning for ``call``, unanswered after ``waited`` seconds
        (``longboat.trace.ps.StallExplainer``)."""
        return self._explainer.explain(call, waited)

    # ---- lazy tables ------------------------------------------------------------------------
    def shrink(self, tables: list[str] | None = None) -> dict[str, int]:
        """End a pass of the lazy ``tables`` (default: all) on every server (``lb.ps.shrink``;
        call it from one trainer, between steps); rows dropped per table. A sync trainer with
        a replay log keeps the call: a replay repeats it after the same step."""
        self.synchronize()
        self.sparse.wait(self.step_no if self._mode_cls.sync else 0)  # the last step applied
        dropped = table_admin.shrink_on(self.client, tables)
        if self.recovery is not None:
            self.recovery.shrunk(tables)
        return dropped

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
        self.dense.pending = {}
        self.sparse.clear()
        self.mode.abandon()
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
        self.dense.pull(step)
        return step

    def close(self) -> None:
        """Stop the background threads and close the connections (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.synchronize()
            self.mode.flush()
        finally:
            self.mode.close()
            self.sparse.detach()
            self._state_hook.remove()
            self.client.close()
            if self.trace is not None:
                self.trace.close()
            release(self)


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy,
    *,
    servers: Sequence[str] | None = None,
    trainer: int | None = None,
    trainers: int | None = None,
    token: str | None = None,
    timeout: float | None = None,
    **overrides: Any,
) -> tuple[PSModel[PSEngine], PSOptimizer[PSEngine]]:
    """Connect ``model`` and ``optimizer`` to the job's servers (``lb.distribute`` calls this for
    ``mode="ps"``). Servers and trainer ids come from the launcher's environment unless given;
    ``timeout`` bounds every call (default ``LONGBOAT_PS_TIMEOUT`` or 120 s); ``overrides`` set
    PSConfig fields (``overlap``, ``min_block_size``, ``bucket_bytes``, ``tune_buckets``, or
    ``mode``: a registered mode's name in place of the Strategy's, see ``longboat.ps.trainer.modes``)."""
    strategy.check_implemented()
    if optimizer is None:
        raise ValueError("parameter-server mode needs the optimizer: lb.distribute(model, opt, s)")
    admit(model, optimizer)
    if isinstance(model, PSModel):
        raise ValueError("this model was already passed to lb.distribute")
    cfg = PSConfig.from_strategy(strategy, **overrides)
    apply_recompute(model, cfg.recompute)
    apply_sparse_table_configs(model, strategy.sparse_table_configs)
    if servers is None or trainer is None or trainers is None:
        env_servers, env_trainer, env_trainers = cluster_from_env()
        servers = env_servers if servers is None else servers
        trainer = env_trainer if trainer is None else trainer
        trainers = env_trainers if trainers is None else trainers
    token = token or auth.load_token()
    engine = PSEngine(model, optimizer, cfg, servers, token, trainer, trainers, timeout)
    make_current(engine)
    return PSModel(model, engine), PSOptimizer(engine, optimizer)


def save() -> int:
    """``lb.ps.save()``: checkpoint every server (started with a checkpoint dir) at this step."""
    return current().save()
