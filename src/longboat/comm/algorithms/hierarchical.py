"""hierarchical: Paddle Fleet's two-level allreduce (``use_hierarchical_allreduce``).

With L ranks on each of M nodes and a flat tensor of ``numel`` elements cut into L shards
(shard i = ``[i·c, (i+1)·c)`` clipped to ``numel``, c = ceil(numel / L)):

1. intra-node reduce-scatter: local rank i ends with the node's sum of shard i;
2. inter-node allreduce of shard i among local rank i of every node (L groups, in parallel);
3. intra-node allgather: every rank gets every shard.

Only 1/L of the tensor crosses nodes per rank. One node degenerates to the intra-node
allreduce, one rank per node to the inter-node allreduce.

The intra-node stage is pluggable by name (:func:`register_intra_node`): an :class:`IntraNode`
does the reduce-scatter and allgather in place on the flat tensor, with the shard layout of
:func:`shard_bounds`. "torch" (the default) uses the backend's collectives on the node's
group; a shared-memory implementation registers itself under its own name. The inter-node
stage is any registered allreduce algorithm ("native" by default).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist

from longboat import cluster
from longboat.cluster.topology import Topology
from longboat.comm import algorithms
from longboat.comm.algorithms import AllreduceFn, Network, Parts, register
from longboat.comm.algorithms.ring import check_dtype, run_flat
from longboat.comm.background import AsyncAllreduce
from longboat.comm.handles import wait_for
from longboat.registry import Registry

INTER_NRANKS_FIELD = "hierarchical_allreduce_inter_nranks"

_log = logging.getLogger("longboat")

# torch >= 2.10 renamed the *_tensor collectives; same signatures
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` equal shards of ceil(numel/parts); the last
    ones may be short or empty."""
    c = -(-numel // parts)
    return [(min(i * c, numel), min((i + 1) * c, numel)) for i in range(parts)]


class IntraNode(ABC):
    """The intra-node stage: collectives among the ranks of one node on a flat tensor.

    Local rank i (``dist.get_rank(group)``) owns shard i of :func:`shard_bounds`.
    Implementations are built by a factory ``(group) -> IntraNode`` registered by name.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @abstractmethod
    def reduce_scatter(self, flat: torch.Tensor) -> None:
        """In place: afterwards this rank's shard of ``flat`` holds the node's sum (the other
        shards are unspecified)."""

    @abstractmethod
    def all_gather(self, flat: torch.Tensor) -> None:
        """In place: afterwards every shard of ``flat`` holds its owner's shard."""

    def allreduce(self, flat: torch.Tensor) -> None:
        """In place SUM over the node (used when there is only one node)."""
        self.reduce_scatter(flat)
        self.all_gather(flat)


IntraNodeFactory = Callable[[dist.ProcessGroup], IntraNode]
# built-in stages: "torch" below and any other module of this folder that registers one
_INTRA: Registry[IntraNodeFactory] = Registry("intra-node stage", "longboat.comm.algorithms")
register_intra_node = _INTRA.register  # decorator: selectable as the intra-node stage ``name``


def intra_node_names() -> list[str]:
    """Registered intra-node stage names."""
    return _INTRA.names()


@register_intra_node("torch")
class TorchIntraNode(IntraNode):
    """The backend's reduce-scatter/allgather, padding to L equal shards when needed."""

    def reduce_scatter(self, flat: torch.Tensor) -> None:
        c = -(-flat.numel() // self.size)
        padded = self._padded(flat, c)
        out = torch.empty(c, dtype=flat.dtype, device=flat.device)
        _reduce_scatter(out, padded, group=self.group)
        lo, hi = shard_bounds(flat.numel(), self.size)[self.rank]
        flat[lo:hi].copy_(out[: hi - lo])

    def all_gather(self, flat: torch.Tensor) -> None:
        c = -(-flat.numel() // self.size)
        lo, hi = shard_bounds(flat.numel(), self.size)[self.rank]
        mine = torch.zeros(c, dtype=flat.dtype, device=flat.device)
        mine[: hi - lo].copy_(flat[lo:hi])
        out = flat if flat.numel() == c * self.size else flat.new_empty(c * self.size)
        _all_gather(out, mine, group=self.group)
        if out is not flat:
            flat.copy_(out[: flat.numel()])

    def allreduce(self, flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=self.group)

    def _padded(self, flat: torch.Tensor, c: int) -> torch.Tensor:
        if flat.numel() == c * self.size:
            return flat
        padded = flat.new_zeros(c * self.size)
        padded[: flat.numel()].copy_(flat)
        return padded


class HierarchicalError(ValueError):
    """The group's ranks cannot be arranged into equal nodes."""


def plan_nodes(members: list[int], topology: Topology, inter_nranks: int | None) -> list[list[int]]:
    """Split the group's global ranks ``members`` into equal "nodes" (ascending ranks each).

    ``inter_nranks`` None (or equal to the ranks per node) follows ``topology``; another value
    that divides the group size cuts it into consecutive blocks of that many ranks.
    """
    world = len(members)
    nodes: dict[int, list[int]] = {}
    for g in members:
        nodes.setdefault(topology.node_of[g], []).append(g)
    real = [sorted(ranks) for ranks in nodes.values()]
    sizes = sorted({len(ranks) for ranks in real})
    described = ", ".join(f"node {n}: {len(r)}" for n, r in nodes.items())
    if inter_nranks is not None and (inter_nranks < 1 or world % inter_nranks):
        raise HierarchicalError(
            f"{INTER_NRANKS_FIELD}={inter_nranks} does not divide the {world} ranks of the "
            f"group; set it to the ranks per node ({described}) or leave it at its default"
        )
    if len(sizes) > 1:
        raise HierarchicalError(
            f"hierarchical allreduce needs the same number of ranks on every node, but the "
            f"group has {described}"
            + (f" (so {INTER_NRANKS_FIELD}={inter_nranks} cannot match)" if inter_nranks else "")
            + "; start equal ranks per node, or use allreduce_algorithm='ring' or 'native'"
        )
    if inter_nranks is None or inter_nranks == sizes[0]:
        return real
    ordered = sorted(members)
    _log.info(
        "hierarchical allreduce: %s=%d differs from the %d ranks per node; using blocks of %d "
        "consecutive ranks as nodes",
        INTER_NRANKS_FIELD,
        inter_nranks,
        sizes[0],
        inter_nranks,
    )
    return [ordered[i : i + inter_nranks] for i in range(0, world, inter_nranks)]


def build_groups(
    group: dist.ProcessGroup, members: list[int], nodes: list[list[int]]
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(intra-node group, inter-node group) of this rank; None where that level is trivial.

    Every rank of the default group must create every new group, in the same order
    (``new_group``'s rule), so two-level layouts need ``group`` to span the default group.
    (``use_local_synchronization`` would lift that, but torch names such groups by each
    process's count of known groups, which differs between ranks that joined different
    groups before, and creation then hangs.)
    """
    whole, flat = len(nodes) == 1, len(nodes[0]) == 1
    if whole or flat:  # one level: the group itself
        return (group if not flat else None), (group if not whole else None)
    if len(members) != dist.get_world_size():
        raise HierarchicalError(
            f"hierarchical allreduce over {len(members)} of {dist.get_world_size()} ranks needs "
            "new intra- and inter-node groups, which every rank must create together; build "
            "it on a group of all ranks (e.g. make_communicators()) or use 'ring'/'native'"
        )
    me, intra, inter = dist.get_rank(), None, None
    for ranks in nodes:
        created = cluster.new_group(ranks)
        intra = created if me in ranks else intra
    for ranks in (list(col) for col in zip(*nodes, strict=True)):
        created = cluster.new_group(ranks)
        inter = created if me in ranks else inter
    return intra, inter


class Hierarchical:
    """Blocking in-place SUM: intra reduce-scatter, inter allreduce of my shard, intra allgather."""

    def __init__(self, intra: IntraNode | None, inter: AllreduceFn | None):
        self.intra = intra
        self.inter = inter

    def __call__(self, tensor: torch.Tensor) -> None:
        check_dtype(tensor, "hierarchical")
        if tensor.numel() == 0 or (self.intra is None and self.inter is None):
            return
        run_flat(tensor, self._allreduce, to_cpu=False)

    def _allreduce(self, flat: torch.Tensor) -> None:
        if self.intra is None:
            assert self.inter is not None
            wait_for(self.inter(flat))
        elif self.inter is None:
            self.intra.allreduce(flat)
        else:
            self.intra.reduce_scatter(flat)
            lo, hi = shard_bounds(flat.numel(), self.intra.size)[self.intra.rank]
            wait_for(self.inter(flat[lo:hi]))
            self.intra.all_gather(flat)


def cost(nbytes: float, net: Network) -> Parts:
    """Reduce-scatter inside each node, allreduce of 1/local across nodes, all-gather inside."""
    if net.on_device:
        return net.nccl(nbytes, "hierarchical")
    if net.nodes > 1 and net.local > 1:
        intra, inter = net.node_half(nbytes), net.across_nodes(nbytes / net.local)
        return 2 * intra[0] + inter[0], 2 * intra[1] + inter[1]
    if net.nodes == 1:
        return net.node_allreduce(nbytes)
    return net.flat(nbytes, "tree")


@register("hierarchical", topologies=("multi_node",), broadcast=True, cost=cost)
def make_hierarchical(
    group: dist.ProcessGroup,
    inter_nranks: int | None = None,
    intra: str = "auto",
    inter: str = "native",
) -> AsyncAllreduce[Hierarchical]:
    """Asynchronous hierarchical allreduce over ``group`` (collective: every rank of the group
    calls it, in the same order).

    ``inter_nranks``: ranks per lower-level group (the plan passes the Strategy's
    ``hierarchical_allreduce_inter_nranks`` when the user set it); default the topology's
    ranks per node.
    ``intra``: the intra-node stage (:func:`intra_node_names`; "auto": shared memory on Gloo,
    the torch collectives otherwise); ``inter``: the registered allreduce algorithm used
    across nodes.
    """
    if intra == "auto":
        intra = "shm" if dist.get_backend(group) == "gloo" else "torch"
    make_intra = _INTRA.get(intra)
    if inter == "hierarchical":
        raise ValueError("the inter-node stage of hierarchical allreduce cannot be hierarchical")
    size = dist.get_world_size(group)
    members = [dist.get_global_rank(group, i) for i in range(size)]
    nodes = plan_nodes(members, cluster.topology(), inter_nranks)
    intra_group, inter_group = build_groups(group, members, nodes)
    state = Hierarchical(
        make_intra(intra_group) if intra_group is not None else None,
        algorithms.make(inter, inter_group) if inter_group is not None else None,
    )
    return AsyncAllreduce(state, "hierarchical", check=lambda t: check_dtype(t, "hierarchical"))
