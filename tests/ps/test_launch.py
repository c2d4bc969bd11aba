"""Real server processes: `longboat launch --servers 2 --workers 2` trains in sync mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.collective import _workloads as W

SCRIPT = Path(__file__).with_name("launch_train.py")


def test_launched_servers_and_trainers_match_global_batch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "longboat", "launch", "--servers", "2", "--workers", "2",
         str(SCRIPT), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("log/*")) if p.is_file())
    assert done.returncode == 0, done.stdout + done.stderr + logs
    tokens = list(tmp_path.glob("log/.ps-token-*"))
    assert len(tokens) == 1 and tokens[0].stat().st_mode & 0o077 == 0  # per-job, owner-only
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    want = W.train_global_batch(model, W.build_optimizer(cfg, model), cfg, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"trainer{rank}.pt", weights_only=True)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
