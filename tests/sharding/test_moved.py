"""The one old import path the documentation showed before stages 1 and 2 moved into
``longboat.sharding.zero`` still works, and says where the code went."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_memory_report_imports_from_its_old_path_with_a_warning_naming_the_new_one() -> None:
    from longboat.sharding.zero.memory import memory_report

    sys.modules.pop("longboat.collective.sharding.memory", None)
    with pytest.warns(DeprecationWarning, match="longboat.sharding.zero.memory"):
        old = importlib.import_module("longboat.collective.sharding.memory")
    assert old.memory_report is memory_report
