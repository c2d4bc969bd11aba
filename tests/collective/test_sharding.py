"""Sharding (ZeRO stage 1 and 2): 2 ranks train like one process on the global batch, and like
longboat without sharding, for SGD with momentum, Adam and AdamW; with param groups and an LR
scheduler, clipping by the global norm, AMP, gradient merge and a shard group smaller than the
world; the gathered state_dict is torch's; memory per rank is measured. One spawn for all."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.collective._workloads import Config, build_model, data, params_of, shard

WORLD = 2
STEPS = 5
CAP_MB = 0.05  # several buckets, parameters cut across the two ranks' slices
OVERFLOW_STEP = 3
CLIP = 0.5
SD_STEPS = 3  # the state_dict is taken after these steps, then training goes on


# -- what every run shares: model, optimizer, one step ----------------------------------------


def _cfg(opt: str) -> Config:
    # Adam/AdamW divide by sqrt(v): float64 keeps summation-order rounding below the tolerance
    return Config(optimizer="adam" if opt in ("adam", "adamw", "groups") else "sgd")


def _optimizer(opt: str, model: nn.Module) -> torch.optim.Optimizer:
    if opt == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if opt == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if opt == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    assert opt == "groups"  # no decay on biases and norms, another lr: two param groups
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3, "weight_decay": 0}],
        lr=1e-3,
    )


def _scheduler(opt: str, optimizer: torch.optim.Optimizer) -> Any:
    if opt != "groups":
        return None
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _losses(
    model: nn.Module, cfg: Config, i: int, ranks: list[int], k_steps: int = 1
) -> list[torch.Tensor]:
    x, y = data(Config(optimizer=cfg.optimizer, k_steps=k_steps))
    return [F.cross_entropy(model(shard(x[i], r, WORLD)), shard(y[i], r, WORLD)) for r in ranks]


def reference(opt: str, steps: int = STEPS, k_steps: int = 1, clip: float | None = None) -> dict:
    """One process on the global batch (the ranks' shards' mean loss)."""
    cfg = _cfg(opt)
    model = build_model(cfg, seed=0)
    optimizer = _optimizer(opt, model)
    scheduler = _scheduler(opt, optimizer)
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(k_steps):
            i = step * k_steps + micro
            loss = torch.stack(_losses(model, cfg, i, [0, 1], k_steps)).mean()
            (loss / k_steps).backward()
        if clip is not None:
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    out = params_of(model)
    if norms:
        out["__norms__"] = torch.stack(norms).float()
    return out


# -- the spawned ranks ------------------------------------------------------------------------


def _strategy(stage: int | None) -> Any:
    import longboat as lb

    strategy = lb.Strategy(fuse_grad_size_in_MB=CAP_MB)
    if stage is not None:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    return strategy


def _train(
    rank: int,
    opt: str,
    stage: int | None,
    *,
    steps: int = STEPS,
    k_steps: int = 1,
    clip: float | None = None,
    degree: int = 0,
    amp: str | None = None,
    overflow_in: str = "input",
) -> dict[str, torch.Tensor]:
    import longboat as lb

    cfg = _cfg(opt)
    model = build_model(cfg, seed=rank)  # different per rank: distribute broadcasts rank 0's
    optimizer = _optimizer(opt, model)
    strategy = _strategy(stage)
    if stage is not None:
        strategy.sharding_configs = {"stage": stage, "sharding_degree": degree}
    if k_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": k_steps, "avg": True}
    if amp is not None:
        strategy.amp = True
        strategy.amp_configs = {
            "dtype": amp,
            "init_loss_scaling": 1024.0,
            "decr_every_n_nan_or_inf": 1,
        }
    dmodel, dopt = lb.distribute(model, optimizer, strategy)
    scheduler = _scheduler(opt, optimizer)
    overflow = amp == "float16" and rank == 1
    hit = [False]
    if overflow and overflow_in == "gradient":
        # one element of rank 1's gradient, in the slice rank 0 owns: only rank 0's slice
        # overflows, so the skip decision must be shared across the shards
        model.head.bias.register_hook(
            lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if hit[0] else g
        )
    x, y = data(Config(optimizer=cfg.optimizer, k_steps=k_steps))
    out: dict[str, torch.Tensor] = {}
    norms = []
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    for step in range(steps):
        dopt.zero_grad()
        for micro in range(k_steps):
            i = step * k_steps + micro
            xi = shard(x[i], rank, WORLD)
            hit[0] = overflow and i == OVERFLOW_STEP
            if hit[0] and overflow_in == "input":
                xi = xi.clone()
                xi[0, 0] = float("inf")  # only rank 1 overflows
            F.cross_entropy(dmodel(xi).float(), shard(y[i], rank, WORLD)).backward()
        if clip is not None:
            norms.append(dmodel.clip_grad_norm_(clip))
        before = params_of(model)
        dopt.step()
        if amp is not None:  # read between steps: the gathered values are written first
            dmodel.settle_parameters()
            out[f"moved{step}"] = torch.tensor(
                [any(not torch.equal(before[n], p) for n, p in params_of(model).items())]
            )
        if scheduler is not None:
            scheduler.step()
    caught.__exit__(None, None, None)
    if scheduler is not None:  # it must see the user's optimizer step
        out["scheduler warned"] = torch.tensor(
            [sum("lr_scheduler" in str(w.message) for w in seen)]
        )
    dmodel.settle_parameters()  # the last step's gathers are written by the next forward
    out |= params_of(model)
    if norms:
        out["__norms__"] = torch.stack(norms).float()
    if amp == "float16":
        out["skipped"] = torch.tensor([dmodel.amp.scaler.skipped_steps])
    return out


def _split_somewhere(rank: int) -> dict[str, torch.Tensor]:
    """The layout cuts some parameter across the two ranks' slices (shards are balanced to the
    element, not to whole parameters)."""
    import longboat as lb

    cfg = _cfg("adam")
    model = build_model(cfg, seed=0)
    _, dopt = lb.distribute(model, _optimizer("adam", model), _strategy(1))
    step = dopt.stages[-1].shards
    cut = [
        p
        for s in step.layout.buckets
        for p in s.pieces
        if p.start > 0 or p.stop < step.params[p.param].numel()
    ]
    sizes = [s.hi - s.lo for s in step.layout.buckets]
    return {"cut": torch.tensor([len(cut)]), "owned": torch.tensor(sizes)}


def _state_dicts(rank: int) -> dict[str, Any]:
    """The gathered state_dict after SD_STEPS steps of stage 2, and a stage 1 run over a shard
    group of one rank (another layout) that loads it and trains on."""
    import longboat as lb

    cfg = _cfg("groups")
    model = build_model(cfg, seed=rank)
    optimizer = _optimizer("groups", model)
    dmodel, dopt = lb.distribute(model, optimizer, _strategy(2))
    x, y = data(cfg)
    for i in range(SD_STEPS):
        dopt.zero_grad()
        F.cross_entropy(dmodel(shard(x[i], rank, WORLD)), shard(y[i], rank, WORLD)).backward()
        dopt.step()
    saved = dopt.state_dict()
    after = {n: t.clone() for n, t in model.state_dict().items()}  # written before it reads

    model2 = build_model(cfg, seed=7)
    model2.load_state_dict(after)
    optimizer2 = _optimizer("groups", model2)
    strategy = _strategy(1)
    strategy.sharding_configs = {"stage": 1, "sharding_degree": 1}
    strategy.fuse_grad_size_in_MB = 0.02  # other buckets too
    dmodel2, dopt2 = lb.distribute(model2, optimizer2, strategy)
    dopt2.load_state_dict(saved)
    for i in range(SD_STEPS, STEPS):
        dopt2.zero_grad()
        F.cross_entropy(dmodel2(shard(x[i], rank, WORLD)), shard(y[i], rank, WORLD)).backward()
        dopt2.step()
    resumed = {n: t.clone() for n, t in model2.state_dict().items()}
    return {"saved": saved, "resumed": resumed}


def _alive_after_workers_settle(refs: list[Any], patience_s: float = 5.0) -> int:
    """How many of ``refs`` are alive once the collective worker threads have let go of the
    job they just finished (its future is set a moment before its frame ends); a reference
    held for good stays alive past ``patience_s``."""
    import time

    deadline = time.monotonic() + patience_s
    while (alive := sum(r() is not None for r in refs)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def _record_full_buckets() -> list[Any]:
    """Weak references to every full bucket stage 2 packs from now on (in this process)."""
    import weakref

    from longboat.sharding.zero.scatter import SliceScatter

    packed: list[Any] = []
    buffer = SliceScatter.buffer

    def recording_buffer(self: SliceScatter, bucket: int) -> torch.Tensor:
        full = buffer(self, bucket)
        packed.append(weakref.ref(full))
        return full

    SliceScatter.buffer = recording_buffer  # type: ignore[method-assign]
    return packed


def _virtual_full_buckets(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Stage 2 over the lagging test backend (4 virtual ranks, futures that hold their
    tensors, as NCCL's do): full buckets alive after each step."""
    import longboat as lb
    from tests import _lagging_harness as harness

    packed = _record_full_buckets()
    alive = []
    with harness.virtual_world(torch.device("cpu")):
        model, optimizer = harness._model("sharding", torch.device("cpu"))
        strategy = lb.Strategy(allreduce_algorithm="native", fuse_grad_size_in_MB=0.05)
        strategy.sharding, strategy.sharding_configs = True, {"stage": 2}
        dmodel, dopt = lb.distribute(model, optimizer, strategy)
        x, y = harness._data(2)
        for i in range(2):
            dopt.zero_grad()
            F.cross_entropy(dmodel(x[i]), y[i]).backward()
            dopt.step()
            alive.append(sum(r() is not None for r in packed))
    return {"alive": torch.tensor(alive), "packed": torch.tensor([len(packed)])}


