"""Lazy sparse tables: admission, eviction, half-precision rows, streaming checkpoints, and
equality with preallocated tables (in-process ``ServerState`` shards, and one gRPC job)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from longboat.ps.server import checkpoint
from longboat.ps.server.state import ServerState
from longboat.ps.server.table_store import _ADMIT_SALT
from longboat.ps.shared import wire
from longboat.ps.shared.rows import initial_rows
from longboat.ps.shared.wire import Message

DIM, KEY, SCALE = 4, 7, 0.1
U64 = (1 << 64) - 1


def _spec(optimizer: str = "sgd", rows: int = 0, **extra: Any) -> dict[str, Any]:
    lazy = {"lazy": True} if not rows or extra else {}
    return {"name": "t", "rows": rows, "dim": DIM, "optimizer": optimizer,
            "hparams": {"lr": 0.5}, "seed": KEY, "scale": SCALE, **lazy, **extra}  # fmt: skip


class Shards:
    """One table over ``n`` in-process servers, pulled and pushed as a trainer would."""

    def __init__(self, spec: dict[str, Any], n: int = 2) -> None:
        self.states = [ServerState(i, n) for i in range(n)]
        for s in self.states:
            s.init(Message({"trainers": 1, "tables": [spec]}))

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(ids), DIM)
        n = len(self.states)
        for i, s in enumerate(self.states):
            mask = ids % n == i
            reply = wire.decode(
                s.pull(Message({"keys": []}, {"t@ids": ids[mask]}), time.monotonic() + 10)
            )
            out[mask] = reply.tensors["t@rows"].float()
        return out

    def push(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        n = len(self.states)
        for i, s in enumerate(self.states):
            mask = ids % n == i
            s.push(Message({"trainer": 0, "step": 0}, {"t@ids": ids[mask], "t@grad": grad[mask]}))

    def shrink(self) -> int:
        return sum(s.shrink(None)["t"] for s in self.states)

    def rows(self) -> int:
        return sum(s.table_stats()["t"]["rows"] for s in self.states)


def _batches(steps: int, id_range: int, size: int = 64, gen_key: int = 0):
    g = torch.Generator().manual_seed(gen_key)
    for _ in range(steps):
        ids = torch.randint(0, id_range, (size,), generator=g)
        yield ids, torch.randn(size, DIM, generator=g)


def _train(shards: Shards, steps: int, id_range: int, gen_key: int = 0) -> None:
    for ids, grad in _batches(steps, id_range, gen_key=gen_key):
        uniq, inverse = torch.unique(ids, return_inverse=True)
        merged = torch.zeros(len(uniq), DIM).index_add_(0, inverse, grad)
        shards.push(uniq, merged)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_lazy_table_matches_preallocated(optimizer: str) -> None:
    dense, lazy = Shards(_spec(optimizer, rows=500)), Shards(_spec(optimizer))
    for shards in (dense, lazy):
        _train(shards, 30, 500)
    ids = torch.arange(500)
    assert not torch.allclose(dense.pull(ids), initial_rows(ids, DIM, KEY, SCALE, torch.float32))
    torch.testing.assert_close(lazy.pull(ids), dense.pull(ids), rtol=0, atol=1e-6)
    assert 0 < lazy.rows() < 500  # rows only for the ids updated


def test_count_admission_matches_reference() -> None:
    need, lr = 3, 0.5
    shards = Shards(_spec(admission={"count": need}))
    weight = initial_rows(torch.arange(300), DIM, KEY, SCALE, torch.float32).clone()
    counts = [0] * 300
    for ids, grad in _batches(40, 300):
        uniq, inverse = torch.unique(ids, return_inverse=True)
        merged = torch.zeros(len(uniq), DIM).index_add_(0, inverse, grad)
        shards.push(uniq, merged)
        for i, row in zip(uniq.tolist(), merged, strict=True):
            counts[i] += 1
            if counts[i] >= need:
                weight[i] -= lr * row
    torch.testing.assert_close(shards.pull(torch.arange(300)), weight, rtol=0, atol=1e-6)
    assert shards.rows() == sum(c >= need for c in counts)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def test_probability_admission_matches_reference() -> None:
    p = 0.3
    shards = Shards(_spec(admission={"probability": p}))
    ids = torch.cat([torch.arange(2000), torch.tensor([-5, -(1 << 62), (1 << 62) + 3])])
    shards.push(ids, torch.ones(len(ids), DIM))
    admitted = [
        (_splitmix64(_splitmix64(i & U64) ^ (KEY ^ _ADMIT_SALT)) >> 11) / float(1 << 53) < p
        for i in ids.tolist()
    ]
    want = initial_rows(ids, DIM, KEY, SCALE, torch.float32)
    want[torch.tensor(admitted)] -= 0.5
    torch.testing.assert_close(shards.pull(ids), want, rtol=0, atol=1e-6)
    assert shards.rows() == sum(admitted)
    assert abs(sum(admitted) / len(ids) - p) < 0.05


def test_shrink_drops_exactly_the_unseen_rows_and_keeps_the_others() -> None:
    shards = Shards(_spec("adagrad", evict_after=2))
    kept, stale = torch.arange(0, 40), torch.arange(40, 100)
    shards.push(torch.arange(100), torch.randn(100, DIM))
    assert shards.shrink() == 0  # pass 0 ends
    shards.push(kept, torch.randn(40, DIM))
    assert shards.shrink() == 0  # stale rows unseen for 1 pass: kept
    shards.push(kept, torch.randn(40, DIM))
    before = shards.pull(kept)
    sums = {int(i): s.tables["t"].lazy.state["sum"][s.tables["t"].lazy.index.lookup(
        torch.tensor([int(i)]))].clone() for s in shards.states for i in kept
        if int(i) % 2 == s.index}  # fmt: skip
    assert shards.shrink() == len(stale)  # unseen for 2 passes
    assert shards.rows() == len(kept)
    torch.testing.assert_close(shards.pull(kept), before, rtol=0, atol=0)
    for s in shards.states:
        lazy = s.tables["t"].lazy
        for i in kept[kept % 2 == s.index].tolist():
            slot = lazy.index.lookup(torch.tensor([i]))
            assert torch.equal(lazy.state["sum"][slot], sums[i])
    fresh = initial_rows(stale, DIM, KEY, SCALE, torch.float32)
    torch.testing.assert_close(shards.pull(stale), fresh, rtol=0, atol=0)


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_precision_rows_train_close_to_float32(storage: str) -> None:
    full, half = Shards(_spec("adagrad")), Shards(_spec("adagrad", storage=storage))
    for shards in (full, half):
        _train(shards, 40, 200)
    ids = torch.arange(200)
    moved = (full.pull(ids) - initial_rows(ids, DIM, KEY, SCALE, torch.float32)).abs().max()
    diff = (half.pull(ids) - full.pull(ids)).abs().max()
    assert diff < 0.02 * moved.item() + 2e-3, (diff, moved)
    stats = half.states[0].table_stats()["t"]
    assert stats["storage"] == storage and stats["float32_row_bytes"] == 4 * DIM


def _rss_peak_reset() -> int | None:
    """Reset the peak RSS; the current RSS (bytes), or None where Linux does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_streaming_save_load_round_trips_within_a_tenth_of_the_table(tmp_path: Path) -> None:
    rows, dim = 600_000, 16
    state = ServerState(0, 1)
    spec = {**_spec("adagrad", evict_after=3, admission={"count": 1}), "dim": dim}
    state.init(Message({"trainers": 1, "tables": [spec]}))
    ids = torch.randperm(rows * 4)[:rows] * 7 - 1_000_000
    state.push(Message({"trainer": 0}, {"t@ids": ids, "t@grad": torch.randn(rows, dim)}))
    state.shrink(None)
    lazy = state.tables["t"].lazy
    table_bytes = lazy.stats()["bytes"]
    before = _rss_peak_reset()
    checkpoint.save_streaming(tmp_path, 0, 5, state)
    if before is not None:
        extra = _status("VmHWM") - before
        assert extra <= 0.1 * table_bytes, (extra, table_bytes)
    restored = ServerState(0, 1)
    restored.load_state_dict(checkpoint.load(tmp_path, 0), tmp_path)
    got = restored.tables["t"].lazy
    assert len(got) == rows and got.passes == lazy.passes
    slots = got.index.lookup(lazy.index.ids)
    assert bool((slots >= 0).all())
    assert torch.equal(got.weight[slots], lazy.weight[:rows])
    assert torch.equal(got.state["sum"][slots], lazy.state["sum"][:rows])
    assert torch.equal(got.last_pass[slots], lazy.last_pass[:rows])
    probe = ids[:1000]
    assert torch.equal(got.read(probe, torch.float32), lazy.read(probe, torch.float32))


