"""An all-gather's slices kept in pieces: a bucket's slice spread over several parameters.

`PlacedSlices` says where each rank's elements live, as ``(column, tensor)`` pieces of its
slice, so a collective copies them straight to and from its wire or shared memory, with no
contiguous slice or full buffer on either side (`longboat.comm.algorithms.shm.ShmComm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Placed = tuple[int, torch.Tensor]
"""Elements of a slice that live apart: ``(column, flat contiguous tensor)``, the tensor holding
the slice's columns ``[column, column + numel)``."""
Gate = Callable[[], contextlib.AbstractContextManager[bool]]
"""Entered around every write into the destinations; yields False once the caller no longer
wants them written (nothing is written then)."""


@dataclass(frozen=True)
class PlacedSlices:
    """Every rank's slice is ``numel`` columns; ``mine`` holds this rank's elements at their
    columns, ``rows[r]`` says where rank ``r``'s elements go (this rank's own included).
    Columns no piece of ``mine`` names are not sent; those of ``rows`` are not written
    (padding). Every write into ``rows`` happens inside ``gate`` (see `Gate`)."""

    numel: int
    mine: Sequence[Placed]
    rows: Sequence[Sequence[Placed]]
    gate: Gate | None = None

    @classmethod
    def whole(cls, rows: torch.Tensor, mine: torch.Tensor) -> PlacedSlices:
        """Torch's all-gather layout: ``rows`` (one row per rank) receives every ``mine``."""
        return cls(mine.numel(), [(0, mine)], [[(0, row)] for row in rows.unbind(0)])

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self.mine] + [t for row in self.rows for _, t in row]

    def check(self, ranks: int) -> torch.dtype:
        """ValueError unless the pieces are flat contiguous CPU tensors of one dtype inside
        ``[0, numel)``, with one row per rank; returns their dtype."""
        pieces = [*self.mine, *(p for row in self.rows for p in row)]
        dtype = pieces[0][1].dtype if pieces else torch.float32
        if len(self.rows) != ranks:
            raise ValueError(f"all-gather: {len(self.rows)} rows for {ranks} ranks")
        for col, t in pieces:
            if t.dtype != dtype or t.device.type != "cpu" or t.dim() != 1:
                raise ValueError("all-gather pieces are flat CPU tensors of one dtype")
            if not t.is_contiguous() or col < 0 or col + t.numel() > self.numel:
                raise ValueError(
                    f"all-gather: a piece of {t.numel()} elements at column {col} is not "
                    f"contiguous inside a slice of {self.numel}"
                )
        return dtype

    def send(self, cols: slice, area: torch.Tensor) -> None:
        """This rank's columns ``cols`` into ``area`` (which holds columns ``cols``)."""
        _copy(*_clipped(self.mine, cols, area, into_area=True))

    def receive(self, rank: int, cols: slice, area: torch.Tensor) -> None:
        """Rank ``rank``'s columns ``cols``, held by ``area``, into their places."""
        with self._writing() as wanted:
            if wanted:
                _copy(*_clipped(self.rows[rank], cols, area, into_area=False))

    def place_own(self, rank: int, start: int, stop: int) -> None:
        """Columns ``[start, stop)`` of this rank's own elements into their places in
        ``rows[rank]``."""
        for col, t in self.mine:
            cols = slice(max(start, col), min(stop, col + t.numel()))
            with self._writing() as wanted:
                if wanted:
                    _copy(*_clipped(self.rows[rank], cols, t, origin=col))

    def _writing(self) -> contextlib.AbstractContextManager[bool]:
        return self.gate() if self.gate is not None else contextlib.nullcontext(True)


def _clipped(
    placed: Sequence[Placed],
    cols: slice,
    area: torch.Tensor,
    *,
    into_area: bool = False,
    origin: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(destinations, sources)`` of the copies between the pieces' columns in ``cols`` and
    ``area``, whose first element is column ``origin`` (default ``cols.start``); into the
    area or out of it."""
    base = cols.start if origin is None else origin
    dst, src = [], []
    for at, t in placed:
        a, b = max(at, cols.start), min(at + t.numel(), cols.stop)
        if a < b:
            piece, window = t[a - at : b - at], area[a - base : b - base]
            dst.append(window if into_area else piece)
            src.append(piece if into_area else window)
    return dst, src


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if dst:
        torch._foreach_copy_(dst, src)
