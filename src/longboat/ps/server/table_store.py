"""``LazyRows``: one server's shard of a lazy sparse table, rows created on first update.

Rows live in slot order (``RowIndex`` maps ids to slots) in tensors that grow by half when
full. A row is created when an update reaches an id its ``Admission`` admits; until then a
lookup returns the row's initial value (``shared.rows.initial_rows``: a pure function of the table's
initial-value key and the id, so a lazy table reads like a preallocated one) and its updates are
dropped. Rows may be stored in float16 or bfloat16: the optimizer gathers the touched rows,
computes in float32 and rounds back; optimizer state stays float32 (Adagrad sums and Adam
moments lose too much in 16 bits). ``shrink`` ends a pass and drops rows no update touched in
the last ``evict_after`` passes. ``save``/``load`` stream the rows in chunks (``row_file``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longboat.ps.server import row_file
from longboat.ps.server.malloc_tuning import keep_buffers
from longboat.ps.server.row_index import RowIndex
from longboat.ps.shared import optim
from longboat.ps.shared.request import RequestError
from longboat.ps.shared.rows import initial_rows, splitmix

_INSERT_ROWS = 1 << 16  # rows moved or put into the index at a time (loading, eviction)
_ADMIT_SALT = 0x5DEECE66D  # keeps the admission draw independent of the initial values


@dataclass(frozen=True)
class Admission:
    """Which ids get a row: after ``count`` updates (count >= 1), or each id with probability
    ``probability``, drawn once per id from (``key``, id) so every trainer and server agrees."""

    count: int = 1
    probability: float = 1.0
    key: int = 0

    def admitted(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each id passes the probability draw (a bool mask)."""
        if self.probability >= 1.0:
            return torch.ones(len(ids), dtype=torch.bool)
        bits = splitmix(splitmix(ids) ^ (self.key ^ _ADMIT_SALT))
        unit = ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
        return unit < self.probability


def admission_draw(ids: torch.Tensor, probability: float, key: int) -> torch.Tensor:
    """The probability admission of ``ids`` (what ``Admission(probability=p, key=k)`` admits)."""
    return Admission(probability=probability, key=key).admitted(ids)


