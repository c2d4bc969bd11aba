"""A sync job with sparse tables (preallocated and lazy, count and probability admission,
eviction, Adagrad) rides out a killed parameter server: the trainers replay their logged dense
and sparse pushes (and a pass end, ``shrink``), and the final dense parameters, table rows and
admission decisions equal those of the same job run without the failure."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import longboat as lb
from longboat.ps.shared.auth import generate_token
from longboat.ps.trainer import table_admin
from longboat.ps.trainer.client import PSError
from longboat.ps.trainer.sparse import SparseEmbedding
from tests.ps._harness import server_processes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
]  # slow tier: killed and restarted servers with sparse tables

DIM, CLASSES, BATCH, SLOT_IDS = 4, 3, 8, 5
STEPS, EVERY, KILL_AT = 12, 3, 8  # server 1 dies after step 7: its newest checkpoint is step 6
SHRINK_AFTER = (3, 6)  # trainer 0 ends a pass after these steps (the second one is replayed)
WORLD = 2


class CTRNet(nn.Module):
    """Three slots, one table each: preallocated, lazy with count admission and eviction, lazy
    with probability admission (hashed int64 ids); all Adagrad, under a dense linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = SparseEmbedding(64, DIM, "pre", optimizer="adagrad", lr=0.1, seed=3)
        self.counted = SparseEmbedding(
            None, DIM, "counted", optimizer="adagrad", lr=0.1, seed=4, admit_count=2,
            evict_after=1,
        )  # fmt: skip
        self.drawn = SparseEmbedding(
            None, DIM, "drawn", optimizer="adagrad", lr=0.1, seed=5, admit_probability=0.5
        )
        torch.manual_seed(1)
        self.head = nn.Linear(3 * DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        parts = [table(slot_ids(ids, k)).mean(1) for k, table in enumerate(self.tables())]
        return self.head(torch.cat(parts, 1))

    def tables(self) -> list[SparseEmbedding]:
        return [self.pre, self.counted, self.drawn]


def slot_ids(ids: torch.Tensor, slot: int) -> torch.Tensor:
    """The ids of ``slot`` (raw ids 0..63, hashed to large int64 ids for the lazy tables)."""
    raw = ids[:, slot]
    return raw if slot == 0 else raw * 1_000_003 + (slot << 40)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (STEPS, BATCH, 3, SLOT_IDS), generator=g)
    return ids, torch.randint(0, CLASSES, (STEPS, BATCH), generator=g)


IDS, LABELS = _data()

Trainer = tuple[CTRNet, Any, Any]


def _trainers(eps: list[str], token: str) -> list[Trainer]:
    models = [CTRNet() for _ in range(WORLD)]  # global RNG: not in threads

    def make(rank: int) -> Trainer:
        m, opt = lb.ps.distribute(
            models[rank],
            torch.optim.SGD(models[rank].parameters(), lr=0.1),
            lb.Strategy(mode="ps", a_sync=False),
            servers=eps,
            trainer=rank,
            trainers=WORLD,
            token=token,
            timeout=60,  # a loaded machine is slow: no call should end at its deadline
            recovery_window=2 * EVERY,
        )
        return models[rank], m, opt

    with ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(make, range(WORLD)))


def _each(trainers: list[Trainer], fn: Callable[[int, Trainer], Any]) -> list[Any]:
    with ThreadPoolExecutor(WORLD) as pool:
        return list(pool.map(lambda r: fn(r, trainers[r]), range(WORLD)))


def _step(trainers: list[Trainer], i: int) -> None:
    _steps(trainers, range(i, i + 1))


def _steps(trainers: list[Trainer], steps: range) -> None:
    """``steps`` on every trainer, each running its own loop (a server failure one trainer
    meets in ``step()`` another may meet in its next forward, as separate processes would)."""

    def loop(rank: int, t: Trainer) -> BaseException | None:
        _, m, opt = t
        per = BATCH // WORLD
        rows = slice(rank * per, (rank + 1) * per)
        try:
            for i in steps:
                opt.zero_grad()
                F.cross_entropy(m(IDS[i, rows]), LABELS[i, rows]).backward()
                opt.step()
        except PSError as exc:
            return exc
        return None

    assert _each(trainers, loop) == [None] * WORLD