def test_lazy_table_over_grpc_stats_shrink_save_restore(tmp_path: Path) -> None:
    from longboat.ps.trainer import table_admin
    from longboat.ps.trainer.client import Client
    from tests.ps._harness import servers

    spec = _spec("adagrad", evict_after=1, storage="float16")
    ids = torch.tensor([3, 10, -8, 1 << 40, 77])
    with servers(2, checkpoint_dir=tmp_path) as (endpoints, token):
        client = Client(endpoints, token)
        init = Message({"trainers": 1, "tables": [spec]})
        client.call_all("init", {0: init, 1: init})

        def push(which: torch.Tensor) -> None:
            for s in range(2):
                m = which % 2 == s
                msg = {"t@ids": which[m], "t@grad": torch.ones(int(m.sum()), DIM)}
                client.call(s, "push", Message({"trainer": 0, "step": 0}, msg))

        def pull() -> torch.Tensor:
            out = torch.empty(len(ids), DIM)
            for s in range(2):
                m = ids % 2 == s
                out[m] = client.call(s, "pull", Message({"keys": []}, {"t@ids": ids[m]})).tensors[
                    "t@rows"
                ]
            return out

        push(ids)
        stats = table_admin.table_stats(client)
        assert sum(st["t"]["rows"] for st in stats.values()) == len(ids)
        assert stats[0]["t"]["float32_row_bytes"] == 4 * DIM
        assert table_admin.shrink(client=client) == {"t": 0}
        push(ids[:2])
        assert table_admin.shrink(client=client) == {"t": 3}
        trained = pull()
        client.call_all("save", {0: Message(), 1: Message()})
        client.close()
    assert list(tmp_path.glob("*.rows"))
    with servers(2, checkpoint_dir=tmp_path) as (endpoints, token):
        client = Client(endpoints, token)
        assert torch.equal(pull(), trained)
        client.close()


