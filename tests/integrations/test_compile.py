"""torch.compile of a longboat model: same training as one process, and buckets still launch
during the compiled backward (cut at the reducer's buckets).

One spawn of 2 Gloo ranks runs every case; each compares its parameters with single-process
training on the global batch. Overlap is shown by an ordering fact, not by timing: the first
bucket (the last layer's gradients) is launched before the backward node that computes the
first layer's gradient starts. Plainly compiled, that node computes every gradient, so every
bucket launches after it.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from longboat.integrations.compile_split import BucketSplitter, plan_split
from tests._dist import run_ranks

STEPS = 3
GLOBAL_BATCH = 8
WIDTH = 32  # a 32x32 weight (4 KB) exceeds the 1 KB cap: one bucket per layer
CAP_MB = 0.001


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g), torch.randint(
        0, 4, (STEPS, GLOBAL_BATCH), generator=g
    )


def _reference() -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    for i in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _Events:
    """An observer for the reducer: the order of bucket launches and of the start of the
    backward node that computes the first layer's weight gradient."""

    def __init__(self, first_weight: torch.Tensor):
        self.first_weight = first_weight
        self.order: list[str] = []

    def forward_begin(self) -> None:
        pass

    def forward_end(self, output: Any) -> None:
        node = _producer_of(output.grad_fn, self.first_weight)
        node.register_prehook(lambda grads: self.order.append("first layer"))

    def bucket_ready(self, bucket: int) -> None:
        pass

    def launched(self, bucket: int, comm: int, tensor: torch.Tensor, handle: Any) -> Any:
        self.order.append(f"bucket {bucket}")
        return handle

    def backward_end(self) -> None:
        pass

    def synced(self) -> None:
        pass


def _producer_of(root: Any, param: torch.Tensor) -> Any:
    """The autograd node that feeds ``param``'s AccumulateGrad."""
    stack, seen = [root], set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is param:
                return fn
            if nxt is not None:
                stack.append(nxt)
    raise AssertionError("no node computes the parameter's gradient")


def _train(rank: int, world: int, how: str) -> dict[str, Any]:
    """Train the model compiled ``how``; its parameters, the launch order of the last step,
    the buckets of each compiled piece and longboat's compile warnings."""
    import longboat as lb

    torch._dynamo.reset()
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("longboat.compile").addHandler(handler)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = lb.Strategy(fuse_grad_size_in_MB=CAP_MB, last_comm_group_size_MB=CAP_MB)
    if how == "before":
        model = torch.compile(model, backend="aot_eager")
    dmodel, dopt = lb.distribute(model, opt, strategy)
    runs: Any = dmodel
    if how in ("after", "inductor"):
        lb.compile(dmodel, backend="aot_eager" if how == "after" else "inductor")
    elif how == "plain":
        runs = torch.compile(dmodel, backend="aot_eager")
    first = dmodel.reducer.params[0]
    x, y = _data()
    half = GLOBAL_BATCH // world
    for i in range(STEPS):
        events = _Events(first)
        dmodel.reducer.observer = events  # type: ignore[assignment]
        dopt.zero_grad()
        out = runs(x[i, rank * half : (rank + 1) * half])
        F.cross_entropy(out, y[i, rank * half : (rank + 1) * half]).backward()
        dopt.step()
    logging.getLogger("longboat.compile").removeHandler(handler)
    splitter = dmodel.splitter
    return {
        "params": [p.detach().clone() for p in dmodel.reducer.params],
        "order": events.order,
        "pieces": [sorted(p) for p in splitter.splits[-1]] if splitter else None,
        "buckets": dmodel.reducer.num_buckets,
        "warnings": warnings,
    }


def _compiled_autograd_refused(rank: int, world: int) -> str:
    from torch._dynamo import compiled_autograd

    import longboat as lb

    model = _model()
    dmodel, _ = lb.distribute(model, None, lb.Strategy())
    loss = dmodel(torch.randn(2, 8)).sum()
    try:
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
    except RuntimeError as e:
        return str(e)
    return "not refused"


CASES = ("eager", "after", "before", "plain", "inductor")


