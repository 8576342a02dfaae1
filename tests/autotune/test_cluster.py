"""Which link a mesh dimension's groups cross: inside a node when the group and the dimensions inside it fit
the node's GPUs, over the network otherwise."""

import pytest

from schedlang.autotune.cluster import NETWORK, NVLINK, spans_nodes
from schedlang.autotune.training_cost import Hardware, Layout


@pytest.mark.parametrize("sizes, dim, per_node, crosses", [
    ({"dp_shard": 8, "tp": 8}, "tp", 8, False),
    ({"dp_shard": 8, "tp": 8}, "dp_shard", 8, True),
    ({"dp_shard": 4, "tp": 2}, "dp_shard", 8, False),   # 2 x 4 = one node
    ({"dp_shard": 8, "tp": 2}, "dp_shard", 8, True),    # 16 ranks: two nodes
    ({"dp_replicate": 4, "dp_shard": 4, "tp": 2}, "dp_shard", 8, False),
    ({"dp_replicate": 4, "dp_shard": 4, "tp": 2}, "dp_replicate", 8, True),
    ({"pp": 8, "dp_shard": 1, "tp": 8}, "pp", 8, True),
    ({"pp": 1, "dp_shard": 64, "tp": 1}, "pp", 8, False),  # a dimension of size 1 has no group to cross anything
    ({"dp_shard": 3, "tp": 3}, "dp_shard", 4, True),     # 9 ranks on nodes of 4 (not a power of two)
])
def test_a_group_spans_nodes_when_its_span_exceeds_a_node(sizes, dim, per_node, crosses):
    assert spans_nodes(sizes, dim, per_node) is crosses


def test_an_unknown_dimension_is_refused():
    with pytest.raises(ValueError, match="unknown mesh dimension 'ep': valid are pp, dp_replicate, dp_shard, cp, tp"):
        spans_nodes({"tp": 2}, "ep", 8)


def test_hardware_gives_each_dimension_its_link():
    hw = Hardware.nominal("cuda", "NVIDIA H100", world=64, intra_gbps=400, inter_gbps=40)
    assert (hw.nodes, hw.gpus_per_node) == (8, 8)
    sizes = Layout(dp=8, tp=8).mesh_sizes()
    assert hw.link(sizes, "tp") == (NVLINK, 400e9)
    assert hw.link(sizes, "dp_shard") == (NETWORK, 40e9)
    # the nominal cluster: NVLink 4 per direction, one 400 Gb/s port per GPU; --link-gbps's alias sets both
    nominal = Hardware.nominal("cuda", world=64)
    assert (nominal.link_bytes_per_s, nominal.network_bytes_per_s) == (450e9, 50e9)
    assert nominal.link_source == nominal.inter_source == "nominal"
    both = Hardware.nominal("cuda", world=64, link_gbps=100)
    assert (both.link_bytes_per_s, both.network_bytes_per_s, both.link_source) == (100e9, 100e9, "given")


def test_a_measured_link_is_the_network_when_the_ranks_span_nodes():
    one_node = Hardware.nominal("cuda", world=8).with_link(300e9, "measured")
    two_nodes = Hardware.nominal("cuda", world=16).with_link(30e9, "measured")
    assert (one_node.link_bytes_per_s, one_node.link_source, one_node.network_bytes_per_s) == (300e9, "measured", 50e9)
    assert (two_nodes.network_bytes_per_s, two_nodes.inter_source, two_nodes.link_bytes_per_s) == (
        30e9, "measured", 450e9)
