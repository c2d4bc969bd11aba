"""Run on emulated nodes by the multi-node PS tests: servers serve (one may kill itself once:
``script.py OUT INDEX@STEP``); trainers train (sync), probe the servers from their own node
with a wrong and a missing token, and save what they saw."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (tests.*)

import longboat as lb  # noqa: E402
from longboat.ps.shared.service import SERVICE  # noqa: E402
from longboat.ps.shared.wire import Message  # noqa: E402
from longboat.ps.trainer.client import Client, PSError  # noqa: E402
from longboat.ps.trainer.engine import cluster_from_env  # noqa: E402
from tests.ps.launch_train import train_and_save  # noqa: E402


def _refusals(servers: list[str]) -> dict[str, list[str]]:
    """What each server answers a call with a wrong token, and one without any token."""
    wrong, missing = [], []
    client = Client(servers, "not-the-job-token", timeout=20)
    for i, endpoint in enumerate(servers):
        try:
            client.call(i, "ping", Message())
            wrong.append("answered")
        except PSError as exc:
            wrong.append(exc.code)
        with grpc.insecure_channel(endpoint) as channel:
            try:
                channel.unary_unary(f"/{SERVICE}/ping")(b"", timeout=20)
                missing.append("answered")
            except grpc.RpcError as exc:
                missing.append(exc.code().name)
    client.close()
    return {"wrong": wrong, "missing": missing}


def _serve(kill: str | None) -> None:
    """Serve; with ``kill`` = ``INDEX@STEP``, server INDEX SIGKILLs itself (first attempt only)
    once it has applied STEP steps."""
    from longboat.ps.server import make_server, serve_until_done

    server = make_server().start()
    index, _, step = (kill or "").partition("@")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if kill and first and int(index) == server.index:

        def watch() -> None:
            while server.state.version() < int(step):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
    serve_until_done(server)


def main(out: str, kill: str | None = None) -> None:
    if lb.is_server():
        _serve(kill)
        return
    torch.set_num_threads(1)
    servers, rank, world = cluster_from_env()
    seen = {
        "servers": servers,
        "trainers": world,
        "trainer": rank,
        "endpoints": os.environ["PADDLE_TRAINER_ENDPOINTS"].split(","),
        "node": int(os.environ["LONGBOAT_NODE_RANK"]),
        **_refusals(servers),
    }
    Path(out, f"seen{rank}.json").write_text(json.dumps(seen))
    train_and_save(out, rank, world)


if __name__ == "__main__":
    main(*sys.argv[1:])
