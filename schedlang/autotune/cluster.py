"""Where a collective's ranks sit: the mesh's dimensions in order and the nodes of a cluster.

A device mesh is laid out with ``tp`` innermost: ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first), and
consecutive ranks share a node (``torchrun`` gives a node's GPUs consecutive ranks). The ranks of one group of a
dimension are then ``product of the dimensions inside it`` apart, and the group stays inside one node exactly when
its size times that product is at most the node's GPU count. A group that leaves the node runs at the network's
speed: a ring over several nodes crosses the network on some hops, and those hops are its bottleneck (each GPU
has its own network port, so the per-GPU network bandwidth is the figure).

Example::

    sizes = {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 8}
    spans_nodes(sizes, "tp", gpus_per_node=8)        # False: tp's 8 ranks are one node
    spans_nodes(sizes, "dp_shard", gpus_per_node=8)  # True: its ranks are 8 apart
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["MESH_ORDER", "spans_nodes", "NVLINK", "NETWORK"]

#: the dimensions of a mesh, outermost first (``tp`` innermost: its groups are neighbouring ranks)
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: the names of the two kinds of link a collective crosses
NVLINK = "intra-node"
NETWORK = "inter-node"


def spans_nodes(sizes: Mapping[str, int], dim: str, gpus_per_node: int) -> bool:
    """Whether a group of mesh dimension ``dim`` holds ranks of more than one node."""
    if dim not in MESH_ORDER:
        raise ValueError(f"unknown mesh dimension {dim!r}: valid are {', '.join(MESH_ORDER)}")
    span = 1
    for name in MESH_ORDER[MESH_ORDER.index(dim):]:
        span *= int(sizes.get(name, 1))
    return sizes.get(dim, 1) > 1 and span > gpus_per_node
