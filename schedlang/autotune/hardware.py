"""The devices a step runs on and their links, nominal or measured: peak bf16 flops, memory bandwidth and
capacity per device, NVLink inside a node and the network between nodes (:mod:`schedlang.autotune.cluster` says
which link a collective crosses)."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

from .cluster import NETWORK, NVLINK, spans_nodes

GIB = 2 ** 30
#: devices' dense bf16 peak and memory bandwidth, by name (the first match wins)
_DEVICES = (("H200", 989e12, 4.8e12), ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.0e12), ("L40", 181e12, 0.86e12))
#: devices whose tensor cores run float8 GEMMs at twice the bf16 rate
FLOAT8_DEVICES = ("H200", "H100", "L40", "B200", "GPU")
#: what a device without a known name is taken to be
_UNKNOWN_GPU = (100e12, 1.0e12)
#: a CPU rank: an order of magnitude for the estimate only
_CPU = (5e10, 2e10)
#: NVLink 4 (H100 / H200 SXM) per direction, as NCCL's bus bandwidth reaches it on 8 GPUs
NOMINAL_NVLINK = 450e9
#: one 400 Gb/s InfiniBand / RoCE port per GPU
NOMINAL_NETWORK = 50e9
#: GPUs of an HGX node
NOMINAL_GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The devices and their links: ``link_bytes_per_s`` inside a node (NVLink), ``inter_bytes_per_s`` per GPU
    between nodes, ``gpus_per_node`` x ``nodes`` ranks. ``link_source``: "measured", "given" or "nominal"."""

    device: str
    name: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth: float
    link_bytes_per_s: float
    link_source: str = "nominal"
    inter_bytes_per_s: Optional[float] = None
    gpus_per_node: int = NOMINAL_GPUS_PER_NODE
    nodes: int = 1
    inter_source: str = "nominal"

    @classmethod
    def nominal(cls, device: str, name: str = "", memory_gib: Optional[float] = None,
                link_gbps: Optional[float] = None, world: int = 2, intra_gbps: Optional[float] = None,
                inter_gbps: Optional[float] = None, gpus_per_node: Optional[int] = None) -> "Hardware":
        """A device by its name (``torch.cuda.get_device_name``), its memory and links, where not measured.
        ``link_gbps`` sets both links (where ``intra_gbps`` / ``inter_gbps`` do not); a CPU world is one host."""
        intra = intra_gbps if intra_gbps is not None else link_gbps
        inter = inter_gbps if inter_gbps is not None else link_gbps
        if device == "cuda":
            peak, bandwidth = next(((p, b) for key, p, b in _DEVICES if key in name), _UNKNOWN_GPU)
            if not name:  # planning for a GPU without one at hand: an H100 / H200-class device
                peak, bandwidth = _DEVICES[1][1:]
            memory = (memory_gib if memory_gib is not None else 80.0) * GIB
            intra_bytes = intra * 1e9 if intra is not None else NOMINAL_NVLINK
            inter_bytes = inter * 1e9 if inter is not None else NOMINAL_NETWORK
            per_node = gpus_per_node or NOMINAL_GPUS_PER_NODE
        else:
            peak, bandwidth = _CPU
            memory = (memory_gib if memory_gib is not None else 16.0) * GIB
            intra_bytes = intra * 1e9 if intra is not None else 2e9
            inter_bytes = inter * 1e9 if inter is not None else 2e9
            per_node = gpus_per_node or max(1, world)
        return cls(device, name or ("GPU" if device == "cuda" else "CPU"), memory, peak, bandwidth, intra_bytes,
                   "given" if intra is not None else "nominal", inter_bytes, per_node,
                   max(1, math.ceil(world / per_node)), "given" if inter is not None else "nominal")

    @property
    def network_bytes_per_s(self) -> float:
        return self.inter_bytes_per_s if self.inter_bytes_per_s is not None else self.link_bytes_per_s

    def with_link(self, bytes_per_s: float, source: str) -> "Hardware":
        """An all-reduce over every rank measured ``bytes_per_s``: the network's figure when the ranks span nodes
        (its slowest hop), NVLink's otherwise."""
        if self.nodes > 1:
            return dataclasses.replace(self, inter_bytes_per_s=bytes_per_s, inter_source=source)
        return dataclasses.replace(self, link_bytes_per_s=bytes_per_s, link_source=source)

    def link(self, sizes: Dict[str, int], dim: str) -> Tuple[str, float]:
        """``(name, bytes/s)`` of the link a group of mesh dimension ``dim`` runs on."""
        if spans_nodes(sizes, dim, self.gpus_per_node):
            return NETWORK, self.network_bytes_per_s
        return NVLINK, self.link_bytes_per_s

    def link_of_group(self, size: int, inner: int) -> Tuple[str, float]:
        """``(name, bytes/s)`` of the link a group of ``size`` ranks ``inner`` apart runs on (expert parallelism's
        group: neighbouring data-parallel ranks, the tp ranks inside them)."""
        if size > 1 and size * inner > self.gpus_per_node:
            return NETWORK, self.network_bytes_per_s
        return NVLINK, self.link_bytes_per_s

    def describe_links(self) -> str:
        unit = "GPU(s)" if self.device == "cuda" else "rank(s)"
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {unit}; intra-node {self.link_bytes_per_s / 1e9:,.1f} "
                f"GB/s ({self.link_source}), inter-node {self.network_bytes_per_s / 1e9:,.1f} GB/s per {unit[:-3]} "
                f"({self.inter_source})")
