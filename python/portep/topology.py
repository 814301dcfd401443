"""Where each rank of an engine's group sits: nodes of `ranks_per_node` consecutive ranks (rank r is on node
r // ranks_per_node). Shared by the host and CUDA engines."""

import os
import socket
from typing import List, Optional, Tuple

from .bootstrap import all_gather_objects, group_rank_and_size


def host_key() -> str:
    """This host as its ranks see it: the host name and the kernel's boot id (ranks in containers with host names of
    their own count as hosts of their own, which only lowers the cores each is given)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def affinity_cpus() -> List[int]:
    """The CPUs this process may run on (its affinity mask, which containers and launchers narrow)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(max(1, os.cpu_count() or 1)))


def host_masks(group: object) -> List[Tuple[str, List[int]]]:
    """Every rank's (host key, affinity CPUs), by rank (collective)."""
    return [(key, list(cpus)) for key, cpus in all_gather_objects((host_key(), affinity_cpus()), group)]


class Topology:
    """Nodes of `ranks_per_node` consecutive ranks of `group` (a torch.distributed group or an mpi4py
    communicator)."""

    def __init__(self, group: object, ranks_per_node: int, max_local_experts: int) -> None:
        self.group = group
        self.rank, self.num_ranks = group_rank_and_size(group, "an engine")
        if ranks_per_node < 1 or self.num_ranks % ranks_per_node:
            raise ValueError(f"num_ranks_per_node={ranks_per_node} must divide the group size {self.num_ranks}")
        self.ranks_per_node = ranks_per_node
        self.num_nodes = self.num_ranks // ranks_per_node
        self.max_local_experts = max_local_experts

    def node_of(self, r: int) -> int:
        """The node of rank r."""
        return r // self.ranks_per_node

    def local_of(self, r: int) -> int:
        """Rank r's index within its node."""
        return r % self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.node_of(self.rank)

    def node_ranks(self, node: Optional[int] = None) -> range:
        """The ranks of `node` (default: this rank's)."""
        node = self.node if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def forwarder(self, node: int, local_index: Optional[int] = None) -> int:
        """The rank of `node` that relays HT traffic from ranks with this local index."""
        local_index = self.local_of(self.rank) if local_index is None else local_index
        return node * self.ranks_per_node + local_index