def _memory(rank: int) -> dict[str, torch.Tensor]:
    """Bytes per rank after two Adam steps, without sharding and at stage 1 and 2; and the
    bytes of the shared-memory segments each run mapped."""
    import longboat as lb
    from longboat.comm.shm_segment import mapped_segments
    from longboat.sharding.zero.memory import memory_report

    cfg = _cfg("adam")
    out = {}
    packed = _record_full_buckets()
    for stage in (None, 1, 2):
        earlier = set(mapped_segments())  # the earlier runs' segments stay mapped
        model = build_model(cfg, seed=0)
        dmodel, dopt = lb.distribute(model, _optimizer("adam", model), _strategy(stage))
        x, y = data(cfg)
        for i in range(2):
            dopt.zero_grad()
            F.cross_entropy(dmodel(shard(x[i], rank, WORLD)), shard(y[i], rank, WORLD)).backward()
            dopt.step()
        if stage == 2:  # the last backward's full buckets are gone after it
            out["full buckets alive"] = torch.tensor([_alive_after_workers_settle(packed)])
        mapped = mapped_segments()
        out[f"shm{stage}"] = torch.tensor([sum(mapped[n] for n in set(mapped) - earlier)])
        report = memory_report(dmodel, dopt)
        buckets = [b.numel() * b.element_size() for b, _ in dmodel.reducer.bucket_layouts()]
        if stage == 2:
            buckets = [g.numel() * g.element_size() * WORLD for g in dmodel.reducer.collective.slices]
        out[f"stage{stage}"] = torch.tensor(
            [report.optimizer_state_bytes, report.gradient_bytes, max(buckets)]
        )
        dmodel.reducer.remove_hooks()
    return out


