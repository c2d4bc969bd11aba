"""``row_sparse_pull`` on real servers moves only the rows asked: its results equal the rows of a
full pull (sorted, unsorted and repeated ids, lists of outputs and keys, before and after
pushes), the servers' replies carry those rows and no others (their frame sizes, counted on the
servers), and bad ids are refused naming the key and the id. 2 workers (threads), 2 servers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import longboat.kvstore as kvstore
from longboat.ps.server import Server
from longboat.ps.server.local import LocalServers
from longboat.ps.shared import wire
from longboat.ps.shared.request import RequestError
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.kv import KVClient
from tests.compat.test_kvstore_semantics import _on_workers

ROWS, DIM = 4096, 16  # 64 Ki elements: two blocks of 2048 rows, one per server
ROW_BYTES = DIM * 4
FRAME_OVERHEAD = 256  # header, meta and the entry's name and shape: far below one row count


def _table(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))


IDS = {
    "sorted": torch.tensor([1, 7, 2047, 2048, 4095]),
    "unsorted": torch.tensor([4095, 3, 2050, 0, 1999]),
    "repeated": torch.tensor([9, 9, 3000, 9, 3000, 5]),
    "one block": torch.tensor([100, 101, 102]),
    "empty": torch.tensor([], dtype=torch.int64),
}


def _rows(kv: Any, key: Any, ids: torch.Tensor) -> kvstore.RowSparse:
    out = kvstore.RowSparse.zeros((ROWS, DIM))
    kv.row_sparse_pull(key, out=out, row_ids=ids)
    return out


def _check_equals_full_pull(out: kvstore.RowSparse, full: torch.Tensor, ids: torch.Tensor) -> None:
    want = torch.unique(ids)
    assert out.indices.tolist() == want.tolist()
    assert torch.equal(out.data, full[want])


@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_row_sparse_pull_equals_the_rows_of_a_full_pull_before_and_after_pushes(kind):
    def body(kv):
        kv.init(["emb", "small"], [_table(0), torch.arange(12.0).reshape(6, 2)])
        results = []
        for step in range(2):
            kv.barrier()  # no push between the full pull and the row pulls
            full, small = kv.pull("emb"), kv.pull("small")
            for ids in IDS.values():
                _check_equals_full_pull(_rows(kv, "emb", ids), full, ids)
            outs = [kvstore.RowSparse.zeros((ROWS, DIM)) for _ in range(2)]
            kv.row_sparse_pull("emb", out=outs, row_ids=[IDS["unsorted"], IDS["repeated"]])
            _check_equals_full_pull(outs[0], full, IDS["unsorted"])
            _check_equals_full_pull(outs[1], full, IDS["repeated"])
            pair = [kvstore.RowSparse.zeros((ROWS, DIM)), kvstore.RowSparse.zeros((6, 2))]
            kv.row_sparse_pull(["emb", "small"], out=pair,
                               row_ids=[IDS["sorted"], torch.tensor([5, 0, 5])])  # fmt: skip
            _check_equals_full_pull(pair[0], full, IDS["sorted"])
            _check_equals_full_pull(pair[1], small, torch.tensor([0, 5]))
            results.append(full)
            kv.barrier()
            kv.push("emb", _table(10 * step + kv.rank + 1))  # the value changes
        return results

    for before, after in _on_workers(kind, body, n_servers=2):
        assert torch.equal(before, _table(0)) and not torch.equal(after, before)


def test_only_the_rows_asked_leave_the_servers(monkeypatch):
    """Every pull reply is recorded on the server that sends it: a row pull's reply holds
    its rows (bytes proportional to them), only servers holding them answer, and a full pull
    moves the table."""
    replies: list[tuple[int, str, int]] = []  # (server, what, reply bytes)
    lock = threading.Lock()
    answer = Server.answer

    def recording(self: Server, method: str, frame: bytes | None, deadline: float) -> bytes:
        reply = answer(self, method, frame, deadline)
        if method == "pull" and frame is not None:
            asked = wire.decode(frame).tensors
            what = f"rows:{sum(t.numel() for t in asked.values())}" if asked else "full"
            with lock:
                replies.append((self.index, what, len(reply)))
        return reply

    monkeypatch.setattr(Server, "answer", recording)
    phases: dict[str, list[tuple[int, str, int]]] = {}

    def body(kv):
        kv.init("emb", _table(0))
        for name, ids in [("few", IDS["one block"]), ("more", torch.arange(0, 300, 3)),
                          ("spread", IDS["sorted"]), ("full", None)]:  # fmt: skip
            kv.barrier()
            if kv.rank == 0:
                replies.clear()
                if ids is None:
                    kv.pull("emb")
                else:
                    _rows(kv, "emb", ids)
                phases[name] = list(replies)
            kv.barrier()

    _on_workers("dist_sync", body, n_servers=2)
    few, more, spread, full = (phases[p] for p in ("few", "more", "spread", "full"))
    assert [w for _, w, _ in few] == ["rows:3"] and [w for _, w, _ in more] == ["rows:100"]
    for (_, _, nbytes), rows in [(few[0], 3), (more[0], 100)]:
        assert rows * ROW_BYTES <= nbytes < rows * ROW_BYTES + FRAME_OVERHEAD
    assert more[0][2] - few[0][2] == 97 * ROW_BYTES  # linear in the rows, nothing else
    assert sorted(s for s, _, _ in spread) == [0, 1]  # rows in both blocks: both servers
    assert sorted(w for _, w, _ in spread) == ["rows:2", "rows:3"]
    assert sum(n for _, _, n in spread) < 5 * ROW_BYTES + 2 * FRAME_OVERHEAD
    assert sum(n for _, _, n in full) >= ROWS * ROW_BYTES  # a full pull moves the table


def test_bad_row_ids_are_refused_naming_the_key_and_the_id():
    def body(kv):
        kv.init("emb", _table(0))
        errors = []
        for ids in (torch.tensor([3, ROWS]), torch.tensor([-1, 2])):
            with pytest.raises(kvstore.InvalidArgumentError) as info:
                _rows(kv, "emb", ids)
            errors.append(str(info.value))
        return errors

    for errors in _on_workers("dist_sync", body, n_servers=2):
        assert errors == [
            f"row_sparse_pull 'emb': row id {ROWS} is not in [0, {ROWS})",
            f"row_sparse_pull 'emb': row id -1 is not in [0, {ROWS})",
        ]


def test_servers_refuse_block_rows_that_are_unsorted_repeated_or_out_of_range():
    local = LocalServers(1)
    state = local.states[0]
    state.init(Message({"blocks": [{"key": "b", "update": "assign"}]}, {"b": torch.ones(4, 2)}))
    reply = wire.decode(state.pull(Message({}, {"b@ids": torch.tensor([0, 3])}), 1e18))
    assert torch.equal(reply.tensors["b@rows"], torch.ones(2, 2))
    for bad in ([3, 0], [1, 1], [4], [-1]):
        with pytest.raises(RequestError, match=r"sorted, unique and in \[0, 4\)"):
            state.pull(Message({}, {"b@ids": torch.tensor(bad)}), 1e18)
    with pytest.raises(RequestError, match="no table or block 'nope'"):
        state.pull(Message({}, {"nope@ids": torch.tensor([0])}), 1e18)


def test_kv_client_pull_rows_keeps_the_order_and_repeats_asked_over_several_blocks():
    kv = KVClient(LocalServers(3), min_block_size=4)
    values = {"m": torch.arange(60.0).reshape(10, 3, 2), "v": torch.arange(9.0)}
    for key, value in values.items():
        kv.init(key, value)
    assert [len(kv._layout[k][2]) for k in values] == [3, 2]  # blocks of >= 4 elements
    ids = {"m": torch.tensor([9, 0, 4, 9, 5]), "v": [8, 8, 1]}
    got = kv.pull_rows_many(ids)
    for key, value in values.items():
        assert torch.equal(got[key], value[torch.as_tensor(ids[key])])
    with pytest.raises(TypeError, match="'v': row ids must be integers"):
        kv.pull_rows("v", torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"kv key 'm': row id 10 is not in \[0, 10\)"):
        kv.pull_rows("m", torch.tensor([10]))
