"""longboat.fleet: role makers, the collective flow on 2 Gloo ranks against single-process
training, persistence through atomic checkpoints, and clear refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.collective._workloads import (
    STEPS,
    Config,
    build_model,
    build_optimizer,
    data,
    params_of,
    reference,
    shard,
)

WORLD = 2
MERGED = replace(Config(optimizer="sgd"), k_steps=2)
PLAIN = Config(optimizer="adam")


def _flow(rank: int, world: int, cfg: Config, model_first: bool, ckpt: str | None) -> dict:
    import longboat.fleet as fleet

    strategy = fleet.DistributedStrategy()
    if cfg.k_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": cfg.k_steps, "avg": True}
    fleet.init(is_collective=True, strategy=strategy)
    model = build_model(cfg, seed=rank)  # rank 0's weights win in distributed_model
    if model_first:
        dmodel = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(build_optimizer(cfg, model))
    else:
        opt = fleet.distributed_optimizer(build_optimizer(cfg, model), strategy=strategy)
        dmodel = fleet.distributed_model(model)
    x, y = data(cfg)
    for i in range(STEPS * cfg.k_steps):
        out = dmodel(shard(x[i], rank, world), rank=rank)
        opt.minimize(F.cross_entropy(out, shard(y[i], rank, world)))
    result = {"params": params_of(model)}
    if ckpt is not None:
        fleet.save_persistables(None, ckpt)
        fleet.barrier_worker()
        fresh = build_model(cfg, seed=7)
        fleet.load_persistables(ckpt, main_program=fresh)
        result["reloaded"] = params_of(fresh)
    return result


def _all(rank: int, world: int, ckpt: str) -> dict:
    import longboat.fleet as fleet

    out = {"merged": _flow(rank, world, MERGED, model_first=False, ckpt=ckpt)}
    out["who"] = [
        fleet.worker_index(),
        fleet.worker_num(),
        fleet.is_first_worker(),
        fleet.is_worker(),
        fleet.is_server(),
    ]
    out["plain"] = _flow(rank, world, PLAIN, model_first=True, ckpt=None)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("fleet")
    return ckpt, run_ranks(_all, WORLD, str(ckpt), timeout=150)


@pytest.mark.parametrize(("key", "cfg"), [("merged", MERGED), ("plain", PLAIN)])
def test_collective_flow_equals_single_process(ranks, key, cfg):
    _, results = ranks
    expected = reference(cfg, WORLD)
    init = params_of(build_model(cfg, seed=0))
    assert any(not torch.allclose(init[n], expected[n]) for n in init)
    for out in results:
        for name in expected:
            torch.testing.assert_close(
                out[key]["params"][name], expected[name], rtol=1e-5, atol=1e-6
            )


def test_roles_and_persistables(ranks):
    ckpt, results = ranks
    assert [out["who"] for out in results] == [
        [0, 2, True, True, False],
        [1, 2, False, True, False],
    ]
    assert (ckpt / "persistables.pt").exists()
    for out in results:
        for name, value in out["merged"]["params"].items():
            torch.testing.assert_close(out["merged"]["reloaded"][name], value)


def test_paddle_cloud_role_maker_reads_parameter_server_env():
    from longboat.fleet import PaddleCloudRoleMaker

    servers = "10.0.0.1:6000,10.0.0.2:6001"
    server = PaddleCloudRoleMaker(
        env={
            "TRAINING_ROLE": "PSERVER",
            "PADDLE_PSERVERS_IP_PORT_LIST": servers,
            "POD_IP": "10.0.0.2",
            "PADDLE_PORT": "6001",
            "PADDLE_TRAINERS_NUM": "3",
        }
    )
    assert server.is_server() and server.server_index() == 1 and server.server_num() == 2
    assert server.worker_num() == 3 and not server.is_first_worker()
    trainer = PaddleCloudRoleMaker(
        env={"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "2", "PADDLE_TRAINERS_NUM": "3"}
    )
    assert trainer.is_worker() and trainer.worker_index() == 2 and trainer._worker_num() == 3
    with pytest.raises(ValueError, match="TRAINING_ROLE='BOSS'"):
        PaddleCloudRoleMaker(env={"TRAINING_ROLE": "BOSS"})


def test_user_defined_role_maker_validates():
    from longboat.fleet import Role, UserDefinedRoleMaker

    maker = UserDefinedRoleMaker(1, Role.WORKER, 2, ["127.0.0.1:6000"])
    assert maker.worker_index() == 1 and maker.worker_num() == 2 and maker.server_num() == 1
    with pytest.raises(ValueError, match="current_id=2 is not below worker_num=2"):
        UserDefinedRoleMaker(current_id=2, role=Role.WORKER, worker_num=2)
    with pytest.raises(ValueError, match="server_endpoints"):
        UserDefinedRoleMaker(current_id=0, role=Role.SERVER, worker_num=2)


def test_refusals_name_the_fix():
    import longboat as lb
    import longboat.fleet as fleet

    fleet.init(fleet.UserDefinedRoleMaker(0, fleet.Role.WORKER, 1))  # parameter-server mode
    for call in (fleet.init_worker, fleet.stop_worker, fleet.barrier_worker):
        with pytest.raises(fleet.FleetError, match="no parameter servers known"):
            call()
    for call in (fleet.init_server, fleet.run_server):
        with pytest.raises(fleet.FleetError, match="server process"):
            call()
    try:
        with pytest.raises(fleet.FleetError, match="rank 0 of 1"):
            fleet.init(fleet.UserDefinedRoleMaker(1, fleet.Role.WORKER, 2), is_collective=True)
        fleet.init(is_collective=True)
        model = build_model(PLAIN, seed=0)
        opt = fleet.distributed_optimizer(build_optimizer(PLAIN, model))
        with pytest.raises(fleet.FleetError, match="distributed_model"):
            opt.minimize(model(torch.zeros(1, 16, dtype=torch.float64)).sum())
        merge = fleet.DistributedStrategy(gradient_merge=True)
        fleet.init(is_collective=True, strategy=merge)
        fleet.distributed_model(build_model(PLAIN, seed=0))
        with pytest.raises(fleet.FleetError, match="before fleet.distributed_model"):
            fleet.distributed_optimizer(build_optimizer(PLAIN, model))
        with pytest.raises(FileNotFoundError, match="persistables.pt"):
            fleet.load_persistables("/nonexistent-dir")
    finally:
        lb.shutdown()
