"""A Lightning job under ``longboat launch --max-restarts 1``: a rank dies mid-epoch, the group
restarts and resumes from Lightning's last checkpoint, and ends where an uninterrupted run ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from tests.launch._launcher import run_launcher  # noqa: E402

PROBE = str(Path(__file__).with_name("lightning_restart_probe.py"))


@pytest.mark.slow  # slow tier: two launched Lightning jobs, one with a restart
def test_a_restarted_lightning_job_matches_the_uninterrupted_one(tmp_path: Path) -> None:
    finals = {}
    for name, extra in (("crashed", ["--max-restarts", "1"]), ("clean", [])):
        out = tmp_path / name
        out.mkdir()
        crash = ["crash"] if name == "crashed" else []
        done = run_launcher(
            out, "--nproc-per-node", "2", *extra, PROBE, str(out), *crash, timeout=240
        )
        assert done.returncode == 0, done.stdout + done.stderr
        finals[name] = torch.load(out / "final.pt", weights_only=True)
        if name == "crashed":
            assert "restart attempt 1 of 1 after rank 1 exited with code 5" in done.stdout
            assert "crashes on purpose" in (out / "log" / "workerlog.1.attempt0").read_text()
            assert "resumed from last.ckpt" in (out / "log" / "workerlog.0").read_text()
    for key, value in finals["clean"].items():
        torch.testing.assert_close(finals["crashed"][key], value, rtol=1e-6, atol=1e-7)
