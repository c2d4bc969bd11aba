"""Lightning's Trainer with LongboatStrategy: 2 spawned CPU ranks equal one process on the
global batch, for the default Strategy and non-default ones, with Lightning's own features
(gradient accumulation without extra allreduces, sync BN, clipping, checkpoints, hooks)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from tests._dist import run_ranks  # noqa: E402

WORLD, BATCH, STEPS, FEATURES = 2, 4, 4, 6
# name -> (longboat Strategy fields, Trainer arguments, batch norm in the model)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], bool]] = {
    "default": ({}, {}, False),
    "2 communicators, small buckets, accumulate 2": (
        {"nccl_comm_num": 2, "fuse_grad_size_in_MB": 0.0005},
        {"accumulate_grad_batches": 2},
        False,
    ),
    "ring, sync BN, clipping": (
        {"allreduce_algorithm": "ring"},
        {"sync_batchnorm": True, "gradient_clip_val": 0.05},
        True,
    ),
    "longboat amp float16": ({"amp": True, "amp_configs": {"dtype": "float16"}}, {}, False),
    "sharding stage 2, clipping": (
        {"sharding": True, "sharding_configs": {"stage": 2}},
        {"gradient_clip_val": 0.05},
        False,
    ),
}
POISONED = {"longboat amp float16": 1}  # case -> the step whose loss is made infinite
TOLERANCE = {"longboat amp float16": 2e-3}  # float16 autocast against the float32 reference


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    n = WORLD * BATCH * STEPS * 2  # enough for 2 micro-batches per step
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randn(n, 2, generator=g))


def _net(batch_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(16)] if batch_norm else []
    return nn.Sequential(nn.Linear(FEATURES, 16), *norm, nn.Tanh(), nn.Linear(16, 2))


class Regressor(pl.LightningModule):
    def __init__(self, batch_norm: bool, poisoned: int | None = None) -> None:
        super().__init__()
        self.net = _net(batch_norm)
        self.poisoned = poisoned  # this step's gradients overflow: the step must be skipped

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.trainer.global_step == self.poisoned:
            loss = loss * float("inf")
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Probe(pl.Callback):
    """What the strategy did: bytes sent per optimizer step, Lightning's collectives."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.incomplete: list[bool] = []  # a weight read NaN (not yet gathered) after the step

    def on_train_batch_end(self, trainer: Any, module: Any, *_: Any) -> None:
        self.sent.append(trainer.strategy.model.bytes_sent())
        self.incomplete.append(any(bool(p.isnan().any()) for p in module.parameters()))

    def on_train_end(self, trainer: Any, module: Any) -> None:
        strategy = trainer.strategy
        rank = trainer.global_rank
        self.reduced = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
        self.gathered = strategy.all_gather(torch.tensor([rank])).flatten().tolist()
        self.broadcast = strategy.broadcast(f"from {rank}", src=1)
        strategy.barrier()


def _trainer(strategy: Any, root: str, **kwargs: Any) -> Any:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


def _leftovers() -> tuple[int, int]:
    """This process's live threads and longboat's shared-memory segments on the machine."""
    from longboat.comm.shm_segment import NAME_PREFIX

    segments = [n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)]
    return threading.active_count(), len(segments)


def _fit_all(rank: int, _world: int, root: str) -> dict[str, Any]:
    import longboat as lb
    from longboat.integrations.lightning import LongboatStrategy

    results: dict[str, Any] = {"leftovers": []}
    for name, (fields, trainer_args, batch_norm) in CASES.items():
        module, probe = Regressor(batch_norm, POISONED.get(name)), Probe()
        trainer = _trainer(
            LongboatStrategy(lb.Strategy(**fields)), root, callbacks=[probe], **trainer_args
        )
        trainer.fit(module, DataLoader(_data(), batch_size=BATCH))
        path = Path(root, f"{name}.ckpt")
        trainer.save_checkpoint(path)  # written by rank 0, waited for by every rank
        results[name] = {
            "params": [p.detach().clone() for p in module.parameters()],
            "buffers": [b.clone() for b in module.buffers()],
            "sent": probe.sent,
            "incomplete": probe.incomplete,
            "reduced": probe.reduced,
            "gathered": probe.gathered,
            "broadcast": probe.broadcast,
            "checkpoint": path.exists(),
            "model_after": type(trainer.strategy.model).__name__,
            "plugin_after": sorted(vars(trainer.precision_plugin)),  # attributes, not methods
        }
        results["leftovers"].append(_leftovers())  # after fit and checkpoint
    named = _trainer("longboat", root)  # the registered name, the default Strategy
    results["registered"] = type(named.strategy).__name__
    return results