def _refusals(rank: int) -> dict[str, str]:
    import longboat as lb

    out = {}
    cases = {
        "lbfgs": (lambda m: torch.optim.LBFGS(m.parameters()), _strategy(1)),
        "degree3": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _strategy(1)),
        "no-optimizer": (lambda m: None, _strategy(2)),
    }
    cases["degree3"][1].sharding_configs = {"sharding_degree": 3}
    for name, (make_opt, strategy) in cases.items():
        model = build_model(_cfg("sgd"), seed=0)
        try:
            lb.distribute(model, make_opt(model), strategy)
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
    return out


RUNS: dict[str, dict[str, Any]] = {
    **{
        f"stage{stage}-{opt}": {"opt": opt, "stage": stage}
        for stage in (1, 2)
        for opt in ("sgd", "adam", "adamw", "groups")
    },
    **{f"plain-{opt}": {"opt": opt, "stage": None} for opt in ("sgd", "adam", "adamw")},
    **{f"clip-stage{s}": {"opt": "sgd", "stage": s, "clip": CLIP} for s in (1, 2)},
    **{f"merge-stage{s}": {"opt": "adam", "stage": s, "k_steps": 4} for s in (None, 1, 2)},
    **{f"degree1-stage{s}": {"opt": "adam", "stage": s, "degree": 1} for s in (1, 2)},
    **{
        f"amp-{dtype}-{stage}": {"opt": "sgd", "stage": stage, "amp": dtype}
        for dtype in ("float16", "bfloat16")
        for stage in (None, 2)
    },
    **{
        f"amp-slice-{stage}": {
            "opt": "sgd",
            "stage": stage,
            "amp": "float16",
            "overflow_in": "gradient",
        }
        for stage in (None, 2)
    },
}


