"""Sync mode equals single-process training on the global batch (2 trainers + 2 servers)."""

from __future__ import annotations

import contextlib

import torch

from tests._dist import run_ranks
from tests.collective import _workloads as W
from tests.ps import _trainers as T
from tests.ps._harness import servers

WORLD = 2
DENSE_CASES = [  # (optimizer, optimizer on the servers, pushes from backward hooks, PSConfig)
    ("sgd", True, True, {}),  # momentum SGD on the servers
    ("adam", True, False, {}),
    ("adagrad", True, True, {}),
    ("sgd", False, True, {}),  # servers only average; trainers run the optimizer
    # several push buckets a step, only the last asking for the next values; tuned: merged
    # into one after the timed steps (this model's backward is far shorter than 4 ms a bucket)
    ("sgd", True, True, {"bucket_bytes": 256}),
    ("sgd", False, True, {"bucket_bytes": 256, "tune_buckets": False}),
]
SPARSE_CASES = ["sgd", "adagrad", "adam"]


def _reference(opt_name: str) -> dict[str, torch.Tensor]:
    """Single-process training on the global batch, on one intra-op thread whatever an earlier
    test in this process set (Lightning sets the thread count from the cores it sees)."""
    cfg = W.Config(optimizer="adam" if opt_name == "adam" else "sgd")
    model = W.build_model(cfg, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return W.train_global_batch(model, T.dense_optimizer(opt_name, model), cfg, WORLD)
    finally:
        torch.set_num_threads(threads)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], case: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{case} {n}: {m}"
        )


def _run(fn_name: str, cases: list[tuple]) -> list[list[dict[str, torch.Tensor]]]:
    """Every case on its own pair of servers, all cases in one spawn of the trainers."""
    with contextlib.ExitStack() as stack:
        jobs = [(*stack.enter_context(servers(2)), *case) for case in cases]
        per_rank = run_ranks(T.run_each, WORLD, fn_name, jobs, timeout=150)
    return [[per_rank[r][i] for r in range(WORLD)] for i in range(len(cases))]


def test_dense_sync_matches_global_batch() -> None:
    for case, results in zip(DENSE_CASES, _run("train_dense", DENSE_CASES), strict=True):
        want = _reference(case[0])
        for rank, got in enumerate(results):
            _assert_close(got, want, f"{case} trainer {rank}")


def test_sparse_sync_matches_global_batch() -> None:
    cases = [(name,) for name in SPARSE_CASES]
    for (name,), results in zip(cases, _run("train_sparse", cases), strict=True):
        want = T.sparse_reference(name, WORLD)
        assert not torch.equal(want["table"], T.sparse_table(name).initial_weight())  # trained
        for rank, got in enumerate(results):
            _assert_close(got, want, f"{name} trainer {rank}")
