"""Sharding stage 3 without ranks: the units chosen, the Strategy mapped onto FSDP2's policies,
and the refusals that need no process group."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

import longboat as lb
from longboat.collective.plan import Placement, resolve
from longboat.sharding.optimizer import rebuild
from longboat.sharding.policies import FullyShardPolicy
from longboat.sharding.units import named_units, planned_units
from tests.sharding import _lm


def _names(model: torch.nn.Module, units: list) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return ["+".join(names[id(m)] for m in unit) for unit in units]


def test_planned_units_pack_siblings_keep_torch_layers_whole_and_tied_weights_at_the_root() -> None:
    model = _lm.model()
    assert _names(model, planned_units(model, 25.0, 20)) == ["blocks.0+blocks.1", "norm"]
    small = _names(model, planned_units(model, 0.004, 20))  # 4 KB: a block does not fit
    assert "blocks.0.attn" in small  # MultiheadAttention reads out_proj.weight itself: whole
    assert not any(n.startswith("blocks.0.attn.") for n in small)
    assert not any(n in ("embed", "head") for n in small)  # tied: the root holds them


def test_named_units_by_class_or_name_and_their_refusals() -> None:
    model = _lm.model()
    assert _names(model, named_units(model, ["Block"])) == ["blocks.0", "blocks.1"]
    assert _names(model, named_units(model, ["blocks.1", "norm"])) == ["blocks.1", "norm"]
    with pytest.raises(ValueError, match="'Blok', which is neither a module class"):
        named_units(model, ["Blok"])
    with pytest.raises(ValueError, match="'head' .* tied weight"):
        named_units(model, ["head"])
    with pytest.raises(ValueError, match="'blocks' .* no forward of its own"):
        named_units(model, ["blocks"])


def _policy(world: int = 4, per_node: int = 2, nodes: int = 2, **fields) -> FullyShardPolicy:
    configs = {"stage": 3, **fields.pop("configs", {})}
    strategy = lb.Strategy(sharding=True, sharding_configs=configs, **fields)
    strategy.check()
    plan = resolve(strategy, Placement.of([r // per_node for r in range(world)], "gloo"))
    return FullyShardPolicy.of(plan, world, per_node, nodes)


def test_strategy_maps_onto_fsdp2_policies() -> None:
    plain = _policy(nodes=1, per_node=4)
    assert (plain.degree, plain.replicas, plain.param_dtype, plain.reduce_dtype) == (
        4,
        1,
        None,
        None,
    )
    across = _policy()  # two nodes: shard within the node, replicate across (HSDP)
    assert (across.degree, across.replicas) == (2, 2)
    assert (_policy(configs={"sharding_degree": 4}).replicas) == 1
    bf16 = _policy(amp=True, amp_configs={"dtype": "bfloat16"})
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert bf16.mixed_precision().param_dtype == torch.bfloat16
    fp16 = _policy(amp=True, amp_configs={"dtype": "float16"})  # float32 shards, loss scaled
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    assert _policy(fp16_allreduce=True).reduce_dtype == torch.float16
    assert _policy(gradient_compression="bf16").reduce_dtype == torch.bfloat16
    offload = _policy(configs={"offload": True})
    assert isinstance(offload.offload_policy("cpu"), CPUOffloadPolicy)
    assert "HSDP" in across.describe() and "over 2 rank(s)" in across.describe()
    with pytest.raises(ValueError, match="sharding_degree'\\]=3 must divide"):
        _policy(configs={"sharding_degree": 3})


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"dgc": True}, "dgc"),
        ({"gradient_compression": "powersgd"}, "gradient_compression"),
        ({"lamb": True}, "lamb"),
        ({"localsgd": True}, "localsgd"),
        ({"mode": "ps"}, "mode"),
        ({"use_hierarchical_allreduce": True}, "use_hierarchical_allreduce"),
    ],
)
def test_what_cannot_apply_is_refused_by_name(fields: dict, named: str) -> None:
    strategy = lb.Strategy(sharding=True, sharding_configs={"stage": 3}, **fields)
    with pytest.raises(lb.StrategyError, match=f"Strategy.{named}="):
        strategy.check()


def test_optimizer_rebuild_keeps_groups_and_refuses_what_cannot_step_shards() -> None:
    model = torch.nn.Linear(3, 2)
    user = torch.optim.SGD(
        [{"params": [model.weight], "lr": 0.5}, {"params": [model.bias]}], lr=0.1, momentum=0.9
    )
    new = {id(p): torch.nn.Parameter(p.detach().clone()) for p in model.parameters()}
    sharded = rebuild(user, new)
    assert type(sharded) is torch.optim.SGD
    assert [g["lr"] for g in sharded.param_groups] == [0.5, 0.1]
    assert sharded.param_groups[0]["momentum"] == 0.9
    assert user.param_groups[0]["params"][0] is new[id(model.weight)]  # old ones released
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="cannot step LBFGS"):
        rebuild(lbfgs, {id(p): p for p in model.parameters()})
    stepped = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="already holds state"):
        rebuild(stepped, {id(p): p for p in model.parameters()})


def test_lightning_refuses_stage_3_by_name() -> None:
    pytest.importorskip("lightning")
    from longboat.integrations.lightning import admit_strategy

    strategy = lb.Strategy(sharding=True, sharding_configs={"stage": 3})
    with pytest.raises(ValueError, match="LongboatStrategy does not run sharding stage 3"):
        admit_strategy(strategy)


def test_cluster_line_names_stage_and_degree() -> None:
    from longboat.sharding.config import ShardingPlan
    from longboat.sharding.policies import banner

    def line(stage: int, degree: int = 0) -> str:
        configs = {"stage": stage, "sharding_degree": degree}
        return banner(
            ShardingPlan.of(lb.Strategy(sharding=True, sharding_configs=configs)), 4, 2, 2
        )

    assert line(3) == ", sharding stage 3 over 2 ranks x 2 replicas"  # HSDP across the nodes
    assert line(3, 4) == ", sharding stage 3 over 4 ranks"
    assert line(2) == ", sharding stage 2 over 4 ranks"
    assert banner(None, 4, 2, 2) == ""
