"""longboat sim at sharding stage 3 (FSDP2): the engine's units planned on the profile's module
tree, each unit all-gathered in forward and again in backward, its gradients reduce-scattered
(and allreduced across HSDP replicas), the memory one rank holds, the overlap on GPUs only, and
--recommend offering stage 3 only where nothing else fits."""

from __future__ import annotations

import pytest

from longboat.collective.plan import Placement, resolve
from longboat.sharding.fsdp import plan_units
from longboat.sim import cluster as cluster_mod
from longboat.sim.measure import module_tree
from longboat.sim.predict import collective_plan, simulate
from longboat.sim.profile import Param, Profile, from_dict
from longboat.sim.stage3_units import unit_params
from longboat.strategy import Strategy
from tests.sharding._lm import TiedLM
from tests.sim.helpers import linear_profile

V, D, BLOCKS = 1000, 256, 4
EMBED, FC = V * D * 4, (D * D + D) * 4  # bytes: the root's embedding, one block's layer
MODULES = {
    "embed": ["Embedding", "torch.nn.modules.sparse", "", True],
    "blocks": ["ModuleList", "torch.nn.modules.container", "ModuleList", False],
    **{f"blocks.{i}": ["Block", "model", "", True] for i in range(BLOCKS)},
    **{f"blocks.{i}.fc": ["Linear", "torch.nn.modules.linear", "", True] for i in range(BLOCKS)},
}


def _profile() -> Profile:
    """An embedding (the root's: not a unit) and 4 blocks of one 256x256 layer, backward
    spread evenly, last block first."""
    params = [Param("embed.weight", (V, D), "float32", "embed", 0.1)]
    for i in range(BLOCKS):
        ready = 0.1 * (BLOCKS - i) / (BLOCKS + 1)
        params.append(Param(f"blocks.{i}.fc.weight", (D, D), "float32", f"blocks.{i}.fc", ready))
        params.append(Param(f"blocks.{i}.fc.bias", (D,), "float32", f"blocks.{i}.fc", ready))
    return Profile("blocks", 8, 0.05, 0.1, 0.004, 1e9, tuple(params), modules=MODULES)


PROFILE = _profile()
TOTAL = EMBED + BLOCKS * FC
CPU4 = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 4, "intra": {"kind": "loopback"}})
CPU2X4 = cluster_mod.from_dict(
    {"nodes": 2, "devices_per_node": 4, "inter": {"bandwidth": "10gbit", "latency": "50us"}}
)
GPU8 = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 8, "device": "A100"})


def _stage3(**fields: object) -> Strategy:
    configs = {"stage": 3, "units": ["Block"]} | dict(fields.pop("configs", {}))  # type: ignore[call-overload]
    return Strategy(sharding=True, sharding_configs=configs, **fields)  # type: ignore[arg-type]


def test_units_are_the_engines_on_the_profiles_module_tree() -> None:
    """A profile of a real model (its module tree recorded) plans the units lb.distribute
    would: by class name, and by the bucket cap."""
    model = TiedLM(vocab=64, dim=32, layers=3)
    named = list(model.named_parameters())
    params = tuple(Param(n, tuple(p.shape), "float32", n.rpartition(".")[0], 0.0) for n, p in named)
    profile = Profile("lm", 1, 0.0, 0.0, 0.0, 0.0, params, modules=module_tree(model))
    profile = from_dict(profile.to_dict())  # the tree survives the file
    place = Placement.of([0, 0], "gloo")
    for fields in (
        {"sharding_configs": {"stage": 3, "units": ["Block"]}},
        {"sharding_configs": {"stage": 3}, "fuse_grad_size_in_MB": 0.02},
    ):
        plan = resolve(Strategy(sharding=True, **fields), place)  # type: ignore[arg-type]
        names = {id(p): n for n, p in named}
        engine = sorted(
            sorted(names[id(p)] for m in u for p in m.parameters()) for u in plan_units(model, plan)
        )
        units, _ = unit_params(profile, plan)
        assert sorted(sorted(params[i].name for i in u) for u in units) == engine
        assert len(engine) >= 2


