"""StagedOptimizer: the one wrapper lb.distribute returns around the user's optimizer.

Stage order, torch's optimizer contract (LR schedulers, state_dict, zero_grad, param groups,
hooks), the gradient-merge gate, and the refusal to wrap an optimizer twice.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn

import longboat as lb
from longboat.collective.model import DistributedModel
from longboat.collective.optimizer import MergeGate
from longboat.optim import Stage, StagedOptimizer, StageKind
from longboat.optim.staged import StepRest, ZeroGradRest
from longboat.trace import current_observer
from longboat.trace.observer import RecordStep


class Recording(Stage):
    """Logs when it enters and leaves the step and zero_grad; `recording` sets its kind."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        self.log.append(f"+{self.kind.name}")
        result = rest(closure, **kwargs)
        self.log.append(f"-{self.kind.name}")
        return result

    def zero_grad(self, rest: ZeroGradRest, set_to_none: bool) -> None:
        self.log.append(f"zero {self.kind.name}")
        rest(set_to_none)


def recording(kind: StageKind, log: list[str]) -> Stage:
    """A `Recording` stage of ``kind``."""
    return type(f"Recording{kind.name}", (Recording,), {"kind": kind})(log)


class Boundary:
    """Stands in for a DistributedModel: a merge boundary every ``k`` calls of ``tick``."""

    def __init__(self, k: int) -> None:
        self.k, self.micro = k, 0

    def tick(self) -> None:
        self.micro += 1

    def is_merge_boundary(self) -> bool:
        return self.micro % self.k == 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _backward(model: nn.Module) -> None:
    model(torch.ones(2, 4)).sum().backward()


def _sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _logged_inner(model: nn.Module, log: list[str]) -> torch.optim.SGD:
    inner = _sgd(model)
    inner.register_step_pre_hook(lambda *_: log.append("inner"))
    return inner


@pytest.fixture
def single():
    lb.init()
    yield
    lb.shutdown()


def test_stages_run_in_stage_kind_order_whatever_order_they_were_added_in() -> None:
    kinds = list(StageKind)
    expected_step = [f"+{k.name}" for k in kinds] + ["inner"] + [f"-{k.name}" for k in kinds[::-1]]
    orders = [kinds[::-1], *itertools.islice(itertools.permutations(kinds), 0, None, 97)]
    for order in orders:
        log: list[str] = []
        model = _model()
        opt = StagedOptimizer(_logged_inner(model, log), [recording(k, log) for k in order[:2]])
        for k in order[2:]:
            opt.set_stage(recording(k, log))
        assert [s.kind for s in opt.stages] == kinds
        _backward(model)
        opt.step()
        assert log == expected_step
        log.clear()
        opt.zero_grad()
        assert log == [f"zero {k.name}" for k in kinds]


def test_set_stage_replaces_its_kind_and_remove_stage_drops_it() -> None:
    log: list[str] = []
    opt = StagedOptimizer(_sgd(_model()), [recording(StageKind.TIMELINE, log)])
    newer = recording(StageKind.TIMELINE, log)
    opt.set_stage(newer)
    assert opt.stages == (newer,) and opt.stage(StageKind.TIMELINE) is newer
    opt.remove_stage(StageKind.TIMELINE)
    opt.remove_stage(StageKind.TIMELINE)  # none left: nothing to do
    assert opt.stages == () and opt.stage(StageKind.TIMELINE) is None


def test_it_is_a_torch_optimizer_sharing_the_inner_state() -> None:
    model = _model()
    inner = _sgd(model)
    opt = StagedOptimizer(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state and opt.defaults is inner.defaults
    extra = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert inner.param_groups[-1]["params"] == [extra] and inner.param_groups[-1]["lr"] == 0.5
    _backward(model)
    opt.step()
    assert all("momentum_buffer" in inner.state[p] for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("StepLR", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)),
        ("OneCycleLR", lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10)),
        ("LambdaLR", lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda n: 1 / (n + 1))),
    ],
)
def test_lr_schedulers_drive_the_inner_learning_rate(
    name: str, make: Callable[[torch.optim.Optimizer], Any]
) -> None:
    model = _model()
    inner, twin = _sgd(model), _sgd(_model())
    opt = StagedOptimizer(inner)
    scheduler, reference = make(opt), make(twin)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            _backward(model)
            opt.step()
            twin.step()
            scheduler.step()
            reference.step()
    assert inner.param_groups[0]["lr"] == twin.param_groups[0]["lr"], name
    assert inner.param_groups[0]["lr"] != 0.1, name
    assert scheduler.get_last_lr() == reference.get_last_lr()
    if name == "OneCycleLR":  # it cycles the momentum too, read through defaults
        assert inner.param_groups[0]["momentum"] == twin.param_groups[0]["momentum"] != 0.9


def test_state_dict_round_trips_with_a_plain_optimizer_of_the_same_class() -> None:
    model = _model()
    opt = StagedOptimizer(_sgd(model))
    for _ in range(2):
        _backward(model)
        opt.step()
    saved = opt.state_dict()
    plain = _sgd(model, lr=0.7)
    plain.load_state_dict(saved)
    for key in ("state", "param_groups"):
        assert str(plain.state_dict()[key]) == str(saved[key])
    again = StagedOptimizer(_sgd(model, lr=0.3))
    again.load_state_dict(plain.state_dict())
    assert again.param_groups[0]["lr"] == 0.1
    assert str(again.state_dict()) == str(opt.state_dict()) == str(opt.inner.state_dict())


