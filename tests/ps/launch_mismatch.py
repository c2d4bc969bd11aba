"""Run by `longboat launch --servers 1 --workers 2`: trainer 1's model has one more hidden unit
than trainer 0's (as many parameters, more elements), so the server refuses whichever trainer
says hello second; ``OUT/refused.json`` notes when. The whole job must end soon after."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (tests.*)

import longboat as lb  # noqa: E402
from longboat.ps.trainer.engine import cluster_from_env  # noqa: E402
from longboat.ps.trainer.settings import SettingsMismatch  # noqa: E402


def main(out: str) -> None:
    if lb.is_server():
        lb.ps.run_server()
        return
    torch.set_num_threads(1)
    _, rank, _ = cluster_from_env()
    hidden = 32 + rank  # the only difference between the trainers
    model = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        m, _ = lb.distribute(model, optimizer, lb.Strategy(mode="ps", a_sync=False))
    except SettingsMismatch as exc:
        Path(out, "refused.json").write_text(json.dumps({"at": time.time(), "why": str(exc)}))
        raise
    m.engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
