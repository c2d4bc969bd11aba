"""Sharding's all-gather overlaps the next forward: each bucket is written just before the first
module that reads it (learnt from one forward), hidden parameters read NaN rather than stale
values, and the results equal one process on the global batch. One spawn for the module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests._dist import run_ranks

WORLD, STEPS, BATCH, SEQ, VOCAB, DIM = 2, 5, 8, 6, 40, 32


class TinyLM(nn.Module):
    """Reads parameters the ways real models do: ``nn.MultiheadAttention`` passes
    ``out_proj.weight`` to its functional form without calling ``out_proj``, and the head
    is the embedding's weight, read by the root's own code after every child ran."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.mlp(self.norm(h))
        return F.linear(h, self.embed.weight)  # tied head


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=2)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def reference() -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = _optimizer(model)
    x, y = _data()
    for i in range(STEPS):
        optimizer.zero_grad()
        _loss(model, x[i], y[i]).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, stage: int, compiled: bool, overlap: bool = True) -> dict[str, Any]:
    import longboat as lb

    model = _model()
    strategy = lb.Strategy(fuse_grad_size_in_MB=0.004)  # a few buckets
    strategy.sharding = True
    strategy.sharding_configs = {"stage": stage, "comm_overlap": overlap}
    pending_after_embed: list[bool] = []
    dmodel, dopt = lb.distribute(model, _optimizer(model), strategy)
    gather = dopt.stages[-1].gather
    model.embed.register_forward_hook(lambda *_: pending_after_embed.append(gather.pending))
    if compiled:
        dmodel.compile(backend="eager")
    x, y = _data()
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    hidden_nan, written_after_forward = [], []
    for i in range(STEPS):
        dopt.zero_grad()
        loss = _loss(dmodel, x[i][half], y[i][half])
        written_after_forward.append(not gather.pending)
        loss.backward()
        dopt.step()
        hidden = [model.get_parameter(n) for n, _ in model.named_parameters()]
        hidden_nan.append(sum(bool(p.isnan().all()) for p in hidden))
    through_wrapper = {n.removeprefix("module."): p.clone() for n, p in dmodel.named_parameters()}
    _loss(dmodel, x[0][half], y[0][half]).backward()
    dopt.step()  # pending again: loading a state dict now writes them, then loads
    model.load_state_dict(through_wrapper)
    loaded = all(torch.equal(p, through_wrapper[n]) for n, p in model.named_parameters())
    state = lb.elastic.State(model=dmodel, optimizer=dopt)
    state.save()
    _loss(dmodel, x[0][half], y[0][half]).backward()
    dopt.step()  # pending again: an elastic rollback drops them unread, then restores
    state.restore()
    restored = all(torch.equal(p, through_wrapper[n]) for n, p in model.named_parameters())
    _loss(dmodel, x[0][half], y[0][half]).backward()
    dopt.step()  # pending again; then an elastic rebuild would drop them unread
    dmodel.drop_pending_writes()
    dropped = sum(bool(p.isnan().any()) for p in model.parameters()) + len(gather._hooks)
    dist.barrier()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "through_wrapper": through_wrapper,
        "pending_after_embed": pending_after_embed,
        "written_after_forward": written_after_forward,
        "hidden_nan": hidden_nan,
        "buckets": len(gather.buckets),
        "order": list(gather.order),
        "nan or hooks after drop": dropped,
        "loaded between step and forward": loaded,
        "restored between step and forward": restored,
    }


def _evaluated_in_inference_mode(rank: int) -> list[bool]:
    """An evaluation under ``torch.inference_mode`` after every step (the first one learns
    who reads what, the later ones launch gathers): finite outputs."""
    import longboat as lb

    model = _model()
    strategy = lb.Strategy(fuse_grad_size_in_MB=0.004)
    strategy.sharding, strategy.sharding_configs = True, {"stage": 2, "comm_overlap": True}
    dmodel, dopt = lb.distribute(model, _optimizer(model), strategy)
    x, y = _data()
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    finite = []
    for i in range(STEPS - 1):
        dopt.zero_grad()
        _loss(dmodel, x[i][half], y[i][half]).backward()
        dopt.step()
        with torch.inference_mode():
            finite.append(bool(torch.isfinite(dmodel(x[i + 1][half])).all()))
    return finite


def _all(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    runs = {
        f"stage{stage}{'-compiled' if compiled else ''}": _train(rank, stage, compiled)
        for stage, compiled in ((1, False), (2, False), (1, True))
    }
    runs |= {"stage2-in-step": _train(rank, 2, False, overlap=False)}
    return runs | {"inference": _evaluated_in_inference_mode(rank)}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout=600)