def _final(trainers: list[Trainer]) -> dict[str, Any]:
    """Trainer 0's dense parameters, every table's rows of every id the data uses, and each
    server's row and pending-admission counts per table."""
    model, m, _ = trainers[0]
    m.engine.synchronize()
    out: dict[str, Any] = {n: p.detach().clone() for n, p in model.head.named_parameters()}
    with torch.no_grad():
        for k, table in enumerate(model.tables()):
            out[table.name] = table(slot_ids(IDS.flatten(0, 1), k).flatten().unique())
    stats = table_admin.table_stats(m.engine.client)
    out["counts"] = {
        (s, name): (st.get("rows"), st.get("pending_admission"))
        for s, tables in stats.items()
        for name, st in tables.items()
    }
    return out


@contextlib.contextmanager
def _job(tmp_path: Path) -> Iterator[tuple[list[Any], list[Trainer]]]:
    """Two server processes (checkpoint every EVERY steps) and two trainer threads."""
    token = generate_token()
    env = {"LONGBOAT_PS_CHECKPOINT_EVERY": str(EVERY)}
    with server_processes(WORLD, token, checkpoint_dir=tmp_path, env=env) as procs:
        trainers = _trainers([p.endpoint for p in procs], token)
        try:
            yield procs, trainers
        finally:
            with contextlib.suppress(PSError):
                _each(trainers, lambda _, t: t[1].engine.close())


def _train(tmp_path: Path, kill: Callable[[list[Any]], threading.Timer | None] | None) -> Any:
    with _job(tmp_path) as (procs, trainers):
        dropped = []
        for i in range(KILL_AT):
            _step(trainers, i)
            if i in SHRINK_AFTER:
                dropped.append(trainers[0][1].engine.shrink())
        assert dropped[-1]["counted"] > 0, dropped  # the replayed pass end evicts rows
        _each(trainers, lambda _, t: t[1].engine.synchronize())
        back = kill(procs) if kill is not None else None
        _steps(trainers, range(KILL_AT, STEPS))
        if back is not None:
            back.join()
        assert [t[1].engine.step_no for t in trainers] == [STEPS] * WORLD
        return _final(trainers)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job without a failure."""
    return _train(tmp_path_factory.mktemp("reference"), None)


def _kill_then_restart_later(procs: list[Any]) -> threading.Timer:
    """Server 1 dies; it is back after the trainers' calls to it have failed."""
    procs[1].kill()
    back = threading.Timer(1.5, procs[1].restart)
    back.start()
    return back


def _kill_and_restart_now(procs: list[Any]) -> None:
    """Server 1 dies and is back from step 6 before the trainers call it again: their pulls
    of step 8 reach a server that lost steps 6 and 7, which refuses them at once."""
    procs[1].restart()


@pytest.mark.parametrize("kill", [_kill_then_restart_later, _kill_and_restart_now])
def test_sparse_tables_recover_from_a_killed_server_without_losing_updates(
    tmp_path: Path,
    reference: dict[str, Any],
    kill: Callable[[list[Any]], Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="longboat.ps"):
        got = _train(tmp_path, kill)
    assert "parameter server 1 is back; replayed steps 6..7" in caplog.text, caplog.text
    if kill is _kill_and_restart_now:  # refused at once, not after the call's deadline
        assert "failed (FAILED_PRECONDITION)" in caplog.text, caplog.text
    assert got["counts"] == reference["counts"]  # the same admission decisions
    for key in ("weight", "bias", "pre", "counted", "drawn"):
        torch.testing.assert_close(got[key], reference[key], rtol=1e-5, atol=1e-5)
    lazy = {key: n for key, n in got["counts"].items() if key[1] != "pre"}
    assert all(rows > 0 for rows, _ in lazy.values()), lazy  # the lazy tables created rows
    assert any(pending > 0 for _, pending in lazy.values()), lazy  # and counted admissions
