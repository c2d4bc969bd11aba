"""The variables every launched rank gets besides torch's own: Paddle's, Horovod's, longboat's."""

from __future__ import annotations

from collections.abc import Mapping

from longboat.launch.roles import num_servers, role_of


def rank_env(env: Mapping[str, str], endpoints: list[str]) -> dict[str, str]:
    """Paddle and Horovod equivalents of torch's RANK/WORLD_SIZE/LOCAL_RANK/... for this rank.

    ``endpoints`` holds every rank's ``host:port`` (a port free on its host at start-up), in
    rank order. In parameter-server mode the first ranks are servers and trainers are numbered
    from 0 among themselves, as Paddle numbers them.
    """
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    node = int(env.get("GROUP_RANK", "0"))
    nodes = int(env.get("LONGBOAT_NNODES") or env.get("GROUP_WORLD_SIZE") or "1")
    servers = num_servers(env)
    role, index = role_of(rank, servers)
    trainers = endpoints[servers:]
    devices = [d for d in env.get("LONGBOAT_DEVICES", "").split(",") if d]
    out = {
        "LONGBOAT_ROLE": role,
        "LONGBOAT_ROLE_RANK": str(index),
        "LONGBOAT_NODE_RANK": str(node),
        "LONGBOAT_NNODES": str(nodes),
        "PADDLE_TRAINER_ID": str(index if role == "trainer" else 0),
        "PADDLE_TRAINERS_NUM": str(len(trainers)),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_TRAINER_ENDPOINTS": ",".join(trainers),
        "FLAGS_selected_gpus": devices[local_rank] if devices else str(local_rank),
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(world),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_world),
        "HOROVOD_CROSS_RANK": str(node),
        "HOROVOD_CROSS_SIZE": str(nodes),
    }
    if servers:
        out |= {
            "TRAINING_ROLE": "PSERVER" if role == "server" else "TRAINER",
            "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints[:servers]),
            "PADDLE_PORT": endpoints[rank].rpartition(":")[2],
            "POD_IP": endpoints[rank].rpartition(":")[0],
        }
    return out
