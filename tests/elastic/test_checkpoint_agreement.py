"""Before the ranks replace lost shards by the sharded checkpoint, they agree on which save
of it they see: a rank that sees none (no shared filesystem) stops every rank in one line
instead of leaving the others inside a collective load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longboat.elastic import reshard
from longboat.elastic.reshard import ShardsLostError, agree_on_checkpoint
from longboat.sharding import checkpoint
from longboat.sharding.zero import files

LOST = ShardsLostError("shard 1 of 2 left with rank 1")


def test_saved_version_reads_both_formats_and_none(tmp_path: Path) -> None:
    assert checkpoint.saved_version(tmp_path / "absent") is None
    (tmp_path / "stage3").mkdir()
    (tmp_path / "stage3" / checkpoint.POINTER).write_text(json.dumps({"checkpoint": "fsdp-1a"}))
    assert checkpoint.saved_version(tmp_path / "stage3") == "fsdp-1a"
    (tmp_path / "zero").mkdir()
    index = {"format": files.FORMAT, "version": files.VERSION, "token": "9f3c"}
    (tmp_path / "zero" / files.INDEX).write_text(json.dumps(index))
    assert checkpoint.saved_version(tmp_path / "zero") == "9f3c"
    (tmp_path / "zero" / files.INDEX).write_text("{not json")
    assert checkpoint.saved_version(tmp_path / "zero") == "unreadable (CheckpointError)"


def test_the_same_save_everywhere_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(reshard, "allgather_bytes", lambda data: [b"None", b"None", b"None"])
    agree_on_checkpoint(tmp_path, LOST)  # no rank sees one: each finds none, as one


def test_ranks_that_see_another_save_are_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen = [b"fsdp-1a", b"None", b"fsdp-1a", b"None"]
    monkeypatch.setattr(reshard, "allgather_bytes", lambda data: seen)
    with pytest.raises(ShardsLostError) as caught:
        agree_on_checkpoint(tmp_path, LOST)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("shard 1 of 2 left with rank 1")
    assert "ranks 0, 2: fsdp-1a; ranks 1, 3: none" in message
    assert "filesystem every node shares" in message
