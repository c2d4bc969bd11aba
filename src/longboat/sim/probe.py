"""Run under `longboat emulate` by `longboat sim calibrate`: time allreduces over the emulated
link. Rank 0 writes ``{"link": {size: s}, "hierarchical": {size: s}, "burn": {rank: s},
"world": n, "nodes": m}``:
``link`` is the backend's allreduce between the local-rank-0 ranks of two nodes (one message
each way per step: the link alone), ``hierarchical`` longboat's algorithm on every rank, ``burn`` each rank's time for `calibrate._burn` with every
rank running it at once (how compute slows when the emulated nodes share this host); each the
fastest of its repeats, since other work on a shared host only ever adds time."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main(out: str, sizes: list[int], repeats: int) -> None:
    import longboat as lb
    from longboat import cluster
    from longboat.comm import algorithms
    from longboat.tools.bench.comm import time_collective

    lb.init()
    torch.set_num_threads(1)
    topo = lb.topology()
    per = lb.world_size() // topo.nodes
    leaders = [i * per for i in range(min(2, topo.nodes))]
    group = dist.new_group(leaders)
    everyone = cluster.new_group()
    hier = algorithms.make("hierarchical", everyone) if topo.nodes > 1 and per > 1 else None
    result: dict[str, dict[str, float]] = {"link": {}, "hierarchical": {}}
    from longboat.sim.calibrate import BURN_REPS, _burn

    dist.barrier()
    burn = torch.tensor([min(_burn((BURN_REPS, 0.0)) for _ in range(3))])
    gathered = [torch.zeros(1) for _ in range(lb.world_size())]
    dist.all_gather(gathered, burn)
    result["burn"] = {str(i): float(t) for i, t in enumerate(gathered)}
    for size in sizes:
        tensor = torch.ones(size // 4)
        if lb.rank() in leaders:
            result["link"][str(size)] = fastest_s(
                lambda t=tensor: dist.all_reduce(t, group=group), repeats, group
            )
        dist.barrier()
        if hier is not None:
            result["hierarchical"][str(size)] = time_collective(
                lambda t=tensor: hier(t).wait(), repeats
            )
    if lb.rank() == 0:
        with open(out, "w") as f:
            json.dump(result | {"world": lb.world_size(), "nodes": topo.nodes}, f)


def fastest_s(run, repeats: int, group=None) -> float:  # noqa: ANN001
    """The fastest of ``repeats`` timed calls after one untimed, the group's ranks starting
    each together (other work on a shared host only adds time)."""
    import time

    run()
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return min(samples)


if __name__ == "__main__":
    main(sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]))