def _reference(name: str) -> dict:
    """One process on the global batch: the same optimizer, schedule, accumulation, clipping,
    and the poisoned step skipped."""
    _, trainer_args, batch_norm = CASES[name]
    net = _net(batch_norm)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    accumulate = trainer_args.get("accumulate_grad_batches", 1)
    clip = trainer_args.get("gradient_clip_val")
    data = _data()
    x, y = data.tensors
    # Lightning shuffles training data with DistributedSampler(seed=0): each global batch is
    # the union of the ranks' batches
    orders = [list(DistributedSampler(data, WORLD, r, shuffle=True, seed=0)) for r in range(WORLD)]
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulate):
            at = (step * accumulate + micro) * BATCH
            rows = torch.tensor([i for order in orders for i in order[at : at + BATCH]])
            loss = F.mse_loss(net(x[rows]), y[rows])
            (loss / accumulate).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        if step != POISONED.get(name):
            optimizer.step()
        scheduler.step()
    return {
        "params": [p.detach() for p in net.parameters()],
        "buffers": [b for b in net.buffers()],
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("lightning"))
    return run_ranks(_fit_all, WORLD, root, timeout=240, env={"PL_DISABLE_FORK": "1"})


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process_on_the_global_batch(ranks, name: str) -> None:
    expected = _reference(name)
    atol = TOLERANCE.get(name, 1e-6)
    for rank in ranks:
        got = rank[name]
        for e, g in zip(expected["params"], got["params"], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=atol)
        for e, g in zip(expected["buffers"], got["buffers"], strict=True):
            torch.testing.assert_close(g.to(e.dtype), e, rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"], strict=True):
        assert torch.equal(a, b)


def test_accumulation_skips_the_allreduce_of_accumulating_backwards(ranks) -> None:
    plain = ranks[0]["default"]["sent"]
    accumulated = ranks[0]["2 communicators, small buckets, accumulate 2"]["sent"]
    per_step = plain[0]
    assert per_step > 0 and plain == [per_step * (i + 1) for i in range(STEPS)]
    # 2 micro-batches per step: the first sends nothing, the second one step's gradients
    assert accumulated == [per_step * ((i + 1) // 2) for i in range(2 * STEPS)]


def test_lightning_collectives_checkpoint_and_teardown(ranks) -> None:
    for rank, result in enumerate(ranks):
        case = result["default"]
        assert case["reduced"] == 3.0
        assert case["gathered"] == [0, 1]
        assert case["broadcast"] == "from 1"
        assert case["checkpoint"]
        assert case["model_after"] == "Regressor"  # unwrapped after fit
        assert result["registered"] == "LongboatStrategy", rank


def test_each_fit_leaves_no_thread_or_shared_memory_behind(ranks) -> None:
    """Five fits in one process (lr_find then fit, sweeps, notebooks): longboat's workers
    stop and its segments unlink at each teardown, so the counts stay those of the first."""
    for result in ranks:
        first, *later = result["leftovers"]
        assert len(later) == len(CASES) - 1
        assert all(counts == first for counts in later), result["leftovers"]


def test_refusals_name_the_field_and_the_way() -> None:
    import longboat as lb
    from longboat.integrations.lightning import LongboatStrategy, check_precision

    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        LongboatStrategy(lb.Strategy(gradient_merge=True))
    with pytest.raises(ValueError, match="parameter"):
        LongboatStrategy(lb.Strategy(mode="ps"))

    class Mixed:
        precision = "16-mixed"

    with pytest.raises(ValueError, match="precision='32-true'"):
        check_precision(lb.Strategy(amp=True), Mixed())
    assert os.environ.get("LONGBOAT_BACKEND") in (None, "gloo")


def test_callbacks_read_complete_weights_after_a_sharded_step(ranks) -> None:
    """Lightning's callbacks (weight averaging, loggers) read the weights between the step and
    the next forward: under sharding they are all-gathered inside the step there."""
    for r in ranks:
        seen = r["sharding stage 2, clipping"]["incomplete"]
        assert len(seen) >= 3 and not any(seen), seen


def test_sharded_clipping_leaves_the_precision_plugin_as_given(ranks) -> None:
    """Stage 2 clips through a subclass of the plugin that serves during the fit, not by
    replacing methods of the plugin Lightning gave: after the fit it is as it was."""
    for r in ranks:
        for name in CASES:
            assert not {"clip_grad_by_norm", "clip_grad_by_value"} & set(r[name]["plugin_after"])
