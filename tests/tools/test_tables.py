"""Every table a user meets fits a 100-column terminal: short headers, a legend where a header
needs one, cells wrapped rather than cut (rich reads COLUMNS)."""

from __future__ import annotations

import pytest

from longboat.launch import netns
from longboat.launch.emulate import print_topology
from longboat.tools.bench import train_report
from longboat.tools.doctor.checks import Check
from longboat.tools.doctor.cli import render as render_doctor


def _fits(text: str) -> None:
    wide = [line for line in text.splitlines() if len(line) > 100]
    assert not wide, "\n".join(wide)
    assert "…" not in text, text  # rich cuts a cell with an ellipsis


def _raw(step_s: float) -> dict:
    return {"step_s": [step_s] * 3, "data_s": [0.0] * 3, "memory": {"optimizer_state_mb": 12.5}}


@pytest.fixture(autouse=True)
def _columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")


def test_bench_train_fits_and_says_which_ratio_is_which(capsys: pytest.CaptureFixture[str]):
    raw = {
        n: {
            "params": 6_300_000, "batch_per_rank": 64, "world_size": n,
            "sharding": {"stage": 2},
            **{s: _raw(0.1 * n) for s in ("longboat", "longboat unsharded", "ddp", "ddp zero",
                                          "ddp lean", "no sync")},
        }
        for n in (1, 2)
    }  # fmt: skip
    train_report.render("transformer-large", train_report.summarise(raw))
    out = capsys.readouterr().out
    _fits(out)
    for head, _, _ in train_report.RATIO_COLUMNS:
        assert f"{head} = " in out  # the legend names every ratio column
    assert "below 1: the first is faster" in out


def test_doctor_fits(capsys: pytest.CaptureFixture[str]):
    detail = "eth0 10.0.0.5/24 mtu 9000 up, ib0 192.168.7.5/24 mtu 4092 up, " * 3
    render_doctor([Check("network interfaces", "PASS", detail, "set NCCL_SOCKET_IFNAME=eth0")])
    _fits(capsys.readouterr().out)


def test_emulate_topology_fits(capsys: pytest.CaptureFixture[str]):
    print_topology(netns.make_plan(4, 10**9, latency_s=0.005, run_id="0123ab", spares=1))
    _fits(capsys.readouterr().err)
