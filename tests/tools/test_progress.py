"""The shared progress display: a bar with an ETA on a terminal, silence in a file or pipe."""

from __future__ import annotations

import pytest

from longboat.tools.progress import progress


def test_nothing_is_written_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture) -> None:
    with progress("work", 3, loss="-") as advance:
        for i in range(3):
            advance(loss=float(i))
    assert capsys.readouterr() == ("", "")


def test_a_terminal_shows_the_bar_fields_and_eta(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats the captured stderr as a terminal
    monkeypatch.setenv("COLUMNS", "160")
    with progress("work", 3, size="-") as advance:
        for size in ("1 KiB", "1 MiB", "1 GiB"):
            advance(size=size)
    err = capsys.readouterr().err
    assert "work" in err and "3/3" in err and "size 1 GiB" in err and "eta" in err


def test_show_false_is_silent_even_on_a_terminal(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    with progress("work", 1, show=False) as advance:
        advance()
    assert capsys.readouterr().err == ""
