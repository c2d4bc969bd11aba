"""Test-wide settings: one intra-op thread (2-core machine; many tiny ops), restored after
every test (Lightning's trainer sets the count from the cores it sees)."""

from collections.abc import Iterator

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