def _close(actual: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(
            actual[name], value, rtol=1e-7, atol=1e-9, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


@pytest.mark.parametrize("run", ["stage1", "stage2", "stage1-compiled", "stage2-in-step"])
def test_overlapped_gathers_train_as_one_process(runs, run):
    expected = reference()
    for rank, r in enumerate(runs):
        assert r[run]["buckets"] > 2
        # the wrapper's parameters() writes what is pending before it returns them
        _close(r[run]["through_wrapper"], expected, f"rank {rank}, {run}, read via the wrapper")


@pytest.mark.parametrize("run", ["stage1", "stage2"])
def test_gathers_are_left_to_the_next_forward(runs, run):
    for r in runs:
        seen = r[run]["pending_after_embed"]
        assert not seen[0] and not seen[1]  # step 1 gathers in the step, and learns the readers
        assert all(seen[2:STEPS])  # later: the embedding ran while other buckets still gathered
        assert all(r[run]["written_after_forward"])  # every bucket written by the forward's end


@pytest.mark.parametrize("run", ["stage1", "stage2"])
def test_a_parameter_waiting_for_its_slices_reads_nan_not_stale_values(runs, run):
    for r in runs:
        hidden = r[run]["hidden_nan"]
        assert hidden[0] == 0  # the first step writes everything before it returns
        assert all(h > 0 for h in hidden[1:])  # then: hidden until the forward needs them


@pytest.mark.parametrize("run", ["stage1-compiled", "stage2-in-step"])
def test_a_compiled_forward_or_comm_overlap_false_gathers_inside_the_step(runs, run):
    for r in runs:
        assert not any(r[run]["pending_after_embed"])
        assert r[run]["hidden_nan"] == [0] * STEPS


def test_the_gathers_follow_the_order_the_forward_reads_the_buckets(runs):
    for r in runs:
        order = r["stage1"]["order"]
        assert sorted(order) == list(range(r["stage1"]["buckets"]))
        assert order[0] != 0  # bucket 0 holds the last layers (it is reduced first)


def test_the_profile_sees_weights_read_without_calling_their_module():
    from longboat.sharding.zero.readers import ReadersProfile

    model = _model()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    seen: list[ReadersProfile] = []
    ReadersProfile(model, params, seen.append)
    x, _ = _data()
    model(x[0])
    (profile,) = seen
    out_proj, embed = index[id(model.attn.out_proj.weight)], index[id(model.embed.weight)]
    assert out_proj in profile.readers[model.attn]  # read by the attention, not by out_proj
    assert model.attn.out_proj not in profile.readers
    assert embed in profile.readers[model]  # the tied head, read by the root's own code
    assert profile.first_read[0] == embed
    assert not torch.overrides._get_current_function_mode_stack()  # the mode is gone
    model(x[1])  # and a second forward runs without it
    assert len(seen) == 1


@pytest.mark.parametrize("run", ["stage1", "stage2"])
def test_dropping_pending_writes_unhides_every_parameter_and_removes_the_hooks(runs, run):
    for r in runs:
        assert r[run]["nan or hooks after drop"] == 0


@pytest.mark.parametrize("run", ["stage1", "stage2"])
def test_load_state_dict_between_step_and_forward(runs, run):
    for r in runs:
        assert r[run]["loaded between step and forward"]
        assert r[run]["restored between step and forward"]  # an elastic rollback


def test_an_evaluation_under_inference_mode_between_steps(runs):
    for r in runs:
        assert r["inference"] == [True] * (STEPS - 1)


def test_gathers_dropped_while_in_flight_write_nothing_into_the_parameters():
    """An elastic rollback drops gathers still running on the collective's thread: the gate
    it writes through closes, so none of their slices lands on the restored parameters."""
    from longboat.comm.handles import FutureHandle
    from longboat.sharding.zero.gather import ParameterGather
    from longboat.sharding.zero.layout import ShardLayout

    model = nn.Linear(4, 4)
    params = list(model.parameters())
    layout = ShardLayout.build(params, [[0, 1]], [0, 0], 2, 0)
    launched: list[Any] = []

    class Groups:  # rank 0 of 2, through shared memory; the gather never completes here
        degree, index, shard_shm = 2, 0, object()

        def all_gather_placed(self, slices: Any) -> Any:
            launched.append((slices.rows, slices.gate))
            return FutureHandle(torch.futures.Future())

    gather = ParameterGather(layout.buckets, params, [p.detach().view(-1) for p in params], Groups())
    gather.watch(model)
    model(torch.zeros(1, 4))  # learns who reads what: the next step leaves the gather pending
    before = [p.detach().clone() for p in params]
    gather.after_step()
    ((rows, gate),) = launched
    assert [t.numel() for _, t in rows[1]] == [6, 4]  # rank 1's slice: the weight's end, bias
    with gate() as wanted:
        assert wanted and model.weight.isnan().all()  # in flight: written, and hidden
    gather.discard()
    with gate() as wanted:
        assert not wanted
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
