"""A script for the launcher's failure-summary tests.

    failure_probe.py OUT_DIR sigkill | stall | hang

Every rank first writes its pid to OUT_DIR/pid.<rank> (so a test can check that none is left).

- ``sigkill``: rank 1 kills itself with SIGKILL while rank 0 is blocked in an allreduce that can
  never complete (rank 0 then fails too, unless the launcher stops it first).
- ``stall``: rank 1 logs a stall report ("Missing ranks: ...") as an error, 30 more lines, and
  exits with the stall exit code while rank 0 waits in an allreduce.
- ``hang``: training under lb.distribute; rank 1 sleeps inside its fourth step (the line marked
  ``# rank 1 hangs here``) while rank 0 waits for its gradients until the job's timeout.
"""

import os
import signal
import sys
import time
from pathlib import Path

out_dir, action = Path(sys.argv[1]), sys.argv[2]
(out_dir / f"pid.{os.environ['RANK']}").write_text(str(os.getpid()))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import longboat as lb  # noqa: E402
from longboat.log import get_logger  # noqa: E402
from longboat.trace.stall import STALL_EXIT_CODE  # noqa: E402

lb.init()
if lb.rank() == 1:
    if action == "sigkill":
        print("rank 1 kills itself with SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "stall":
        get_logger("longboat.stall").error(
            "rank 1 has waited 3.0 s for barrier (launch 2). Missing ranks: 0: [barrier]"
        )
        for i in range(30):
            print(f"unrelated line {i}", flush=True)
        sys.stderr.flush()
        os._exit(STALL_EXIT_CODE)
if action == "hang":
    net = torch.nn.Linear(4, 2)
    model, opt = lb.distribute(
        net, torch.optim.SGD(net.parameters(), lr=0.1), lb.Strategy(stall_warning_seconds=1)
    )
    for step in range(8):
        if lb.rank() == 1 and step == 3:
            time.sleep(120)  # rank 1 hangs here
        model(torch.ones(2, 4)).sum().backward()
    sys.exit(0)
dist.all_reduce(torch.zeros(1))  # blocks: rank 1 never joins
lb.shutdown()
