"""Parameter-server mode: pushes and pulls of the dense gradients/parameters per server link.

Every trainer sends its gradients, split evenly over S servers, and receives the parameters
back. A trainer's link carries ``D`` bytes each way (``D``: dense gradient bytes); each server's
link carries ``T * D / S`` bytes each way (``T`` trainers). Per direction the slower of the two
bounds the transfer; each RPC adds the server link's latency twice (request, reply).

* sync (``a_sync=False``): ``compute + push + server update + pull`` after backward, in one
  call per server (the step's push carries its pull);
* async (``a_sync=True``, ``k_steps <= 0``): trainers do not wait for each other, so a step is
  the larger of a trainer's own ``compute + push + pull`` and the servers' time per step of all
  trainers' traffic;
* half-async (async with ``use_thread_barrier``): as async, plus the trainers' barrier each step
  (a round trip to the servers);
* geo (``k_steps > 0``): local optimizer steps, parameters exchanged every k steps.

The mode is the engine's own reading of the Strategy (`PSConfig.from_strategy`).
"""

from __future__ import annotations

from longboat.ps.trainer.config import PSConfig
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
    transfer = max(dense / trainer_rate, trainers * dense / servers / link.rate)
    one_way = transfer + 2 * link.latency
    update = trainers * dense / servers / cluster.mem_bw + prof.optimizer_s / servers
    compute = prof.forward_s + prof.backward_s
    cfg = PSConfig.from_strategy(strategy)
    k = cfg.k_steps
    if cfg.mode == "sync":  # one call per server: the step's push carries its pull
        exchange = 2 * transfer + 2 * link.latency
        step, exposed, opt = compute + exchange + update, exchange, update
        kind, comm = "sync", exchange
    elif cfg.mode in ("async", "half_async"):
        server_time = 2 * trainers * dense / servers / link.rate + update
        own = compute + 2 * (dense / trainer_rate + 2 * link.latency)
        barrier = 2 * link.latency if cfg.mode == "half_async" else 0.0
        step = max(own, server_time) + barrier
        exposed, opt, kind = step - compute, 0.0, cfg.mode
        comm = 2 * one_way
    else:
        step = compute + prof.optimizer_s + (2 * one_way + update) / k
        exposed, opt, kind = (2 * one_way + update) / k, prof.optimizer_s, f"geo k={k}"
        comm = 2 * one_way
    return Prediction(
        devices=trainers,
        nodes=cluster.nodes,
        step_s=step,
        samples_per_s=prof.batch * trainers / step,
        compute_s=compute,
        exposed_comm_s=exposed,
        optimizer_s=opt,
        comm_s=comm,
        buckets=servers,
        bytes_sent=dense,
        algorithm=f"ps {kind}, {servers} server(s)",
        notes=(f"parameter servers: {servers}, {kind}",),
    )
