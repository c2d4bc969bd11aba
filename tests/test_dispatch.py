"""lb.distribute refuses an optimizer that updates parameters outside the model, in both modes,
before anything is started."""

from __future__ import annotations

import pytest
import torch

import longboat as lb
from longboat.ownership import ForeignParameterError


@pytest.mark.parametrize("mode", ["collective", "ps"])
def test_optimizer_with_parameters_outside_the_model_is_refused(mode: str) -> None:
    net, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD([*net.parameters(), *head.parameters()], lr=0.1)
    with pytest.raises(ForeignParameterError) as caught:
        lb.distribute(net, optimizer, lb.Strategy(mode=mode))
    message = str(caught.value)
    assert "holds 2 parameter(s) that are not in the model" in message
    assert "param_groups[0]['params'][2] (shape (2, 4))" in message
    assert "nn.ModuleDict" in message  # names the fix
    assert not lb.is_initialized()


def test_frozen_model_parameters_left_out_of_the_optimizer_are_fine() -> None:
    from longboat.ownership import check_optimizer_owns_model_params

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    check_optimizer_owns_model_params(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    check_optimizer_owns_model_params(model, None)


def test_a_frozen_parameter_is_not_foreign_at_any_door() -> None:
    """A frozen parameter gets no gradient, so there is nothing to average: every door (one
    check, longboat.ownership.admit) lets the optimizer hold it, given a model or the
    trainable parameters only (hvd.DistributedOptimizer's named_parameters)."""
    from longboat.ownership import admit

    net = torch.nn.Linear(2, 2)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    optimizer = torch.optim.SGD([frozen, *net.parameters()], lr=0.1)
    for door in ("lb.distribute", "lb.ps.distribute", "hvd.DistributedOptimizer"):
        admit(net, optimizer, door)
        admit(list(net.parameters()), optimizer, door)
    frozen.requires_grad_(True)  # trainable: foreign again
    with pytest.raises(ForeignParameterError, match="1 parameter"):
        admit(net, optimizer)


def test_every_door_refuses_a_foreign_or_reused_optimizer() -> None:
    """lb.distribute, the collective engine called directly and lb.ps.distribute check the
    same things before touching anything (one function: longboat.ownership.admit)."""
    from longboat.collective.engine import distribute as collective_distribute

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    foreign = torch.optim.SGD(other.parameters(), lr=0.1)
    for door in (lb.distribute, collective_distribute, lb.ps.distribute):
        strategy = lb.Strategy(mode="ps") if door is lb.ps.distribute else lb.Strategy()
        with pytest.raises(ForeignParameterError, match="not in the model"):
            door(model, foreign, strategy)


def test_kvstore_trainer_refuses_what_lb_distribute_refuses() -> None:
    """The KVStore facade's gluon Trainer (its own key-value path, no engine) runs the same
    entry checks: a foreign-parameter optimizer, or one another wrapper already distributes."""
    import longboat.kvstore as kvstore
    from longboat.optim.staged import claim

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    foreign = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ForeignParameterError) as caught:
        kvstore.Trainer(model.parameters(), foreign, kvstore.create("local"))
    assert "2 parameter(s) that are not in the parameters passed to kvstore.Trainer" in str(
        caught.value
    )
    wrapped = torch.optim.SGD(model.parameters(), lr=0.1)
    claim(wrapped, "hvd.DistributedOptimizer")
    with pytest.raises(ValueError, match="already passed to hvd.DistributedOptimizer: its grad"):
        kvstore.Trainer(model.parameters(), wrapped, kvstore.create("local"))
    ok = torch.optim.SGD(model.parameters(), lr=0.1)
    assert kvstore.Trainer(model.parameters(), ok, kvstore.create("local")).update_on_kvstore


def test_the_optimizer_only_door_checks_what_lb_distribute_checks() -> None:
    """hvd.DistributedOptimizer reaches the reducer through dispatch.enter_reducer: an
    optimizer holding parameters it was not given, or a parameter-server Strategy, is
    refused before anything is started."""
    from longboat.dispatch import enter_reducer

    net, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    named = list(net.named_parameters())
    optimizer = torch.optim.SGD([*net.parameters(), *head.parameters()], lr=0.1)
    with pytest.raises(ForeignParameterError, match="hvd.DistributedOptimizer"):
        enter_reducer(named, optimizer, lb.Strategy(), "hvd.DistributedOptimizer")
    own = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="collectively"):
        enter_reducer(named, own, lb.Strategy(mode="ps"), "hvd.DistributedOptimizer")
    assert not lb.is_initialized()
