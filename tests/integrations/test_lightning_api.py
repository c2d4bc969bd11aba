"""LongboatStrategy as a drop-in for DDPStrategy, in this process: DDPStrategy's signature,
MPS refused by name, an init_process_group that fails (or is mocked) keeps its error, and
the unused-parameter error names the fix a Lightning user can write."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import lightning.fabric.accelerators.mps as fabric_mps  # noqa: E402
from lightning.pytorch.accelerators import CPUAccelerator, MPSAccelerator  # noqa: E402
from lightning.pytorch.plugins import Precision  # noqa: E402
from lightning.pytorch.plugins.environments import LightningEnvironment  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

import longboat as lb  # noqa: E402
import longboat.cluster as cluster  # noqa: E402
from longboat.integrations.lightning import LongboatStrategy, sliced_clipping  # noqa: E402

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def alone() -> Iterator[None]:
    """One process without launcher variables; no process group or longboat state after."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name in LAUNCHER or name.startswith(("LONGBOAT_", "PL_", "SLURM_", "OMPI_")):
            del os.environ[name]
    try:
        yield
    finally:
        cluster.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def test_ddp_strategy_arguments_by_position_and_keyword() -> None:
    accelerator, devices = CPUAccelerator(), [torch.device("cpu")] * 2
    environment, io, precision = LightningEnvironment(), TorchCheckpointIO(), Precision()
    by_position = LongboatStrategy(accelerator, devices, environment, io, precision)
    by_keyword = LongboatStrategy(
        accelerator=accelerator,
        parallel_devices=devices,
        cluster_environment=environment,
        checkpoint_io=io,
        precision_plugin=precision,
    )
    for strategy in (by_position, by_keyword):
        assert strategy.accelerator is accelerator
        assert strategy.parallel_devices == devices
        assert strategy.cluster_environment is environment
        assert strategy.checkpoint_io is io
        assert strategy.precision_plugin is precision
        assert strategy.longboat_strategy == lb.Strategy()
    # the longboat Strategy first (told apart by its type), or by keyword
    chosen = lb.Strategy(nccl_comm_num=2)
    first = LongboatStrategy(chosen, accelerator)
    named = LongboatStrategy(accelerator, strategy=chosen, timeout=timedelta(minutes=30))
    for strategy in (first, named):
        assert strategy.longboat_strategy is chosen and strategy.accelerator is accelerator
    assert first._timeout == cluster.job_timeout()  # longboat's, not DDP's 30 minutes
    assert named._timeout == timedelta(minutes=30)  # asked for
    # DDP's module options mean the longboat Strategy's fields
    unused = LongboatStrategy(chosen, find_unused_parameters=True, bucket_cap_mb=1)
    assert unused.longboat_strategy.find_unused_parameters
    assert unused.longboat_strategy.fuse_grad_size_in_MB == 1
    assert not chosen.find_unused_parameters  # the given Strategy is left as it was
    # a Trainer takes it as it takes DDPStrategy(accelerator)
    trainer = pl.Trainer(strategy=LongboatStrategy(CPUAccelerator()), devices=1, logger=False)
    assert isinstance(trainer.strategy.accelerator, CPUAccelerator)


def test_what_longboat_does_not_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ddp_comm_hook.*gradient_compression"):
        LongboatStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(TypeError, match=r"static_graph.*lb\.Strategy"):
        LongboatStrategy(static_graph=True)
    with pytest.raises(TypeError, match="two longboat Strategies"):
        LongboatStrategy(lb.Strategy(), strategy=lb.Strategy())


def test_mps_is_refused_by_name_as_every_ddp_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fabric_mps, "_get_all_available_mps_gpus", lambda: [0])
    for accelerator in (fabric_mps.MPSAccelerator, MPSAccelerator):
        monkeypatch.setattr(accelerator, "is_available", staticmethod(lambda: True))
    for name in ("longboat", "longboat_spawn"):
        with pytest.raises(ValueError, match="DDP family are not supported on the MPS"):
            pl.Trainer(accelerator="mps", strategy=name, devices=1)
    with pytest.raises(ValueError, match="accelerator='cpu'"):
        LongboatStrategy(MPSAccelerator())


def test_a_mocked_init_process_group_keeps_its_error(alone: None) -> None:
    with mock.patch("torch.distributed.init_process_group") as init:
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            lb.init()
        assert init.call_count == 1
        # under Lightning, its own (mocked) call is the one made: nothing to adopt yet
        trainer = pl.Trainer(
            strategy=LongboatStrategy(timeout=timedelta(seconds=30)),
            accelerator="cpu",
            devices=1,
            logger=False,
        )
        trainer.strategy.connect(_Unused())
        trainer.strategy.setup_environment()
        assert init.call_args.kwargs["timeout"] == timedelta(seconds=30)
        assert not cluster.is_initialized()


class _Unused(pl.LightningModule):
    """A layer that never takes part in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        return self.used(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_unused_parameter_error_names_the_lightning_fix(alone: None) -> None:
    trainer = pl.Trainer(
        strategy=LongboatStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4)
    with pytest.raises(RuntimeError, match="unused.weight") as error:
        trainer.fit(_Unused(), data)
    message = str(error.value)
    assert "LongboatStrategy(lb.Strategy(find_unused_parameters=True))" in message
    assert "lb.distribute" not in message


def test_sliced_clipping_serves_a_subclass_of_the_plugin_and_leaves_it_alone() -> None:
    plugin, norms = Precision(), []
    model = mock.Mock(clip_grad_norm_=norms.append)
    sliced = sliced_clipping(plugin, model)
    sliced.clip_gradients(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), 0.5)
    assert norms == [0.5] and isinstance(sliced, Precision)
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value' with sharding stage 2"):
        sliced.clip_grad_by_value(None, 1.0)
    assert type(plugin) is Precision and not {"clip_grad_by_norm", "model"} & set(vars(plugin))
