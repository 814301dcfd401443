"""The tests spawn ranks with the same helper as the benchmarks."""

from portep_bench.spawn import RankFailure, free_port, one_rank_group, run_ranks  # noqa: F401
