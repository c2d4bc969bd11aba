"""Parameter-server mode: pushes and pulls of the dense gradients/parameters per server link.

Every trainer sends its gradients, split evenly over S servers, and receives the parameters
back. A trainer's link carries ``D`` bytes each way (``D``: dense gradient bytes); each server's
link carries ``T * D / S`` bytes each way (``T`` trainers). Per direction the slower of the two
bounds the transfer; each RPC adds the server link's latency twice (request, reply). The
servers' update reads every trainer's push once and runs the optimizer's share of each server.

How a step combines these (what waits, how many pushes and pulls) is the mode's own
declaration: its ``cost`` (`longboat.ps.trainer.modes.Mode`, from an
`longboat.ps.trainer.modes.Exchange`); the mode is the engine's own reading of the Strategy
(`PSConfig.from_strategy`), and nothing here knows a mode by name.
"""

from __future__ import annotations

from longboat.ps.trainer import modes
from longboat.ps.trainer.config import PSConfig
from longboat.ps.trainer.modes import Exchange
from longboat.sim.cluster import Cluster
from longboat.sim.profile import Profile
from longboat.strategy import Strategy


def simulate_ps(profile: Profile, cluster: Cluster, strategy: Strategy):  # noqa: ANN201
    from longboat.sim.predict import Prediction, device_profile

    if cluster.ps is None:
        raise ValueError("mode='ps' needs a 'ps: {servers: S, bandwidth: ...}' cluster section")
    prof = device_profile(profile, cluster, strategy)
    servers, link = cluster.ps.servers, cluster.ps.link
    trainers = cluster.world
    dense = prof.grad_bytes
    trainer_rate = cluster.inter.rate * min(cluster.inter.nics_per_node, cluster.devices_per_node)
    trainer_rate /= cluster.devices_per_node  # the node's NICs are shared by its trainers
    own, on_servers = dense / trainer_rate, trainers * dense / servers / link.rate
    update = trainers * dense / servers / cluster.mem_bw + prof.optimizer_s / servers
    compute = prof.forward_s + prof.backward_s
    cfg = PSConfig.from_strategy(strategy)
    mode = modes.get(cfg.mode)
    if mode.cost is None:
        raise ValueError(
            f"parameter-server mode {cfg.mode!r} declares no cost, so longboat sim cannot "
            "predict it; give its Mode class a cost (docs/ps.md)"
        )
    priced = mode.cost(
        Exchange(
            compute=compute,
            optimizer=prof.optimizer_s,
            update=update,
            transfer=max(own, on_servers),
            own=own,
            servers=on_servers,
            latency=link.latency,
            k_steps=cfg.k_steps,
        )
    )
    return Prediction(
        devices=trainers,
        nodes=cluster.nodes,
        step_s=priced.step,
        samples_per_s=prof.batch * trainers / priced.step,
        compute_s=compute,
        exposed_comm_s=priced.exposed,
        optimizer_s=priced.optimizer,
        comm_s=priced.comm,
        buckets=servers,
        bytes_sent=dense,
        algorithm=f"ps {priced.label}, {servers} server(s)",
        notes=(f"parameter servers: {servers}, {priced.label}",),
    )
