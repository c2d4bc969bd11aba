"""``RowIndex``: a vectorized map from int64 row ids to dense slots 0..n-1 (lazy sparse tables).

An open-addressing hash table in torch: ``buckets`` (int32, a power of two, at most half full)
holds slots, ``ids[slot]`` holds each slot's id, and a bucket matches when ``ids[bucket]`` is
the id looked for. Lookups and inserts run one probe round at a time over the whole batch of
ids (triangular probing: home, +1, +3, +6, ...: it visits every bucket of a power-of-two table
and clusters less than linear probing, so the rounds end sooner); no Python loop runs per id.

Why a hash table and not sorted ids + ``searchsorted``: inserting new ids into a sorted array
rewrites the whole array (O(rows) per batch with new ids; 80 MB per batch at 10 M rows), while
a hash insert touches only the new ids. Memory: 4 bytes per bucket at 25-50 % load plus the
8-byte id of each slot, 16-24 bytes per row, 8-16 bytes more than a sorted array would need;
the low load keeps the probes of misses (new ids) few. Deletions (eviction) rebuild the table
from the kept ids (``rebuild``) at the end of a pass: no tombstones, probes stay short.
"""

from __future__ import annotations

import torch

from longboat.ps.shared.rows import splitmix

MAX_LOAD = 0.5
_MIN_BUCKETS = 1024


def _home(ids: torch.Tensor, mask: int) -> torch.Tensor:
    return splitmix(ids) & mask


class RowIndex:
    """Row id -> slot, slots dense from 0 in insertion order (``ids[:len(self)]``)."""

    def __init__(self, expected_rows: int = 0) -> None:
        buckets = _MIN_BUCKETS
        while buckets * MAX_LOAD < expected_rows:
            buckets *= 2
        self.buckets = torch.full((buckets,), -1, dtype=torch.int32)
        self.slot_ids = torch.empty(max(expected_rows, 16), dtype=torch.int64)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def ids(self) -> torch.Tensor:
        """The id of every slot (a view)."""
        return self.slot_ids[: self.size]

    def nbytes(self) -> int:
        """Bytes held (buckets and the slot ids, spare capacity included)."""
        return self.buckets.nbytes + self.slot_ids.nbytes

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id (int64), -1 for ids not in the index."""
        out = torch.full((len(ids),), -1, dtype=torch.int64)
        mask = len(self.buckets) - 1
        todo = torch.arange(len(ids))
        keys, pos, step = ids, _home(ids, mask), 0
        while len(todo):
            step += 1
            slot = self.buckets[pos].to(torch.int64)
            found = self.slot_ids[slot.clamp_min(0)] == keys
            found &= slot >= 0
            out[todo[found]] = slot[found]
            more = ((slot >= 0) & ~found).nonzero().squeeze(1)
            todo, keys, pos = todo[more], keys[more], (pos[more] + step) & mask
        return out

    def insert(self, ids: torch.Tensor) -> torch.Tensor:
        """Add distinct ``ids`` not in the index yet; their new slots (int64, consecutive)."""
        n = len(ids)
        if self.size + n > len(self.buckets) * MAX_LOAD:
            self._grow_buckets(self.size + n)
        if self.size + n > len(self.slot_ids):
            grown = torch.empty(max(self.size + n, len(self.slot_ids) * 3 // 2), dtype=torch.int64)
            grown[: self.size] = self.ids
            self.slot_ids = grown
        slots = torch.arange(self.size, self.size + n)
        self.slot_ids[self.size : self.size + n] = ids
        self.size += n
        self._place(slots)
        return slots

    def _place(self, slots: torch.Tensor) -> None:
        """Put ``slots`` (their ids already in ``slot_ids``) into free buckets."""
        mask = len(self.buckets) - 1
        pos, step = _home(self.slot_ids[slots], mask), 0
        while len(slots):
            step += 1
            free = (self.buckets[pos] < 0).nonzero().squeeze(1)
            claim_pos, claim = pos[free], slots[free].to(torch.int32)
            self.buckets[claim_pos] = claim  # of several claims on one bucket, one wins
            lost = torch.ones(len(slots), dtype=torch.bool)
            lost[free] = self.buckets[claim_pos] != claim
            rest = lost.nonzero().squeeze(1)
            slots, pos = slots[rest], (pos[rest] + step) & mask

    def _grow_buckets(self, rows: int) -> None:
        buckets = len(self.buckets)
        while buckets * MAX_LOAD < rows:
            buckets *= 2
        self.buckets = torch.full((buckets,), -1, dtype=torch.int32)
        self._place(torch.arange(self.size))

    def rebuild(self, keep: torch.Tensor) -> None:
        """Keep only the slots where the bool mask ``keep`` is set, renumbered in order."""
        kept = self.ids[keep].clone()
        self.slot_ids = torch.empty(max(len(kept), 16), dtype=torch.int64)
        self.slot_ids[: len(kept)] = kept
        self.size = len(kept)
        buckets = _MIN_BUCKETS
        while buckets * MAX_LOAD < len(kept):
            buckets *= 2
        self.buckets = torch.full((buckets,), -1, dtype=torch.int32)
        self._place(torch.arange(self.size))