def _all(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    out: dict[str, Any] = {
        name: _train(rank, kw.pop("opt"), kw.pop("stage"), **kw)
        for name, kw in ((n, dict(kw)) for n, kw in RUNS.items())
    }
    out["split"] = _split_somewhere(rank)
    out["state"] = _state_dicts(rank)
    out["memory"] = _memory(rank)
    out["refusals"] = _refusals(rank)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout=600)


def _close(actual: dict, expected: dict, what: str, rtol: float = 1e-5, atol: float = 1e-6):
    for name, value in expected.items():
        if name == "scheduler warned":
            continue
        torch.testing.assert_close(
            actual[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


# -- equal results ----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw", "groups"])
def test_sharded_training_matches_single_process(runs, stage, opt):
    expected = reference(opt)
    init = params_of(build_model(_cfg(opt), seed=0))
    assert any(not torch.allclose(init[n], expected[n]) for n in init)  # it trained
    for rank, r in enumerate(runs):
        _close(r[f"stage{stage}-{opt}"], expected, f"rank {rank}, stage {stage}, {opt}")


@pytest.mark.parametrize("stage", [1, 2])
def test_lr_scheduler_sees_the_user_optimizer_step(runs, stage):
    for r in runs:
        assert r[f"stage{stage}-groups"]["scheduler warned"].item() == 0


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
def test_sharded_training_matches_unsharded_longboat(runs, stage, opt):
    for rank, r in enumerate(runs):
        _close(r[f"stage{stage}-{opt}"], r[f"plain-{opt}"], f"rank {rank} vs sharding=False")


def test_slices_cut_parameters_to_balance_elements(runs):
    for r in runs:
        assert r["split"]["cut"].item() > 0
    owned = [r["split"]["owned"] for r in runs]
    assert ((owned[0] - owned[1]).abs() <= 1).all()  # balanced to the element


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_uses_the_global_norm(runs, stage):
    expected = reference("sgd", clip=CLIP)
    assert (expected["__norms__"] > CLIP).all()  # clipping really acts on every step
    for rank, r in enumerate(runs):
        _close(r[f"clip-stage{stage}"], expected, f"rank {rank}, clip, stage {stage}")


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_merge(runs, stage):
    expected = reference("adam", k_steps=4)
    for rank, r in enumerate(runs):
        merged, plain = r[f"merge-stage{stage}"], r["merge-stageNone"]
        _close(merged, plain, f"rank {rank}, merge, stage {stage} vs sharding=False")
        # one Adam element of this workload sits where the update is steep in its gradient:
        # longboat without sharding is 2e-6 off the single process there too
        _close(merged, expected, f"rank {rank}, merge, stage {stage}", atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_shard_groups_smaller_than_the_world_average_across_groups(runs, stage):
    expected = reference("adam")
    for rank, r in enumerate(runs):
        _close(r[f"degree1-stage{stage}"], expected, f"rank {rank}, degree 1, stage {stage}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "slice"])
def test_amp_matches_unsharded_and_overflow_skips_everywhere(runs, dtype):
    for rank, r in enumerate(runs):
        sharded, plain = r[f"amp-{dtype}-2"], r[f"amp-{dtype}-None"]
        params = {n: v for n, v in plain.items() if not n.startswith(("moved", "skipped"))}
        _close(sharded, params, f"rank {rank}, {dtype}")
        if dtype != "bfloat16":
            assert sharded["skipped"].item() == 1
            assert not sharded[f"moved{OVERFLOW_STEP}"].item()
        assert all(sharded[f"moved{i}"].item() for i in range(STEPS) if i != OVERFLOW_STEP)


# -- checkpoints ------------------------------------------------------------------------------


def _plain_after(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    cfg = _cfg("groups")
    model = build_model(cfg, seed=0)
    optimizer = _optimizer("groups", model)
    for i in range(steps):
        optimizer.zero_grad()
        torch.stack(_losses(model, cfg, i, [0, 1])).mean().backward()
        optimizer.step()
    return model, optimizer, None


def test_state_dict_is_the_plain_optimizers(runs):
    _, plain, _ = _plain_after(SD_STEPS)
    expected = plain.state_dict()
    for rank, r in enumerate(runs):
        saved = r["state"]["saved"]
        assert saved["param_groups"] == expected["param_groups"]
        assert saved["state"].keys() == expected["state"].keys()
        for index, state in expected["state"].items():
            assert saved["state"][index].keys() == state.keys()
            _close(saved["state"][index], state, f"rank {rank}, state of parameter {index}")


def test_state_dict_loads_into_the_plain_optimizer(runs):
    saved = runs[0]["state"]["saved"]
    model, plain, _ = _plain_after(SD_STEPS)
    fresh = _optimizer("groups", model)
    fresh.load_state_dict(saved)
    cfg = _cfg("groups")
    for i in range(SD_STEPS, STEPS):
        fresh.zero_grad()
        torch.stack(_losses(model, cfg, i, [0, 1])).mean().backward()
        fresh.step()
    expected, _, _ = _plain_after(STEPS)
    _close(params_of(model), params_of(expected), "plain optimizer resumed")


def test_state_dict_loads_into_another_shard_layout(runs):
    expected, _, _ = _plain_after(STEPS)
    for rank, r in enumerate(runs):
        _close(r["state"]["resumed"], params_of(expected), f"rank {rank}, resumed sharded")


# -- memory -----------------------------------------------------------------------------------


def test_memory_per_rank_shrinks_with_the_stage(runs):
    for rank, r in enumerate(runs):
        m = r["memory"]
        full_state, full_grads, _ = m["stageNone"].tolist()
        state1, grads1, bucket1 = m["stage1"].tolist()
        state2, grads2, bucket2 = m["stage2"].tolist()
        assert full_state > 0 and full_grads > 0
        # Adam keeps two values per element: at most 1/N of them plus a bucket's worth
        assert state1 <= full_state / WORLD + 2 * bucket1, (rank, state1, full_state)
        assert state2 <= full_state / WORLD + 2 * bucket2, (rank, state2, full_state)
        assert state1 < 0.6 * full_state
        # stage 1 keeps the full buckets and its slice; stage 2 its slices only
        assert grads1 >= full_grads
        assert grads2 <= full_grads / WORLD + bucket2, (rank, grads2, full_grads)
        # nothing (a collective's handle, a view) keeps a full bucket alive past backward
        assert m["full buckets alive"].item() == 0


def test_sharding_maps_no_more_shared_memory_than_unsharded(runs):
    """On one node the shard group's reduce-scatter and all-gather run on the allreduce's
    shared-memory segments instead of mapping segments of their own beside them."""
    for rank, r in enumerate(runs):
        plain, *sharded = (r["memory"][f"shm{s}"].item() for s in (None, 1, 2))
        assert plain > 0, "the allreduce does not run through shared memory on one node"
        assert max(sharded) <= plain, (rank, plain, sharded)


# -- refusals ---------------------------------------------------------------------------------


def test_refusals_name_the_field_and_the_way_out(runs):
    for r in runs:
        refused = r["refusals"]
        assert "LBFGS" in refused["lbfgs"] and "Adam" in refused["lbfgs"]
        assert "sharding_degree" in refused["degree3"] and "divide" in refused["degree3"]
        assert "pass the optimizer" in refused["no-optimizer"]


def test_stage2_releases_the_full_buckets_after_backward():
    (result,) = run_ranks(_virtual_full_buckets, 1, timeout=120)
    assert result["packed"].item() > 2  # several buckets per backward were packed
    assert result["alive"].tolist() == [0, 0]


def _gathered(rank: int, world: int, device: str) -> dict[str, torch.Tensor]:
    """Stage 1 at 4 virtual ranks of the lagging backend, whose all-gather repeats this rank's
    slice (landing late on its own stream on a GPU): after each step and the next forward (or
    an explicit settle) every element outside the slice must equal the slice's element at
    that offset. Largest difference."""
    import longboat as lb
    from tests import _lagging_harness as harness

    dev = torch.device(device)
    worst = 0.0
    with harness.virtual_world(dev):
        model, optimizer = harness._model("sharding", dev)
        strategy = lb.Strategy(allreduce_algorithm="native", fuse_grad_size_in_MB=0.05)
        strategy.sharding, strategy.sharding_configs = True, {"stage": 1, "comm_overlap": True}
        dmodel, dopt = lb.distribute(model, optimizer, strategy)
        step = dopt.stages[-1].shards
        x, y = harness._data(3)
        for i in range(4):
            dopt.zero_grad()
            F.cross_entropy(dmodel(x[i % 3].to(dev)), y[i % 3].to(dev)).backward()
            dopt.step()
            if i % 2:  # written by the next forward, bucket by bucket ...
                with torch.no_grad():
                    dmodel(x[(i + 1) % 3].to(dev))
            else:  # ... or all at once, for a reader outside the forward
                dmodel.settle_parameters()
            for s in step.layout.buckets:
                full = torch.cat([step.flat[p].detach() for p, _ in s.members])
                mine = full[s.lo : s.hi]
                for k in range(1, step.groups.degree):
                    other = full[k * s.shard_numel : k * s.shard_numel + mine.numel()]
                    if other.numel():
                        worst = max(worst, float((other - mine[: other.numel()]).abs().max()))
    return {"worst": torch.tensor([worst]), "buckets": torch.tensor([len(step.layout.buckets)])}


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)], ids=["cpu", "gpu"]
)
def test_all_gather_is_read_after_it_lands(device):
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (result,) = run_ranks(_gathered, 1, device, timeout=120)
    assert result["buckets"].item() > 1
    assert result["worst"].item() == 0.0


def test_state_descriptions_travel_as_json_never_pickled() -> None:
    """Ranks tell each other which optimizer state they hold in JSON: a tensor's dtype, a
    scalar's value; any other object is refused by name instead of being pickled."""
    import json

    from longboat.sharding.zero.state import _entry, scalars

    entries = {
        "exp_avg": _entry("exp_avg", torch.zeros(2, dtype=torch.float64)),
        "step": _entry("step", torch.tensor(3.0)),
        "count": _entry("count", 7),
    }
    assert json.loads(json.dumps(entries)) == entries
    assert entries["exp_avg"] == {"dtype": "float64"}
    rebuilt = scalars(entries)
    assert torch.equal(rebuilt["step"], torch.tensor(3.0)) and rebuilt["count"] == 7
    with pytest.raises(TypeError, match="nothing is pickled"):
        _entry("weird", object())
