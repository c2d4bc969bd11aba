"""ElasticSampler and schedule(): equal batch counts, exact coverage across membership changes."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from longboat.elastic.sampler import ElasticSampler, schedule

GRID = [(n, w, b) for n in range(0, 61) for w in range(1, 7) for b in range(1, 6)]


def dropped(n: int, world: int, batch_size: int) -> int:
    """How many indices schedule() is documented to drop."""
    full, tail = divmod(n, world * batch_size)
    if 0 < tail < world and (full == 0 or batch_size == 1):
        return tail
    return 0


def check_schedule(steps: list[list[list[int]]], remaining: list[int], world: int, b: int) -> None:
    for step in steps:
        assert len(step) == world
        sizes = [len(batch) for batch in step]
        assert min(sizes) >= 1
        assert max(sizes) <= b
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # larger parts first
    flat = [i for step in steps for batch in step for i in batch]
    assert len(flat) == len(set(flat))
    # contiguous, in order: the scheduled indices are a prefix of ``remaining``
    assert flat == remaining[: len(flat)]
    assert len(remaining) - len(flat) == dropped(len(remaining), world, b)


@pytest.mark.parametrize("world", range(1, 7))
def test_schedule_properties_over_grid(world: int) -> None:
    for n, w, b in GRID:
        if w != world:
            continue
        remaining = list(range(100, 100 + n))
        steps = schedule(remaining, w, b)
        check_schedule(steps, remaining, w, b)
        # every rank gets the same number of batches
        per_rank = [[step[r] for step in steps] for r in range(w)]
        assert len({len(batches) for batches in per_rank}) == 1


def test_schedule_full_steps_are_chunks() -> None:
    remaining = list(range(30))
    steps = schedule(remaining, 3, 4)
    assert steps[0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert steps[1] == [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
    # tail 6 >= world 3: one step split 2/2/2
    assert steps[2] == [[24, 25], [26, 27], [28, 29]]


def test_schedule_uneven_tail_larger_parts_first() -> None:
    assert schedule(list(range(7)), 3, 4) == [[[0, 1, 2], [3, 4], [5, 6]]]


def test_schedule_rebalances_small_tail() -> None:
    # 12 = one full step (W*B = 10) + tail 2 < W = 5: two steps of 6, every rank >= 1
    steps = schedule(list(range(12)), 5, 2)
    assert steps == [
        [[0, 1], [2], [3], [4], [5]],
        [[6, 7], [8], [9], [10], [11]],
    ]


def test_schedule_empty() -> None:
    assert schedule([], 4, 2) == []


@pytest.mark.parametrize(("n", "world", "b", "lost"), [(3, 4, 2, 3), (1, 2, 5, 1), (5, 4, 1, 1)])
def test_schedule_drop_warns(
    caplog: pytest.LogCaptureFixture, n: int, world: int, b: int, lost: int
) -> None:
    with caplog.at_level(logging.WARNING, logger="longboat.elastic"):
        steps = schedule(list(range(n)), world, b)
    flat = [i for step in steps for batch in step for i in batch]
    assert len(flat) == n - lost
    messages = [r.getMessage() for r in caplog.records if r.name == "longboat.elastic"]
    assert len(messages) == 1
    assert f"dropping {lost} index" in messages[0]


def test_schedule_no_warning_when_nothing_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="longboat.elastic"):
        schedule(list(range(12)), 5, 2)
    assert not [r for r in caplog.records if r.name == "longboat.elastic"]


@pytest.mark.parametrize(("world", "b"), [(0, 1), (1, 0), (True, 1), (2, 1.5)])
def test_schedule_rejects_bad_arguments(world: object, b: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        schedule([1, 2, 3], world, b)  # type: ignore[arg-type]


# -- ElasticSampler -------------------------------------------------------------------------


def make_ranks(n: int, b: int, world: int, **kwargs: object) -> list[ElasticSampler]:
    ranks = []
    for r in range(world):
        sampler = ElasticSampler(n, b, **kwargs)  # type: ignore[arg-type]
        sampler.reshard(r, world)
        ranks.append(sampler)
    return ranks


def run_steps(ranks: list[ElasticSampler], steps: int | None, seen: list[int]) -> int:
    """Every rank takes ``steps`` batches (all if None) and records them; returns steps run."""
    lengths = {len(s) for s in ranks}
    assert len(lengths) == 1, lengths
    iters = [iter(s) for s in ranks]
    todo = lengths.pop() if steps is None else steps
    for _ in range(todo):
        for it in iters:
            seen.extend(next(it))
        for s in ranks:
            s.record_batch()
    return todo


def test_simulated_epoch_with_membership_changes() -> None:
    n, b = 103, 4
    seen: list[int] = []
    ranks = make_ranks(n, b, 3, seed=7)
    for s in ranks:
        s.set_epoch(2)
    run_steps(ranks, 5, seen)
    assert all(s.processed_count == 60 for s in ranks)

    # rank 1 leaves: survivors 0 and 2 become ranks 0 and 1 of world 2
    ranks = [ranks[0], ranks[2]]
    for r, s in enumerate(ranks):
        s.reshard(r, 2)
    run_steps(ranks, 3, seen)
    assert all(s.processed_count == 60 + 24 for s in ranks)

    # two ranks join from a survivor's state
    state = ranks[0].state_dict()
    for _ in range(2):
        joiner = ElasticSampler(n, 1, shuffle=False, seed=0)
        joiner.load_state_dict(state)
        ranks.append(joiner)
    for r, s in enumerate(ranks):
        s.reshard(r, 4)
    assert len({len(s) for s in ranks}) == 1
    run_steps(ranks, None, seen)

    assert sorted(seen) == list(range(n))  # every index exactly once
    for s in ranks:
        assert len(s) == 0
        assert list(s) == []
        assert s.remaining_count == 0
        assert s.processed_indices() == list(range(n))
        assert s.steps_recorded == 5 + 3 + len(schedule(list(range(19)), 4, 4))


def test_iteration_resumes_after_recorded_steps() -> None:
    s = ElasticSampler(20, 2, shuffle=False)
    assert len(s) == 10
    first = list(s)
    s.record_batch()
    s.record_batch()
    assert len(s) == 8
    assert list(s) == first[2:]
    assert s.processed_count == 4
    assert s.processed_indices() == [0, 1, 2, 3]
    assert s.remaining_count == 16


def test_iterator_is_a_snapshot() -> None:
    s = ElasticSampler(8, 2, shuffle=False)
    it = iter(s)
    s.record_batch()  # recorded after iter() but before the first next()
    assert next(it) == [0, 1]


def test_record_batch_does_not_touch_the_mask() -> None:
    s = ElasticSampler(10, 2, shuffle=False)
    s.record_batch()
    assert not s._mask.any()  # folded only at reshard/state_dict
    assert s.state_dict()["processed"][:2].all()
    assert not s._mask.any()


def test_record_batch_past_the_end_raises() -> None:
    s = ElasticSampler(4, 2, shuffle=False)
    s.record_batch()
    s.record_batch()
    with pytest.raises(RuntimeError, match="already recorded"):
        s.record_batch()


def test_state_round_trip_then_reshard_to_another_world() -> None:
    n, b = 50, 3
    ranks = make_ranks(n, b, 2, seed=3)
    seen: list[int] = []
    run_steps(ranks, 4, seen)
    state = ranks[1].state_dict()
    assert set(state) == {
        "epoch",
        "seed",
        "shuffle",
        "batch_size",
        "num_samples",
        "processed",
        "steps",
    }
    assert state["processed"].dtype == torch.bool
    assert state["processed"].shape == (n,)
    assert all(isinstance(v, int | bool | torch.Tensor) for v in state.values())
    assert int(state["processed"].sum()) == 24

    # a fresh group of three restores the state
    fresh = []
    for r in range(3):
        s = ElasticSampler(n, 99, shuffle=False, seed=1)
        s.load_state_dict(state)
        s.reshard(r, 3)
        fresh.append(s)
    assert fresh[0].batch_size == b and fresh[0].seed == 3 and fresh[0].shuffle
    assert fresh[0].processed_count == 24
    assert fresh[0].processed_indices() == sorted(seen)
    run_steps(fresh, None, seen)
    assert sorted(seen) == list(range(n))


def test_load_without_reshard_uses_current_placement() -> None:
    a = ElasticSampler(10, 2, shuffle=False)
    a.record_batch()
    b = ElasticSampler(10, 2, shuffle=False)
    b.load_state_dict(a.state_dict())
    assert (b.rank, b.world_size) == (0, 1)
    assert list(b) == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_state_survives_tensor_valued_ints() -> None:
    a = ElasticSampler(10, 2, seed=5)
    a.set_epoch(3)
    a.record_batch()
    state = {
        k: torch.tensor(v) if not isinstance(v, torch.Tensor) else v
        for k, v in a.state_dict().items()
    }
    b = ElasticSampler(10, 2)
    b.load_state_dict(state)
    assert (b.epoch, b.seed, b.shuffle, b.processed_count) == (3, 5, True, 2)
    assert list(b) == list(a)


def test_load_state_for_other_size_names_both() -> None:
    state = ElasticSampler(10, 2).state_dict()
    with pytest.raises(ValueError, match=r"10 samples.*has 12"):
        ElasticSampler(12, 2).load_state_dict(state)


def test_load_state_missing_key() -> None:
    state = ElasticSampler(10, 2).state_dict()
    del state["processed"]
    with pytest.raises(KeyError, match="processed"):
        ElasticSampler(10, 2).load_state_dict(state)


def test_set_epoch_same_keeps_new_resets() -> None:
    s = ElasticSampler(30, 2, seed=1)
    s.set_epoch(4)
    s.record_batch()
    s.record_batch()
    s.reshard(0, 2)
    s.record_batch()
    done = s.processed_indices()
    assert len(done) == 2 * 2 + 2 * 2
    s.set_epoch(4)  # re-entering the same epoch keeps progress
    assert s.processed_indices() == done
    assert s.steps_recorded == 3
    s.set_epoch(5)
    assert s.processed_count == 0
    assert s.steps_recorded == 0
    assert len(s) == 8  # 30 over world 2, batch 2: 7 full steps + one step of 1/1


def test_shuffle_determinism() -> None:
    def order(seed: int, epoch: int, shuffle: bool = True) -> list[int]:
        s = ElasticSampler(40, 40, seed=seed, shuffle=shuffle)
        s.set_epoch(epoch)
        return [i for batch in s for i in batch]

    expected = torch.randperm(40, generator=torch.Generator().manual_seed(5 + 2)).tolist()
    assert order(5, 2) == expected
    assert order(5, 2) == order(5, 2)
    assert order(5, 2) == order(6, 1)  # the generator starts from seed + epoch
    assert order(5, 2) != order(5, 3)
    assert order(5, 2, shuffle=False) == list(range(40))
    assert sorted(order(5, 3)) == list(range(40))


def test_dropped_indices_stay_unprocessed(caplog: pytest.LogCaptureFixture) -> None:
    ranks = make_ranks(3, 2, 4)
    with caplog.at_level(logging.WARNING, logger="longboat.elastic"):
        assert [len(s) for s in ranks] == [0, 0, 0, 0]
    assert any("dropping 3 index" in r.getMessage() for r in caplog.records)
    assert ranks[0].remaining_count == 3
    # a smaller world can take them
    ranks[0].reshard(0, 1)
    perm = torch.randperm(3, generator=torch.Generator().manual_seed(0)).tolist()
    assert list(ranks[0]) == [perm[:2], perm[2:]]


def test_sized_dataset_and_dataloader() -> None:
    data = list(range(100, 111))
    s = ElasticSampler(data, 4, shuffle=False)
    batches = [b.tolist() for b in DataLoader(data, batch_sampler=s)]
    assert batches == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110]]
    assert s.num_samples == 11


def test_defaults_without_process_group() -> None:
    s = ElasticSampler(5, 1)
    assert (s.rank, s.world_size) == (0, 1)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((10, 0), ValueError),
        ((0, 2), ValueError),
        (([], 2), ValueError),
        ((10, 2.0), TypeError),
        ((True, 2), TypeError),
        ((object(), 2), TypeError),
    ],
)
def test_constructor_errors(args: tuple[object, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        ElasticSampler(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 0), (0, True)])
def test_reshard_errors(rank: object, world: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        ElasticSampler(10, 2).reshard(rank, world)  # type: ignore[arg-type]


def test_reshard_error_message() -> None:
    with pytest.raises(ValueError, match=r"rank=3 is out of range for world=2"):
        ElasticSampler(10, 2).reshard(3, 2)


def test_set_epoch_error() -> None:
    with pytest.raises(ValueError, match="epoch"):
        ElasticSampler(10, 2).set_epoch(-1)


def test_every_rank_same_length_many_reshards() -> None:
    """Random membership walk: coverage is exact whenever nothing is dropped."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 31, 64, 97):
        for b in (1, 2, 5):
            world = 1 + int(torch.randint(4, (1,), generator=gen))
            ranks = make_ranks(n, b, world, seed=n)
            seen: list[int] = []
            while ranks[0].remaining_count and len(ranks[0]):
                k = int(torch.randint(len(ranks[0]) + 1, (1,), generator=gen))
                run_steps(ranks, k, seen)
                state = ranks[0].state_dict()
                world = 1 + int(torch.randint(4, (1,), generator=gen))
                ranks = []
                for r in range(world):
                    s = ElasticSampler(n, b)
                    s.load_state_dict(state)
                    s.reshard(r, world)
                    ranks.append(s)
            counts = Counter(seen)
            assert all(c == 1 for c in counts.values())
            assert len(counts) + ranks[0].remaining_count == n
            assert sorted(counts) == ranks[0].processed_indices()
