"""A sync trainer process for tests/ps/test_liveness.py.

    python tests/ps/_liveness_trainer.py ENDPOINTS TRAINER TRAINERS DIR NAME [--hold-after K]

Trains the collective tests' MixedNet in sync mode (token from ``LONGBOAT_PS_TOKEN``). After each
step it writes the engine's step to ``DIR/NAME.progress``; it stops once that reaches the number
in ``DIR/target`` (written by the test) and saves its parameters, pulled from the servers, to
``DIR/NAME.pt``. ``--hold-after K``: after K steps it goes silent (sleeps) until killed. Every
wait is bounded: at ``MAX_STEPS`` steps, or ``HOLD_S`` seconds of holding, it exits with 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (tests.*)

import longboat as lb  # noqa: E402
from tests.collective import _workloads as W  # noqa: E402

MAX_STEPS = 3000
HOLD_S = 120.0
PACE_S = 0.005  # a short pause per step: a trainer alone does not spin


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _target(folder: Path) -> int | None:
    try:
        return int((folder / "target").read_text())
    except (FileNotFoundError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("endpoints")
    p.add_argument("trainer", type=int)
    p.add_argument("trainers", type=int)
    p.add_argument("folder", type=Path)
    p.add_argument("name")
    p.add_argument("--hold-after", type=int, default=-1)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    m, opt = lb.ps.distribute(
        model,
        W.build_optimizer(cfg, model),
        lb.Strategy(mode="ps", a_sync=False),
        servers=a.endpoints.split(","),
        trainer=a.trainer,
        trainers=a.trainers,
        timeout=60,
    )
    engine = m.engine
    x, y = W.data(cfg)
    progress = a.folder / f"{a.name}.progress"
    _write(progress, str(engine.step_no))
    for _ in range(MAX_STEPS):
        target = _target(a.folder)
        if target is not None and engine.step_no >= target:
            break
        if engine.step_no == a.hold_after:
            time.sleep(HOLD_S)  # silent: the test kills this process meanwhile
            return 3
        i = engine.step_no % W.STEPS
        opt.zero_grad()
        world, rank = a.trainers, a.trainer
        F.cross_entropy(m(W.shard(x[i], rank, world)), W.shard(y[i], rank, world)).backward()
        opt.step()
        _write(progress, str(engine.step_no))
        time.sleep(PACE_S)
    else:
        return 3
    engine.synchronize()
    engine.dense.pull(engine.step_no)  # the values after the last step, from the servers
    torch.save(W.params_of(model), a.folder / f"{a.name}.pt")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
