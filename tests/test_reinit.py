"""lb.shutdown forgets every per-process state, so init -> train -> shutdown runs again cleanly.

One process, a 1-rank Gloo world: each round trains with the timeline on and must match a plain
single-process run; after shutdown every accessor reports that nothing is current.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import longboat as lb
import longboat.cluster as lc
import longboat.horovod.torch as hvd
from longboat.cluster import runtime
from longboat.collective.optimizer import MergeGate
from longboat.horovod.torch import ops
from longboat.optim import StageKind
from longboat.trace import collective_watch, current_observer
from longboat.trace.config import TraceConfig
from longboat.trace.stall import watch_collectives

LAUNCHER_PREFIXES = ("PADDLE_", "HOROVOD_", "SLURM_", "OMPI_", "PMIX_", "LONGBOAT_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
STEPS = 2


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variables in os.environ, and no longboat state before or after."""
    for name in list(os.environ):
        if name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    lc.shutdown()
    yield monkeypatch
    hvd.shutdown()
    lc.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _reference() -> list[torch.Tensor]:
    model = _model()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _batches())
    return [p.detach().clone() for p in model.parameters()]


def _assert_nothing_current() -> None:
    assert not lc.is_initialized() and not dist.is_initialized()
    assert lc.current_strategy() is None
    assert current_observer() is None
    assert collective_watch() is None
    assert not hvd.is_initialized()
    assert runtime._shutdown_hooks == []


def test_train_shutdown_init_train_again(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    expected = _reference()
    for round_ in range(2):
        timeline = tmp_path / f"round{round_}.json"
        strategy = lb.Strategy(timeline=str(timeline))
        info = lb.init(strategy)
        assert (info.world_size, info.backend) == (1, "gloo")
        assert lc.current_strategy() is strategy
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        wrapped, traced = lb.distribute(model, opt, strategy)
        assert traced.inner is opt and traced.stage(StageKind.TIMELINE) is not None
        observer = current_observer()
        assert observer is not None and observer is wrapped.reducer.observer
        _train(wrapped, traced, list(lb.trace.data(_batches())))
        for got, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want)
        lb.shutdown()
        _assert_nothing_current()
        assert timeline.exists(), "the timeline is finished at shutdown"
        assert observer.recorder is not None and observer.recorder.save() is None  # saved
        assert {e["name"] for e in lb.trace.load(timeline)} >= {"forward", "optimizer step"}


def test_gradient_merge_gate_is_staged_once(clean_env: pytest.MonkeyPatch) -> None:
    lb.init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = lb.Strategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    wrapped, staged = lb.distribute(model, opt, strategy)
    gate = staged.stage(StageKind.GRADIENT_MERGE)
    assert staged.inner is opt and isinstance(gate, MergeGate) and gate.model is wrapped
    with pytest.raises(ValueError, match="already passed"):
        lb.distribute(_model(), opt, strategy)
    lb.shutdown()
    _assert_nothing_current()


def test_collective_watch_is_stopped_by_shutdown(clean_env: pytest.MonkeyPatch) -> None:
    lb.init()
    with clean_env.context() as patch:  # a world of two as far as the watch is concerned
        patch.setattr(dist, "get_world_size", lambda group=None: 2)
        watch = watch_collectives(TraceConfig.of(lb.Strategy(stall_warning_seconds=30)))
    assert watch is not None and collective_watch() is watch
    lb.shutdown()
    _assert_nothing_current()
    assert not watch._thread.is_alive()


def test_horovod_init_allreduce_shutdown_init_again(clean_env: pytest.MonkeyPatch) -> None:
    x = torch.arange(4.0)
    seen: list[int] = []
    for stop in (lb.shutdown, hvd.shutdown):
        hvd.init()
        assert hvd.is_initialized() and hvd.size() == 1
        handle = hvd.allreduce_async(x, name="x")
        assert handle not in seen, "an old session's handle never names a new op"
        seen.append(handle)
        torch.testing.assert_close(hvd.synchronize(handle), x)
        torch.testing.assert_close(hvd.allreduce(x, op=hvd.Sum), x)
        stop()
        assert not hvd.is_initialized() and ops._handles == {}
        with pytest.raises(ValueError, match="hvd.init"):
            hvd.allreduce(x)
    lb.shutdown()
    _assert_nothing_current()


LEAK_PROBE = """
import os
import longboat as lb

def gloo_threads():
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sum(name.startswith("pt_gloo") for name in names)

lb.init(backend="gloo")
import torch.distributed.fsdp  # as lb.distribute at stage 3 does, after the group exists
assert gloo_threads() > 0
lb.shutdown()
print("gloo threads after shutdown:", gloo_threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_shutdown_frees_the_world_group_and_its_threads(clean_env: pytest.MonkeyPatch) -> None:
    """Nothing keeps the group alive after lb.shutdown (torch.distributed.nn's functions take
    the world group as a default when first imported after it exists): a leaked group's Gloo
    threads run into interpreter exit and may abort it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_NAMES}
    run = subprocess.run(
        [sys.executable, "-c", LEAK_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "gloo threads after shutdown: 0" in run.stdout, run.stdout
