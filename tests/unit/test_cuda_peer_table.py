"""The kernels' peer tables come from the native Channel, never from addresses in Python: `cuda_peer_table` writes
the regions the Channel mapped, `peer_mapped` says which are, HTKernels fills its own table from the Channel, and a
Channel's region reaches torch as a lease. Without a GPU: a one-rank shm Channel over emulated device memory (host
memory standing in for the GPU's), and stand-in tensors that reach the copy to the device, which the CUDA runtime
then refuses."""

import pytest
import torch

from portep import native

from native_channel import native_channel
from test_cuda_binding_args import _gpu, _ht_kernel_memory, _ht_layout

pytestmark = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or torch.cuda.is_available(),
    reason="needs portep's GPU kernels compiled in, and no GPU (the stand-ins' host memory must never be copied to)",
)

EMULATED_GPU = -2  # transport/transport_factory.h kEmulatedDevice: the data region is host memory standing in


@pytest.fixture
def channel():
    ch = native_channel(nbytes=1 << 22, num_streams=4, device=EMULATED_GPU)
    ch.connect([ch.endpoint_blob()])
    ch.bootstrap_done()
    yield ch
    ch.destroy()


def test_the_channel_maps_its_own_region_and_says_so(channel):
    assert channel.peer_mapped(0)
    lease = channel.device_data_lease()
    assert lease.nbytes >= 1 << 22
    cai = lease.__cuda_array_interface__
    assert cai["shape"] == (lease.nbytes,) and cai["typestr"] == "|u1" and cai["version"] == 3
    assert cai["data"][0] == lease.address and cai["data"][1] is False


def test_the_peer_table_reaches_the_copy_to_the_device(channel):
    with pytest.raises(RuntimeError, match="cuda_peer_table: "):
        native.cuda_peer_table(channel, [0], _gpu(1, dtype=torch.int64))


@pytest.mark.parametrize(
    "ranks,table,message",
    [
        ([1], _gpu(1, dtype=torch.int64), r"rank 1 is not in \[0, 1\)"),
        ([0], _gpu(1, dtype=torch.int32), "table: dtype torch.int32"),
        ([0], torch.zeros(1, dtype=torch.int64), "table: a tensor on cuda is needed"),
    ],
)
def test_the_peer_table_refuses_by_name(channel, ranks, table, message):
    with pytest.raises(ValueError, match=message):
        native.cuda_peer_table(channel, ranks, table)


def test_ht_kernels_with_a_channel_write_their_own_peer_table(channel):
    memory = {**_ht_kernel_memory(1), "region": None, "signals": None, "rank": 0}
    with pytest.raises(RuntimeError, match="the normal mode on GPU tensors: "):
        native.HTKernels(_ht_layout(1, 1), None, channel=channel, **memory)


def test_ht_kernels_take_the_channel_or_a_region_not_both(channel):
    memory = {**_ht_kernel_memory(1), "rank": 0}
    with pytest.raises(ValueError, match="region, signals: None with a channel"):
        native.HTKernels(_ht_layout(1, 1), None, channel=channel, **memory)


def test_ht_kernels_refuse_a_channel_region_shorter_than_the_layout(channel):
    memory = {**_ht_kernel_memory(1), "region": None, "signals": None, "rank": 0}
    long = native.HTLayout(num_ranks=1, ranks_per_node=1, proxy=False, ctrl_off=1 << 23, area_off=0, area_bytes=1 << 16)
    with pytest.raises(ValueError, match="channel: its region has .* bytes; the layout ends at"):
        native.HTKernels(long, None, channel=channel, **memory)
