"""An elastic batch sampler: an epoch's progress survives ranks leaving and joining.

Every rank derives the same global schedule from the epoch's permutation and the indices not
yet processed, so after a change of world size the survivors (and any joiner that loaded the
state) agree on which indices are left and who takes which, without exchanging index lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from longboat.log import get_logger

__all__ = ["ElasticSampler", "schedule"]

logger = get_logger("longboat.elastic")

Schedule = list[list[list[int]]]
"""Steps x ranks x dataset indices."""

_STATE_KEYS = ("epoch", "seed", "shuffle", "batch_size", "num_samples", "processed", "steps")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ElasticSampler: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"ElasticSampler: {name}={value} must be >= {minimum}")
    return value


def _split(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous ``parts`` pieces of ``items`` whose sizes differ by at most 1, larger first."""
    size, extra = divmod(len(items), parts)
    out: list[list[int]] = []
    start = 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


def schedule(remaining: Sequence[int], world: int, batch_size: int) -> Schedule:
    """Split ``remaining`` (in order) into global steps: ``result[step][rank]`` is a batch.

    Full steps take consecutive chunks of ``world * batch_size`` indices; rank ``r`` gets
    ``chunk[r * batch_size:(r + 1) * batch_size]``. A tail ``t < world * batch_size``:

    * ``t >= world``: one last step, split into ``world`` contiguous parts whose sizes differ
      by at most 1 (larger parts first);
    * ``0 < t < world`` after at least one full step, with ``batch_size >= 2``: the last full
      step and the tail are rebalanced into two steps where every rank gets at least one index
      (sizes within a step differ by at most 1, none exceeds ``batch_size``);
    * otherwise (``0 < t < world`` with no full step, or ``batch_size == 1`` where every step
      holds exactly ``world`` indices) the ``t`` indices cannot reach every rank: they are
      dropped from this schedule and a warning naming how many is logged to
      ``longboat.elastic``. They stay unprocessed, so a later reshard to a smaller world, or
      the next epoch, still covers them.

    Every rank gets the same number of batches; no index appears twice; nothing else is
    skipped.
    """
    world = _check_int("world", world, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    items = list(remaining)
    step_size = world * batch_size
    full, tail = divmod(len(items), step_size)
    steps = [_split(items[i * step_size : (i + 1) * step_size], world) for i in range(full)]
    if tail == 0:
        return steps
    if tail >= world:
        steps.append(_split(items[full * step_size :], world))
    elif full and batch_size > 1:
        last = items[(full - 1) * step_size :]
        first = (len(last) + 1) // 2
        steps[-1] = _split(last[:first], world)
        steps.append(_split(last[first:], world))
    else:
        logger.warning(
            "elastic sampler: dropping %d index(es) from this epoch's schedule: fewer than "
            "world size (%d) are left over, so they cannot be given to every rank",
            tail,
            world,
        )
    return steps


def _batches(steps: Schedule, start: int, rank: int) -> Iterator[list[int]]:
    for step in steps[start:]:
        yield list(step[rank])


def _state_int(state: dict[str, Any], key: str) -> int:
    value = state[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ElasticSampler state: {key!r} must be an int, got {value!r}")
    return value


class ElasticSampler(Sampler[list[int]]):
    """Batch sampler whose progress through an epoch survives changes of world size.

    Use as ``DataLoader(dataset, batch_sampler=sampler)``. The epoch's order is a permutation
    of ``range(n)`` (``torch.randperm`` with its generator at ``seed + epoch`` when ``shuffle``, else the
    identity); the indices not yet processed are laid out by :func:`schedule` over the current
    world. Call :meth:`record_batch` on every rank after each optimizer step; after a
    membership change call :meth:`reshard` on every rank (a joiner first loads a survivor's
    :meth:`state_dict`) and iterate again: it continues with the indices left.

    ``rank``/``world_size`` come from :mod:`torch.distributed` when it is initialised (else
    0/1), read at first use, until :meth:`reshard` sets them.

    Example::

        sampler = ElasticSampler(dataset, batch_size=32, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler)
        sampler.set_epoch(epoch)        # same epoch again: keeps progress
        for batch in loader:
            train_step(batch)
            sampler.record_batch()
    """

    def __init__(
        self, data: Sized | int, batch_size: int, *, shuffle: bool = True, seed: int = 0
    ) -> None:
        if isinstance(data, int) and not isinstance(data, bool):
            n = data
        elif hasattr(data, "__len__"):
            n = len(data)
        else:
            raise TypeError(
                f"ElasticSampler: data must be a sized dataset or an int, got {type(data).__name__}"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ElasticSampler needs at least one sample, got {n!r}")
        self._n = n
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.shuffle = bool(shuffle)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"ElasticSampler: seed must be an int, got {seed!r}")
        self.seed = seed
        self._epoch = 0
        self._rank: int | None = None
        self._world: int | None = None
        self._reset_progress()

    # -- progress bookkeeping -------------------------------------------------------------

    def _reset_progress(self) -> None:
        # processed before the current schedule; steps of the current one are folded in lazily
        self._mask = torch.zeros(self._n, dtype=torch.bool)
        self._base_count = 0
        self._steps = 0  # steps recorded in the current schedule
        self._steps_before = 0  # steps recorded in earlier schedules of this epoch
        self._plan: tuple[Schedule, list[int]] | None = None

    def _placement(self) -> tuple[int, int]:
        if self._rank is None or self._world is None:
            if dist.is_available() and dist.is_initialized():
                self._rank, self._world = dist.get_rank(), dist.get_world_size()
            else:
                self._rank, self._world = 0, 1
        return self._rank, self._world

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self._n)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self._epoch)
        return torch.randperm(self._n, generator=generator)

    def _current_plan(self) -> tuple[Schedule, list[int]]:
        """The current schedule and its cumulative sizes (``cum[k]``: indices in steps < k)."""
        if self._plan is None:
            order = self._permutation()
            remaining = order[~self._mask[order]].tolist()
            steps = schedule(remaining, self._placement()[1], self.batch_size)
            cum = [0]
            for step in steps:
                cum.append(cum[-1] + sum(len(batch) for batch in step))
            self._plan = (steps, cum)
        return self._plan

    def _folded_mask(self, into: torch.Tensor) -> torch.Tensor:
        """Mark the indices of the steps recorded in the current schedule in ``into``."""
        if self._steps:
            steps, _ = self._current_plan()
            done = [i for step in steps[: self._steps] for batch in step for i in batch]
            into[torch.tensor(done, dtype=torch.long)] = True
        return into

    # -- public API -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def num_samples(self) -> int:
        """Number of samples in the dataset."""
        return self._n

    @property
    def rank(self) -> int:
        """This process's rank in the current schedule."""
        return self._placement()[0]

    @property
    def world_size(self) -> int:
        """The world size of the current schedule."""
        return self._placement()[1]

    @property
    def steps_recorded(self) -> int:
        """Global steps recorded so far this epoch, across reshards."""
        return self._steps_before + self._steps

    @property
    def processed_count(self) -> int:
        """Number of indices processed so far this epoch."""
        if not self._steps:
            return self._base_count
        return self._base_count + self._current_plan()[1][self._steps]

    @property
    def remaining_count(self) -> int:
        """Number of indices not processed yet this epoch (including any dropped ones)."""
        return self._n - self.processed_count

    def processed_indices(self) -> list[int]:
        """Sorted indices processed so far this epoch."""
        mask = self._folded_mask(self._mask.clone())
        return mask.nonzero().flatten().tolist()

    def set_epoch(self, epoch: int) -> None:
        """Switch to ``epoch``: a different epoch starts afresh, the same one keeps progress."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._reset_progress()

    def record_batch(self) -> None:
        """Mark one more global step of the current schedule as done (every rank calls it)."""
        if self._steps >= len(self._current_plan()[0]):
            raise RuntimeError(
                f"ElasticSampler: all {self._steps} step(s) of the current schedule are "
                "already recorded; call set_epoch() for a new epoch"
            )
        self._steps += 1

    def reshard(self, rank: int, world: int) -> None:
        """Reschedule the indices not processed yet over ``world`` ranks, this one ``rank``."""
        world = _check_int("world", world, 1)
        rank = _check_int("rank", rank, 0)
        if rank >= world:
            raise ValueError(f"ElasticSampler: rank={rank} is out of range for world={world}")
        self._folded_mask(self._mask)
        self._base_count = int(self._mask.sum())
        self._steps_before += self._steps
        self._steps = 0
        self._plan = None
        self._rank, self._world = rank, world

    def state_dict(self) -> dict[str, Any]:
        """Progress as ints, bools and a ``torch.bool`` mask (broadcastable).

        ``processed`` has every recorded step folded in, so the state does not depend on the
        world size it was taken under; ``steps`` counts the global steps recorded this epoch.
        """
        return {
            "epoch": self._epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_samples": self._n,
            "processed": self._folded_mask(self._mask.clone()),
            "steps": self.steps_recorded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (epoch, seed, shuffle, batch size, progress).

        The indices left are scheduled over the current rank/world; call :meth:`reshard` to
        set them.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise KeyError(f"ElasticSampler state is missing {', '.join(missing)}")
        n = _state_int(state, "num_samples")
        if n != self._n:
            raise ValueError(
                f"ElasticSampler: the state is for {n} samples but this sampler has {self._n}"
            )
        processed = state["processed"]
        if not isinstance(processed, torch.Tensor) or processed.shape != (self._n,):
            raise ValueError(
                f"ElasticSampler: 'processed' must be a tensor of shape ({self._n},), "
                f"got {getattr(processed, 'shape', type(processed).__name__)}"
            )
        epoch = _check_int("epoch", _state_int(state, "epoch"), 0)
        seed = _state_int(state, "seed")
        batch_size = _check_int("batch_size", _state_int(state, "batch_size"), 1)
        steps = _check_int("steps", _state_int(state, "steps"), 0)
        shuffle = state["shuffle"]
        shuffle = bool(shuffle.item() if isinstance(shuffle, torch.Tensor) else shuffle)

        self._epoch, self.seed, self.batch_size, self.shuffle = epoch, seed, batch_size, shuffle
        self._reset_progress()
        self._mask = processed.detach().to(device="cpu", dtype=torch.bool).clone()
        self._base_count = int(self._mask.sum())
        self._steps_before = steps

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches from the first global step not yet recorded."""
        steps, _ = self._current_plan()
        return _batches(steps, self._steps, self._placement()[0])

    def __len__(self) -> int:
        """Batches left for this rank (the same on every rank)."""
        return len(self._current_plan()[0]) - self._steps