def _all(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb

    lb.init(backend="gloo")
    out: dict[str, Any] = {how: _train(rank, world, how) for how in CASES}
    out["compiled autograd"] = _compiled_autograd_refused(rank, world)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_all, 2, timeout=420)


@pytest.mark.parametrize("how", CASES)
def test_training_equals_single_process(ranks: list[dict[str, Any]], how: str) -> None:
    expected = _reference()
    for result in ranks:
        assert result[how]["buckets"] == 3
        for got, want in zip(result[how]["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ("eager", "after", "before", "inductor"))
def test_first_bucket_launches_before_first_layer_gradient(
    ranks: list[dict[str, Any]], how: str
) -> None:
    for result in ranks:
        order = result[how]["order"]
        assert order.index("bucket 0") < order.index("first layer"), order
        assert order.index("bucket 1") < order.index("first layer"), order
        assert order.index("first layer") < order.index("bucket 2"), order


@pytest.mark.parametrize("how", ("after", "before", "inductor"))
def test_each_compiled_piece_produces_whole_buckets(ranks: list[dict[str, Any]], how: str) -> None:
    for result in ranks:  # backward order: the last layer's piece first, one bucket each
        assert result[how]["pieces"] == [[0], [1], [2]]
        assert result[how]["warnings"] == []


def test_plain_torch_compile_loses_overlap_and_says_so(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        order = result["plain"]["order"]
        assert order[0] == "first layer", order  # one node computes every gradient first
        assert order[1:] == ["bucket 0", "bucket 1", "bucket 2"]
        assert len(result["plain"]["warnings"]) == 1
        warning = result["plain"]["warnings"][0]
        assert "model.compile(...) or lb.compile(model, ...)" in warning
        assert "write model.compile(...) in place of model = torch.compile(model, ...)" in warning


def test_compiled_autograd_is_refused_with_the_way_out(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        message = result["compiled autograd"]
        assert message.startswith("compiled autograd"), message
        assert "lb.compile(model" in message


# ---- the split plan on graphs, without ranks ----------------------------------------------------


class _Tied(nn.Module):
    """An embedding whose weight the head reuses, around a middle layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mid(self.embed(tokens)))
        return h @ self.embed.weight.t()  # the tied head: the transpose feeds the matmul


def _split(module: nn.Module, groups: list[list[str]]) -> list[set[int]]:
    """Per-piece buckets of ``module`` traced with get_attr parameters, ``groups`` holding
    parameter names per bucket."""
    gm = fx.symbolic_trace(module)
    named = dict(module.named_parameters())
    bucket_of = {id(named[n]): b for b, names in enumerate(groups) for n in names}
    return [set(b) for b in plan_split(gm, [], bucket_of).buckets]


def test_one_piece_per_bucket_in_forward_order() -> None:
    names = [[f"{i}.weight", f"{i}.bias"] for i in (4, 2, 0)]
    assert _split(_model(), names) == [{2}, {1}, {0}]


def test_no_cut_inside_a_bucket_of_several_layers() -> None:
    names = [["4.weight", "4.bias", "2.weight", "2.bias"], ["0.weight", "0.bias"]]
    assert _split(_model(), names) == [{1}, {0}]


def test_a_parameter_read_at_both_ends_keeps_one_piece() -> None:
    assert _split(_Tied(), [["mid.weight", "mid.bias"], ["embed.weight"]]) == [{0, 1}]


def test_a_transposed_parameter_stays_with_its_matmul() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.body = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            wt = self.w.t()  # read first, used after the body
            return self.body(x) @ wt

    # a cut before the transpose or between it and the matmul would part w from its use
    assert _split(Head(), [["w"], ["body.weight", "body.bias"]]) == [{0, 1}]


def test_the_bucket_splitter_survives_a_deep_copy_of_compile_arguments() -> None:
    """Lightning replaces torch.compile with a wrapper that deep-copies its arguments; the
    splitter reads a live model (threads, locks) and must come through as itself."""
    live = {"lock": threading.Lock()}
    splitter = BucketSplitter(live.copy, lambda gm, example_inputs: gm)  # copies its owner
    assert copy.deepcopy({"backend": splitter})["backend"] is splitter