def test_sparse_embedding_lazy_spec_builds_a_lazy_shard() -> None:
    from longboat.ps.trainer.sparse import SparseEmbedding

    emb = SparseEmbedding(
        None, DIM, "t", optimizer="adam", admit_count=2, evict_after=3,
        storage_dtype=torch.bfloat16, expected_rows=1000,
    )  # fmt: skip
    state = ServerState(1, 2)
    state.init(Message({"trainers": 1, "tables": [emb.spec()]}))
    lazy = state.tables["t"].lazy
    assert lazy is not None and lazy.storage == torch.bfloat16 and lazy.evict_after == 3
    assert lazy.admission.count == 2 and len(lazy.weight) >= 500
    with pytest.raises(ValueError, match="lazy=True"):
        SparseEmbedding(10, DIM, "d", admit_count=2)


def test_lazy_table_in_a_plain_state_dict_round_trips() -> None:
    shards = Shards(_spec("adam", admission={"count": 2}, evict_after=1))
    _train(shards, 10, 300)
    restored = [ServerState(i, 2) for i in range(2)]
    for old, new in zip(shards.states, restored, strict=True):
        new.load_state_dict(old.state_dict())
    ids = torch.arange(300)
    copy = Shards.__new__(Shards)
    copy.states = restored
    assert torch.equal(copy.pull(ids), shards.pull(ids))
    _train(shards, 5, 300, gen_key=1)
    _train(copy, 5, 300, gen_key=1)
    assert torch.equal(copy.pull(ids), shards.pull(ids))
    assert copy.shrink() == shards.shrink()


def train_lazy_job(
    rank: int, world: int, jobs: list[tuple[list[str], str, str]]
) -> list[dict[str, torch.Tensor]]:
    """``_trainers.train_sparse`` with a lazy table (no row count) in place of the preallocated
    one, for each (servers, token, optimizer) job in turn (a spawned trainer)."""
    import torch.nn.functional as F

    import longboat as lb
    from longboat.ps.trainer.sparse import SparseEmbedding
    from tests.collective import _workloads as W
    from tests.ps import _trainers as T

    out = []
    for eps, token, opt_name in jobs:
        lr = 1e-2 if opt_name == "adam" else 0.1
        table = SparseEmbedding(
            None, T.DIM, f"emb{opt_name}", optimizer=opt_name, lr=lr, seed=3, dtype=torch.float64
        )
        model = T.SparseNet(table)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m, opt = lb.ps.distribute(model, opt, T.ps_strategy(a_sync=False), servers=eps,
                                  trainer=rank, trainers=world, token=token)  # fmt: skip
        ids, y = T.sparse_data()
        for i in range(W.STEPS):
            opt.zero_grad()
            F.cross_entropy(m(W.shard(ids[i], rank, world)), W.shard(y[i], rank, world)).backward()
            opt.step()
        with torch.no_grad():
            rows = table(torch.arange(T.VOCAB))
        m.engine.close()
        out.append({"head.weight": model.head.weight.detach().clone(),
                    "head.bias": model.head.bias.detach().clone(), "table": rows})  # fmt: skip
    return out


