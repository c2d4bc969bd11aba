"""A script for launcher tests: allreduce the rank, record the environment, then act.

launch_probe.py OUT_DIR [ok | exit3 | sigkill | ps]
"""

import contextlib
import json
import os
import signal
import socket
import sys
import time

out_dir, action = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ok"
env = {k: v for k, v in os.environ.items() if k.startswith(("PADDLE_", "HOROVOD_", "LONGBOAT_"))}
env |= {
    k: os.environ.get(k)
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "FLAGS_selected_gpus",
        "TRAINING_ROLE",
    )
}


def dump(name, payload):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(payload, f)


if action == "ps":
    if os.environ["TRAINING_ROLE"] == "PSERVER":
        server = socket.create_server(("127.0.0.1", int(os.environ["PADDLE_PORT"])))
        dump(f"server{os.environ['LONGBOAT_ROLE_RANK']}.json", env)
        while True:  # serve until the launcher ends this server after the trainers finish
            server.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                server.accept()[0].close()
    seen = []
    for endpoint in os.environ["PADDLE_PSERVERS_IP_PORT_LIST"].split(","):
        host, _, port = endpoint.rpartition(":")
        socket.create_connection((host, int(port)), timeout=5).close()
        seen.append(endpoint)
    dump(f"trainer{os.environ['PADDLE_TRAINER_ID']}.json", env | {"seen": seen})
    print(f"trainer {os.environ['PADDLE_TRAINER_ID']} reached every server", flush=True)
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import longboat as lb  # noqa: E402

lb.init()
t = torch.tensor([float(lb.rank())])
dist.all_reduce(t)
dump(f"rank{lb.rank()}.json", env | {"sum": t.item(), "argv": sys.argv[1:]})
if action == "exit3" and lb.rank() == 1:
    print("rank 1 is exiting with code 3 on purpose", flush=True)
    sys.exit(3)
if action == "sigkill" and lb.rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if action in ("exit3", "sigkill"):
    time.sleep(60)  # the survivors must be stopped by the launcher, not by finishing
    dump(f"survived{lb.rank()}.json", {})
lb.shutdown()
