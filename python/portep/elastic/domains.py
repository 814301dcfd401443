"""DeepEP V2's domains on portep's topology: the physical domain is (nodes, ranks per node) as portep's engines see
the group (topology.py: nodes of num_ranks_per_node consecutive ranks); the logical one is the pair V2's routing
and reduction order follow."""

from typing import Optional, Tuple

from ..bootstrap import group_rank_and_size
from ..buffer import ranks_per_node


def physical_domain(group: object, num_ranks_per_node: Optional[int] = None) -> Tuple[int, int]:
    """(nodes, ranks per node) of group."""
    _, size = group_rank_and_size(group, "get_physical_domain_size")
    per_node = ranks_per_node(num_ranks_per_node, size)
    return size // per_node, per_node


def logical_domain(physical: Tuple[int, int], allow_hybrid_mode: bool) -> Tuple[int, int]:
    """(scale-out ranks, scale-up ranks): physical with allow_hybrid_mode, else one scale-up domain of all ranks."""
    nodes, per_node = physical
    return (nodes, per_node) if allow_hybrid_mode else (1, nodes * per_node)