def test_lazy_table_in_a_sync_job_matches_the_single_process_reference() -> None:
    """Two trainers, two servers, a lazy ``SparseEmbedding(None, ...)``: equal to plain torch
    (``nn.Embedding`` + the table's optimizer) on the global batch."""
    from tests._dist import run_ranks
    from tests.ps import _trainers as T
    from tests.ps._harness import servers

    names = ["adagrad", "adam"]
    with contextlib.ExitStack() as stack:
        jobs = [(*stack.enter_context(servers(2)), name) for name in names]
        per_rank = run_ranks(train_lazy_job, 2, jobs, timeout=300)
    for i, name in enumerate(names):
        want = T.sparse_reference(name, 2)
        for rank in range(2):
            got = per_rank[rank][i]
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_shrink_of_many_chunks_keeps_each_row_with_its_id() -> None:
    from longboat.ps.server.table_store import Admission, LazyRows

    rows = LazyRows(2, torch.float32, "adagrad", {"lr": 1.0, "lr_decay": 0.0, "eps": 1e-10,
                    "initial_accumulator_value": 0.0}, key=1, scale=0.1,
                    admission=Admission(), evict_after=1)  # fmt: skip
    ids = torch.randperm(300_000) * 3
    grad = torch.stack([ids.double(), -ids.double()], 1).float()
    rows.update(ids, grad, 1)
    rows.shrink()
    kept = ids[ids % 2 == 0]
    rows.update(kept, grad[ids % 2 == 0], 2)
    before = rows.read(kept, torch.float32)
    assert rows.shrink() == len(ids) - len(kept)
    assert len(rows) == len(kept)
    assert torch.equal(rows.read(kept, torch.float32), before)
    slots = rows.index.lookup(kept)
    want_sum = 2 * torch.stack([kept.float() ** 2, kept.float() ** 2], 1)
    assert torch.equal(rows.state["sum"][slots], want_sum)


def test_a_moved_checkpoint_directory_restores_its_lazy_tables(tmp_path: Path) -> None:
    """Row files (rows, admission counters) are named relative to their checkpoint: move the
    directory, restore from the new place (the old one is gone), and rows and counts are back."""
    spec = _spec("adagrad", admission={"count": 2})
    shards = Shards(spec, n=1)
    _train(shards, 6, 200)
    checkpoint.save_streaming(tmp_path / "old", 0, 6, shards.states[0])
    (tmp_path / "old").rename(tmp_path / "new")
    saved = checkpoint.load(tmp_path / "new", 0)
    assert saved is not None
    table = saved["tables"]["t"]
    assert not Path(table["rows_file"]).is_absolute()
    assert "seen_ids" not in table["lazy"]  # the admission counters are in a row file too
    assert (tmp_path / "new" / table["counters_file"]).is_file()
    restored = ServerState(0, 1)
    restored.load_state_dict(saved, tmp_path / "new")
    copy = Shards.__new__(Shards)
    copy.states = [restored]
    ids = torch.arange(200)
    assert torch.equal(copy.pull(ids), shards.pull(ids))
    counts = [s.table_stats()["t"] for s in (restored, shards.states[0])]
    got, want = ((c["rows"], c["pending_admission"]) for c in counts)
    assert got == want and got[0] > 0


def test_a_restored_lazy_table_keeps_its_byte_limit(tmp_path: Path) -> None:
    """A server's limit on a table's bytes holds for the rows created after a restore as it
    did before (a restored table used to have none)."""
    limit = 40_000
    state = ServerState(0, 1, max_table_bytes=limit)
    state.init(Message({"trainers": 1, "tables": [_spec("adagrad", admission={"count": 1})]}))
    row_bytes = state.tables["t"].lazy.row_bytes_estimate()
    fits = int(limit // row_bytes)

    def push(target: ServerState, ids: torch.Tensor) -> None:
        grads = torch.ones(len(ids), DIM)
        target.push(Message({"trainer": 0}, {"t@ids": ids, "t@grad": grads}))

    push(state, torch.arange(fits - 10))
    checkpoint.save_streaming(tmp_path, 0, 1, state)
    restored = ServerState(0, 1, max_table_bytes=limit)
    restored.load_state_dict(checkpoint.load(tmp_path, 0), tmp_path)
    for target in (state, restored):
        with pytest.raises(Exception, match=f"more than {limit} bytes"):
            push(target, torch.arange(fits, fits + 20))
        push(target, torch.arange(fits - 10, fits))  # what still fits is created
        assert len(target.tables["t"].lazy) == fits