class LazyRows:
    """Rows of ``dim`` stored as ``storage`` (optimizer state float32), created on admission."""

    def __init__(
        self,
        dim: int,
        storage: torch.dtype,
        optimizer: str,
        hparams: dict[str, Any],
        *,
        key: int,
        scale: float,
        admission: Admission,
        evict_after: int = 0,
        expected_rows: int = 0,
        max_bytes: int = 1 << 62,
    ) -> None:
        self.dim, self.storage, self.optimizer, self.hparams = dim, storage, optimizer, hparams
        self.key, self.scale, self.admission, self.evict_after = key, scale, admission, evict_after
        self.max_bytes = max_bytes
        self.compute = torch.promote_types(storage, torch.float32)
        self.index = RowIndex(expected_rows)
        cap = max(expected_rows, 16)
        self.weight = torch.empty(cap, dim, dtype=storage)
        self.state = {s: torch.empty(cap, dim) for s in optim.ROW_STATES[optimizer]}
        self.last_pass = torch.empty(cap, dtype=torch.int32)
        self.passes = 0  # passes ended (shrink calls)
        self.seen = RowIndex()  # count admission: ids updated but not admitted yet
        self.seen_counts = torch.zeros(16, dtype=torch.int32)
        self.seen_pass = torch.zeros(16, dtype=torch.int32)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # ids, slots of a lookup
        keep_buffers()

    def __len__(self) -> int:
        return len(self.index)

    # ---- reads and updates ------------------------------------------------------------------
    def read(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of ``ids`` as ``dtype``: the stored row, or the initial value of ids without one."""
        slots = self._slots(ids)
        found = (slots >= 0).nonzero().squeeze(1)
        if len(found) == len(ids):
            return self.weight[slots].to(dtype)
        out = torch.empty(len(ids), self.dim, dtype=dtype)
        out[found] = self.weight[slots[found]].to(dtype)
        missing = (slots < 0).nonzero().squeeze(1)
        out[missing] = initial_rows(ids[missing], self.dim, self.key, self.scale, dtype)
        return out

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """``index.lookup(ids)``, reusing the previous lookup when ``ids`` are the same (a
        trainer's push follows its pull of the same ids): only its misses are looked up again."""
        last = self._last
        if last is not None and len(last[0]) == len(ids) and torch.equal(last[0], ids):
            slots = last[1].clone()
            miss = (slots < 0).nonzero().squeeze(1)
            if len(miss):
                slots[miss] = self.index.lookup(ids[miss])
        else:
            slots = self.index.lookup(ids)
        self._last = (ids.clone(), slots.clone())
        return slots

    def update(self, ids: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Apply the optimizer to distinct ``ids`` (``grad`` merged per id); ids not admitted
        yet are counted and their gradients dropped."""
        slots = self._slots(ids)
        missing = (slots < 0).nonzero().squeeze(1)
        if len(missing):
            new = ids[missing]
            admit = self.admission.admitted(new)
            if self.admission.count > 1:
                admit &= self._counted(new)
            chosen = admit.nonzero().squeeze(1)
            if len(chosen):
                slots[missing[chosen]] = self._create(new[chosen])
            if len(chosen) < len(missing):
                live = (slots >= 0).nonzero().squeeze(1)
                slots, grad = slots[live], grad[live]
        if not len(slots):
            return
        self.last_pass[slots] = self.passes
        weight = self.weight[slots].to(self.compute)
        state = {k: v[slots] for k, v in self.state.items()}
        optim.update_rows(self.optimizer, weight, state, grad.to(self.compute), self.hparams, step)
        self.weight[slots] = weight.to(self.storage)
        for k, v in state.items():
            self.state[k][slots] = v

    def _counted(self, ids: torch.Tensor) -> torch.Tensor:
        """Count one more update of each of ``ids``; whether each reached the admission count
        (those leave the counter)."""
        slots = self.seen.lookup(ids)
        fresh = slots < 0
        if bool(fresh.any()):
            slots[fresh] = self.seen.insert(ids[fresh])
            need = len(self.seen.slot_ids)
            if need > len(self.seen_counts):
                self.seen_counts = _grown(self.seen_counts, need, len(self.seen) - int(fresh.sum()))
                self.seen_pass = _grown(self.seen_pass, need, len(self.seen) - int(fresh.sum()))
            self.seen_counts[slots[fresh]] = 0
        self.seen_counts[slots] += 1
        self.seen_pass[slots] = self.passes
        done = self.seen_counts[slots] >= self.admission.count
        self.seen_counts[slots[done]] = -1  # admitted: dropped from the counter at the next shrink
        return done

    def _create(self, ids: torch.Tensor) -> torch.Tensor:
        """New rows for ``ids`` at their initial value and fresh optimizer state; their slots."""
        filled = len(self.index)
        if (filled + len(ids)) * self.row_bytes_estimate() > self.max_bytes:
            raise RequestError(
                f"lazy table: {filled + len(ids)} rows would need more than {self.max_bytes} "
                "bytes on this server (evict with shrink, or add servers)"
            )
        slots = self.index.insert(ids)
        self._reserve(len(self.index), filled)
        self.weight[slots] = initial_rows(ids, self.dim, self.key, self.scale, self.storage)
        init = float(self.hparams.get("initial_accumulator_value", 0.0))
        for k, v in self.state.items():
            v[slots] = init if k == "sum" else 0.0
        return slots

    def _reserve(self, rows: int, n: int) -> None:
        """Room for ``rows`` rows, the first ``n`` kept."""
        if rows <= len(self.weight):
            return
        cap = max(rows, len(self.weight) * 3 // 2)
        self.weight = _grown(self.weight, cap, n)
        self.state = {k: _grown(v, cap, n) for k, v in self.state.items()}
        self.last_pass = _grown(self.last_pass, cap, n)

    # ---- passes -----------------------------------------------------------------------------
    def shrink(self) -> int:
        """End a pass: drop the rows no update touched in the last ``evict_after`` passes (0:
        keep all) and the admission counts of ids unseen as long; the number of rows dropped."""
        dropped = 0
        n = len(self.index)
        if self.evict_after > 0 and n:
            keep = self.passes - self.last_pass[:n] < self.evict_after
            dropped = n - int(keep.sum())
            if dropped:
                self._compact(keep)
        m = len(self.seen)
        if m:
            stale = self.passes - self.seen_pass[:m] >= max(self.evict_after, 1)
            keep_seen = self.seen_counts[:m] >= 0
            if self.evict_after > 0:
                keep_seen &= ~stale
            if not bool(keep_seen.all()):
                counts, last = self.seen_counts[:m][keep_seen], self.seen_pass[:m][keep_seen]
                self.seen.rebuild(keep_seen)
                self.seen_counts = torch.zeros(max(len(counts), 16), dtype=torch.int32)
                self.seen_pass = torch.zeros(max(len(counts), 16), dtype=torch.int32)
                self.seen_counts[: len(counts)], self.seen_pass[: len(counts)] = counts, last
        self.passes += 1
        return dropped

    def _compact(self, keep: torch.Tensor) -> None:
        """Keep the rows of the bool mask ``keep`` (in place, slot order kept)."""
        self._last = None
        kept = keep.nonzero().squeeze(1)
        columns = [self.weight, *self.state.values(), self.last_pass]
        # in place, a chunk at a time: kept[i] >= i, so a chunk reads only rows not yet written
        for start in range(0, len(kept), _INSERT_ROWS):
            part = kept[start : start + _INSERT_ROWS]
            for column in columns:
                column[start : start + len(part)] = column[part]
        self.index.rebuild(keep)

    # ---- memory -----------------------------------------------------------------------------
    def row_bytes_estimate(self) -> float:
        """Bytes per row at full capacity: row, optimizer state, last pass, index at 50 %
        load (spare capacity adds up to half of this)."""
        states = len(self.state)
        return self.dim * (self.storage.itemsize + 4 * states) + 4 + 8 + 4 / 0.5

    def stats(self) -> dict[str, Any]:
        """Rows held and bytes used: allocated totals and per live row (against ``4 * dim``,
        a float32 row without optimizer state or index)."""
        rows = len(self)
        weight = self.weight.nbytes
        state = sum(v.nbytes for v in self.state.values()) + self.last_pass.nbytes
        index = self.index.nbytes()
        admission = self.seen.nbytes() + self.seen_counts.nbytes + self.seen_pass.nbytes
        total = weight + state + index + admission
        per_row = rows or 1
        return {
            "rows": rows,
            "capacity": len(self.weight),
            "pending_admission": len(self.seen),
            "bytes": total,
            "bytes_per_row": total / per_row,
            "weight_bytes_per_row": weight / per_row,
            "state_bytes_per_row": state / per_row,
            "index_bytes_per_row": (index + admission) / per_row,
            "float32_row_bytes": 4 * self.dim,
            "storage": str(self.storage).removeprefix("torch."),
        }

    # ---- save and load ----------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the rows, their state and last pass to ``path`` in chunks (``row_file``)."""
        n = len(self)
        columns = {"ids": self.index.slot_ids, "weight": self.weight, "last_pass": self.last_pass}
        columns |= {f"state.{k}": v for k, v in self.state.items()}
        row_file.write(path, n, columns)

    def load(self, path: str | Path) -> None:
        """Replace the rows with those ``save`` wrote to ``path`` (read in chunks)."""
        like = {"ids": (torch.int64, ()), "weight": (self.storage, (self.dim,))}
        like["last_pass"] = (torch.int32, ())
        like |= {f"state.{k}": (torch.float32, (self.dim,)) for k in self.state}
        n, columns = row_file.read(path, like)
        self._last = None
        self.weight, self.last_pass = columns["weight"], columns["last_pass"]
        self.state = {k: columns[f"state.{k}"] for k in self.state}
        self.index = RowIndex(n)
        for start in range(0, n, _INSERT_ROWS):
            self.index.insert(columns["ids"][start : start + _INSERT_ROWS])
        del columns

    def rows_dict(self) -> dict[str, torch.Tensor]:
        """The rows as tensors (a checkpoint without a row file; copies the shard)."""
        n = len(self)
        out = {"ids": self.index.ids.clone(), "weight": self.weight[:n].clone()}
        out["last_pass"] = self.last_pass[:n].clone()
        return out | {f"state.{k}": v[:n].clone() for k, v in self.state.items()}

    def load_rows_dict(self, rows: dict[str, torch.Tensor]) -> None:
        """Replace the rows with a ``rows_dict``."""
        n = len(rows["ids"])
        self._last = None
        self.index = RowIndex(n)
        self.index.insert(rows["ids"])
        self.weight = rows["weight"].to(self.storage).clone()
        self.last_pass = rows["last_pass"].to(torch.int32).clone()
        self.state = {k: rows[f"state.{k}"].float().clone() for k in self.state}

    def extra_state(self, counters: bool = True) -> dict[str, Any]:
        """The rest of the shard for a checkpoint: the pass count and (``counters``) the
        admission counters, else written by ``save_counters``."""
        if not counters:
            return {"passes": self.passes}
        return {"passes": self.passes} | {
            f"seen_{k}": v.clone() for k, v in self._counter_columns().items()
        }

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        self.passes = int(saved["passes"])
        if "seen_ids" in saved:
            self._load_counters(*(saved[f"seen_{k}"] for k in ("ids", "counts", "pass")))

    def _counter_columns(self) -> dict[str, torch.Tensor]:
        """The admission counters: ids updated but not admitted, their counts and last pass."""
        m = len(self.seen)
        return {"ids": self.seen.ids, "counts": self.seen_counts[:m], "pass": self.seen_pass[:m]}

    def save_counters(self, path: str | Path) -> None:
        """Write the admission counters to ``path`` in chunks (``row_file``)."""
        row_file.write(path, len(self.seen), self._counter_columns())

    def load_counters(self, path: str | Path) -> None:
        """Replace the admission counters with those ``save_counters`` wrote to ``path``."""
        like = {"ids": (torch.int64, ()), "counts": (torch.int32, ()), "pass": (torch.int32, ())}
        _, columns = row_file.read(path, like)
        self._load_counters(columns["ids"], columns["counts"], columns["pass"])

    def _load_counters(self, ids: torch.Tensor, counts: torch.Tensor, last: torch.Tensor) -> None:
        self.seen = RowIndex(len(ids))
        for start in range(0, len(ids), _INSERT_ROWS):
            self.seen.insert(ids[start : start + _INSERT_ROWS])
        self.seen_counts = torch.zeros(max(len(ids), 16), dtype=torch.int32)
        self.seen_pass = torch.zeros(max(len(ids), 16), dtype=torch.int32)
        self.seen_counts[: len(ids)] = counts
        self.seen_pass[: len(ids)] = last


def _grown(t: torch.Tensor, rows: int, filled: int) -> torch.Tensor:
    """``t`` with room for ``rows`` rows, its first ``filled`` rows kept."""
    out = torch.empty(rows, *t.shape[1:], dtype=t.dtype)
    out[:filled] = t[:filled]
    if t.dtype == torch.int32:
        out[filled:] = 0
    return out
