"""A plain torch script (its own init_process_group, no longboat call) under
``longboat launch --max-restarts 2``: rank 1 exits with code 3 in attempts 0 and 1, after an
allreduce; attempt 2 must form its group again and finish."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt}: sum {t.item():.0f}", flush=True)
if attempt < 2 and dist.get_rank() == 1:
    os._exit(3)
dist.all_reduce(t)
dist.destroy_process_group()
