"""The one-process internode benchmark (portep_bench.ht_nodes_loopback, `python -m portep_bench gpu-ht-nodes`) on the
host backend: 2 simulated nodes x 2 ranks (and 3 x 2) as threads of this process over both shm transports, every output
checked against the senders' rows by the benchmark itself; its checks fail on outputs a bug would produce; the threads'
communicator (portep_bench.thread_comm) gathers in rank order every round and breaks instead of hanging."""

import threading
import time

import pytest
import torch

from portep_bench import ht_nodes_loopback as nodes
from portep_bench.report import Progress, Report
from portep_bench.thread_comm import ThreadGroup, on_all_ranks

SHAPE = dict(tokens=96, hidden=256, topk=4, experts=16)
R = 4  # the default: 2 nodes x 2 ranks


def _report():
    return Report("test", ["gpu-ht-nodes"], Progress())


@pytest.mark.parametrize(
    "transport, num_nodes", [("shm", 2), ("shm-unordered", 2), ("shm", 3)], ids=["shm", "shm-unordered", "shm-3-nodes"]
)
def test_benchmark_runs_checked_on_the_host_backend(transport, num_nodes):
    report = _report()
    shape = dict(SHAPE, experts=24) if num_nodes == 3 else SHAPE  # experts a multiple of the 6 ranks
    nodes.run(report, sms_list=(4, 8), iterations=2, backend="host", transport=transport, nodes=num_nodes, **shape)
    assert [t.title.split(",")[:2] for t in report.tables] == [
        ["gpu-ht-nodes: 4 SMs per rank", f" {num_nodes} nodes x 2 ranks"],
        ["gpu-ht-nodes: 8 SMs per rank", f" {num_nodes} nodes x 2 ranks"],
    ]
    E, ranks = shape["experts"], 2 * num_nodes
    inputs = [nodes.rank_inputs(r, 96, 256, 4, E, "cpu") for r in range(ranks)]
    per_rank = E // ranks
    want_rows = sum(int((i[1] // per_rank == 0).any(1).sum()) for i in inputs)  # every rank's tokens to rank 0
    for table in report.tables:
        assert f"rank 0 receives {want_rows} rows" in table.title
        assert [r.what for r in table.rows] == ["dispatch BF16 (cached)", "dispatch FP8 (cached)", "combine"]
        for row in table.rows:
            assert len(row.samples) == 2 and min(row.samples) > 0
            assert float(row.extra["RDMA GB/s"]) >= 0 and float(row.extra["NVL GB/s"]) >= 0


def test_bytes_are_counted_as_deepep_test_internode_counts_them():
    H, E = 128, 16
    idx = torch.tensor([[0, 1], [0, 9], [8, 15], [3, 4], [12, 13], [1, 2], [9, 10], [0, 15]])
    inputs = [(None, idx)]
    # nodes of 8 experts each: tokens 0, 3, 5 go to node 0 only; 2, 4, 6 to node 1 only; 1 and 7 to both
    rdma, nvl = nodes.deepep_bytes(inputs, recv_rows=11, H=H, E=E, nodes=2)
    assert rdma == (3 + 3 + 2 * 2) * H * 2 and nvl == 11 * H * 2
    # 3 nodes of 8 experts (E = 24): token 0 -> node 0; 1 -> 0, 1; 2 -> 1, 2; 3 -> 2; 4 -> 0, 2; 5 -> 0, 1, 2
    idx = torch.tensor([[0, 7], [0, 9], [8, 23], [16, 17], [1, 20], [2, 10]])
    rdma, nvl = nodes.deepep_bytes([(None, idx)], recv_rows=5, H=H, E=24, nodes=3)
    assert rdma == (1 + 2 + 2 + 1 + 2 + 2) * H * 2 and nvl == 5 * H * 2


def test_the_node_count_is_checked():
    with pytest.raises(ValueError, match="nodes=1"):
        nodes.run(_report(), sms_list=(4,), iterations=1, backend="host", nodes=1, **SHAPE)
    with pytest.raises(ValueError, match="experts=16 must be a multiple of the 6 ranks"):
        nodes.run(_report(), sms_list=(4,), iterations=1, backend="host", nodes=3, **SHAPE)


def _dispatched():
    N = 32
    inputs = [nodes.rank_inputs(r, N, 128, 2, 8, "cpu") for r in range(R)]
    in_rank = []
    for i in inputs:
        m = torch.zeros(N, R, dtype=torch.bool)
        m.scatter_(1, i[1] // 2, True)
        in_rank.append(m)
    recvs = []
    for d in range(R):
        rows = [inputs[s][0][in_rank[s][:, d]] for s in reversed(range(R))]  # any order the kernels pick
        recvs.append(torch.cat(rows))
    return N, inputs, in_rank, recvs


def test_dispatch_check_takes_any_order_and_fails_on_a_wrong_row():
    N, inputs, in_rank, recvs = _dispatched()
    order = nodes.check_dispatch(recvs, inputs, in_rank, N)
    for d, (src, tok) in enumerate(order):
        assert torch.equal(torch.stack([inputs[s][0][t] for s, t in zip(src.tolist(), tok.tolist())]), recvs[d])
    bad = [r.clone() for r in recvs]
    bad[2][1, 7] += 1  # one value of one row
    with pytest.raises(AssertionError, match="rank 2: received rows differ"):
        nodes.check_dispatch(bad, inputs, in_rank, N)
    bad = [r.clone() for r in recvs]
    bad[1] = bad[1][1:]  # a row missing
    with pytest.raises(AssertionError, match="rank 1: received"):
        nodes.check_dispatch(bad, inputs, in_rank, N)
    bad = [r.clone() for r in recvs]
    bad[3][0] = bad[3][1]  # a row twice, another missing
    with pytest.raises(AssertionError, match="rank 3: received"):
        nodes.check_dispatch(bad, inputs, in_rank, N)


def test_fp8_and_combine_checks_fail_on_wrong_outputs():
    N, inputs, in_rank, recvs = _dispatched()
    order = nodes.check_dispatch(recvs, inputs, in_rank, N)
    fp8 = [
        (
            torch.stack([inputs[s][3][t] for s, t in zip(*map(torch.Tensor.tolist, o))]),
            torch.stack([inputs[s][4][t] for s, t in zip(*map(torch.Tensor.tolist, o))]),
        )
        for o in order
    ]
    nodes.check_fp8(fp8, order, inputs)
    wrong = [(f.clone(), s.clone()) for f, s in fp8]
    wrong[0][1][0, 0] *= 2
    with pytest.raises(AssertionError, match="rank 0: FP8"):
        nodes.check_fp8(wrong, order, inputs)
    outs = [(i[0].float() * m.sum(1, keepdim=True)).to(torch.bfloat16) for i, m in zip(inputs, in_rank)]
    nodes.check_combine(outs, inputs, in_rank)
    outs[3] = outs[3].clone()
    outs[3][5, 3] = -outs[3][5, 3] - 1
    with pytest.raises(AssertionError, match="rank 3: combined"):
        nodes.check_combine(outs, inputs, in_rank)


def test_thread_comm_gathers_in_rank_order_every_round():
    group = ThreadGroup(3, timeout_s=30)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        got = on_all_ranks(pool, lambda r: [group.comm(r).allgather((r, k)) for k in range(50)], 3)
    for r in range(3):
        assert got[r] == [[(0, k), (1, k), (2, k)] for k in range(50)]
    comm = group.comm(1)
    assert (comm.Get_rank(), comm.Get_size()) == (1, 3)
    with pytest.raises(ValueError, match="rank=3"):
        group.comm(3)


def test_thread_comm_breaks_when_a_rank_never_comes():
    group = ThreadGroup(2, timeout_s=0.5)
    errors = []

    def lone():
        try:
            group.comm(0).allgather("x")
        except threading.BrokenBarrierError as e:
            errors.append(e)

    t = threading.Thread(target=lone)
    t.start()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1


def test_a_failing_rank_ends_the_others_exchanges_and_its_error_is_raised():
    from concurrent.futures import ThreadPoolExecutor

    group = ThreadGroup(3, timeout_s=60)

    def body(r):
        if r == 1:
            raise RuntimeError("rank 1 failed")
        return group.comm(r).allgather(r)  # waits for rank 1, which never comes

    with ThreadPoolExecutor(3) as pool:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 failed"):
            on_all_ranks(pool, body, 3, group)
        assert time.monotonic() - t0 < 10  # not the 60 s timeout


class _Event:
    """A CUDA event's query(): complete after `polls` queries (never, with None)."""

    def __init__(self, polls):
        self.polls, self.queries = polls, 0

    def query(self):
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


def test_the_wait_for_the_ranks_work_is_bounded():
    done = [_Event(0), _Event(3)]
    nodes.wait_events(done, 5.0, "combine, call 1 of 3")
    assert [e.queries for e in done] == [1, 4]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"dispatch BF16, call 2 of 23 has not ended after timeout_s=0.05 s"):
        nodes.wait_events([_Event(0), _Event(None)], 0.05, "dispatch BF16, call 2 of 23")
    assert time.monotonic() - t0 < 2.0
