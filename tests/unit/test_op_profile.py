"""The benchmark's per-operation profile (portep_bench.op_profile) on the CPU: every aten operation of one call
counted with its calls, the largest first, and a total that sums them."""

import torch

from portep_bench.op_profile import op_table, op_times


def _work(a, b):
    for _ in range(3):
        a @ b
    a.add(1.0)


def test_op_times_counts_each_operation_of_one_call():
    a = torch.randn(256, 256)
    rows = op_times(lambda: _work(a, a), "cpu")
    by_name = {name: (dev, cpu, calls) for name, dev, cpu, calls in rows}
    assert by_name["aten::mm"][2] == 3 and by_name["aten::add"][2] == 1
    assert rows[-1][0] == "all operations"
    body = rows[:-1]
    assert [r[1] for r in body] == sorted((r[1] for r in body), reverse=True)
    assert abs(rows[-1][1] - sum(r[1] for r in body)) < 1e-6 and rows[-1][3] == sum(r[3] for r in body)
    assert by_name["aten::mm"][0] > 0


def test_op_table_has_the_top_operations_and_the_total_per_call():
    a = torch.randn(128, 128)
    t = op_table("t", [("first", lambda: _work(a, a)), ("second", lambda: a.sum())], "cpu", top=2)
    labels = [r.what for r in t.rows]
    assert labels[0].startswith("first: aten::") and "first: all operations" in labels
    assert labels.index("first: all operations") == 2 and labels[-1] == "second: all operations"
    assert "second: aten::sum" in labels
    assert {r.extra["calls"] for r in t.rows if r.what == "first: aten::mm"} == {"3"}
