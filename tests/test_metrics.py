"""lb.log_every: one host sync per n steps, correct averages, a line per fetch off-terminal."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import longboat as lb


class CountingTensor(torch.Tensor):
    """A tensor that counts ``.item()`` calls (each one a device synchronisation on GPU)."""

    items = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.item:
            cls.items += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_fetches_once_every_n_steps_with_the_mean_loss() -> None:
    CountingTensor.items = 0
    logger = lb.log_every(4, samples_per_step=16, rank=0)
    fetched = []
    for i in range(10):
        loss = torch.tensor(float(i)).as_subclass(CountingTensor)
        fetched.append(logger.step(loss))
    last = logger.close()
    assert [f is not None for f in fetched] == [(i + 1) % 4 == 0 for i in range(10)]
    assert CountingTensor.items == 3  # steps 4, 8 and the close() of the last 2; not 10
    assert fetched[3]["loss"] == pytest.approx(1.5) and fetched[7]["loss"] == pytest.approx(5.5)
    assert last is not None and last["loss"] == pytest.approx(8.5) and last["step"] == 10
    assert fetched[3]["samples_per_s"] == pytest.approx(fetched[3]["steps_per_s"] * 16)


def test_logs_a_line_per_fetch_when_not_on_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="longboat.metrics"), lb.log_every(2, rank=0) as logger:
        for _ in range(4):
            logger.step(torch.tensor(1.0))
    lines = [r.getMessage() for r in caplog.records if r.name == "longboat.metrics"]
    assert len(lines) == 2 and lines[0].startswith("step 2: ") and "loss 1" in lines[0]
    # the documented line: loss, samples_per_s, steps_per_s, in that order and those formats
    assert re.fullmatch(r"step 2: loss \d+\.\d{4}  steps_per_s \d+\.\d{2}", lines[0]), lines[0]


def test_other_ranks_stay_quiet_and_bad_n_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="longboat.metrics"):
        logger = lb.log_every(1, rank=1)
        assert logger.step(torch.tensor(2.0)) == {
            "step": 1.0,
            "steps_per_s": pytest.approx(logger.last["steps_per_s"]),
            "loss": 2.0,
        }  # noqa: E501
    assert not caplog.records
    with pytest.raises(ValueError, match="n must be >= 1"):
        lb.log_every(0)


def test_a_sized_total_gives_steps_of_total_and_an_eta(caplog: pytest.LogCaptureFixture) -> None:
    loader = [None] * 6  # anything with a length: a DataLoader in practice
    with (
        caplog.at_level("INFO", logger="longboat.metrics"),
        lb.log_every(2, total=loader, rank=0) as logger,
    ):
        for _ in loader:
            logger.step(torch.tensor(1.0))
            if logger.steps == 2:
                first = dict(logger.last)
    lines = [r.getMessage() for r in caplog.records if r.name == "longboat.metrics"]
    assert lines[0].startswith("step 2/6: ") and " eta " in lines[0], lines[0]
    shown = r"step 2/6: loss \d+\.\d{4}  steps_per_s \d+\.\d{2}  eta \d+:\d\d"
    assert re.fullmatch(shown, lines[0]), lines[0]
    assert first["eta_s"] == pytest.approx(4 / first["steps_per_s"])
    assert logger.last["eta_s"] == 0
