"""``LongboatStrategy``: Lightning's ``Trainer`` running longboat's collective engine.

    import longboat.integrations.lightning  # registers the names "longboat" and "longboat_spawn"
    trainer = lightning.Trainer(strategy=LongboatStrategy(lb.Strategy(nccl_comm_num=2)), ...)

Lightning owns the loop, the launcher, the sampler, checkpoints and logging; longboat owns the
model wrapper and the optimizer stages (buckets, overlap, communicators, compression, AMP, sync
BN, local SGD, DGC), exactly as ``lb.distribute`` builds them. Needs ``pip install
'longboat[lightning]'``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

try:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import MPSAccelerator
    from lightning.pytorch.overrides.distributed import _sync_module_states
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "longboat.integrations.lightning needs Lightning: pip install 'longboat[lightning]' "
        f"(or pip install lightning); importing it failed: {exc}"
    ) from exc

import longboat.cluster as cluster
from longboat import session
from longboat.collective.model import DistributedModel
from longboat.collective.reducer import UNUSED_FIX, UnusedParametersError
from longboat.dispatch import distribute
from longboat.strategy import Strategy

__all__ = ["LongboatStrategy", "register"]

FULL_PRECISION = ("32-true", "32", 32)
DDP_OPTIONS = {  # DDP's module options -> the longboat Strategy fields that mean the same
    "find_unused_parameters": "find_unused_parameters",
    "bucket_cap_mb": "fuse_grad_size_in_MB",
}
UNUSED_FIX_LIGHTNING = (
    "Make every parameter that requires grad take part in the loss on every rank, freeze it "
    "(requires_grad_(False)) in the LightningModule, or pass "
    "LongboatStrategy(lb.Strategy(find_unused_parameters=True)) to reduce missing gradients "
    "as zeros."
)
_log = logging.getLogger("longboat")


class LongboatStrategy(DDPStrategy):
    """Lightning strategy that trains with ``lb.distribute``'s model and optimizer.

    Takes ``DDPStrategy``'s arguments as they are (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, by position or keyword;
    ``process_group_backend``, ``timeout``, ``start_method``), so that replacing the class
    name is enough. The longboat Strategy is ``strategy=``, or the first argument when it is
    one (default: the one ``lb.init`` was given, else ``Strategy()``). Of DDP's module options,
    ``find_unused_parameters`` and ``bucket_cap_mb`` set the longboat Strategy's
    ``find_unused_parameters`` and ``fuse_grad_size_in_MB``; DDP's communication hooks and
    model averaging are refused (longboat reduces the gradients: use the Strategy's fields).
    The process group is Lightning's, bounded by longboat's job timeout (``LONGBOAT_TIMEOUT``,
    300 s) unless ``timeout`` says otherwise, on ``process_group_backend``, else
    ``LONGBOAT_BACKEND`` when set. Refused on MPS, like every strategy of the DDP family.

    Lightning's features map onto longboat's: ``accumulate_grad_batches`` skips the
    allreduce of the accumulating backwards (``no_sync``), ``sync_batchnorm=True`` is
    longboat's sync BN, ``precision="16-mixed"``/``"bf16-mixed"`` is Lightning's AMP (or
    ``Strategy(amp=True)`` with ``precision="32-true"``, longboat's; not both).
    """

    strategy_name = "longboat"

    def __init__(self, *args: Any, strategy: Strategy | None = None, **kwargs: Any) -> None:
        if args and isinstance(args[0], Strategy):  # LongboatStrategy(lb.Strategy(...), ...)
            if strategy is not None:
                raise TypeError("LongboatStrategy got two longboat Strategies: pass one")
            strategy, args = args[0], args[1:]
        ddp = ddp_arguments(args, kwargs)
        refuse_mps(ddp["accelerator"])
        super().__init__(
            accelerator=ddp["accelerator"],
            parallel_devices=ddp["parallel_devices"],
            cluster_environment=ddp["cluster_environment"],
            checkpoint_io=ddp["checkpoint_io"],
            precision_plugin=ddp["precision_plugin"],
            process_group_backend=ddp["process_group_backend"]
            or os.environ.get("LONGBOAT_BACKEND")
            or None,
            timeout=ddp["timeout"] or cluster.job_timeout(),
            start_method=ddp["start_method"],
        )
        if strategy is not None:
            admit_strategy(strategy)
        self._longboat = strategy
        self._ddp_fields = ddp_fields(ddp["kwargs"])
        self._plain_precision: Precision | None = None  # while sliced_clipping's copy serves

    @property  # type: ignore[override]
    def accelerator(self) -> pl.accelerators.Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: pl.accelerators.Accelerator | None) -> None:
        refuse_mps(accelerator)  # Trainer(accelerator="mps", strategy="longboat") lands here
        self._accelerator = accelerator

    @property
    def longboat_strategy(self) -> Strategy:
        """The longboat Strategy this run trains with (with DDP's module options applied)."""
        strategy = self._longboat or cluster.current_strategy() or Strategy()
        if not self._ddp_fields:
            return strategy
        strategy = strategy.copy()
        for name, value in self._ddp_fields.items():
            setattr(strategy, name, value)
        return strategy

    # -- the process group: Lightning's, adopted by longboat ---------------------------------

    def setup_distributed(self) -> None:
        super().setup_distributed()
        if dist.is_initialized():  # else init_process_group was replaced (a test's mock)
            session.init(self.longboat_strategy)  # adopts the group Lightning just created

    # -- model and optimizer -------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        strategy = admit_strategy(self.longboat_strategy)
        check_precision(strategy, self.precision_plugin)
        if fitting and self._layer_sync is not None:  # Trainer(sync_batchnorm=True)
            strategy = strategy.copy()  # longboat's sync BN in place of torch's (CUDA-only)
            strategy.sync_batch_norm = True
        if strategy.sharding and strategy.sharding_configs["comm_overlap"]:
            # Lightning's callbacks (weight averaging, loggers) read the weights between the
            # step and the next forward: the all-gather completes them inside the step
            _log.info(
                "LongboatStrategy: sharding's comm_overlap turned off: Lightning's callbacks "
                "read the weights right after the step, so the all-gather completes inside it"
            )
            strategy = strategy.copy()
            strategy.sharding_configs = {**strategy.sharding_configs, "comm_overlap": False}
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self._distribute(strategy)
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def _distribute(self, strategy: Strategy) -> None:
        if len(self.optimizers) > 1:
            raise ValueError(
                f"LongboatStrategy trains with one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}. Put their parameters in one optimizer's param groups "
                "(each group keeps its own hyper-parameters)."
            )
        optimizer = self.optimizers[0] if self.optimizers else None
        model, wrapped = distribute(self.model, optimizer, strategy)
        self.model = model
        sharding = model.plan.sharding if model.plan is not None else None
        if sharding is not None and sharding.stage >= 2:  # clipping must reach the slices
            self._plain_precision = self.precision_plugin
            self.precision_plugin = sliced_clipping(self.precision_plugin, model)
        if wrapped is not None:
            if getattr(wrapped, "inner", optimizer) is not optimizer:  # LARS/LAMB swapped in
                for config in self.lr_scheduler_configs:
                    if getattr(config.scheduler, "optimizer", None) is optimizer:
                        config.scheduler.optimizer = wrapped
            self.optimizers = [wrapped]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with lightning_hints():
            return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with lightning_hints():
            return super().backward(closure_loss, *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: no allreduce until the last micro-batch."""
        if isinstance(self.model, DistributedModel):
            with self.model.no_sync():
                yield
        else:
            yield

    def teardown(self) -> None:
        if isinstance(self.model, DistributedModel):
            self.model = self.lightning_module
        if self._plain_precision is not None:  # the next fit starts from the plugin as given
            self.precision_plugin, self._plain_precision = self._plain_precision, None
        super().teardown()
        cluster.shutdown()  # longboat's state; the process group stays Lightning's

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("longboat", "popen"), ("longboat_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"longboat's collective engine, start_method {start_method!r}",
                    start_method=start_method,
                )


def ddp_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``args`` and ``kwargs`` bound to ``DDPStrategy``'s signature (its TypeErrors), with the
    defaults filled in; ``kwargs`` holds DDP's module options."""
    signature = inspect.signature(DDPStrategy.__init__)
    bound = signature.bind(None, *args, **kwargs)
    given = set(bound.arguments)
    bound.apply_defaults()
    ddp = dict(bound.arguments)
    ddp.pop(next(iter(signature.parameters)))  # self
    for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"):
        if ddp[name] is not None:
            raise ValueError(
                f"LongboatStrategy({name}=...): longboat reduces the gradients itself, so "
                "DDP's communication hooks and model averaging do not apply; use the longboat "
                "Strategy's fields (gradient_compression, localsgd), or keep DDPStrategy with "
                "ddp_comm_hook=lb.ddp_comm_hook(...)"
            )
    if "timeout" not in given:  # longboat's job timeout, not DDP's 30 minutes
        ddp["timeout"] = None
    return ddp


def ddp_fields(options: dict[str, Any]) -> dict[str, Any]:
    """DDP's module options as the longboat Strategy fields they mean; others refused."""
    fields = {}
    for name, value in options.items():
        if name not in DDP_OPTIONS:
            raise TypeError(
                f"LongboatStrategy({name}=...): not a DDPStrategy argument longboat maps. "
                f"Of DDP's module options it takes {', '.join(DDP_OPTIONS)}; set the rest on "
                "the longboat Strategy: LongboatStrategy(lb.Strategy(...))"
            )
        fields[DDP_OPTIONS[name]] = value
    return fields


def refuse_mps(accelerator: Any) -> None:
    """Lightning refuses DDP-family strategies on MPS by "ddp" in their name: this one too."""
    if isinstance(accelerator, MPSAccelerator):
        raise ValueError(
            "You set strategy='longboat' (LongboatStrategy) but strategies from the DDP family "
            "are not supported on the MPS accelerator. Either explicitly set "
            "accelerator='cpu' or change the strategy."
        )


@contextlib.contextmanager
def lightning_hints() -> Generator[None, None, None]:
    """Errors whose fix is written for ``lb.distribute``'s caller, reworded for Lightning's."""
    try:
        yield
    except UnusedParametersError as exc:
        exc.args = (str(exc).replace(UNUSED_FIX, UNUSED_FIX_LIGHTNING),)
        raise


def admit_strategy(strategy: Strategy) -> Strategy:
    """``strategy`` if Lightning can run it, else a ValueError naming the field and the way."""
    strategy.check()
    if strategy.mode != "collective":
        raise ValueError(
            f"LongboatStrategy runs collective training; this Strategy is in {strategy.mode!r} "
            "mode (parameter server). Train parameter-server jobs with lb.distribute in your "
            "own loop, or use Strategy(mode='collective')."
        )
    if strategy.gradient_merge:
        raise ValueError(
            "Strategy(gradient_merge=True) under Lightning: use "
            "Trainer(accumulate_grad_batches=k) instead (longboat skips the allreduce of the "
            "accumulating backwards, as gradient merge does)."
        )
    if strategy.sharding and strategy.sharding_configs["stage"] == 3:
        raise ValueError(
            "LongboatStrategy does not run sharding stage 3 (Lightning's hooks and callbacks "
            "read whole parameters): use sharding_configs['stage'] 1 or 2, or Lightning's "
            "FSDPStrategy"
        )
    return strategy


def check_precision(strategy: Strategy, plugin: Any) -> None:
    """Refuse two mixed-precision systems at once (two autocasts, two loss scalers)."""
    precision = getattr(plugin, "precision", "32-true")
    if strategy.amp and precision not in FULL_PRECISION:
        raise ValueError(
            f"Strategy(amp=True) and Trainer(precision={precision!r}) both do mixed precision. "
            "Keep one: Trainer(precision='32-true') with longboat's AMP, or Strategy(amp=False) "
            "with Lightning's."
        )


class SlicedClipping:
    """Clipping for a precision plugin under sharding stage 2, where each rank holds a slice of
    the gradients and ``param.grad`` is None (torch's clipping would clip nothing): by norm
    through ``model.clip_grad_norm_`` (the norm over every rank's slices); by value refused.
    Mixed into the plugin's own class by `sliced_clipping`, as Lightning's precision plugins
    are extended (``FSDPPrecision`` overrides the same two methods)."""

    model: DistributedModel

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float | int) -> None:
        self.model.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float | int) -> None:
        raise ValueError(
            "gradient_clip_algorithm='value' with sharding stage 2: each rank holds a slice of "
            "the gradients; clip by norm (the default algorithm), or use sharding stage 1"
        )


def sliced_clipping(plugin: Precision, model: DistributedModel) -> Precision:
    """A copy of ``plugin`` (the same settings and loss scaler) whose class is its own with
    `SlicedClipping` first: the strategy serves it in place of ``plugin`` while ``model``
    trains, and everything but clipping behaves as ``plugin`` does. ``plugin`` is unchanged."""
    kind = type(plugin)
    sliced = type(f"Sliced{kind.__name__}", (SlicedClipping, kind), {})
    copy = sliced.__new__(sliced)
    copy.__dict__.update(vars(plugin))
    copy.model = model
    return copy


def register(registry: Any = StrategyRegistry) -> None:
    """Make ``Trainer(strategy="longboat")`` (and ``"longboat_spawn"``) name this strategy."""
    LongboatStrategy.register_strategies(registry)


register()