def test_bytes_and_memory_per_rank_by_hand() -> None:
    """4 ranks: the root (the embedding) gathered once, each block twice, everything
    reduce-scattered once; a rank holds a quarter of the parameters, gradients and Adam's two
    moments, plus the root and two blocks gathered."""
    p = simulate(PROFILE, CPU4, _stage3())
    assert p.bytes_sent == int(3 / 4 * (EMBED + 2 * BLOCKS * FC) + 3 / 4 * TOTAL)
    assert p.memory == {
        "parameters": TOTAL // 4,
        "gradients": TOTAL // 4,
        "optimizer_state": 2 * TOTAL // 4,
        "gathered_parameters": EMBED + 2 * FC,
    }
    assert p.buckets == BLOCKS + 1 and p.algorithm == "fsdp2"
    assert any("stage 3 (FSDP2) over 4 ranks: 4 unit(s)" in n for n in p.notes)


def test_bfloat16_gathers_hsdp_allreduces_and_merge_keeps_whole_gradients() -> None:
    bf16 = simulate(PROFILE, CPU4, _stage3(amp=True, amp_configs={"dtype": "bfloat16"}))
    assert bf16.bytes_sent == int(3 / 4 * (EMBED + 2 * BLOCKS * FC) / 2 + 3 / 4 * TOTAL)
    assert bf16.memory["gathered_parameters"] == (EMBED + 2 * FC) // 2
    hsdp = simulate(PROFILE, CPU2X4, _stage3())  # 0 on 2 nodes: shard within the node
    assert hsdp.bytes_sent == int(
        3 / 4 * (EMBED + 2 * BLOCKS * FC) + 3 / 4 * TOTAL + 2 * (1 / 2) * TOTAL / 4
    )
    assert any("over 4 ranks x 2 replicas (HSDP)" in n for n in hsdp.notes)
    merged = simulate(
        PROFILE, CPU4, _stage3(gradient_merge=True, gradient_merge_configs={"k_steps": 2})
    )
    assert merged.memory["gradients"] == TOTAL
    assert merged.bytes_sent == int((2 * 3 / 4 * (EMBED + 2 * BLOCKS * FC) + 3 / 4 * TOTAL) / 2)


def test_cpu_ranks_expose_every_collective_gpus_overlap_one_unit_ahead() -> None:
    cpu = simulate(PROFILE, CPU4, _stage3())
    assert cpu.exposed_comm_s == pytest.approx(cpu.comm_s)
    assert cpu.optimizer_s == pytest.approx(PROFILE.optimizer_s / 4)
    assert cpu.step_s == pytest.approx(cpu.compute_s + cpu.comm_s + cpu.optimizer_s)
    gpu = simulate(PROFILE, GPU8, _stage3())
    assert 0 < gpu.exposed_comm_s < gpu.comm_s  # the first gather waits, the rest hide
    assert not any("synchronously" in n for n in gpu.notes)


def test_a_profile_without_module_classes_names_the_fix() -> None:
    bare = linear_profile([64] * 3)
    with pytest.raises(ValueError, match="records no module classes.*longboat sim profile"):
        simulate(bare, CPU4, _stage3())
    plan = collective_plan(Strategy(sharding=True, sharding_configs={"stage": 3}), CPU4)
    assert unit_params(bare, plan)[0]  # by the bucket cap it plans on the names


def test_recommend_offers_stage_3_only_where_stage_2_does_not_fit() -> None:
    """24 layers 4096 wide, 1.6 GB of float32 parameters, 8 cards. Stage 2 needs 2.2 GB per
    rank: on 4 GB cards (3.2 GB usable) it fits and stage 3 is not offered; on 2 GB cards
    (1.6 GB) only stage 3 does, with each layer a unit (a 128 MB cap): 0.8 GB of shards plus
    two 67 MB layers gathered."""
    from longboat.sim.recommend import recommend

    big = linear_profile([4096] * 25, backward_s=0.5)

    def cards(gb: int) -> cluster_mod.Cluster:
        return cluster_mod.from_dict(
            {"nodes": 1, "devices_per_node": 8, "device": {"name": "A10", "memory_gb": gb}}
        )

    roomy = recommend(big, cards(4), top=100, show=False)
    assert roomy and all(c.fields["sharding_configs"]["stage"] == 2 for c in roomy)
    tight = recommend(big, cards(2), top=100, show=False)
    assert tight and all(c.fields["sharding_configs"]["stage"] == 3 for c in tight)
    assert {c.fields.get("fuse_grad_size_in_MB") for c in tight} == {128.0}
    layer = 4096 * 4097 * 4
    assert tight[0].prediction.memory["gathered_parameters"] == 2 * layer
