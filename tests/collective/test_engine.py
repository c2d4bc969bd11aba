"""lb.distribute in one process: Strategy mappings, refusals and gradient-merge gating."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import longboat as lb
from longboat.collective.model import DistributedModel


@pytest.fixture
def single():
    lb.init()
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    lb.shutdown()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_num_threads_applied_only_when_set(single):
    before = torch.get_num_threads()
    model = _model()
    lb.distribute(model, None, lb.Strategy())
    assert torch.get_num_threads() == before
    lb.distribute(_model(), None, lb.Strategy(num_threads=3))
    assert torch.get_num_threads() == 3


def test_fuse_all_optimizer_ops_turns_on_foreach(single):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = lb.Strategy()
    strategy.build_strategy = {"fuse_all_optimizer_ops": True}
    _, opt = lb.distribute(model, opt, strategy)
    assert all(g["foreach"] is True for g in opt.param_groups)


def test_op_fusion_fields_compile_the_model(single):
    strategy = lb.Strategy(fuse_bn_act_ops=True)
    wrapped, _ = lb.distribute(_model(), None, strategy)
    assert isinstance(wrapped.module, torch._dynamo.eval_frame.OptimizedModule)


def test_dgc_without_its_optimizer_is_refused_with_the_reason(single):
    with pytest.raises(ValueError, match="dgc=True needs torch.optim.SGD .* got no optimizer"):
        lb.distribute(_model(), None, lb.Strategy(dgc=True))


def test_distributing_twice_is_an_error(single):
    wrapped, _ = lb.distribute(_model(), None)
    with pytest.raises(ValueError, match="already passed"):
        lb.distribute(wrapped, None)


def test_model_without_trainable_parameters_is_an_error(single):
    frozen = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        lb.distribute(frozen, None)


def test_gradient_merge_gates_step_and_zero_grad(single):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = lb.Strategy(gradient_merge=True)
    strategy.gradient_merge_configs = {"k_steps": 3, "avg": False}
    wrapped, opt = lb.distribute(model, opt, strategy)
    assert isinstance(opt.inner, torch.optim.SGD) and isinstance(wrapped, DistributedModel)
    start = model[0].weight.detach().clone()
    x = torch.randn(5, 4)
    grads = []
    for _ in range(2):
        opt.zero_grad()
        wrapped(x).sum().backward()
        opt.step()
        grads.append(model[0].weight.grad.clone())
    assert torch.equal(model[0].weight, start)  # no step before the 3rd micro step
    torch.testing.assert_close(grads[1], 2 * grads[0])  # zero_grad skipped: accumulating
    opt.zero_grad()
    wrapped(x).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, start)