def test_zero_grad_set_to_none_or_zeros() -> None:
    model = _model()
    opt = StagedOptimizer(_sgd(model))
    _backward(model)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    _backward(model)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    _backward(model)
    opt.zero_grad()  # torch's default: None
    assert all(p.grad is None for p in model.parameters())


def test_merge_gate_skips_step_and_zero_grad_between_boundaries() -> None:
    model, boundary = _model(), Boundary(k=3)
    opt = StagedOptimizer(_sgd(model), [MergeGate(cast(DistributedModel, boundary))])
    start = [p.detach().clone() for p in model.parameters()]
    grads = []
    for _ in range(2):
        boundary.tick()
        opt.zero_grad(set_to_none=False)
        _backward(model)
        assert opt.step() is None
        grads.append(model[0].weight.grad.clone())
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    torch.testing.assert_close(grads[1], 2 * grads[0])  # zero_grad skipped: accumulating
    boundary.tick()  # the third micro step is a boundary
    opt.step()
    assert not torch.equal(model[0].weight, start[0])
    opt.zero_grad(set_to_none=False)
    assert not model[0].weight.grad.any()


def test_step_keywords_reach_the_stages_and_what_is_left_the_inner() -> None:
    class TakesLoss(Stage):
        kind = StageKind.LOCAL_SGD

        def __init__(self) -> None:
            self.seen: list[Any] = []

        def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
            self.seen.append(kwargs.pop("loss"))
            return rest(closure, **kwargs)

    model = _model()
    stage = TakesLoss()
    opt = StagedOptimizer(_sgd(model), [stage])
    _backward(model)
    assert opt.step(lambda: 2.5, loss=1.5) == 2.5  # the closure's result comes back
    assert stage.seen == [1.5]
    with pytest.raises(TypeError):
        opt.step(loss=1.0, unknown=True)  # SGD.step takes no such keyword


def test_step_hooks_registered_on_the_wrapper_run_around_the_inner_step() -> None:
    model, boundary = _model(), Boundary(k=2)
    opt = StagedOptimizer(_sgd(model), [MergeGate(cast(DistributedModel, boundary))])
    calls: list[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(boundary.micro))
    for _ in range(4):
        boundary.tick()
        _backward(model)
        opt.step()
    assert calls == [2, 4]  # only the steps that happened


def test_wrapping_twice_is_refused() -> None:
    inner = _sgd(_model())
    opt = StagedOptimizer(inner)
    for again in (inner, opt):
        with pytest.raises(ValueError, match="already passed to lb.distribute"):
            StagedOptimizer(again)


def test_lb_distribute_returns_the_wrapper_and_refuses_it_back(single) -> None:
    model = _model()
    inner = _sgd(model)
    strategy = lb.Strategy(gradient_merge=True)
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    wrapped, opt = lb.distribute(model, inner, strategy)
    assert isinstance(opt, StagedOptimizer) and opt.inner is inner
    assert [s.kind for s in opt.stages] == [StageKind.GRADIENT_MERGE]
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        wrapped(torch.ones(2, 4)).sum().backward()
        opt.step()
        scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.025)
    for again in (opt, inner):  # the same model, or another one (the ownership check's words)
        for target in (model, _model()):
            with pytest.raises(ValueError, match="already passed to lb.distribute"):
                lb.distribute(target, again, lb.Strategy())


def test_attach_gives_the_timeline_stage_and_attaching_again_replaces_it(single, tmp_path) -> None:
    strategy = lb.Strategy(timeline=str(tmp_path / "trace.json"))
    model = _model()
    wrapped, opt = lb.distribute(model, _sgd(model), strategy)
    first = opt.stage(StageKind.TIMELINE)
    assert isinstance(first, RecordStep) and first.observer is current_observer()
    lb.trace.attach(wrapped, opt, strategy)  # as an elastic rebuild does for the new world
    second = opt.stage(StageKind.TIMELINE)
    assert isinstance(second, RecordStep) and second is not first
    assert second.observer is current_observer() and opt.stages == (second,)


def _closure_run(strategy: lb.Strategy, use_closure: bool, overflow_at: int = -1) -> list[Any]:
    model = _model()
    wrapped, opt = lb.distribute(model, _sgd(model), strategy)
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    for i in range(6):

        def closure(i: int = i) -> torch.Tensor:
            opt.zero_grad()
            loss = wrapped(x * (1 + i)).sum()
            (loss * (float("inf") if i == overflow_at else 1.0)).backward()
            return loss

        if use_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "fields",
    [
        {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": True}},
        {"amp": True, "amp_configs": {"dtype": "float16", "init_loss_scaling": 8.0}},
    ],
    ids=["gradient merge", "amp float16 overflow"],
)
def test_a_closure_step_equals_backward_then_step(single, fields) -> None:
    """Stages that decide from the step's gradients (merge gate, loss scaling) see the
    closure's backward, not the previous step's (Lightning always steps with a closure)."""
    overflow = 2 if fields.get("amp") else -1
    expected = _closure_run(lb.Strategy(**fields), use_closure=False, overflow_at=overflow)
    got = _closure_run(lb.Strategy(**fields), use_closure=True, overflow_at=overflow)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_an_inner_that_calls_the_closure_again_evaluates_it_again() -> None:
    model, boundary = _model(), Boundary(k=1)
    calls: list[int] = []

    def closure() -> torch.Tensor:
        calls.append(1)
        boundary.tick()
        model.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).sum()
        loss.backward()
        return loss

    lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=3)
    opt = StagedOptimizer(lbfgs, [MergeGate(cast(DistributedModel, boundary))])
    first = opt.step(closure)
    assert isinstance(first, torch.Tensor)
    assert len(calls) > 1  # once before the stages, then LBFGS's own re-evaluations
