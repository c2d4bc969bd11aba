"""A Lightning job under ``longboat launch``: ``python lightning_restart_probe.py OUT [CRASH]``.

Trains 3 epochs with LongboatStrategy, checkpointing at every epoch's end into OUT/ckpt. With
CRASH, rank 1 of the first attempt exits with code 5 in the middle of epoch 2; under
``--max-restarts 1`` the group restarts and resumes from the last checkpoint. Rank 0 writes
the final parameters to OUT/final.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import longboat as lb
from longboat.integrations.lightning import LongboatStrategy

CRASH_AT_STEP = 11  # epoch 2 (8 steps per epoch)


class Net(pl.LightningModule):
    def __init__(self, crash: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
        )
        self.crash = crash

    def training_step(self, batch, _index):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if (
            self.crash
            and attempt == 0
            and (self.global_rank, self.global_step) == (1, CRASH_AT_STEP)
        ):
            print("rank 1 crashes on purpose", flush=True)
            os._exit(5)
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


def main() -> None:
    out, crash = Path(sys.argv[1]), len(sys.argv) > 2
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 3, (128,), generator=g))
    checkpoints = out / "ckpt"
    trainer = pl.Trainer(
        strategy=LongboatStrategy(lb.Strategy(nccl_comm_num=2)),
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=checkpoints, save_last=True)],
    )
    resume = checkpoints / "last.ckpt"
    if resume.exists():
        print(f"resumed from {resume.name}", flush=True)
    module = Net(crash)
    trainer.fit(
        module, DataLoader(data, batch_size=8), ckpt_path=resume if resume.exists() else None
    )
    if trainer.is_global_zero:
        torch.save(module.state_dict(), out / "final.pt")


if __name__ == "__main__":
    main()
